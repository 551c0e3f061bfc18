//! `linear` on block-quantized weights ([`QuantMatrix`]), multiplied without widening them to
//! f32 in memory, so a decode step reads each weight's quantized bytes once.
//!
//! Two regimes, split at [`QUANT_MAX_M`] activation rows:
//! - **Integer** (decode and small batches): the activations are quantized to 8 bits per block
//!   of 32 ([`acts`]); each task takes a run of weight rows, decodes `C` of them at a time,
//!   a chunk of `k` at a time, into one canonical form whatever the format ([`decode`]), and
//!   multiplies the chunk against every activation row in tiles of `R` rows with exact integer
//!   dot products of four bytes ([`dot`]: AVX2 `maddubs`, AVX-512BW, AVX-512 VNNI `vpdpbusd`, or
//!   portable), scaled in f32 per 32 values; the weight offsets (Q4_1's `m`, Q4_0's `-8 d`,
//!   the K-quants' mins) meet the activations' block sums in one short f32 dot per row pair.
//!   The decoded chunk (a few KiB) stays in L1 while the activation rows stream past it, so the
//!   decoding is paid once per weight per call, and each weight byte is read from memory once.
//! - **Wide** (prefill): columns in blocks of panels are dequantized into the f32 panel layout
//!   of [`super::packed`] (a bounded scratch) and multiplied by its micro-kernel; the cost of
//!   dequantizing is small beside `m` rows of FMAs, and the f32 kernel needs no per-row scaling.
//!
//! Why integer dot products rather than f32 activations against weights widened in registers:
//! measured, see BENCHMARKS.md ("Quantized weights") and `examples/quant_shapes.rs`. The accuracy
//! cost is the activations' 8-bit rounding (bounded in [`acts`]), which the wide path does not pay.
//!
//! Work split: one rayon task per run of weight rows of one product (several products of the
//! same `x` share one parallel region), each writing its own columns of `out`.

mod acts;
mod decode;
mod dot;

use rayon::prelude::*;

use super::packed::{self, PackedLinear};
use super::simd::{self, Isa};
use crate::quant::QuantMatrix;
use crate::Result;
use acts::QActs;
use dot::{WRow, XRow};

/// Largest `m` served by the integer kernels; larger batches dequantize panels for the f32
/// micro-kernel (measured crossover: `examples/quant_shapes.rs`).
pub const QUANT_MAX_M: usize = 32;

/// Activation rows per integer tile.
const RMAX: usize = 4;
/// Weight rows decoded and multiplied together.
const CMAX: usize = 2;
/// Values of `k` decoded per chunk: a multiple of every block size, small enough that `CMAX`
/// decoded rows stay in L1.
const KC: usize = 4096;
/// Floats of the wide path's f32 panel scratch (16 MiB); columns are done in blocks that fit.
const WIDE_SCRATCH_FLOATS: usize = 4 << 20;

/// The instruction set of the quantized kernels: AVX-512 needs BW (byte multiplies) and uses
/// VNNI where present, which the f32 kernels' [`Isa::Avx512`] (AVX-512F) does not imply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantIsa {
    /// AVX-512F/BW/VL with VNNI (`vpdpbusd`).
    Avx512Vnni,
    /// AVX-512F/BW/VL, `vpmaddubsw` + `vpmaddwd`.
    Avx512Bw,
    /// AVX2 + FMA + F16C.
    Avx2,
    Portable,
}

impl QuantIsa {
    /// The best quantized path that `isa` allows on this CPU.
    pub fn for_isa(isa: Isa) -> QuantIsa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            let bw = is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl");
            match isa {
                Isa::Avx512 if avx2 && bw && is_x86_feature_detected!("avx512vnni") => return QuantIsa::Avx512Vnni,
                Isa::Avx512 if avx2 && bw => return QuantIsa::Avx512Bw,
                Isa::Avx512 | Isa::Avx2Fma if avx2 => return QuantIsa::Avx2,
                _ => {}
            }
        }
        let _ = isa;
        QuantIsa::Portable
    }

    /// Every path this CPU can run, portable first (for tests and benchmarks).
    pub fn available() -> Vec<QuantIsa> {
        let best = QuantIsa::for_isa(Isa::detect());
        let all = [QuantIsa::Portable, QuantIsa::Avx2, QuantIsa::Avx512Bw, QuantIsa::Avx512Vnni];
        let rank = |q: QuantIsa| all.iter().position(|&a| a == q).unwrap_or(0);
        all.into_iter().filter(|&q| rank(q) <= rank(best)).collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantIsa::Avx512Vnni => "avx512-vnni",
            QuantIsa::Avx512Bw => "avx512bw",
            QuantIsa::Avx2 => "avx2",
            QuantIsa::Portable => "portable",
        }
    }
}

