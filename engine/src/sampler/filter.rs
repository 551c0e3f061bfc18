//! Truncation (top-k, top-p, min-p) and the draw, over unnormalised weights `w_i = e^(s_i - max)`
//! where `s` are the penalised, temperature-scaled logits. The largest weight is exactly 1.
//!
//! Every filter keeps a *top set*: all tokens whose weight is at least some threshold. So the
//! surviving set is `{i : w_i >= theta}` with `theta` the largest of the filters' thresholds, and
//! no filter needs the vocabulary sorted:
//! - top-k: `theta_k` is the k-th largest weight (ties with it are kept, as in HF and vLLM, so
//!   more than k tokens can survive on exact ties);
//! - top-p: `theta_p` is the weight at which the descending cumulative mass first reaches
//!   `top_p` of the (top-k renormalised) total (ties kept);
//! - min-p: `theta_min = min_p`, i.e. `p_i >= min_p * p_max`.
//!
//! Applying them in HF's order (top-k, then top-p on the renormalised top-k set, then min-p)
//! gives the same set as the largest threshold, because min-p's ratio is invariant under
//! renormalisation and top-p's target is computed on the top-k mass.
//!
//! How the thresholds are found without sorting the vocabulary:
//! - top-k visits chunks by decreasing maximum: the first chunks give a provisional k-th
//!   weight, then only chunks whose maximum reaches it are read, and a quickselect over the
//!   collected weights gives the exact `theta_k` (and the top-k mass for top-p);
//! - top-p alone: a *ladder* pass sums the weights above 8 thresholds at once (vectorised),
//!   which brackets `theta_p`; up to two more passes subdivide the bracket (4 octaves, then 1/2,
//!   then 1/16 of an octave), skipping chunks whose maximum lies below it. Only the weights in
//!   the final bracket are collected, and a weighted quickselect among them gives `theta_p`.
//!
//! The draw then walks per-chunk sums of the surviving weights, so even a nucleus of 100k
//! tokens is never listed.

use std::cmp::Reverse;

use super::math::{ladder, sum_bits, CHUNK, RUNGS};

/// Weights are never below this unless they are 0 (see `exp_nonpos`); the bottom of every
/// bracket.
const BOTTOM: f32 = f32::MIN_POSITIVE;

/// Stop refining a bracket once it provably holds at most this many weights.
const SMALL_BRACKET: f64 = 2048.0;

/// The truncation filters of one request, with disabled ones as `None`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Filters {
    /// In `1..vocab`; `top_k >= vocab` keeps everything and is stored as `None`.
    pub top_k: Option<usize>,
    /// In `(0, 1)`.
    pub top_p: Option<f64>,
    /// In `(0, 1]`.
    pub min_p: Option<f32>,
}

impl Filters {
    /// Reads the filters from validated parameters. Out-of-range values do not panic: a
    /// `top_p <= 0` keeps only the most likely token(s), `min_p > 1` acts as 1, NaN disables.
    pub fn new(top_k: u32, top_p: f32, min_p: f32, vocab: usize) -> Self {
        let top_k = usize::try_from(top_k).ok().filter(|&k| k > 0 && k < vocab);
        let top_p = (top_p < 1.0).then(|| f64::from(top_p).max(f64::from(f32::MIN_POSITIVE)));
        let min_p = (min_p > 0.0).then(|| min_p.min(1.0));
        Self { top_k, top_p, min_p }
    }

    pub fn any(&self) -> bool {
        self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some()
    }
}

/// The weights of one step with their per-[`CHUNK`] summaries.
#[derive(Debug, Clone, Copy)]
pub(super) struct Weights<'a> {
    pub w: &'a [f32],
    /// Largest weight of each chunk.
    pub chunk_max: &'a [f32],
    /// Sum of all weights.
    pub total: f64,
}

impl Weights<'_> {
    fn chunks(&self) -> impl Iterator<Item = (&[f32], f32)> + '_ {
        self.w.chunks(CHUNK).zip(self.chunk_max.iter().copied())
    }
}

/// Scratch of [`threshold`].
#[derive(Debug, Default)]
pub(super) struct ThresholdScratch {
    /// Weights as bit patterns (non-negative floats order like their bits).
    sel: Vec<u32>,
    /// Chunk visiting order for top-k.
    order: Vec<u64>,
}

