//! The engine core: one model on one backend, its KV storage, the scheduler and the per-request
//! output state (sampler, incremental detokenizer, stop strings). Plain state: [`EngineCore::step`]
//! takes `now` and returns the token events of that step; the thread that drives it lives in
//! [`crate::handle`].

use std::collections::HashMap;
use std::time::Instant;

use cleave_kernels::{AttnSeq, Backend};
use cleave_protocol::{FinishReason, RequestId, SamplingParams, StopConditions, TokenEvent};
use cleave_tokenizer::{IncrementalDecoder, StopMatcher, Tokenizer};

use crate::model::{ForwardBatch, KvStorage, Model, ModelFiles, Workspace};
use crate::sampler::{Sampler, SamplerScratch};
use crate::sched::{Scheduler, SchedulerConfig, SeqRequest};
use crate::{EngineError, Result};

/// Engine settings; defaults in one place.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Token slots per KV block.
    pub block_size: usize,
    /// Bytes of K/V cache to allocate.
    pub kv_cache_memory: usize,
    /// Most tokens fed per step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output); None: the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// Seeds the samplers of requests that bring no seed of their own.
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_memory: 1 << 30,
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len: None,
            enable_prefix_caching: true,
            seed: 0,
        }
    }
}

/// One request as the engine takes it: token ids, validated parameters.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopConditions,
}

/// Output-side state of one live request.
struct SeqState {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    sampler: Sampler,
    detok: IncrementalDecoder,
    stop: StopMatcher,
    /// Prompt tokens served from the prefix cache (known after the first step that ran it).
    cached_tokens: u32,
}

/// Counters of what the engine has done (for benchmarks and metrics).
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
}

/// The engine's load at one moment, as nodes report it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineSnapshot {
    pub waiting: usize,
    pub running: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    /// Unreferenced blocks kept for prefix reuse (evictable).
    pub kv_blocks_cached: usize,
    pub kv_blocks_in_use: usize,
    pub preemptions: u64,
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
}

pub struct EngineCore<B: Backend> {
    backend: B,
    model: Model<B>,
    kv: KvStorage<B>,
    /// Activation buffers reused across steps.
    workspace: Workspace<B>,
    sched: Scheduler,
    tokenizer: Tokenizer,
    eos_token_ids: Vec<u32>,
    seqs: HashMap<u64, SeqState>,
    scratch: SamplerScratch,
    seed: u64,
    stats: EngineStats,
}

impl<B: Backend> EngineCore<B> {
    /// Loads the weights of `files` onto `backend` and sizes the KV cache from `cfg`.
    pub fn load(backend: B, files: ModelFiles, cfg: &EngineConfig) -> Result<Self> {
        let eos_token_ids = files.eos_token_ids();
        let model = Model::load(&backend, files.config.clone(), files.source.as_ref())?;
        Self::new(backend, model, files.tokenizer, eos_token_ids, cfg)
    }

