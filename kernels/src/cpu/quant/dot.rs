//! The integer inner loop of quantized `linear`: `C` decoded weight rows ([`super::decode`])
//! against `R` quantized activation rows ([`super::acts`]), over `units` units of 32 values:
//!
//! `out[c][r] = Σ_u Σ_lane ds[c][8u + lane] · dx[r][u] · Σ_{i < 4} q[c][32u + 4 lane + i] ·
//! xq[r][32u + 4 lane + i]`
//!
//! (the weight offsets' share, `Σ wm · s`, is added by the caller). The four-byte sums are exact
//! integers on every path: AVX2 and AVX-512BW multiply with `maddubs` (unsigned weight byte by
//! signed activation byte, pairs summed into i16 without saturation since quants are at most 63,
//! or 128 in magnitude for Q8_0 against activations of at most 127) and `madd` by ones; AVX-512
//! VNNI with `vpdpbusd`. Signed weights (Q8_0) go in as their magnitude, with the activation
//! negated where the weight is negative. Each unit's i32 lanes are converted to f32 and added
//! with the product of the two scales, so the paths differ only in the order of the f32
//! additions.
//!
//! Invariant: the operands hold at least `units` units (asserted by [`tile`]), so the
//! pointer-based kernels stay in bounds.

use super::QuantIsa;

/// One decoded weight row's run: `32 · units` quants and `8 · units` lane scales.
#[derive(Clone, Copy)]
pub(crate) struct WRow<'a> {
    pub q: &'a [u8],
    pub ds: &'a [f32],
}

/// One quantized activation row's run: `32 · units` quants and `units` block scales.
#[derive(Clone, Copy)]
pub(crate) struct XRow<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
}

/// The `C × R` unit sums of `w` against `x` (see the module docs).
///
/// # Panics
/// If an operand holds fewer than `units` units.
pub(crate) fn tile<const R: usize, const C: usize>(
    isa: QuantIsa,
    signed: bool,
    w: &[WRow<'_>; C],
    x: &[XRow<'_>; R],
    units: usize,
) -> [[f32; R]; C] {
    assert!(w.iter().all(|w| w.q.len() >= 32 * units && w.ds.len() >= 8 * units));
    assert!(x.iter().all(|x| x.q.len() >= 32 * units && x.d.len() >= units));
    let wp: [(*const u8, *const f32); C] = std::array::from_fn(|c| (w[c].q.as_ptr(), w[c].ds.as_ptr()));
    let xp: [(*const i8, *const f32); R] = std::array::from_fn(|r| (x[r].q.as_ptr(), x[r].d.as_ptr()));
    // SAFETY (every arm): the ISA was detected on this CPU ([`QuantIsa::detect`]); the operands
    // hold `units` units (asserted above).
    match (isa, signed) {
        #[cfg(target_arch = "x86_64")]
        (QuantIsa::Avx512Vnni, false) => unsafe { avx512::tile_vnni::<R, C, false>(wp, xp, units) },
        #[cfg(target_arch = "x86_64")]
        (QuantIsa::Avx512Vnni, true) => unsafe { avx512::tile_vnni::<R, C, true>(wp, xp, units) },
        #[cfg(target_arch = "x86_64")]
        (QuantIsa::Avx512Bw, false) => unsafe { avx512::tile_bw::<R, C, false>(wp, xp, units) },
        #[cfg(target_arch = "x86_64")]
        (QuantIsa::Avx512Bw, true) => unsafe { avx512::tile_bw::<R, C, true>(wp, xp, units) },
        #[cfg(target_arch = "x86_64")]
        (QuantIsa::Avx2, false) => unsafe { avx2::tile::<R, C, false>(wp, xp, units) },
        #[cfg(target_arch = "x86_64")]
        (QuantIsa::Avx2, true) => unsafe { avx2::tile::<R, C, true>(wp, xp, units) },
        _ => portable(signed, w, x, units),
    }
}

fn portable<const R: usize, const C: usize>(
    signed: bool,
    w: &[WRow<'_>; C],
    x: &[XRow<'_>; R],
    units: usize,
) -> [[f32; R]; C] {
    let mut out = [[0f32; R]; C];
    for (w, out) in w.iter().zip(out.iter_mut()) {
        for (x, out) in x.iter().zip(out.iter_mut()) {
            let mut acc = [0f32; 8];
            for u in 0..units {
                let dx = x.d[u];
                for (lane, acc) in acc.iter_mut().enumerate() {
                    let i = 32 * u + 4 * lane;
                    let p: i32 = (i..i + 4)
                        .map(|i| {
                            let wq = if signed { i32::from(w.q[i] as i8) } else { i32::from(w.q[i]) };
                            wq * i32::from(x.q[i])
                        })
                        .sum();
                    *acc += p as f32 * (w.ds[8 * u + lane] * dx);
                }
            }
            *out = acc.iter().sum();
        }
    }
    out
}

// Register arrays are indexed by row and column in fully unrolled loops: iterators over them
// would read no better.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 and FMA available; each `w` valid for `32 · units` quants and `8 · units` scales,
    /// each `x` for `32 · units` quants and `units` scales.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const R: usize, const C: usize, const SIGNED: bool>(
        w: [(*const u8, *const f32); C],
        x: [(*const i8, *const f32); R],
        units: usize,
    ) -> [[f32; R]; C] {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); R]; C];
        let mut wq = [_mm256_setzero_si256(); C];
        let mut wa = [_mm256_setzero_si256(); C];
        // SAFETY (all loads): `u < units`: inside the runs the caller vouches for.
        unsafe {
            for u in 0..units {
                for c in 0..C {
                    wq[c] = _mm256_loadu_si256(w[c].0.add(32 * u) as *const __m256i);
                    wa[c] = if SIGNED { _mm256_sign_epi8(wq[c], wq[c]) } else { wq[c] };
                }
                for r in 0..R {
                    let xv = _mm256_loadu_si256(x[r].0.add(32 * u) as *const __m256i);
                    let dx = _mm256_broadcast_ss(&*x[r].1.add(u));
                    for c in 0..C {
                        let xs = if SIGNED { _mm256_sign_epi8(xv, wq[c]) } else { xv };
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[c], xs), ones);
                        let s = _mm256_mul_ps(_mm256_loadu_ps(w[c].1.add(8 * u)), dx);
                        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[c][r]);
                    }
                }
            }
        }
        let mut out = [[0f32; R]; C];
        for c in 0..C {
            for r in 0..R {
                out[c][r] = hsum(acc[c][r]);
            }
        }
        out
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

