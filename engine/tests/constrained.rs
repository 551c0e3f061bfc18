//! Constrained decoding in the engine: sampled (not only greedy) output under a JSON Schema, a
//! regex or a choice belongs to its language on every seed tried, with the tiny model
//! (SentencePiece vocabulary) and the real SmolLM2-135M-Instruct (byte-level vocabulary); an
//! unconstrained request beside constrained ones generates what it generates alone; a bad
//! constraint is refused before anything is queued. The handoff and resume cases are in
//! `disagg.rs`.

mod common;

use std::time::Instant;

use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineError, EngineRequest};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::{Constraint, FinishReason, RequestId, SamplingParams, StopConditions};
use cleave_tokenizer::ChatMessage;
use common::*;

type Core = EngineCore<CpuBackend>;

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "maxItems": 3},
    "capital": {"type": "boolean"}
  },
  "required": ["city", "population", "capital"],
  "additionalProperties": false
}"#;

fn config() -> EngineConfig {
    EngineConfig { max_num_seqs: 16, kv_cache_memory: 64 << 20, ..Default::default() }
}

fn request(
    id: u64,
    prompt: Vec<u32>,
    constraint: Option<Constraint>,
    temperature: f32,
    max_tokens: u32,
) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt,
        params: SamplingParams { temperature, seed: Some(id * 7919), constraint, ..Default::default() },
        stop: StopConditions { max_tokens, ..Default::default() },
    }
}

/// Runs `reqs` batched together; returns each request's text and finish.
fn generate(core: &mut Core, reqs: &[EngineRequest]) -> Vec<(String, FinishReason)> {
    for r in reqs {
        core.add_request(r.clone(), Instant::now()).unwrap();
    }
    let out = run_to_end(core);
    let snap = core.snapshot();
    assert_eq!(snap.kv_blocks_in_use, 0, "{snap:?}");
    reqs.iter()
        .map(|r| {
            let evs = &out[&r.id.0];
            if let Some(e) = evs.iter().find_map(|e| e.error.clone()) {
                panic!("request {} failed: {e}", r.id);
            }
            let text: String = evs.iter().map(|e| e.text.as_str()).collect();
            (text, evs.last().unwrap().finish_reason.unwrap())
        })
        .collect()
}

/// The schema's requests on one engine: every seed's text validates, and finishes with `Stop`.
fn schema_holds(core: &mut Core, prompt: &[u32], seeds: u64, max_tokens: u32) {
    let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let c = Some(Constraint::JsonSchema(SCHEMA.into()));
    let mut reqs: Vec<_> = (1..=seeds).map(|id| request(id, prompt.to_vec(), c.clone(), 1.0, max_tokens)).collect();
    reqs.push(request(100, prompt.to_vec(), c.clone(), 0.0, max_tokens));
    for (r, (text, finish)) in reqs.iter().zip(generate(core, &reqs)) {
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {text:?} is not JSON: {e}", r.id));
        assert!(validator.is_valid(&value), "{}: {text} does not validate", r.id);
        assert_eq!(finish, FinishReason::Stop, "{}: {text}", r.id);
    }
}

#[test]
fn sampled_output_under_a_schema_validates_on_every_seed_with_the_tiny_model() {
    let mut core = engine(&tiny_llama_dir(), config());
    let prompt = core.tokenizer().encode("Describe a city as JSON:", true).unwrap();
    schema_holds(&mut core, &prompt, 12, 400);
}

