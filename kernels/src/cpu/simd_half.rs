//! The vector inner loops of 16-bit KV caches (f16 and bf16), with runtime ISA dispatch like
//! [`super::simd`]: conversion of a row to and from f32, and the two attention loops
//! ([`dot_keys`], [`accumulate_rows`]) with keys and values converted to f32 in registers as
//! they are loaded.
//!
//! Elements are raw bits (`u16`); `BF` selects the format: `false` is IEEE f16 (F16C
//! `vcvtph2ps`/`vcvtps2ph` on AVX2 and AVX-512), `true` is bf16 (the upper half of an f32: widen
//! and shift left by 16; narrowing rounds in integer arithmetic). Narrowing rounds to nearest,
//! ties to even, on every path; a NaN stays a NaN (quieted), an overflow becomes infinity.
//! The portable path converts in software, bit for bit like the vector paths.
//!
//! Tails (lengths that are not a multiple of the vector width) go through a zero-padded stack
//! buffer: AVX-512F alone has no masked 16-bit loads (those need AVX-512BW).
//!
//! Invariant of every function here, as in [`super::simd`]: the slices it pairs up have at least
//! the length of the one that sets the loop count; the safe wrappers assert it.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::simd::Isa;

/// `dst[i] = round(src[i])` to the 16-bit format, over `src.len()` elements.
pub fn from_f32<const BF: bool>(isa: Isa, src: &[f32], dst: &mut [u16]) {
    let dst = &mut dst[..src.len()];
    match isa {
        // SAFETY: `detect` returned this ISA only if the CPU supports it (AVX2 implies F16C
        // there); lengths are equal.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::from_f32::<BF>(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::from_f32::<BF>(src, dst) },
        _ => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = portable::narrow::<BF>(s)),
    }
}

/// `dst[i] = src[i]` widened to f32, over `src.len()` elements (exact).
pub fn to_f32<const BF: bool>(isa: Isa, src: &[u16], dst: &mut [f32]) {
    let dst = &mut dst[..src.len()];
    match isa {
        // SAFETY: as in `from_f32`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::to_f32::<BF>(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::to_f32::<BF>(src, dst) },
        _ => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = portable::widen::<BF>(s)),
    }
}

/// `out[j] = q · keys[j]` (attention scores of one query); each key has at least `q.len()`
/// elements.
pub fn dot_keys<const BF: bool>(isa: Isa, q: &[f32], keys: &[&[u16]], out: &mut [f32]) {
    let out = &mut out[..keys.len()];
    let d = q.len();
    assert!(keys.iter().all(|k| k.len() >= d));
    match isa {
        // SAFETY: as in `from_f32`; every key holds `d` elements (asserted).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot_keys::<BF>(q, keys, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::dot_keys::<BF>(q, keys, out) },
        _ => out.iter_mut().zip(keys).for_each(|(o, k)| *o = portable::dot::<BF>(q, &k[..d])),
    }
}

/// `out[r * d..(r + 1) * d] += Σ_j p[r * p_stride + j] · vals[j][..d]` for every row `r < rows`,
/// as [`super::simd::accumulate_rows`] with 16-bit values.
pub fn accumulate_rows<const BF: bool>(
    isa: Isa,
    p: &[f32],
    p_stride: usize,
    rows: usize,
    vals: &[&[u16]],
    out: &mut [f32],
    d: usize,
) {
    let nv = vals.len();
    if rows == 0 || nv == 0 || d == 0 {
        return;
    }
    assert!(vals.iter().all(|v| v.len() >= d) && out.len() >= rows * d);
    assert!(p_stride >= nv && p.len() >= (rows - 1) * p_stride + nv);
    match isa {
        // SAFETY: as in `from_f32`; sizes asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::accumulate_rows::<BF>(p, p_stride, rows, vals, out, d) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::accumulate_rows::<BF>(p, p_stride, rows, vals, out, d) },
        _ => {
            for r in 0..rows {
                let o = &mut out[r * d..(r + 1) * d];
                for (j, v) in vals.iter().enumerate() {
                    let a = p[r * p_stride + j];
                    o.iter_mut().zip(&v[..d]).for_each(|(o, &h)| *o += a * portable::widen::<BF>(h));
                }
            }
        }
    }
}

