//! The engine side of disaggregated serving: prefill-only requests that export their K/V layer
//! by layer ([`crate::export`]), and requests whose prompt K/V is imported from another engine
//! ([`crate::import`]). The module docs there state the contracts; this file wires them into
//! [`EngineCore`].

use std::collections::HashSet;
use std::time::Instant;

use cleave_kernels::Backend;
use cleave_protocol::{FinishReason, KvLayout, RequestId, TokenEvent};

use super::{EngineCore, EngineRequest, Parked};
use crate::export::{ExportItem, ExportState, KvChunk, KvExport, KvExportEvent};
use crate::import::{ImportGrant, ImportStart, KvRows};
use crate::sched::{Batch, SchedError};
use crate::{EngineError, Result};

/// The finish of a prefill-only request's first token, which the scheduler ran with
/// `max_tokens` 1 (so it always reports a finish): `None` when the request goes on elsewhere.
pub(super) fn handoff_finish(sched: Option<FinishReason>, max_tokens: u32, context_full: bool) -> Option<FinishReason> {
    match sched {
        Some(FinishReason::Length) if max_tokens > 1 && !context_full => None,
        other => other,
    }
}

/// `params` with `seed` in place of its own, when given.
fn seeded(params: cleave_protocol::SamplingParams, seed: Option<u64>) -> cleave_protocol::SamplingParams {
    match seed {
        Some(s) => cleave_protocol::SamplingParams { seed: Some(s), ..params },
        None => params,
    }
}

impl<B: Backend> EngineCore<B> {
    /// The layout of this engine's KV blocks, with the model's identity as its fingerprint
    /// (the same for every storage format of one model: see [`crate::model::identity`]): what a
    /// handoff ticket carries so that both sides can check they agree before any byte moves.
    pub fn kv_layout(&self) -> KvLayout {
        let c = &self.model.config;
        KvLayout {
            model_fingerprint: self.identity,
            dtype: self.kv.dtype(),
            num_layers: c.num_layers as u32,
            num_kv_heads: c.num_kv_heads as u32,
            head_dim: c.head_dim as u32,
            block_size: self.kv.block_size() as u32,
        }
    }

    /// Queues a prefill-only request: its prompt K/V goes to `export` layer by layer as it is
    /// computed and it ends after its first token (contract in [`crate::export`]). Rejected
    /// like [`EngineCore::add_request`], and also when `prompt + max_tokens` exceeds
    /// `max_model_len` (the decode side could not continue it).
    pub fn add_prefill_only(&mut self, req: EngineRequest, export: KvExport, now: Instant) -> Result<()> {
        self.check_request(&req)?;
        self.check_new_id(req.id)?;
        let mut seq = self.seq_request(&req, now);
        let max_model_len = self.max_model_len();
        if seq.max_tokens == 0 {
            return Err(SchedError::ZeroMaxTokens { id: seq.id }.into());
        }
        if seq.prompt.len().saturating_add(seq.max_tokens as usize) > max_model_len {
            return Err(SchedError::TooLong {
                id: seq.id,
                prompt_len: seq.prompt.len(),
                max_tokens: seq.max_tokens,
                max_model_len,
            }
            .into());
        }
        let constraint = self.start_constraint(&req, &[])?;
        let max_tokens = std::mem::replace(&mut seq.max_tokens, 1);
        self.sched.add(seq)?;
        let id = req.id.0;
        let mut state = self.seq_state(req, None);
        state.export = Some(ExportState::new(export, max_tokens));
        state.constraint = constraint;
        self.seqs.insert(id, state);
        Ok(())
    }

