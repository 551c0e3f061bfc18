//! A real byte-level BPE tokenizer of any vocabulary size (≥ [`MIN_VOCAB_SIZE`]), built
//! deterministically: no files, no network.
//!
//! Layout of the vocabulary (ids): the special tokens [`SPECIAL_TOKENS`] first (0, 1, 2), then
//! the 256 byte tokens in byte order, then one token per merge. Merges come first from the
//! `tokenizers` BPE trainer run on a small embedded English/code text, then, while the
//! vocabulary is still short, from synthetic merges of existing token pairs drawn from a fixed
//! ChaCha8 stream.
//!
//! Invariant: the result depends only on `vocab_size` (not on the model seed), and the tokenizer
//! holds exactly `vocab_size` tokens.

use std::collections::HashMap;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, Tokenizer, TokenizerImpl,
};

use crate::{EngineError, Result};

/// Special tokens, at ids 0, 1, 2: end of text (also BOS and EOS), and ChatML's turn markers.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// The smallest vocabulary: the special tokens and the 256 bytes.
pub const MIN_VOCAB_SIZE: usize = SPECIAL_TOKENS.len() + 256;
/// Longest token (in bytes) a synthetic merge may create.
const MAX_SYNTHETIC_TOKEN_BYTES: usize = 16;
/// Seed of the synthetic merges: fixed, so the tokenizer depends on `vocab_size` only.
const SYNTHETIC_MERGE_SEED: u64 = 0x5eed_70c3;

const CORPUS: &str = include_str!("corpus.txt");

fn tokenizer_error(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::ModelFile { path: "tokenizer.json".into(), detail: format!("{what}: {e}") }
}

/// Builds the tokenizer with exactly `vocab_size` tokens.
pub fn build_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    if vocab_size < MIN_VOCAB_SIZE {
        return Err(tokenizer_error(
            "vocabulary too small",
            format!("vocab_size {vocab_size} < {MIN_VOCAB_SIZE} (3 special tokens + 256 bytes)"),
        ));
    }
    let mut vocab = Vocab::default();
    for special in SPECIAL_TOKENS {
        vocab.add(special.to_string());
    }
    for c in byte_level_chars() {
        vocab.add(c.to_string());
    }
    let mut merges: Vec<(String, String)> = Vec::new();
    for (a, b) in trained_merges(vocab_size - SPECIAL_TOKENS.len())? {
        if vocab.len() == vocab_size {
            break;
        }
        vocab.add(format!("{a}{b}"));
        merges.push((a, b));
    }
    // Synthetic merges: `a` any non-special token, `b` one that does not start a new word
    // (no leading space, `Ġ`), so new tokens read like longer word pieces.
    let mut rng = ChaCha8Rng::seed_from_u64(SYNTHETIC_MERGE_SEED);
    let mut attempts = 0usize;
    while vocab.len() < vocab_size {
        attempts += 1;
        if attempts > 1000 * vocab_size {
            return Err(tokenizer_error("synthetic merges", format!("could not reach {vocab_size} tokens")));
        }
        let (a, b) = (vocab.pick_regular(rng.next_u64()), vocab.pick_regular(rng.next_u64()));
        let joined = format!("{a}{b}");
        if b.starts_with('Ġ') || joined.chars().count() > MAX_SYNTHETIC_TOKEN_BYTES || vocab.ids.contains_key(&joined)
        {
            continue;
        }
        let (a, b) = (a.to_string(), b.to_string());
        vocab.add(joined);
        merges.push((a, b));
    }
    let vocab = vocab.ids;
    // Through serde, because `BpeBuilder` wants an `ahash` map, a type this crate does not name.
    let model = serde_json::json!({ "type": "BPE", "vocab": vocab, "merges": merges });
    // From text, not from the `Value`: BPE's deserializer borrows its `type` string.
    let bpe: BPE = serde_json::from_str(&model.to_string()).map_err(|e| tokenizer_error("building BPE", e))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_decoder(Some(ByteLevel::default()))
        .with_post_processor(Some(ByteLevel::new(false, true, true)));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().map(|t| AddedToken::from(*t, true)).collect();
    tokenizer.add_special_tokens(&specials);
    let got = tokenizer.get_vocab_size(true);
    if got != vocab_size {
        return Err(tokenizer_error("vocabulary size", format!("built {got} tokens, wanted {vocab_size}")));
    }
    Ok(tokenizer)
}