/// The threshold `theta` of the filters: the survivors are exactly the tokens with weight
/// `>= theta`, and 0-weight tokens are never drawn.
///
/// Precondition: the largest weight is exactly 1 (so `theta <= 1` and a survivor exists).
pub(super) fn threshold(wts: &Weights<'_>, f: &Filters, s: &mut ThresholdScratch) -> f32 {
    let theta = match (f.top_k, f.top_p) {
        (Some(k), top_p) => {
            let theta_k = top_k_set(wts, k, s);
            // `sel` now holds exactly the weights >= theta_k.
            match top_p {
                Some(p) => {
                    let target = p * sum_bits(&s.sel);
                    nucleus_threshold(&mut s.sel, target).map_or(theta_k, |t| t.max(theta_k))
                }
                None => theta_k,
            }
        }
        (None, Some(p)) => top_p_threshold(wts, p * wts.total, &mut s.sel),
        (None, None) => 0.0,
    };
    theta.max(f.min_p.unwrap_or(0.0))
}

/// Collects into `s.sel` every weight `>= theta_k` and returns `theta_k`, the k-th largest
/// weight ([`BOTTOM`] when fewer than k weights are positive: then all of them are kept).
fn top_k_set(wts: &Weights<'_>, k: usize, s: &mut ThresholdScratch) -> f32 {
    // Chunks by decreasing maximum (index as tie-break, so the order is deterministic).
    s.order.clear();
    s.order.extend(
        wts.chunk_max
            .iter()
            .enumerate()
            .filter(|&(_, &m)| m > 0.0)
            .map(|(i, &m)| (u64::from(m.to_bits()) << 32) | u64::from(u32::MAX - i as u32)),
    );
    s.order.sort_unstable_by_key(|&key| Reverse(key));
    let chunk = |key: u64| {
        let i = (u32::MAX - key as u32) as usize;
        &wts.w[i * CHUNK..((i + 1) * CHUNK).min(wts.w.len())]
    };
    let sel = &mut s.sel;
    sel.clear();
    // `floor` is the k-th largest weight seen so far, a lower bound of theta_k: lighter weights
    // are not collected, and once a chunk's maximum is below it, so are all later chunks'.
    let mut floor = 0u32;
    let mut prune_at = 2 * k + CHUNK;
    for &key in &s.order {
        if sel.len() >= k && ((key >> 32) as u32) < floor {
            break;
        }
        sel.extend(chunk(key).iter().map(|w| w.to_bits()).filter(|&b| b >= floor));
        if sel.len() >= prune_at {
            floor = kth_largest(sel, k);
            sel.retain(|&b| b >= floor);
            // Ties with the floor survive pruning; growing the trigger keeps this linear.
            prune_at = prune_at.max(2 * sel.len());
        }
    }
    if sel.len() < k {
        sel.retain(|&b| b > 0);
        return BOTTOM;
    }
    let kth = kth_largest(sel, k);
    sel.retain(|&b| b >= kth);
    f32::from_bits(kth)
}

/// The k-th largest of the bit patterns (reorders them). Precondition: `1 <= k <= len`.
fn kth_largest(bits: &mut [u32], k: usize) -> u32 {
    *bits.select_nth_unstable_by_key(k - 1, |&b| Reverse(b)).1
}

/// `theta_p` for top-p alone: the largest weight `t` such that the weights `>= t` reach
/// `target`. `sel` is scratch.
fn top_p_threshold(wts: &Weights<'_>, target: f64, sel: &mut Vec<u32>) -> f32 {
    let b = find_bracket(wts, target);
    collect(wts, b.lo, b.hi, sel);
    let rest = target - b.above_mass;
    if rest <= 0.0 {
        // Only through rounding: the weights above the bracket already reach the target.
        return b.hi;
    }
    nucleus_threshold(sel, rest).unwrap_or(b.lo)
}

/// `[lo, hi)` holds `theta_p`: the weights `>= lo` reach the target (or `lo` is [`BOTTOM`]),
/// those `>= hi` do not (or `hi` is infinite); `above_mass` is the mass of the weights `>= hi`.
#[derive(Debug, Clone, Copy)]
struct Bracket {
    lo: f32,
    hi: f32,
    above_mass: f64,
}

