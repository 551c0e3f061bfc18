//! The AVX2 and AVX-512 integer kernels: each 32-value unit of a weight row is decoded in
//! registers into the canonical form of [`super::portable`] (32 quant bytes, a lane vector of
//! scales, one or two offsets) and multiplied at once against `R` quantized activation rows, so
//! a weight byte is read from memory once and never stored again.
//!
//! Per unit and activation row: `maddubs` + `madd` by ones (AVX2, AVX-512BW) or `vpdpbusd`
//! (VNNI) give eight (sixteen for a pair of units) exact i32 sums of four products; they are
//! converted to f32 and added with the product of the weight's lane scales and the activation
//! block's scale. The offsets (Q4_1's `m`, Q4_0's `-8 d`, the K-quants' mins, Q6_K's `-32 d sc`)
//! meet the activation block (or half-block) sums in scalar FMAs. AVX-512 takes units in pairs
//! (64 bytes), an odd last one with the AVX2 step.
//!
//! One function per (path, format, `R`), generated from one body: the format is a const
//! parameter, so each unit decoder inlines into its loop.
//!
//! Invariant of [`run`]: every row of the run and every activation row holds `k` values (asserted),
//! so the pointer arithmetic below stays inside them.

use std::arch::x86_64::*;
use std::ops::Range;

use super::acts::QActs;
use super::QuantIsa;
use crate::quant::{scale_min_k4, QuantFormat, QuantMatrix};

/// Activation rows per call, most first: `m` is covered by calls of these sizes.
pub(super) const GROUPS: [usize; 5] = [8, 4, 3, 2, 1];

/// `res[r * width + (j - rows.start)] = x[r0 + r] · w[j]` for the stored weight rows `j` of
/// `rows` ([`QuantMatrix::stored_row`]) and `r < rr` (`rr` one of [`GROUPS`]; `acts` is `(acts, r0, rr)`), without bias.
///
/// # Panics
/// If `qisa` is portable, `rr` is not one of [`GROUPS`], the rows or activation rows are out of
/// range, or `res` is too short.
pub(super) fn run(
    qisa: QuantIsa,
    w: &QuantMatrix,
    rows: Range<usize>,
    (acts, r0, rr): (&QActs, usize, usize),
    (res, width): (&mut [f32], usize),
) {
    assert!(rows.end <= w.n() && acts.k == w.k() && GROUPS.contains(&rr));
    assert!(rr == 0 || (r0 + rr) * w.k() <= acts.q.len());
    assert!(rows.len() <= width && (rr == 0 || res.len() >= (rr - 1) * width + rows.len()));
    let job = Job {
        w: w.stored_row(rows.start).as_ptr(),
        row_bytes: w.row_bytes(),
        rows: rows.len(),
        units: w.k() / 32,
        x: acts.row(r0).q.as_ptr(),
        xd: acts.row(r0).d.as_ptr(),
        s16: acts.row(r0).s16.as_ptr(),
        s32: acts.row(r0).s32.as_ptr(),
        k: w.k(),
        out: res.as_mut_ptr(),
        width,
    };
    macro_rules! by_rows {
        ($f:ident, $fmt:expr) => {
            match rr {
                8 => $f::<{ $fmt }, 8>(job),
                4 => $f::<{ $fmt }, 4>(job),
                3 => $f::<{ $fmt }, 3>(job),
                2 => $f::<{ $fmt }, 2>(job),
                _ => $f::<{ $fmt }, 1>(job),
            }
        };
    }
    macro_rules! by_format {
        ($f:ident) => {
            match w.format() {
                QuantFormat::Q8_0 => by_rows!($f, Q8_0),
                QuantFormat::Q4_0 => by_rows!($f, Q4_0),
                QuantFormat::Q4_1 => by_rows!($f, Q4_1),
                QuantFormat::Q5_0 => by_rows!($f, Q5_0),
                QuantFormat::Q5_1 => by_rows!($f, Q5_1),
                QuantFormat::Q4_K => by_rows!($f, Q4_K),
                QuantFormat::Q5_K => by_rows!($f, Q5_K),
                QuantFormat::Q6_K => by_rows!($f, Q6_K),
            }
        };
    }
    // SAFETY: the ISA was detected on this CPU ([`QuantIsa::for_isa`]); the job's pointers
    // cover `rows` weight rows of `row_bytes`, `rr` activation rows of `k` values (and their
    // scales and sums), and `rr` result rows of `width >= rows` (asserted above).
    unsafe {
        match qisa {
            QuantIsa::Avx512Vnni => by_format!(vnni),
            QuantIsa::Avx512Bw => by_format!(bw),
            QuantIsa::Avx2 => by_format!(avx2),
            QuantIsa::Portable => panic!("the portable path has no x86 kernel"),
        }
    }
}

