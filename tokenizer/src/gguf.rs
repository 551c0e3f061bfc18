//! Building a `tokenizers::Tokenizer` from the vocabulary a GGUF file carries in its metadata.
//!
//! A GGUF (llama.cpp / Ollama) has no `tokenizer.json`: it stores the vocabulary under
//! `tokenizer.ggml.*` keys. The caller (the engine's GGUF reader) copies those keys into a
//! [`GgufTokenizerMeta`]; this module knows nothing about the file format.
//!
//! Two vocabularies are supported, mirroring llama.cpp:
//! - `"gpt2"`: byte-level BPE with the file's merges, pre-tokenized by the regexes llama.cpp uses
//!   for `tokenizer.ggml.pre` (see [`pre_tokenizer_regexes`]), ByteLevel decoder.
//! - `"llama"`: SentencePiece. Built as a BPE with byte fallback whose merges are recovered from
//!   the scores (a pair merges with the priority of the score of the token it forms, as
//!   llama.cpp's SPM tokenizer does), normalizer "prepend ▁, spaces to ▁", decoder
//!   "▁ to space, byte fallback, fuse, strip one leading space".
//!
//! Tokens typed control (3) or unknown (2) become special added tokens and user-defined (4)
//! become plain added tokens, so both are matched whole in the input (e.g. `<|im_start|>`).
//!
//! Allowed dependencies: std and `tokenizers`. Invariant: token ids of the built tokenizer are
//! the indices of [`GgufTokenizerMeta::tokens`]; no token is ever added past the file's vocabulary.

use std::collections::HashSet;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, NormalizerWrapper, SplitDelimiterBehavior};

/// The tokenizer type built here, re-exported so that callers need no direct `tokenizers` dependency.
pub use tokenizers::Tokenizer as HfTokenizer;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    /// An ordinary vocabulary entry.
    pub const NORMAL: i32 = 1;
    /// The unknown token.
    pub const UNKNOWN: i32 = 2;
    /// A control token such as `<|im_start|>` or `<s>`.
    pub const CONTROL: i32 = 3;
    /// An added token that is not special (matched whole, not skipped when decoding).
    pub const USER_DEFINED: i32 = 4;
    /// An unused slot.
    pub const UNUSED: i32 = 5;
    /// A byte-fallback token `<0xNN>`.
    pub const BYTE: i32 = 6;
}

/// The `tokenizer.ggml.*` metadata of a GGUF file, as plain data.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufTokenizerMeta {
    /// `tokenizer.ggml.model`: "gpt2" or "llama".
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name (gpt2 vocabularies only).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the vocabulary; a token's id is its index.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`, one per token (required for "llama").
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`, one per token (see [`token_type`]); absent means all normal.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: "left right" pairs in priority order (required for "gpt2").
    pub merges: Option<Vec<String>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unknown_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`; when absent llama.cpp adds BOS for "llama", not for "gpt2".
    pub add_bos_token: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`; absent means false.
    pub add_eos_token: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` ("llama" only); absent means true.
    pub add_space_prefix: Option<bool>,
}