/// Software conversions (the portable path, and the tails of nothing else: the vector paths pad
/// their tails and convert them in registers too).
pub(crate) mod portable {
    /// The 16-bit value of `x`, rounded to nearest, ties to even.
    #[inline]
    pub fn narrow<const BF: bool>(x: f32) -> u16 {
        if BF {
            f32_to_bf16(x)
        } else {
            f32_to_f16(x)
        }
    }

    /// The f32 value of a 16-bit element (exact).
    #[inline]
    pub fn widen<const BF: bool>(h: u16) -> f32 {
        if BF {
            f32::from_bits((h as u32) << 16)
        } else {
            f16_to_f32(h)
        }
    }

    pub fn f32_to_bf16(x: f32) -> u16 {
        let b = x.to_bits();
        if x.is_nan() {
            return ((b >> 16) | 0x40) as u16;
        }
        // Adding 0x7fff plus the kept part's lowest bit rounds half to even; a carry out of the
        // mantissa bumps the exponent (up to infinity), as it should.
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }

    pub fn f16_to_f32(h: u16) -> f32 {
        let sign = ((h & 0x8000) as u32) << 16;
        let exp = ((h >> 10) & 0x1f) as u32;
        let man = (h & 0x3ff) as u32;
        let bits = match (exp, man) {
            (0, 0) => sign,
            // Subnormal: man · 2^-24, exact in f32.
            (0, _) => sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
            (0x1f, 0) => sign | 0x7f80_0000,
            // NaN, quieted, payload kept.
            (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
            _ => sign | ((exp + 112) << 23) | (man << 13),
        };
        f32::from_bits(bits)
    }

    pub fn f32_to_f16(x: f32) -> u16 {
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32;
        let man = b & 0x7f_ffff;
        if exp == 0xff {
            return sign | 0x7c00 | if man != 0 { 0x200 | (man >> 13) as u16 } else { 0 };
        }
        // Rounds `q` (the kept bits) up when the dropped bits `rem` are above half of `unit`, or
        // exactly half and `q` is odd.
        let round = |q: u32, rem: u32, half: u32| q + u32::from(rem > half || (rem == half && q & 1 == 1));
        let e = exp - 127 + 15;
        if e >= 0x1f {
            return sign | 0x7c00;
        }
        if e <= 0 {
            // A subnormal f16 (or zero): the 24-bit significand scaled to units of 2^-24.
            let shift = (14 - e) as u32;
            if shift > 24 {
                return sign;
            }
            let m = man | 0x80_0000;
            let q = round(m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1));
            return sign | q as u16;
        }
        // A carry out of the mantissa moves into the exponent (to infinity at the top).
        let q = round(((e as u32) << 10) | (man >> 13), man & 0x1fff, 0x1000);
        sign | q as u16
    }

    /// `q · k` with `k` widened, in 16 lane sums like [`super::super::simd`]'s portable dot.
    pub fn dot<const BF: bool>(q: &[f32], k: &[u16]) -> f32 {
        const LANES: usize = 16;
        let mut acc = [0f32; LANES];
        let (qc, kc) = (q.chunks_exact(LANES), k.chunks_exact(LANES));
        let tail: f32 = qc.remainder().iter().zip(kc.remainder()).map(|(&a, &h)| a * widen::<BF>(h)).sum();
        for (a, h) in qc.zip(kc) {
            for l in 0..LANES {
                acc[l] += a[l] * widen::<BF>(h[l]);
            }
        }
        acc.iter().sum::<f32>() + tail
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// Mask selecting the first `n < 16` lanes.
    #[inline(always)]
    fn tail_mask(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// 16 elements at `p` widened to f32.
    ///
    /// # Safety
    /// AVX-512F available; `p` valid for 16 reads.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16<const BF: bool>(p: *const u16) -> __m512 {
        // SAFETY: the caller vouches for 16 readable elements.
        let h = unsafe { _mm256_loadu_si256(p as *const __m256i) };
        if BF {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_cvtph_ps(h)
        }
    }

    /// The first `n <= 16` elements at `p` widened to f32, zeros after.
    ///
    /// # Safety
    /// AVX-512F available; `p` valid for `n` reads.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_part<const BF: bool>(p: *const u16, n: usize) -> __m512 {
        let mut buf = [0u16; 16];
        // SAFETY: `n <= 16` elements, readable at `p` as the caller vouches.
        unsafe {
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            load16::<BF>(buf.as_ptr())
        }
    }