/// Row `j` of `w` dequantized into `out[..k]` with the unit decoders (the wide path's panels).
///
/// # Panics
/// If `qisa` is portable, `j >= n` or `out` is shorter than `k`.
pub(super) fn dequantize_row(qisa: QuantIsa, w: &QuantMatrix, j: usize, out: &mut [f32]) {
    assert!(qisa != QuantIsa::Portable && j < w.n() && out.len() >= w.k());
    let (row, units, out) = (w.row(j).as_ptr(), w.k() / 32, out.as_mut_ptr());
    // SAFETY: AVX2/FMA/F16C are present whenever the quantized path is not portable; `row`
    // holds the row's `units` units and `out` `32 * units` floats (asserted above).
    unsafe {
        match w.format() {
            QuantFormat::Q8_0 => dequant::<Q8_0>(row, units, out),
            QuantFormat::Q4_0 => dequant::<Q4_0>(row, units, out),
            QuantFormat::Q4_1 => dequant::<Q4_1>(row, units, out),
            QuantFormat::Q5_0 => dequant::<Q5_0>(row, units, out),
            QuantFormat::Q5_1 => dequant::<Q5_1>(row, units, out),
            QuantFormat::Q4_K => dequant::<Q4_K>(row, units, out),
            QuantFormat::Q5_K => dequant::<Q5_K>(row, units, out),
            QuantFormat::Q6_K => dequant::<Q6_K>(row, units, out),
        }
    }
}

/// How far ahead of the unit it multiplies a kernel prefetches the weights (bytes): the
/// weights' trip from memory is what a unit waits on. Measured with `examples/quant_shapes.rs`:
/// on the AMD EPYC VM (AVX2) it took batch 1 from 6.1 to 5.2 ms a step (Q4_1) and cost 5% at
/// four rows, where that machine is compute-bound; on the Intel Xeon VM (AVX-512 + VNNI) it
/// halved a step at every row count, both kernels (Q8_0 with VNNI: 9.8-11.7 to 5.3-5.5 ms at
/// one row, 23.8 to 14.0-14.5 at eight; the AVX2 kernel at eight rows, 51 to 18-19), so every
/// row count prefetches. (A prefetch never faults: past the weight's end it only hints at
/// nothing useful.)
const PF_AHEAD: usize = 4096;

/// Format ids of the const parameter.
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const Q4_K: u8 = 5;
const Q5_K: u8 = 6;
const Q6_K: u8 = 7;

/// Raw pointers of one call (see [`run`]).
#[derive(Clone, Copy)]
struct Job {
    /// The first weight row of the run; row `j` at `w + j * row_bytes`.
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    /// Units of 32 values per row (`k / 32`).
    units: usize,
    /// Activation row `r` at `x + r * k`, its scales (one per four values) at `xd + r * k / 4`,
    /// sums at `s16 + r * k / 16` and `s32 + r * k / 32`.
    x: *const i8,
    xd: *const f32,
    s16: *const f32,
    s32: *const f32,
    k: usize,
    /// Result row `r` at `out + r * width`.
    out: *mut f32,
    width: usize,
}

