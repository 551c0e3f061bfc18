//! `linear` on weights packed once, at load, into panels for an outer-product micro-kernel.
//!
//! Layout: `w: [n, k]` (Hugging Face) becomes `ceil(n / NR)` panels of `k × NR` floats; panel `p`
//! holds `w[p * NR + j, kk]` at `kk * NR + j`, and columns past `n` are zero. A micro-kernel
//! computes an `R × NR` tile of the output (`R <= MR` activation rows): for each `kk` it loads
//! one panel row (`NR` consecutive floats: four AVX-512 vectors) and broadcasts `x[r, kk]` for
//! each of its rows, so the `R × NR` accumulators stay in registers over the whole `k` loop, each
//! weight element is loaded once per tile, and activations need no packing. Every shape, from
//! batch-1 decode (`m = 1`: the panels stream from memory once, sequentially) to prefill
//! (`m` in the thousands: row blocks keep `x` in L2 while each panel meets every row tile of a
//! block), runs the same kernel; nothing is repacked per call, unlike `gemm`.
//!
//! Work split: rows go in blocks of whole row tiles (a block's `x` fits in L2), panels in
//! contiguous runs; one task per (row block, panel run), each writing its own disjoint part of
//! `out`, run by the forward pass's crew when there is one (`super::crew::par_tasks`), else by
//! rayon.
//!
//! The panels come from a [`Panels`]: stored ones ([`PackedLinear`]), or panels a task decodes
//! as it reaches them (quantized weights, `super::quant`), into a buffer of its own that stays in
//! L2 while every row tile of its block passes over it.
//!
//! Invariant of [`PackedLinear`]: `data[off..off + panels * k * NR]` holds the panels and
//! `data.as_ptr() + off` is 64-byte aligned (so no panel row straddles a cache line).

use super::simd::Isa;
use crate::{check, Result};
use rayon::prelude::*;

/// Output columns per panel (four AVX-512 vectors, eight AVX2 ones).
pub const NR: usize = 64;

/// Most activation rows per micro-kernel tile: `6 × 4` accumulators + 4 weight vectors + one
/// broadcast = 29 of AVX-512's 32 registers.
const MR: usize = 6;

/// Activation floats per row block, so that a block's `x` (plus one panel) stays in L2.
const X_BLOCK_FLOATS: usize = 64 * 1024;

/// A linear weight `[n, k]` packed into `NR`-column panels (see the module docs).
pub struct PackedLinear {
    n: usize,
    k: usize,
    data: Vec<f32>,
    off: usize,
}

impl std::fmt::Debug for PackedLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedLinear").field("n", &self.n).field("k", &self.k).finish()
    }
}

impl PackedLinear {
    /// Packs `w: [n, k]` (row-major; only its first `n * k` elements are read).
    pub(crate) fn pack(pool: &rayon::ThreadPool, isa: Isa, w: &[f32], n: usize, k: usize) -> Result<Self> {
        const OP: &str = "prepare_linear";
        check::at_least(OP, "w", w.len(), check::mul(OP, n, k)?)?;
        let row = |j: usize, out: &mut [f32]| out.copy_from_slice(&w[j * k..(j + 1) * k]);
        let panels = n.div_ceil(NR);
        let len = check::mul(OP, check::mul(OP, panels, k)?, NR)?;
        // 16 spare floats to align the panels to 64 bytes.
        let total = len.checked_add(16).ok_or_else(|| check::err(OP, "size overflows".into()))?;
        let mut data = Vec::new();
        data.try_reserve_exact(total).map_err(|_| crate::KernelError::OutOfMemory { bytes: total * 4 })?;
        data.resize(total, 0f32);
        let off = (data.as_ptr() as usize).wrapping_neg() % 64 / std::mem::size_of::<f32>();
        if k > 0 {
            pool.install(|| {
                data[off..off + len]
                    .par_chunks_mut(k * NR)
                    .enumerate()
                    .for_each(|(p, panel)| fill_panel(isa, panel, p, n, k, &row))
            });
        }
        Ok(PackedLinear { n, k, data, off })
    }

    /// Output features (rows of the original weight).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (columns of the original weight).
    pub fn k(&self) -> usize {
        self.k
    }

    fn stored_panel(&self, p: usize) -> &[f32] {
        let size = self.k * NR;
        &self.data[self.off + p * size..self.off + (p + 1) * size]
    }

    /// Copies row `j` of the original weight into `out[..k]` (an embedding lookup in a tied
    /// table): `k` reads at a stride of `NR`.
    pub(crate) fn row_into(&self, j: usize, out: &mut [f32]) {
        let panel = self.stored_panel(j / NR);
        let c = j % NR;
        for (kk, o) in out[..self.k].iter_mut().enumerate() {
            *o = panel[kk * NR + c];
        }
    }

