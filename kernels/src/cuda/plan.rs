//! The CUDA backend's host-side logic, kept free of device calls so that it is tested on
//! machines without a GPU: launch geometry, the packing of a batch's block tables into one
//! upload, and the kernels' compile options.

use crate::{check, AttnSeq, AttnShape, Result};

/// Threads per block of the element-wise and row-wise kernels.
pub const THREADS: u32 = 256;
/// Threads per block of paged attention (four warps).
pub const ATTN_THREADS: u32 = 128;
/// Most query heads one attention block serves (the largest `G` kernels.cu is built for).
pub const ATTN_MAX_GROUP: usize = 8;
/// Marks a query row no sequence owns in the packed metadata.
pub const NO_SEQ: u32 = u32::MAX;
/// Largest grid x of a launch: grid-stride kernels loop past it.
const MAX_GRID_X: u64 = (1 << 31) - 1;

/// A launch's grid and block, as `(x, y, z)`, and its dynamic shared memory in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// A grid-stride launch over `n` elements: enough blocks for one element per thread, capped at
/// the grid's limit (the kernels loop past it). `n == 0` is not launched at all.
pub fn elementwise(n: usize) -> Option<Geometry> {
    if n == 0 {
        return None;
    }
    let blocks = (n as u64).div_ceil(THREADS as u64).min(MAX_GRID_X) as u32;
    Some(Geometry { grid: (blocks, 1, 1), block: (THREADS, 1, 1), shared_bytes: 0 })
}

/// One block per row (RMSNorm, softmax, RoPE's tokens, gathers, KV writes), its threads striding
/// over the row's `width` elements: as many warps as the row fills, up to [`THREADS`].
pub fn per_row(rows: usize, width: usize) -> Result<Option<Geometry>> {
    if rows == 0 || width == 0 {
        return Ok(None);
    }
    if rows as u64 > MAX_GRID_X {
        return Err(check::err("cuda launch", format!("{rows} rows exceed the grid's {MAX_GRID_X}")));
    }
    let threads = (width.div_ceil(32) * 32).min(THREADS as usize) as u32;
    Ok(Some(Geometry { grid: (rows as u32, 1, 1), block: (threads, 1, 1), shared_bytes: 0 }))
}

/// The largest head_dim the attention kernel takes (its per-thread outputs are sized for it).
pub const ATTN_MAX_HEAD_DIM: usize = 256;

/// Query heads per attention block for a GQA group of `group` heads: the smallest kernel tile
/// (1, 2, 4 or 8) that holds it, or 8, so that no registers go to heads that do not exist.
pub fn attention_tile(group: usize) -> usize {
    [1, 2, 4].into_iter().find(|&g| g >= group).unwrap_or(ATTN_MAX_GROUP)
}

/// The attention launch for `num_tokens` query rows: one block per (row, KV head, tile of
/// [`attention_tile`] query heads), with shared memory for every key group's partial state.
pub fn attention(num_tokens: usize, shape: &AttnShape) -> Result<Option<Geometry>> {
    if shape.head_dim > ATTN_MAX_HEAD_DIM {
        return Err(check::err(
            "paged_attention",
            format!("head_dim {} exceeds the CUDA kernel's {ATTN_MAX_HEAD_DIM}", shape.head_dim),
        ));
    }
    if num_tokens == 0 {
        return Ok(None);
    }
    if num_tokens as u64 > MAX_GRID_X || shape.num_kv_heads > 65535 {
        return Err(check::err("paged_attention", format!("{num_tokens} tokens x {shape:?} exceed the grid")));
    }
    let group = shape.num_heads / shape.num_kv_heads;
    let tile = attention_tile(group);
    // Row offsets (8 bytes per thread), rescale factors and sums (padded to 16 bytes), then either q, the tile's
    // probabilities and per-warp maxima and sums, or (after the last tile) the partial sums of
    // each key subset (kernels.cu's layout).
    let threads = ATTN_THREADS as usize;
    let hd = shape.head_dim;
    let subsets = threads / hd.div_ceil(8);
    let tiles = tile * hd + tile * threads + 2 * tile * (threads / 32);
    let shared = 8 * threads + 4 * ((2 * tile).next_multiple_of(4) + tiles.max(subsets * tile * hd));
    Ok(Some(Geometry {
        grid: (num_tokens as u32, shape.num_kv_heads as u32, group.div_ceil(tile) as u32),
        block: (ATTN_THREADS, 1, 1),
        shared_bytes: shared as u32,
    }))
}