const fn block_values(f: u8) -> usize {
    if f >= Q4_K {
        256
    } else {
        32
    }
}

const fn block_bytes(f: u8) -> usize {
    match f {
        Q8_0 => 34,
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        Q4_K => 144,
        Q5_K => 176,
        _ => 210,
    }
}

/// Quants are signed bytes (Q8_0) rather than unsigned ones with an offset.
const fn signed(f: u8) -> bool {
    f == Q8_0
}

/// Offsets per half unit (Q6_K's sixteen-value scales) rather than per unit.
const fn per16(f: u8) -> bool {
    f == Q6_K
}

/// Scales and offsets of a K-quant block: per 32-value unit for Q4_K/Q5_K (first 8 entries),
/// per 16 values for Q6_K.
#[derive(Clone, Copy)]
struct KScales {
    d: [f32; 16],
    m: [f32; 16],
}

/// One decoded unit: 32 quant bytes, a scale per four of them, the offsets of its halves.
#[derive(Clone, Copy)]
struct Unit {
    q: __m256i,
    ds: __m256,
    m0: f32,
    m1: f32,
}

/// The f16 pair at `p` as two f32 (F16C).
///
/// # Safety
/// `p` valid for 4 reads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(p: *const u8) -> (f32, f32) {
    // SAFETY: the caller vouches for 4 readable bytes.
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe { std::ptr::read_unaligned(p as *const i32) }));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// The scales of the K-quant block at `b` (once per eight units: kept out of line, so that the
/// unit decoders stay small enough to inline).
///
/// # Safety
/// `b` valid for the block's bytes.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_scales<const F: u8>(b: *const u8) -> KScales {
    let mut s = KScales { d: [0.0; 16], m: [0.0; 16] };
    // SAFETY: offsets inside the block layouts of quant.rs.
    unsafe {
        if F == Q6_K {
            let (d, _) = halves(b.add(208));
            for g in 0..16 {
                s.d[g] = d * f32::from(*b.add(192 + g) as i8);
                s.m[g] = -32.0 * s.d[g];
            }
        } else {
            let (d, dmin) = halves(b);
            let packed = std::slice::from_raw_parts(b.add(4), 12);
            for u in 0..8 {
                let (sc, mn) = scale_min_k4(u, packed);
                s.d[u] = d * f32::from(sc);
                s.m[u] = -dmin * f32::from(mn);
            }
        }
    }
    s
}

/// 32 nibbles of the 16 bytes at `p`: low nibbles first, then high ones.
///
/// # Safety
/// `p` valid for 16 reads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller vouches for 16 readable bytes.
    let raw = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw), _mm256_set1_epi8(0x0F))
}

/// Byte `j` is 16 where bit `j` of the u32 at `p` is set, else 0.
///
/// # Safety
/// `p` valid for 4 reads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fifth_bits(p: *const u8) -> __m256i {
    // SAFETY: the caller vouches for 4 readable bytes.
    let qh = unsafe { std::ptr::read_unaligned(p as *const i32) };
    // Byte j takes byte j / 8 of qh (shuffles stay within 128-bit lanes, and every 4 bytes of
    // the broadcast hold all of qh), then tests its bit j % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh),
        _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16))
}

/// Bits `shift..shift + width` of every byte of `v` (width 1 or 2), moved to bit 4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bits_to_16(v: __m256i, shift: usize, mask: i8) -> __m256i {
    let down = _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift as i32));
    _mm256_slli_epi16::<4>(_mm256_and_si256(down, _mm256_set1_epi8(mask)))
}

