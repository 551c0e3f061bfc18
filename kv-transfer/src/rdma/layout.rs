//! Where the leased blocks lie in the receiver's registered memory region, and the 32-bit
//! immediate value that names a (lease, layer, chunk) write group.
//!
//! Pure data and arithmetic: no verbs, no I/O.
//!
//! Invariant: a [`PoolLayout`] that passed [`PoolLayout::validate`] maps distinct
//! (layer, half, block, slot) tuples to disjoint byte ranges that all lie inside the region.

use cleave_protocol::KvLayout;

use crate::error::{KvTransferError, Result};

/// K or V half of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Half {
    K = 0,
    V = 1,
}

impl Half {
    pub const BOTH: [Half; 2] = [Half::K, Half::V];
}

/// Where the blocks of a KV pool lie inside one registered memory region. All offsets are in
/// bytes relative to the region's base address.
///
/// The K half of token slot `t` of block `b` in layer `l` starts at
/// `l * layer_stride + b * block_stride + t * token_bytes`; the V half at that offset plus
/// `half_stride`. Within a block half, the slots of a block are contiguous
/// (`[block_size, num_kv_heads, head_dim]`, as [`KvLayout`] says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolLayout {
    pub num_layers: u32,
    pub num_blocks: u32,
    /// Token slots per block.
    pub block_size: u32,
    /// Bytes of K (or of V) of one token in one layer.
    pub token_bytes: u32,
    pub block_stride: u64,
    pub half_stride: u64,
    pub layer_stride: u64,
}

impl PoolLayout {
    /// The layout of one contiguous arena ordered `[layer][K|V][block][slot]`: consecutive
    /// block ids are adjacent in memory, so a run of them is one RDMA write.
    pub fn dense(kv: &KvLayout, num_blocks: u32) -> Result<Self> {
        let token_bytes = kv.num_kv_heads as u64 * kv.head_dim as u64 * kv.dtype.size_bytes() as u64;
        let token_bytes = u32::try_from(token_bytes).map_err(|_| invalid(format!("{token_bytes} bytes per token")))?;
        let half = token_bytes as u64 * kv.block_size as u64;
        let block_stride = half;
        let half_stride =
            half.checked_mul(num_blocks as u64).ok_or_else(|| invalid("pool size overflows u64".into()))?;
        let layer_stride = half_stride.checked_mul(2).ok_or_else(|| invalid("pool size overflows u64".into()))?;
        let l = Self {
            num_layers: kv.num_layers,
            num_blocks,
            block_size: kv.block_size,
            token_bytes,
            block_stride,
            half_stride,
            layer_stride,
        };
        l.validate(l.extent()?)?;
        Ok(l)
    }

    /// The layout of one arena ordered `[block][layer][K|V][slot]`, as
    /// [`crate::sink::MemoryPool`] stores blocks. Valid, but each block is its own write: a
    /// pool meant for RDMA should prefer [`Self::dense`].
    pub fn block_major(kv: &KvLayout, num_blocks: u32) -> Result<Self> {
        let mut l = Self::dense(kv, num_blocks)?;
        let half = l.half_block_bytes();
        l.half_stride = half;
        l.layer_stride = 2 * half;
        l.block_stride = 2 * half * l.num_layers as u64;
        l.validate(l.extent()?)?;
        Ok(l)
    }

    /// Bytes of one block half (K or V of one block in one layer).
    pub fn half_block_bytes(&self) -> u64 {
        self.block_size as u64 * self.token_bytes as u64
    }

    /// One past the last byte any block may occupy.
    pub fn extent(&self) -> Result<u64> {
        if self.num_layers == 0 || self.num_blocks == 0 || self.block_size == 0 || self.token_bytes == 0 {
            return Err(invalid(format!("zero-sized dimension in {self:?}")));
        }
        let last = (self.num_layers as u64 - 1)
            .checked_mul(self.layer_stride)
            .and_then(|a| a.checked_add(self.half_stride))
            .and_then(|a| a.checked_add((self.num_blocks as u64 - 1).checked_mul(self.block_stride)?))
            .and_then(|a| a.checked_add(self.half_block_bytes()));
        last.ok_or_else(|| invalid(format!("extent of {self:?} overflows u64")))
    }