    /// The original `[n, k]` weight (for tests).
    pub fn unpack(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        for (j, row) in w.chunks_exact_mut(self.k.max(1)).enumerate().take(self.n) {
            self.row_into(j, row);
        }
        w
    }
}

/// A 16-bit linear weight `[n, k]` ([`crate::HalfMatrix`]) in the panel layout of
/// [`PackedLinear`], its elements kept in their format: half the bytes of f32 panels.
///
/// Invariant: as [`PackedLinear`]'s, in `u16` elements (`data.as_ptr() + off` 64-byte aligned,
/// columns past `n` zero).
pub struct HalfPacked {
    n: usize,
    k: usize,
    format: crate::HalfFormat,
    data: Vec<u16>,
    off: usize,
}

impl std::fmt::Debug for HalfPacked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HalfPacked").field("format", &self.format).field("n", &self.n).field("k", &self.k).finish()
    }
}

impl HalfPacked {
    /// Packs `w` into panels (its rows become panel columns; no value changes).
    pub(crate) fn pack(pool: &rayon::ThreadPool, w: &crate::HalfMatrix) -> Result<Self> {
        const OP: &str = "prepare_linear_half";
        let (n, k) = (w.n(), w.k());
        let panels = n.div_ceil(NR);
        let len = check::mul(OP, check::mul(OP, panels, k)?, NR)?;
        // 32 spare elements to align the panels to 64 bytes.
        let total = len.checked_add(32).ok_or_else(|| check::err(OP, "size overflows".into()))?;
        let mut data = Vec::new();
        data.try_reserve_exact(total).map_err(|_| crate::KernelError::OutOfMemory { bytes: total * 2 })?;
        data.resize(total, 0u16);
        let off = (data.as_ptr() as usize).wrapping_neg() % 64 / std::mem::size_of::<u16>();
        let src = w.data();
        if k > 0 {
            pool.install(|| {
                data[off..off + len].par_chunks_mut(k * NR).enumerate().for_each(|(p, panel)| {
                    for c in 0..NR.min(n - p * NR) {
                        let row = &src[(p * NR + c) * k..(p * NR + c + 1) * k];
                        for (kk, &v) in row.iter().enumerate() {
                            panel[kk * NR + c] = v;
                        }
                    }
                })
            });
        }
        Ok(HalfPacked { n, k, format: w.format(), data, off })
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn format(&self) -> crate::HalfFormat {
        self.format
    }

    fn stored_panel(&self, p: usize) -> &[u16] {
        let size = self.k * NR;
        &self.data[self.off + p * size..self.off + (p + 1) * size]
    }

    /// Row `j` of the original weight, widened, into `out[..k]` (a tied embedding lookup).
    pub(crate) fn row_into(&self, j: usize, out: &mut [f32]) {
        let panel = self.stored_panel(j / NR);
        let c = j % NR;
        for (kk, o) in out[..self.k].iter_mut().enumerate() {
            *o = self.format.widen(panel[kk * NR + c]);
        }
    }
}

impl Panels for HalfPacked {
    fn n(&self) -> usize {
        self.n
    }

    fn k(&self) -> usize {
        self.k
    }

    fn stored(&self, p: usize) -> Option<Panel<'_>> {
        let panel = self.stored_panel(p);
        Some(match self.format {
            crate::HalfFormat::F16 => Panel::F16(panel),
            crate::HalfFormat::Bf16 => Panel::Bf16(panel),
        })
    }

    fn decode(&self, p: usize, buf: &mut [f32]) {
        for (o, &h) in buf.iter_mut().zip(self.stored_panel(p)) {
            *o = self.format.widen(h);
        }
    }
}

/// Fills `panel` (`k * NR` floats) with panel `p` of an `[n, k]` weight whose row `j`
/// `row(j, out)` writes into `out` (`k` floats); columns past `n` are left as they are.
pub(crate) fn fill_panel(
    isa: Isa,
    panel: &mut [f32],
    p: usize,
    n: usize,
    k: usize,
    row: &(impl Fn(usize, &mut [f32]) + ?Sized),
) {
    // Eight rows at a time, so each step of `kk` writes eight consecutive floats of the panel
    // rather than one at a stride of `NR` (with AVX2, eight steps at once as 8 × 8 transposes).
    const G: usize = 8;
    let mut buf = vec![0f32; G * k];
    let rows = NR.min(n - p * NR);
    for j0 in (0..rows).step_by(G) {
        let g = G.min(rows - j0);
        for (jj, b) in buf.chunks_exact_mut(k).take(g).enumerate() {
            row(p * NR + j0 + jj, b);
        }
        let mut kk = 0;
        #[cfg(target_arch = "x86_64")]
        if g == G && isa != Isa::Portable {
            assert!(panel.len() >= k * NR && j0 + G <= NR);
            while kk + 8 <= k {
                // SAFETY: AVX2 is present for any ISA but portable; rows `0..8` of `buf` hold
                // `kk..kk + 8` (asserted sizes: `buf` is `8 * k`), and panel rows `kk..kk + 8`
                // hold columns `j0..j0 + 8` (asserted above).
                unsafe { transpose8(buf.as_ptr().add(kk), k, panel.as_mut_ptr().add(kk * NR + j0), NR) };
                kk += 8;
            }
        }
        let _ = isa;
        for (kk, dst) in panel.chunks_exact_mut(NR).enumerate().skip(kk) {
            for (jj, d) in dst[j0..j0 + g].iter_mut().enumerate() {
                *d = buf[jj * k + kk];
            }
        }
    }
}