/// Unit `i` of the block at `b` (`i < 8` for K-quants, 0 otherwise), with its block's scales.
///
/// # Safety
/// `b` valid for the block's bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unit<const F: u8>(b: *const u8, i: usize, ks: &KScales) -> Unit {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: offsets inside the block layouts of quant.rs.
    unsafe {
        match F {
            Q8_0 => {
                let (d, _) = halves(b);
                Unit { q: _mm256_loadu_si256(b.add(2) as *const __m256i), ds: _mm256_set1_ps(d), m0: 0.0, m1: 0.0 }
            }
            Q4_0 | Q4_1 | Q5_0 | Q5_1 => {
                let (d, m) = halves(b);
                let (q, m) = match F {
                    Q4_0 => (nibbles(b.add(2)), -8.0 * d),
                    Q4_1 => (nibbles(b.add(4)), m),
                    Q5_0 => (_mm256_or_si256(nibbles(b.add(6)), fifth_bits(b.add(2))), -16.0 * d),
                    _ => (_mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4))), m),
                };
                Unit { q, ds: _mm256_set1_ps(d), m0: m, m1: m }
            }
            Q4_K | Q5_K => {
                let qs = b.add(if F == Q5_K { 48 } else { 16 });
                let raw = _mm256_loadu_si256(qs.add(32 * (i / 2)) as *const __m256i);
                let raw = if i.is_multiple_of(2) { raw } else { _mm256_srli_epi16::<4>(raw) };
                let mut q = _mm256_and_si256(raw, m4);
                if F == Q5_K {
                    q = _mm256_or_si256(q, bits_to_16(_mm256_loadu_si256(b.add(16) as *const __m256i), i, 1));
                }
                Unit { q, ds: _mm256_set1_ps(ks.d[i]), m0: ks.m[i], m1: ks.m[i] }
            }
            _ => {
                let (h, g) = (i / 4, i % 4);
                let ql = _mm256_loadu_si256(b.add(64 * h + 32 * (g % 2)) as *const __m256i);
                let ql = if g < 2 { ql } else { _mm256_srli_epi16::<4>(ql) };
                let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
                let q = _mm256_or_si256(_mm256_and_si256(ql, m4), bits_to_16(qh, 2 * g, 3));
                let ds = _mm256_set_m128(_mm_set1_ps(ks.d[2 * i + 1]), _mm_set1_ps(ks.d[2 * i]));
                Unit { q, ds, m0: ks.m[2 * i], m1: ks.m[2 * i + 1] }
            }
        }
    }
}

/// Unit `u` of the row at `row`, decoding its block's scales into `ks` when it starts a
/// K-quant block.
///
/// # Safety
/// `u` below the row's units.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_unit<const F: u8>(row: *const u8, u: usize, ks: &mut KScales) -> Unit {
    let per_block = block_values(F) / 32;
    // SAFETY: unit `u` lies in block `u / per_block` of the row.
    unsafe {
        let b = row.add(u / per_block * block_bytes(F));
        if per_block > 1 && u.is_multiple_of(per_block) {
            *ks = k_scales::<F>(b);
        }
        unit::<F>(b, u % per_block, ks)
    }
}

/// Unit `u`'s offsets (Q4_1's `m`, the K-quants' mins, ...) against every activation row's
/// block (or half-block) sums, added to `off` in scalar FMAs beside the vector work. (Keeping a
/// row's offsets for one dot once the row is done cost a call and a reduction per weight row,
/// as much as a few units on SmolLM2's 18-unit rows.)
///
/// # Safety
/// `u` below the job's units; activation row `r < R` holds its sums.
#[inline(always)]
unsafe fn add_offsets<const F: u8, const R: usize>(job: &Job, u: usize, w: &Unit, off: &mut [f32; R]) {
    // SAFETY: the caller's contract.
    unsafe {
        for (r, off) in off.iter_mut().enumerate() {
            if per16(F) {
                let s = job.s16.add(r * job.k / 16 + 2 * u);
                *off = w.m1.mul_add(*s.add(1), w.m0.mul_add(*s, *off));
            } else if !signed(F) {
                *off = w.m0.mul_add(*job.s32.add(r * job.k / 32 + u), *off);
            }
        }
    }
}

