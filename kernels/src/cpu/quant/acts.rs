//! Activations quantized to 8 bits per block of 32 for the integer dot kernels: for each block,
//! `d = max|x| / 127`, `q = round(x / d)` (ties to even; `|q| <= 127`), and for each half of the
//! block `s = d * Σ q`, the sum that multiplies a weight group's offset.
//!
//! The portable and AVX2 paths compute the same `d`, the same product `x * (1 / d)` and the same
//! rounding, so they produce identical bytes.
//!
//! Accuracy: the rounding moves each activation by at most `d / 2`, so a dot product with
//! weights `w` moves by at most `Σ_blocks d / 2 · Σ_block |w|`; for activations whose largest
//! value in a block is A that is a relative error of about `1 / 254` of `A · Σ|w|`, and it
//! averages out over a row (the errors are independent and centred). llama.cpp quantizes
//! activations the same way for these formats (with an f16 `d`; this keeps f32).

use super::QuantIsa;

/// `m` rows of `k` activations, quantized (see the module docs). Reused between calls.
#[derive(Default)]
pub(crate) struct QActs {
    pub k: usize,
    /// `[m, k]` quants.
    pub q: Vec<i8>,
    /// `[m, k / 32]` block scales.
    pub d: Vec<f32>,
    /// `[m, k / 16]` scaled half-block sums.
    pub s: Vec<f32>,
    /// `[m, k / 32]` scaled block sums (`d * Σ q` over the whole block).
    pub s32: Vec<f32>,
}

impl QActs {
    /// Quantizes `x: [m, k]`, `k` a multiple of 32, in `passes` rows per row of `x`: row
    /// `r * passes` holds `x[r]` quantized, each next one the rounding error of the rows before
    /// it, quantized again (so the rows of `x[r]` sum to it within `d / 2` of its last pass).
    ///
    /// # Panics
    /// If `k` is not a multiple of 32, `passes` is 0 or `x` is shorter than `m * k`.
    pub fn quantize(&mut self, isa: QuantIsa, x: &[f32], m: usize, k: usize, passes: usize) {
        assert!(k.is_multiple_of(32) && passes > 0 && x.len() >= m * k);
        let rows = m * passes;
        self.k = k;
        self.q.resize(rows * k, 0);
        self.d.resize(rows * k / 32, 0.0);
        self.s.resize(rows * k / 16, 0.0);
        self.s32.resize(rows * k / 32, 0.0);
        let per_row = k / 32;
        for (i, x) in x[..m * k].chunks_exact(32).enumerate() {
            let mut cur: [f32; 32] = x.try_into().expect("32");
            let (r, b) = (i / per_row, i % per_row);
            for pass in 0..passes {
                let o = (r * passes + pass) * per_row + b;
                let q: &mut [i8; 32] = (&mut self.q[32 * o..32 * o + 32]).try_into().expect("32");
                let (d, sums) = match isa {
                    // SAFETY: a non-portable `QuantIsa` is only chosen when AVX2 is present.
                    #[cfg(target_arch = "x86_64")]
                    QuantIsa::Avx2 | QuantIsa::Avx512Bw | QuantIsa::Avx512Vnni => unsafe { avx2::block(&cur, q) },
                    _ => block(&cur, q),
                };
                self.d[o] = d;
                self.s[2 * o] = d * sums[0] as f32;
                self.s[2 * o + 1] = d * sums[1] as f32;
                self.s32[o] = d * (sums[0] + sums[1]) as f32;
                for (c, &q) in cur.iter_mut().zip(q.iter()) {
                    *c -= d * f32::from(q);
                }
            }
        }
    }

    /// Row `r`'s quants, block scales, half-block sums and block sums.
    pub fn row(&self, r: usize) -> ActRow<'_> {
        let k = self.k;
        ActRow {
            q: &self.q[r * k..(r + 1) * k],
            d: &self.d[r * k / 32..(r + 1) * k / 32],
            s16: &self.s[r * k / 16..(r + 1) * k / 16],
            s32: &self.s32[r * k / 32..(r + 1) * k / 32],
        }
    }
}

/// One quantized activation row (see [`QActs`]).
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub s16: &'a [f32],
    pub s32: &'a [f32],
}

/// `d` and `1 / d` of a block whose largest magnitude is `amax` (both 0 for an all-zero block).
fn scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// One block: its scale, and the sums of the quants of its halves.
fn block(x: &[f32; 32], q: &mut [i8; 32]) -> (f32, [i32; 2]) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let (d, id) = scale(amax);
    let mut sums = [0i32; 2];
    for (j, (q, &v)) in q.iter_mut().zip(x).enumerate() {
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        sums[j / 16] += r;
    }
    (d, sums)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::block`] with AVX2 (`cvtps2dq` rounds to nearest even, as `round_ties_even`).
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block(x: &[f32; 32], q: &mut [i8; 32]) -> (f32, [i32; 2]) {
        // SAFETY: four loads of 8 floats inside `x`'s 32, one store of 32 bytes into `q`.
        unsafe {
            let v = [
                _mm256_loadu_ps(x.as_ptr()),
                _mm256_loadu_ps(x.as_ptr().add(8)),
                _mm256_loadu_ps(x.as_ptr().add(16)),
                _mm256_loadu_ps(x.as_ptr().add(24)),
            ];
            let m = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
            let n = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
            // max |x| = max(max x, -min x).
            let m = _mm256_max_ps(m, _mm256_sub_ps(_mm256_setzero_ps(), n));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_movehdup_ps(m));
            let (d, id) = super::scale(_mm_cvtss_f32(m));
            let idv = _mm256_set1_ps(id);
            let i = [
                _mm256_cvtps_epi32(_mm256_mul_ps(v[0], idv)),
                _mm256_cvtps_epi32(_mm256_mul_ps(v[1], idv)),
                _mm256_cvtps_epi32(_mm256_mul_ps(v[2], idv)),
                _mm256_cvtps_epi32(_mm256_mul_ps(v[3], idv)),
            ];
            let sums = [hsum(_mm256_add_epi32(i[0], i[1])), hsum(_mm256_add_epi32(i[2], i[3]))];
            // Packing interleaves the 128-bit lanes; the permutation puts the bytes back in order.
            let p16 = [_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])];
            let p8 = _mm256_packs_epi16(p16[0], p16[1]);
            let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, p8);
            (d, sums)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }
}
