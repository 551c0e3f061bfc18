//! Paged causal attention on the CPU.
//!
//! Work is split into items of (sequence, query head, block of up to `Q_BLOCK` queries), run in
//! parallel on the pool; a decode batch yields `seqs × heads` items, a long prefill chunk many
//! more. Within an item the keys are walked once, block by block through the block table, and
//! each key is dotted with every query of the block that may see it (causal mask); the scores are
//! then softmaxed per query (max-subtracted, f64 denominator) and the values accumulated with
//! the same key-major walk. Scores are kept in full (`q_block × keys` floats), which is exact
//! two-pass softmax rather than an online rescaling.
//!
//! Sequences whose chunk has at least [`TILED_MIN_Q`] queries (prefill) go to the tiled
//! matrix-product path instead ([`super::attention_tiled`]).
//!
//! Inputs were validated by the caller (`check::paged_attention`).

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
    head: usize,
    /// Query offsets `q0..q1` within the sequence's `q_len` queries.
    q0: usize,
    q1: usize,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    pool: &rayon::ThreadPool,
    isa: Isa,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    seqs: &[AttnSeq<'_>],
    shape: &AttnShape,
    dims: AttnDims,
    out: &mut [f32],
) {
    let tiled: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].q_len >= TILED_MIN_Q).collect();
    if !tiled.is_empty() {
        super::attention_tiled::paged_attention(pool, q, k_cache, v_cache, seqs, &tiled, shape, dims, out);
    }
    let mut items = Vec::new();
    for (seq, s) in seqs.iter().enumerate().filter(|(_, s)| s.q_len < TILED_MIN_Q) {
        for head in 0..shape.num_heads {
            for q0 in (0..s.q_len).step_by(Q_BLOCK) {
                items.push(Item { seq, head, q0, q1: (q0 + Q_BLOCK).min(s.q_len) });
            }
        }
    }
    let ctx = Ctx { isa, q, k_cache, v_cache, seqs, shape, dims };
    let results: Vec<Vec<f32>> = pool.install(|| items.par_iter().map(|it| ctx.attend(it)).collect());
    let (h, d) = (shape.num_heads, shape.head_dim);
    for (it, res) in items.iter().zip(&results) {
        let s = &seqs[it.seq];
        for (qi, src) in res.chunks_exact(d).enumerate() {
            let row = s.q_start + it.q0 + qi;
            let o = (row * h + it.head) * d;
            out[o..o + d].copy_from_slice(src);
        }
    }
}

struct Ctx<'a> {
    isa: Isa,
    q: &'a [f32],
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    seqs: &'a [AttnSeq<'a>],
    shape: &'a AttnShape,
    dims: AttnDims,
}

impl Ctx<'_> {
    /// Attention output `[q1 - q0, head_dim]` of one item.
    fn attend(&self, it: &Item) -> Vec<f32> {
        let s = &self.seqs[it.seq];
        let (h, d, bs) = (self.shape.num_heads, self.shape.head_dim, self.shape.block_size);
        let kv_off = (it.head / self.dims.group) * d;
        let nq = it.q1 - it.q0;
        // Position of the item's first query; query qi sees keys 0..=pos0 + qi.
        let pos0 = s.context_len - s.q_len + it.q0;
        let nk = pos0 + nq;
        let query = |qi: usize| {
            let o = ((s.q_start + it.q0 + qi) * h + it.head) * d;
            &self.q[o..o + d]
        };
        let key_offset = |t: usize| (s.block_table[t / bs] as usize * bs + t % bs) * self.dims.kv_width + kv_off;

        let mut scores = vec![0f32; nq * nk];
        for t in 0..nk {
            let o = key_offset(t);
            let k = &self.k_cache[o..o + d];
            for qi in t.saturating_sub(pos0)..nq {
                scores[qi * nk + t] = simd::dot(self.isa, query(qi), k) * self.shape.scale;
            }
        }
        let mut inv_sum = vec![0f32; nq];
        for (qi, inv) in inv_sum.iter_mut().enumerate() {
            let row = &mut scores[qi * nk..qi * nk + pos0 + qi + 1];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f64;
            for v in row.iter_mut() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
            *inv = (1.0 / sum) as f32;
        }
        let mut out = vec![0f32; nq * d];
        for t in 0..nk {
            let o = key_offset(t);
            let v = &self.v_cache[o..o + d];
            for qi in t.saturating_sub(pos0)..nq {
                simd::axpy(self.isa, &mut out[qi * d..(qi + 1) * d], scores[qi * nk + t], v);
            }
        }
        for (row, inv) in out.chunks_exact_mut(d).zip(&inv_sum) {
            row.iter_mut().for_each(|v| *v *= inv);
        }
        out
    }
}
