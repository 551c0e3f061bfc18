//! Request datasets: synthetic random prompts, ShareGPT conversations and Mooncake traces.
//!
//! Token counts are measured offline with the model's own tokenizer (special tokens included, as
//! the server counts a completions prompt). Everything random comes from ChaCha8 streams seeded
//! by `--seed` (random, ShareGPT order) or by the hash id (Mooncake blocks), so a dataset is a
//! pure function of its arguments and files.
//!
//! Invariant: every [`SampleRequest`] has `output_len >= 1` and `prompt_len` equal to the
//! tokenizer's count of `prompt`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cleave_tokenizer::Tokenizer;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::{BenchError, Result};

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    pub prompt: String,
    /// Measured prompt tokens (may differ from a random dataset's target where the text does not
    /// re-encode to exactly that many).
    pub prompt_len: usize,
    /// `max_tokens` for the request.
    pub output_len: usize,
    /// Arrival time from a trace, seconds.
    pub timestamp_s: Option<f64>,
}

/// Which dataset to build.
#[derive(Debug, Clone, PartialEq)]
pub enum DatasetSpec {
    Random { input_len: usize, output_len: usize, range_ratio: f64, prefix_len: usize },
    ShareGpt { path: PathBuf, output_len: Option<usize> },
    Mooncake { path: PathBuf, block_size: usize },
}

impl DatasetSpec {
    /// Whether the dataset carries its own arrival times.
    pub fn is_trace(&self) -> bool {
        matches!(self, DatasetSpec::Mooncake { .. })
    }
}

/// Builds `num` requests (a trace gives all its lines when `num` is `None`; the others default
/// to 1000, vLLM's `--num-prompts` default).
pub fn load(spec: &DatasetSpec, num: Option<usize>, seed: u64, tok: &Tokenizer) -> Result<Vec<SampleRequest>> {
    match spec {
        DatasetSpec::Random { input_len, output_len, range_ratio, prefix_len } => random(
            &RandomSpec {
                input_len: *input_len,
                output_len: *output_len,
                range_ratio: *range_ratio,
                prefix_len: *prefix_len,
            },
            num.unwrap_or(1000),
            seed,
            tok,
        ),
        DatasetSpec::ShareGpt { path, output_len } => sharegpt(path, num.unwrap_or(1000), *output_len, seed, tok),
        DatasetSpec::Mooncake { path, block_size } => mooncake(path, num, *block_size, tok),
    }
}

/// Token ids that decode to non-empty text on their own (no special or control tokens).
fn plain_token_ids(tok: &Tokenizer) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for id in 0..tok.vocab_size() as u32 {
        if Some(id) == tok.bos_token_id() || Some(id) == tok.eos_token_id() {
            continue;
        }
        if tok.decode(&[id], true).is_ok_and(|t| !t.trim().is_empty()) {
            ids.push(id);
        }
    }
    if ids.is_empty() {
        return Err(BenchError::InvalidArg("the tokenizer has no plain text tokens to build prompts from".into()));
    }
    Ok(ids)
}

fn count(tok: &Tokenizer, text: &str) -> Result<usize> {
    Ok(tok.encode(text, true)?.len())
}

/// `--dataset-name random`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomSpec {
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
    /// Tokens of a prefix shared by every prompt, on top of `input_len`.
    pub prefix_len: usize,
}

/// Uniform integer in [len*(1-r), len*(1+r)], as vLLM's `--random-range-ratio`.
fn around(rng: &mut ChaCha8Rng, len: usize, r: f64) -> usize {
    let lo = (len as f64 * (1.0 - r)).floor().max(0.0) as usize;
    let hi = (len as f64 * (1.0 + r)).floor() as usize;
    if hi <= lo {
        lo
    } else {
        rng.random_range(lo..=hi)
    }
}

/// Random prompts: token ids drawn from the plain vocabulary, decoded to text, then adjusted
/// (tokens appended or dropped, up to 8 rounds) until the text re-encodes to the target count.
pub fn random(spec: &RandomSpec, num: usize, seed: u64, tok: &Tokenizer) -> Result<Vec<SampleRequest>> {
    if !(0.0..1.0).contains(&spec.range_ratio) {
        return Err(BenchError::InvalidArg(format!(
            "--random-range-ratio must be in [0, 1), got {}",
            spec.range_ratio
        )));
    }
    let vocab = plain_token_ids(tok)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let draw = |rng: &mut ChaCha8Rng, n: usize| -> Vec<u32> {
        (0..n).map(|_| vocab[rng.random_range(0..vocab.len())]).collect()
    };
    let prefix = draw(&mut rng, spec.prefix_len);
    let mut out = Vec::with_capacity(num);
    for _ in 0..num {
        let input_len = around(&mut rng, spec.input_len, spec.range_ratio);
        let output_len = around(&mut rng, spec.output_len, spec.range_ratio).max(1);
        let target = (spec.prefix_len + input_len).max(1);
        let mut ids = prefix.clone();
        ids.extend(draw(&mut rng, input_len));
        let mut prompt = tok.decode(&ids, true)?;
        let mut measured = count(tok, &prompt)?;
        for _ in 0..8 {
            if measured == target {
                break;
            }
            if measured < target {
                ids.extend(draw(&mut rng, target - measured));
            } else {
                // Drop from the end, never into the shared prefix.
                let keep = ids.len().saturating_sub(measured - target).max(prefix.len().min(ids.len()));
                if keep == ids.len() {
                    break;
                }
                ids.truncate(keep);
            }
            prompt = tok.decode(&ids, true)?;
            measured = count(tok, &prompt)?;
        }
        out.push(SampleRequest { prompt, prompt_len: measured, output_len, timestamp_s: None });
    }
    Ok(out)
}