    pub fn new(
        backend: B,
        model: Model<B>,
        tokenizer: Tokenizer,
        eos_token_ids: Vec<u32>,
        cfg: &EngineConfig,
    ) -> Result<Self> {
        let num_blocks = KvStorage::<B>::blocks_for_budget(&model.config, cfg.block_size, cfg.kv_cache_memory);
        if num_blocks == 0 {
            return Err(EngineError::Rejected(format!(
                "kv cache memory of {} bytes holds no block of {} bytes",
                cfg.kv_cache_memory,
                KvStorage::<B>::bytes_per_block(&model.config, cfg.block_size)
            )));
        }
        let max_model_len =
            cfg.max_model_len.unwrap_or(model.config.max_position_embeddings).min(model.max_positions());
        let sched = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_num_seqs: cfg.max_num_seqs,
            block_size: cfg.block_size,
            num_blocks,
            max_model_len,
            enable_prefix_caching: cfg.enable_prefix_caching,
            long_prefill_threshold: None,
        })?;
        let kv = KvStorage::new(&backend, &model.config, num_blocks, cfg.block_size)?;
        Ok(Self {
            backend,
            model,
            kv,
            workspace: Workspace::default(),
            sched,
            tokenizer,
            eos_token_ids,
            seqs: HashMap::new(),
            scratch: SamplerScratch::default(),
            seed: cfg.seed,
            stats: EngineStats::default(),
        })
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        let kv = self.sched.kv();
        EngineSnapshot {
            waiting: self.sched.num_waiting(),
            running: self.sched.num_running(),
            kv_blocks_total: kv.num_blocks(),
            kv_blocks_free: kv.num_free(),
            kv_blocks_cached: kv.num_cached(),
            kv_blocks_in_use: kv.num_in_use(),
            preemptions: self.sched.num_preemptions(),
            steps: self.stats.steps,
            prefill_tokens: self.stats.prefill_tokens,
            decode_tokens: self.stats.decode_tokens,
        }
    }

    pub fn max_model_len(&self) -> usize {
        self.sched.config().max_model_len
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.sched.is_idle()
    }

    /// Queues a request. Rejects (without side effects) one that can never be served.
    pub fn add_request(&mut self, req: EngineRequest, now: Instant) -> Result<()> {
        req.params.validate().map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= self.model.config.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.model.config.vocab_size
            )));
        }
        let id = req.id.0;
        let seq = SeqRequest {
            id,
            prompt: req.prompt.clone(),
            max_tokens: req.stop.max_tokens,
            eos_token_ids: self.eos_token_ids.clone(),
            stop_token_ids: req.stop.stop_token_ids.clone(),
            ignore_eos: req.stop.ignore_eos,
            arrival: now,
        };
        self.sched.add(seq)?;
        // Requests without a seed get one derived from the engine seed and their id, so a run
        // is reproducible without every request repeating the same random stream.
        let fallback = self.seed ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.seqs.insert(
            id,
            SeqState {
                sampler: Sampler::new(&req.params, fallback),
                detok: self.tokenizer.incremental_decoder(&req.prompt),
                stop: StopMatcher::new(req.stop.stop_strings.iter().cloned()),
                params: req.params,
                prompt: req.prompt,
                output: Vec::new(),
                cached_tokens: 0,
            },
        );
        Ok(())
    }

    /// Cancels a request; its blocks are freed at the next step, which reports it `Cancelled`.
    pub fn abort(&mut self, id: RequestId) {
        // Unknown ids (already finished) are fine: cancellation races completion.
        let _ = self.sched.abort(id.0);
    }

    /// The final event of a request that failed.
    pub fn error_event(&self, id: RequestId, err: &EngineError) -> TokenEvent {
        TokenEvent {
            request_id: id,
            token_id: None,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(FinishReason::Error),
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            error: Some(err.to_string()),
        }
    }

    /// Runs one iteration: schedule, forward, sample, commit. Returns the events it produced.
    pub fn step(&mut self, now: Instant) -> Result<Vec<TokenEvent>> {
        let batch = self.sched.schedule(now)?;
        let mut events = Vec::new();
        for &(id, reason) in &batch.finished {
            if let Some(seq) = self.seqs.remove(&id) {
                events.push(self.final_event(id, &seq, reason));
            }
        }
        for &(src, dst) in &batch.copies {
            self.kv.copy_block(&self.backend, src, dst)?;
        }
        if batch.items.is_empty() {
            return Ok(events);
        }
        self.stats.steps += 1;
        let block_size = self.kv.block_size();
        let mut tokens = Vec::with_capacity(batch.num_tokens());
        let mut positions = Vec::with_capacity(batch.num_tokens());
        let mut slots = Vec::with_capacity(batch.num_tokens());
        let mut logit_rows = Vec::new();
        let mut seqs = Vec::with_capacity(batch.items.len());
        for item in &batch.items {
            let q_start = tokens.len();
            tokens.extend_from_slice(&item.token_ids);
            positions.extend((item.start_pos..item.start_pos + item.token_ids.len()).map(|p| p as u32));
            slots.extend(item.slots(block_size));
            seqs.push(AttnSeq {
                q_start,
                q_len: item.token_ids.len(),
                context_len: item.start_pos + item.token_ids.len(),
                block_table: &item.block_table,
            });
            if item.sample {
                logit_rows.push((tokens.len() - 1) as u32);
            }
            if item.token_ids.len() == 1 && item.start_pos > 0 && item.sample {
                self.stats.decode_tokens += 1;
            } else {
                self.stats.prefill_tokens += item.token_ids.len() as u64;
            }
        }
        let fwd = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logit_rows: &logit_rows,
        };
        let logits = self.model.forward_with(&self.backend, fwd, &mut self.kv, &mut self.workspace)?;
        let vocab = self.model.config.vocab_size;
        let mut outputs = Vec::with_capacity(logit_rows.len());
        let mut logprobs = HashMap::new();
        for (row, item) in batch.items.iter().filter(|i| i.sample).enumerate() {
            let seq = self
                .seqs
                .get_mut(&item.seq_id)
                .ok_or_else(|| EngineError::Rejected(format!("scheduled unknown sequence {}", item.seq_id)))?;
            let sampled = seq.sampler.sample(
                &logits[row * vocab..(row + 1) * vocab],
                &seq.params,
                &seq.prompt,
                &seq.output,
                &mut self.scratch,
            )?;
            outputs.push((item.seq_id, sampled.token));
            if let Some(lp) = sampled.logprobs {
                logprobs.insert(item.seq_id, lp);
            }
        }
        let updates = self.sched.commit(&outputs, now)?;
        for upd in updates {
            let Some(seq) = self.seqs.get_mut(&upd.seq_id) else { continue };
            seq.output.push(upd.token);
            seq.cached_tokens = upd.cached_tokens;
            let text = seq.detok.push(upd.token)?;
            let mut finish = upd.finish;
            let mut out = seq.stop.push(&text);
            if out.stopped {
                if finish.is_none() {
                    // Ended by a stop string, which the scheduler cannot see.
                    self.sched.finish(upd.seq_id, FinishReason::Stop)?;
                }
                finish = Some(FinishReason::Stop);
            } else if finish.is_some() {
                let tail = seq.detok.finish()?;
                let more = seq.stop.push(&tail);
                out.emit.push_str(&more.emit);
                if !more.stopped {
                    out.emit.push_str(&seq.stop.flush());
                }
            }
            events.push(TokenEvent {
                request_id: RequestId(upd.seq_id),
                token_id: Some(upd.token),
                text: out.emit,
                logprobs: logprobs.remove(&upd.seq_id),
                finish_reason: finish,
                prompt_tokens: upd.prompt_tokens,
                cached_tokens: upd.cached_tokens,
                completion_tokens: upd.num_generated,
                error: None,
            });
            if finish.is_some() {
                self.seqs.remove(&upd.seq_id);
            }
        }
        Ok(events)
    }

    fn final_event(&self, id: u64, seq: &SeqState, reason: FinishReason) -> TokenEvent {
        TokenEvent {
            request_id: RequestId(id),
            token_id: None,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(reason),
            prompt_tokens: seq.prompt.len() as u32,
            cached_tokens: seq.cached_tokens,
            completion_tokens: seq.output.len() as u32,
            error: None,
        }
    }
}