/// The metadata of one paged-attention call, packed into one `u32` upload (layout in
/// kernels.cu): which sequence owns each query row, each sequence's `[q_start, q_len,
/// context_len, table_offset]`, then the block tables (only the blocks the context uses).
/// Validation is the caller's (`check::paged_attention`), done before this.
pub fn pack_attention(seqs: &[AttnSeq<'_>], block_size: usize) -> (Vec<u32>, usize) {
    let num_tokens = seqs.iter().filter(|s| s.q_len > 0).map(|s| s.q_start + s.q_len).max().unwrap_or(0);
    let tables: usize = seqs.iter().map(|s| s.context_len.div_ceil(block_size)).sum();
    let mut meta = vec![NO_SEQ; num_tokens + 4 * seqs.len()];
    meta.reserve(tables);
    let mut table_off = num_tokens + 4 * seqs.len();
    for (i, s) in seqs.iter().enumerate() {
        meta[s.q_start..s.q_start + s.q_len].fill(i as u32);
        let blocks = s.context_len.div_ceil(block_size);
        let info = num_tokens + 4 * i;
        meta[info..info + 4].copy_from_slice(&[
            s.q_start as u32,
            s.q_len as u32,
            s.context_len as u32,
            table_off as u32,
        ]);
        meta.extend_from_slice(&s.block_table[..blocks]);
        table_off += blocks;
    }
    (meta, num_tokens)
}

/// NVRTC's architecture option: the device's own when known, so the PTX uses what the device
/// has and the driver's JIT targets it.
pub fn compile_arch(compute_capability: Option<(i32, i32)>) -> Option<String> {
    compute_capability.map(|(major, minor)| format!("--gpu-architecture=compute_{major}{minor}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_launches_cover_every_element_and_cap_the_grid() {
        assert_eq!(elementwise(0), None);
        let g = elementwise(1).unwrap();
        assert_eq!((g.grid.0, g.block.0), (1, THREADS));
        let g = elementwise(THREADS as usize + 1).unwrap();
        assert_eq!(g.grid.0, 2);
        let g = elementwise(usize::MAX / 2).unwrap();
        assert_eq!(g.grid.0 as u64, MAX_GRID_X);
    }

    #[test]
    fn row_launches_use_warps_the_row_fills() {
        assert_eq!(per_row(0, 64).unwrap(), None);
        assert_eq!(per_row(3, 0).unwrap(), None);
        assert_eq!(per_row(3, 16).unwrap().unwrap().block.0, 32);
        assert_eq!(per_row(3, 64).unwrap().unwrap().block.0, 64);
        assert_eq!(per_row(3, 65).unwrap().unwrap().block.0, 96);
        assert_eq!(per_row(3, 4096).unwrap().unwrap().block.0, THREADS);
        assert_eq!(per_row(3, 4096).unwrap().unwrap().grid.0, 3);
        assert!(per_row(1 << 32, 4).is_err());
    }

    #[test]
    fn attention_geometry_fits_shared_memory_for_every_head_dim_it_takes() {
        for hd in 1..=256 {
            let shape = AttnShape { num_heads: 64, num_kv_heads: 4, head_dim: hd, block_size: 16, scale: 1.0 };
            let g = attention(5, &shape).unwrap().unwrap();
            assert!(g.shared_bytes <= 48 * 1024, "head_dim {hd}: {} bytes", g.shared_bytes);
            assert_eq!(g.grid, (5, 4, 2));
        }
        let big = AttnShape { num_heads: 2, num_kv_heads: 1, head_dim: 257, block_size: 16, scale: 1.0 };
        assert!(attention(1, &big).is_err());
        for (group, tile) in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (16, 8)] {
            assert_eq!(attention_tile(group), tile, "group {group}");
        }
        // 64 query heads over 4 KV heads: groups of 16 take two blocks each.
        let shape = AttnShape { num_heads: 64, num_kv_heads: 4, head_dim: 128, block_size: 16, scale: 1.0 };
        assert_eq!(attention(2, &shape).unwrap().unwrap().grid, (2, 4, 2));
        assert_eq!(attention(0, &shape).unwrap(), None);
    }

    #[test]
    fn packed_attention_metadata_maps_rows_to_sequences_and_their_tables() {
        let (t0, t1) = ([7u32, 3, 9], [4u32, 5]);
        let seqs = [
            // A prefill chunk of 3 over a cached prefix of 30 (33 tokens: 3 blocks of 16).
            AttnSeq { q_start: 0, q_len: 3, context_len: 33, block_table: &t0 },
            // A sequence with no query rows this call.
            AttnSeq { q_start: 3, q_len: 0, context_len: 5, block_table: &t1 },
            // A decode token at row 4 (row 3 is nobody's); its table is longer than it needs.
            AttnSeq { q_start: 4, q_len: 1, context_len: 16, block_table: &t1 },
        ];
        let (meta, tokens) = pack_attention(&seqs, 16);
        assert_eq!(tokens, 5);
        assert_eq!(&meta[..5], &[0, 0, 0, NO_SEQ, 2]);
        let base = 5 + 12;
        assert_eq!(&meta[5..9], &[0, 3, 33, base as u32]);
        assert_eq!(&meta[9..13], &[3, 0, 5, base as u32 + 3]);
        assert_eq!(&meta[13..17], &[4, 1, 16, base as u32 + 4]);
        assert_eq!(&meta[base..], &[7, 3, 9, 4, 4]);
        assert_eq!(pack_attention(&[], 16), (vec![], 0));
    }
}
