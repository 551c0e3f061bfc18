//! The model's vocabulary as bytes: what every token id spells, which llguidance needs to
//! decide which tokens a grammar state allows.
//!
//! A `tokenizer.json` stores token *strings* in one of two encodings, told apart by its decoder:
//! - byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): every byte is one printable character
//!   (GPT-2's `bytes_to_unicode` table), so a token's bytes are its characters mapped back;
//! - SentencePiece with byte fallback (Llama 2, Mistral, TinyLlama): `▁` (or whatever a
//!   `Replace` decoder turns into a space) stands for a space and `<0xNN>` for one raw byte.
//!
//! Special tokens (added tokens marked special) spell nothing a grammar can match: they get
//! toktrie's marker byte `0xff` before their name, so only EOS (which the trie knows by id) is
//! ever allowed by a mask. Added tokens *not* marked special (Qwen's `<tool_call>`, which the
//! detokenizer writes out as text) spell their text, so a grammar's literal `<tool_call>` matches
//! the one token the model was trained to emit as well as the text spelled out. Ids the tokenizer does not name (padding rows of the
//! embedding) spell nothing and are never allowed.

use std::collections::HashMap;

use tokenizers::DecoderWrapper;
use toktrie::{TokRxInfo, TokTrie};

use crate::ConstrainError;

/// How the vocabulary's strings encode bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    ByteLevel,
    /// `space` is the character that stands for a space (`▁` unless a decoder says otherwise).
    ByteFallback {
        space: char,
    },
}

/// Builds the trie of `tokenizer` for a model with `model_vocab` logits per row (at least the
/// tokenizer's size: embeddings are often padded), whose end-of-sequence ids are `eos`.
pub fn token_trie(
    tokenizer: &cleave_tokenizer::Tokenizer,
    model_vocab: usize,
    eos: &[u32],
) -> Result<TokTrie, ConstrainError> {
    let encoding = encoding(tokenizer.decoder())?;
    let tok_vocab = tokenizer.vocab_size();
    let n = model_vocab.max(tok_vocab);
    let special: HashMap<u32, String> = tokenizer.special_tokens().into_iter().collect();
    let byte_of: HashMap<char, u8> = byte_level_chars().into_iter().map(|(b, c)| (c, b)).collect();
    let mut words = vec![Vec::new(); n];
    for (id, word) in words.iter_mut().enumerate().take(tok_vocab) {
        let id = id as u32;
        if let Some(name) = special.get(&id) {
            word.push(TokTrie::SPECIAL_TOKEN_MARKER);
            word.extend_from_slice(name.as_bytes());
            continue;
        }
        let Some(s) = tokenizer.id_to_token(id) else { continue };
        *word = match encoding {
            Encoding::ByteLevel => match s.chars().map(|c| byte_of.get(&c).copied()).collect::<Option<Vec<u8>>>() {
                Some(b) => b,
                // An added (non-special) token is stored as plain text, not byte-level encoded.
                None => s.into_bytes(),
            },
            Encoding::ByteFallback { space } => match byte_token(&s) {
                Some(b) => vec![b],
                None => s.replace(space, " ").into_bytes(),
            },
        };
    }
    let eos_first = eos
        .first()
        .copied()
        .ok_or_else(|| ConstrainError::Vocabulary("the model names no end-of-sequence token".into()))?;
    let mut info = TokRxInfo::new(n as u32, eos_first);
    info.tok_bos = tokenizer.bos_token_id();
    let trie = TokTrie::from(&info, &words);
    Ok(trie.with_eos_tokens(eos))
}

/// `<0xNN>` → the byte NN.
fn byte_token(s: &str) -> Option<u8> {
    let hex = s.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn encoding(decoder: Option<&DecoderWrapper>) -> Result<Encoding, ConstrainError> {
    fn walk(d: &DecoderWrapper, level: &mut bool, fallback: &mut bool, space: &mut char) {
        match d {
            DecoderWrapper::ByteLevel(_) => *level = true,
            DecoderWrapper::ByteFallback(_) => *fallback = true,
            DecoderWrapper::Metaspace(m) => {
                *fallback = true;
                *space = m.get_replacement();
            }
            DecoderWrapper::Replace(r) => {
                // The pattern has no accessor; its serialised form has it.
                if let Ok(v) = serde_json::to_value(r) {
                    let content = v["content"].as_str();
                    let mut pattern = v["pattern"]["String"].as_str().unwrap_or("").chars();
                    if let (Some(" "), Some(c), None) = (content, pattern.next(), pattern.next()) {
                        *space = c;
                    }
                }
            }
            DecoderWrapper::Sequence(seq) => {
                for d in seq.get_decoders() {
                    walk(d, level, fallback, space);
                }
            }
            _ => {}
        }
    }
    let (mut level, mut fallback, mut space) = (false, false, '\u{2581}');
    if let Some(d) = decoder {
        walk(d, &mut level, &mut fallback, &mut space);
    }
    match (level, fallback) {
        (true, _) => Ok(Encoding::ByteLevel),
        (false, true) => Ok(Encoding::ByteFallback { space }),
        (false, false) => Err(ConstrainError::Vocabulary(format!(
            "cannot tell how this tokenizer's tokens spell bytes (decoder {decoder:?}): neither byte-level nor byte-fallback"
        ))),
    }
}

/// GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the other 68 bytes for
/// the code points from 256 up, in byte order.
fn byte_level_chars() -> Vec<(u8, char)> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b, b as char)
            } else {
                let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
                next += 1;
                (b, c)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_onto_gpt2_s_characters() {
        let t = byte_level_chars();
        let chars: std::collections::HashSet<char> = t.iter().map(|&(_, c)| c).collect();
        assert_eq!(chars.len(), 256);
        // GPT-2: space is U+0120 ('Ġ'), newline U+010A ('Ċ').
        assert_eq!(t[b' ' as usize].1, '\u{120}');
        assert_eq!(t[b'\n' as usize].1, '\u{10a}');
        assert_eq!(t[b'A' as usize].1, 'A');
    }

    #[test]
    fn byte_tokens_parse_only_in_their_exact_form() {
        assert_eq!(byte_token("<0x0A>"), Some(10));
        assert_eq!(byte_token("<0xFF>"), Some(255));
        assert_eq!(byte_token("<0x0A"), None);
        assert_eq!(byte_token("<0x0AB>"), None);
        assert_eq!(byte_token("<s>"), None);
    }
}