/// Why a tokenizer could not be built from GGUF metadata.
#[derive(Debug, thiserror::Error)]
pub enum GgufTokenizerError {
    #[error("unsupported GGUF tokenizer model {model:?} (supported: \"gpt2\", \"llama\")")]
    UnsupportedModel { model: String },
    #[error("unsupported GGUF pre-tokenizer {pre:?} for a gpt2 vocabulary (supported: {supported})")]
    UnsupportedPre { pre: String, supported: String },
    #[error("GGUF tokenizer has an empty vocabulary")]
    EmptyVocab,
    #[error("GGUF tokenizer vocabulary of {len} tokens exceeds u32 ids")]
    VocabTooLarge { len: usize },
    #[error("GGUF tokenizer field {field} has {len} entries but the vocabulary has {vocab}")]
    LengthMismatch { field: &'static str, len: usize, vocab: usize },
    #[error("GGUF tokenizer {field} id {id} is outside the vocabulary of {vocab} tokens")]
    TokenIdOutOfRange { field: &'static str, id: u32, vocab: usize },
    #[error("GGUF tokenizer merge #{index} {merge:?} is not two space-separated vocabulary tokens")]
    BadMerge { index: usize, merge: String },
    #[error("GGUF tokenizer model {model:?} needs {field}, which the file lacks")]
    MissingField { model: &'static str, field: &'static str },
    #[error("building the tokenizer's {stage} failed: {message}")]
    Build { stage: &'static str, message: String },
}

type Result<T> = std::result::Result<T, GgufTokenizerError>;

fn build_err(stage: &'static str) -> impl FnOnce(tokenizers::Error) -> GgufTokenizerError {
    move |e| GgufTokenizerError::Build { stage, message: e.to_string() }
}

/// The GPT-2 split regex as `tokenizers`' ByteLevel uses it (llama.cpp's lacks the final `|\s+`,
/// which changes nothing because unmatched text is kept as its own piece either way).
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values this module knows, for error messages.
const SUPPORTED_PRE: &str = "default, gpt-2, llama-bpe, llama3, llama-v3, qwen2, \
     deepseek-r1-qwen, smollm, starcoder, refact, command-r";

/// The regexes llama.cpp (`llm_tokenizer_bpe`) applies in order for a `tokenizer.ggml.pre`
/// value, each splitting the pieces of the previous one with matches kept as pieces of their own,
/// and whether merges are ignored for words that are whole vocabulary entries (llama3).
/// `None` for an unknown name. A missing `pre` is llama.cpp's "default".
pub fn pre_tokenizer_regexes(pre: Option<&str>) -> Option<(Vec<&'static str>, bool)> {
    let pre = pre.unwrap_or("default");
    Some(match pre {
        "default" => (vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"], false),
        "gpt-2" | "gpt2" | "phi-2" => (vec![GPT2_SPLIT], false),
        "llama-bpe" | "llama3" | "llama-v3" => (vec![LLAMA3_SPLIT], true),
        "qwen2" | "deepseek-r1-qwen" => (vec![QWEN2_SPLIT], false),
        "smollm" | "starcoder" | "refact" | "command-r" => (vec![r"\p{N}", GPT2_SPLIT], false),
        _ => return None,
    })
}

/// Build a tokenizer equivalent to llama.cpp's for this vocabulary.
///
/// Errors name the field or token at fault; nothing here panics on malformed metadata.
pub fn tokenizer_from_gguf(meta: &GgufTokenizerMeta) -> Result<HfTokenizer> {
    let n = meta.tokens.len();
    if n == 0 {
        return Err(GgufTokenizerError::EmptyVocab);
    }
    if u32::try_from(n).is_err() {
        return Err(GgufTokenizerError::VocabTooLarge { len: n });
    }
    let check_len = |field: &'static str, len: Option<usize>| match len {
        Some(len) if len != n => Err(GgufTokenizerError::LengthMismatch { field, len, vocab: n }),
        _ => Ok(()),
    };
    check_len("tokenizer.ggml.scores", meta.scores.as_ref().map(Vec::len))?;
    check_len("tokenizer.ggml.token_type", meta.token_types.as_ref().map(Vec::len))?;
    for (field, id) in [
        ("bos_token_id", meta.bos_token_id),
        ("eos_token_id", meta.eos_token_id),
        ("unknown_token_id", meta.unknown_token_id),
    ] {
        if let Some(id) = id {
            if id as usize >= n {
                return Err(GgufTokenizerError::TokenIdOutOfRange { field, id, vocab: n });
            }
        }
    }
    let (mut tokenizer, add_bos_default) = match meta.model.as_str() {
        "gpt2" => (build_gpt2(meta)?, false),
        "llama" => (build_llama(meta)?, true),
        other => return Err(GgufTokenizerError::UnsupportedModel { model: other.to_string() }),
    };
    add_typed_tokens(&mut tokenizer, meta);
    let add_bos = meta.add_bos_token.unwrap_or(add_bos_default);
    let add_eos = meta.add_eos_token.unwrap_or(false);
    let processor = post_processor(meta, add_bos, add_eos)?;
    tokenizer.with_post_processor(processor);
    Ok(tokenizer)
}

fn type_of(meta: &GgufTokenizerMeta, id: usize) -> i32 {
    meta.token_types.as_ref().and_then(|t| t.get(id).copied()).unwrap_or(token_type::NORMAL)
}

/// Control and unknown tokens become special added tokens, user-defined ones plain added tokens;
/// both keep their vocabulary ids because their content is in the model's vocabulary.
fn add_typed_tokens(tokenizer: &mut HfTokenizer, meta: &GgufTokenizerMeta) {
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (id, tok) in meta.tokens.iter().enumerate() {
        match type_of(meta, id) {
            token_type::CONTROL | token_type::UNKNOWN if !tok.is_empty() => {
                special.push(AddedToken::from(tok.clone(), true).normalized(false))
            }
            token_type::USER_DEFINED if !tok.is_empty() => {
                user.push(AddedToken::from(tok.clone(), false).normalized(false))
            }
            _ => {}
        }
    }
    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&user);
}

fn post_processor(meta: &GgufTokenizerMeta, add_bos: bool, add_eos: bool) -> Result<Option<PostProcessorWrapper>> {
    let bos = meta.bos_token_id.filter(|_| add_bos);
    let eos = meta.eos_token_id.filter(|_| add_eos);
    if bos.is_none() && eos.is_none() {
        return Ok(match meta.model.as_str() {
            "gpt2" => Some(ByteLevel::new(false, false, false).into()),
            _ => None,
        });
    }
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    let mut push_special = |name: &str, id: u32| {
        let content = meta.tokens[id as usize].clone();
        // The ids were range-checked above, so `new` only fails on length mismatch (never here).
        if let Ok(tok) = SpecialToken::new(name.to_string(), vec![id], vec![content]) {
            specials.push(tok);
        }
    };
    if let Some(id) = bos {
        push_special("bos", id);
    }
    if let Some(id) = eos {
        push_special("eos", id);
    }
    for (seq, out) in [("$A:0", &mut single), ("$A:0 $B:1", &mut pair)] {
        for (i, piece) in seq.split(' ').enumerate() {
            if bos.is_some() {
                out.push(if i == 0 { "bos:0" } else { "bos:1" });
            }
            out.push(piece);
            if eos.is_some() {
                out.push(if i == 0 { "eos:0" } else { "eos:1" });
            }
        }
    }
    let template = TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map_err(|message| GgufTokenizerError::Build { stage: "post-processor template", message })?
        .special_tokens(specials)
        .build()
        .map_err(|e| GgufTokenizerError::Build { stage: "post-processor", message: e.to_string() })?;
    Ok(Some(template.into()))
}

/// GPT-2's map from bytes to printable characters (`bytes_to_unicode`).
fn byte_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        out[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    out
}

fn build_gpt2(meta: &GgufTokenizerMeta) -> Result<HfTokenizer> {
    let merges_src = meta
        .merges
        .as_ref()
        .ok_or(GgufTokenizerError::MissingField { model: "gpt2", field: "tokenizer.ggml.merges" })?;
    let pre = meta.pre.as_deref();
    let (regexes, ignore_merges) = pre_tokenizer_regexes(pre).ok_or_else(|| GgufTokenizerError::UnsupportedPre {
        pre: pre.unwrap_or_default().to_string(),
        supported: SUPPORTED_PRE.to_string(),
    })?;
    let alphabet = byte_alphabet();
    let in_alphabet: HashSet<char> = alphabet.iter().copied().collect();
    let mut vocab = Vocab::with_capacity(meta.tokens.len());
    for (id, tok) in meta.tokens.iter().enumerate() {
        let ty = type_of(meta, id);
        // A normal token spelled outside the byte alphabet (e.g. a literal space) could never be
        // produced from byte-level pieces: respell its UTF-8 bytes, as transformers does.
        let key = if ty != token_type::CONTROL
            && ty != token_type::USER_DEFINED
            && !tok.chars().all(|c| in_alphabet.contains(&c))
        {
            tok.bytes().map(|b| alphabet[b as usize]).collect()
        } else {
            tok.clone()
        };
        // First id wins for duplicate spellings, as in llama.cpp's text_to_token map.
        vocab.entry(key).or_insert(id as u32);
    }
    let mut merges = Vec::with_capacity(merges_src.len());
    for (index, m) in merges_src.iter().enumerate() {
        let bad = || GgufTokenizerError::BadMerge { index, merge: m.clone() };
        let (l, r) = m.split_once(' ').ok_or_else(bad)?;
        if !vocab.contains_key(l) || !vocab.contains_key(r) {
            return Err(bad());
        }
        merges.push((l.to_string(), r.to_string()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(build_err("BPE model"))?;
    let mut tokenizer = HfTokenizer::new(bpe);
    let mut pres: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(build_err("pre-tokenizer regex"))?;
        pres.push(split.into());
    }
    pres.push(ByteLevel::new(false, false, false).into());
    tokenizer.with_pre_tokenizer(Some(PreSequence::new(pres)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, false, false)));
    Ok(tokenizer)
}

/// SentencePiece merges recovered from scores: every split of a token into two vocabulary
/// tokens is a merge ranked by the token's score (best first); ties keep (left id, right id)
/// order, as transformers' `generate_merges` does.
fn spm_merges(meta: &GgufTokenizerMeta, vocab: &Vocab) -> Vec<(String, String)> {
    let scores = meta.scores.as_deref().unwrap_or(&[]);
    let mut ranked: Vec<(f32, u32, u32, usize, usize)> = Vec::new(); // score, l id, r id, token, split byte
    for (id, tok) in meta.tokens.iter().enumerate() {
        let ty = type_of(meta, id);
        if matches!(ty, token_type::CONTROL | token_type::UNKNOWN | token_type::BYTE) {
            continue;
        }
        for (split, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(split);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                let score = scores.get(id).copied().unwrap_or(0.0);
                ranked.push((score, li, ri, id, split));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked
        .into_iter()
        .map(|(_, _, _, id, split)| {
            let (l, r) = meta.tokens[id].split_at(split);
            (l.to_string(), r.to_string())
        })
        .collect()
}

fn build_llama(meta: &GgufTokenizerMeta) -> Result<HfTokenizer> {
    if meta.scores.is_none() {
        return Err(GgufTokenizerError::MissingField { model: "llama", field: "tokenizer.ggml.scores" });
    }
    let mut vocab = Vocab::with_capacity(meta.tokens.len());
    for (id, tok) in meta.tokens.iter().enumerate() {
        vocab.entry(tok.clone()).or_insert(id as u32);
    }
    let merges = spm_merges(meta, &vocab);
    let unk = meta.unknown_token_id.map(|id| meta.tokens[id as usize].clone()).or_else(|| {
        (0..meta.tokens.len()).find(|&i| type_of(meta, i) == token_type::UNKNOWN).map(|i| meta.tokens[i].clone())
    });
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(build_err("BPE model"))?;
    let mut tokenizer = HfTokenizer::new(bpe);
    let space_prefix = meta.add_space_prefix.unwrap_or(true);
    let mut norms: Vec<NormalizerWrapper> = Vec::new();
    if space_prefix {
        norms.push(Prepend::new("\u{2581}".to_string()).into());
    }
    norms.push(Replace::new(" ", "\u{2581}").map_err(build_err("normalizer"))?.into());
    tokenizer.with_normalizer(Some(NormalizerSequence::new(norms)));
    let mut decs: Vec<DecoderWrapper> = vec![
        tokenizers::decoders::DecoderWrapper::Replace(Replace::new("\u{2581}", " ").map_err(build_err("decoder"))?),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decs.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decs)));
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: the 256 byte characters, then merged tokens, then control tokens.
    fn gpt2_meta(pre: &str) -> GgufTokenizerMeta {
        let alphabet = byte_alphabet();
        let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into()];
        let mut types = vec![token_type::CONTROL, token_type::CONTROL];
        tokens.extend(alphabet.iter().map(|c| c.to_string()));
        types.extend(std::iter::repeat_n(token_type::NORMAL, 256));
        let merges = ["h e", "l l", "he ll", "hell o", "\u{120} w", "\u{120}w o", "1 2"];
        for m in merges {
            let (l, r) = m.split_once(' ').unwrap();
            tokens.push(format!("{l}{r}"));
            types.push(token_type::NORMAL);
        }
        tokens.push("<think>".into());
        types.push(token_type::USER_DEFINED);
        GgufTokenizerMeta {
            model: "gpt2".into(),
            pre: Some(pre.into()),
            tokens,
            token_types: Some(types),
            merges: Some(merges.iter().map(|m| m.to_string()).collect()),
            bos_token_id: Some(0),
            eos_token_id: Some(0),
            ..Default::default()
        }
    }

    fn id(meta: &GgufTokenizerMeta, tok: &str) -> u32 {
        meta.tokens.iter().position(|t| t == tok).unwrap() as u32
    }

    fn encode(t: &HfTokenizer, text: &str) -> Vec<u32> {
        t.encode(text, true).unwrap().get_ids().to_vec()
    }

    #[test]
    fn gpt2_merges_specials_and_decode() {
        let meta = gpt2_meta("gpt-2");
        let t = tokenizer_from_gguf(&meta).unwrap();
        let ids = encode(&t, "<|im_start|>hello wo<think>");
        let want = vec![id(&meta, "<|im_start|>"), id(&meta, "hello"), id(&meta, "\u{120}wo"), id(&meta, "<think>")];
        assert_eq!(ids, want);
        assert_eq!(t.decode(&ids, false).unwrap(), "<|im_start|>hello wo<think>");
        // Control tokens are skipped when asked, user-defined ones are not.
        assert_eq!(t.decode(&ids, true).unwrap(), "hello wo<think>");
        // Bytes outside ASCII go through the byte alphabet and come back intact.
        let ids = encode(&t, "é€");
        assert_eq!(ids.len(), 5);
        assert_eq!(t.decode(&ids, false).unwrap(), "é€");
    }

    #[test]
    fn smollm_splits_digits_but_gpt2_does_not() {
        let meta = gpt2_meta("smollm");
        let t = tokenizer_from_gguf(&meta).unwrap();
        assert_eq!(encode(&t, "12"), vec![id(&meta, "1"), id(&meta, "2")]);
        let t = tokenizer_from_gguf(&gpt2_meta("gpt-2")).unwrap();
        assert_eq!(encode(&t, "12"), vec![id(&meta, "12")]);
    }

    #[test]
    fn every_known_pre_builds() {
        for pre in SUPPORTED_PRE.split(", ") {
            let t = tokenizer_from_gguf(&gpt2_meta(pre)).unwrap();
            assert_eq!(t.decode(&encode(&t, "hello world 123"), false).unwrap(), "hello world 123");
        }
    }

    fn spm_meta() -> GgufTokenizerMeta {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![token_type::UNKNOWN, token_type::CONTROL, token_type::CONTROL];
        let mut scores = vec![0.0, 0.0, 0.0];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(token_type::BYTE);
            scores.push(0.0);
        }
        // Merges apply best score first: ll, ▁h, ▁he, llo, then ▁he+llo.
        let normal = [
            ("\u{2581}", -1.0),
            ("h", -2.0),
            ("e", -3.0),
            ("l", -4.0),
            ("o", -5.0),
            ("ll", -6.0),
            ("\u{2581}h", -7.0),
            ("\u{2581}he", -8.0),
            ("llo", -9.0),
            ("\u{2581}hello", -10.0),
        ];
        for (t, s) in normal {
            tokens.push(t.into());
            types.push(token_type::NORMAL);
            scores.push(s);
        }
        GgufTokenizerMeta {
            model: "llama".into(),
            tokens,
            token_types: Some(types),
            scores: Some(scores),
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            unknown_token_id: Some(0),
            ..Default::default()
        }
    }

    #[test]
    fn spm_merges_by_score_with_byte_fallback_and_bos() {
        let meta = spm_meta();
        let t = tokenizer_from_gguf(&meta).unwrap();
        let ids = encode(&t, "hello");
        assert_eq!(ids, vec![1, id(&meta, "\u{2581}hello")]);
        // "€" is not in the vocabulary: three byte tokens.
        let ids = encode(&t, "hello €");
        let tail: Vec<u32> = ["\u{2581}", "<0xE2>", "<0x82>", "<0xAC>"].iter().map(|s| id(&meta, s)).collect();
        assert_eq!(&ids[2..], &tail[..]);
        assert_eq!(t.decode(&ids, true).unwrap(), "hello €");
        // "</s>" in text is a control token, matched whole.
        assert_eq!(encode(&t, "</s>").last(), Some(&2));
    }

    #[test]
    fn spm_without_bos_or_space_prefix() {
        let mut meta = spm_meta();
        meta.add_bos_token = Some(false);
        meta.add_eos_token = Some(true);
        meta.add_space_prefix = Some(false);
        let t = tokenizer_from_gguf(&meta).unwrap();
        assert_eq!(encode(&t, "ll"), vec![id(&meta, "ll"), 2]);
    }

    #[test]
    fn malformed_metadata_gives_named_errors() {
        let mut m = gpt2_meta("gpt-2");
        m.model = "bert".into();
        let e = tokenizer_from_gguf(&m).unwrap_err();
        assert!(matches!(e, GgufTokenizerError::UnsupportedModel { .. }), "{e}");
        let e = tokenizer_from_gguf(&gpt2_meta("mystery")).unwrap_err();
        assert!(e.to_string().contains("mystery"), "{e}");
        let mut m = gpt2_meta("gpt-2");
        m.token_types.as_mut().unwrap().pop();
        let e = tokenizer_from_gguf(&m).unwrap_err();
        assert!(e.to_string().contains("token_type"), "{e}");
        let mut m = gpt2_meta("gpt-2");
        m.merges.as_mut().unwrap().push("nospace".into());
        let e = tokenizer_from_gguf(&m).unwrap_err();
        assert!(matches!(e, GgufTokenizerError::BadMerge { index: 7, .. }), "{e}");
        let mut m = gpt2_meta("gpt-2");
        m.merges.as_mut().unwrap().push("zz qq".into());
        assert!(tokenizer_from_gguf(&m).is_err());
        let mut m = gpt2_meta("gpt-2");
        m.eos_token_id = Some(99_999);
        let e = tokenizer_from_gguf(&m).unwrap_err();
        assert!(e.to_string().contains("99999"), "{e}");
        let mut m = gpt2_meta("gpt-2");
        m.merges = None;
        assert!(matches!(tokenizer_from_gguf(&m).unwrap_err(), GgufTokenizerError::MissingField { .. }));
        let mut m = spm_meta();
        m.scores = None;
        assert!(tokenizer_from_gguf(&m).is_err());
        m.tokens.clear();
        assert!(matches!(tokenizer_from_gguf(&m).unwrap_err(), GgufTokenizerError::EmptyVocab));
    }
}