/// One product of [`linear_many`]: `out[m, n] = x[m, k] · wᵀ (+ bias)`.
pub(crate) struct Product<'a> {
    pub w: &'a QuantMatrix,
    pub bias: Option<&'a [f32]>,
    pub out: &'a mut [f32],
}

/// Several products of the same `x` (q/k/v, gate/up); every weight has `k` inputs and sizes
/// were checked by the caller (`x: m*k`, each `out: m*n`, `bias: n`).
pub(crate) fn linear_many(
    pool: &rayon::ThreadPool,
    isa: Isa,
    qisa: QuantIsa,
    x: &[f32],
    m: usize,
    products: &mut [Product<'_>],
) -> Result<()> {
    let Some(k) = products.first().map(|p| p.w.k()) else { return Ok(()) };
    debug_assert!(products.iter().all(|p| p.w.k() == k));
    if m == 0 {
        return Ok(());
    }
    if k == 0 {
        for p in products.iter_mut() {
            fill_bias(p.out, p.bias, p.w.n());
        }
        return Ok(());
    }
    if m > QUANT_MAX_M {
        for p in products.iter_mut() {
            wide(pool, isa, x, m, p)?;
        }
        return Ok(());
    }
    let mut acts = QActs::default();
    acts.quantize(qisa, x, m, k);
    let acts = &acts;
    // Runs of weight rows per task: enough tasks to balance the pool.
    let wanted = 4 * pool.current_num_threads();
    let mut plans = Vec::with_capacity(products.len());
    let mut first = 0;
    for p in products.iter_mut().filter(|p| p.w.n() > 0) {
        let n = p.w.n();
        let rows = n.div_ceil(wanted).next_multiple_of(CMAX);
        let tasks = n.div_ceil(rows);
        plans.push(Plan { w: p.w, bias: p.bias, dst: OutPtr(p.out.as_mut_ptr()), rows, first });
        first += tasks;
    }
    let plans = &plans;
    let task = |i: usize| {
        let plan = plans.iter().rev().find(|p| p.first <= i).expect("task index inside the plans");
        let n = plan.w.n();
        let j0 = (i - plan.first) * plan.rows;
        let j1 = (j0 + plan.rows).min(n);
        let mut res = vec![0f32; m * (j1 - j0)];
        rows_task(isa, qisa, plan.w, acts, m, j0..j1, &mut res);
        for r in 0..m {
            // SAFETY: this product's `out` is `[m, n]` (checked by the caller); row `r < m`,
            // columns `j0..j1 <= n`. Tasks own disjoint (product, column run) pieces, and
            // nothing reads an `out` until the parallel loop has joined.
            let o = unsafe { std::slice::from_raw_parts_mut(plan.dst.0.add(r * n + j0), j1 - j0) };
            let res = &res[r * (j1 - j0)..(r + 1) * (j1 - j0)];
            match plan.bias {
                Some(b) => o.iter_mut().zip(res).zip(&b[j0..j1]).for_each(|((o, v), b)| *o = v + b),
                None => o.copy_from_slice(res),
            }
        }
    };
    match first {
        0 => {}
        1 => task(0),
        count => pool.install(|| (0..count).into_par_iter().for_each(task)),
    }
    Ok(())
}

/// A product's share of the task space of [`linear_many`].
struct Plan<'a> {
    w: &'a QuantMatrix,
    bias: Option<&'a [f32]>,
    dst: OutPtr,
    /// Weight rows per task.
    rows: usize,
    /// Index of this product's first task.
    first: usize,
}

/// An `out`'s base pointer, shared by the tasks of [`linear_many`], which write disjoint elements.
struct OutPtr(*mut f32);
// SAFETY: only used to write disjoint pieces from tasks joined before `out` is used again.
unsafe impl Sync for OutPtr {}

fn fill_bias(out: &mut [f32], bias: Option<&[f32]>, n: usize) {
    for row in out.chunks_exact_mut(n.max(1)) {
        match bias {
            Some(b) => row.copy_from_slice(&b[..n]),
            None => row.fill(0.0),
        }
    }
}

/// Decoded weight rows of one chunk (see [`decode`]), `CMAX` rows of `KC` values.
struct Scratch {
    q: Vec<u8>,
    ds: Vec<f32>,
    wm: Vec<f32>,
}

