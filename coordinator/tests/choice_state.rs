//! The sans-IO core of a choice against a naive reference: the text released over a whole
//! stream is `decode(prompt + tokens)` minus the prompt's text, truncated before the first
//! stop string, for any token sequence and any stop strings.

mod common;

use cleave_coordinator::generate::ChoiceState;
use cleave_coordinator::{CoordinatorError, DispatchEvent, ModelInfo};
use cleave_protocol::{FinishReason, RequestId, TokenEvent};
use cleave_tokenizer::IncrementalDecoder;
use common::*;
use proptest::prelude::*;

static MODEL: std::sync::OnceLock<ModelInfo> = std::sync::OnceLock::new();

fn token(id: Option<u32>, finish: Option<FinishReason>) -> DispatchEvent {
    DispatchEvent::Token(TokenEvent {
        request_id: RequestId(1),
        token_id: id,
        text: String::new(),
        logprobs: None,
        finish_reason: finish,
        prompt_tokens: 1,
        cached_tokens: 0,
        completion_tokens: 0,
        error: None,
    })
}

/// Runs a whole stream; returns the released text, the finish reason and how many updates
/// carried a finish (must be exactly one).
fn run(model: &ModelInfo, prompt: &[u32], tokens: &[u32], stops: &[String]) -> (String, Option<FinishReason>) {
    let mut st = ChoiceState::new(0, RequestId(1), &model.tokenizer, prompt, stops);
    let mut text = String::new();
    let mut finish = None;
    for (i, &t) in tokens.iter().enumerate() {
        let last = i + 1 == tokens.len();
        let u = st.on_event(token(Some(t), last.then_some(FinishReason::Length))).unwrap();
        assert!(finish.is_none() || (u.text.is_empty() && u.finish.is_none()), "nothing after the finish");
        text.push_str(&u.text);
        if u.finish.is_some() {
            finish = u.finish;
        }
    }
    (text, finish)
}

/// Naive reference. Generation stops as soon as a stop string is complete, so the cut is
/// decided by the first token whose text completes an occurrence (not by the earliest
/// occurrence in the whole text: with stops `["café ", "a"]`, "a" completes first); within
/// the text known at that point, the earliest-starting occurrence wins.
fn reference(model: &ModelInfo, prompt: &[u32], tokens: &[u32], stops: &[String]) -> (String, FinishReason) {
    let full = expected_text(model, prompt, tokens);
    let mut known = String::new();
    let mut dec = IncrementalDecoder::new(model.tokenizer.clone(), prompt);
    let mut pieces: Vec<String> = tokens.iter().map(|&t| dec.push(t).unwrap()).collect();
    pieces.push(dec.finish().unwrap());
    for piece in pieces {
        known.push_str(&piece);
        if let Some(at) = stops.iter().filter(|s| !s.is_empty()).filter_map(|s| known.find(s.as_str())).min() {
            return (known[..at].to_owned(), FinishReason::Stop);
        }
    }
    assert_eq!(known, full, "the pieces concatenate to the incremental text");
    (full, FinishReason::Length)
}

