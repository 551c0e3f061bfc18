//! Paged causal attention for long query chunks (prefill), as small matrix products.
//!
//! Work is split into items of (sequence, kv head, tile of up to [`TILE_Q`] queries); one item
//! covers every query head of the kv head's group, so its query matrix has `tile × group` rows.
//! Before the items run, the keys and values of each (sequence, kv head) are gathered once from
//! the block pools into contiguous `[context_len, head_dim]` buffers shared by all its tiles.
//! An item then computes `S = Q·Kᵀ · scale` over the keys up to its last query's position with
//! the `gemm` crate, applies the causal mask, takes an exact max-subtracted softmax per row (vector
//! `exp`, [`simd::exp_shifted`]), and computes `O = P·V` with `gemm`. Scratch per item is `tile × group × keys`
//! floats for the scores plus `tile × group × head_dim` for queries and outputs.
//! The gathered keys/values (on the calling thread) and each pool thread's scratch are
//! thread-locals kept between calls: allocated fresh, their pages were faulted in again on every
//! layer, which cost a prefill of 2048 tokens about half its time.
//!
//! The gather widens 16-bit pools (f16, bf16) to f32 as it copies ([`KvElem::decode`]); the
//! products then run in f32 as for an f32 pool.
//!
//! Inputs were validated by the caller (`check::paged_attention`).

use super::kv::KvElem;
use super::simd::{self, Isa};
use crate::check::AttnDims;
use crate::{AttnSeq, AttnShape};
use rayon::prelude::*;

/// Queries per work item (each with all query heads of one kv head).
const TILE_Q: usize = 64;

/// One work item: queries `q0..q1` of `seq`'s chunk, all query heads of kv head `kvh`.
#[derive(Debug, Clone, Copy)]
struct Item {
    /// Index into the gathered (sequence, kv head) list.
    gathered: usize,
    seq: usize,
    kvh: usize,
    q0: usize,
    q1: usize,
}

/// Contiguous `[context_len, head_dim]` keys and values of one (sequence, kv head).
struct Gathered<'a> {
    k: &'a [f32],
    v: &'a [f32],
}

/// Per-thread scratch, reused across items and calls.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    s: Vec<f32>,
}

