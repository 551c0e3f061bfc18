//! The [`Scheduler`]: sequence state, `schedule`, `commit`, `finish`/`abort`.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use cleave_protocol::FinishReason;

use super::pacing::{paced_chunk, Pace};
use super::{Batch, BatchItem, SchedError, SchedulerConfig, SeqRequest, SeqUpdate, StepCosts};
use crate::kv::{BlockPool, BlockTable, KvError, PrefixHit};

/// One sequence's state. `tokens` is prompt + generated; `table.num_tokens()` of them have
/// their K/V computed.
#[derive(Debug)]
struct Seq {
    arrival: Instant,
    /// Position in `add` order: breaks arrival ties.
    order: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: u32,
    eos_token_ids: Vec<u32>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    /// Empty while waiting.
    table: BlockTable,
    /// Prefix-cache hit of the first admission (what the client is told).
    first_cached: Option<usize>,
    /// Prefix-cache hit of the current admission.
    cached_now: usize,
    /// Tokens planned for the step being built or in flight (0: none).
    scheduled: usize,
    /// Copy-on-write copies planned for this sequence in the step being built.
    copies: Vec<(u32, u32)>,
    /// Set by `finish`/`abort`; applied at the next `schedule`.
    finishing: Option<FinishReason>,
    /// Set at the step after the first token this scheduler committed for it, when that token
    /// is out (see [`super::pacing`]); `pace_from` holds the count until then.
    pace: Option<Pace>,
    pace_from: Option<usize>,
}

impl Seq {
    fn priority(&self) -> (Instant, u64) {
        (self.arrival, self.order)
    }

    fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether the last token ends the sequence: stop token ids, then EOS unless
    /// `ignore_eos` -> `Stop`; `max_tokens` or `max_model_len` -> `Length`.
    fn finish_reason(&self, max_model_len: usize) -> Option<FinishReason> {
        let &token = self.tokens.last()?;
        if self.stop_token_ids.contains(&token) || (!self.ignore_eos && self.eos_token_ids.contains(&token)) {
            Some(FinishReason::Stop)
        } else if self.num_generated() >= self.max_tokens as usize || self.tokens.len() >= max_model_len {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// Continuous-batching scheduler owning the KV [`BlockPool`]. See the module docs for the
/// step protocol and invariants.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: BlockPool,
    seqs: HashMap<u64, Seq>,
    /// FCFS; preempted sequences go back to the front.
    waiting: VecDeque<u64>,
    /// Oldest first by (arrival, add order).
    running: Vec<u64>,
    /// Sequences marked by `finish`/`abort`, in call order.
    pending_finish: Vec<u64>,
    /// `(seq_id, sample)` of the items of the batch awaiting `commit`.
    in_flight: Option<Vec<(u64, bool)>>,
    next_order: u64,
    num_preemptions: u64,
    /// Time per output token the running decodes are paced to (None: not paced).
    tpot_target: Option<std::time::Duration>,
    /// The runner's latest step costs (None until it has measured them).
    costs: Option<StepCosts>,
    /// Steps whose prompt tokens pacing cut below what the budget allowed.
    num_paced_steps: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self, SchedError> {
        let bad = |what| Err(SchedError::InvalidConfig { what });
        if cfg.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if cfg.max_num_batched_tokens < cfg.max_num_seqs {
            return bad("max_num_batched_tokens must be at least max_num_seqs");
        }
        if cfg.max_model_len == 0 {
            return bad("max_model_len must be at least 1");
        }
        if cfg.long_prefill_threshold == Some(0) {
            return bad("long_prefill_threshold must be at least 1");
        }
        let kv = BlockPool::new(cfg.num_blocks, cfg.block_size)?.with_prefix_caching(cfg.enable_prefix_caching);
        Ok(Self {
            cfg,
            kv,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_finish: Vec::new(),
            in_flight: None,
            next_order: 0,
            num_preemptions: 0,
            tpot_target: None,
            costs: None,
            num_paced_steps: 0,
        })
    }

    /// Changes the step budget; refused below `max_num_seqs` (as at construction) or at 0.
    pub fn set_max_num_batched_tokens(&mut self, tokens: usize) -> Result<(), SchedError> {
        if tokens < self.cfg.max_num_seqs.max(1) {
            return Err(SchedError::InvalidConfig { what: "max_num_batched_tokens must be at least max_num_seqs" });
        }
        self.cfg.max_num_batched_tokens = tokens;
        Ok(())
    }

    /// Paces prompt chunks beside running decodes to a time per output token (see
    /// [`super::pacing`]); None: only the budget limits them. A zero target is refused.
    pub fn set_tpot_target(&mut self, target: Option<std::time::Duration>) -> Result<(), SchedError> {
        if target.is_some_and(|t| t.is_zero()) {
            return Err(SchedError::InvalidConfig { what: "the time per output token target must be above 0" });
        }
        self.tpot_target = target;
        Ok(())
    }

    pub fn tpot_target(&self) -> Option<std::time::Duration> {
        self.tpot_target
    }

    /// The step costs pacing sizes chunks with (the runner measures them).
    pub fn set_step_costs(&mut self, costs: StepCosts) {
        self.costs = Some(costs);
    }

    /// Steps whose prompt tokens pacing held below the budget.
    pub fn num_paced_steps(&self) -> u64 {
        self.num_paced_steps
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Read-only view of the block pool (free/cached counts, cached hashes, refcounts).
    pub fn kv(&self) -> &BlockPool {
        &self.kv
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Whether nothing is queued, running or pending a finish report.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty() && self.pending_finish.is_empty()
    }

    pub fn contains(&self, seq_id: u64) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// Blocks on the free list.
    pub fn kv_free_blocks(&self) -> usize {
        self.kv.num_free()
    }

    /// Cached-evictable blocks (refcount 0, reusable as prefix cache or as fresh blocks).
    pub fn kv_cached_blocks(&self) -> usize {
        self.kv.num_cached()
    }

    /// Fraction of blocks held by sequences.
    pub fn kv_usage(&self) -> f32 {
        self.kv.usage()
    }

    /// Keys of the blocks in the prefix cache (for the coordinator's routing).
    pub fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.kv.cached_hashes()
    }

    /// Prompt tokens still to compute: all of a waiting sequence's tokens (prefix-cache hits
    /// are only known at admission) and what is left of a running sequence's prefill.
    pub fn num_pending_prefill_tokens(&self) -> usize {
        self.seqs
            .values()
            .map(|s| {
                let left = s.tokens.len() - s.table.num_tokens();
                if left > 1 || s.num_generated() == 0 {
                    left
                } else {
                    0
                }
            })
            .sum()
    }

    /// Preemptions so far.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// The block ids of a sequence (empty while it waits).
    pub fn block_ids(&self, seq_id: u64) -> Option<&[u32]> {
        self.seqs.get(&seq_id).map(|s| s.table.blocks())
    }

    /// Prompt + generated tokens of a sequence.
    pub fn seq_tokens(&self, seq_id: u64) -> Option<&[u32]> {
        self.seqs.get(&seq_id).map(|s| s.tokens.as_slice())
    }

    /// Queues a request (FCFS). Rejects one that could never run: empty prompt, zero
    /// `max_tokens`, longer than `max_model_len`, or needing more blocks than the whole pool
    /// (`ceil((prompt + max_tokens) / block_size)`, which also covers one copy-on-write block).
    pub fn add(&mut self, req: SeqRequest) -> Result<(), SchedError> {
        self.validate(&req)?;
        let id = req.id;
        let seq = self.new_seq(req);
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Blocks for `num_tokens` token slots of a sequence whose K/V will arrive from elsewhere
    /// (a prefill node). Hand them to [`Scheduler::add_prefilled`] once filled, or back with
    /// [`Scheduler::release_reserved`].
    pub fn reserve_blocks(&mut self, num_tokens: usize) -> Result<Vec<u32>, SchedError> {
        Ok(self.kv.reserve(self.kv.blocks_for(num_tokens))?)
    }

    /// [`Scheduler::reserve_blocks`] for the K/V of `prompt`, whose leading full blocks may
    /// already be in the prefix cache: those blocks come first (a reference taken on each, so
    /// they stay cached and are never written: the sequence writes only past them), fresh
    /// ones after. Returns the blocks and how many leading tokens they already hold: whole
    /// blocks, and below `prompt.len()` (the last token's K/V always arrives, so the sequence
    /// owns the block it goes on writing into). All or nothing.
    pub fn reserve_blocks_for_prompt(&mut self, prompt: &[u32]) -> Result<(Vec<u32>, usize), SchedError> {
        let bs = self.kv.block_size();
        let hit = self.kv.find_prefix(prompt);
        let cached = hit.num_tokens(bs).min(prompt.len().saturating_sub(1) / bs * bs);
        let table = self.kv.adopt_prefix(&hit, cached)?;
        let fresh = match self.kv.reserve(self.kv.blocks_for(prompt.len()) - table.blocks().len()) {
            Ok(f) => f,
            Err(e) => {
                self.kv.free(table)?;
                return Err(e.into());
            }
        };
        let mut blocks = table.blocks().to_vec();
        blocks.extend(fresh);
        Ok((blocks, cached))
    }

    /// Returns reserved blocks that will not be used (e.g. the transfer failed).
    pub fn release_reserved(&mut self, blocks: &[u32]) -> Result<(), SchedError> {
        Ok(self.kv.release_blocks(blocks)?)
    }

    /// Adds a sequence whose prompt K/V is already in `blocks` (from
    /// [`Scheduler::reserve_blocks`], position order) and whose first token was sampled
    /// elsewhere. It joins `running` directly and decodes from the next step; its full prompt
    /// blocks are registered in the prefix cache. Returns `Some(reason)` when `first_token`
    /// already ends it (it is then not added).
    ///
    /// On `Ok` the blocks belong to the scheduler (released by it, now or later); on `Err` they
    /// are still the caller's. Fails with `NoSeqSlot` while `max_num_seqs` sequences run.
    pub fn add_prefilled(
        &mut self,
        req: SeqRequest,
        blocks: &[u32],
        first_token: u32,
    ) -> Result<Option<FinishReason>, SchedError> {
        self.validate(&req)?;
        if self.running.len() >= self.cfg.max_num_seqs {
            return Err(SchedError::NoSeqSlot { max_num_seqs: self.cfg.max_num_seqs });
        }
        let id = req.id;
        let mut seq = self.new_seq(req);
        let table = self.kv.table_from_blocks(blocks.to_vec(), &seq.tokens, seq.prompt_len)?;
        seq.table = table;
        seq.first_cached = Some(0);
        seq.tokens.push(first_token);
        if let Some(reason) = seq.finish_reason(self.cfg.max_model_len) {
            self.kv.free(seq.table)?;
            return Ok(Some(reason));
        }
        let priority = seq.priority();
        self.seqs.insert(id, seq);
        let at = self.running.partition_point(|r| self.seqs[r].priority() < priority);
        self.running.insert(at, id);
        Ok(None)
    }

    /// Queues a sequence that already generated `generated` elsewhere (a migrated stream): it
    /// prefills `prompt ++ generated` and samples the token after them; `generated` counts
    /// toward `max_tokens` and `SeqUpdate::num_generated`. Rejected like [`Scheduler::add`],
    /// and with `TooLong` when `generated` already reaches `max_tokens`.
    pub fn add_resumed(&mut self, req: SeqRequest, generated: &[u32]) -> Result<(), SchedError> {
        self.validate(&req)?;
        if generated.len() >= req.max_tokens as usize {
            return Err(SchedError::TooLong {
                id: req.id,
                prompt_len: req.prompt.len() + generated.len(),
                max_tokens: req.max_tokens,
                max_model_len: self.cfg.max_model_len,
            });
        }
        let id = req.id;
        let mut seq = self.new_seq(req);
        seq.tokens.extend_from_slice(generated);
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    fn validate(&self, req: &SeqRequest) -> Result<(), SchedError> {
        let id = req.id;
        if self.seqs.contains_key(&id) {
            return Err(SchedError::DuplicateSeq { id });
        }
        if req.prompt.is_empty() {
            return Err(SchedError::EmptyPrompt { id });
        }
        if req.max_tokens == 0 {
            return Err(SchedError::ZeroMaxTokens { id });
        }
        let total = req.prompt.len().saturating_add(req.max_tokens as usize);
        if total > self.cfg.max_model_len {
            return Err(SchedError::TooLong {
                id,
                prompt_len: req.prompt.len(),
                max_tokens: req.max_tokens,
                max_model_len: self.cfg.max_model_len,
            });
        }
        let need_blocks = self.kv.blocks_for(total);
        if need_blocks > self.kv.num_blocks() {
            return Err(SchedError::ExceedsKvCapacity { id, need_blocks, num_blocks: self.kv.num_blocks() });
        }
        Ok(())
    }

    fn new_seq(&mut self, req: SeqRequest) -> Seq {
        let order = self.next_order;
        self.next_order += 1;
        Seq {
            arrival: req.arrival,
            order,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            max_tokens: req.max_tokens,
            eos_token_ids: req.eos_token_ids,
            stop_token_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            table: BlockTable::default(),
            first_cached: None,
            cached_now: 0,
            scheduled: 0,
            copies: Vec::new(),
            finishing: None,
            pace: None,
            pace_from: None,
        }
    }

    /// Ends a sequence with `reason` (e.g. `Stop` for a stop string found in the text). Takes
    /// effect at the next `schedule`, which frees its blocks and reports it in
    /// `Batch::finished`; a token committed in between is not appended. The first call wins.
    pub fn finish(&mut self, seq_id: u64, reason: FinishReason) -> Result<(), SchedError> {
        let seq = self.seqs.get_mut(&seq_id).ok_or(SchedError::UnknownSeq { id: seq_id })?;
        if seq.finishing.is_none() {
            seq.finishing = Some(reason);
            self.pending_finish.push(seq_id);
        }
        Ok(())
    }

    /// Cancels a sequence: `finish(seq_id, FinishReason::Cancelled)`.
    pub fn abort(&mut self, seq_id: u64) -> Result<(), SchedError> {
        self.finish(seq_id, FinishReason::Cancelled)
    }

    fn chunk_limit(&self) -> usize {
        self.cfg.long_prefill_threshold.unwrap_or(usize::MAX)
    }

    /// Plans the next forward pass. Errors with `BatchInFlight` if the previous non-empty
    /// batch was not committed. An empty batch needs no commit. `now` is not used yet (the
    /// policy is pure FCFS by `SeqRequest::arrival`); it is taken so that time-based policies
    /// (queue timeouts, metrics) need no API change.
    pub fn schedule(&mut self, now: Instant) -> Result<Batch, SchedError> {
        if self.in_flight.is_some() {
            return Err(SchedError::BatchInFlight);
        }
        let mut batch = Batch::default();
        self.drain_finished(&mut batch)?;
        // A token committed by the last step is out now: the pace of a sequence's first one
        // starts here (the step that sampled it started a whole step earlier).
        for id in &self.running {
            let seq = self.seqs.get_mut(id).expect("running sequences exist");
            if let Some(generated_then) = seq.pace_from.take() {
                seq.pace = Some(Pace { since: now, generated_then });
            }
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut order = Vec::new();

        // Running sequences: decodes first, then unfinished prefills.
        for decode_pass in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let id = self.running[i];
                let seq = &self.seqs[&id];
                let remaining = seq.tokens.len() - seq.table.num_tokens();
                if seq.scheduled > 0 || (remaining == 1) != decode_pass {
                    i += 1;
                    continue;
                }
                let k = remaining.min(budget).min(self.chunk_limit());
                if self.try_grow(id, k)? {
                    budget -= k;
                    order.push(id);
                    i += 1;
                } else {
                    // Out of blocks: preempt the youngest running sequence (maybe this one,
                    // in which case index i now lies past the end).
                    let Some(&victim) = self.running.last() else {
                        break;
                    };
                    budget += self.preempt(victim, &mut batch)?;
                }
            }
            if decode_pass {
                if let Some(chunk) = self.paced_prompt_tokens(now, budget) {
                    if chunk < budget && self.has_prompt_work() {
                        self.num_paced_steps += 1;
                    }
                    budget = chunk;
                }
            }
        }

        if batch.preempted.is_empty() {
            self.admit_waiting(&mut budget, &mut order)?;
        }

        let bs = self.kv.block_size();
        for id in order {
            let seq = self.seqs.get_mut(&id).expect("scheduled sequences exist");
            if seq.scheduled == 0 {
                continue; // preempted after being planned
            }
            let start = seq.table.num_tokens();
            let end = start + seq.scheduled;
            batch.items.push(BatchItem {
                seq_id: id,
                token_ids: seq.tokens[start..end].to_vec(),
                start_pos: start,
                block_table: seq.table.blocks()[..end.div_ceil(bs)].to_vec(),
                sample: end == seq.tokens.len(),
                cached_tokens: seq.cached_now,
            });
            batch.copies.append(&mut seq.copies);
        }
        if !batch.items.is_empty() {
            self.in_flight = Some(batch.items.iter().map(|i| (i.seq_id, i.sample)).collect());
        }
        Ok(batch)
    }

    /// Prompt tokens this step may carry beside the decodes planned so far (see
    /// [`super::pacing`]); None when nothing paces it.
    fn paced_prompt_tokens(&self, now: Instant, budget: usize) -> Option<usize> {
        let (target, costs) = (self.tpot_target?, self.costs.filter(StepCosts::known)?);
        let allowance = self
            .running
            .iter()
            .map(|id| &self.seqs[id])
            .filter(|s| s.scheduled == 1 && s.tokens.len() - s.table.num_tokens() == 1)
            .filter_map(|s| Some(s.pace?.allowance_s(s.num_generated(), now, target)))
            .min_by(f64::total_cmp)?;
        Some(paced_chunk(allowance, &costs, budget))
    }

    /// Whether any sequence waits for prompt tokens (a running prefill or a waiting one).
    fn has_prompt_work(&self) -> bool {
        !self.waiting.is_empty()
            || self.running.iter().any(|id| {
                let s = &self.seqs[id];
                s.scheduled == 0 && s.tokens.len() - s.table.num_tokens() > 1
            })
    }

    /// Removes the sequences marked by `finish`/`abort`.
    fn drain_finished(&mut self, batch: &mut Batch) -> Result<(), SchedError> {
        for id in std::mem::take(&mut self.pending_finish) {
            let Some(seq) = self.seqs.remove(&id) else {
                continue;
            };
            self.running.retain(|&x| x != id);
            self.waiting.retain(|&x| x != id);
            self.kv.free(seq.table)?;
            batch.finished.push((id, seq.finishing.unwrap_or(FinishReason::Cancelled)));
        }
        Ok(())
    }

    /// Plans `k` more tokens for a running sequence; `Ok(false)` when blocks ran out.
    fn try_grow(&mut self, id: u64, k: usize) -> Result<bool, SchedError> {
        let seq = self.seqs.get_mut(&id).expect("running sequences exist");
        let end = seq.table.num_tokens() + k;
        match self.kv.prepare_write(&mut seq.table, end, &mut seq.copies) {
            Ok(()) => {
                seq.scheduled = k;
                Ok(true)
            }
            Err(KvError::OutOfBlocks { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Preempts a running sequence by recompute; returns the budget it had been given.
    fn preempt(&mut self, id: u64, batch: &mut Batch) -> Result<usize, SchedError> {
        let seq = self.seqs.get_mut(&id).expect("running sequences exist");
        let returned = std::mem::take(&mut seq.scheduled);
        seq.copies.clear();
        seq.cached_now = 0;
        let table = std::mem::take(&mut seq.table);
        self.running.retain(|&x| x != id);
        self.waiting.push_front(id);
        batch.preempted.push(id);
        self.num_preemptions += 1;
        self.kv.free(table)?;
        Ok(returned)
    }

    /// Admits waiting sequences FCFS while budget, `max_num_seqs` and blocks allow.
    fn admit_waiting(&mut self, budget: &mut usize, order: &mut Vec<u64>) -> Result<(), SchedError> {
        let bs = self.kv.block_size();
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let seq = self.seqs.get_mut(&id).expect("waiting sequences exist");
            let len = seq.tokens.len();
            let hit = if self.kv.prefix_caching() { self.kv.find_prefix(&seq.tokens) } else { PrefixHit::default() };
            // Never take the last token from the cache: its logits are needed.
            let cached = hit.num_tokens(bs).min(len - 1);
            let k = (len - cached).min(*budget).min(self.cfg.long_prefill_threshold.unwrap_or(usize::MAX));
            // Check before touching the pool, so a blocked head leaves the LRU order alone.
            let used_hits = &hit.blocks[..cached.div_ceil(bs)];
            let revived = used_hits.iter().filter(|&&b| self.kv.refcount(b) == Some(0)).count();
            let cow = usize::from(cached % bs != 0);
            let need = (cached + k).div_ceil(bs) - used_hits.len() + cow;
            if need + revived > self.kv.num_available() {
                break;
            }
            let mut table = self.kv.adopt_prefix(&hit, cached)?;
            let mut copies = Vec::new();
            if let Err(e) = self.kv.prepare_write(&mut table, cached + k, &mut copies) {
                self.kv.free(table)?;
                return match e {
                    KvError::OutOfBlocks { .. } => Ok(()),
                    e => Err(e.into()),
                };
            }
            seq.table = table;
            seq.copies = copies;
            seq.scheduled = k;
            seq.cached_now = cached;
            let prompt_len = seq.prompt_len;
            seq.first_cached.get_or_insert(cached.min(prompt_len));
            let priority = seq.priority();
            self.waiting.pop_front();
            let at = self.running.partition_point(|r| self.seqs[r].priority() < priority);
            self.running.insert(at, id);
            *budget -= k;
            order.push(id);
        }
        Ok(())
    }

    /// Applies a step's results: `outputs` holds exactly one `(seq_id, token)` for each item
    /// with `sample` in the batch in flight (any order). Commits the computed K/V (registering
    /// newly full blocks in the prefix cache), appends the tokens, detects finishes
    /// (stop token ids, then EOS unless `ignore_eos` -> `Stop`; `max_tokens` or
    /// `max_model_len` -> `Length`) and frees finished sequences' blocks. On a malformed
    /// `outputs` nothing changes and the batch stays in flight.
    pub fn commit(&mut self, outputs: &[(u64, u32)], _now: Instant) -> Result<Vec<SeqUpdate>, SchedError> {
        let Some(flight) = self.in_flight.take() else {
            return match outputs.first() {
                Some(&(id, _)) => Err(SchedError::UnexpectedOutput { id }),
                None => Ok(Vec::new()),
            };
        };
        if let Err(e) = Self::validate_outputs(&flight, outputs) {
            self.in_flight = Some(flight);
            return Err(e);
        }
        let sampled: HashMap<u64, u32> = outputs.iter().copied().collect();
        let mut updates = Vec::with_capacity(outputs.len());
        for (id, sample) in flight {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            let n = seq.table.num_tokens() + std::mem::take(&mut seq.scheduled);
            self.kv.commit(&mut seq.table, &seq.tokens, n)?;
            if !sample || seq.finishing.is_some() {
                continue;
            }
            let token = sampled[&id];
            seq.tokens.push(token);
            if seq.pace.is_none() && seq.pace_from.is_none() {
                seq.pace_from = Some(seq.num_generated());
            }
            let finish = seq.finish_reason(self.cfg.max_model_len);
            updates.push(SeqUpdate {
                seq_id: id,
                token,
                finish,
                num_generated: seq.num_generated() as u32,
                prompt_tokens: seq.prompt_len as u32,
                cached_tokens: seq.first_cached.unwrap_or(0) as u32,
            });
            if finish.is_some() {
                let seq = self.seqs.remove(&id).expect("present");
                self.running.retain(|&x| x != id);
                self.kv.free(seq.table)?;
            }
        }
        Ok(updates)
    }

    fn validate_outputs(flight: &[(u64, bool)], outputs: &[(u64, u32)]) -> Result<(), SchedError> {
        let mut seen: HashMap<u64, bool> = flight.iter().filter(|f| f.1).map(|&(id, _)| (id, false)).collect();
        for &(id, _) in outputs {
            match seen.get_mut(&id) {
                Some(s) if !*s => *s = true,
                _ => return Err(SchedError::UnexpectedOutput { id }),
            }
        }
        match flight.iter().find(|&&(id, sample)| sample && !seen[&id]) {
            Some(&(id, _)) => Err(SchedError::MissingOutput { id }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
