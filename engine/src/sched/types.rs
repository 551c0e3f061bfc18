//! The scheduler's inputs and outputs: requests in, batches out, per-sequence updates back.

use std::time::Instant;

use cleave_protocol::FinishReason;

/// One generation request as the scheduler sees it: token ids and stop conditions only.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    /// Unique among the scheduler's live sequences.
    pub id: u64,
    /// Must not be empty.
    pub prompt: Vec<u32>,
    /// Most tokens to generate; at least 1.
    pub max_tokens: u32,
    /// End-of-sequence ids: finish with `Stop` unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Always finish with `Stop` (the token is kept in the output).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Orders admission (FCFS, by `add` order) ties and preemption (latest arrival first).
    pub arrival: Instant,
}

impl SeqRequest {
    /// A request with no stop conditions besides `max_tokens`.
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: u32, arrival: Instant) -> Self {
        Self {
            id,
            prompt,
            max_tokens,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            arrival,
        }
    }
}

/// Work for one sequence in one forward pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchItem {
    pub seq_id: u64,
    /// Tokens to feed this step, at positions `start_pos..start_pos + token_ids.len()`.
    pub token_ids: Vec<u32>,
    /// Tokens whose K/V is already in the cache before these (the attention context).
    pub start_pos: usize,
    /// Blocks covering positions `0..start_pos + token_ids.len()`, in position order.
    pub block_table: Vec<u32>,
    /// Whether the logits of the last fed token produce a new token (a decode step, or the
    /// last chunk of a prefill). The runner returns exactly one token for each such item.
    pub sample: bool,
    /// Tokens of this sequence's current admission served from the prefix cache.
    pub cached_tokens: usize,
}

impl BatchItem {
    /// Flat KV slots (`block * block_size + offset`) of the tokens being written, in order.
    pub fn slots(&self, block_size: usize) -> impl Iterator<Item = u32> + '_ {
        let table = &self.block_table;
        (self.start_pos..self.start_pos + self.token_ids.len())
            .map(move |p| table[p / block_size] * block_size as u32 + (p % block_size) as u32)
    }

    /// Position of the last token fed (whose logits are sampled when `sample`).
    pub fn last_pos(&self) -> usize {
        self.start_pos + self.token_ids.len() - 1
    }
}

/// One scheduling step's plan.
///
/// The runner executes `copies` in order (copy every slot of block `src` into block `dst`,
/// for every layer's K and V) before the forward pass, runs `items`, and reports the sampled
/// tokens back through `Scheduler::commit`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub items: Vec<BatchItem>,
    /// Copy-on-write block copies `(src, dst)`.
    pub copies: Vec<(u32, u32)>,
    /// Sequences preempted this step (blocks freed; they will recompute, output unchanged).
    pub preempted: Vec<u64>,
    /// Sequences ended by `Scheduler::finish`/`abort` since the last step; their blocks are
    /// freed and they are gone from the scheduler.
    pub finished: Vec<(u64, FinishReason)>,
}

impl Batch {
    /// Tokens fed this step, over all items.
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.token_ids.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// What happened to one sequence when a step was committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqUpdate {
    pub seq_id: u64,
    /// The token sampled this step (already appended to the sequence).
    pub token: u32,
    /// Set when this token ends the sequence; its blocks are already freed.
    pub finish: Option<FinishReason>,
    /// Tokens generated so far, this one included.
    pub num_generated: u32,
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache on the sequence's first admission.
    pub cached_tokens: u32,
}