thread_local! {
    /// Each pool thread's scratch: kept between calls so that its pages are faulted in once, not
    /// on every layer (a prefill of 2048 tokens has 1.5 MB of scores per item).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
    /// The calling thread's gathered keys and values, kept between calls for the same reason.
    static GATHER: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Attention of the sequences `which` (indices into `seqs`), written into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention<E: KvElem>(
    pool: &rayon::ThreadPool,
    isa: Isa,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    seqs: &[AttnSeq<'_>],
    which: &[usize],
    shape: &AttnShape,
    dims: AttnDims,
    out: &mut [f32],
) {
    let kvh_n = shape.num_kv_heads;
    let pairs: Vec<(usize, usize)> = which.iter().flat_map(|&s| (0..kvh_n).map(move |h| (s, h))).collect();
    let mut items = Vec::new();
    for (gathered, &(seq, kvh)) in pairs.iter().enumerate() {
        let s = &seqs[seq];
        for q0 in (0..s.q_len).step_by(TILE_Q) {
            items.push(Item { gathered, seq, kvh, q0, q1: (q0 + TILE_Q).min(s.q_len) });
        }
    }
    let (h, d, bs) = (shape.num_heads, shape.head_dim, shape.block_size);
    let g = dims.group;
    // Keys then values of each pair, `[context_len, head_dim]` each, back to back in one buffer
    // kept by the calling thread across calls (a fresh one would be faulted in on every layer).
    let total: usize = pairs.iter().map(|&(seq, _)| 2 * seqs[seq].context_len * d).sum();
    let results: Vec<Vec<f32>> = GATHER.with_borrow_mut(|buf| {
        if buf.len() < total {
            buf.resize(total, 0.0);
        }
        let mut rest = &mut buf[..total];
        let mut slots: Vec<&mut [f32]> = Vec::with_capacity(pairs.len());
        for &(seq, _) in &pairs {
            let (head, tail) = rest.split_at_mut(2 * seqs[seq].context_len * d);
            slots.push(head);
            rest = tail;
        }
        pool.install(|| {
            slots.par_iter_mut().zip(&pairs).for_each(|(slot, &(seq, kvh))| {
                let s = &seqs[seq];
                let n = s.context_len;
                let (k, v) = slot.split_at_mut(n * d);
                for t in 0..n {
                    let o = (s.block_table[t / bs] as usize * bs + t % bs) * dims.kv_width + kvh * d;
                    E::decode(isa, &k_cache[o..o + d], &mut k[t * d..(t + 1) * d]);
                    E::decode(isa, &v_cache[o..o + d], &mut v[t * d..(t + 1) * d]);
                }
            })
        });
        let gathered: Vec<Gathered<'_>> = slots
            .iter()
            .zip(&pairs)
            .map(|(slot, &(seq, _))| {
                let (k, v) = slot.split_at(seqs[seq].context_len * d);
                Gathered { k, v }
            })
            .collect();
        pool.install(|| {
            items
                .par_iter()
                .map(|it| {
                    SCRATCH.with_borrow_mut(|scratch| {
                        attend(isa, q, &seqs[it.seq], &gathered[it.gathered], shape, g, it, scratch)
                    })
                })
                .collect()
        })
    });
    // Rows of a result are ordered (query, head within group), as in `out`.
    for (it, res) in items.iter().zip(&results) {
        let s = &seqs[it.seq];
        for (qi, src) in res.chunks_exact(g * d).enumerate() {
            let o = ((s.q_start + it.q0 + qi) * h + it.kvh * g) * d;
            out[o..o + g * d].copy_from_slice(src);
        }
    }
}

/// Output `[(q1 - q0) * group, head_dim]` of one item, rows ordered (query, head within group).
#[allow(clippy::too_many_arguments)]
fn attend(
    isa: Isa,
    q: &[f32],
    s: &AttnSeq<'_>,
    kv: &Gathered<'_>,
    shape: &AttnShape,
    g: usize,
    it: &Item,
    scratch: &mut Scratch,
) -> Vec<f32> {
    let (h, d) = (shape.num_heads, shape.head_dim);
    let nq = it.q1 - it.q0;
    let m = nq * g;
    // Query qi (row qi*g + hg) sees keys 0..=pos0 + qi.
    let pos0 = s.context_len - s.q_len + it.q0;
    let nk = pos0 + nq;

    scratch.q.clear();
    for qi in 0..nq {
        let o = ((s.q_start + it.q0 + qi) * h + it.kvh * g) * d;
        scratch.q.extend_from_slice(&q[o..o + g * d]);
    }
    scratch.s.clear();
    scratch.s.resize(m * nk, 0.0);
    let parallelism = gemm::Parallelism::None;
    // SAFETY: dst is `S: [m, nk]` row-major (row stride nk, column stride 1) inside `scratch.s`
    // (resized to m*nk above); lhs is `Q: [m, d]` (row stride d) in `scratch.q` (m*d floats);
    // rhs is `Kᵀ: [d, nk]` read from the gathered `K: [context_len, d]` (element (p, j) at
    // j*d + p: row stride 1, column stride d; nk <= context_len). dst aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            nk,
            d,
            scratch.s.as_mut_ptr(),
            1,
            nk as isize,
            false,
            scratch.q.as_ptr(),
            1,
            d as isize,
            kv.k.as_ptr(),
            d as isize,
            1,
            0.0f32,
            shape.scale,
            false,
            false,
            false,
            parallelism,
        )
    };
    let mut inv_sum = vec![0f32; m];
    for (r, inv) in inv_sum.iter_mut().enumerate() {
        let visible = pos0 + r / g + 1;
        let row = &mut scratch.s[r * nk..(r + 1) * nk];
        let (seen, masked) = row.split_at_mut(visible);
        let max = simd::max(isa, seen);
        let sum = simd::exp_shifted(isa, seen, max);
        masked.fill(0.0);
        *inv = 1.0 / sum;
    }
    let mut out = vec![0f32; m * d];
    // SAFETY: dst is `O: [m, d]` row-major in `out` (m*d floats); lhs is `P: [m, nk]` (row stride
    // nk) in `scratch.s`; rhs is `V: [nk, d]` (row stride d) in the gathered values
    // (context_len*d >= nk*d floats). dst aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            d,
            nk,
            out.as_mut_ptr(),
            1,
            d as isize,
            false,
            scratch.s.as_ptr(),
            1,
            nk as isize,
            kv.v.as_ptr(),
            1,
            d as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        )
    };
    for (row, inv) in out.chunks_exact_mut(d).zip(&inv_sum) {
        row.iter_mut().for_each(|v| *v *= inv);
    }
    out
}