/// Narrows the bracket of `theta_p` with up to three ladder passes.
fn find_bracket(wts: &Weights<'_>, target: f64) -> Bracket {
    let mut b = Bracket { lo: BOTTOM, hi: f32::INFINITY, above_mass: 0.0 };
    // First pass: 1, 2^-4, ..., 2^-28; then each bracket is cut into RUNGS geometric steps.
    let mut taus: [f32; RUNGS] = std::array::from_fn(|r| (-4.0 * r as f32).exp2());
    let mut step_octaves = 4.0f32;
    for pass in 0..3 {
        let mass = ladder(wts.w, wts.chunk_max, &taus);
        match (0..RUNGS).find(|&r| mass[r] >= target) {
            Some(r) => {
                b.lo = taus[r];
                if r > 0 {
                    b.hi = taus[r - 1];
                    b.above_mass = mass[r - 1];
                }
                // Each weight in the bracket is >= lo, which bounds their number.
                let inside = mass[r] - b.above_mass;
                if b.hi == f32::INFINITY || inside <= SMALL_BRACKET * f64::from(b.lo) {
                    break;
                }
            }
            None => {
                // Below the last rung: [previous lo, last rung), no finer ladder there.
                b.hi = taus[RUNGS - 1];
                b.above_mass = mass[RUNGS - 1];
                if pass == 0 {
                    break;
                }
            }
        }
        step_octaves /= RUNGS as f32;
        let hi = b.hi;
        taus = std::array::from_fn(|r| hi * (-(r as f32 + 1.0) * step_octaves).exp2());
    }
    b
}

/// The bit patterns of the weights in `[lo, hi)` into `sel` (cleared first).
fn collect(wts: &Weights<'_>, lo: f32, hi: f32, sel: &mut Vec<u32>) {
    sel.clear();
    for (chunk, max) in wts.chunks() {
        if max < lo {
            continue;
        }
        // Branch-free compaction: hits are common and unpredictable inside a bracket.
        let start = sel.len();
        sel.resize(start + chunk.len(), 0);
        let out = &mut sel[start..];
        let mut n = 0;
        for &w in chunk {
            out[n] = w.to_bits();
            n += usize::from(w >= lo && w < hi);
        }
        sel.truncate(start + n);
    }
}

/// The weight at which the descending cumulative mass of `ws` first reaches `target`, found by a
/// weighted quickselect in expected O(len); `None` when the whole slice has less mass than
/// `target` (keep everything). Reorders `ws`. Precondition: `target > 0`.
///
/// Weights are non-negative floats passed as their bit patterns, which order the same way as
/// the values and select faster (integer compares).
pub(super) fn nucleus_threshold(ws: &mut [u32], target: f64) -> Option<f32> {
    // Invariant: the elements outside ws[lo..hi] that rank above it sum to `above < target`, and
    // those below it are not needed.
    let (mut lo, mut hi, mut above) = (0usize, ws.len(), 0.0f64);
    while lo < hi {
        let s = &mut ws[lo..hi];
        let mid = s.len() / 2;
        let (upper, &mut pivot, _) = s.select_nth_unstable_by_key(mid, |&b| Reverse(b));
        let pivot = f32::from_bits(pivot);
        let upper_mass = sum_bits(upper);
        if above + upper_mass >= target {
            // mid > 0 here, since upper_mass == 0 would contradict the invariant.
            hi = lo + mid;
            continue;
        }
        let with_pivot = above + upper_mass + f64::from(pivot);
        if with_pivot >= target {
            return Some(pivot);
        }
        above = with_pivot;
        lo += mid + 1;
    }
    None
}