/// `dst[i * dst_stride + j] = src[j * src_stride + i]` for `i, j < 8`.
///
/// # Safety
/// AVX2 available; `src` valid for 8 rows of 8 floats at `src_stride`, `dst` for 8 rows of 8 at
/// `dst_stride`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(src.add(j * src_stride)));
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let out = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (i, v) in out.into_iter().enumerate() {
            _mm256_storeu_ps(dst.add(i * dst_stride), v);
        }
    }
}

/// A stored panel (`k * NR` elements), in the element type its weight holds.
#[derive(Clone, Copy)]
pub(crate) enum Panel<'a> {
    F32(&'a [f32]),
    /// Raw bits of IEEE f16 elements.
    F16(&'a [u16]),
    /// Raw bits of bf16 elements.
    Bf16(&'a [u16]),
}

/// Where [`linear_many`] finds the panels (`k * NR` elements each) of a weight `[n, k]`.
pub(crate) trait Panels: Sync {
    fn n(&self) -> usize;
    fn k(&self) -> usize;
    /// Panel `p`, if this weight stores its panels.
    fn stored(&self, p: usize) -> Option<Panel<'_>>;
    /// Writes panel `p` into `buf` (`k * NR` floats; columns past `n` may hold anything), for a
    /// weight that stores none.
    fn decode(&self, p: usize, buf: &mut [f32]);
}

impl Panels for PackedLinear {
    fn n(&self) -> usize {
        self.n
    }

    fn k(&self) -> usize {
        self.k
    }

    fn stored(&self, p: usize) -> Option<Panel<'_>> {
        Some(Panel::F32(self.stored_panel(p)))
    }

    fn decode(&self, p: usize, buf: &mut [f32]) {
        buf.copy_from_slice(self.stored_panel(p));
    }
}

/// One product of [`linear_many`]: `out[m, n] = x[m, k] · wᵀ (+ bias)`, where row `r` of `out`
/// starts at `out[r * ld]` (`ld >= n`; `ld == n` for a whole output).
pub(crate) struct Product<'a> {
    pub w: &'a dyn Panels,
    pub bias: Option<&'a [f32]>,
    pub out: &'a mut [f32],
    pub ld: usize,
}

/// A product's share of the task space of [`linear_many`].
struct Plan<'a> {
    w: &'a dyn Panels,
    bias: Option<&'a [f32]>,
    dst: OutPtr,
    ld: usize,
    tiles_per_block: usize,
    per_run: usize,
    runs: usize,
    /// Index of this product's first task.
    first: usize,
}

