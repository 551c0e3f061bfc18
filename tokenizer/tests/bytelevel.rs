//! IncrementalDecoder and StopMatcher on a GPT-2-style byte-level tokenizer (the family
//! SmolLM2, Llama 3 and Qwen use), built in code: one token per byte, no merges, plus
//! the special tokens `<|im_start|>`/`<|im_end|>`. Every non-ASCII character is split
//! across tokens, the worst case for streaming.

use std::str::FromStr;

use cleave_tokenizer::{IncrementalDecoder, StopMatcher, Tokenizer, TokenizerConfig};
use serde_json::json;

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to U+0100+.
fn byte_to_char() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~')).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(&chars) {
        table[*b as usize] = char::from_u32(*c).unwrap();
    }
    table
}

fn byte_level_tokenizer() -> Tokenizer {
    let table = byte_to_char();
    let mut vocab = serde_json::Map::new();
    for (b, c) in table.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let spec = json!({
        "version": "1.0",
        "added_tokens": [special(256, "<|im_start|>"), special(257, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                          "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true,
                    "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    let hf = tokenizers::Tokenizer::from_str(&spec.to_string()).unwrap();
    let config = TokenizerConfig { eos_token: Some("<|im_end|>".into()), ..Default::default() };
    Tokenizer::from_hf(hf, config)
}

const TEXT: &str = "héllo 日本語 🎉 naïve\n\tend";

#[test]
fn round_trip_one_byte_per_token() {
    let tok = byte_level_tokenizer();
    let ids = tok.encode(TEXT, false).unwrap();
    assert_eq!(ids.len(), TEXT.len());
    assert_eq!(tok.decode(&ids, true).unwrap(), TEXT);
    assert_eq!(tok.eos_token_id(), Some(257));
}

#[test]
fn streaming_never_emits_partial_characters() {
    let tok = byte_level_tokenizer();
    let ids = tok.encode(TEXT, false).unwrap();
    for split in 0..ids.len() {
        let (prompt, gen) = ids.split_at(split);
        if !TEXT.is_char_boundary(split) {
            continue; // a prompt cut inside a character has no well-defined "rest"
        }
        let mut dec = IncrementalDecoder::new(tok.clone(), prompt);
        let mut out = String::new();
        for &id in gen {
            let piece = dec.push(id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "split {split}: {piece:?}");
            out.push_str(&piece);
        }
        out.push_str(&dec.finish().unwrap());
        assert_eq!(out, TEXT[split..], "split {split}");
    }
}

#[test]
fn streaming_with_special_tokens_and_stop_strings() {
    let tok = byte_level_tokenizer();
    let prompt = [vec![256], tok.encode("assistant\n", false).unwrap()].concat();
    let gen =
        [tok.encode("Voilà: 日本", false).unwrap(), vec![257], tok.encode("語 STOP here", false).unwrap()].concat();
    for (skip, want) in [(true, "Voilà: 日本語 "), (false, "Voilà: 日本<|im_end|>語 ")] {
        let mut dec = IncrementalDecoder::new(tok.clone(), &prompt).with_skip_special_tokens(skip);
        let mut stops = StopMatcher::new(["STOP"]);
        let mut out = String::new();
        for &id in &gen {
            let piece = dec.push(id).unwrap();
            let o = stops.push(&piece);
            assert!(!o.emit.contains('\u{FFFD}'));
            out.push_str(&o.emit);
            if o.stopped {
                break;
            }
        }
        assert!(stops.stopped());
        assert_eq!(out, want, "skip={skip}");
    }
}
