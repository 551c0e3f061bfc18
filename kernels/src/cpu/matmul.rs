//! `linear` on the CPU: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)`, with weights in the plain
//! Hugging Face layout. The model's weights are prepared once at load and multiplied by
//! [`super::packed`] instead (about 2x this kernel at decode batch 32); this path serves
//! `Backend::linear` callers that hold plain weights.
//!
//! Two regimes:
//! - **Skinny** (`m <= SKINNY_MAX_M` by default, i.e. decode): the weight matrix is streamed from memory
//!   from DRAM exactly once, so for small `m` time is bytes / bandwidth. Output rows are split
//!   into contiguous ranges over the rayon pool (each range's weights fit L2). On AVX-512, full
//!   groups of 8 activation rows are cut along `k` so that all groups stay in L1, and each pair of
//!   weight rows is dotted with every group while it is in L1 ([`simd::dots8_groups`]: 16
//!   register accumulators, one transposing reduction), so weights come from memory once per
//!   call. Leftover rows (and other ISAs) go in groups of up to 8, each step dotting a group
//!   against 1-3 weight rows with register-resident accumulators ([`simd::dots`]).
//! - **Wide** (prefill): the `gemm` crate's packed, cache-blocked kernel, parallel on our pool.
//!
//! Inputs were validated by the caller (`check::linear`); slices here are exactly sized.

use super::simd::{self, Isa};
use rayon::prelude::*;

/// Largest `m` served by the skinny kernel; larger batches go to `gemm`. `gemm` packs the whole
/// weight matrix on every call (its `pack_lhs` was 40% of a batch-32 decode step), which only pays
/// once `m` is large; with the 8-row AVX-512 kernel ([`simd::dots8_groups`]) the streaming kernel
/// is ahead of gemm up to m = 32 on every base-100m shape and about even at m = 64
/// (`examples/decode_shapes.rs`, 2 threads).
pub(crate) const SKINNY_MAX_M: usize = 64;

/// Activation rows per pass of the skinny kernel (accumulators must fit in registers).
const MR: usize = 8;

/// Activation floats per pass kept hot in L1 (32 KiB): `x` is split along `k` into blocks of
/// `L1_FLOATS / rows` so that every weight element is multiplied against L1-resident activations.
const L1_FLOATS: usize = 8192;

/// Weight rows handled by one rayon task: enough tasks to balance the pool, and a task's slice
/// of `w` (re-read once per group of `MR` activation rows) small enough to stay in L2.
fn rows_per_task(n: usize, k: usize, threads: usize) -> usize {
    let l2_rows = (1 << 20) / (4 * k.max(1));
    n.div_ceil(threads * 4).min(l2_rows).max(4)
}

/// Computes the product, with the skinny kernel when `m <= skinny_max_m`; `x: m*k`, `w: n*k`, `bias: n`, `out: m*n`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    pool: &rayon::ThreadPool,
    isa: Isa,
    skinny_max_m: usize,
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
    if m <= skinny_max_m {
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
    let rows = rows_per_task(n, k, pool.current_num_threads());
    let task = |(c, chunk): (usize, &mut [f32])| tile(isa, x, w, bias, (m, k), c * rows, chunk);
    if m == 1 {
        // The transposed output `[n, 1]` is `out` itself.
        pool.install(|| out.par_chunks_mut(rows).enumerate().for_each(task));
        return;
    }
    // Each task computes its columns `j0..j1` transposed (`[j1 - j0, m]`) in a task-local buffer,
    // then writes them into `out` itself: the transpose runs in parallel and while the tile is hot.
    let dst = OutPtr(out.as_mut_ptr());
    let dst = &dst;
    pool.install(|| {
        (0..n.div_ceil(rows)).into_par_iter().for_each(|c| {
            let (j0, j1) = (c * rows, ((c + 1) * rows).min(n));
            let mut tile_t = vec![0f32; (j1 - j0) * m];
            task((c, &mut tile_t));
            for i in 0..m {
                // SAFETY: `out` is `[m, n]` (checked by the caller); row `i`, columns `j0..j1` lie
                // inside it, and tasks own disjoint column ranges, so no two tasks write the same
                // element and nothing reads `out` until the parallel loop has joined.
                let row = unsafe { std::slice::from_raw_parts_mut(dst.0.add(i * n + j0), j1 - j0) };
                for (o, col) in row.iter_mut().zip(tile_t.chunks_exact(m)) {
                    *o = col[i];
                }
            }
        })
    });
}

/// `out`'s base pointer, shared by the tasks of [`skinny`], which write disjoint elements.
struct OutPtr(*mut f32);
// SAFETY: only used to write disjoint column ranges from tasks joined before `out` is used again.
unsafe impl Sync for OutPtr {}