/// `res[r, j - j0] = x[r] · w[j]` for the weight rows `j` of `rows`, without bias.
fn rows_task(
    isa: Isa,
    qisa: QuantIsa,
    w: &QuantMatrix,
    acts: &QActs,
    m: usize,
    rows: std::ops::Range<usize>,
    res: &mut [f32],
) {
    let (format, k) = (w.format(), w.k());
    let (bv, bb) = (format.block_values(), format.block_bytes());
    let signed = decode::signed(format);
    let kc = KC.min(k);
    let mut s = Scratch { q: vec![0; CMAX * kc], ds: vec![0.0; CMAX * kc / 4], wm: vec![0.0; CMAX * kc / 16] };
    let width = rows.len();
    for j in rows.clone().step_by(CMAX) {
        let c = CMAX.min(rows.end - j);
        for k0 in (0..k).step_by(kc) {
            let k1 = (k0 + kc).min(k);
            let len = k1 - k0;
            for cc in 0..c {
                let blocks = &w.row(j + cc)[k0 / bv * bb..k1 / bv * bb];
                decode::decode(
                    qisa,
                    format,
                    blocks,
                    &mut s.q[cc * kc..],
                    &mut s.ds[cc * kc / 4..],
                    &mut s.wm[cc * kc / 16..],
                );
            }
            let wrow =
                |cc: usize| WRow { q: &s.q[cc * kc..cc * kc + len], ds: &s.ds[cc * kc / 4..cc * kc / 4 + len / 4] };
            for r0 in (0..m).step_by(RMAX) {
                let rr = RMAX.min(m - r0);
                let xrow = |r: usize| {
                    let (q, d, _) = acts.row(r0 + r);
                    XRow { q: &q[k0..k1], d: &d[k0 / 32..k1 / 32] }
                };
                let sums = tile_dispatch(qisa, signed, rr, c, &wrow, &xrow, len / 32);
                for (cc, sums) in sums.iter().enumerate().take(c) {
                    for (r, v) in sums.iter().enumerate().take(rr) {
                        let mut v = *v;
                        if !signed {
                            let wm = &s.wm[cc * kc / 16..cc * kc / 16 + len / 16];
                            v += simd::dot(isa, wm, &acts.row(r0 + r).2[k0 / 16..k1 / 16]);
                        }
                        res[(r0 + r) * width + (j - rows.start) + cc] += v;
                    }
                }
            }
        }
    }
}

/// [`dot::tile`] for `rr <= RMAX` activation rows and `c <= CMAX` weight rows, as a
/// `RMAX × CMAX` array (entries past `rr`, `c` are zero).
fn tile_dispatch<'a>(
    qisa: QuantIsa,
    signed: bool,
    rr: usize,
    c: usize,
    wrow: &dyn Fn(usize) -> WRow<'a>,
    xrow: &dyn Fn(usize) -> XRow<'a>,
    units: usize,
) -> [[f32; RMAX]; CMAX] {
    fn run<'a, const R: usize, const C: usize>(
        qisa: QuantIsa,
        signed: bool,
        wrow: &dyn Fn(usize) -> WRow<'a>,
        xrow: &dyn Fn(usize) -> XRow<'a>,
        units: usize,
    ) -> [[f32; RMAX]; CMAX] {
        let w: [WRow<'a>; C] = std::array::from_fn(wrow);
        let x: [XRow<'a>; R] = std::array::from_fn(xrow);
        let t = dot::tile::<R, C>(qisa, signed, &w, &x, units);
        let mut out = [[0f32; RMAX]; CMAX];
        for (o, t) in out.iter_mut().zip(&t) {
            o[..R].copy_from_slice(t);
        }
        out
    }
    match (rr, c) {
        (1, 1) => run::<1, 1>(qisa, signed, wrow, xrow, units),
        (2, 1) => run::<2, 1>(qisa, signed, wrow, xrow, units),
        (3, 1) => run::<3, 1>(qisa, signed, wrow, xrow, units),
        (_, 1) => run::<4, 1>(qisa, signed, wrow, xrow, units),
        (1, _) => run::<1, 2>(qisa, signed, wrow, xrow, units),
        (2, _) => run::<2, 2>(qisa, signed, wrow, xrow, units),
        (3, _) => run::<3, 2>(qisa, signed, wrow, xrow, units),
        _ => run::<4, 2>(qisa, signed, wrow, xrow, units),
    }
}

/// The wide regime: columns in blocks whose f32 panels fit [`WIDE_SCRATCH_FLOATS`], each block
/// dequantized into panels and multiplied by the packed micro-kernel.
fn wide(pool: &rayon::ThreadPool, isa: Isa, x: &[f32], m: usize, p: &mut Product<'_>) -> Result<()> {
    let (n, k) = (p.w.n(), p.w.k());
    let cols = (WIDE_SCRATCH_FLOATS / k).max(packed::NR) / packed::NR * packed::NR;
    for c0 in (0..n).step_by(cols) {
        let nb = cols.min(n - c0);
        let panels = PackedLinear::pack_with(pool, nb, k, |j, row| p.w.dequantize_row(c0 + j, row))?;
        let bias = p.bias.map(|b| &b[c0..c0 + nb]);
        let out = &mut p.out[c0..];
        packed::linear_many(pool, isa, x, m, &mut [packed::Product { w: &panels, bias, out, ld: n }]);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
