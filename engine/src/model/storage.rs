//! Physical KV cache storage: per layer, one K pool and one V pool of
//! `[num_blocks, block_size, num_kv_heads, head_dim]` elements of the cache's dtype (f32, f16 or
//! bf16; [`KvSpec::dtype`]) on the backend.
//!
//! Which block belongs to whom is decided by [`crate::kv`]; this type only holds the bytes and
//! moves whole blocks (copy-on-write copies, and handing rows of one layer out to and in from
//! the KV transfer layer). Rows leave and arrive as the cache stores them: a 16-bit cache moves
//! half the bytes of an f32 one, and nothing is converted on either side.

use bytes::Bytes;
use cleave_kernels::{Backend, CacheDtype, KernelError};
use cleave_protocol::KvDtype;

use super::ModelConfig;
use crate::Result;

/// The kernels' name for a KV dtype.
pub fn cache_dtype(d: KvDtype) -> CacheDtype {
    match d {
        KvDtype::F32 => CacheDtype::F32,
        KvDtype::F16 => CacheDtype::F16,
        KvDtype::Bf16 => CacheDtype::Bf16,
    }
}

/// The shape of a KV cache: how many blocks of how many tokens, stored as what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSpec {
    pub num_blocks: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

pub struct KvStorage<B: Backend> {
    pub(crate) k: Vec<B::KvBuf>,
    pub(crate) v: Vec<B::KvBuf>,
    num_blocks: usize,
    block_size: usize,
    kv_width: usize,
    dtype: KvDtype,
}

impl<B: Backend> KvStorage<B> {
    /// Bytes of K and V of one block over all layers.
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize, dtype: KvDtype) -> usize {
        2 * cfg.num_layers * block_size * cfg.kv_width() * dtype.size_bytes()
    }

    /// How many blocks a memory budget holds (a 16-bit cache twice as many as an f32 one).
    pub fn blocks_for_budget(cfg: &ModelConfig, block_size: usize, dtype: KvDtype, budget_bytes: usize) -> usize {
        budget_bytes / Self::bytes_per_block(cfg, block_size, dtype)
    }

    pub fn new(backend: &B, cfg: &ModelConfig, spec: KvSpec) -> Result<Self> {
        let KvSpec { num_blocks, block_size, dtype } = spec;
        let kv_width = cfg.kv_width();
        let len = num_blocks * block_size * kv_width;
        let mut k = Vec::with_capacity(cfg.num_layers);
        let mut v = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            k.push(backend.alloc_kv(cache_dtype(dtype), len)?);
            v.push(backend.alloc_kv(cache_dtype(dtype), len)?);
        }
        Ok(Self { k, v, num_blocks, block_size, kv_width, dtype })
    }

    /// Bytes of the cache that occupy host memory now, as the OS says ([`Backend::kv_resident_bytes`]:
    /// a page-table walk over every pool, milliseconds for a large cache; the engine's snapshot
    /// counts blocks instead, and tests check the two agree).
    pub fn resident_bytes(&self, backend: &B) -> usize {
        self.k.iter().chain(&self.v).map(|pool| backend.kv_resident_bytes(pool)).sum()
    }

    /// What each element is stored as.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes of K (or V) of one token in one layer, as stored and as exported.
    pub fn row_bytes(&self) -> usize {
        self.kv_width * self.dtype.size_bytes()
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Elements of K (or V) of one block in one layer.
    pub fn block_len(&self) -> usize {
        self.block_size * self.kv_width
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.k.len() {
            return Err(KernelError::Shape {
                op: "kv_layer",
                detail: format!("layer {layer} out of range ({} layers)", self.k.len()),
            }
            .into());
        }
        Ok(())
    }

    fn check_block(&self, block: u32) -> Result<usize> {
        let b = block as usize;
        if b >= self.num_blocks {
            return Err(KernelError::Shape {
                op: "kv_block",
                detail: format!("block {b} out of range ({} blocks)", self.num_blocks),
            }
            .into());
        }
        Ok(b * self.block_len())
    }

    /// Copies block `src` to block `dst` in every layer (copy-on-write).
    pub fn copy_block(&mut self, backend: &B, src: u32, dst: u32) -> Result<()> {
        let (s, d, n) = (self.check_block(src)?, self.check_block(dst)?, self.block_len());
        if s == d {
            return Ok(());
        }
        for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
            backend.copy_kv(pool, s, d, n)?;
        }
        Ok(())
    }

    /// Elements of K (or V) of one token in one layer (`num_kv_heads * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.kv_width
    }

    /// Contiguous runs `(position, element offset, tokens)` covering positions `start..end` of a
    /// sequence whose block table is `blocks` (position `p` is in `blocks[p / block_size]`).
    fn runs(&self, blocks: &[u32], start: usize, end: usize) -> Result<Vec<(usize, usize, usize)>> {
        let bs = self.block_size;
        if end.div_ceil(bs) > blocks.len() {
            return Err(KernelError::Shape {
                op: "kv_rows",
                detail: format!(
                    "positions {start}..{end} need {} blocks, the table has {}",
                    end.div_ceil(bs),
                    blocks.len()
                ),
            }
            .into());
        }
        let mut runs = Vec::new();
        let mut p = start;
        while p < end {
            let off = p % bs;
            let n = (bs - off).min(end - p);
            let base = self.check_block(blocks[p / bs])?;
            runs.push((p, base + off * self.kv_width, n));
            p += n;
        }
        Ok(runs)
    }

    /// K and V of positions `start..end` of one layer of a sequence with block table `blocks`,
    /// each as `(end - start) * kv_width` little-endian values of the cache's dtype, token-major
    /// (position order): the wire layout of a KV chunk.
    pub fn export_rows(
        &self,
        backend: &B,
        layer: usize,
        blocks: &[u32],
        start: usize,
        end: usize,
    ) -> Result<(Bytes, Bytes)> {
        self.check_layer(layer)?;
        let bytes = (end.saturating_sub(start)) * self.row_bytes();
        let (mut k, mut v) = (Vec::with_capacity(bytes), Vec::with_capacity(bytes));
        for (_, off, n) in self.runs(blocks, start, end)? {
            let len = n * self.kv_width;
            backend.read_kv_bytes(&self.k[layer], off, len, &mut k)?;
            backend.read_kv_bytes(&self.v[layer], off, len, &mut v)?;
        }
        Ok((Bytes::from(k), Bytes::from(v)))
    }

    /// Writes K and V rows in the layout of [`KvStorage::export_rows`] (their length gives the
    /// token count) to positions `token_start..` of one layer of a sequence with block table
    /// `blocks`. Errors (nothing written) when the layer is out of range, the lengths differ or
    /// are not a whole number of tokens, or the positions run past the table.
    pub fn import_rows(
        &mut self,
        backend: &B,
        layer: usize,
        blocks: &[u32],
        token_start: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let row_bytes = self.row_bytes();
        if k.len() != v.len() || !k.len().is_multiple_of(row_bytes) {
            return Err(KernelError::Shape {
                op: "import_rows",
                detail: format!(
                    "k has {} bytes, v {}: need equal multiples of {row_bytes} (one token)",
                    k.len(),
                    v.len()
                ),
            }
            .into());
        }
        let count = k.len() / row_bytes;
        let runs = self.runs(blocks, token_start, token_start + count)?;
        for (p, off, n) in runs {
            let from = (p - token_start) * row_bytes;
            let to = from + n * row_bytes;
            backend.write_kv_bytes(&mut self.k[layer], off, &k[from..to])?;
            backend.write_kv_bytes(&mut self.v[layer], off, &v[from..to])?;
        }
        Ok(())
    }
}
