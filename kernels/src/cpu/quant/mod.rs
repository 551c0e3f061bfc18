//! `linear` on block-quantized weights ([`QuantMatrix`]), multiplied without widening them to
//! f32 in memory, so a decode step reads each weight's quantized bytes once.
//!
//! Two regimes, split at [`QuantIsa::max_m`] activation rows:
//! - **Integer** (decode and small batches): the activations are quantized to 8 bits with a
//!   scale per four values ([`acts`]); each task takes a run of weight rows and decodes every 32-value unit of a
//!   row into one canonical form whatever the format ([`portable`]: quant bytes, a scale per four
//!   of them, offsets), in registers on x86 ([`x86`]: AVX2, AVX-512BW, AVX-512 VNNI), and
//!   multiplies it at once against up to eight activation rows with exact integer dot products
//!   of four bytes, scaled in f32 per unit; the weight offsets (Q4_1's `m`, Q4_0's `-8 d`, the
//!   K-quants' mins) meet the activations' block sums in scalar FMAs (one f32 dot per row on the
//!   portable path). Each weight byte is read from memory once per group of eight activation
//!   rows.
//! - **Wide** (prefill, larger batches): the f32 micro-kernel of [`super::packed`], on panels
//!   each task decodes as it reaches them into a buffer that stays in L2 while every row tile of
//!   its block passes over it; decoding is small beside `m` rows of FMAs, the activations stay
//!   f32 (exact up to summation order), and no f32 copy of the weight reaches memory.
//!
//! Why integer dot products rather than f32 activations against weights widened in registers:
//! measured, see BENCHMARKS.md ("Quantized weights") and `examples/quant_shapes.rs`. The accuracy
//! cost is the activations' 8-bit rounding (bounded in [`acts`]), which the wide path does not pay.
//!
//! Work split: one task per run of weight rows of one product (several products of the same `x`
//! share one parallel region), each writing its own columns of `out`; the tasks go to the
//! forward pass's crew when there is one (`super::crew::par_tasks`), else to rayon.

