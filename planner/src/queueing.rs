//! Queueing formulas, as plain functions of numbers (no cost model, no configuration).
//!
//! - Erlang C (probability that an arrival waits in M/M/c), by the numerically stable Erlang B
//!   recursion, for all server counts at once in O(c).
//! - The waiting-time quantile of M/G/c by the Allen–Cunneen approximation: the M/M/c tail
//!   `P(W > t) = C * exp(-(c - a) t / S)` with its rate divided by `(ca^2 + cs^2) / 2`, arrivals
//!   Poisson (`ca^2 = 1`).
//! - An upper quantile of a Poisson count (Cornish–Fisher, continuous in the mean).
//! - The least fixed point of a non-decreasing map (continuous-batching sizes).

/// Quantile of the standard normal distribution (Acklam's rational approximation, relative
/// error below 1.2e-9). `p` is clamped into (0, 1).
pub(crate) fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] =
        [7.784_695_709_041_462e-3, 3.224_671_290_700_398e-1, 2.445_134_137_142_996, 3.754_408_661_907_416];
    let p = p.clamp(1e-12, 1.0 - 1e-12);
    let low = 0.02425;
    if p < low {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - low {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -normal_quantile(1.0 - p)
    }
}

/// Erlang C for every server count `c` in `0..=c_max` at offered load `a` (erlangs). Entries
/// with `a >= c` (unstable) are 1.
pub(crate) fn erlang_c_table(a: f64, c_max: u32) -> Vec<f64> {
    let mut out = Vec::with_capacity(c_max as usize + 1);
    out.push(1.0);
    let mut b = 1.0; // Erlang B with 0 servers
    for c in 1..=c_max {
        let k = f64::from(c);
        b = a * b / (k + a * b);
        let rho = a / k;
        out.push(if rho >= 1.0 { 1.0 } else { b / (1.0 - rho * (1.0 - b)) });
    }
    out
}

/// Erlang C for `c` servers at offered load `a`.
pub(crate) fn erlang_c(c: u32, a: f64) -> f64 {
    erlang_c_table(a, c)[c as usize]
}

/// Queue wait (seconds) at quantile `q` in M/G/c with offered load `a = lambda * s_mean`,
/// probability of waiting `erlang_c`, mean service `s_mean` and squared coefficient of
/// variation of service `cs2`. Infinite when `a >= c`; 0 when fewer than `1 - q` of arrivals wait.
pub(crate) fn wait_quantile(c: u32, a: f64, erlang_c: f64, s_mean: f64, cs2: f64, q: f64) -> f64 {
    let c = f64::from(c);
    if c <= 0.0 || a >= c {
        return f64::INFINITY;
    }
    let tail = 1.0 - q;
    if erlang_c <= tail {
        return 0.0;
    }
    (erlang_c / tail).ln() * (1.0 + cs2) / 2.0 * s_mean / (c - a)
}

/// Upper quantile (standard normal score `z`) of a Poisson count with mean `mu`: the
/// Cornish–Fisher expansion `mu + z sqrt(mu) + (z^2 - 1) / 6`, floored at 0. Continuous in `mu`
/// so that predictions move smoothly with load.
pub(crate) fn poisson_upper(mu: f64, z: f64) -> f64 {
    if mu <= 0.0 {
        return 0.0;
    }
    (mu + z * mu.sqrt() + (z * z - 1.0) / 6.0).max(0.0)
}