#[test]
fn regex_choice_and_json_object_hold_and_an_unconstrained_neighbour_is_unchanged() {
    let dir = tiny_llama_dir();
    let mut core = engine(&dir, config());
    let prompt = core.tokenizer().encode("Answer:", true).unwrap();
    let free = request(50, prompt.clone(), None, 0.9, 24);
    let alone = generate(&mut engine(&dir, config()), std::slice::from_ref(&free));
    let choices = vec!["red".to_string(), "green".into(), "blue-ish (2)".into()];
    let mut reqs = vec![free];
    for id in 1..=6 {
        reqs.push(request(id, prompt.clone(), Some(Constraint::Regex(r"[A-Z][a-z]{1,6} [0-9]{2}".into())), 1.0, 60));
        reqs.push(request(10 + id, prompt.clone(), Some(Constraint::Choice(choices.clone())), 1.0, 60));
        reqs.push(request(20 + id, prompt.clone(), Some(Constraint::JsonObject), 1.0, 60));
    }
    let got = generate(&mut core, &reqs);
    assert_eq!(got[0], alone[0], "an unconstrained request is not affected by constrained neighbours");
    for (r, (text, finish)) in reqs.iter().zip(&got).skip(1) {
        match r.params.constraint.as_ref().unwrap() {
            Constraint::Regex(_) => {
                let b = text.as_bytes();
                assert!(
                    b.len() >= 5
                        && b[0].is_ascii_uppercase()
                        && b[b.len() - 3] == b' '
                        && b[b.len() - 2..].iter().all(u8::is_ascii_digit)
                        && b[1..b.len() - 3].iter().all(u8::is_ascii_lowercase),
                    "{}: {text:?}",
                    r.id
                );
                assert_eq!(*finish, FinishReason::Stop);
            }
            Constraint::Choice(c) => {
                assert!(c.contains(text), "{}: {text:?}", r.id);
                assert_eq!(*finish, FinishReason::Stop);
            }
            _ => {
                // An object with nothing bounding it may run into max_tokens: then what came
                // out is a prefix of one; when it stopped, a whole one.
                assert!(text.trim_start().starts_with('{'), "{}: {text:?}", r.id);
                if *finish == FinishReason::Stop {
                    let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                    assert!(v.is_object());
                }
            }
        }
    }
}

/// The compiler (17 MB of tries for SmolLM2) is built for the first constrained request, not at
/// load nor for an unconstrained one, and then kept.
#[test]
fn the_constraint_compiler_is_built_for_the_first_constrained_request() {
    let mut core = engine(&tiny_llama_dir(), config());
    let compiler = core.constraint_compiler();
    assert!(!compiler.is_built(), "built at load");
    let prompt = core.tokenizer().encode("Answer:", true).unwrap();
    generate(&mut core, &[request(1, prompt.clone(), None, 0.0, 4)]);
    assert!(!compiler.is_built(), "built for an unconstrained request");
    let out = generate(&mut core, &[request(2, prompt, Some(Constraint::JsonObject), 0.0, 8)]);
    assert!(compiler.is_built());
    assert!(out[0].0.trim_start().starts_with('{'), "{out:?}");
}

#[test]
fn a_bad_constraint_is_refused_before_anything_is_queued() {
    let mut core = engine(&tiny_llama_dir(), config());
    let req = request(1, vec![1, 5, 9], Some(Constraint::JsonSchema(r#"{"type": 7}"#.into())), 0.0, 10);
    let err = core.add_request(req, Instant::now()).unwrap_err();
    assert!(matches!(err, EngineError::Constraint(_)), "{err}");
    assert!(!core.has_work());
    let req = request(2, vec![1, 5, 9], Some(Constraint::Choice(vec![])), 0.0, 10);
    let err = core.add_request(req, Instant::now()).unwrap_err();
    assert!(err.to_string().contains("choice list is empty"), "{err}");
}

#[test]
fn smollm2_answers_in_the_schema_and_picks_the_right_choice() {
    let Some(path) = smollm2() else { return };
    let files = ModelFiles::open(&path).unwrap();
    let mut core = EngineCore::load(CpuBackend::default(), files, &config()).unwrap();
    let chat = |q: &str| {
        let text = core.tokenizer().render_chat(&[ChatMessage::user(q)], true).unwrap();
        core.tokenizer().encode(&text, false).unwrap()
    };
    let json_prompt = chat("Describe Paris as a JSON object with keys city, population, tags and capital.");
    let choice_prompt = chat("What is the capital of France?");
    schema_holds(&mut core, &json_prompt, 6, 200);
    // Whole sentences: a bare city name would be decided on its first token ("L" may outscore
    // "Par" before the model has said anything); after the forced shared words the model picks
    // the city where it knows it.
    let choices: Vec<String> =
        ["London", "Paris", "Berlin", "Madrid"].iter().map(|c| format!("The capital of France is {c}.")).collect();
    let got = generate(&mut core, &[request(1, choice_prompt, Some(Constraint::Choice(choices)), 0.0, 20)]);
    assert_eq!(got[0], ("The capital of France is Paris.".to_string(), FinishReason::Stop));
}