    /// `x` rounded to 16 elements of the format (to nearest, ties to even).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn narrow16<const BF: bool>(x: __m512) -> __m256i {
        if BF {
            let b = _mm512_castps_si512(x);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
            let rounded =
                _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))));
            let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
        } else {
            _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x)
        }
    }

    /// # Safety
    /// AVX-512F available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn from_f32<const BF: bool>(src: &[f32], dst: &mut [u16]) {
        let n = src.len();
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`, or masked / copied up to it.
        unsafe {
            while i + 16 <= n {
                _mm256_storeu_si256(pd.add(i) as *mut __m256i, narrow16::<BF>(_mm512_loadu_ps(ps.add(i))));
                i += 16;
            }
            if i < n {
                let mut buf = [0u16; 16];
                let x = _mm512_maskz_loadu_ps(tail_mask(n - i), ps.add(i));
                _mm256_storeu_si256(buf.as_mut_ptr() as *mut __m256i, narrow16::<BF>(x));
                std::ptr::copy_nonoverlapping(buf.as_ptr(), pd.add(i), n - i);
            }
        }
    }

    /// # Safety
    /// AVX-512F available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn to_f32<const BF: bool>(src: &[u16], dst: &mut [f32]) {
        let n = src.len();
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`, or masked / copied up to it.
        unsafe {
            while i + 16 <= n {
                _mm512_storeu_ps(pd.add(i), load16::<BF>(ps.add(i)));
                i += 16;
            }
            if i < n {
                _mm512_mask_storeu_ps(pd.add(i), tail_mask(n - i), load_part::<BF>(ps.add(i), n - i));
            }
        }
    }

    /// # Safety
    /// AVX-512F available; every key holds `q.len()` elements; `out.len() == keys.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_keys<const BF: bool>(q: &[f32], keys: &[&[u16]], out: &mut [f32]) {
        let d = q.len();
        // SAFETY (all accesses): offsets below `d` (or masked / copied up to it) in `q` and in
        // each key; output lanes masked to the chunk's key count.
        unsafe {
            for (c, chunk) in keys.chunks(16).enumerate() {
                // A short last chunk repeats its last key (see `simd::avx512::dot_keys`).
                let kp: [*const u16; 16] = std::array::from_fn(|j| chunk[j.min(chunk.len() - 1)].as_ptr());
                let mut acc = [_mm512_setzero_ps(); 16];
                let mut i = 0;
                while i + 16 <= d {
                    let qv = _mm512_loadu_ps(q.as_ptr().add(i));
                    for j in 0..16 {
                        acc[j] = _mm512_fmadd_ps(qv, load16::<BF>(kp[j].add(i)), acc[j]);
                    }
                    i += 16;
                }
                if i < d {
                    let qv = _mm512_maskz_loadu_ps(tail_mask(d - i), q.as_ptr().add(i));
                    for j in 0..16 {
                        acc[j] = _mm512_fmadd_ps(qv, load_part::<BF>(kp[j].add(i), d - i), acc[j]);
                    }
                }
                let s = crate::cpu::simd::hsum16_avx512(&acc);
                let n = chunk.len();
                let m = if n == 16 { 0xffff } else { tail_mask(n) };
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(16 * c), m, s);
            }
        }
    }

    /// # Safety
    /// AVX-512F available; sizes as asserted by the safe wrapper.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn accumulate_rows<const BF: bool>(
        p: &[f32],
        p_stride: usize,
        rows: usize,
        vals: &[&[u16]],
        out: &mut [f32],
        d: usize,
    ) {
        // SAFETY: forwarded; every group stays inside the asserted sizes.
        unsafe {
            for r0 in (0..rows).step_by(6) {
                let (pp, op) = (p.as_ptr().add(r0 * p_stride), out.as_mut_ptr().add(r0 * d));
                match (rows - r0).min(6) {
                    1 => accumulate_group::<BF, 1>(pp, p_stride, vals, op, d),
                    2 => accumulate_group::<BF, 2>(pp, p_stride, vals, op, d),
                    3 => accumulate_group::<BF, 3>(pp, p_stride, vals, op, d),
                    4 => accumulate_group::<BF, 4>(pp, p_stride, vals, op, d),
                    5 => accumulate_group::<BF, 5>(pp, p_stride, vals, op, d),
                    _ => accumulate_group::<BF, 6>(pp, p_stride, vals, op, d),
                }
            }
        }
    }

    /// `R` rows of [`accumulate_rows`], 64 columns (four vectors) at a time, with the rows'
    /// `R × 4` accumulators in registers across all values (as `simd::avx512::accumulate_group`).
    ///
    /// # Safety
    /// AVX-512F available; `p` valid for `(R - 1) * p_stride + vals.len()` reads, `out` for
    /// `R * d` reads and writes, every value for `d` reads.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed in fully unrolled loops
    unsafe fn accumulate_group<const BF: bool, const R: usize>(
        p: *const f32,
        p_stride: usize,
        vals: &[&[u16]],
        out: *mut f32,
        d: usize,
    ) {
        // Columns of vector `c` at offset `i`: 16, a tail, or none.
        let cols = |i: usize| d.saturating_sub(i).min(16);
        let mask = |n: usize| if n == 16 { 0xffff } else { tail_mask(n) };
        let mut i = 0;
        // SAFETY (all accesses): columns below `d` (masked or copied), rows below `R`, values
        // below `vals.len()`, as the caller vouches.
        unsafe {
            while i < d {
                let n: [usize; 4] = std::array::from_fn(|c| cols(i + 16 * c));
                let mut acc = [[_mm512_setzero_ps(); 4]; R];
                for (j, v) in vals.iter().enumerate() {
                    let vp = v.as_ptr().add(i);
                    let vv: [__m512; 4] = std::array::from_fn(|c| match n[c] {
                        16 => load16::<BF>(vp.add(16 * c)),
                        0 => _mm512_setzero_ps(),
                        k => load_part::<BF>(vp.add(16 * c), k),
                    });
                    for r in 0..R {
                        let pv = _mm512_set1_ps(*p.add(r * p_stride + j));
                        for c in 0..4 {
                            acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
                        }
                    }
                }
                for r in 0..R {
                    for c in 0..4 {
                        if n[c] == 0 {
                            continue;
                        }
                        let m = mask(n[c]);
                        let o = out.add(r * d + i + 16 * c);
                        _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), acc[r][c]));
                    }
                }
                i += 64;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use crate::cpu::simd::avx2::load_part as load_part_f32;

    /// 8 elements at `p` widened to f32.
    ///
    /// # Safety
    /// AVX2 and F16C available; `p` valid for 8 reads.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<const BF: bool>(p: *const u16) -> __m256 {
        // SAFETY: the caller vouches for 8 readable elements.
        let h = unsafe { _mm_loadu_si128(p as *const __m128i) };
        if BF {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    }

    /// The first `n <= 8` elements at `p` widened to f32, zeros after.
    ///
    /// # Safety
    /// AVX2 and F16C available; `p` valid for `n` reads.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_part<const BF: bool>(p: *const u16, n: usize) -> __m256 {
        let mut buf = [0u16; 8];
        // SAFETY: `n <= 8` elements, readable at `p` as the caller vouches.
        unsafe {
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            load8::<BF>(buf.as_ptr())
        }
    }

    /// `x` rounded to 8 elements of the format (to nearest, ties to even).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn narrow8<const BF: bool>(x: __m256) -> __m128i {
        if BF {
            let b = _mm256_castps_si256(x);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
            let rounded =
                _mm256_srli_epi32::<16>(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))));
            let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            let r = _mm256_blendv_epi8(rounded, quiet, nan);
            // Every lane is below 0x10000, so the unsigned saturating pack is exact.
            _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r))
        } else {
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn from_f32<const BF: bool>(src: &[f32], dst: &mut [u16]) {
        let n = src.len();
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`, or copied up to it.
        unsafe {
            while i + 8 <= n {
                _mm_storeu_si128(pd.add(i) as *mut __m128i, narrow8::<BF>(_mm256_loadu_ps(ps.add(i))));
                i += 8;
            }
            if i < n {
                let mut buf = [0u16; 8];
                _mm_storeu_si128(buf.as_mut_ptr() as *mut __m128i, narrow8::<BF>(load_part_f32(ps.add(i), n - i)));
                std::ptr::copy_nonoverlapping(buf.as_ptr(), pd.add(i), n - i);
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn to_f32<const BF: bool>(src: &[u16], dst: &mut [f32]) {
        let n = src.len();
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY (all accesses): offsets below `n`, or copied up to it.
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(pd.add(i), load8::<BF>(ps.add(i)));
                i += 8;
            }
            if i < n {
                let mut buf = [0f32; 8];
                _mm256_storeu_ps(buf.as_mut_ptr(), load_part::<BF>(ps.add(i), n - i));
                std::ptr::copy_nonoverlapping(buf.as_ptr(), pd.add(i), n - i);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2, FMA and F16C available; every key holds `q.len()` elements; `out.len() ==
    /// keys.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_keys<const BF: bool>(q: &[f32], keys: &[&[u16]], out: &mut [f32]) {
        let d = q.len();
        // SAFETY (all accesses): offsets below `d` (or copied up to it) in `q` and each key.
        unsafe {
            // Four keys at a time share each query load and keep four chains in flight.
            for (c, chunk) in keys.chunks(4).enumerate() {
                let kp: [*const u16; 4] = std::array::from_fn(|j| chunk[j.min(chunk.len() - 1)].as_ptr());
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                while i + 8 <= d {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(i));
                    for j in 0..4 {
                        acc[j] = _mm256_fmadd_ps(qv, load8::<BF>(kp[j].add(i)), acc[j]);
                    }
                    i += 8;
                }
                if i < d {
                    let qv = load_part_f32(q.as_ptr().add(i), d - i);
                    for j in 0..4 {
                        acc[j] = _mm256_fmadd_ps(qv, load_part::<BF>(kp[j].add(i), d - i), acc[j]);
                    }
                }
                for (j, o) in out[4 * c..4 * c + chunk.len()].iter_mut().enumerate() {
                    *o = hsum(acc[j]);
                }
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C available; sizes as asserted by the safe wrapper.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn accumulate_rows<const BF: bool>(
        p: &[f32],
        p_stride: usize,
        rows: usize,
        vals: &[&[u16]],
        out: &mut [f32],
        d: usize,
    ) {
        // SAFETY (all accesses): columns below `d` (or copied up to it) in each value and each
        // output row; rows below `rows`; `p` inside the asserted size.
        unsafe {
            // Each value row is converted once per 8 columns and added into every output row.
            let mut i = 0;
            while i < d {
                let n = (d - i).min(8);
                for (j, v) in vals.iter().enumerate() {
                    let vv =
                        if n == 8 { load8::<BF>(v.as_ptr().add(i)) } else { load_part::<BF>(v.as_ptr().add(i), n) };
                    for r in 0..rows {
                        let pv = _mm256_set1_ps(*p.as_ptr().add(r * p_stride + j));
                        let o = out.as_mut_ptr().add(r * d + i);
                        if n == 8 {
                            _mm256_storeu_ps(o, _mm256_fmadd_ps(pv, vv, _mm256_loadu_ps(o)));
                        } else {
                            let mut buf = [0f32; 8];
                            _mm256_storeu_ps(buf.as_mut_ptr(), _mm256_fmadd_ps(pv, vv, load_part_f32(o, n)));
                            std::ptr::copy_nonoverlapping(buf.as_ptr(), o, n);
                        }
                    }
                }
                i += 8;
            }
        }
    }
}

#[cfg(test)]
mod tests;