/// Draws a token among the `weights >= theta`, proportionally to weight, with `u` uniform in
/// `[0, 1)`. `sums` are the per-[`CHUNK`] totals of those weights and `total` their sequential
/// sum; the walk goes over `sums`, then inside one chunk. Precondition: some weight `>= theta`
/// is positive.
pub(super) fn draw(weights: &[f32], sums: &[f64], total: f64, theta: f32, u: f64) -> u32 {
    let target = u * total;
    let mut acc = 0.0f64;
    for (ci, &sum) in sums.iter().enumerate() {
        if acc + sum <= target {
            acc += sum;
            continue;
        }
        let base = ci * CHUNK;
        for (j, &w) in weights[base..].iter().take(CHUNK).enumerate() {
            if w >= theta {
                acc += f64::from(w);
                if acc > target {
                    return (base + j) as u32;
                }
            }
        }
        // The chunk's lane-order sum rounded differently from this walk; go on to the next.
    }
    weights.iter().rposition(|&w| w >= theta && w > 0.0).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nucleus_threshold_matches_sorting() {
        let ws = [0.05f32, 0.4, 0.1, 0.2, 0.25];
        let mut sorted = ws;
        sorted.sort_by(|a, b| b.total_cmp(a));
        for target in [0.01, 0.4, 0.41, 0.64, 0.65, 0.84, 0.9, 0.95, 0.999] {
            let mut acc = 0.0f64;
            let want = sorted
                .iter()
                .find(|&&w| {
                    acc += f64::from(w);
                    acc >= target
                })
                .copied();
            let mut work = ws.map(f32::to_bits);
            assert_eq!(nucleus_threshold(&mut work, target), want, "target {target}");
        }
        let mut work = ws.map(f32::to_bits);
        assert_eq!(nucleus_threshold(&mut work, 2.0), None);
        assert_eq!(nucleus_threshold(&mut [], 0.5), None);
    }

    #[test]
    fn draw_covers_chunk_boundaries_and_respects_theta() {
        let mut ws = vec![0.0f32; 3 * CHUNK + 5];
        ws[CHUNK - 1] = 1.0;
        ws[CHUNK] = 1.0;
        ws[3 * CHUNK + 4] = 2.0;
        let sums: Vec<f64> = ws.chunks(CHUNK).map(|c| c.iter().map(|&w| f64::from(w)).sum()).collect();
        let total: f64 = sums.iter().sum();
        assert_eq!(draw(&ws, &sums, total, 0.0, 0.0), (CHUNK - 1) as u32);
        assert_eq!(draw(&ws, &sums, total, 0.0, 0.2499), (CHUNK - 1) as u32);
        assert_eq!(draw(&ws, &sums, total, 0.0, 0.2501), CHUNK as u32);
        assert_eq!(draw(&ws, &sums, total, 0.0, 0.5001), (3 * CHUNK + 4) as u32);
        assert_eq!(draw(&ws, &sums, total, 0.0, 0.999_999), (3 * CHUNK + 4) as u32);
        // Above theta = 1.5 only the last one survives; with theta = 1 the first two share half.
        let masked = [0.0, 0.0, 0.0, 2.0];
        assert_eq!(draw(&ws, &masked, 2.0, 1.5, 0.0), (3 * CHUNK + 4) as u32);
        assert_eq!(draw(&ws, &sums, total, 1.0, 0.3), CHUNK as u32);
    }

    /// A vocabulary where token i has weight `2^-(i / 1000)`, shuffled: every ladder pass and
    /// both top-k phases are exercised, and the k-th largest is known.
    #[test]
    fn thresholds_are_exact_on_a_long_tail() {
        let n = 20_000;
        let mut ws: Vec<f32> = (0..n).map(|i| (-(i as f32) / 1000.0).exp2()).collect();
        for i in (1..n).rev() {
            ws.swap(i, (i * 7919 + 13) % (i + 1));
        }
        let sums: Vec<f64> = ws.chunks(CHUNK).map(|c| c.iter().map(|&w| f64::from(w)).sum()).collect();
        let maxima: Vec<f32> = ws.chunks(CHUNK).map(|c| c.iter().copied().fold(0.0, f32::max)).collect();
        let total: f64 = sums.iter().sum();
        let wts = Weights { w: &ws, chunk_max: &maxima, total };
        let mut sorted = ws.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let mut scratch = ThresholdScratch::default();
        for k in [1usize, 2, 255, 256, 999, 5000, 19_999] {
            let f = Filters::new(k as u32, 1.0, 0.0, n);
            assert_eq!(threshold(&wts, &f, &mut scratch), sorted[k - 1], "top_k {k}");
        }
        for p in [1e-6f32, 0.3, 0.9, 0.99, 0.999_9] {
            let f = Filters::new(0, p, 0.0, n);
            let target = f64::from(p) * total;
            let mut acc = 0.0;
            let want = *sorted
                .iter()
                .find(|&&w| {
                    acc += f64::from(w);
                    acc >= target
                })
                .unwrap();
            assert_eq!(threshold(&wts, &f, &mut scratch), want, "top_p {p}");
        }
    }
}