// As in `avx2`.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// The i32 lane sums of four unsigned-by-signed byte products: `vpdpbusd` with VNNI, else
    /// `maddubs` then `madd` by ones.
    macro_rules! products {
        (vnni, $a:expr, $b:expr) => {
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), $a, $b)
        };
        (bw, $a:expr, $b:expr) => {
            _mm512_madd_epi16(_mm512_maddubs_epi16($a, $b), _mm512_set1_epi16(1))
        };
    }

    /// The kernel body, two units (64 bytes) per step and an odd last unit with masked loads,
    /// spelled once for the two functions below (which differ in their target features and
    /// product instruction).
    macro_rules! body {
        ($w:ident, $x:ident, $units:ident, $mode:ident) => {{
            // SAFETY (all loads): pairs `2p, 2p + 1 < units`; the odd tail loads only its 32
            // bytes and 8 scales (masked-off lanes touch no memory).
            unsafe {
                let zero = _mm512_setzero_si512();
                let mut acc = [[_mm512_setzero_ps(); R]; C];
                let mut wa = [zero; C];
                let mut neg: [__mmask64; C] = [0; C];
                let mut ds = [_mm512_setzero_ps(); C];
                for p in 0..$units.div_ceil(2) {
                    let full = 2 * p + 1 < $units;
                    let (bmask, fmask): (__mmask64, __mmask16) = if full { (!0, !0) } else { (0xFFFF_FFFF, 0x00FF) };
                    for c in 0..C {
                        let q = _mm512_maskz_loadu_epi8(bmask, $w[c].0.add(64 * p) as *const i8);
                        if SIGNED {
                            neg[c] = _mm512_movepi8_mask(q);
                            wa[c] = _mm512_abs_epi8(q);
                        } else {
                            wa[c] = q;
                        }
                        ds[c] = _mm512_maskz_loadu_ps(fmask, $w[c].1.add(16 * p));
                    }
                    for r in 0..R {
                        let xv = _mm512_maskz_loadu_epi8(bmask, $x[r].0.add(64 * p));
                        let d0 = _mm256_set1_ps(*$x[r].1.add(2 * p));
                        let d1 = if full { _mm256_set1_ps(*$x[r].1.add(2 * p + 1)) } else { _mm256_setzero_ps() };
                        let dx = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                            _mm512_castpd256_pd512(_mm256_castps_pd(d0)),
                            _mm256_castps_pd(d1),
                        ));
                        for c in 0..C {
                            // Signed weights: |w| against x negated where w < 0.
                            let xs = if SIGNED { _mm512_mask_sub_epi8(xv, neg[c], zero, xv) } else { xv };
                            let p32 = products!($mode, wa[c], xs);
                            acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), _mm512_mul_ps(ds[c], dx), acc[c][r]);
                        }
                    }
                }
                let mut out = [[0f32; R]; C];
                for c in 0..C {
                    for r in 0..R {
                        out[c][r] = _mm512_reduce_add_ps(acc[c][r]);
                    }
                }
                out
            }
        }};
    }

    /// # Safety
    /// AVX-512F/BW/VL and AVX512-VNNI available; operands as in the AVX2 kernel.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub unsafe fn tile_vnni<const R: usize, const C: usize, const SIGNED: bool>(
        w: [(*const u8, *const f32); C],
        x: [(*const i8, *const f32); R],
        units: usize,
    ) -> [[f32; R]; C] {
        body!(w, x, units, vnni)
    }

    /// # Safety
    /// AVX-512F/BW/VL available; operands as in the AVX2 kernel.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub unsafe fn tile_bw<const R: usize, const C: usize, const SIGNED: bool>(
        w: [(*const u8, *const f32); C],
        x: [(*const i8, *const f32); R],
        units: usize,
    ) -> [[f32; R]; C] {
        body!(w, x, units, bw)
    }
}
