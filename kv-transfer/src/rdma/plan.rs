//! Work-request construction: which RDMA writes move one layer of one prefill chunk into the
//! leased blocks. Pure functions, tested against a byte-by-byte reference without a device.
//!
//! Source layout (sender side): the chunk's K and V of one layer sit in one staging buffer,
//! `[K of tokens start..end][V of tokens start..end]`, each token `token_bytes` long, so the
//! buffer is `2 * (end - start) * token_bytes` bytes ([`source_len`]). `src_offset` is relative
//! to that buffer's start.
//!
//! Invariants of a plan returned by [`plan_chunk`]:
//! - the writes cover every byte of the source exactly once, and land where the naive per-token
//!   copy would put them; all remote ranges lie inside the region;
//! - runs of destination slots that are adjacent in remote memory (consecutive block ids in a
//!   dense pool) are merged into one write, split only at `max_write` bytes;
//! - exactly one write carries the immediate, the last one, and it is signaled;
//! - at most `SignalPolicy::every - 1` unsignaled writes precede a signaled one.
//!
//! Fence policy: no write sets `IBV_SEND_FENCE`. A fence only orders a work request after
//! earlier RDMA READs and atomics on the same queue pair, and this transport posts neither. The
//! receiver may trust the data of a group once it sees the group's immediate because a reliable
//! connection places the writes of one queue pair in order: the WRITE WITH IMMEDIATE is placed
//! (and its receive completion generated) after every earlier write of the queue pair.

use std::ops::Range;

use super::layout::{Half, Imm, PoolLayout};
use crate::error::{KvTransferError, Result};

/// The receiver's registered KV pool as the sender sees it (from its [`super::QpMetadata`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of the region's first byte in the receiver's address space.
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
    pub layout: PoolLayout,
}

impl RemoteRegion {
    /// Checks that `addr + len` does not overflow and that the layout fits in the region.
    pub fn validate(&self) -> Result<()> {
        if self.addr.checked_add(self.len).is_none() {
            return Err(KvTransferError::RdmaLayout {
                reason: format!("region {:#x}+{} wraps the address space", self.addr, self.len),
            });
        }
        self.layout.validate(self.len)
    }
}

/// When to ask for a completion. The last write of a group (the one with the immediate) is
/// always signaled; besides, every `every`-th write is, so that the send queue never holds more
/// than `every - 1` unsignaled work requests (their slots are freed only by a later completion).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignalPolicy {
    pub every: u32,
}

impl Default for SignalPolicy {
    fn default() -> Self {
        Self { every: 64 }
    }
}

/// One RDMA write work request, before it gets a `wr_id` and local keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaWrite {
    pub remote_addr: u64,
    pub len: u32,
    /// Offset in the chunk's staging buffer (see the module docs).
    pub src_offset: u64,
    /// `Some` on the last write of a group only: post it as WRITE WITH IMMEDIATE.
    pub imm: Option<Imm>,
    pub signaled: bool,
}

/// One layer of one prefill chunk, bound for a lease's blocks.
#[derive(Debug, Clone)]
pub struct ChunkWrite<'a> {
    /// The lease's destination blocks in position order: token `p` goes to slot
    /// `p % block_size` of `blocks[p / block_size]`.
    pub blocks: &'a [u32],
    pub layer: u32,
    /// Positions of the sequence this chunk carries.
    pub tokens: Range<u32>,
    /// The lease tag the receiver assigned.
    pub tag: u16,
    /// Index of this prefill chunk (0, 1, ... in order).
    pub chunk: u32,
}

/// Bytes of the staging buffer of a chunk of `tokens` tokens.
pub fn source_len(tokens: u32, token_bytes: u32) -> u64 {
    2 * tokens as u64 * token_bytes as u64
}

