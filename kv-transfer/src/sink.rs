//! The receiver's view of a block pool: the one interface through which received KV reaches
//! memory. The decode node implements it over the engine's paged KV cache; [`MemoryPool`] is the
//! implementation for tests and benchmarks.
//!
//! Contract of an implementation:
//! - `reserve(ask)` answers, at once or later ([`Reserved`]), either a [`Grant`] of exactly
//!   `ask.num_blocks` distinct blocks (for `ask.num_tokens` tokens of `ask.request_id`; a pool
//!   keyed by request, like the engine's, uses those), which stay out of the free pool until
//!   `release`d or adopted by a request, or [`KvTransferError::OutOfBlocks`] without reserving
//!   anything. When the ask carries the prompt, a pool with a prefix cache may grant its
//!   leading blocks already holding that prefix's K and V (pinned for the lease, never written
//!   by it): [`Grant::cached_tokens`] says how many tokens, and only the rest travels. It never blocks:
//!   a pool owned by another thread (the engine's, which answers between its steps) answers
//!   [`Reserved::Later`], and the receiver's actor goes on with every other lease's frames
//!   meanwhile. Writes for a request come only after its reservation was answered (they follow
//!   the ticket), so a pool that applies commands in order needs no more than that;
//! - `write` copies `w.k`/`w.v` (token-major `[token_count, num_kv_heads, head_dim]`, layout
//!   dtype, little-endian) into layer `w.layer` of the blocks holding tokens
//!   `w.token_start..w.token_start + w.token_count`; tokens that share a block are one copy;
//! - `release(blocks)` returns blocks to the free pool; it is called exactly once per failed
//!   lease and never for a completed one (those blocks belong to the decode request).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use cleave_protocol::{KvLayout, RequestId};

use crate::payload::KvWrite;
use crate::{KvTransferError, Result};

/// What a reservation asks of the pool.
#[derive(Debug, Clone)]
pub struct Ask {
    pub request_id: RequestId,
    pub num_tokens: u32,
    /// `ceil(num_tokens / block_size)`.
    pub num_blocks: usize,
    /// The prompt whose K and V will arrive (`num_tokens` long), when the decode node knows it:
    /// a pool may match it against its prefix cache. `None`: every token travels.
    pub prompt: Option<Arc<[u32]>>,
}

/// Blocks a pool granted for a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// `Ask::num_blocks` blocks in position order.
    pub blocks: Vec<u32>,
    /// Leading tokens whose K and V the first blocks already hold (a cached prefix of the
    /// prompt): a multiple of the block size, below `num_tokens`. The sender skips them.
    pub cached_tokens: u32,
}

impl Grant {
    /// Fresh blocks, nothing cached.
    pub fn fresh(blocks: Vec<u32>) -> Self {
        Self { blocks, cached_tokens: 0 }
    }
}

/// A reservation's answer: now (a pool in this thread's reach), or a future the receiver's actor
/// does not wait for (a pool owned by another thread).
pub enum Reserved {
    Now(Result<Grant>),
    Later(Pin<Box<dyn Future<Output = Result<Grant>> + Send>>),
}

impl Reserved {
    /// The answer, waited for.
    pub async fn wait(self) -> Result<Grant> {
        match self {
            Reserved::Now(r) => r,
            Reserved::Later(f) => f.await,
        }
    }
}

impl std::fmt::Debug for Reserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reserved::Now(r) => f.debug_tuple("Now").field(r).finish(),
            Reserved::Later(_) => f.write_str("Later(..)"),
        }
    }
}

/// Where a receiver reserves blocks and writes the KV it receives.
pub trait KvSink: Send + 'static {
    fn reserve(&mut self, ask: Ask) -> Reserved;
    fn write(&mut self, w: &KvWrite) -> Result<()>;
    fn release(&mut self, request_id: RequestId, blocks: &[u32]);

    /// CRC-32 ([`crate::frame::checksum`]) of K then V of `tokens` of one layer as they lie in
    /// `blocks`, read in place: how a receiver checks KV that one-sided RDMA writes put into
    /// its pool. A pool that RDMA cannot write into says so.
    fn landed_checksum(&self, blocks: &[u32], layer: u32, tokens: std::ops::Range<u32>) -> Result<u32> {
        let _ = (blocks, layer, tokens);
        Err(KvTransferError::InvalidRequest { reason: "this block pool is not an RDMA-registered region".into() })
    }
}

