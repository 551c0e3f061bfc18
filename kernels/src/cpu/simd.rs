//! Vector inner loops (dot products, axpy, sum) with runtime ISA dispatch.
//!
//! The ISA is detected once when a backend is built ([`Isa::detect`]) and passed to every call,
//! so the hot loops pay one `match` rather than a feature check. Each kernel has an AVX-512F
//! version, an AVX2+FMA version and a portable fallback written with fixed-width lane arrays that
//! the compiler vectorizes for the baseline target.
//!
//! Invariant of every function here: the slices it pairs up have at least the length of the one
//! that sets the loop count (`w` / `x`); the safe wrappers slice to that length, so a violation
//! is a bounds panic, never an out-of-bounds read.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `accumulate_rows`' split of its rows into groups of at most six, each handed to the ISA's
/// `$group::<R>` (R rows' accumulators in registers). Expands to unsafe calls: the caller
/// vouches for the sizes, as `accumulate_rows` asserts them.
#[cfg(target_arch = "x86_64")]
macro_rules! in_row_groups {
    ($group:ident, $p:expr, $p_stride:expr, $rows:expr, $vals:expr, $out:expr, $d:expr) => {
        for r0 in (0..$rows).step_by(6) {
            let (pp, op) = ($p.as_ptr().add(r0 * $p_stride), $out.as_mut_ptr().add(r0 * $d));
            match ($rows - r0).min(6) {
                1 => $group::<1>(pp, $p_stride, $vals, op, $d),
                2 => $group::<2>(pp, $p_stride, $vals, op, $d),
                3 => $group::<3>(pp, $p_stride, $vals, op, $d),
                4 => $group::<4>(pp, $p_stride, $vals, op, $d),
                5 => $group::<5>(pp, $p_stride, $vals, op, $d),
                _ => $group::<6>(pp, $p_stride, $vals, op, $d),
            }
        }
    };
}

/// The instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2Fma,
    Portable,
}

impl Isa {
    /// The best ISA this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            // F16C (half-precision conversions, for 16-bit KV caches) came before AVX2 on every
            // x86 line; it is checked anyway.
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Isa::Avx2Fma;
            }
        }
        Isa::Portable
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2+fma",
            Isa::Portable => "portable",
        }
    }
}

/// `Σ a[i] * b[i]` over `b.len()` elements.
#[inline]
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    let a = &a[..b.len()];
    match isa {
        // SAFETY: `detect` returned this ISA only if the CPU supports it; lengths are equal.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot(a, b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::dot(a, b) },
        _ => portable::dot(a, b),
    }
}

/// `out[j][r] = Σ xs[r][i] * ws[j][i]`: the `M × J` dot products of `M` activation rows with `J`
/// weight rows, in one pass that loads each element of every row once. All rows are sliced to
/// `ws[0].len()`.
#[inline]
pub fn dots<const M: usize, const J: usize>(isa: Isa, xs: &[&[f32]; M], ws: &[&[f32]; J]) -> [[f32; M]; J] {
    let n = if J == 0 { 0 } else { ws[0].len() };
    let xs: [&[f32]; M] = std::array::from_fn(|r| &xs[r][..n]);
    let ws: [&[f32]; J] = std::array::from_fn(|j| &ws[j][..n]);
    match isa {
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dots(&xs, &ws) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::dots(&xs, &ws) },
        _ => std::array::from_fn(|j| std::array::from_fn(|r| portable::dot(xs[r], ws[j]))),
    }
}