/// Fills `chunk`, rows `j0..` of the transposed output `[n, m]`, with `bias[j] + x[i] · w[j]`:
/// activation rows in groups of up to `MR`, each group in `k` blocks that fit L1.
fn tile(isa: Isa, x: &[f32], w: &[f32], bias: Option<&[f32]>, (m, k): (usize, usize), j0: usize, chunk: &mut [f32]) {
    for (jj, o) in chunk.chunks_exact_mut(m).enumerate() {
        o.fill(bias.map_or(0.0, |b| b[j0 + jj]));
    }
    // Full groups of 8 rows on AVX-512: k blocks small enough that all groups' activations stay
    // in L1, so each weight element comes from memory once and meets every activation row there.
    let full = if isa == Isa::Avx512 { m / MR } else { 0 };
    if full > 0 {
        let kb = (L1_FLOATS / (full * MR)).max(64) / 16 * 16;
        let w = &w[j0 * k..];
        let rows = chunk.len() / m;
        for k0 in (0..k).step_by(kb) {
            let done = simd::dots8_groups(isa, x, w, (k, k0, (k0 + kb).min(k)), full, rows, chunk, m);
            debug_assert!(done, "AVX-512 has the 8-row kernel");
        }
    }
    for g0 in (full * MR..m).step_by(MR) {
        let g = (m - g0).min(MR);
        let kb = (L1_FLOATS / g).max(16);
        for k0 in (0..k).step_by(kb) {
            let p = Pass { isa, x, w, k, g0, k0, k1: (k0 + kb).min(k), m, j0 };
            match g {
                1 => p.run::<1>(chunk),
                2 => p.run::<2>(chunk),
                3 => p.run::<3>(chunk),
                4 => p.run::<4>(chunk),
                5 => p.run::<5>(chunk),
                6 => p.run::<6>(chunk),
                7 => p.run::<7>(chunk),
                _ => p.run::<8>(chunk),
            }
        }
    }
}

/// One group of activation rows `g0..g0 + M` and one `k` block `k0..k1` against a task's weight
/// rows.
struct Pass<'a> {
    isa: Isa,
    x: &'a [f32],
    w: &'a [f32],
    k: usize,
    g0: usize,
    k0: usize,
    k1: usize,
    m: usize,
    j0: usize,
}

impl Pass<'_> {
    fn run<const M: usize>(&self, chunk: &mut [f32]) {
        // Weight rows per step: as many as keep `M × J` accumulators plus the loaded rows in
        // registers (32 with AVX-512, 16 with AVX2), so each activation load feeds `J` FMAs.
        match (self.isa, M) {
            // 3 rows for small groups (more loads in flight); 2 for larger ones, whose `M × 3`
            // accumulators would spill to the stack.
            (Isa::Avx512, 1..=4) => self.run_j::<M, 3>(chunk),
            (Isa::Avx512, _) => self.run_j::<M, 2>(chunk),
            (Isa::Avx2Fma, 1..=4) => self.run_j::<M, 2>(chunk),
            _ => self.run_j::<M, 1>(chunk),
        }
    }

    fn run_j<const M: usize, const J: usize>(&self, chunk: &mut [f32]) {
        let (k, k0, k1, m, g0) = (self.k, self.k0, self.k1, self.m, self.g0);
        let xs: [&[f32]; M] = std::array::from_fn(|r| &self.x[(g0 + r) * k + k0..(g0 + r) * k + k1]);
        let wrow = |j: usize| &self.w[j * k + k0..j * k + k1];
        let rows = chunk.len() / m;
        let mut jj = 0;
        while jj + J <= rows {
            let ws: [&[f32]; J] = std::array::from_fn(|u| wrow(self.j0 + jj + u));
            let d = simd::dots::<M, J>(self.isa, &xs, &ws);
            for (u, d) in d.iter().enumerate() {
                add(&mut chunk[(jj + u) * m + g0..(jj + u) * m + g0 + M], d);
            }
            jj += J;
        }
        for jj in jj..rows {
            let [d] = simd::dots::<M, 1>(self.isa, &xs, &[wrow(self.j0 + jj)]);
            add(&mut chunk[jj * m + g0..jj * m + g0 + M], &d);
        }
    }
}

fn add(acc: &mut [f32], d: &[f32]) {
    acc.iter_mut().zip(d).for_each(|(a, d)| *a += d);
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
        out.chunks_exact_mut(n).for_each(|row| row.copy_from_slice(&b[..n]));
    }
    let threads = pool.current_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
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
