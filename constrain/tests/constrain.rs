//! The constraint layer against the tiny model's real tokenizer (SentencePiece with byte
//! fallback; the byte-level SmolLM2 vocabulary is covered in the engine's tests): the vocabulary
//! spells what the tokenizer decodes, a random walk through every mask yields text that
//! belongs to the language, and bad constraints are refused with what is wrong.

mod common;

use cleave_constrain::{Compiler, ConstrainError, Mask};
use cleave_protocol::Constraint;
use cleave_tokenizer::Tokenizer;
use common::{random_walk, tokenizer, EOS};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn compiler() -> Compiler {
    let tok = tokenizer();
    Compiler::new(&tok, tok.vocab_size(), &[EOS]).unwrap()
}

#[test]
fn the_trie_spells_every_token_as_the_tokenizer_decodes_it() {
    let tok = tokenizer();
    let trie = cleave_constrain::token_trie(&tok, tok.vocab_size(), &[EOS]).unwrap();
    for text in ["Hello, world!", "{\"a\": [1, 2.5e-3]}", "naïve café — 東京 🚀", "  two  spaces\n\ttab"] {
        let ids = tok.encode(text, false).unwrap();
        let bytes = trie.decode(&ids);
        // SentencePiece prepends a space (the normaliser's `▁`) that its decoder strips again.
        assert_eq!(String::from_utf8(bytes).unwrap(), format!(" {text}"), "{ids:?}");
    }
    assert!(trie.is_special_token(EOS));
    assert!(trie.is_special_token(1));
}

#[test]
fn an_added_token_not_marked_special_spells_its_text_for_the_grammar() {
    let base = tokenizer();
    let mut hf = base.hf().unwrap().clone();
    hf.add_tokens(&[tokenizers::AddedToken::from("<tool_call>", false)]);
    let tok = Tokenizer::from_hf(hf, base.config().clone());
    let id = tok.token_to_id("<tool_call>").unwrap();
    let compiler = Compiler::new(&tok, tok.vocab_size(), &[EOS]).unwrap();
    let mut state = compiler.start(&Constraint::Lark(r#"start: "<tool_call>" "x""#.into()), &[]).unwrap();
    let mut mask = Mask::default();
    state.fill_mask(&mut mask).unwrap();
    assert!(mask.allows(id), "the added token is the grammar's literal");
    state.commit(id).unwrap();
    assert_eq!(tok.decode(&[id], false).unwrap(), "<tool_call>", "the detokenizer writes it out as text");
}

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "age", "ok"],
  "additionalProperties": false
}"#;

#[test]
fn random_walks_through_a_schema_s_masks_give_json_the_schema_accepts() {
    let tok = tokenizer();
    let compiler = compiler();
    let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let c = Constraint::JsonSchema(SCHEMA.into());
    for seed in 0..20 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut state = compiler.start(&c, &[]).unwrap();
        let ids = random_walk(&mut state, &mut rng, 400);
        let text = tok.decode(&ids, false).unwrap();
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        assert!(validator.is_valid(&value), "seed {seed}: {text} does not validate");
    }
}

#[test]
fn json_object_regex_and_choice_hold_on_random_walks() {
    let tok = tokenizer();
    let compiler = compiler();
    let rx = regex_lite(r"^[0-9]{3}-[a-z]{2,4}$");
    for seed in 0..10 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut state = compiler.start(&Constraint::Regex("[0-9]{3}-[a-z]{2,4}".into()), &[]).unwrap();
        let text = tok.decode(&random_walk(&mut state, &mut rng, 100), false).unwrap();
        assert!(rx(&text), "seed {seed}: {text:?}");

        let choices = vec!["Paris".to_string(), "Lyon".into(), "Saint-Étienne (42)".into()];
        let mut state = compiler.start(&Constraint::Choice(choices.clone()), &[]).unwrap();
        let text = tok.decode(&random_walk(&mut state, &mut rng, 100), false).unwrap();
        assert!(choices.contains(&text), "seed {seed}: {text:?}");
    }
    // A JSON object with nothing to bound it: walk until done or stop at a cap, and check the
    // mask never allowed anything but a prefix of an object.
    let mut state = compiler.start(&Constraint::JsonObject, &[]).unwrap();
    let mut mask = Mask::default();
    state.fill_mask(&mut mask).unwrap();
    let first: Vec<u32> = (0..32000u32).filter(|&t| mask.allows(t)).collect();
    for t in first {
        let s = tok.decode(&[t], false).unwrap();
        assert!(s.trim_start().starts_with('{'), "token {t} ({s:?}) may start a JSON object?");
    }
}

