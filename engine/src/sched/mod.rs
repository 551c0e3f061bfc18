//! Iteration-level continuous batching with a per-step token budget (vLLM-v1-like).
//!
//! Allowed dependencies: [`crate::kv`] and protocol's `FinishReason`. Plain state, no async,
//! no clock of its own: `schedule` and `commit` take `now`.
//!
//! A step is `schedule(now) -> Batch`, the runner's forward pass, then `commit(outputs, now)`.
//! Each step: (1) sequences ended by `finish`/`abort` are removed and their blocks freed;
//! (2) every running sequence that is decoding gets its one token; (3) running sequences still
//! in prefill get (chunked) prefill tokens; (4) waiting sequences are admitted FCFS, each with
//! its prompt's full blocks looked up in the prefix cache. Steps 2–4 share
//! `max_num_batched_tokens`; at most `max_num_seqs` sequences run. When a running sequence
//! needs a block and none can be had (even by evicting cached ones), the youngest running
//! sequence (latest arrival) is preempted by recompute: its blocks are freed and it goes back
//! to the front of the waiting queue with prompt + generated tokens as its new prompt, so its
//! output is unchanged. No admission happens in a step that preempted.
//!
//! Invariants:
//! - a sequence is in exactly one of `waiting` (holding no blocks) or `running`;
//! - `running` is ordered by (arrival, add order), oldest first; `running.len() <=
//!   max_num_seqs`;
//! - for every sequence, `table.num_tokens() < tokens.len()`: the last token is never in the
//!   cache (it is the next one to feed), which also guarantees at least one token is computed
//!   for logits even when the whole prompt is in the prefix cache;
//! - prefix-cache registration happens only in `commit`, after the K/V was computed.
//!
//! Liveness: the oldest running sequence is only ever preempted when it is alone, and `add`
//! rejects any request that could not fit in the whole pool alone, so the oldest sequence
//! always makes progress.

pub mod pacing;
mod scheduler;
mod types;

pub use pacing::StepCosts;
pub use scheduler::Scheduler;
pub use types::{Batch, BatchItem, SeqRequest, SeqUpdate};

use serde::Deserialize;

use crate::kv::{KvError, DEFAULT_BLOCK_SIZE};

/// Limits of the scheduler and the size of the KV pool it manages.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// Most tokens fed per step over all sequences (at least `max_num_seqs`).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Token slots per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Most tokens (prompt + generated) in one sequence.
    pub max_model_len: usize,
    /// Reuse computed K/V of identical prompt prefixes.
    pub enable_prefix_caching: bool,
    /// Most prefill tokens one sequence gets per step (None: only the budget limits it).
    pub long_prefill_threshold: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks: 1024,
            max_model_len: 4096,
            enable_prefix_caching: true,
            long_prefill_threshold: None,
        }
    }
}

/// What can go wrong in the scheduler. Every variant leaves the scheduler unchanged except
/// `Kv`, which means an internal invariant broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    #[error("invalid scheduler config: {what}")]
    InvalidConfig { what: &'static str },
    #[error("sequence {id} already exists")]
    DuplicateSeq { id: u64 },
    #[error("sequence {id} has an empty prompt")]
    EmptyPrompt { id: u64 },
    #[error("sequence {id} asks for max_tokens 0 (at least 1)")]
    ZeroMaxTokens { id: u64 },
    #[error(
        "sequence {id}: prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds \
         max_model_len {max_model_len}"
    )]
    TooLong { id: u64, prompt_len: usize, max_tokens: u32, max_model_len: usize },
    #[error("sequence {id} needs {need_blocks} KV blocks at most, the whole pool has {num_blocks}")]
    ExceedsKvCapacity { id: u64, need_blocks: usize, num_blocks: usize },
    #[error("{max_num_seqs} sequences already run")]
    NoSeqSlot { max_num_seqs: usize },
    #[error("unknown sequence {id}")]
    UnknownSeq { id: u64 },
    #[error("a batch is in flight: commit it before scheduling again")]
    BatchInFlight,
    #[error("output for sequence {id}, which was not sampled in the batch in flight (or twice)")]
    UnexpectedOutput { id: u64 },
    #[error("no output for sequence {id}, which was sampled in the batch in flight")]
    MissingOutput { id: u64 },
    #[error(transparent)]
    Kv(#[from] KvError),
}