/// The skinny kernel's inner loop for full groups of eight activation rows, on AVX-512:
/// `out[j * m + r] += x[r, k0..k1] · w[j, k0..k1]` for every weight row `j < rows` and activation
/// row `r < 8 * groups`, where `x` and `w` are row-major with row stride `k`. Weight rows go in
/// pairs; each pair is loaded from memory once and dotted with every group while it sits in L1,
/// so the caller picks `k1 - k0` small enough for the groups' `x` block to stay in L1 too.
/// Returns `false`, touching nothing, when this ISA has no such kernel (the caller then uses
/// [`dots`]).
///
/// # Panics
/// If `k0 <= k1 <= k`, `8 * groups <= m`, `x.len() >= (8 * groups - 1) * k + k1`,
/// `w.len() >= (rows - 1) * k + k1` or `out.len() >= (rows - 1) * m + 8 * groups` fails.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn dots8_groups(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    (k, k0, k1): (usize, usize, usize),
    groups: usize,
    rows: usize,
    out: &mut [f32],
    m: usize,
) -> bool {
    if rows == 0 || groups == 0 || k0 == k1 {
        return true;
    }
    assert!(k0 <= k1 && k1 <= k && 8 * groups <= m);
    assert!(x.len() >= (8 * groups - 1) * k + k1 && w.len() >= (rows - 1) * k + k1);
    assert!(out.len() >= (rows - 1) * m + 8 * groups);
    match isa {
        // SAFETY: `detect` returned this ISA only if the CPU supports it; sizes asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            unsafe { avx512::dots8_groups(x, w, (k, k0, k1), groups, rows, out, m) };
            true
        }
        _ => false,
    }
}

/// `y[i] += a * x[i]` over `x.len()` elements.
#[inline]
pub fn axpy(isa: Isa, y: &mut [f32], a: f32, x: &[f32]) {
    let y = &mut y[..x.len()];
    match isa {
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::axpy(y, a, x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::axpy(y, a, x) },
        _ => y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x),
    }
}

/// `Σ x[i]` (used to measure read bandwidth).
#[inline]
pub fn sum(isa: Isa, x: &[f32]) -> f32 {
    match isa {
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::sum(x) },
        _ => portable::sum(x),
    }
}

/// `out[j] = q · keys[j]` for every key (attention scores of one query); each key has at least
/// `q.len()` elements.
pub fn dot_keys(isa: Isa, q: &[f32], keys: &[&[f32]], out: &mut [f32]) {
    let out = &mut out[..keys.len()];
    let d = q.len();
    assert!(keys.iter().all(|k| k.len() >= d));
    match isa {
        // SAFETY: as in `dot`; every key holds `d` elements (asserted).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot_keys(q, keys, out) },
        // SAFETY: as in `dot`; every key holds `d` elements (asserted).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::dot_keys(q, keys, out) },
        _ => out.iter_mut().zip(keys).for_each(|(o, k)| *o = dot(isa, k, q)),
    }
}

/// `max(x)` (`-inf` when empty); NaNs are not propagated (it is a softmax's shift).
pub fn max(isa: Isa, x: &[f32]) -> f32 {
    match isa {
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::max(x) },
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::max(x) },
        _ => x.iter().copied().fold(f32::NEG_INFINITY, f32::max),
    }
}

/// `out[i] = silu(gate[i]) · up[i]` = `gate[i] / (1 + exp(-gate[i])) · up[i]` over `out`'s
/// length (`gate` and `up` at least as long). On x86 sixteen at a time with AVX-512 (the tail
/// masked) or eight with AVX2, with the Cephes exponential of [`exp_shifted`] (within a few ulp
/// of the scalar `expf`); the portable path is [`crate::reference::silu`] element by element.
/// Scalar `expf` had been 2% of an f32 prefill's time in perf, the MLP's 1536 activations per
/// token a call each; the AVX2 path, 2.2% of a lone SmolLM2 request's on an AVX-512 machine.
pub fn silu_mul(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len();
    assert!(gate.len() >= n && up.len() >= n, "silu_mul: inputs shorter than the output");
    match isa {
        // SAFETY: `Isa::Avx512` is only selected where AVX-512F was detected; lengths asserted.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::silu_mul(&gate[..n], &up[..n], out) },
        // SAFETY: AVX2 and FMA detected; lengths asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") => unsafe {
            avx2::silu_mul(&gate[..n], &up[..n], out)
        },
        _ => out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (&g, &u))| *o = crate::reference::silu(g) * u),
    }
}

/// `row[i] = exp(row[i] - max)`; returns `Σ row[i]` (a softmax numerator and its denominator).
/// The AVX-512 and AVX2 exponentials are a degree-6 polynomial (Cephes `expf`, within 2 ulp).
pub fn exp_shifted(isa: Isa, row: &mut [f32], max: f32) -> f32 {
    match isa {
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::exp_shifted(row, max) },
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::exp_shifted(row, max) },
        _ => {
            let mut sum = 0f64;
            for v in row.iter_mut() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
            sum as f32
        }
    }
}

