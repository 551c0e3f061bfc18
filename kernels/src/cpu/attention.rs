//! Paged causal attention on the CPU.
//!
//! Work is split into items of (sequence, KV head, block of up to `Q_BLOCK` queries), run in
//! parallel on the pool; a decode batch yields `seqs × kv_heads` items, a long prefill chunk
//! many more. An item's rows are its queries times the query heads that share the KV head (GQA),
//! so every key and value is read once per item, not once per query head. Scores go 16 keys at a
//! time ([`simd::dot_keys`]: 16 accumulators, one transposing reduction), are softmaxed per row
//! (max-subtracted, exact two-pass softmax over the full score row, normalized before the
//! values), and the values are accumulated with each row group's outputs in registers
//! ([`simd::accumulate_rows`]). The causal mask is applied by zeroing the probabilities of the
//! keys a row may not see.
//!
//! Sequences whose chunk has at least [`TILED_MIN_Q`] queries (prefill) go to the tiled
//! matrix-product path instead ([`super::attention_tiled`]).
//!
//! The pools may hold f32, f16 or bf16 ([`KvElem`]): scores and value sums widen the elements
//! to f32 as they load them, so a 16-bit cache halves the bytes this reads and changes nothing
//! else.
//!
//! Inputs were validated by the caller (`check::paged_attention`).

use super::kv::KvElem;
use super::simd::{self, Isa};
use crate::check::AttnDims;
use crate::{AttnSeq, AttnShape};
use rayon::prelude::*;

/// Queries per work item.
const Q_BLOCK: usize = 16;

/// Chunk length from which a sequence takes the tiled (matrix-product) path.
const TILED_MIN_Q: usize = 32;

#[derive(Debug, Clone, Copy)]
struct Item {
    seq: usize,
    kv_head: usize,
    /// Query offsets `q0..q1` within the sequence's `q_len` queries.
    q0: usize,
    q1: usize,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention<E: KvElem>(
    pool: &rayon::ThreadPool,
    isa: Isa,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    seqs: &[AttnSeq<'_>],
    shape: &AttnShape,
    dims: AttnDims,
    out: &mut [f32],
) {
    let tiled: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].q_len >= TILED_MIN_Q).collect();
    if !tiled.is_empty() {
        super::attention_tiled::paged_attention(pool, isa, q, k_cache, v_cache, seqs, &tiled, shape, dims, out);
    }
    let mut items = Vec::new();
    for (seq, s) in seqs.iter().enumerate().filter(|(_, s)| s.q_len < TILED_MIN_Q) {
        for kv_head in 0..shape.num_kv_heads {
            for q0 in (0..s.q_len).step_by(Q_BLOCK) {
                items.push(Item { seq, kv_head, q0, q1: (q0 + Q_BLOCK).min(s.q_len) });
            }
        }
    }
    let ctx = Ctx { isa, q, k_cache, v_cache, seqs, shape, dims };
    let results: Vec<Vec<f32>> = pool.install(|| items.par_iter().map(|it| ctx.attend(it)).collect());
    let (h, d, g) = (shape.num_heads, shape.head_dim, dims.group);
    for (it, res) in items.iter().zip(&results) {
        let s = &seqs[it.seq];
        // Result rows are (query, head in group) pairs, query-major.
        for (r, src) in res.chunks_exact(d).enumerate() {
            let (qi, gi) = (r / g, r % g);
            let o = ((s.q_start + it.q0 + qi) * h + it.kv_head * g + gi) * d;
            out[o..o + d].copy_from_slice(src);
        }
    }
}

struct Ctx<'a, E> {
    isa: Isa,
    q: &'a [f32],
    k_cache: &'a [E],
    v_cache: &'a [E],
    seqs: &'a [AttnSeq<'a>],
    shape: &'a AttnShape,
    dims: AttnDims,
}

impl<E: KvElem> Ctx<'_, E> {
    /// Attention output of one item: `[(q1 - q0) * group, head_dim]`, rows (query, head in
    /// group), query-major.
    fn attend(&self, it: &Item) -> Vec<f32> {
        let s = &self.seqs[it.seq];
        let (h, d, bs, g) = (self.shape.num_heads, self.shape.head_dim, self.shape.block_size, self.dims.group);
        let kv_off = it.kv_head * d;
        let nq = it.q1 - it.q0;
        let rows = nq * g;
        // Position of the item's first query; query qi sees keys 0..=pos0 + qi.
        let pos0 = s.context_len - s.q_len + it.q0;
        let nk = pos0 + nq;
        let key_offset = |t: usize| (s.block_table[t / bs] as usize * bs + t % bs) * self.dims.kv_width + kv_off;
        let keys: Vec<&[E]> = (0..nk).map(|t| &self.k_cache[key_offset(t)..key_offset(t) + d]).collect();
        let vals: Vec<&[E]> = (0..nk).map(|t| &self.v_cache[key_offset(t)..key_offset(t) + d]).collect();

        let mut p = vec![0f32; rows * nk];
        for r in 0..rows {
            let (qi, gi) = (r / g, r % g);
            let o = ((s.q_start + it.q0 + qi) * h + it.kv_head * g + gi) * d;
            let seen = pos0 + qi + 1;
            let row = &mut p[r * nk..r * nk + seen];
            E::dot_keys(self.isa, &self.q[o..o + d], &keys[..seen], row);
            row.iter_mut().for_each(|v| *v *= self.shape.scale);
            let max = simd::max(self.isa, row);
            let inv = 1.0 / simd::exp_shifted(self.isa, row, max);
            row.iter_mut().for_each(|v| *v *= inv);
        }
        let mut out = vec![0f32; rows * d];
        E::accumulate_rows(self.isa, &p, nk, rows, &vals, &mut out, d);
        out
    }
}
