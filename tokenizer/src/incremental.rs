//! Streaming detokenization.
//!
//! Decoding one token at a time is wrong for two reasons: byte-fallback tokens carry
//! parts of a UTF-8 character (decoding them alone gives U+FFFD), and decoders such as
//! SentencePiece's `Strip`/`Metaspace` treat the first token of a sequence specially
//! (dropping its leading space). The standard fix (TGI, vLLM) decodes a *window*:
//! `prefix = decode(ids[prefix_offset..read_offset])`, `full =
//! decode(ids[prefix_offset..])`, and emits `full[prefix.len()..]` once `full` does not end
//! in U+FFFD; then `prefix_offset = read_offset`, `read_offset = ids.len()`.
//!
//! Invariants:
//! * `prefix_offset <= read_offset <= ids.len()`; `ids[..read_offset]` has been emitted
//!   (or belongs to the prompt) and `read_offset` only advances when the decoded window
//!   ends on a complete character, so emitted text never holds a partial character.
//! * The window's decoded prefix is never empty unless it starts at id 0 (it is widened
//!   backwards otherwise), so a decoder that strips the first token's leading space
//!   strips it from both decodes alike, and the concatenation of everything emitted
//!   (plus [`IncrementalDecoder::finish`]) equals
//!   `decode(prompt + generated)[decode(prompt).len()..]`.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// How many prompt tokens of left context the first window gets.
const PROMPT_CONTEXT: usize = 5;

/// Turns a stream of generated token ids into a stream of text pieces.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder whose context is `prompt_ids`; their text is never emitted. Special
    /// tokens are skipped (see [`IncrementalDecoder::with_skip_special_tokens`]).
    pub fn new(tokenizer: Tokenizer, prompt_ids: &[u32]) -> Self {
        let len = prompt_ids.len();
        IncrementalDecoder {
            tokenizer,
            ids: prompt_ids.to_vec(),
            prefix_offset: len.saturating_sub(PROMPT_CONTEXT),
            read_offset: len,
            skip_special_tokens: true,
        }
    }

    /// Whether special tokens (BOS, EOS, `<|im_end|>`, ...) are left out of the text.
    pub fn with_skip_special_tokens(mut self, skip: bool) -> Self {
        self.skip_special_tokens = skip;
        self
    }

    /// Adds one generated id; returns the text that became final (often empty while a
    /// multi-byte character is incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        self.step(false)
    }

    /// Adds several generated ids at once; same text as pushing them one by one.
    pub fn push_many(&mut self, ids: &[u32]) -> Result<String> {
        self.ids.extend_from_slice(ids);
        self.step(false)
    }

    /// Releases text still held back because it ends in U+FFFD (a generation that
    /// stopped mid-character, or a token that really is U+FFFD). Call once at the end.
    pub fn finish(&mut self) -> Result<String> {
        self.step(true)
    }

    /// Every id seen so far, prompt first.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn step(&mut self, force: bool) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let skip = self.skip_special_tokens;
        let mut prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        while prefix.is_empty() && self.prefix_offset > 0 {
            self.prefix_offset = self.prefix_offset.saturating_sub(PROMPT_CONTEXT);
            prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        }
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..], skip)?;
        if full.len() <= prefix.len() || (!force && full.ends_with('\u{FFFD}')) {
            return Ok(String::new());
        }
        let start = if full.starts_with(&prefix) {
            prefix.len()
        } else {
            // Not expected from the decoders we know; keep going rather than fail,
            // emitting from where the two decodes diverge.
            common_prefix_len(&prefix, &full)
        };
        let text = full[start..].to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(text)
    }
}

/// Byte length of the longest common prefix of `a` and `b`, on a char boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_is_char_aligned() {
        assert_eq!(common_prefix_len("héllo", "hélp"), 4);
        assert_eq!(common_prefix_len("日本", "日x"), 3);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
        assert_eq!(common_prefix_len("", "x"), 0);
    }
}