#[test]
fn stop_string_inside_the_last_token_and_router_errors() {
    let m = ModelInfo::from_args(&args()).unwrap();
    let toks = ids(&m, " Hello world");
    let (text, finish) = run(&m, &[1, 22557], &toks, &["orld".to_owned()]);
    assert_eq!(
        (text.as_str(), finish),
        ("  Hello w", Some(FinishReason::Stop)),
        "encode adds a ▁ before the text's own space"
    );

    let mut st = ChoiceState::new(0, RequestId(9), &m.tokenizer, &[1], &[]);
    st.on_event(token(Some(toks[0]), None)).unwrap();
    let err = st.on_event(DispatchEvent::Refused { reason: "gone".into() }).unwrap_err();
    assert!(matches!(err, CoordinatorError::BackendFailed { .. }), "refusal after a token is a failure: {err}");
    let mut st = ChoiceState::new(0, RequestId(9), &m.tokenizer, &[1], &[]);
    let err = st.on_event(DispatchEvent::Refused { reason: "gone".into() }).unwrap_err();
    assert!(matches!(err, CoordinatorError::Unavailable { .. }));
    let mut st = ChoiceState::new(0, RequestId(9), &m.tokenizer, &[1], &[]);
    let err = st.on_event(token(None, Some(FinishReason::Error))).unwrap_err();
    assert!(matches!(err, CoordinatorError::BackendFailed { .. }));

    // A final event without a token releases held-back text.
    let mut st = ChoiceState::new(0, RequestId(9), &m.tokenizer, &[1, 22557], &["Hello!".to_owned()]);
    let a = st.on_event(token(Some(22557), None)).unwrap();
    assert_eq!(a.text, " ", "'Hello' could start the stop string: held back");
    let b = st.on_event(token(None, Some(FinishReason::Stop))).unwrap();
    assert_eq!((b.text.as_str(), b.finish), ("Hello", Some(FinishReason::Stop)));
    assert!(!st.needs_cancel());
}

/// The router's route reaches the first update with a token after it, once; a new route (a
/// migration) reaches the next one.
#[test]
fn the_route_rides_on_the_first_token_after_it() {
    use cleave_coordinator::dispatch::Route;
    let m = ModelInfo::from_args(&args()).unwrap();
    let toks = ids(&m, " Hello world again");
    let route = |path: &'static str, decode: &str| Route {
        path,
        reason: None,
        prefill_node: (path == "remote").then(|| "p0".to_string()),
        decode_node: decode.into(),
        decode_pool: "decode",
    };
    let mut st = ChoiceState::new(0, RequestId(9), &m.tokenizer, &[1], &[]);
    let u = st.on_event(DispatchEvent::Routed(route("remote", "d0"))).unwrap();
    assert!(u.token.is_none() && u.text.is_empty() && u.route.is_none(), "a route alone changes no text");
    let a = st.on_event(token(Some(toks[0]), None)).unwrap();
    assert_eq!(a.route, Some(route("remote", "d0")));
    let b = st.on_event(token(Some(toks[1]), None)).unwrap();
    assert_eq!(b.route, None, "told once");
    st.on_route(route("migrated", "d1"));
    assert_eq!(st.route(), Some(&route("migrated", "d1")));
    let c = st.on_event(token(Some(toks[2]), Some(FinishReason::Length))).unwrap();
    assert_eq!(c.route, Some(route("migrated", "d1")));
    assert_eq!(c.route.unwrap().header_value(), "migrated; decode=d1");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]
    #[test]
    fn released_text_matches_the_reference(
        picks in proptest::collection::vec(0usize..1000, 1..24),
        stop_spans in proptest::collection::vec((0usize..200, 1usize..6), 0..3),
    ) {
        let m = MODEL.get_or_init(|| ModelInfo::from_args(&args()).unwrap());
        // A pool with multi-byte characters (byte-fallback tokens), spaces and EOS.
        let pool: Vec<u32> = ids(m, " Hello world, café 日本語 🙂 END.\n ok").into_iter().chain([2]).collect();
        let tokens: Vec<u32> = picks.iter().map(|p| pool[p % pool.len()]).collect();
        let prompt = [1, 22557];
        let full = expected_text(m, &prompt, &tokens);
        // Stop strings cut from the text itself (so they do occur) or absent ones.
        let stops: Vec<String> = stop_spans
            .iter()
            .map(|&(at, len)| {
                let chars: Vec<char> = full.chars().collect();
                if chars.is_empty() { return "zzz".to_owned(); }
                let start = at % chars.len();
                chars[start..(start + len).min(chars.len())].iter().collect()
            })
            .collect();
        let (text, finish) = run(m, &prompt, &tokens, &stops);
        let (want, want_finish) = reference(m, &prompt, &tokens, &stops);
        prop_assert_eq!(text, want);
        prop_assert_eq!(finish, Some(want_finish));
    }
}