/// Quantile `q` of a Poisson count with mean `mu`, the inverse CDF interpolated linearly
/// between the integers (`n - 1 + (q - F(n - 1)) / p(n)` for `F(n - 1) < q <= F(n)`): exact at
/// every integer's CDF, continuous and non-decreasing in `q` and `mu`, and 0 for `q <= e^-mu`.
///
/// For the few prompts that overlap one colocated sequence's life (means well under 1 at the
/// loads that matter), the count is mostly 0: `e^-0.5` = 61% of sequences see no prefill at
/// all, which the Cornish–Fisher form ([`poisson_upper`], 0.33 at the median) cannot say; it
/// made colocated nodes look a prefill chunk slower at every quantile than they run. Above a
/// mean of [`POISSON_EXACT_MAX`] the normal-based form is used (close there, and no long sum).
pub(crate) fn poisson_quantile(mu: f64, q: f64) -> f64 {
    if mu <= 0.0 || q <= 0.0 {
        return 0.0;
    }
    if mu > POISSON_EXACT_MAX || q >= 1.0 {
        return poisson_upper(mu, normal_quantile(q.min(1.0 - 1e-9)));
    }
    let mut pmf = (-mu).exp();
    let mut cdf = pmf;
    if q <= cdf {
        return 0.0;
    }
    let mut n = 0.0;
    // F(n) reaches any q < 1 well before mu + 40 sqrt(mu) + 40 terms for mu <= 50.
    while cdf < q && n < mu + 40.0 * mu.sqrt() + 40.0 {
        n += 1.0;
        pmf *= mu / n;
        let prev = cdf;
        cdf += pmf;
        if q <= cdf {
            return n - 1.0 + (q - prev) / pmf;
        }
    }
    n
}

/// Largest mean for which [`poisson_quantile`] sums the distribution.
pub(crate) const POISSON_EXACT_MAX: f64 = 50.0;