/// Prefetches the weights [`PF_AHEAD`] bytes past unit `u` of `row`.
#[inline(always)]
fn prefetch<const F: u8>(row: *const u8, u: usize) {
    let pf = row.wrapping_add(PF_AHEAD + u * block_bytes(F) / (block_values(F) / 32));
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(pf as *const i8) };
}

/// One unit against one activation row on 256-bit vectors: `acc += cvt(Σ4 q·x) · ds · dx`.
///
/// # Safety
/// `x` valid for 32 reads, `dx` (the unit's eight activation scales) for 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn step256(signed: bool, w: &Unit, wa: __m256i, x: *const i8, dx: *const f32, acc: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    let (xv, dx) = unsafe { (_mm256_loadu_si256(x as *const __m256i), _mm256_loadu_ps(dx)) };
    let xs = if signed { _mm256_sign_epi8(xv, w.q) } else { xv };
    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), _mm256_set1_epi16(1));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(w.ds, dx), acc)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Unit `u` of `row` against every activation row of the job, into `acc`; returns the decoded
/// unit, whose offsets the caller takes ([`add_offsets`]).
///
/// # Safety
/// `u` below the job's units; `row` one of its rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unit_rows<const F: u8, const R: usize>(
    job: &Job,
    row: *const u8,
    u: usize,
    ks: &mut KScales,
    acc: &mut [__m256; R],
) -> Unit {
    // SAFETY: the caller's contract; activation row `r < R` holds unit `u`.
    unsafe {
        let w = row_unit::<F>(row, u, ks);
        let wa = if signed(F) { _mm256_sign_epi8(w.q, w.q) } else { w.q };
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = job.x.add(r * job.k + 32 * u);
            *acc = step256(signed(F), &w, wa, x, job.xd.add(r * job.k / 4 + 8 * u), *acc);
        }
        w
    }
}

/// [`unit_rows`] with the unit's offsets added to `off` and the weights prefetched.
///
/// # Safety
/// As [`unit_rows`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unit_rows_off<const F: u8, const R: usize>(
    job: &Job,
    row: *const u8,
    u: usize,
    ks: &mut KScales,
    acc: &mut [__m256; R],
    off: &mut [f32; R],
) {
    prefetch::<F>(row, u);
    // SAFETY: the caller's contract.
    unsafe {
        let w = unit_rows::<F, R>(job, row, u, ks, acc);
        add_offsets::<F, R>(job, u, &w, off);
    }
}

/// The AVX2 kernel. Up to four activation rows, even and odd units go to two sets of
/// accumulators, so that consecutive units do not wait on one FMA chain.
///
/// # Safety
/// AVX2, FMA and F16C available; the job as [`run`] builds it.
// Register arrays are indexed by row in fully unrolled loops.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const F: u8, const R: usize>(job: Job) {
    let mut ks = KScales { d: [0.0; 16], m: [0.0; 16] };
    // SAFETY: every unit `u < units` of every row `j < rows`, and every activation row `r < R`.
    unsafe {
        for j in 0..job.rows {
            let row = job.w.add(j * job.row_bytes);
            let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
            let mut off = [0f32; R];
            let mut u = 0;
            while u + 1 < job.units {
                unit_rows_off::<F, R>(&job, row, u, &mut ks, &mut acc0, &mut off);
                if R <= 4 {
                    unit_rows_off::<F, R>(&job, row, u + 1, &mut ks, &mut acc1, &mut off);
                } else {
                    unit_rows_off::<F, R>(&job, row, u + 1, &mut ks, &mut acc0, &mut off);
                }
                u += 2;
            }
            if u < job.units {
                unit_rows_off::<F, R>(&job, row, u, &mut ks, &mut acc0, &mut off);
            }
            for r in 0..R {
                *job.out.add(r * job.width + j) = hsum256(_mm256_add_ps(acc0[r], acc1[r])) + off[r];
            }
        }
    }
}

