//! Branch-light numeric passes over a vocabulary-sized slice, written so that the compiler
//! vectorises them (fixed-width lane arrays, no early exits in the hot loops).
//!
//! Invariant: every function here takes *sanitized* values (see [`sanitize`]) unless its doc says
//! otherwise, so no NaN reaches a comparison and no `+inf` reaches `x - max`.

/// Elements per chunk of [`exp_weights`]; the per-chunk sums let later passes skip whole chunks.
pub(super) const CHUNK: usize = 64;

/// Lane count of the reductions (8 f32 = one AVX register, two SSE registers).
const LANES: usize = 8;

/// Maps a model logit onto the values the sampler works with: NaN becomes `-inf` (the token can
/// never be chosen), `+inf` becomes `f32::MAX` (so that `x - max` stays finite), anything else is
/// unchanged.
#[inline(always)]
pub(super) fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else if x > f32::MAX {
        f32::MAX
    } else {
        x
    }
}

/// Largest element, `-inf` for an empty slice. Accepts unsanitized input: NaN never compares
/// greater, so it is ignored.
pub(super) fn max(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            if c[j] > lanes[j] {
                lanes[j] = c[j];
            }
        }
    }
    for &x in chunks.remainder() {
        if x > lanes[0] {
            lanes[0] = x;
        }
    }
    lanes
        .into_iter()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
}

/// Index of the largest element after [`sanitize`], the lowest index on ties; 0 when every
/// element is NaN or `-inf`, and 0 for an empty slice. Accepts unsanitized input.
pub(super) fn argmax(xs: &[f32]) -> usize {
    let m = sanitize(max(xs));
    xs.iter().position(|&x| sanitize(x) == m).unwrap_or(0)
}

/// `e^x` for `x <= 0` (a logit minus the maximum), with a relative error below 3e-7 on
/// `[-87, 0]`; exactly 1 at 0 and exactly 0 below -87 (including `-inf`). Cephes' `expf`
/// range reduction and polynomial, with the rounding and the `2^n` scale done by bit tricks so
/// that the loop around it vectorises.
#[inline(always)]
pub(super) fn exp_nonpos(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer that then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x < -87.0 { -87.0 } else { x };
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r * r + r + 1.0;
    // n_int is in [-126, 0] here, so the biased exponent is a normal one.
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        e * scale
    }
}

/// Replaces each `xs[i]` (sanitized, `<= m`) by its unnormalised probability `e^(xs[i] - m)`,
/// writes the sum of every [`CHUNK`] elements into `chunk_sums` and returns their total. The
/// total is the sequential f64 sum of `chunk_sums`, so a walk over `chunk_sums` reaches it
/// exactly. Each chunk sum is at least the largest weight in its chunk (rounding is monotone).
pub(super) fn exp_weights(xs: &mut [f32], m: f32, chunk_sums: &mut Vec<f64>) -> f64 {
    chunk_sums.clear();
    let mut total = 0.0f64;
    for chunk in xs.chunks_mut(CHUNK) {
        let mut lanes = [0.0f32; LANES];
        let mut it = chunk.chunks_exact_mut(LANES);
        for c in &mut it {
            for j in 0..LANES {
                let e = exp_nonpos(c[j] - m);
                c[j] = e;
                lanes[j] += e;
            }
        }
        let mut s: f32 = lanes.iter().sum();
        for x in it.into_remainder() {
            let e = exp_nonpos(*x - m);
            *x = e;
            s += e;
        }
        chunk_sums.push(f64::from(s));
        total += f64::from(s);
    }
    total
}

/// `sum_i e^(sanitize(xs[i]) - m)` without writing anything; `m` is the sanitized maximum.
/// Accepts unsanitized input.
pub(super) fn sum_exp(xs: &[f32], m: f32) -> f64 {
    let mut total = 0.0f64;
    for chunk in xs.chunks(CHUNK) {
        let mut lanes = [0.0f32; LANES];
        let mut it = chunk.chunks_exact(LANES);
        for c in &mut it {
            for j in 0..LANES {
                lanes[j] += exp_nonpos(sanitize(c[j]) - m);
            }
        }
        let mut s: f32 = lanes.iter().sum();
        for &x in it.remainder() {
            s += exp_nonpos(sanitize(x) - m);
        }
        total += f64::from(s);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_nonpos_matches_std_exp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpos(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_3;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-87.5), 0.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn argmax_takes_lowest_index_and_ignores_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[1.0, f32::INFINITY, f32::MAX]), 1);
        assert_eq!(argmax(&[]), 0);
        // Longer than a lane group, maximum in the remainder.
        let mut v = vec![0.5f32; 19];
        v[18] = 0.6;
        assert_eq!(argmax(&v), 18);
    }

    #[test]
    fn exp_weights_chunk_sums_add_up() {
        let mut xs: Vec<f32> = (0..1000).map(|i| -((i % 37) as f32) * 0.25).collect();
        xs[5] = f32::NEG_INFINITY;
        let want: f64 = xs.iter().map(|&x| f64::from(x).exp()).sum();
        let mut sums = Vec::new();
        let total = exp_weights(&mut xs, 0.0, &mut sums);
        assert_eq!(sums.len(), 1000usize.div_ceil(CHUNK));
        assert!((total - want).abs() / want < 1e-6);
        assert_eq!(xs[5], 0.0);
        assert_eq!(total, sums.iter().sum::<f64>());
    }
}
