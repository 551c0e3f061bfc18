//! Branch-light numeric passes over a vocabulary-sized slice, written so that the compiler
//! vectorises them (fixed-width lane arrays, no early exits in the hot loops), each compiled for
//! AVX-512F, AVX2 and the baseline and dispatched at run time by `multiversion!`. LLVM's
//! vectoriser is fragile here: a pairwise lane reduction after a loop, or a kernel inlined into
//! a caller with known trip counts, turned 16-wide loops into 2-wide ones, hence the plain sums
//! and the out-of-line copies. Check `objdump` for `zmm`/`ymm` after touching a kernel.
//!
//! Invariant: every function here takes *sanitized* values (see [`sanitize`]) unless its doc says
//! otherwise, so no NaN reaches a comparison and no `+inf` reaches `x - max`.

/// Elements per chunk of [`exp_weights`]; per-chunk sums and maxima let later passes skip whole
/// chunks.
pub(super) const CHUNK: usize = 256;

/// Lane count of the reductions: 16 f32 lanes keep several vector registers in flight at every
/// width. Results depend on this constant (summation order) but not on the instruction set.
const LANES: usize = 16;

/// Defines `$name` as a dispatcher over copies of one body compiled for AVX-512F, AVX2 and the
/// baseline, picked at run time (the detection is cached by std), and `$portable` as the
/// baseline copy for tests. No fast-math is involved, so every copy computes bit-identical
/// results: the choice of instruction set never changes a sampled token.
macro_rules! multiversion {
    ($(#[$meta:meta])* fn $name:ident / $portable:ident ($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
            // Every copy is out of line, so that LLVM vectorises it on its own rather than after
            // inlining it into a caller with known trip counts (which it does badly).
            #[cfg(target_arch = "x86_64")]
            {
                #[inline(never)]
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) $(-> $ret)? { $portable($($arg),*) }
                #[inline(never)]
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) $(-> $ret)? { $portable($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports AVX-512F, checked just above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            #[inline(never)]
            fn baseline($($arg: $ty),*) $(-> $ret)? { $portable($($arg),*) }
            baseline($($arg),*)
        }

        /// The baseline copy of the function above (always inlined into its dispatched copies).
        #[inline(always)]
        pub(super) fn $portable($($arg: $ty),*) $(-> $ret)? $body
    };
}

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

multiversion! {
    /// Largest element, `-inf` for an empty slice. Accepts unsanitized input: NaN never
    /// compares greater, so it is ignored.
    fn max / max_portable(xs: &[f32]) -> f32 {
        max_lanes(xs)
    }
}

#[inline(always)]
fn max_lanes(xs: &[f32]) -> f32 {
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
    lanes.into_iter().fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
}

multiversion! {
    /// Index of the largest element after [`sanitize`], the lowest index on ties; 0 when every
    /// element is NaN or `-inf`, and 0 for an empty slice. Accepts unsanitized input.
    fn argmax / argmax_portable(xs: &[f32]) -> usize {
        let m = max_lanes(xs);
        if m == f32::NEG_INFINITY {
            return 0;
        }
        // A vectorised "contains" per chunk, then a short scalar search in the first hit.
        for (ci, c) in xs.chunks(CHUNK).enumerate() {
            if c.iter().fold(false, |hit, &x| hit | (x == m)) {
                return ci * CHUNK + c.iter().position(|&x| x == m).unwrap_or(0);
            }
        }
        0
    }
}

multiversion! {
    /// Overwrites `out` with `sanitize(sanitize(x) * scale)` for each logit `x`.
    fn scaled_into / scaled_into_portable(out: &mut Vec<f32>, xs: &[f32], scale: f32) {
        out.clear();
        out.extend(xs.iter().map(|&x| sanitize(sanitize(x) * scale)));
    }
}

multiversion! {
    /// Sum in f64 of non-negative weights given as their bit patterns.
    fn sum_bits / sum_bits_portable(ws: &[u32]) -> f64 {
        let mut lanes = [0.0f64; LANES];
        let mut it = ws.chunks_exact(LANES);
        for c in &mut it {
            for j in 0..LANES {
                lanes[j] += f64::from(f32::from_bits(c[j]));
            }
        }
        let rest: f64 = it.remainder().iter().map(|&b| f64::from(f32::from_bits(b))).sum();
        lanes.iter().sum::<f64>() + rest
    }
}

/// Sum of (up to a chunk of) f32 values in [`LANES`] f32 lanes.
#[inline(always)]
fn sum_lanes(xs: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut it = xs.chunks_exact(LANES);
    for c in &mut it {
        for j in 0..LANES {
            lanes[j] += c[j];
        }
    }
    // A plain sequential sum: a pairwise tree here stops LLVM from vectorising the loop above.
    lanes.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

multiversion! {
    /// Sum of the elements `>= tau` of a chunk.
    fn mass_at_least / mass_at_least_portable(xs: &[f32], tau: f32) -> f32 {
        let mut mass = [0.0f32; LANES];
        let mut it = xs.chunks_exact(LANES);
        for c in &mut it {
            for j in 0..LANES {
                mass[j] += if c[j] >= tau { c[j] } else { 0.0 };
            }
        }
        // Plain sums: a pairwise tree here stops LLVM from vectorising the loop above.
        mass.iter().sum::<f32>() + it.remainder().iter().filter(|&&x| x >= tau).sum::<f32>()
    }
}

/// Thresholds evaluated per [`ladder`] pass.
pub(super) const RUNGS: usize = 8;

/// For each threshold `taus[r]`, the total of the `weights >= taus[r]`; chunks whose maximum
/// (`chunk_max`) is below every threshold are skipped unread.
pub(super) fn ladder(weights: &[f32], chunk_max: &[f32], taus: &[f32; RUNGS]) -> [f64; RUNGS] {
    let floor = taus.iter().fold(f32::INFINITY, |a, &b| a.min(b));
    let mut mass = [0.0f64; RUNGS];
    for (chunk, &max) in weights.chunks(CHUNK).zip(chunk_max) {
        if max < floor {
            continue;
        }
        for r in 0..RUNGS {
            if max >= taus[r] {
                mass[r] += f64::from(mass_at_least(chunk, taus[r]));
            }
        }
    }
    mass
}

/// Per chunk, the total of the `weights >= theta` into `out` (0 for a chunk whose maximum is
/// below `theta`); returns the sequential f64 sum of `out`.
pub(super) fn masked_chunk_sums(weights: &[f32], chunk_max: &[f32], theta: f32, out: &mut Vec<f64>) -> f64 {
    out.clear();
    let mut total = 0.0f64;
    for (chunk, &max) in weights.chunks(CHUNK).zip(chunk_max) {
        let s = if max < theta { 0.0 } else { f64::from(mass_at_least(chunk, theta)) };
        out.push(s);
        total += s;
    }
    total
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
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1)
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

multiversion! {
    /// Replaces each `xs[i]` (sanitized, `<= m`) by its unnormalised probability
    /// `e^(xs[i] - m)`, writes the sum of every [`CHUNK`] elements into `chunk_sums` and returns
    /// their total. The total is the sequential f64 sum of `chunk_sums`, so a walk over
    /// `chunk_sums` reaches it exactly. Each chunk sum is at least the largest weight in its
    /// chunk (rounding is monotone).
    fn exp_weights / exp_weights_portable(xs: &mut [f32], m: f32, chunk_sums: &mut Vec<f64>) -> f64 {
        chunk_sums.clear();
        let mut total = 0.0f64;
        for chunk in xs.chunks_mut(CHUNK) {
            // Two simple loops rather than one fused one: LLVM vectorises these, not the fusion.
            for x in chunk.iter_mut() {
                *x = exp_nonpos(*x - m);
            }
            let s = f64::from(sum_lanes(chunk));
            chunk_sums.push(s);
            total += s;
        }
        total
    }
}

multiversion! {
    /// `sum_i e^(sanitize(xs[i]) - m)` without writing anything; `m` is the sanitized maximum.
    /// Accepts unsanitized input.
    fn sum_exp / sum_exp_portable(xs: &[f32], m: f32) -> f64 {
        let mut buf = [0.0f32; CHUNK];
        let mut total = 0.0f64;
        for chunk in xs.chunks(CHUNK) {
            let buf = &mut buf[..chunk.len()];
            for (b, &x) in buf.iter_mut().zip(chunk) {
                *b = exp_nonpos(sanitize(x) - m);
            }
            total += f64::from(sum_lanes(buf));
        }
        total
    }
}

multiversion! {
    /// The largest element of each [`CHUNK`] of `xs` into `out` (for skipping chunks).
    /// Accepts unsanitized input (NaN ignored).
    fn chunk_maxima / chunk_maxima_portable(xs: &[f32], out: &mut Vec<f32>) {
        out.clear();
        out.extend(xs.chunks(CHUNK).map(max_lanes));
    }
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
        let mut portable = xs.clone();
        let mut portable_sums = Vec::new();
        let portable_total = exp_weights_portable(&mut portable, 0.0, &mut portable_sums);
        let mut sums = Vec::new();
        let total = exp_weights(&mut xs, 0.0, &mut sums);
        assert_eq!(sums.len(), 1000usize.div_ceil(CHUNK));
        assert!((total - want).abs() / want < 1e-6);
        assert_eq!(xs[5], 0.0);
        assert_eq!(total, sums.iter().sum::<f64>());
        // The dispatched copy (AVX-512 or AVX2 here) is bit-identical to the baseline one.
        assert_eq!(total.to_bits(), portable_total.to_bits());
        assert_eq!(sums, portable_sums);
        assert!(xs.iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