/// The least fixed point `x = g(x)` in `[0, limit]` of a non-decreasing `g` with `g(0) >= 0`,
/// or `None` when there is none there (the pool diverges) or `g` answers something infinite.
///
/// A few rounds of fixed-point iteration from 0 (which climbs monotonically toward the least
/// fixed point) are followed by bracketing (doubling) and Illinois regula falsi on
/// `g(x) - x`: plain iteration crawls near saturation, where `g' -> 1`, and bisection costs
/// ~15 evaluations where the secant needs 2-4 (exact at once for a linear `g`). Returns a
/// point with `g(x) <= x` (up to the tolerance), so the size is never under-estimated. For a
/// convex or linear `g` (step costs linear or convex in batch) the bracketed root is the least.
pub(crate) fn least_fixed_point(mut g: impl FnMut(f64) -> f64, limit: f64) -> Option<f64> {
    let tol = |x: f64| 1e-4 * x.max(1e-2);
    let mut x = 0.0;
    for _ in 0..3 {
        let nx = g(x);
        if !nx.is_finite() || nx > limit {
            return None;
        }
        if nx - x <= tol(nx) {
            return Some(nx);
        }
        x = nx;
    }
    // g(x) >= x here: g is non-decreasing and the iterates rose.
    let (mut lo, mut h_lo) = (x, g(x) - x);
    let mut hi = (2.0 * x).max(1.0).min(limit);
    let mut h_hi;
    loop {
        h_hi = g(hi) - hi;
        if h_hi <= 0.0 {
            break;
        }
        if hi >= limit {
            return None;
        }
        (lo, h_lo) = (hi, h_hi);
        hi = (2.0 * hi).min(limit);
    }
    let mut last = 0i8;
    for _ in 0..64 {
        if hi - lo <= tol(hi) {
            break;
        }
        let mut m = (lo * h_hi - hi * h_lo) / (h_hi - h_lo);
        if !(m > lo && m < hi) {
            m = 0.5 * (lo + hi);
        }
        let h = g(m) - m;
        if h.abs() <= tol(m) {
            return Some(m + h.max(0.0));
        }
        if h < 0.0 {
            (hi, h_hi) = (m, h);
            if last == -1 {
                h_lo /= 2.0;
            }
            last = -1;
        } else {
            (lo, h_lo) = (m, h);
            if last == 1 {
                h_hi /= 2.0;
            }
            last = 1;
        }
    }
    Some(hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_quantile_is_exact_at_the_integers_and_continuous() {
        let mu: f64 = 0.5;
        let f0 = (-mu).exp();
        let f1 = f0 * (1.0 + mu);
        assert_eq!(poisson_quantile(mu, 0.5), 0.0, "the median of Poisson(0.5) is 0");
        assert_eq!(poisson_quantile(mu, f0), 0.0);
        assert!((poisson_quantile(mu, f1) - 1.0).abs() < 1e-12);
        assert!((poisson_quantile(mu, 0.5 * (f0 + f1)) - 0.5).abs() < 1e-12);
        // Non-decreasing in q and mu; near the normal form for a large mean.
        let mut last = 0.0;
        for i in 1..100 {
            let x = poisson_quantile(3.0, f64::from(i) / 100.0);
            assert!(x >= last, "{x} < {last}");
            last = x;
        }
        assert!(poisson_quantile(2.0, 0.9) > poisson_quantile(1.9, 0.9));
        let (exact, cf) = (poisson_quantile(49.0, 0.9), poisson_upper(49.0, normal_quantile(0.9)));
        assert!((exact - cf).abs() < 1.0, "{exact} vs {cf}");
        assert_eq!(poisson_quantile(0.0, 0.9), 0.0);
    }

    #[test]
    fn normal_quantile_known_values() {
        assert!((normal_quantile(0.9) - 1.281_551_565_5).abs() < 1e-8);
        assert!((normal_quantile(0.5)).abs() < 1e-12);
        assert!((normal_quantile(0.01) + 2.326_347_874).abs() < 1e-8);
        assert!((normal_quantile(0.99) - 2.326_347_874).abs() < 1e-8);
    }

    #[test]
    fn erlang_c_known_values() {
        // Two servers at one erlang: C = 1/3. One server: C = rho.
        assert!((erlang_c(2, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        assert!((erlang_c(1, 0.7) - 0.7).abs() < 1e-12);
        assert_eq!(erlang_c(2, 2.5), 1.0);
        let t = erlang_c_table(5.0, 20);
        assert!(t.windows(2).skip(5).all(|w| w[1] <= w[0]), "more servers wait less");
    }

    #[test]
    fn mm1_wait_quantile_matches_the_exponential_tail() {
        // M/M/1, rho = 0.8, S = 1: P(W > t) = 0.8 e^{-0.2 t}; p90 at ln(8) / 0.2.
        let w = wait_quantile(1, 0.8, 0.8, 1.0, 1.0, 0.9);
        assert!((w - 8f64.ln() / 0.2).abs() < 1e-9);
        assert_eq!(wait_quantile(1, 0.05, 0.05, 1.0, 1.0, 0.9), 0.0);
        assert!(wait_quantile(2, 2.0, 1.0, 1.0, 1.0, 0.9).is_infinite());
    }

    #[test]
    fn least_fixed_point_of_a_linear_map_and_divergence() {
        // x = 3 + 0.95 x -> 60 (slow for plain iteration).
        let mut calls = 0;
        let x = least_fixed_point(
            |x| {
                calls += 1;
                3.0 + 0.95 * x
            },
            1e6,
        )
        .unwrap();
        assert!((x - 60.0).abs() < 0.01 && x >= 60.0 - 0.006, "{x}");
        assert!(calls <= 12, "{calls} evaluations");
        // Convex, with an infinite region past saturation.
        let g = |x: f64| if x >= 90.0 { f64::INFINITY } else { 2.0 + x * x / 100.0 };
        let x = least_fixed_point(g, 1e6).unwrap();
        let root = 50.0 - (2500.0f64 - 200.0).sqrt();
        assert!((x - root).abs() < 1e-3 * root, "{x} vs {root}");
        assert_eq!(least_fixed_point(|x| 1.0 + x, 1e6), None);
        assert_eq!(least_fixed_point(|x| 3.0 + 0.95 * x, 50.0), None);
    }
}
