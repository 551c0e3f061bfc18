//! The tool-call grammars against the tiny model's real tokenizer: a random walk through the
//! masks of a forced call (a named function, or `required`) gives text that the tool-call
//! parser reads back as calls to the allowed functions, with arguments the function's schema
//! accepts; a call the grammar does not allow is refused.

mod common;

use cleave_constrain::tools::{call_grammar, Collected, Forced, ToolFormat, ToolSpec};
use cleave_constrain::{Compiler, ConstraintState, Mask};
use common::{random_walk, tokenizer, EOS};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::json;

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Lyon", "東京"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "unit": {"$ref": "#/$defs/unit"}
                },
                "required": ["city", "days"],
                "additionalProperties": false,
                "$defs": {"unit": {"enum": ["C", "F"]}}
            }),
        },
        ToolSpec {
            name: "set-alarm_2".into(),
            parameters: json!({
                "type": "object",
                "properties": {"on": {"type": "boolean"}, "label": {"type": "string", "maxLength": 5}},
                "required": ["on"],
                "additionalProperties": false
            }),
        },
    ]
}

#[test]
fn random_walks_through_forced_calls_parse_to_valid_calls() {
    let tok = tokenizer();
    let compiler = Compiler::new(&tok, tok.vocab_size(), &[EOS]).unwrap();
    let tools = tools();
    let validators: Vec<_> = tools.iter().map(|t| jsonschema::validator_for(&t.parameters).unwrap()).collect();
    let cases = [
        (Forced::Named("set-alarm_2"), 1..=1),
        (Forced::Required { parallel: false }, 1..=1),
        (Forced::Required { parallel: true }, 1..=usize::MAX),
    ];
    for format in [ToolFormat::Hermes, ToolFormat::Llama3Json] {
        for (forced, count) in cases.clone() {
            let grammar = call_grammar(format, &tools, forced);
            compiler.check(&grammar).unwrap_or_else(|e| panic!("{grammar:?}: {e}"));
            for seed in 0..8 {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut state = compiler.start(&grammar, &[]).unwrap();
                let text = tok.decode(&random_walk(&mut state, &mut rng, 600), false).unwrap();
                let got = Collected::parse(format, &text);
                assert_eq!(got.content, "", "{format:?} {forced:?} seed {seed}: {text:?}");
                assert!(count.contains(&got.calls.len()), "{format:?} {forced:?} seed {seed}: {text:?}");
                for (name, args) in &got.calls {
                    let i = tools.iter().position(|t| &t.name == name).unwrap_or_else(|| panic!("{name}: {text:?}"));
                    if let Forced::Named(want) = forced {
                        assert_eq!(name, want);
                    }
                    let args: serde_json::Value =
                        serde_json::from_str(args).unwrap_or_else(|e| panic!("{args:?} is not JSON ({e}): {text:?}"));
                    assert!(validators[i].is_valid(&args), "{format:?} seed {seed}: {args} for {name}");
                }
            }
        }
    }
}

#[test]
fn a_forced_call_refuses_other_functions_and_plain_text() {
    let tok = tokenizer();
    let compiler = Compiler::new(&tok, tok.vocab_size(), &[EOS]).unwrap();
    let grammar = call_grammar(ToolFormat::Hermes, &tools(), Forced::Named("get_weather"));
    // Feed text byte by byte through the tokenizer's byte tokens (<0xNN>), so that no
    // tokenization question arises: the grammar sees exactly these bytes.
    let feed = |text: &str| -> Result<ConstraintState, String> {
        let mut state = compiler.start(&grammar, &[]).map_err(|e| e.to_string())?;
        for b in text.bytes() {
            let id = tok.token_to_id(&format!("<0x{b:02X}>")).unwrap();
            state.commit(id).map_err(|e| format!("{e}"))?;
        }
        Ok(state)
    };
    let ok = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\", \"days\": 3}}\n</tool_call>";
    let mut mask = Mask::default();
    feed(ok).unwrap().fill_mask(&mut mask).unwrap();
    assert!(mask.allows(EOS) && mask.count() == 1, "after a whole call only EOS may follow");
    for bad in [
        "<tool_call>\n{\"name\": \"set-alarm_2\"",
        "Sure",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Nice\"",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\", \"days\": 3, \"x\"",
    ] {
        assert!(feed(bad).is_err(), "{bad:?} was allowed");
    }
}