#[derive(Deserialize)]
struct ShareGptEntry {
    #[serde(default)]
    conversations: Vec<Turn>,
}

#[derive(Deserialize)]
struct Turn {
    from: String,
    value: String,
}

/// ShareGPT: the first human turn is the prompt, the first gpt turn's token count the output
/// length (unless `fixed_output`). Entries are shuffled with `seed`, then filtered as vLLM does:
/// prompt < 4 or output < 4 tokens, prompt > 1024 or prompt + output > 2048 are skipped.
pub fn sharegpt(
    path: &Path,
    num: usize,
    fixed_output: Option<usize>,
    seed: u64,
    tok: &Tokenizer,
) -> Result<Vec<SampleRequest>> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let mut entries: Vec<ShareGptEntry> = serde_json::from_str(&text)
        .map_err(|e| BenchError::Dataset { path: path.into(), msg: format!("not a ShareGPT JSON array: {e}") })?;
    entries.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut out = Vec::new();
    for e in entries {
        if out.len() >= num {
            break;
        }
        let human = e.conversations.iter().find(|t| t.from == "human");
        let gpt = e.conversations.iter().find(|t| t.from == "gpt");
        let (Some(human), Some(gpt)) = (human, gpt) else { continue };
        let prompt_len = count(tok, &human.value)?;
        let output_len = match fixed_output {
            Some(n) => n.max(1),
            None => tok.encode(&gpt.value, false)?.len(),
        };
        let too_short = prompt_len < 4 || (fixed_output.is_none() && output_len < 4);
        if too_short || prompt_len > 1024 || prompt_len + output_len > 2048 {
            continue;
        }
        out.push(SampleRequest { prompt: human.value.clone(), prompt_len, output_len, timestamp_s: None });
    }
    if out.is_empty() {
        return Err(BenchError::Dataset { path: path.into(), msg: "no conversation passed the length filters".into() });
    }
    Ok(out)
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Builds prompts for trace lines from per-hash-id blocks of text.
struct BlockText<'a> {
    tok: &'a Tokenizer,
    vocab: Vec<u32>,
    block_size: usize,
    cache: HashMap<u64, Vec<u32>>,
}

impl BlockText<'_> {
    /// The block's token ids: `block_size` plain tokens from a ChaCha8 stream seeded by the id.
    fn ids(&mut self, hash_id: u64) -> &[u32] {
        let (vocab, n) = (&self.vocab, self.block_size);
        self.cache.entry(hash_id).or_insert_with(|| {
            let mut rng = ChaCha8Rng::seed_from_u64(hash_id);
            (0..n).map(|_| vocab[rng.random_range(0..vocab.len())]).collect()
        })
    }

    /// The prompt for a line: the blocks' texts in order, the last one cut so the ids total
    /// `input_length`; lines longer than their blocks are padded with a block seeded by the
    /// line number (offset past the u64 range of ids used in practice, so it is unique).
    fn prompt(&mut self, line_no: usize, hash_ids: &[u64], input_length: usize) -> Result<String> {
        let mut text = String::new();
        let mut left = input_length;
        let pad_ids: Vec<u64> =
            (0..input_length.saturating_sub(hash_ids.len() * self.block_size).div_ceil(self.block_size))
                .map(|k| u64::MAX - (line_no as u64) * 1024 - k as u64)
                .collect();
        for &h in hash_ids.iter().chain(&pad_ids) {
            if left == 0 {
                break;
            }
            let take = left.min(self.block_size);
            let ids = self.ids(h)[..take].to_vec();
            text.push_str(&self.tok.decode(&ids, true)?);
            left -= take;
        }
        Ok(text)
    }
}

/// Mooncake trace (JSONL): each line's `hash_ids` name blocks of `block_size` tokens, so lines
/// with equal hash-id prefixes get equal text prefixes; `timestamp` (ms) becomes the arrival
/// time. The first `num` lines (all when `None`).
pub fn mooncake(path: &Path, num: Option<usize>, block_size: usize, tok: &Tokenizer) -> Result<Vec<SampleRequest>> {
    if block_size == 0 {
        return Err(BenchError::InvalidArg("--trace-block-size must be positive".into()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let mut blocks = BlockText { tok, vocab: plain_token_ids(tok)?, block_size, cache: HashMap::new() };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        if num.is_some_and(|n| out.len() >= n) {
            break;
        }
        let l: MooncakeLine = serde_json::from_str(line)
            .map_err(|e| BenchError::Dataset { path: path.into(), msg: format!("line {}: {e}", i + 1) })?;
        let prompt = blocks.prompt(i, &l.hash_ids, l.input_length.max(1))?;
        let prompt_len = count(tok, &prompt)?;
        out.push(SampleRequest {
            prompt,
            prompt_len,
            output_len: l.output_length.max(1),
            timestamp_s: Some(l.timestamp / 1e3),
        });
    }
    if out.is_empty() {
        return Err(BenchError::Dataset { path: path.into(), msg: "no trace lines".into() });
    }
    Ok(out)
}
