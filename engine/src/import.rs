//! KV imports: the decode side of a handoff.
//!
//! Life of an import, all on the engine thread, keyed by the request id:
//!
//! 1. [`crate::EngineCore::reserve_import`]`(id, num_tokens)` takes
//!    `ceil(num_tokens / block_size)` fresh blocks (refused up front, with no side effect, when
//!    the pool cannot supply them) and returns their ids in position order.
//!    [`crate::EngineCore::reserve_import_prompt`]`(id, prompt)` does the same for a known
//!    prompt, whose leading full blocks may come from the prefix cache: those rows are covered
//!    from the start, and only the rest must arrive (a delta handoff). A cached block is shared
//!    and never written: the import writes past it, and at least the last token arrives.
//! 2. [`crate::EngineCore::import_kv`]`(id, layer, token_start, k, v)` writes rows (the layout of
//!    [`crate::export::KvChunk`]) into those blocks. Chunks may come in any order and may repeat
//!    (a rewrite is harmless); a bad chunk is an error that leaves the reservation alone.
//! 3. [`crate::EngineCore::add_imported`]`(req, start)` checks that every layer covers every
//!    prompt token, and turns the reservation into a running sequence that decodes from the
//!    token after `start.first_token`; or [`crate::EngineCore::release_import`]`(id)` gives the
//!    blocks back (lease expiry, failed transfer).
//!
//! Ownership: from `reserve_import` until `add_imported` or `release_import` the blocks belong to
//! the reservation; `add_imported` consumes the reservation on every outcome (success: the
//! scheduler owns the blocks; error: they are released). `abort(id)` releases a reservation,
//! and a shutting-down engine releases them all. So a reserved block is freed on every path.
//!
//! Equality with a single engine: the imported K/V is bit-identical to what the prefill engine
//! computed; the decode side replays the first token through its incremental detokenizer and
//! stop-string matcher (discarding the text, which the prefill node already streamed, but
//! keeping what they hold back), counts it in `completion_tokens`, and seeds the sampler with
//! the prefill side's seed. The sampler's draw for output position `i` depends only on the seed
//! and `i` (see [`crate::sampler`]), so seeded sampling continues exactly the stream a single
//! engine would have produced.

use std::collections::HashMap;

use cleave_kernels::Backend;
use cleave_protocol::RequestId;

use crate::model::KvStorage;
use crate::sched::Scheduler;
use crate::{EngineError, Result};

/// How an imported request starts decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportStart {
    /// The token the prefill node sampled (and already streamed to the client).
    pub first_token: u32,
    /// The prefill side's sampler seed ([`crate::export::ExportDone::sampler_seed`]); `None`:
    /// derive it as a plain request would (the request's seed, else this engine's seed and id).
    pub sampler_seed: Option<u64>,
    /// Prompt tokens the prefill node served from its prefix cache, reported in usage.
    pub cached_tokens: u32,
}

/// A reservation for a known prompt ([`crate::EngineCore::reserve_import_prompt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportGrant {
    /// Blocks in position order; the first `cached_tokens / block_size` hold a cached prefix.
    pub blocks: Vec<u32>,
    /// Leading prompt tokens whose K/V the blocks already hold (0: none).
    pub cached_tokens: usize,
}

/// One chunk's rows as [`crate::EngineCore::import_kv`] takes them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvRows<'a> {
    pub layer: u32,
    pub token_start: u32,
    pub k: &'a [u8],
    pub v: &'a [u8],
}

/// One reservation.
#[derive(Debug)]
struct Import {
    blocks: Vec<u32>,
    num_tokens: usize,
    /// `covered[layer * num_tokens + pos]`: the row has been written.
    covered: Vec<bool>,
    /// Tokens covered per layer.
    have: Vec<usize>,
}

/// The reservations of one engine.
#[derive(Debug, Default)]
pub(crate) struct Imports {
    map: HashMap<u64, Import>,
}

