//! Physical KV cache storage: per layer, one K pool and one V pool of
//! `[num_blocks, block_size, num_kv_heads, head_dim]` f32 on the backend.
//!
//! Which block belongs to whom is decided by [`crate::kv`]; this type only holds the bytes and
//! moves whole blocks (copy-on-write copies, and handing blocks of one layer out to and in from
//! the KV transfer layer).

use bytes::{BufMut, Bytes, BytesMut};
use cleave_kernels::{Backend, KernelError};

use super::ModelConfig;
use crate::Result;

pub struct KvStorage<B: Backend> {
    pub(crate) k: Vec<B::Buf>,
    pub(crate) v: Vec<B::Buf>,
    num_blocks: usize,
    block_size: usize,
    kv_width: usize,
}

impl<B: Backend> KvStorage<B> {
    /// Bytes of K and V of one block over all layers.
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        2 * cfg.num_layers * block_size * cfg.kv_width() * std::mem::size_of::<f32>()
    }

    /// How many blocks a memory budget holds.
    pub fn blocks_for_budget(cfg: &ModelConfig, block_size: usize, budget_bytes: usize) -> usize {
        budget_bytes / Self::bytes_per_block(cfg, block_size)
    }

    pub fn new(backend: &B, cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Result<Self> {
        let kv_width = cfg.kv_width();
        let len = num_blocks * block_size * kv_width;
        let mut k = Vec::with_capacity(cfg.num_layers);
        let mut v = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            k.push(backend.alloc_zeros(len)?);
            v.push(backend.alloc_zeros(len)?);
        }
        Ok(Self { k, v, num_blocks, block_size, kv_width })
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
        for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
            // A buffer cannot be borrowed as both source and destination: stage through the host.
            // COW copies are rare (forks, fully cached prompts), so the extra copy is acceptable.
            let tmp = backend.read(pool, s, n)?;
            backend.write(pool, d, &tmp)?;
        }
        Ok(())
    }

    /// K and V of one block of one layer, as host memory (for the KV transfer layer).
    pub fn read_block(&self, backend: &B, layer: usize, block: u32) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_layer(layer)?;
        let off = self.check_block(block)?;
        let n = self.block_len();
        Ok((backend.read(&self.k[layer], off, n)?, backend.read(&self.v[layer], off, n)?))
    }

    /// Writes K and V of one block of one layer (received from another node).
    pub fn write_block(&mut self, backend: &B, layer: usize, block: u32, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_layer(layer)?;
        let off = self.check_block(block)?;
        let n = self.block_len();
        if k.len() != n || v.len() != n {
            return Err(KernelError::Shape {
                op: "write_block",
                detail: format!("need {n} elements, got k {} v {}", k.len(), v.len()),
            }
            .into());
        }
        backend.write(&mut self.k[layer], off, k)?;
        backend.write(&mut self.v[layer], off, v)?;
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
    /// each as `(end - start) * kv_width` f32 little-endian values, token-major (position
    /// order): the wire layout of a KV chunk.
    pub fn export_rows(
        &self,
        backend: &B,
        layer: usize,
        blocks: &[u32],
        start: usize,
        end: usize,
    ) -> Result<(Bytes, Bytes)> {
        self.check_layer(layer)?;
        let bytes = (end.saturating_sub(start)) * self.kv_width * 4;
        let (mut k, mut v) = (BytesMut::with_capacity(bytes), BytesMut::with_capacity(bytes));
        for (_, off, n) in self.runs(blocks, start, end)? {
            let len = n * self.kv_width;
            for (pool, out) in [(&self.k[layer], &mut k), (&self.v[layer], &mut v)] {
                for x in backend.read(pool, off, len)? {
                    out.put_f32_le(x);
                }
            }
        }
        Ok((k.freeze(), v.freeze()))
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
        let row_bytes = self.kv_width * 4;
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
        let mut floats = Vec::new();
        for (p, off, n) in runs {
            let from = (p - token_start) * row_bytes;
            let to = from + n * row_bytes;
            for (src, pool) in [(&k[from..to], &mut self.k[layer]), (&v[from..to], &mut self.v[layer])] {
                floats.clear();
                floats.extend(src.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
                backend.write(pool, off, &floats)?;
            }
        }
        Ok(())
    }
}