/// `out[32u + i] = ds · q + m` for every unit `u` of the row (see [`dequantize_row`]).
///
/// # Safety
/// AVX2, FMA and F16C available; `row` holds `units` units, `out` is valid for `32 · units`
/// writes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant<const F: u8>(row: *const u8, units: usize, out: *mut f32) {
    let mut ks = KScales { d: [0.0; 16], m: [0.0; 16] };
    // SAFETY: unit `u < units` of the row; 32 floats of `out` per unit.
    unsafe {
        for u in 0..units {
            let w = row_unit::<F>(row, u, &mut ks);
            let (lo, hi) = (_mm256_castsi256_si128(w.q), _mm256_extracti128_si256::<1>(w.q));
            let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
            // Values 0..16 have the scale of lane 0 and offset m0, values 16..32 lane 4 and m1.
            let (s0, s1) = (
                _mm256_permutevar8x32_ps(w.ds, _mm256_setzero_si256()),
                _mm256_permutevar8x32_ps(w.ds, _mm256_set1_epi32(4)),
            );
            for (i, part) in parts.into_iter().enumerate() {
                let q = if signed(F) { _mm256_cvtepi8_epi32(part) } else { _mm256_cvtepu8_epi32(part) };
                let (s, m) = if i < 2 { (s0, w.m0) } else { (s1, w.m1) };
                let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, _mm256_set1_ps(m));
                _mm256_storeu_ps(out.add(32 * u + 8 * i), v);
            }
        }
    }
}

/// Units `u` and `u + 1` of the row at `row` as one 64-byte vector of quants, and each unit's
/// scales and offsets (the units' own `q` are not used). Q5_0 and Q5_1 take their fifth bits
/// from the two 32-bit `qh` words as one 64-bit byte mask (`vmovdqu8` under a mask: a unit's byte
/// `j` has bit `j` of its `qh`), in place of [`fifth_bits`]' four vector operations a unit; the
/// other formats decode each unit with [`row_unit`].
///
/// # Safety
/// `u + 1` below the row's units.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn unit_pair<const F: u8>(row: *const u8, u: usize, ks: &mut KScales) -> (__m512i, Unit, Unit) {
    // SAFETY: units `u` and `u + 1` lie in the row (the caller's contract); for Q5_0/Q5_1 each
    // is one block.
    unsafe {
        if F == Q5_0 || F == Q5_1 {
            let (b0, b1) = (row.add(u * block_bytes(F)), row.add((u + 1) * block_bytes(F)));
            let (qh, qs) = if F == Q5_0 { (2, 6) } else { (4, 8) };
            let bits = u64::from(std::ptr::read_unaligned(b0.add(qh) as *const u32))
                | u64::from(std::ptr::read_unaligned(b1.add(qh) as *const u32)) << 32;
            let low = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(nibbles(b0.add(qs))), nibbles(b1.add(qs)));
            let q = _mm512_or_si512(low, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(16)));
            let ((d0, m0), (d1, m1)) = (halves(b0), halves(b1));
            let (m0, m1) = if F == Q5_0 { (-16.0 * d0, -16.0 * d1) } else { (m0, m1) };
            let zero = _mm256_setzero_si256();
            let w0 = Unit { q: zero, ds: _mm256_set1_ps(d0), m0, m1: m0 };
            let w1 = Unit { q: zero, ds: _mm256_set1_ps(d1), m0: m1, m1 };
            (q, w0, w1)
        } else {
            let (w0, w1) = (row_unit::<F>(row, u, ks), row_unit::<F>(row, u + 1, ks));
            (_mm512_inserti64x4::<1>(_mm512_castsi256_si512(w0.q), w1.q), w0, w1)
        }
    }
}

