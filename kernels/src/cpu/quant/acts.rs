//! Activations quantized to 8 bits for the integer dot kernels, with one scale per four values:
//! for each group of four, `d = max|x| / 127` and `q = round(x / d)` (ties to even; `|q| <=
//! 127`); for each half of a 32-value block, `s = Σ d · q`, the sum that multiplies a weight
//! group's offset.
//!
//! Four values is the width of one `i32` lane of the kernels' byte dot products (`maddubs` +
//! `madd`, or `vpdpbusd`), so a scale per lane costs them nothing: they load a vector of eight
//! scales per 32 values where a scale per 32 would be broadcast. It bounds the damage of the
//! outlier channels that LLM activations have (a few values 100x the rest): an outlier coarsens
//! only its own group of four, not the 31 values of a block beside it. llama.cpp's Q8_0/Q8_1
//! activations have one scale per 32; on SmolLM2, with every product on the integer path, that
//! moved a chat's first-token log-probs by up to 0.27 nats, one scale per four by 0.001-0.11
//! (BENCHMARKS.md, "Quantized weights").
//!
//! Accuracy: the rounding moves each activation by at most `d / 2`, so a dot product with weights
//! `w` moves by at most `Σ_groups d / 2 · Σ_group |w|`: a relative error of at most `1 / 254` of
//! `Σ max_group|x| · |w|`, and the errors are independent and centred, so they average out over
//! a row.
//!
//! The portable and AVX2 paths compute the same `d`, the same `1 / d`, the same product and the
//! same rounding, and the sums in scalar code, so they produce identical bytes.

use super::QuantIsa;

/// `m` rows of `k` activations, quantized (see the module docs). Reused between calls.
#[derive(Default)]
pub(crate) struct QActs {
    pub k: usize,
    /// `[rows, k]` quants.
    pub q: Vec<i8>,
    /// `[rows, k / 4]` scales, one per four values (the kernels' lanes).
    pub d: Vec<f32>,
    /// `[rows, k / 16]` half-block sums `Σ d · q`.
    pub s: Vec<f32>,
    /// `[rows, k / 32]` block sums (the two halves added).
    pub s32: Vec<f32>,
}

impl QActs {
    /// Quantizes `x: [m, k]`, `k` a multiple of 32.
    ///
    /// # Panics
    /// If `k` is not a multiple of 32 or `x` is shorter than `m * k`.
    pub fn quantize(&mut self, isa: QuantIsa, x: &[f32], m: usize, k: usize) {
        assert!(k.is_multiple_of(32) && x.len() >= m * k);
        self.k = k;
        self.q.resize(m * k, 0);
        self.d.resize(m * k / 4, 0.0);
        self.s.resize(m * k / 16, 0.0);
        self.s32.resize(m * k / 32, 0.0);
        let blocks = x[..m * k].chunks_exact(32).zip(self.q.chunks_exact_mut(32)).zip(self.d.chunks_exact_mut(8));
        for (o, ((x, q), d)) in blocks.enumerate() {
            let x: &[f32; 32] = x.try_into().expect("32");
            let q: &mut [i8; 32] = q.try_into().expect("32");
            let d: &mut [f32; 8] = d.try_into().expect("8");
            match isa {
                // SAFETY: a non-portable `QuantIsa` is only chosen when AVX2 is present.
                #[cfg(target_arch = "x86_64")]
                QuantIsa::Avx2 | QuantIsa::Avx512Bw | QuantIsa::Avx512Vnni => unsafe { avx2::block(x, q, d) },
                _ => block(x, q, d),
            }
            let half = |h: usize| (4 * h..4 * h + 4).map(|g| d[g] * group_sum(q, g)).sum::<f32>();
            let (s0, s1) = (half(0), half(1));
            self.s[2 * o] = s0;
            self.s[2 * o + 1] = s1;
            self.s32[o] = s0 + s1;
        }
    }

    /// Row `r`'s quants, scales, half-block sums and block sums.
    pub fn row(&self, r: usize) -> ActRow<'_> {
        let k = self.k;
        ActRow {
            q: &self.q[r * k..(r + 1) * k],
            d: &self.d[r * k / 4..(r + 1) * k / 4],
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

/// `Σ q` over group `g` (four values) of a block, as f32 (exact).
fn group_sum(q: &[i8; 32], g: usize) -> f32 {
    q[4 * g..4 * g + 4].iter().map(|&v| i32::from(v)).sum::<i32>() as f32
}

/// `d` and `1 / d` of a group whose largest magnitude is `amax` (both 0 for an all-zero group).
fn scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// One block of 32: the quants and the scale of each group of four.
fn block(x: &[f32; 32], q: &mut [i8; 32], d: &mut [f32; 8]) {
    for (g, (x, q)) in x.chunks_exact(4).zip(q.chunks_exact_mut(4)).enumerate() {
        let (dg, id) = scale(x.iter().fold(0f32, |a, v| a.max(v.abs())));
        d[g] = dg;
        for (q, &v) in q.iter_mut().zip(x) {
            *q = (v * id).round_ties_even() as i32 as i8;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::block`] with AVX2: the same IEEE divisions and products, and `cvtps2dq` rounds to
    /// nearest even as `round_ties_even` does.
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block(x: &[f32; 32], q: &mut [i8; 32], d: &mut [f32; 8]) {
        let mut i = [_mm256_setzero_si256(); 4];
        let mut scales = [0f32; 32];
        // SAFETY: loads of 8 floats inside `x`'s 32 and stores inside `scales`' 32; one store of
        // 32 bytes into `q`.
        unsafe {
            for (c, i) in i.iter_mut().enumerate() {
                let v = _mm256_loadu_ps(x.as_ptr().add(8 * c));
                let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
                // The maximum of each group of four, in each of its lanes.
                let a = _mm256_max_ps(a, _mm256_permute_ps::<0b10_11_00_01>(a));
                let a = _mm256_max_ps(a, _mm256_permute_ps::<0b01_00_11_10>(a));
                let dv = _mm256_div_ps(a, _mm256_set1_ps(127.0));
                let inv = _mm256_div_ps(_mm256_set1_ps(1.0), dv);
                let id = _mm256_and_ps(inv, _mm256_cmp_ps::<_CMP_GT_OQ>(dv, _mm256_setzero_ps()));
                *i = _mm256_cvtps_epi32(_mm256_mul_ps(v, id));
                _mm256_storeu_ps(scales.as_mut_ptr().add(8 * c), dv);
            }
            // Packing interleaves the 128-bit lanes; the permutation puts the bytes back in order.
            let p16 = [_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])];
            let p8 = _mm256_packs_epi16(p16[0], p16[1]);
            let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, p8);
        }
        for (g, d) in d.iter_mut().enumerate() {
            *d = scales[4 * g];
        }
    }
}