    /// Queues a request that already generated `generated` on another engine (a migrated
    /// stream): this engine prefills `prompt ++ generated` and continues, its events starting
    /// with the token after `generated`. `generated` counts toward `max_tokens` and in
    /// `completion_tokens`; the text state replays it (its text is not sent again) and the
    /// sampler continues the same random stream when `sampler_seed` is the original one
    /// (`None`: derived as for a plain request).
    pub fn add_resumed(
        &mut self,
        req: EngineRequest,
        generated: Vec<u32>,
        sampler_seed: Option<u64>,
        now: Instant,
    ) -> Result<()> {
        if generated.is_empty() {
            return self.add_request(EngineRequest { params: seeded(req.params.clone(), sampler_seed), ..req }, now);
        }
        self.check_request(&req)?;
        self.check_new_id(req.id)?;
        let vocab = self.model.config.vocab_size;
        if let Some(&bad) = generated.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "generated token id {bad} is outside the vocabulary of {vocab} tokens"
            )));
        }
        let constraint = self.start_constraint(&req, &generated)?;
        let id = req.id.0;
        let seq = self.seq_request(&req, now);
        let mut state = self.seq_state(req, sampler_seed);
        state.constraint = constraint;
        for &t in &generated {
            let text = state.detok.push(t)?;
            state.stop.push(&text);
        }
        self.sched.add_resumed(seq, &generated)?;
        state.output = generated;
        self.seqs.insert(id, state);
        Ok(())
    }

    fn check_new_id(&self, id: RequestId) -> Result<()> {
        if self.sched.contains(id.0) || self.imports.contains(id.0) || self.parked.iter().any(|p| p.seq.id == id.0) {
            return Err(EngineError::DuplicateImport { id });
        }
        Ok(())
    }

    /// Reserves blocks for `num_tokens` prompt tokens of request `id` whose K/V will arrive
    /// with [`EngineCore::import_kv`]; returns their ids in position order. Refused up front,
    /// changing nothing, when the pool cannot supply them (`ImportRefused`), when `id` is
    /// already live here, or when `num_tokens` is 0 or leaves no room under `max_model_len`.
    pub fn reserve_import(&mut self, id: RequestId, num_tokens: usize) -> Result<Vec<u32>> {
        self.check_new_id(id)?;
        let layers = self.model.config.num_layers;
        Ok(self.imports.reserve(&mut self.sched, id, num_tokens, layers, None)?.0)
    }

    /// [`EngineCore::reserve_import`] for the K/V of `prompt`: leading full blocks of it found
    /// in the prefix cache are reserved as they are (pinned for the import) and count as
    /// arrived, so only tokens `cached_tokens..` must come with [`EngineCore::import_kv`].
    /// `cached_tokens` is a multiple of the block size below the prompt's length.
    pub fn reserve_import_prompt(&mut self, id: RequestId, prompt: &[u32]) -> Result<ImportGrant> {
        self.check_new_id(id)?;
        let layers = self.model.config.num_layers;
        let (blocks, cached_tokens) = self.imports.reserve(&mut self.sched, id, prompt.len(), layers, Some(prompt))?;
        Ok(ImportGrant { blocks, cached_tokens })
    }

    /// Writes K and V rows of one layer for positions `token_start..` (the layout of
    /// [`KvChunk`]; their length gives the count) into `id`'s reservation. Errors, writing
    /// nothing and keeping the reservation, on an unknown id, a layer out of range, unequal or
    /// partial-token lengths, or positions past the reservation.
    pub fn import_kv(&mut self, id: RequestId, layer: u32, token_start: u32, k: &[u8], v: &[u8]) -> Result<()> {
        self.imports.write(&self.backend, &mut self.kv, id, KvRows { layer, token_start, k, v })
    }

    /// Gives `id`'s reserved blocks back (lease expired, transfer failed).
    pub fn release_import(&mut self, id: RequestId) -> Result<()> {
        self.imports.release(&mut self.sched, id)
    }

    /// Releases every reservation and every import waiting for a slot (engine shutdown).
    pub fn release_all_imports(&mut self) -> Result<()> {
        let mut result = self.imports.release_all(&mut self.sched);
        for p in std::mem::take(&mut self.parked) {
            if let Err(e) = self.sched.release_reserved(&p.blocks) {
                result = result.and(Err(e.into()));
            }
        }
        result
    }

    /// Starts decoding request `req` whose prompt K/V fills `req.id`'s reservation and whose
    /// first token `start.first_token` was sampled (and streamed) by the prefill node. Its
    /// events start with the second token; `completion_tokens` counts the first. Consumes the
    /// reservation on every outcome: on error its blocks are released. When no sequence slot
    /// is free the request waits (holding its blocks) and starts at a later step, in order.
    /// When the first token already ends the request, its only event is a final one without a
    /// token.
    pub fn add_imported(&mut self, req: EngineRequest, start: ImportStart, now: Instant) -> Result<()> {
        let id = req.id;
        if !self.imports.contains(id.0) {
            return Err(EngineError::UnknownImport { id });
        }
        let vocab = self.model.config.vocab_size;
        let checked = self.check_request(&req).and_then(|()| {
            if start.first_token as usize >= vocab {
                return Err(EngineError::InvalidRequest(format!(
                    "first token {} is outside the vocabulary of {vocab} tokens",
                    start.first_token
                )));
            }
            if self.sched.contains(id.0) {
                return Err(EngineError::DuplicateImport { id });
            }
            self.start_constraint(&req, &[start.first_token])
        });
        let constraint = match checked {
            Ok(c) => c,
            Err(e) => {
                self.imports.release(&mut self.sched, id)?;
                return Err(e);
            }
        };
        let blocks = self.imports.take_complete(&mut self.sched, id, req.prompt.len())?;
        let seq = self.seq_request(&req, now);
        let mut state = self.seq_state(req, start.sampler_seed);
        // A first token that completes the text would have ended the request on the prefill
        // side; should one arrive anyway, nothing may follow it.
        let complete = constraint.as_ref().is_some_and(cleave_constrain::ConstraintState::is_done);
        state.constraint = constraint;
        // Replay the first token through the text state: its text was streamed by the prefill
        // node, but what the decoder and the stop matcher hold back must be held here too.
        let replay = match state.detok.push(start.first_token) {
            Ok(text) => state.stop.push(&text),
            Err(e) => {
                self.sched.release_reserved(&blocks)?;
                return Err(e.into());
            }
        };
        state.output.push(start.first_token);
        state.cached_tokens = start.cached_tokens;
        state.cached_override = Some(start.cached_tokens);
        if replay.stopped || complete {
            self.sched.release_reserved(&blocks)?;
            self.pending.push(self.final_event(id.0, &state, FinishReason::Stop));
            return Ok(());
        }
        let parked = Parked { seq, state, blocks, first_token: start.first_token };
        if !self.parked.is_empty() {
            self.parked.push_back(parked);
            return Ok(());
        }
        let mut events = Vec::new();
        let result = self.place(parked, &mut events);
        self.pending.append(&mut events);
        if let Some(back) = result? {
            self.parked.push_back(back);
        }
        Ok(())
    }

    /// Tries to start an import whose K/V is complete; gives it back when no slot is free.
    fn place(&mut self, p: Parked, events: &mut Vec<TokenEvent>) -> Result<Option<Parked>> {
        let id = p.seq.id;
        match self.sched.add_prefilled(p.seq.clone(), &p.blocks, p.first_token) {
            Ok(None) => {
                self.seqs.insert(id, p.state);
                Ok(None)
            }
            Ok(Some(reason)) => {
                // The scheduler freed the blocks.
                events.push(self.final_event(id, &p.state, reason));
                Ok(None)
            }
            Err(SchedError::NoSeqSlot { .. }) => Ok(Some(p)),
            Err(e) => {
                self.sched.release_reserved(&p.blocks)?;
                Err(e.into())
            }
        }
    }

    /// Starts parked imports, oldest first, while slots are free (at the start of a step).
    pub(super) fn admit_parked(&mut self, events: &mut Vec<TokenEvent>) -> Result<()> {
        while let Some(p) = self.parked.pop_front() {
            let id = RequestId(p.seq.id);
            match self.place(p, events) {
                Ok(None) => {}
                Ok(Some(back)) => {
                    self.parked.push_front(back);
                    break;
                }
                Err(e) => events.push(self.error_event(id, &e)),
            }
        }
        Ok(())
    }

    /// Drops `id`'s reservation or parked import, if any (a parked one reports `Cancelled`).
    pub(super) fn abort_import(&mut self, id: RequestId) {
        if self.imports.contains(id.0) {
            let _ = self.imports.release(&mut self.sched, id);
        }
        if let Some(at) = self.parked.iter().position(|p| p.seq.id == id.0) {
            let p = self.parked.remove(at).expect("position is in range");
            let _ = self.sched.release_reserved(&p.blocks);
            self.pending.push(self.final_event(id.0, &p.state, FinishReason::Cancelled));
        }
    }

    /// Before the forward pass: sends the prefix-cache part of the prefill-only requests of
    /// `batch` (tokens they did not compute), every layer, and returns what the pass itself
    /// must export.
    pub(super) fn export_cached(&mut self, batch: &Batch) -> Result<Vec<ExportItem>> {
        let mut items = Vec::new();
        let num_layers = self.model.config.num_layers;
        for item in &batch.items {
            let Some(exp) = self.seqs.get_mut(&item.seq_id).and_then(|s| s.export.as_mut()) else { continue };
            let end = item.start_pos + item.token_ids.len();
            if exp.exported < item.start_pos {
                for layer in 0..num_layers {
                    let (k, v) =
                        self.kv.export_rows(&self.backend, layer, &item.block_table, exp.exported, item.start_pos)?;
                    exp.send(KvExportEvent::Chunk(KvChunk {
                        request_id: RequestId(item.seq_id),
                        layer: layer as u32,
                        token_start: exp.exported as u32,
                        token_count: (item.start_pos - exp.exported) as u32,
                        k,
                        v,
                    }));
                }
                exp.exported = item.start_pos;
            }
            let from = exp.exported.max(item.start_pos);
            if from < end {
                items.push(ExportItem { seq_id: item.seq_id, from, to: end, block_table: item.block_table.clone() });
            }
        }
        Ok(items)
    }

    /// After the forward pass: records what was exported, and fails every prefill-only request
    /// whose sink refused an event (error event now; blocks freed at the next step). Returns
    /// the failed ids, whose sampled rows must be ignored.
    pub(super) fn finish_exports(
        &mut self,
        exports: &[ExportItem],
        events: &mut Vec<TokenEvent>,
    ) -> Result<HashSet<u64>> {
        for item in exports {
            if let Some(exp) = self.seqs.get_mut(&item.seq_id).and_then(|s| s.export.as_mut()) {
                exp.exported = exp.exported.max(item.to);
            }
        }
        let failed: Vec<_> = self.seqs.iter().filter_map(|(&id, s)| Some((id, s.export.as_ref()?.failed?))).collect();
        let mut ids = HashSet::new();
        for (id, source) in failed {
            self.seqs.remove(&id);
            let rid = RequestId(id);
            events.push(self.error_event(rid, &EngineError::KvExport { id: rid, source }));
            if self.sched.contains(id) {
                self.sched.finish(id, FinishReason::Error)?;
            }
            ids.insert(id);
        }
        Ok(ids)
    }
}
