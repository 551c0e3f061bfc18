//! `linear` on the CPU: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)`.
//!
//! Two regimes:
//! - **Skinny** (`m <= SKINNY_MAX_M`, i.e. decode): the weight matrix is streamed from memory
//!   exactly once, so time is bytes / bandwidth. Output rows are split into contiguous ranges
//!   over the rayon pool; for each weight row all `m` activation rows (which stay in L1/L2) are
//!   dotted against it in one pass ([`simd::dots`]).
//! - **Wide** (prefill): the `gemm` crate's packed, cache-blocked kernel, parallel on our pool.
//!
//! Inputs were validated by the caller (`check::linear`); slices here are exactly sized.

use super::simd::{self, Isa};
use rayon::prelude::*;

/// Largest `m` served by the skinny kernel; larger batches go to `gemm`. Chosen by measurement
/// (`examples/kernel_bench.rs`): the skinny kernel re-reads `w` once per 8 rows, gemm packs it.
pub(crate) const SKINNY_MAX_M: usize = 8;

/// Rows of `w` per rayon task in the skinny kernel: enough tasks to balance, each long enough
/// that the hardware prefetcher streams it.
fn rows_per_task(n: usize, threads: usize) -> usize {
    (n / (threads * 8)).clamp(16, 1024)
}

/// Computes the product; `x: m*k`, `w: n*k`, `bias: n`, `out: m*n`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    pool: &rayon::ThreadPool,
    isa: Isa,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for row in out.chunks_exact_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return;
    }
    if m <= SKINNY_MAX_M {
        skinny(pool, isa, x, w, bias, (m, k, n), out);
    } else {
        wide(pool, x, w, bias, (m, k, n), out);
    }
}

fn skinny(
    pool: &rayon::ThreadPool,
    isa: Isa,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    let rows = rows_per_task(n, pool.current_num_threads());
    let task = |(c, chunk): (usize, &mut [f32])| {
        let j0 = c * rows;
        match m {
            1 => fill::<1>(isa, x, w, bias, k, j0, chunk),
            2 => fill::<2>(isa, x, w, bias, k, j0, chunk),
            3 => fill::<3>(isa, x, w, bias, k, j0, chunk),
            4 => fill::<4>(isa, x, w, bias, k, j0, chunk),
            5 => fill::<5>(isa, x, w, bias, k, j0, chunk),
            6 => fill::<6>(isa, x, w, bias, k, j0, chunk),
            7 => fill::<7>(isa, x, w, bias, k, j0, chunk),
            _ => fill::<8>(isa, x, w, bias, k, j0, chunk),
        }
    };
    if m == 1 {
        // The transposed output `[n, 1]` is `out` itself.
        pool.install(|| out.par_chunks_mut(rows).enumerate().for_each(task));
        return;
    }
    let mut tn = vec![0f32; m * n];
    pool.install(|| tn.par_chunks_mut(rows * m).enumerate().for_each(task));
    for (j, col) in tn.chunks_exact(m).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            out[i * n + j] = v;
        }
    }
}

/// Fills `chunk = tn[j0.., ..]` (rows of the transposed output `[n, M]`) with
/// `dot(x[i], w[j]) + bias[j]`.
fn fill<const M: usize>(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    j0: usize,
    chunk: &mut [f32],
) {
    let xs: [&[f32]; M] = std::array::from_fn(|i| &x[i * k..(i + 1) * k]);
    for (jj, o) in chunk.chunks_exact_mut(M).enumerate() {
        let j = j0 + jj;
        let d = simd::dots::<M>(isa, &xs, &w[j * k..(j + 1) * k]);
        let b = bias.map_or(0.0, |b| b[j]);
        for (o, d) in o.iter_mut().zip(d) {
            *o = d + b;
        }
    }
}

fn wide(
    pool: &rayon::ThreadPool,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    let out = &mut out[..m * n];
    if let Some(b) = bias {
        out.chunks_exact_mut(n)
            .for_each(|row| row.copy_from_slice(&b[..n]));
    }
    let threads = pool.current_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: dst is `[m, n]` row-major (row stride n, column stride 1) inside `out`; lhs is
    // `x: [m, k]` (row stride k); rhs is `wᵀ: [k, n]` read from `w: [n, k]` (element (p, j) at
    // j*k + p: row stride 1, column stride k). All three were checked to hold these many
    // elements, and dst does not alias the inputs (it is a distinct `&mut`).
    pool.install(|| unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            bias.is_some(),
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        )
    });
}