/// The AVX-512 kernels: units in pairs, one 512-bit multiply each; `vpdpbusd` with VNNI, else
/// `maddubs` + `madd`. The offsets go in scalar FMAs as units are multiplied ([`add_offsets`])
/// and the weights are prefetched, as in the AVX2 kernel. (They used to keep a row's offsets
/// for one dot per activation row once the row was done, without prefetching; on the Intel Xeon
/// VM, `QS_ISA=avx512-vnni examples/quant_shapes.rs`, two threads, interleaved rounds, ms a
/// step at one row: Q8_0 9.8-11.7 then, 5.3-5.5 now; Q4_1 4.0-4.9, 4.0-4.3; Q5_0 5.7-6.9,
/// 5.0-5.2. With the prefetch, the scalar offsets against the kept ones at four rows: Q4_1
/// 8.0-8.2 against 9.2, Q5_0 9.4-9.6 against 11.6-11.7; at three and eight rows within the
/// noise.)
macro_rules! avx512_kernel {
    ($name:ident, $features:literal, $mode:ident) => {
        /// # Safety
        /// The target features available; the job as [`run`] builds it.
        // Register arrays are indexed by row in fully unrolled loops.
        #[allow(clippy::needless_range_loop)]
        #[target_feature(enable = $features)]
        unsafe fn $name<const F: u8, const R: usize>(job: Job) {
            let mut ks = KScales { d: [0.0; 16], m: [0.0; 16] };
            let zero = _mm512_setzero_si512();
            // SAFETY: every unit `u < units` of every row `j < rows`, and every activation row
            // `r < R`; pairs cover units `2p, 2p + 1 < units`, the odd last one goes alone.
            unsafe {
                for j in 0..job.rows {
                    let row = job.w.add(j * job.row_bytes);
                    let mut acc = [_mm512_setzero_ps(); R];
                    let mut off = [0f32; R];
                    for p in 0..job.units / 2 {
                        let (u0, u1) = (2 * p, 2 * p + 1);
                        prefetch::<F>(row, u0);
                        prefetch::<F>(row, u1);
                        let (q, w0, w1) = unit_pair::<F>(row, u0, &mut ks);
                        add_offsets::<F, R>(&job, u0, &w0, &mut off);
                        add_offsets::<F, R>(&job, u1, &w1, &mut off);
                        let ds = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                            _mm512_castpd256_pd512(_mm256_castps_pd(w0.ds)),
                            _mm256_castps_pd(w1.ds),
                        ));
                        let (wa, neg) = if signed(F) { (_mm512_abs_epi8(q), _mm512_movepi8_mask(q)) } else { (q, 0) };
                        for r in 0..R {
                            let xv = _mm512_loadu_si512(job.x.add(r * job.k + 32 * u0) as *const __m512i);
                            let dx = _mm512_loadu_ps(job.xd.add(r * job.k / 4 + 8 * u0));
                            // Signed weights: |w| against x negated where w < 0.
                            let xs = if signed(F) { _mm512_mask_sub_epi8(xv, neg, zero, xv) } else { xv };
                            let p32 = avx512_kernel!(@products $mode, wa, xs);
                            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), _mm512_mul_ps(ds, dx), acc[r]);
                        }
                    }
                    let mut tail = [_mm256_setzero_ps(); R];
                    if job.units % 2 == 1 {
                        unit_rows_off::<F, R>(&job, row, job.units - 1, &mut ks, &mut tail, &mut off);
                    }
                    for r in 0..R {
                        *job.out.add(r * job.width + j) = _mm512_reduce_add_ps(acc[r]) + hsum256(tail[r]) + off[r];
                    }
                }
            }
        }
    };
    (@products vnni, $a:expr, $b:expr) => {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), $a, $b)
    };
    (@products bw, $a:expr, $b:expr) => {
        _mm512_madd_epi16(_mm512_maddubs_epi16($a, $b), _mm512_set1_epi16(1))
    };
}

avx512_kernel!(vnni, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c", vnni);
avx512_kernel!(bw, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", bw);