mod acts;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::packed;
use super::simd::Isa;
use crate::quant::{QuantFormat, QuantMatrix};
use crate::Rows;
use acts::QActs;

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

    /// Largest `m` served by the integer kernels; larger batches go to the f32 micro-kernel on
    /// decoded panels.
    ///
    /// Decode rows ([`Rows::Decode`]): for as long as the integer kernels are the faster. They
    /// decode each weight unit once per eight rows where the panels decode it once, so the
    /// crossover comes sooner for formats whose units cost more to decode (fifth bits, K-quant
    /// scales): 48 rows for Q8_0, Q4_0 and Q4_1, 32 for the others. Measured with
    /// `examples/quant_shapes.rs`, 2 threads, on the Intel Xeon VM with VNNI (ms a step, integer
    /// against panels): on SmolLM2's shapes Q4_1 60.5 / 82.6 at 32 rows and 120.6 / 104.2 at
    /// 64, Q8_0 58.8 / 74.1 and 109.4 / 101.8; on its MLP down projection alone (k = 1536) Q4_1
    /// 10.5 / 12.7 at 32 and 15.5 / 16.3 at 48, Q5_0 12.5 / 12.2 and 18.0 / 15.2, Q4_K
    /// 12.5 / 12.5 and 19.0 / 15.0. (On the AMD EPYC VM the AVX2 kernel led up to about 56 on
    /// Q4_1.) A decode row takes 8-bit activations at batch 1 anyway, so a batch of them pays no
    /// accuracy for it.
    ///
    /// Prompt rows: 16, for accuracy: prefill chunks then see the f32 activations (the K/V of a
    /// prompt as `--dequantize-weights` computes it), where the 8-bit activations' noise (about
    /// 0.05 nats on a log-prob) had flipped SmolLM2's first answer token on a near-tie. Chunks
    /// of 17-48 rows pay 10-30% for it.
    pub fn max_m(self, rows: Rows, format: QuantFormat) -> usize {
        match (rows, format) {
            (Rows::Prompt, _) => 16,
            (Rows::Decode, QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1) => 48,
            (Rows::Decode, _) => 32,
        }
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

/// Which kernels [`linear_many`] runs: the f32 and quantized ISAs, and the largest `m` for the
/// integer kernels (normally [`QuantIsa::max_m`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernels {
    pub isa: Isa,
    pub qisa: QuantIsa,
    pub max_m: usize,
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
    Kernels { isa, qisa, max_m }: Kernels,
    x: &[f32],
    m: usize,
    products: &mut [Product<'_>],
) {
    let Some(k) = products.first().map(|p| p.w.k()) else { return };
    debug_assert!(products.iter().all(|p| p.w.k() == k));
    if m == 0 {
        return;
    }
    // The wide path also fills in the biases of `k == 0`.
    if m > max_m || k == 0 {
        wide(pool, isa, qisa, x, m, products);
        return;
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
        let rows = n.div_ceil(wanted);
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
        let width = j1 - j0;
        let mut res = vec![0f32; m * width];
        rows_task(qisa, plan.w, acts, m, j0..j1, &mut res);
        for r in 0..m {
            let res = &res[r * width..(r + 1) * width];
            if plan.w.is_reordered() {
                // Stored rows `j0..j1` are the output features `feature_of(j)`, which no other
                // task's stored rows are (a permutation).
                for (j, v) in (j0..j1).zip(res) {
                    let f = plan.w.feature_of(j);
                    // SAFETY: as below, for the one element `(r, f)`, `f < n`.
                    unsafe { *plan.dst.0.add(r * n + f) = v + plan.bias.map_or(0.0, |b| b[f]) };
                }
                continue;
            }
            // SAFETY: this product's `out` is `[m, n]` (checked by the caller); row `r < m`,
            // columns `j0..j1 <= n`. Tasks own disjoint (product, column run) pieces, and
            // nothing reads an `out` until the parallel loop has joined.
            let o = unsafe { std::slice::from_raw_parts_mut(plan.dst.0.add(r * n + j0), j1 - j0) };
            match plan.bias {
                Some(b) => o.iter_mut().zip(res).zip(&b[j0..j1]).for_each(|((o, v), b)| *o = v + b),
                None => o.copy_from_slice(res),
            }
        }
    };
    match first {
        0 => {}
        1 => task(0),
        count => crate::cpu::crew::par_tasks(pool, count, &task),
    }
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

/// `res[r, j - j0] = x[r] · w[j]` for the weight rows `j` of `rows` (`j0 = rows.start`), without
/// bias.
fn rows_task(qisa: QuantIsa, w: &QuantMatrix, acts: &QActs, m: usize, rows: std::ops::Range<usize>, res: &mut [f32]) {
    let width = rows.len();
    match qisa {
        QuantIsa::Portable => portable::rows_task(w, acts, m, rows, res, width),
        #[cfg(target_arch = "x86_64")]
        _ => {
            let mut r0 = 0;
            while r0 < m {
                let rr = x86::GROUPS.into_iter().find(|&g| g <= m - r0).unwrap_or(1);
                x86::run(qisa, w, rows.clone(), (acts, r0, rr), (&mut res[r0 * width..], width));
                r0 += rr;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => portable::rows_task(w, acts, m, rows, res, width),
    }
}

/// A quantized weight seen as panels for the f32 micro-kernel, each decoded when a task reaches
/// it (into the task's own buffer, which stays in L2 while every row tile of its block passes).
struct QuantPanels<'a> {
    w: &'a QuantMatrix,
    isa: Isa,
    qisa: QuantIsa,
}

impl packed::Panels for QuantPanels<'_> {
    fn n(&self) -> usize {
        self.w.n()
    }

    fn k(&self) -> usize {
        self.w.k()
    }

    fn stored(&self, _: usize) -> Option<super::packed::Panel<'_>> {
        None
    }

    fn decode(&self, p: usize, buf: &mut [f32]) {
        let (w, qisa) = (self.w, self.qisa);
        let row = |j: usize, out: &mut [f32]| match qisa {
            #[cfg(target_arch = "x86_64")]
            QuantIsa::Avx2 | QuantIsa::Avx512Bw | QuantIsa::Avx512Vnni => x86::dequantize_row(qisa, w, j, out),
            _ => w.dequantize_row(j, out),
        };
        packed::fill_panel(self.isa, buf, p, w.n(), w.k(), &row);
    }
}

/// The wide regime: the f32 micro-kernel on panels decoded as they are reached.
fn wide(pool: &rayon::ThreadPool, isa: Isa, qisa: QuantIsa, x: &[f32], m: usize, products: &mut [Product<'_>]) {
    let panels: Vec<QuantPanels<'_>> = products.iter().map(|p| QuantPanels { w: p.w, isa, qisa }).collect();
    let mut f32s: Vec<packed::Product<'_>> = products
        .iter_mut()
        .zip(&panels)
        .map(|(p, w)| packed::Product { w, bias: p.bias, ld: p.w.n(), out: &mut *p.out })
        .collect();
    packed::linear_many(pool, isa, x, m, &mut f32s);
}

#[cfg(test)]
mod tests;