/// Several products of the same `x` (q/k/v, gate/up) in one parallel region, so a layer pays
/// fewer fork/joins (each is a chance to wait for a preempted thread on a shared machine). Every
/// product has `k` inputs; sizes were checked by the caller (`x: m*k`, each `out` holds `m` rows
/// of `n` at a stride of `ld`, `bias: n`).
pub(crate) fn linear_many(pool: &rayon::ThreadPool, isa: Isa, x: &[f32], m: usize, products: &mut [Product<'_>]) {
    let Some(k) = products.first().map(|p| p.w.k()) else { return };
    debug_assert!(products.iter().all(|p| p.w.k() == k));
    if m == 0 {
        return;
    }
    if k == 0 {
        for p in products.iter_mut() {
            let n = p.w.n();
            for row in p.out.chunks_mut(p.ld.max(1)).take(m) {
                let row = &mut row[..n];
                match p.bias {
                    Some(b) => row.copy_from_slice(&b[..n]),
                    None => row.fill(0.0),
                }
            }
        }
        return;
    }
    // Row tiles of at most MR rows, as even as possible (m = 32: 6, 6, 5, 5, 5, 5), so no tile is
    // a thin remainder.
    let tiles = m.div_ceil(MR);
    let tile = |t: usize| {
        let (base, extra) = (m / tiles, m % tiles);
        (t * base + t.min(extra), base + usize::from(t < extra))
    };
    // Row blocks keep `x` in L2 while stored panels stream past; panels decoded per task are
    // dearer to make twice than `x` is to read from L3 again, so those tasks take every row.
    let stored = products.iter().all(|p| p.w.stored(0).is_some() || p.w.n() == 0);
    let most_per_block = if stored { (X_BLOCK_FLOATS / k / MR).clamp(1, tiles) } else { tiles };
    // Blocks as even as possible: a thin last block (m = 113 at k = 576 was 18 tiles and 1)
    // streams every panel again for a few rows, and ran the gate/up products of a 256-row
    // prefill at 264-270 GFLOP/s where even blocks run 320-340.
    let tiles_per_block = tiles.div_ceil(tiles.div_ceil(most_per_block));
    let blocks = tiles.div_ceil(tiles_per_block);
    let wanted = 8 * pool.current_num_threads();
    let mut first = 0;
    let mut plans = Vec::with_capacity(products.len());
    for p in products.iter_mut().filter(|p| p.w.n() > 0) {
        let panels = p.w.n().div_ceil(NR);
        let per_run = panels.div_ceil(wanted.div_ceil(blocks).min(panels));
        let runs = panels.div_ceil(per_run);
        let dst = OutPtr(p.out.as_mut_ptr());
        plans.push(Plan { w: p.w, bias: p.bias, dst, ld: p.ld, tiles_per_block, per_run, runs, first });
        first += blocks * runs;
    }
    let plans = &plans;
    let task = |i: usize| {
        let plan = plans.iter().rev().find(|p| p.first <= i).expect("task index inside the plans");
        let (w, n, per_run) = (plan.w, plan.w.n(), plan.per_run);
        let panels = n.div_ceil(NR);
        let (b, r) = ((i - plan.first) / plan.runs, (i - plan.first) % plan.runs);
        let tile_range = b * plan.tiles_per_block..((b + 1) * plan.tiles_per_block).min(tiles);
        let mut acc = [[0f32; NR]; MR];
        let run_end = ((r + 1) * per_run).min(panels);
        let mut buf = Vec::new();
        for p in r * per_run..run_end {
            let passes = tile_range.len();
            // 16-bit panels are widened in registers when one or two row tiles pass over them
            // (decode: the bytes read are what costs), and widened once into `buf` for more
            // (prefill: each element then meets many rows, and the f32 kernel runs at full rate).
            // Either way every product is the f32 one over the widened weights, summed in the
            // same order, so the results are bit for bit those of the f32 panels.
            let src = match w.stored(p) {
                Some(Panel::F32(panel)) => Panel::F32(panel),
                Some(Panel::F16(h)) if passes >= 3 => {
                    buf.resize(k * NR, 0.0);
                    super::simd_half::to_f32::<false>(isa, h, &mut buf);
                    Panel::F32(&buf[..])
                }
                Some(Panel::Bf16(h)) if passes >= 3 => {
                    buf.resize(k * NR, 0.0);
                    super::simd_half::to_f32::<true>(isa, h, &mut buf);
                    Panel::F32(&buf[..])
                }
                Some(half) => half,
                None => {
                    buf.resize(k * NR, 0.0);
                    w.decode(p, &mut buf);
                    Panel::F32(&buf[..])
                }
            };
            let (c0, cols) = (p * NR, NR.min(n - p * NR));
            // The task's next panel is fetched into L2 a slice per row tile while this one
            // computes, so the weights' trip from memory overlaps the FMAs instead of stalling
            // the first row tile.
            // With one or two row tiles the kernel is bandwidth-bound and the hardware
            // prefetcher does better alone.
            let next = match (p + 1 < run_end && passes >= 3).then(|| w.stored(p + 1)).flatten() {
                Some(Panel::F32(next)) => next,
                _ => &[],
            };
            for (pass, t) in tile_range.clone().enumerate() {
                let (r0, rows) = tile(t);
                let xt = &x[r0 * k..(r0 + rows) * k];
                let lines = next.len() / 16;
                let pf = &next[pass * lines / passes * 16..(pass + 1) * lines / passes * 16];
                match src {
                    Panel::F32(panel) => micro(isa, xt, panel, pf, k, rows, &mut acc),
                    Panel::F16(h) => micro_half::<false>(isa, xt, h, k, rows, &mut acc),
                    Panel::Bf16(h) => micro_half::<true>(isa, xt, h, k, rows, &mut acc),
                }
                for (rr, acc) in acc.iter().enumerate().take(rows) {
                    // SAFETY: this product's `out` holds `m` rows of `n` at a stride of `ld`
                    // (checked by the caller); row `r0 + rr < m`, columns `c0..c0 + cols <= n`.
                    // Tasks own disjoint (product, row block, panel run) rectangles, and nothing
                    // reads an `out` until the parallel loop has joined.
                    let o = unsafe { std::slice::from_raw_parts_mut(plan.dst.0.add((r0 + rr) * plan.ld + c0), cols) };
                    match plan.bias {
                        Some(b) => {
                            for ((o, a), b) in o.iter_mut().zip(acc).zip(&b[c0..c0 + cols]) {
                                *o = a + b;
                            }
                        }
                        None => o.copy_from_slice(&acc[..cols]),
                    }
                }
            }
        }
    };
    match first {
        0 => {}
        1 => task(0),
        count => crate::cpu::crew::par_tasks(pool, count, &task),
    }
}

/// An `out`'s base pointer, shared by the tasks of [`linear_many`], which write disjoint elements.
struct OutPtr(*mut f32);
// SAFETY: only used to write disjoint rectangles from tasks joined before `out` is used again.
unsafe impl Sync for OutPtr {}

/// `acc[r][j] = Σ_kk x[r * k + kk] · panel[kk * NR + j]` for `r < rows`, prefetching `pf` (a
/// slice of the next panel; the portable kernel ignores it) into L2 along the way.
fn micro(isa: Isa, x: &[f32], panel: &[f32], pf: &[f32], k: usize, rows: usize, acc: &mut [[f32; NR]; MR]) {
    match rows {
        1 => micro_r::<1>(isa, x, panel, pf, k, acc),
        2 => micro_r::<2>(isa, x, panel, pf, k, acc),
        3 => micro_r::<3>(isa, x, panel, pf, k, acc),
        4 => micro_r::<4>(isa, x, panel, pf, k, acc),
        5 => micro_r::<5>(isa, x, panel, pf, k, acc),
        _ => micro_r::<6>(isa, x, panel, pf, k, acc),
    }
}

fn micro_r<const R: usize>(isa: Isa, x: &[f32], panel: &[f32], pf: &[f32], k: usize, acc: &mut [[f32; NR]; MR]) {
    // The raw-pointer kernels read `x[..R * k]` and `panel[..k * NR]`; these checks make a wrong
    // call a panic rather than an out-of-bounds read. Prefetches never fault, but they stay
    // inside `pf` too.
    assert!(R <= MR && x.len() >= R * k && panel.len() >= k * NR);
    // Cache lines (16 floats) of `pf` to prefetch per step of `kk`.
    let (lines, per_k) = (pf.len() / 16, (pf.len() / 16).div_ceil(k.max(1)));
    match isa {
        // SAFETY: `detect` returned this ISA only if the CPU supports it; sizes asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::tile::<R>(x.as_ptr(), panel.as_ptr(), k, (pf.as_ptr(), lines, per_k), acc) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::tile::<R>(x.as_ptr(), panel.as_ptr(), k, (pf.as_ptr(), lines, per_k), acc) },
        _ => portable_tile::<R>(x, panel, k, acc),
    }
}

/// [`micro`] over a 16-bit panel (`k * NR` elements; `BF`: bf16, else f16), each weight widened
/// to f32 in registers as it is loaded and the products summed in [`micro`]'s order, so the
/// result is bit for bit [`micro`]'s over the widened panel.
fn micro_half<const BF: bool>(isa: Isa, x: &[f32], panel: &[u16], k: usize, rows: usize, acc: &mut [[f32; NR]; MR]) {
    match rows {
        1 => micro_half_r::<1, BF>(isa, x, panel, k, acc),
        2 => micro_half_r::<2, BF>(isa, x, panel, k, acc),
        3 => micro_half_r::<3, BF>(isa, x, panel, k, acc),
        4 => micro_half_r::<4, BF>(isa, x, panel, k, acc),
        5 => micro_half_r::<5, BF>(isa, x, panel, k, acc),
        _ => micro_half_r::<6, BF>(isa, x, panel, k, acc),
    }
}

fn micro_half_r<const R: usize, const BF: bool>(
    isa: Isa,
    x: &[f32],
    panel: &[u16],
    k: usize,
    acc: &mut [[f32; NR]; MR],
) {
    // As in `micro_r`: the raw-pointer kernels read `x[..R * k]` and `panel[..k * NR]`.
    assert!(R <= MR && x.len() >= R * k && panel.len() >= k * NR);
    match isa {
        // SAFETY: `detect` returned this ISA only if the CPU supports it (AVX2 implies F16C
        // there); sizes asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::tile_half::<R, BF>(x.as_ptr(), panel.as_ptr(), k, acc) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::tile_half::<R, BF>(x.as_ptr(), panel.as_ptr(), k, acc) },
        _ => portable_tile_half::<R, BF>(x, panel, k, acc),
    }
}

/// Prefetches lines `kk * per_k .. (kk + 1) * per_k` (those below `lines`) of `pf` into L2.
///
/// # Safety
/// None needed for memory: a prefetch never faults; `wrapping_add` keeps the address arithmetic
/// defined.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch((pf, lines, per_k): (*const f32, usize, usize), kk: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    for line in kk * per_k..((kk + 1) * per_k).min(lines) {
        // SAFETY: `_mm_prefetch` is a hint: it reads nothing architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(line * 16) as *const i8) };
    }
}