/// A block pool in plain memory: per block and layer, K then V, each
/// `[block_size, num_kv_heads, head_dim]` of the dtype.
///
/// Cloning shares the pool (a test keeps one handle to look inside while the receiver owns the
/// other); the lock is held only for one call.
#[derive(Clone)]
pub struct MemoryPool {
    inner: Arc<Mutex<PoolInner>>,
}

struct PoolInner {
    layout: KvLayout,
    num_blocks: usize,
    free: Vec<u32>,
    data: Vec<u8>,
    writes: u64,
}

impl std::fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.lock();
        f.debug_struct("MemoryPool").field("blocks", &p.num_blocks).field("free", &p.free.len()).finish()
    }
}

impl MemoryPool {
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let bytes = num_blocks * layout.num_layers as usize * 2 * layout.half_block_bytes();
        Self {
            inner: Arc::new(Mutex::new(PoolInner {
                layout,
                num_blocks,
                free: (0..num_blocks as u32).rev().collect(),
                data: vec![0; bytes],
                writes: 0,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn free_blocks(&self) -> usize {
        self.lock().free.len()
    }

    pub fn total_blocks(&self) -> usize {
        self.lock().num_blocks
    }

    /// Number of `write` calls so far (one per contiguous run).
    pub fn writes(&self) -> u64 {
        self.lock().writes
    }

    /// Returns a completed request's blocks to the pool (what the decode engine does when the
    /// request finishes).
    pub fn free_request(&self, blocks: &[u32]) {
        self.lock().free.extend_from_slice(blocks);
    }

    /// Bytes of the pool's memory: every block, laid out as
    /// `rdma::PoolLayout::block_major` describes (the region an RDMA receiver exposes).
    pub fn region_len(&self) -> usize {
        self.lock().data.len()
    }

    /// Copies `bytes` into the pool's memory at `offset`, as a one-sided write into the
    /// registered region would; false (and nothing written) when it does not fit.
    pub fn write_region(&self, offset: usize, bytes: &[u8]) -> bool {
        let mut p = self.lock();
        match offset.checked_add(bytes.len()).filter(|end| *end <= p.data.len()) {
            Some(end) => {
                p.data[offset..end].copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }

    /// Address and length of the pool's memory, for registering it with a device (the RDMA
    /// path registers a receiver's pool once, whole). The buffer is allocated once and never
    /// moves while any clone of the pool lives; reading or writing through the pointer is the
    /// caller's `unsafe`, outside the pool's lock.
    pub fn raw_region(&self) -> (*mut u8, usize) {
        let mut p = self.lock();
        (p.data.as_mut_ptr(), p.data.len())
    }

    /// A copy of the pool's memory.
    pub fn region_bytes(&self) -> Vec<u8> {
        self.lock().data.clone()
    }

    /// K and V of tokens `start..start+count` of one layer, gathered from `blocks`.
    pub fn gather(&self, blocks: &[u32], layer: u32, start: u32, count: u32) -> (Vec<u8>, Vec<u8>) {
        let p = self.lock();
        let tok = p.token_bytes();
        let mut k = Vec::with_capacity(count as usize * tok);
        let mut v = Vec::with_capacity(count as usize * tok);
        for t in start..start + count {
            let (ko, vo) = p.offsets(blocks, layer, t);
            k.extend_from_slice(&p.data[ko..ko + tok]);
            v.extend_from_slice(&p.data[vo..vo + tok]);
        }
        (k, v)
    }
}

impl PoolInner {
    fn token_bytes(&self) -> usize {
        self.layout.num_kv_heads as usize * self.layout.head_dim as usize * self.layout.dtype.size_bytes()
    }

    /// Byte offsets of token `t`'s K and V in layer `layer`.
    fn offsets(&self, blocks: &[u32], layer: u32, t: u32) -> (usize, usize) {
        let bs = self.layout.block_size as usize;
        let half = self.layout.half_block_bytes();
        let block = blocks[t as usize / bs] as usize;
        let base = (block * self.layout.num_layers as usize + layer as usize) * 2 * half;
        let slot = (t as usize % bs) * self.token_bytes();
        (base + slot, base + half + slot)
    }
}

impl MemoryPool {
    /// Takes `num_blocks` free blocks, or none ([`KvTransferError::OutOfBlocks`]).
    pub fn take_blocks(&self, num_blocks: usize) -> Result<Vec<u32>> {
        let mut p = self.lock();
        if p.free.len() < num_blocks {
            return Err(KvTransferError::OutOfBlocks { need: num_blocks, free: p.free.len() });
        }
        let at = p.free.len() - num_blocks;
        Ok(p.free.split_off(at))
    }

    /// Returns blocks to the free list.
    pub fn put_blocks(&self, blocks: &[u32]) {
        self.lock().free.extend_from_slice(blocks);
    }
}

impl KvSink for MemoryPool {
    fn reserve(&mut self, ask: Ask) -> Reserved {
        Reserved::Now(self.take_blocks(ask.num_blocks).map(Grant::fresh))
    }

    fn write(&mut self, w: &KvWrite) -> Result<()> {
        let mut p = self.lock();
        let tok = p.token_bytes();
        let bs = p.layout.block_size;
        let need = w.token_count as usize * tok;
        let last_block = (w.token_start + w.token_count).div_ceil(bs) as usize;
        if w.k.len() != need || w.v.len() != need || last_block > w.blocks.len() || w.layer >= p.layout.num_layers {
            return Err(KvTransferError::SinkWrite { lease: w.lease, reason: "write outside the lease".into() });
        }
        if let Some(b) = w.blocks.iter().find(|b| **b as usize >= p.num_blocks) {
            return Err(KvTransferError::SinkWrite { lease: w.lease, reason: format!("block {b} not in the pool") });
        }
        p.writes += 1;
        // One copy per block the run touches.
        let mut t = w.token_start;
        let end = w.token_start + w.token_count;
        while t < end {
            let run_end = ((t / bs + 1) * bs).min(end);
            let n = (run_end - t) as usize * tok;
            let src = (t - w.token_start) as usize * tok;
            let (ko, vo) = p.offsets(&w.blocks, w.layer, t);
            p.data[ko..ko + n].copy_from_slice(&w.k[src..src + n]);
            p.data[vo..vo + n].copy_from_slice(&w.v[src..src + n]);
            t = run_end;
        }
        Ok(())
    }

    fn release(&mut self, _request_id: RequestId, blocks: &[u32]) {
        self.put_blocks(blocks);
    }

    fn landed_checksum(&self, blocks: &[u32], layer: u32, tokens: std::ops::Range<u32>) -> Result<u32> {
        let p = self.lock();
        let bs = p.layout.block_size;
        let fits = tokens.start < tokens.end && tokens.end.div_ceil(bs) as usize <= blocks.len();
        if !fits || layer >= p.layout.num_layers || blocks.iter().any(|b| *b as usize >= p.num_blocks) {
            return Err(KvTransferError::InvalidRequest {
                reason: format!("layer {layer} tokens {tokens:?} do not fit {} blocks of this pool", blocks.len()),
            });
        }
        let tok = p.token_bytes();
        let mut h = crc32fast::Hasher::new();
        for v in [false, true] {
            let mut t = tokens.start;
            while t < tokens.end {
                let run_end = ((t / bs + 1) * bs).min(tokens.end);
                let (ko, vo) = p.offsets(blocks, layer, t);
                let at = if v { vo } else { ko };
                h.update(&p.data[at..at + (run_end - t) as usize * tok]);
                t = run_end;
            }
        }
        Ok(h.finalize())
    }
}
