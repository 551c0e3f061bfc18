//! `Tokenizer::for_decoding`: the copy a node keeps decodes exactly as the whole tokenizer does
//! (every id alone, random sequences with out-of-range ids, special tokens skipped or kept,
//! streamed), names the same tokens, and refuses to encode with a clear error. On three
//! families: the repository's tiny Llama (SentencePiece-style, from `tokenizer.json`), and a
//! byte-level BPE and a SentencePiece vocabulary built from GGUF metadata.

use std::path::PathBuf;

use cleave_tokenizer::gguf::{token_type, tokenizer_from_gguf, GgufTokenizerMeta};
use cleave_tokenizer::{IncrementalDecoder, Tokenizer, TokenizerConfig, TokenizerError};

/// Every check of the module docs, `whole` against its decode-only copy.
fn decodes_alike(whole: &Tokenizer) {
    let slim = whole.for_decoding().unwrap();
    assert!(whole.can_encode() && !slim.can_encode());
    assert_eq!(slim.vocab_size(), whole.vocab_size());
    assert_eq!((slim.bos_token_id(), slim.eos_token_id()), (whole.bos_token_id(), whole.eos_token_id()));
    assert_eq!(slim.special_tokens(), whole.special_tokens());
    assert_eq!(slim.decoder().is_some(), whole.decoder().is_some());
    let n = whole.vocab_size() as u32 + 3;
    for id in 0..n {
        assert_eq!(slim.id_to_token(id), whole.id_to_token(id), "id {id}");
        for skip in [false, true] {
            assert_eq!(slim.decode(&[id], skip).unwrap(), whole.decode(&[id], skip).unwrap(), "id {id}, skip {skip}");
        }
    }
    for (id, name) in whole.special_tokens() {
        assert_eq!(slim.token_to_id(&name), Some(id));
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..300 {
        let len = 1 + next() as usize % 40;
        let ids: Vec<u32> = (0..len).map(|_| next() as u32 % n).collect();
        for skip in [false, true] {
            assert_eq!(slim.decode(&ids, skip).unwrap(), whole.decode(&ids, skip).unwrap(), "{ids:?}, skip {skip}");
        }
        let (mut a, mut b) =
            (IncrementalDecoder::new(whole.clone(), &ids[..1]), IncrementalDecoder::new(slim.clone(), &ids[..1]));
        for &id in &ids[1..] {
            assert_eq!(b.push(id).unwrap(), a.push(id).unwrap(), "{ids:?}");
        }
        assert_eq!(b.finish().unwrap(), a.finish().unwrap());
    }
    let err = slim.encode("hello", false).unwrap_err();
    assert!(matches!(err, TokenizerError::Encode { len_bytes: 5, .. }), "{err}");
    assert!(err.to_string().contains("only what decoding needs"), "{err}");
    assert!(slim.hf().is_none() && whole.hf().is_some());
    // Slimming twice is slimming once.
    assert_eq!(
        slim.for_decoding().unwrap().decode(&[1, 2, 3], false).unwrap(),
        slim.decode(&[1, 2, 3], false).unwrap()
    );
}

#[test]
fn the_tiny_llamas_tokenizer() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tiny-llama");
    decodes_alike(&Tokenizer::from_model_dir(dir).unwrap());
}

/// GPT-2's printable stand-ins for the 256 bytes, in byte order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

#[test]
fn a_byte_level_vocabulary_with_added_tokens() {
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<|im_end|>".into()];
    let mut types = vec![token_type::CONTROL; 3];
    tokens.extend(byte_chars().iter().map(char::to_string));
    types.extend(std::iter::repeat_n(token_type::NORMAL, 256));
    let merges = ["\u{120} t", "\u{120}t h", "\u{120}th e", "i n", "\u{120} a", "e r"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(token_type::NORMAL);
    }
    // Not special: written out as text, and a token the decoder must not byte-map.
    tokens.push("<tool_call>".into());
    types.push(token_type::USER_DEFINED);
    let meta = GgufTokenizerMeta {
        model: "gpt2".into(),
        pre: Some("smollm".into()),
        tokens,
        token_types: Some(types),
        merges: Some(merges.iter().map(|m| m.to_string()).collect()),
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        ..Default::default()
    };
    let config = TokenizerConfig {
        bos_token: Some("<|im_start|>".into()),
        eos_token: Some("<|im_end|>".into()),
        ..Default::default()
    };
    decodes_alike(&Tokenizer::from_hf(tokenizer_from_gguf(&meta).unwrap(), config));
}

#[test]
fn a_sentencepiece_vocabulary_with_byte_fallback() {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![token_type::UNKNOWN, token_type::CONTROL, token_type::CONTROL];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    types.extend(std::iter::repeat_n(token_type::BYTE, 256));
    for t in ["\u{2581}", "a", "b", "\u{2581}a", "ab", "\u{2581}ab", "\u{2581}\u{2581}"] {
        tokens.push(t.into());
        types.push(token_type::NORMAL);
    }
    let scores = Some((0..tokens.len()).map(|i| -(i as f32)).collect());
    let meta = GgufTokenizerMeta {
        model: "llama".into(),
        tokens,
        token_types: Some(types),
        scores,
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        unknown_token_id: Some(0),
        ..Default::default()
    };
    let config =
        TokenizerConfig { bos_token: Some("<s>".into()), eos_token: Some("</s>".into()), ..Default::default() };
    decodes_alike(&Tokenizer::from_hf(tokenizer_from_gguf(&meta).unwrap(), config));
}