impl Imports {
    pub fn contains(&self, id: u64) -> bool {
        self.map.contains_key(&id)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Blocks held by reservations.
    pub fn num_blocks(&self) -> usize {
        self.map.values().map(|i| i.blocks.len()).sum()
    }

    /// A reservation for `num_tokens` tokens; with `prompt` (of that length), its leading
    /// blocks may come from the prefix cache ([`Scheduler::reserve_blocks_for_prompt`]), their
    /// rows covered from the start. Returns the blocks and the tokens they already hold.
    pub fn reserve(
        &mut self,
        sched: &mut Scheduler,
        id: RequestId,
        num_tokens: usize,
        num_layers: usize,
        prompt: Option<&[u32]>,
    ) -> Result<(Vec<u32>, usize)> {
        if prompt.is_some_and(|p| p.len() != num_tokens) {
            return Err(EngineError::InvalidRequest(format!(
                "KV import for {id} of {num_tokens} tokens with a prompt of {}",
                prompt.map_or(0, <[u32]>::len)
            )));
        }
        if num_tokens == 0 {
            return Err(EngineError::InvalidRequest(format!("KV import for {id} of 0 tokens")));
        }
        let max = sched.config().max_model_len;
        if num_tokens >= max {
            return Err(EngineError::InvalidRequest(format!(
                "KV import for {id} of {num_tokens} tokens leaves no room under max_model_len {max}"
            )));
        }
        let kv = sched.kv();
        let (need, available) = (kv.blocks_for(num_tokens), kv.num_available());
        let refused = EngineError::ImportRefused { id, num_tokens, need, available };
        let (blocks, cached) = match prompt {
            // Cached blocks count as available (evictable), so this check covers them too.
            Some(p) if need <= available => sched.reserve_blocks_for_prompt(p)?,
            _ if need > available => return Err(refused),
            _ => (sched.reserve_blocks(num_tokens)?, 0),
        };
        let mut covered = vec![false; num_layers * num_tokens];
        for layer in covered.chunks_mut(num_tokens) {
            layer[..cached].fill(true);
        }
        self.map.insert(id.0, Import { blocks: blocks.clone(), num_tokens, covered, have: vec![cached; num_layers] });
        Ok((blocks, cached))
    }

    /// Writes one chunk (see the module docs).
    pub fn write<B: Backend>(
        &mut self,
        backend: &B,
        kv: &mut KvStorage<B>,
        id: RequestId,
        rows: KvRows<'_>,
    ) -> Result<()> {
        let KvRows { layer, token_start, k, v } = rows;
        let imp = self.map.get_mut(&id.0).ok_or(EngineError::UnknownImport { id })?;
        let bad = |detail: String| EngineError::ImportChunk { id, layer, token_start, detail };
        let (l, start) = (layer as usize, token_start as usize);
        if l >= imp.have.len() {
            return Err(bad(format!("the model has {} layers", imp.have.len())));
        }
        let row = kv.row_bytes();
        if k.len() != v.len() || k.is_empty() || !k.len().is_multiple_of(row) {
            return Err(bad(format!(
                "k has {} bytes and v {}: need equal, non-zero multiples of {row} bytes (one token)",
                k.len(),
                v.len()
            )));
        }
        let count = k.len() / row;
        if start + count > imp.num_tokens {
            return Err(bad(format!("{count} tokens run past the {} reserved", imp.num_tokens)));
        }
        kv.import_rows(backend, l, &imp.blocks, start, k, v).map_err(|e| bad(e.to_string()))?;
        let covered = &mut imp.covered[l * imp.num_tokens + start..l * imp.num_tokens + start + count];
        imp.have[l] += covered.iter().filter(|c| !**c).count();
        covered.fill(true);
        Ok(())
    }

    /// Gives a reservation's blocks back.
    pub fn release(&mut self, sched: &mut Scheduler, id: RequestId) -> Result<()> {
        let imp = self.map.remove(&id.0).ok_or(EngineError::UnknownImport { id })?;
        sched.release_reserved(&imp.blocks)?;
        Ok(())
    }

    pub fn release_all(&mut self, sched: &mut Scheduler) -> Result<()> {
        let mut result = Ok(());
        for (_, imp) in self.map.drain() {
            if let Err(e) = sched.release_reserved(&imp.blocks) {
                result = result.and(Err(e.into()));
            }
        }
        result
    }

    /// Removes a complete reservation for a prompt of `prompt_len` tokens and returns its
    /// blocks (now the caller's). An incomplete or mismatched one is released and reported.
    pub fn take_complete(&mut self, sched: &mut Scheduler, id: RequestId, prompt_len: usize) -> Result<Vec<u32>> {
        let imp = self.map.remove(&id.0).ok_or(EngineError::UnknownImport { id })?;
        let err = if imp.num_tokens != prompt_len {
            Some(EngineError::ImportMismatch { id, reserved: imp.num_tokens, prompt: prompt_len })
        } else {
            imp.have.iter().position(|&h| h < imp.num_tokens).map(|l| EngineError::ImportIncomplete {
                id,
                layer: l as u32,
                have: imp.have[l],
                need: imp.num_tokens,
            })
        };
        match err {
            None => Ok(imp.blocks),
            Some(e) => {
                sched.release_reserved(&imp.blocks)?;
                Err(e)
            }
        }
    }
}