    /// Checks that the layout is non-degenerate, that no two block halves overlap, and that all
    /// of them fit in `region_len` bytes.
    ///
    /// Overlap check: sorted by stride, each dimension's stride must be at least the extent of
    /// the dimensions below it (a mixed-radix layout). That is sufficient, and every layout a
    /// pool allocates in practice (any order of layer, half and block) satisfies it.
    pub fn validate(&self, region_len: u64) -> Result<()> {
        let extent = self.extent()?;
        if extent > region_len {
            return Err(invalid(format!("blocks need {extent} bytes, the region has {region_len}")));
        }
        let mut dims = [
            (self.block_stride, self.num_blocks as u64),
            (self.half_stride, 2),
            (self.layer_stride, self.num_layers as u64),
        ];
        dims.sort_unstable();
        let mut below = self.half_block_bytes();
        for (stride, count) in dims {
            if count == 1 {
                continue;
            }
            if stride < below {
                return Err(invalid(format!(
                    "stride {stride} < {below} bytes below it: block halves overlap in {self:?}"
                )));
            }
            below += stride * (count - 1);
        }
        Ok(())
    }

    /// Offset in the region of token slot `slot` of `block` in `layer`, `half`. Checked.
    pub fn offset(&self, layer: u32, half: Half, block: u32, slot: u32) -> Result<u64> {
        if layer >= self.num_layers || block >= self.num_blocks || slot >= self.block_size {
            return Err(invalid(format!(
                "layer {layer} block {block} slot {slot} outside {} layers x {} blocks x {} slots",
                self.num_layers, self.num_blocks, self.block_size
            )));
        }
        // Cannot overflow: bounded by extent(), which validate() computed without overflow.
        Ok(layer as u64 * self.layer_stride
            + half as u64 * self.half_stride
            + block as u64 * self.block_stride
            + slot as u64 * self.token_bytes as u64)
    }
}

fn invalid(reason: String) -> KvTransferError {
    KvTransferError::RdmaLayout { reason }
}

/// The 32-bit immediate value of an RDMA WRITE WITH IMMEDIATE: names the write group it closes.
///
/// Bit layout (sent in network byte order, as verbs requires):
///
/// ```text
///  31          20 19        12 11           0
/// +--------------+------------+--------------+
/// |  lease tag   |   layer    |    chunk     |
/// |   12 bits    |   8 bits   |   12 bits    |
/// +--------------+------------+--------------+
/// ```
///
/// The lease tag is a small number the receiver assigns per queue pair when it accepts a lease
/// (at most 4096 open leases per queue pair); a layer index is below 256 and a chunk index
/// (the sender's prefill chunk, in order) below 4096.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Imm {
    pub tag: u16,
    pub layer: u8,
    pub chunk: u16,
}

impl Imm {
    pub const MAX_TAG: u16 = (1 << 12) - 1;
    pub const MAX_LAYER: u32 = u8::MAX as u32;
    pub const MAX_CHUNK: u16 = (1 << 12) - 1;

    /// Checked constructor.
    pub fn new(tag: u16, layer: u32, chunk: u32) -> Result<Self> {
        if tag > Self::MAX_TAG || layer > Self::MAX_LAYER || chunk > Self::MAX_CHUNK as u32 {
            return Err(invalid(format!(
                "immediate out of range: tag {tag} (max {}), layer {layer} (max {}), chunk {chunk} (max {})",
                Self::MAX_TAG,
                Self::MAX_LAYER,
                Self::MAX_CHUNK
            )));
        }
        Ok(Self { tag, layer: layer as u8, chunk: chunk as u16 })
    }

    /// The host-order value; convert with `to_be()` when filling `imm_data`.
    pub fn encode(self) -> u32 {
        (self.tag as u32) << 20 | (self.layer as u32) << 12 | self.chunk as u32
    }