/// Prefetches the lines of `pf` that steps `..upto` of `kk` are to fetch ([`prefetch`]'s
/// shares, `per_k` a step) and are not fetched yet (`*fetched` of them are), into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_upto((pf, lines, per_k): (*const f32, usize, usize), fetched: &mut usize, upto: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let end = upto.saturating_mul(per_k).min(lines);
    while *fetched < end {
        // SAFETY: `_mm_prefetch` is a hint: it reads nothing architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(*fetched * 16) as *const i8) };
        *fetched += 1;
    }
}

/// Column strip width of the portable kernel (lane arrays the compiler vectorizes).
const STRIP: usize = 16;

fn portable_tile<const R: usize>(x: &[f32], panel: &[f32], k: usize, acc: &mut [[f32; NR]; MR]) {
    for s in (0..NR).step_by(STRIP) {
        let mut a = [[0f32; STRIP]; R];
        for kk in 0..k {
            let w: &[f32; STRIP] = panel[kk * NR + s..kk * NR + s + STRIP].try_into().expect("strip");
            for (r, a) in a.iter_mut().enumerate() {
                let xv = x[r * k + kk];
                for (a, &w) in a.iter_mut().zip(w) {
                    *a += xv * w;
                }
            }
        }
        for (acc, a) in acc.iter_mut().zip(&a) {
            acc[s..s + STRIP].copy_from_slice(a);
        }
    }
}