/// `^...$` with the few constructs used above, so the test needs no regex crate of its own.
fn regex_lite(_: &str) -> impl Fn(&str) -> bool {
    |s: &str| {
        let (d, rest) = s.split_at(s.find('-').unwrap_or(0));
        d.len() == 3
            && d.bytes().all(|b| b.is_ascii_digit())
            && rest.len() >= 3
            && rest.len() <= 5
            && rest[1..].bytes().all(|b| b.is_ascii_lowercase())
    }
}

#[test]
fn a_replayed_history_reaches_the_same_state_as_stepping() {
    let compiler = compiler();
    let c = Constraint::JsonSchema(SCHEMA.into());
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut stepped = compiler.start(&c, &[]).unwrap();
    let ids = random_walk(&mut stepped.clone(), &mut rng, 400);
    for cut in [0, 1, ids.len() / 2, ids.len()] {
        let mut a = compiler.start(&c, &ids[..cut]).unwrap();
        let mut b = compiler.start(&c, &[]).unwrap();
        for &t in &ids[..cut] {
            b.commit(t).unwrap();
        }
        let (mut ma, mut mb) = (Mask::default(), Mask::default());
        a.fill_mask(&mut ma).unwrap();
        b.fill_mask(&mut mb).unwrap();
        assert_eq!(ma.count(), mb.count());
        assert!((0..32000).all(|t| ma.allows(t) == mb.allows(t)));
    }
    let _ = stepped.fill_mask(&mut Mask::default());
    // A history outside the language is refused, naming the token.
    let bad = tokenizer().encode("not json", false).unwrap();
    let err = compiler.start(&c, &bad).unwrap_err();
    assert!(matches!(err, ConstrainError::Rejected { token, .. } if token == bad[0]), "{err}");
}

#[test]
fn json_whitespace_runs_are_bounded() {
    let tok = tokenizer();
    let compiler = compiler();
    let ok = format!("{{\n{}\"a\":1}}", " ".repeat(cleave_constrain::JSON_MAX_WHITESPACE - 1));
    let too_long = format!("{{\n{}\"a\":1}}", " ".repeat(cleave_constrain::JSON_MAX_WHITESPACE));
    for c in [Constraint::JsonObject, Constraint::JsonSchema(r#"{"type": "object"}"#.into())] {
        // The trie's own tokenisation: SentencePiece's encode would prepend a space.
        let trie = cleave_constrain::token_trie(&tok, tok.vocab_size(), &[EOS]).unwrap();
        let ids = |s: &str| trie.greedy_tokenize(s.as_bytes());
        let mut state = compiler.start(&c, &ids(&ok)).unwrap();
        assert!(
            state.is_done() || {
                let mut m = Mask::default();
                state.fill_mask(&mut m).is_ok() && m.allows(EOS)
            }
        );
        let err = compiler.start(&c, &ids(&too_long)).unwrap_err();
        assert!(matches!(err, ConstrainError::Rejected { .. }), "{err}");
    }
}

#[test]
fn bad_constraints_are_refused_with_what_is_wrong() {
    let compiler = compiler();
    let cases = [
        (Constraint::JsonSchema("{not json".into()), "not JSON"),
        (Constraint::JsonSchema("[1, 2]".into()), "object or a boolean"),
        (Constraint::JsonSchema(r#"{"type": "frobnicate"}"#.into()), "frobnicate"),
        (Constraint::Regex("a(b".into()), ""),
        (Constraint::Lark("start: undefined_rule".into()), "undefined_rule"),
    ];
    for (c, needle) in cases {
        let err = compiler.check(&c).unwrap_err();
        assert!(matches!(err, ConstrainError::Invalid { .. }), "{c:?}: {err}");
        assert!(err.to_string().contains(needle), "{c:?}: {err}");
    }
    for ok in [Constraint::JsonObject, Constraint::Regex("a+".into()), Constraint::Lark("start: \"x\" | \"y\"".into())]
    {
        compiler.check(&ok).unwrap();
    }
}

#[test]
fn a_mask_sets_disallowed_logits_and_the_padding_past_the_vocabulary_to_minus_infinity() {
    let compiler = compiler();
    let mut state = compiler.start(&Constraint::Choice(vec!["yes".into(), "no".into()]), &[]).unwrap();
    let mut mask = Mask::default();
    state.fill_mask(&mut mask).unwrap();
    let mut logits = vec![1.0f32; 32000 + 40];
    mask.apply(&mut logits);
    let kept: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] == 1.0).collect();
    assert_eq!(kept.len(), mask.count());
    assert!(kept.iter().all(|&t| t < 32000 && mask.allows(t as u32)));
    assert!(logits[32000..].iter().all(|&l| l == f32::NEG_INFINITY));
    // No mask (an unconstrained sequence) leaves the row alone.
    let mut row = vec![0.5f32; 10];
    Mask::default().apply(&mut row);
    assert!(row.iter().all(|&l| l == 0.5));
}