/// Tokens in id order.
#[derive(Default)]
struct Vocab {
    ids: HashMap<String, u32>,
    order: Vec<String>,
}

impl Vocab {
    fn len(&self) -> usize {
        self.order.len()
    }

    /// Adds `token` with the next id unless it is already present.
    fn add(&mut self, token: String) {
        if !self.ids.contains_key(&token) {
            self.ids.insert(token.clone(), self.order.len() as u32);
            self.order.push(token);
        }
    }

    /// A non-special token chosen by `r`.
    fn pick_regular(&self, r: u64) -> &str {
        let regular = &self.order[SPECIAL_TOKENS.len()..];
        &regular[(r % regular.len() as u64) as usize]
    }
}

/// The 256 byte-level characters in byte order (byte `b` is written as `chars[b]`).
fn byte_level_chars() -> Vec<char> {
    // GPT-2's map: printable bytes stand for themselves, the rest shift to U+0100 onwards.
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap_or('?')
            }
        })
        .collect()
}

/// Merges the `tokenizers` BPE trainer learns from the embedded corpus, in rank order, for a
/// vocabulary of at most `max_tokens` (bytes included, specials excluded).
fn trained_merges(max_tokens: usize) -> Result<Vec<(String, String)>> {
    let mut trainer = BpeTrainer::builder()
        .vocab_size(max_tokens)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .max_token_length(Some(MAX_SYNTHETIC_TOKEN_BYTES))
        .build();
    let mut tokenizer: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerImpl::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.train(&mut trainer, CORPUS.lines()).map_err(|e| tokenizer_error("training BPE", e))?;
    #[derive(serde::Deserialize)]
    struct Merges {
        merges: Vec<(String, String)>,
    }
    let json = serde_json::to_value(tokenizer.get_model()).map_err(|e| tokenizer_error("reading merges", e))?;
    let merges: Merges = serde_json::from_value(json).map_err(|e| tokenizer_error("reading merges", e))?;
    Ok(merges.merges)
}

/// Whether `chars` covers every byte once; used by tests.
#[cfg(test)]
fn is_byte_alphabet(chars: &[char]) -> bool {
    let set: std::collections::HashSet<char> = chars.iter().copied().collect();
    set.len() == 256 && set == ByteLevel::alphabet().into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_match_tokenizers_alphabet() {
        assert!(is_byte_alphabet(&byte_level_chars()));
    }

    #[test]
    fn exact_sizes_and_fixed_ids() {
        for size in [MIN_VOCAB_SIZE, 300, 1000, 4096] {
            let t = build_tokenizer(size).unwrap();
            assert_eq!(t.get_vocab_size(true), size);
            for (id, special) in SPECIAL_TOKENS.iter().enumerate() {
                assert_eq!(t.token_to_id(special), Some(id as u32));
            }
            assert_eq!(t.token_to_id("A"), Some(3 + b'A' as u32));
        }
        assert!(build_tokenizer(MIN_VOCAB_SIZE - 1).is_err());
    }

    #[test]
    fn learns_common_words_and_is_deterministic() {
        let a = build_tokenizer(4096).unwrap();
        assert!(a.token_to_id("Ġthe").is_some());
        let b = build_tokenizer(4096).unwrap();
        assert_eq!(a.to_string(false).unwrap(), b.to_string(false).unwrap());
    }

    #[test]
    fn round_trips_text() {
        let t = build_tokenizer(4096).unwrap();
        for text in [
            "Hello, world! The quick brown fox.",
            "  leading and trailing spaces  \n\ttabs\r\n",
            "naïve café, Grüße, 日本語のテキスト, Ελληνικά",
            "emoji: 🦀🚀👩‍👩‍👧 and \u{0} control \u{7f}",
            "fn main() { println!(\"{}\", 1 + 2); }",
            "<|im_start|>user\nhi<|im_end|>",
        ] {
            let ids = t.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(t.decode(&ids, false).unwrap(), text);
        }
        let ids = t.encode("<|im_start|>assistant<|im_end|><|endoftext|>", false).unwrap().get_ids().to_vec();
        assert_eq!(ids[0], 1);
        assert_eq!(ids[ids.len() - 2..], [2, 0]);
    }
}