/// The writes that move `chunk` into `region`. Fails, before anything is posted, when the chunk
/// does not fit the lease or the region, or `max_write` / the policy is zero.
pub fn plan_chunk(
    region: &RemoteRegion,
    chunk: &ChunkWrite<'_>,
    max_write: u32,
    policy: SignalPolicy,
) -> Result<Vec<RdmaWrite>> {
    let bad = |reason: String| KvTransferError::RdmaPlan { reason };
    if max_write == 0 || policy.every == 0 {
        return Err(bad(format!("max_write {max_write} and signal interval {} must be positive", policy.every)));
    }
    let imm = Imm::new(chunk.tag, chunk.layer, chunk.chunk)?;
    let l = &region.layout;
    let Range { start, end } = chunk.tokens.clone();
    if start >= end {
        return Err(bad(format!("empty token range {start}..{end}")));
    }
    let capacity = chunk.blocks.len() as u64 * l.block_size as u64;
    if end as u64 > capacity {
        return Err(bad(format!(
            "tokens {start}..{end} exceed the lease's {} blocks of {} slots",
            chunk.blocks.len(),
            l.block_size
        )));
    }
    let n = (end - start) as u64;
    let tb = l.token_bytes as u64;

    // Contiguous runs as (remote offset, source offset, bytes).
    let mut runs: Vec<(u64, u64, u64)> = Vec::new();
    for half in Half::BOTH {
        let src_base = half as u64 * n * tb;
        let mut p = start;
        while p < end {
            let block = chunk.blocks[(p / l.block_size) as usize];
            let slot = p % l.block_size;
            let count = (l.block_size - slot).min(end - p);
            let remote = l.offset(chunk.layer, half, block, slot)?;
            let src = src_base + (p - start) as u64 * tb;
            let bytes = count as u64 * tb;
            match runs.last_mut() {
                Some((r, s, len)) if *r + *len == remote && *s + *len == src => *len += bytes,
                _ => runs.push((remote, src, bytes)),
            }
            p += count;
        }
    }

    let mut writes = Vec::new();
    for (remote, src, len) in runs {
        let mut done = 0;
        while done < len {
            let piece = (len - done).min(max_write as u64);
            writes.push(RdmaWrite {
                remote_addr: region.addr + remote + done,
                len: piece as u32,
                src_offset: src + done,
                imm: None,
                signaled: false,
            });
            done += piece;
        }
    }
    let count = writes.len();
    for (i, w) in writes.iter_mut().enumerate() {
        w.signaled = (i as u64 + 1).is_multiple_of(policy.every as u64) || i + 1 == count;
    }
    if let Some(last) = writes.last_mut() {
        last.imm = Some(imm);
    }
    Ok(writes)
}