    /// Every u32 decodes to some `Imm`; whether it names an open lease is the tracker's business.
    pub fn decode(v: u32) -> Self {
        Self { tag: (v >> 20) as u16, layer: (v >> 12) as u8, chunk: (v & 0xfff) as u16 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_protocol::KvDtype;

    fn kv() -> KvLayout {
        KvLayout {
            model_fingerprint: 1,
            dtype: KvDtype::Bf16,
            num_layers: 4,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
        }
    }

    #[test]
    fn dense_layout_is_valid_and_adjacent() {
        let l = PoolLayout::dense(&kv(), 10).unwrap();
        assert_eq!(l.token_bytes, 32);
        assert_eq!(l.offset(0, Half::K, 1, 0).unwrap(), l.offset(0, Half::K, 0, 3).unwrap() + 32);
        assert_eq!(l.extent().unwrap(), 4 * 2 * 10 * 128);
        assert!(l.validate(l.extent().unwrap() - 1).is_err());
    }

    #[test]
    fn block_major_matches_the_memory_pool_formula() {
        let kv = kv();
        let l = PoolLayout::block_major(&kv, 10).unwrap();
        let half = kv.half_block_bytes() as u64;
        let tb = l.token_bytes as u64;
        // MemoryPool: base = (block * num_layers + layer) * 2 * half; V = K + half.
        for (layer, block, slot) in [(0, 0, 0), (3, 9, 3), (1, 4, 2)] {
            let base = (block as u64 * 4 + layer as u64) * 2 * half + slot as u64 * tb;
            assert_eq!(l.offset(layer, Half::K, block, slot).unwrap(), base);
            assert_eq!(l.offset(layer, Half::V, block, slot).unwrap(), base + half);
        }
        assert_eq!(l.extent().unwrap(), PoolLayout::dense(&kv, 10).unwrap().extent().unwrap());
    }

    #[test]
    fn overlapping_layouts_are_refused() {
        let mut l = PoolLayout::dense(&kv(), 10).unwrap();
        l.half_stride = 64; // V of block 0 inside K of block 0
        assert!(matches!(l.validate(u64::MAX), Err(KvTransferError::RdmaLayout { .. })));
        let mut l = PoolLayout::dense(&kv(), 10).unwrap();
        l.block_stride = 100; // < 128 bytes of a block half
        assert!(l.validate(u64::MAX).is_err());
        let mut l = PoolLayout::dense(&kv(), 10).unwrap();
        l.layer_stride = u64::MAX / 2;
        assert!(l.validate(u64::MAX).is_err(), "overflow is an error, not a panic");
    }

    #[test]
    fn layer_major_within_block_layouts_are_accepted() {
        // [block][layer][half][slot]: another order a pool could use.
        let half = 4 * 32u64;
        let l = PoolLayout {
            num_layers: 4,
            num_blocks: 10,
            block_size: 4,
            token_bytes: 32,
            half_stride: half,
            layer_stride: 2 * half,
            block_stride: 8 * half,
        };
        l.validate(l.extent().unwrap()).unwrap();
    }

    #[test]
    fn offsets_out_of_range_are_errors() {
        let l = PoolLayout::dense(&kv(), 10).unwrap();
        assert!(l.offset(4, Half::K, 0, 0).is_err());
        assert!(l.offset(0, Half::V, 10, 0).is_err());
        assert!(l.offset(0, Half::V, 0, 4).is_err());
    }

    #[test]
    fn imm_round_trips_and_refuses_out_of_range() {
        for (t, l, c) in [(0, 0, 0), (4095, 255, 4095), (7, 31, 100)] {
            let imm = Imm::new(t, l, c).unwrap();
            assert_eq!(Imm::decode(imm.encode()), imm);
        }
        assert_eq!(Imm::new(1, 2, 3).unwrap().encode(), 0x0010_2003);
        assert!(Imm::new(4096, 0, 0).is_err());
        assert!(Imm::new(0, 256, 0).is_err());
        assert!(Imm::new(0, 0, 4096).is_err());
        assert_eq!(Imm::decode(u32::MAX), Imm { tag: 4095, layer: 255, chunk: 4095 });
    }
}