/// [`portable_tile`] over a 16-bit panel, widening each weight as it is read.
fn portable_tile_half<const R: usize, const BF: bool>(x: &[f32], panel: &[u16], k: usize, acc: &mut [[f32; NR]; MR]) {
    for s in (0..NR).step_by(STRIP) {
        let mut a = [[0f32; STRIP]; R];
        for kk in 0..k {
            let h: &[u16; STRIP] = panel[kk * NR + s..kk * NR + s + STRIP].try_into().expect("strip");
            let w: [f32; STRIP] = std::array::from_fn(|i| super::simd_half::portable::widen::<BF>(h[i]));
            for (r, a) in a.iter_mut().enumerate() {
                let xv = x[r * k + kk];
                for (a, &w) in a.iter_mut().zip(&w) {
                    *a += xv * w;
                }
            }
        }
        for (acc, a) in acc.iter_mut().zip(&a) {
            acc[s..s + STRIP].copy_from_slice(a);
        }
    }
}

// Register arrays are indexed by row and vector in fully unrolled loops: iterators over them
// would read no better.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// How many panel rows ahead [`tile`] prefetches at one or two activation rows, where it
    /// streams the panel from memory and does little else: on the Intel Xeon VM (SmolLM2's
    /// shapes as f32 panels, `QS_MODES=f32 examples/quant_shapes.rs Q4_1 2 40 1`, four
    /// interleaved rounds) a step took 23.9-25.8 ms against 25.6-27.9 without it. 16 rows ahead
    /// gained nothing; 128 lost (29.6-30.9 against 26.3-27.0 ms at 64, three rounds), and a
    /// non-temporal hint at 64 doubled the step.
    const PF_ROWS: usize = 64;

    /// # Safety
    /// AVX-512F available; `x` valid for `R * k` reads, `panel` for `k * NR`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile<const R: usize>(
        x: *const f32,
        panel: *const f32,
        k: usize,
        pf: (*const f32, usize, usize),
        acc: &mut [[f32; NR]; MR],
    ) {
        let mut a = [[_mm512_setzero_ps(); 4]; R];
        // The next panel's lines are prefetched a chunk of steps' worth at a time: computing
        // each step's share in the loop cost as many integer instructions as the step has FMAs
        // at three rows, and the front end, not the FMA ports, set the pace.
        const CHUNK: usize = 8;
        let mut fetched = 0;
        // SAFETY (all loads): `kk < k`, `r < R`, `c < 4`: inside the ranges the caller vouches for.
        unsafe {
            for k0 in (0..k).step_by(CHUNK) {
                let k1 = (k0 + CHUNK).min(k);
                super::prefetch_upto(pf, &mut fetched, k1);
                for kk in k0..k1 {
                    let p = panel.add(kk * NR);
                    if R <= 2 {
                        // A hint: never faults, even past the panel's end.
                        for l in 0..4 {
                            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PF_ROWS * NR + 16 * l) as *const i8);
                        }
                    }
                    let w = [
                        _mm512_loadu_ps(p),
                        _mm512_loadu_ps(p.add(16)),
                        _mm512_loadu_ps(p.add(32)),
                        _mm512_loadu_ps(p.add(48)),
                    ];
                    for r in 0..R {
                        let xv = _mm512_set1_ps(*x.add(r * k + kk));
                        for c in 0..4 {
                            a[r][c] = _mm512_fmadd_ps(xv, w[c], a[r][c]);
                        }
                    }
                }
            }
            for r in 0..R {
                for c in 0..4 {
                    _mm512_storeu_ps(acc[r].as_mut_ptr().add(16 * c), a[r][c]);
                }
            }
        }
    }

    /// Sixteen 16-bit elements at `p`, widened to f32.
    ///
    /// # Safety
    /// AVX-512F available; `p` valid for 16 reads.
    #[inline(always)]
    unsafe fn widen16<const BF: bool>(p: *const u16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            match BF {
                true => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h))),
                false => _mm512_cvtph_ps(h),
            }
        }
    }

    /// [`tile`] over a 16-bit panel (`BF`: bf16, else f16).
    ///
    /// # Safety
    /// AVX-512F available; `x` valid for `R * k` reads, `panel` for `k * NR`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_half<const R: usize, const BF: bool>(
        x: *const f32,
        panel: *const u16,
        k: usize,
        acc: &mut [[f32; NR]; MR],
    ) {
        let mut a = [[_mm512_setzero_ps(); 4]; R];
        // SAFETY (all loads): `kk < k`, `r < R`, `c < 4`: inside the ranges the caller vouches for.
        unsafe {
            for kk in 0..k {
                let p = panel.add(kk * NR);
                let w =
                    [widen16::<BF>(p), widen16::<BF>(p.add(16)), widen16::<BF>(p.add(32)), widen16::<BF>(p.add(48))];
                for r in 0..R {
                    let xv = _mm512_set1_ps(*x.add(r * k + kk));
                    for c in 0..4 {
                        a[r][c] = _mm512_fmadd_ps(xv, w[c], a[r][c]);
                    }
                }
            }
            for r in 0..R {
                for c in 0..4 {
                    _mm512_storeu_ps(acc[r].as_mut_ptr().add(16 * c), a[r][c]);
                }
            }
        }
    }
}

