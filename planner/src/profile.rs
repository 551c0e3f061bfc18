//! The measured cost profile of one engine on one machine: what `cleave bench profile` writes,
//! `cleave bench simulate` runs on and the coordinator's planner predicts with
//! (`--planner-profile`). Plain serde data, so neither this crate nor its readers depend on the
//! engine; reading and writing the file is the callers' (this crate does no I/O).
//!
//! Invariant (checked by [`Profile::validate`]): every time is finite and positive, the prefill
//! grid has at least one point without a cached prefix, and the decode points form a full
//! batch × context grid.

use serde::{Deserialize, Serialize};

use crate::error::PlannerError;

/// Current format version of the profile file.
pub const PROFILE_VERSION: u32 = 1;

/// Wall time of one prefill of `tokens` new prompt tokens after `cached_prefix` tokens already in
/// the KV cache (0: a cold prompt).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillPoint {
    pub tokens: usize,
    #[serde(default)]
    pub cached_prefix: usize,
    pub seconds: f64,
}

/// Wall time of one decode step of `batch` sequences, each with `context` tokens in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    pub batch: usize,
    pub context: usize,
    pub seconds: f64,
}

/// Wall time of one step that carries a prefill chunk of `prefill_tokens` (a cold prompt) beside
/// `decode_batch` decodes of `context` tokens each: what a colocated node runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MixedPoint {
    pub prefill_tokens: usize,
    pub decode_batch: usize,
    pub context: usize,
    pub seconds: f64,
}

/// One engine's measured costs and the limits it ran with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    #[serde(default = "default_version")]
    pub version: u32,
    /// Model name (folder name or hub id).
    pub model: String,
    /// When it was measured (RFC 3339, UTC).
    #[serde(default)]
    pub date: String,
    /// Compute threads the engine ran with.
    pub threads: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most tokens per engine step.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// KV bytes one token occupies over all layers (K and V): the handoff payload per token.
    pub kv_bytes_per_token: u64,
    /// Tokens the KV cache holds (blocks × block size).
    pub kv_capacity_tokens: usize,
    pub prefill: Vec<PrefillPoint>,
    pub decode: Vec<DecodePoint>,
    #[serde(default)]
    pub mixed: Vec<MixedPoint>,
}

fn default_version() -> u32 {
    PROFILE_VERSION
}

impl Profile {
    /// A small synthetic profile (prefill 4 ms at 16 tokens to 1 s at 4096; decode 10-15 ms
    /// over batch 1-16 and context 128-1024): for tests and examples, not a measurement.
    pub fn synthetic() -> Profile {
        let prefill = [(16, 0.004), (64, 0.01), (256, 0.03), (1024, 0.15), (4096, 1.0)]
            .iter()
            .map(|&(n, t)| PrefillPoint { tokens: n, cached_prefix: 0, seconds: t })
            .collect();
        let mut decode = Vec::new();
        for (i, b) in [1usize, 4, 16].iter().enumerate() {
            for (j, c) in [128usize, 1024].iter().enumerate() {
                decode.push(DecodePoint {
                    batch: *b,
                    context: *c,
                    seconds: 0.01 + 0.002 * i as f64 + 0.001 * j as f64,
                });
            }
        }
        Profile {
            version: PROFILE_VERSION,
            model: "synthetic".into(),
            date: String::new(),
            threads: 1,
            block_size: 16,
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            kv_bytes_per_token: 1000,
            kv_capacity_tokens: 100_000,
            prefill,
            decode,
            mixed: vec![],
        }
    }

    /// Checks the invariants in the module docs.
    pub fn validate(&self) -> Result<(), PlannerError> {
        let bad = |what: String| Err(PlannerError::InvalidProfile(what));
        if self.version != PROFILE_VERSION {
            return bad(format!("version {} (this build reads {PROFILE_VERSION})", self.version));
        }
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 || self.block_size == 0 {
            return bad("max_num_batched_tokens, max_num_seqs and block_size must be positive".into());
        }
        let times = self
            .prefill
            .iter()
            .map(|p| p.seconds)
            .chain(self.decode.iter().map(|d| d.seconds))
            .chain(self.mixed.iter().map(|m| m.seconds));
        for t in times {
            if !(t.is_finite() && t > 0.0) {
                return bad(format!("time {t} is not a positive number of seconds"));
            }
        }
        if !self.prefill.iter().any(|p| p.cached_prefix == 0 && p.tokens > 0) {
            return bad("no prefill point without a cached prefix".into());
        }
        if self.decode.iter().any(|d| d.batch == 0) {
            return bad("decode point with batch 0".into());
        }
        let (batches, contexts) = decode_axes(&self.decode);
        if batches.is_empty() {
            return bad("no decode points".into());
        }
        for &b in &batches {
            for &c in &contexts {
                if !self.decode.iter().any(|d| d.batch == b && d.context == c) {
                    return bad(format!("decode grid lacks batch {b} × context {c}"));
                }
            }
        }
        Ok(())
    }
}

/// The sorted, deduplicated batch and context axes of a decode grid.
pub fn decode_axes(points: &[DecodePoint]) -> (Vec<usize>, Vec<usize>) {
    let mut b: Vec<usize> = points.iter().map(|d| d.batch).collect();
    let mut c: Vec<usize> = points.iter().map(|d| d.context).collect();
    b.sort_unstable();
    b.dedup();
    c.sort_unstable();
    c.dedup();
    (b, c)
}