/// CRC-32 of a chunk as it landed in the receiver's pool: K of `tokens` in order, then V, the
/// same value as [`crate::frame::checksum`] of the sender's K and V. The receiver computes it
/// after the group's immediate arrived and compares it with the checksum the sender sent on
/// the control stream (one-sided writes carry none), reading the pool in place (no copy).
///
/// `pool` is the registered region's bytes, from its base address.
pub fn landed_checksum(
    pool: &[u8],
    layout: &PoolLayout,
    blocks: &[u32],
    layer: u32,
    tokens: Range<u32>,
) -> Result<u32> {
    let bad = |reason: String| KvTransferError::RdmaPlan { reason };
    if tokens.start >= tokens.end || tokens.end as u64 > blocks.len() as u64 * layout.block_size as u64 {
        return Err(bad(format!("tokens {tokens:?} do not fit {} blocks", blocks.len())));
    }
    let mut h = crc32fast::Hasher::new();
    for half in Half::BOTH {
        let mut p = tokens.start;
        while p < tokens.end {
            let slot = p % layout.block_size;
            let count = (layout.block_size - slot).min(tokens.end - p);
            let at = layout.offset(layer, half, blocks[(p / layout.block_size) as usize], slot)? as usize;
            let len = count as usize * layout.token_bytes as usize;
            let bytes = pool
                .get(at..at + len)
                .ok_or_else(|| bad(format!("bytes {at}..{} outside the {}-byte pool", at + len, pool.len())))?;
            h.update(bytes);
            p += count;
        }
    }
    Ok(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_protocol::{KvDtype, KvLayout};

    fn region(num_blocks: u32) -> RemoteRegion {
        let kv = KvLayout {
            model_fingerprint: 0,
            dtype: KvDtype::F32,
            num_layers: 3,
            num_kv_heads: 1,
            head_dim: 2,
            block_size: 4,
        };
        let layout = PoolLayout::dense(&kv, num_blocks).unwrap();
        RemoteRegion { addr: 0x1000, len: layout.extent().unwrap(), rkey: 7, layout }
    }

    #[test]
    fn consecutive_blocks_merge_into_one_write_per_half() {
        let r = region(8);
        let c = ChunkWrite { blocks: &[2, 3, 4], layer: 1, tokens: 0..12, tag: 5, chunk: 0 };
        let w = plan_chunk(&r, &c, u32::MAX, SignalPolicy::default()).unwrap();
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(w[0].len, 12 * 8);
        assert_eq!(w[0].remote_addr, 0x1000 + r.layout.offset(1, Half::K, 2, 0).unwrap());
        assert_eq!(w[1].src_offset, 12 * 8);
        assert_eq!(w[1].imm, Some(Imm::new(5, 1, 0).unwrap()));
        assert!(!w[0].signaled && w[1].signaled && w[0].imm.is_none());
    }

    #[test]
    fn scattered_blocks_and_partial_ranges_split_at_block_edges() {
        let r = region(8);
        let c = ChunkWrite { blocks: &[6, 1, 2, 0], layer: 0, tokens: 3..13, tag: 0, chunk: 2 };
        let w = plan_chunk(&r, &c, u32::MAX, SignalPolicy::default()).unwrap();
        // Per half: [6 slot 3], [1, 2 whole], [0 slot 0] -> 3 writes.
        assert_eq!(w.len(), 6, "{w:?}");
        assert_eq!(w.iter().map(|w| w.len as u64).sum::<u64>(), source_len(10, 8));
    }

    #[test]
    fn max_write_splits_and_signal_policy_bounds_unsignaled_runs() {
        let r = region(8);
        let c = ChunkWrite { blocks: &[0, 1, 2, 3], layer: 2, tokens: 0..16, tag: 1, chunk: 1 };
        let w = plan_chunk(&r, &c, 24, SignalPolicy { every: 3 }).unwrap();
        assert!(w.iter().all(|w| w.len <= 24));
        assert_eq!(w.len(), 2 * (128usize).div_ceil(24));
        let mut unsignaled = 0;
        for x in &w {
            unsignaled = if x.signaled { 0 } else { unsignaled + 1 };
            assert!(unsignaled < 3);
        }
        assert!(w.last().unwrap().signaled);
        assert_eq!(w.iter().filter(|w| w.imm.is_some()).count(), 1);
    }

    #[test]
    fn bad_chunks_are_refused() {
        let r = region(8);
        let ok = ChunkWrite { blocks: &[0, 1], layer: 0, tokens: 0..8, tag: 0, chunk: 0 };
        assert!(plan_chunk(&r, &ok, 0, SignalPolicy::default()).is_err());
        assert!(plan_chunk(&r, &ok, 8, SignalPolicy { every: 0 }).is_err());
        for c in [
            ChunkWrite { tokens: 4..4, ..ok.clone() },
            ChunkWrite { tokens: 0..9, ..ok.clone() },
            ChunkWrite { layer: 3, ..ok.clone() },
            ChunkWrite { blocks: &[0, 8], ..ok.clone() },
            ChunkWrite { tag: 4096, ..ok.clone() },
            ChunkWrite { chunk: 4096, ..ok.clone() },
        ] {
            let e = plan_chunk(&r, &c, 64, SignalPolicy::default());
            assert!(e.is_err(), "{c:?} -> {e:?}");
        }
    }
}