// Register arrays are indexed by row and vector in fully unrolled loops: iterators over them
// would read no better.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// Panel element kinds of [`strips`].
    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;

    /// Panel rows per `kk` block of [`strips`]: 64 rows of 256 bytes (f32; 16 KB) stay in L1
    /// while the strips of a tile pass over them.
    const KB: usize = 64;

    /// The `R × NR` tile in strips of `8 * W` columns, `W` vectors wide, so that `R × W`
    /// accumulators + `W` weight vectors + one broadcast fit AVX2's 16 registers: one row takes
    /// the whole panel row (`W = 8`) and two rows half of it (`W = 4`), so a decode step streams
    /// each panel once, front to back, with eight (four per row) independent FMA chains; more
    /// rows take strips of 16 columns (`W = 2`). Every output column sums its products in `kk`
    /// order whatever the strip width, so the result does not depend on `R`.
    ///
    /// # Safety
    /// AVX2 and FMA available; `x` valid for `R * k` reads, `panel` for `k * NR`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const R: usize>(
        x: *const f32,
        panel: *const f32,
        k: usize,
        pf: (*const f32, usize, usize),
        acc: &mut [[f32; NR]; MR],
    ) {
        let panel = panel as *const u8;
        // SAFETY: the caller's contract.
        unsafe {
            match R {
                1 => strips::<R, 8, F32>(x, panel, k, pf, acc),
                2 => strips::<R, 4, F32>(x, panel, k, pf, acc),
                _ => strips::<R, 2, F32>(x, panel, k, pf, acc),
            }
        }
    }

    /// [`tile`] over a 16-bit panel (`BF`: bf16, else f16), each weight widened to f32 in
    /// registers as it is loaded.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; `x` valid for `R * k` reads, `panel` for `k * NR`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_half<const R: usize, const BF: bool>(
        x: *const f32,
        panel: *const u16,
        k: usize,
        acc: &mut [[f32; NR]; MR],
    ) {
        let (panel, none) = (panel as *const u8, (std::ptr::null(), 0, 1));
        // SAFETY: the caller's contract.
        unsafe {
            match (R, BF) {
                (1, false) => strips::<R, 8, F16>(x, panel, k, none, acc),
                (1, true) => strips::<R, 8, BF16>(x, panel, k, none, acc),
                (2, false) => strips::<R, 4, F16>(x, panel, k, none, acc),
                (2, true) => strips::<R, 4, BF16>(x, panel, k, none, acc),
                (_, false) => strips::<R, 2, F16>(x, panel, k, none, acc),
                (_, true) => strips::<R, 2, BF16>(x, panel, k, none, acc),
            }
        }
    }

    /// Eight panel elements from element `i` on, as f32.
    ///
    /// # Safety
    /// F16C available for 16-bit kinds; `panel` valid for elements `i..i + 8`.
    #[inline(always)]
    unsafe fn load8<const KIND: u8>(panel: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            match KIND {
                F32 => _mm256_loadu_ps((panel as *const f32).add(i)),
                _ => {
                    let h = _mm_loadu_si128((panel as *const u16).add(i) as *const __m128i);
                    match KIND {
                        BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h))),
                        _ => _mm256_cvtph_ps(h),
                    }
                }
            }
        }
    }

    /// [`tile`] with strips of `W` vectors over a panel of `KIND` elements. With more than one
    /// strip, `kk` goes in blocks of [`KB`] panel rows and every strip passes over a block
    /// before the next is read, while its steps prefetch the next block into L1, in address
    /// order. Without that, each strip read one cache line of each 256-byte panel
    /// row, at a stride the hardware prefetcher followed badly: decode at 4-8 rows ran at a
    /// third of the FMA rate (`examples/decode_shapes.rs`). The accumulators wait in `acc`
    /// between blocks (a store and a load: each column still sums its products in `kk` order).
    ///
    /// # Safety
    /// As [`tile`]; `8 * W` divides `NR`; F16C available for 16-bit kinds.
    // Register arrays are indexed in fully unrolled loops.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn strips<const R: usize, const W: usize, const KIND: u8>(
        x: *const f32,
        panel: *const u8,
        k: usize,
        pf: (*const f32, usize, usize),
        acc: &mut [[f32; NR]; MR],
    ) {
        let es = if KIND == F32 { 4 } else { 2 };
        let block = if 8 * W == NR { k.max(1) } else { KB };
        // A block holds `block * es` cache lines (rows of NR = 64 elements) and takes
        // `8 * block / W` steps (strips × rows): `es * W / 8` lines a step.
        const { assert!(NR == 64) };
        // SAFETY (all loads): `kk < k`, `r < R`, `s + 8 * v < NR`: inside the caller's ranges.
        // Prefetches never fault, and `wrapping_add` keeps their addresses defined.
        unsafe {
            let mut kb = 0;
            while kb < k || (kb == 0 && k == 0) {
                let kend = (kb + block).min(k);
                for s in (0..NR).step_by(8 * W) {
                    let mut a = [[_mm256_setzero_ps(); W]; R];
                    if kb > 0 {
                        for r in 0..R {
                            for v in 0..W {
                                a[r][v] = _mm256_loadu_ps(acc[r].as_ptr().add(s + 8 * v));
                            }
                        }
                    }
                    for kk in kb..kend {
                        if s == 0 {
                            super::prefetch(pf, kk);
                        }
                        let i = kk * NR + s;
                        if 8 * W < NR && kend < k {
                            // This step's share of the next block's lines, in address order.
                            let step = (s / (8 * W)) * block + (kk - kb);
                            let next = panel.wrapping_add(kend * NR * es);
                            // Lines per two steps: 2 (16-bit, W = 2) to 8 (f32, W = 4).
                            let pair = es * W / 4;
                            if pair >= 2 {
                                for l in 0..pair / 2 {
                                    let at = next.wrapping_add(64 * (step * (pair / 2) + l));
                                    _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
                                }
                            } else if step.is_multiple_of(2) {
                                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * (step / 2)) as *const i8);
                            }
                        }
                        let mut w = [_mm256_setzero_ps(); W];
                        for v in 0..W {
                            w[v] = load8::<KIND>(panel, i + 8 * v);
                        }
                        for r in 0..R {
                            let xv = _mm256_set1_ps(*x.add(r * k + kk));
                            for v in 0..W {
                                a[r][v] = _mm256_fmadd_ps(xv, w[v], a[r][v]);
                            }
                        }
                    }
                    for r in 0..R {
                        for v in 0..W {
                            _mm256_storeu_ps(acc[r].as_mut_ptr().add(s + 8 * v), a[r][v]);
                        }
                    }
                }
                kb = kend.max(kb + 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trips_and_aligns() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for (n, k) in [(1, 1), (63, 5), (64, 3), (65, 7), (200, 33), (3, 0)] {
            let w: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
            let p = PackedLinear::pack(&pool, Isa::detect(), &w, n, k).unwrap();
            assert_eq!(p.unpack(), w, "{n}x{k}");
            assert_eq!(p.data[p.off..].as_ptr() as usize % 64, 0);
            // Padding columns are zero.
            if n % NR != 0 && k > 0 {
                let last = p.stored_panel(n / NR);
                assert!(last.chunks_exact(NR).all(|row| row[n % NR..].iter().all(|&v| v == 0.0)));
            }
        }
    }
}