/// `out[r * d..(r + 1) * d] += Σ_j p[r * p_stride + j] · vals[j][..d]` for every row
/// `r < rows` (attention outputs of `rows` queries over the same values); every value has at
/// least `d` elements.
pub fn accumulate_rows(isa: Isa, p: &[f32], p_stride: usize, rows: usize, vals: &[&[f32]], out: &mut [f32], d: usize) {
    let nv = vals.len();
    if rows == 0 || nv == 0 || d == 0 {
        return;
    }
    assert!(vals.iter().all(|v| v.len() >= d) && out.len() >= rows * d);
    assert!(p_stride >= nv && p.len() >= (rows - 1) * p_stride + nv);
    match isa {
        // SAFETY: as in `dot`; sizes asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::accumulate_rows(p, p_stride, rows, vals, out, d) },
        // SAFETY: as in `dot`; sizes asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::accumulate_rows(p, p_stride, rows, vals, out, d) },
        _ => {
            for r in 0..rows {
                for (j, v) in vals.iter().enumerate() {
                    axpy(isa, &mut out[r * d..(r + 1) * d], p[r * p_stride + j], &v[..d]);
                }
            }
        }
    }
}

mod portable {
    const LANES: usize = 16;

    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
        for (x, y) in ac.zip(bc) {
            for l in 0..LANES {
                acc[l] += x[l] * y[l];
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    pub fn sum(x: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let chunks = x.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().sum();
        for c in chunks {
            for l in 0..LANES {
                acc[l] += c[l];
            }
        }
        acc.iter().sum::<f32>() + tail
    }
}

/// The transposing sum of 16 vectors (also used by the 16-bit KV kernels).
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::hsum16 as hsum16_avx512;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// Mask selecting the first `n < 16` lanes.
    #[inline(always)]
    fn tail_mask(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// # Safety
    /// AVX-512F available; `a.len() == b.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = b.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): offsets stay below `n`, or are masked to it.
        unsafe {
            while i + 64 <= n {
                for (u, acc) in acc.iter_mut().enumerate() {
                    let o = i + 16 * u;
                    *acc = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(o)), _mm512_loadu_ps(pb.add(o)), *acc);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
                i += 16;
            }
            if i < n {
                let m = tail_mask(n - i);
                acc[1] =
                    _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, pa.add(i)), _mm512_maskz_loadu_ps(m, pb.add(i)), acc[1]);
            }
        }
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(s)
    }

    /// # Safety
    /// AVX-512F available; every row of `xs` and `ws` has the same length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dots<const M: usize, const J: usize>(xs: &[&[f32]; M], ws: &[&[f32]; J]) -> [[f32; M]; J] {
        let n = if J == 0 { 0 } else { ws[0].len() };
        let mut acc = [[_mm512_setzero_ps(); M]; J];
        let mut i = 0;
        // SAFETY (all loads): offsets stay below `n`, or are masked to it.
        unsafe {
            while i + 16 <= n {
                let mut wv = [_mm512_setzero_ps(); J];
                for j in 0..J {
                    wv[j] = _mm512_loadu_ps(ws[j].as_ptr().add(i));
                }
                for r in 0..M {
                    let xv = _mm512_loadu_ps(xs[r].as_ptr().add(i));
                    for j in 0..J {
                        acc[j][r] = _mm512_fmadd_ps(xv, wv[j], acc[j][r]);
                    }
                }
                i += 16;
            }
            if i < n {
                let m = tail_mask(n - i);
                let mut wv = [_mm512_setzero_ps(); J];
                for j in 0..J {
                    wv[j] = _mm512_maskz_loadu_ps(m, ws[j].as_ptr().add(i));
                }
                for r in 0..M {
                    let xv = _mm512_maskz_loadu_ps(m, xs[r].as_ptr().add(i));
                    for j in 0..J {
                        acc[j][r] = _mm512_fmadd_ps(xv, wv[j], acc[j][r]);
                    }
                }
            }
        }
        // Plain loops rather than `array::from_fn` closures: a closure capturing `acc` makes it
        // escape to memory, and the hot loop then stores every accumulator on each step.
        let mut out = [[0f32; M]; J];
        for j in 0..J {
            for r in 0..M {
                out[j][r] = _mm512_reduce_add_ps(acc[j][r]);
            }
        }
        out
    }

    /// Sums of 16 vectors: lane `i` of the result is the horizontal sum of `a[i]`. A transposing
    /// add tree (about 45 shuffles and adds) instead of 16 separate reductions (about 130).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn hsum16(a: &[__m512; 16]) -> __m512 {
        // Level 1: pairs interleaved; each 128-bit lane holds [x0+x2, y0+y2, x1+x3, y1+y3] of (x, y).
        let pair = |x: __m512, y: __m512| _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
        let p: [__m512; 8] = [
            pair(a[0], a[1]),
            pair(a[2], a[3]),
            pair(a[4], a[5]),
            pair(a[6], a[7]),
            pair(a[8], a[9]),
            pair(a[10], a[11]),
            pair(a[12], a[13]),
            pair(a[14], a[15]),
        ];
        // Level 2: each 128-bit lane holds the partial sums of four vectors, in order.
        let quad = |x: __m512, y: __m512| {
            let (xd, yd) = (_mm512_castps_pd(x), _mm512_castps_pd(y));
            let lo = _mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd));
            let hi = _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd));
            _mm512_add_ps(lo, hi)
        };
        let q = [quad(p[0], p[1]), quad(p[2], p[3]), quad(p[4], p[5]), quad(p[6], p[7])];
        // Levels 3 and 4: add the 128-bit lanes across vectors.
        let fold = |x: __m512, y: __m512| {
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y))
        };
        fold(fold(q[0], q[1]), fold(q[2], q[3]))
    }

    /// 16 dot products: eight activation rows (`xp`) against two weight rows (`w0`, `w1`) over
    /// `n` elements, returned as one vector (lanes 0..8: row `w0`, lanes 8..16: row `w1`).
    ///
    /// # Safety
    /// AVX-512F available; every pointer valid for `n` reads.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn dots_8x2(xp: &[*const f32; 8], w0: *const f32, w1: *const f32, n: usize) -> __m512 {
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut i = 0;
        // SAFETY (all loads): offsets stay below `n`, or are masked to it.
        unsafe {
            while i + 16 <= n {
                let a = _mm512_loadu_ps(w0.add(i));
                let b = _mm512_loadu_ps(w1.add(i));
                for r in 0..8 {
                    let xv = _mm512_loadu_ps(xp[r].add(i));
                    acc[r] = _mm512_fmadd_ps(xv, a, acc[r]);
                    acc[8 + r] = _mm512_fmadd_ps(xv, b, acc[8 + r]);
                }
                i += 16;
            }
            if i < n {
                let t = tail_mask(n - i);
                let a = _mm512_maskz_loadu_ps(t, w0.add(i));
                let b = _mm512_maskz_loadu_ps(t, w1.add(i));
                for r in 0..8 {
                    let xv = _mm512_maskz_loadu_ps(t, xp[r].add(i));
                    acc[r] = _mm512_fmadd_ps(xv, a, acc[r]);
                    acc[8 + r] = _mm512_fmadd_ps(xv, b, acc[8 + r]);
                }
            }
        }
        hsum16(&acc)
    }

    /// # Safety
    /// AVX-512F available; sizes as asserted by the safe wrapper `simd::dots8_groups`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dots8_groups(
        x: &[f32],
        w: &[f32],
        (k, k0, k1): (usize, usize, usize),
        groups: usize,
        rows: usize,
        out: &mut [f32],
        m: usize,
    ) {
        let n = k1 - k0;
        let (xb, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
        // SAFETY (all accesses): activation row `g * 8 + r < 8 * groups` and weight rows
        // `j, j + 1 < rows` span `.. * k + k0 .. * k + k1` inside `x` and `w`; outputs lie in
        // `j * m + 8 * g .. + 8` for `j < rows`, inside `out` (all asserted by the wrapper).
        unsafe {
            let xp = |g: usize| -> [*const f32; 8] { std::array::from_fn(|r| xb.add((g * 8 + r) * k + k0)) };
            let mut j = 0;
            while j + 2 <= rows {
                let (w0, w1) = (wp.add(j * k + k0), wp.add((j + 1) * k + k0));
                for g in 0..groups {
                    let s = dots_8x2(&xp(g), w0, w1, n);
                    let (o0, o1) = (op.add(j * m + 8 * g), op.add((j + 1) * m + 8 * g));
                    _mm256_storeu_ps(o0, _mm256_add_ps(_mm256_loadu_ps(o0), _mm512_castps512_ps256(s)));
                    let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(s, s);
                    _mm256_storeu_ps(o1, _mm256_add_ps(_mm256_loadu_ps(o1), _mm512_castps512_ps256(hi)));
                }
                j += 2;
            }
            if j < rows {
                let w0 = std::slice::from_raw_parts(wp.add(j * k + k0), n);
                for g in 0..groups {
                    let p = xp(g);
                    let xs: [&[f32]; 8] = std::array::from_fn(|r| std::slice::from_raw_parts(p[r], n));
                    let [d] = dots::<8, 1>(&xs, &[w0]);
                    let o = op.add(j * m + 8 * g);
                    for (r, d) in d.iter().enumerate() {
                        *o.add(r) += d;
                    }
                }
            }
        }
    }

    /// # Safety
    /// AVX-512F available; every key holds `q.len()` elements; `out.len() == keys.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_keys(q: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        let d = q.len();
        // SAFETY (all accesses): offsets below `d` (or masked to it) in `q` and in each key;
        // output lanes masked to the chunk's key count.
        unsafe {
            for (c, chunk) in keys.chunks(16).enumerate() {
                // A short last chunk repeats its last key: a fixed count of 16 keeps the loop
                // unrolled and the accumulators in registers; the extra lanes are not stored.
                let kp: [*const f32; 16] = std::array::from_fn(|j| chunk[j.min(chunk.len() - 1)].as_ptr());
                let mut acc = [_mm512_setzero_ps(); 16];
                let mut i = 0;
                while i < d {
                    let m = if d - i >= 16 { 0xffff } else { tail_mask(d - i) };
                    let qv = _mm512_maskz_loadu_ps(m, q.as_ptr().add(i));
                    for j in 0..16 {
                        acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, kp[j].add(i)), acc[j]);
                    }
                    i += 16;
                }
                let s = hsum16(&acc);
                let n = chunk.len();
                let m = if n == 16 { 0xffff } else { tail_mask(n) };
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(16 * c), m, s);
            }
        }
    }

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn max(x: &[f32]) -> f32 {
        let n = x.len();
        let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        // SAFETY (all loads): offsets below `n`, or masked to it.
        unsafe {
            while i < n {
                let m = if n - i >= 16 { 0xffff } else { tail_mask(n - i) };
                acc = _mm512_mask_max_ps(acc, m, acc, _mm512_maskz_loadu_ps(m, x.as_ptr().add(i)));
                i += 16;
            }
        }
        _mm512_reduce_max_ps(acc)
    }

    /// `exp(x)` for 16 lanes (Cephes `expf`: `2^n · (1 + r + r² P(r))`, `r = x - n ln 2`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn exp16(x: __m512) -> __m512 {
        let x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.37626)), _mm512_set1_ps(-103.27893));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        _mm512_scalef_ps(y, n)
    }

    /// # Safety
    /// AVX-512F available; `gate` and `up` as long as `out`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let (g, u, o) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`, or masked to it.
        unsafe {
            while i < n {
                let m = if n - i >= 16 { 0xffff } else { tail_mask(n - i) };
                let gv = _mm512_maskz_loadu_ps(m, g.add(i));
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
                let y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_maskz_loadu_ps(m, u.add(i)));
                _mm512_mask_storeu_ps(o.add(i), m, y);
                i += 16;
            }
        }
    }

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
        let n = row.len();
        let p = row.as_mut_ptr();
        let mv = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`, or masked to it.
        unsafe {
            while i < n {
                let m = if n - i >= 16 { 0xffff } else { tail_mask(n - i) };
                let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.add(i)), mv));
                let e = _mm512_maskz_mov_ps(m, e);
                _mm512_mask_storeu_ps(p.add(i), m, e);
                acc = _mm512_add_ps(acc, e);
                i += 16;
            }
        }
        _mm512_reduce_add_ps(acc)
    }

    /// # Safety
    /// AVX-512F available; sizes as asserted by the safe wrapper `simd::accumulate_rows`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn accumulate_rows(p: &[f32], p_stride: usize, rows: usize, vals: &[&[f32]], out: &mut [f32], d: usize) {
        // SAFETY: forwarded; every group stays inside the asserted sizes.
        unsafe { in_row_groups!(accumulate_group, p, p_stride, rows, vals, out, d) }
    }

    /// `R` rows of [`accumulate_rows`], 64 columns (four vectors) at a time, with the rows'
    /// `R × 4` accumulators in registers across all values.
    ///
    /// # Safety
    /// AVX-512F available; `p` valid for `(R - 1) * p_stride + vals.len()` reads, `out` for
    /// `R * d` reads and writes, every value for `d` reads.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed in fully unrolled loops
    unsafe fn accumulate_group<const R: usize>(
        p: *const f32,
        p_stride: usize,
        vals: &[&[f32]],
        out: *mut f32,
        d: usize,
    ) {
        let mask = |i: usize| {
            if i >= d {
                0
            } else if d - i >= 16 {
                0xffff
            } else {
                tail_mask(d - i)
            }
        };
        let mut i = 0;
        // SAFETY (all accesses): columns below `d` (masked), rows below `R`, values below
        // `vals.len()`, as the caller vouches.
        unsafe {
            while i < d {
                let m: [__mmask16; 4] = std::array::from_fn(|c| mask(i + 16 * c));
                let mut acc = [[_mm512_setzero_ps(); 4]; R];
                for (j, v) in vals.iter().enumerate() {
                    let vp = v.as_ptr().add(i);
                    let vv: [__m512; 4] = std::array::from_fn(|c| _mm512_maskz_loadu_ps(m[c], vp.add(16 * c)));
                    for r in 0..R {
                        let pv = _mm512_set1_ps(*p.add(r * p_stride + j));
                        for c in 0..4 {
                            acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
                        }
                    }
                }
                for r in 0..R {
                    for c in 0..4 {
                        let o = out.add(r * d + i + 16 * c);
                        _mm512_mask_storeu_ps(o, m[c], _mm512_add_ps(_mm512_maskz_loadu_ps(m[c], o), acc[r][c]));
                    }
                }
                i += 64;
            }
        }
    }

    /// # Safety
    /// AVX-512F available; `y.len() == x.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = x.len();
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let av = _mm512_set1_ps(a);
        let mut i = 0;
        // SAFETY (all accesses): offsets stay below `n`, or are masked to it.
        unsafe {
            while i + 16 <= n {
                let r = _mm512_fmadd_ps(av, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i)));
                _mm512_storeu_ps(py.add(i), r);
                i += 16;
            }
            if i < n {
                let m = tail_mask(n - i);
                let r = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, px.add(i)), _mm512_maskz_loadu_ps(m, py.add(i)));
                _mm512_mask_storeu_ps(py.add(i), m, r);
            }
        }
    }

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum(x: &[f32]) -> f32 {
        let n = x.len();
        let p = x.as_ptr();
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): offsets stay below `n`, or are masked to it.
        unsafe {
            while i + 64 <= n {
                for (u, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_add_ps(_mm512_loadu_ps(p.add(i + 16 * u)), *acc);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_add_ps(_mm512_loadu_ps(p.add(i)), acc[0]);
                i += 16;
            }
            if i < n {
                acc[1] = _mm512_add_ps(_mm512_maskz_loadu_ps(tail_mask(n - i), p.add(i)), acc[1]);
            }
        }
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(s)
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::*;

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2 and FMA available; `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = b.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): offsets stay below `n`.
        unsafe {
            while i + 32 <= n {
                for (u, acc) in acc.iter_mut().enumerate() {
                    let o = i + 8 * u;
                    *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *acc);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
                i += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            hsum(s) + a[i..].iter().zip(&b[i..]).map(|(x, y)| x * y).sum::<f32>()
        }
    }

    /// # Safety
    /// AVX2 and FMA available; every row of `xs` and `ws` has the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots<const M: usize, const J: usize>(xs: &[&[f32]; M], ws: &[&[f32]; J]) -> [[f32; M]; J] {
        let n = if J == 0 { 0 } else { ws[0].len() };
        let mut acc = [[_mm256_setzero_ps(); M]; J];
        let mut i = 0;
        // SAFETY (all loads): offsets stay below `n`.
        unsafe {
            while i + 8 <= n {
                let mut wv = [_mm256_setzero_ps(); J];
                for j in 0..J {
                    wv[j] = _mm256_loadu_ps(ws[j].as_ptr().add(i));
                }
                for r in 0..M {
                    let xv = _mm256_loadu_ps(xs[r].as_ptr().add(i));
                    for j in 0..J {
                        acc[j][r] = _mm256_fmadd_ps(xv, wv[j], acc[j][r]);
                    }
                }
                i += 8;
            }
        }
        // Plain loops: see `avx512::dots`.
        let mut out = [[0f32; M]; J];
        for j in 0..J {
            for r in 0..M {
                let tail: f32 = xs[r][i..].iter().zip(&ws[j][i..]).map(|(x, y)| x * y).sum();
                out[j][r] = hsum(acc[j][r]) + tail;
            }
        }
        out
    }

    /// # Safety
    /// AVX2 and FMA available; `y.len() == x.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = x.len();
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY (all accesses): offsets stay below `n`.
        unsafe {
            while i + 8 <= n {
                let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
                _mm256_storeu_ps(py.add(i), r);
                i += 8;
            }
        }
        for j in i..n {
            y[j] += a * x[j];
        }
    }

    /// `n <= 8` floats at `p`, the rest of the vector zero (also the 16-bit kernels' f32 tails).
    ///
    /// # Safety
    /// AVX2 available; `p` valid for `n` reads.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(in crate::cpu) unsafe fn load_part(p: *const f32, n: usize) -> __m256 {
        let mut buf = [0f32; 8];
        // SAFETY: the caller vouches for `n <= 8` readable floats.
        unsafe {
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            _mm256_loadu_ps(buf.as_ptr())
        }
    }

    /// # Safety
    /// AVX2 and FMA available; every key holds `q.len()` elements; `out.len() == keys.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_keys(q: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        let d = q.len();
        // SAFETY (all accesses): offsets below `d` (or copied up to it) in `q` and each key.
        unsafe {
            // Four keys at a time share each query load and keep four chains in flight.
            for (c, chunk) in keys.chunks(4).enumerate() {
                let kp: [*const f32; 4] = std::array::from_fn(|j| chunk[j.min(chunk.len() - 1)].as_ptr());
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                while i + 8 <= d {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(i));
                    for j in 0..4 {
                        acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[j].add(i)), acc[j]);
                    }
                    i += 8;
                }
                if i < d {
                    let qv = load_part(q.as_ptr().add(i), d - i);
                    for j in 0..4 {
                        acc[j] = _mm256_fmadd_ps(qv, load_part(kp[j].add(i), d - i), acc[j]);
                    }
                }
                for (j, o) in out[4 * c..4 * c + chunk.len()].iter_mut().enumerate() {
                    *o = hsum(acc[j]);
                }
            }
        }
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn max(x: &[f32]) -> f32 {
        let n = x.len();
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        // SAFETY (all loads): offsets below `n`.
        unsafe {
            while i + 8 <= n {
                // `max_ps(a, b)` returns `b` when either is NaN: NaN keys do not propagate.
                acc = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(i)), acc);
                i += 8;
            }
        }
        let mut lanes = [0f32; 8];
        // SAFETY: a store of 8 floats into an array of 8.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes.into_iter().chain(x[i..].iter().copied()).fold(f32::NEG_INFINITY, f32::max)
    }

    /// `exp(x)` for 8 lanes: the AVX-512 `exp16`'s polynomial, with `2^n` built in the exponent
    /// bits. Inputs below -87 (where `2^n` leaves the normal range; `exp` < 1.7e-38 there) give 0.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn exp8(x: __m256) -> __m256 {
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
        let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37626)), _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        // n is in [-126, 128]: 2^n for n <= 127 is a normal float (biased exponent n + 127 in
        // [1, 254]); n = 128 (x near the upper clamp) is taken as 2 · 2^127, the 2 folded into y.
        let ni = _mm256_cvtps_epi32(n);
        let hi = _mm256_min_epi32(ni, _mm256_set1_epi32(127));
        let y = _mm256_mul_ps(
            y,
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_sub_epi32(ni, hi),
                _mm256_set1_epi32(127),
            ))),
        );
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(hi, _mm256_set1_epi32(127))));
        _mm256_andnot_ps(tiny, _mm256_mul_ps(y, two_n))
    }

    /// `silu(g) · u` of eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn silu8(g: __m256, u: __m256) -> __m256 {
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
    }

    /// # Safety
    /// AVX2 and FMA available; `gate` and `up` as long as `out`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let (g, u, o) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`, which every slice holds.
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(o.add(i), silu8(_mm256_loadu_ps(g.add(i)), _mm256_loadu_ps(u.add(i))));
                i += 8;
            }
            if i < n {
                let mut buf = [0f32; 8];
                _mm256_storeu_ps(buf.as_mut_ptr(), silu8(load_part(g.add(i), n - i), load_part(u.add(i), n - i)));
                std::ptr::copy_nonoverlapping(buf.as_ptr(), o.add(i), n - i);
            }
        }
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
        let n = row.len();
        let p = row.as_mut_ptr();
        let mv = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`.
        unsafe {
            while i + 8 <= n {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
                _mm256_storeu_ps(p.add(i), e);
                acc = _mm256_add_ps(acc, e);
                i += 8;
            }
            if i < n {
                let mut buf = [0f32; 8];
                std::ptr::copy_nonoverlapping(p.add(i), buf.as_mut_ptr(), n - i);
                _mm256_storeu_ps(buf.as_mut_ptr(), exp8(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv)));
                std::ptr::copy_nonoverlapping(buf.as_ptr(), p.add(i), n - i);
                acc = _mm256_add_ps(acc, load_part(buf.as_ptr(), n - i));
            }
        }
        hsum(acc)
    }

    /// # Safety
    /// AVX2 and FMA available; sizes as asserted by the safe wrapper `simd::accumulate_rows`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn accumulate_rows(p: &[f32], p_stride: usize, rows: usize, vals: &[&[f32]], out: &mut [f32], d: usize) {
        // SAFETY: forwarded; every group stays inside the asserted sizes.
        unsafe { in_row_groups!(accumulate_group, p, p_stride, rows, vals, out, d) }
    }

    /// `R` rows of [`accumulate_rows`], 16 columns (two vectors) at a time, with the rows'
    /// `R × 2` accumulators in registers across all values (`R × 2` + two values + one
    /// broadcast fit AVX2's 16 registers). A last partial strip goes through a zero-padded copy.
    ///
    /// # Safety
    /// AVX2 and FMA available; `p` valid for `(R - 1) * p_stride + vals.len()` reads, `out` for
    /// `R * d` reads and writes, every value for `d` reads.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed in fully unrolled loops
    unsafe fn accumulate_group<const R: usize>(
        p: *const f32,
        p_stride: usize,
        vals: &[&[f32]],
        out: *mut f32,
        d: usize,
    ) {
        // SAFETY (all accesses): columns below `d` (or copied up to it), rows below `R`, values
        // below `vals.len()`, as the caller vouches.
        unsafe {
            let mut i = 0;
            while i < d {
                let n = (d - i).min(16);
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                for (j, v) in vals.iter().enumerate() {
                    let vp = v.as_ptr().add(i);
                    let vv = if n == 16 {
                        [_mm256_loadu_ps(vp), _mm256_loadu_ps(vp.add(8))]
                    } else {
                        [load_part(vp, n.min(8)), load_part(vp.add(8.min(n)), n.saturating_sub(8))]
                    };
                    for r in 0..R {
                        let pv = _mm256_set1_ps(*p.add(r * p_stride + j));
                        for c in 0..2 {
                            acc[r][c] = _mm256_fmadd_ps(pv, vv[c], acc[r][c]);
                        }
                    }
                }
                for r in 0..R {
                    let o = out.add(r * d + i);
                    if n == 16 {
                        for c in 0..2 {
                            let oc = o.add(8 * c);
                            _mm256_storeu_ps(oc, _mm256_add_ps(_mm256_loadu_ps(oc), acc[r][c]));
                        }
                    } else {
                        let mut buf = [0f32; 16];
                        std::ptr::copy_nonoverlapping(o, buf.as_mut_ptr(), n);
                        for c in 0..2 {
                            let bc = buf.as_mut_ptr().add(8 * c);
                            _mm256_storeu_ps(bc, _mm256_add_ps(_mm256_loadu_ps(bc), acc[r][c]));
                        }
                        std::ptr::copy_nonoverlapping(buf.as_ptr(), o, n);
                    }
                }
                i += 16;
            }
        }
    }
}

#[cfg(test)]
mod tests;
