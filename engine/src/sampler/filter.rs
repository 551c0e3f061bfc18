//! Truncation (top-k, top-p, min-p) and the draw, over unnormalised weights `w_i = e^(s_i - max)`
//! where `s` are the penalised, temperature-scaled logits. The largest weight is exactly 1.
//!
//! Every filter keeps a *top set*: all tokens whose weight is at least some threshold. So the
//! surviving set is `{i : w_i >= theta}` with `theta` the largest of the filters' thresholds, and
//! no filter needs the vocabulary sorted:
//! - top-k: `theta_k` is the k-th largest weight (ties with it are kept, as in HF and vLLM, so
//!   more than k tokens can survive on exact ties);
//! - top-p: `theta_p` is the weight at which the descending cumulative mass first reaches
//!   `top_p` of the (top-k renormalised) total, found by a weighted quickselect (ties kept);
//! - min-p: `theta_min = min_p`, i.e. `p_i >= min_p * p_max`.
//!
//! Applying them in HF's order (top-k, then top-p on the renormalised top-k set, then min-p)
//! gives the same set as the largest threshold, because min-p's ratio is invariant under
//! renormalisation and top-p's target is computed on the top-k mass.
//!
//! To avoid touching the whole vocabulary more than necessary, candidates are first collected
//! above a coarse level `tau` (relative weight 2^-10, then 2^-20, then everything non-zero)
//! until the candidates provably contain the surviving set; chunks whose sum is below `tau`
//! are skipped without being read.

use std::cmp::Reverse;

use super::math::{sum_bits, CHUNK};

/// Coarse collection levels, descending; the last one admits every non-zero weight.
const LEVELS: [f32; 3] = [1.0 / 1024.0, 1.0 / 1_048_576.0, f32::from_bits(1)];

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
        Self {
            top_k,
            top_p,
            min_p,
        }
    }

    pub fn any(&self) -> bool {
        self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some()
    }
}

/// Collects into `cand`, in index order, the `(token, weight)` pairs that can survive the
/// filters, and returns the threshold `theta`: the survivors are exactly the pairs of `cand`
/// with weight `>= theta`. `total` is the sum of all weights and `chunk_sums` the per-[`CHUNK`]
/// sums from `exp_weights`. `sel` is scratch (weights as bit patterns, see [`nucleus_threshold`]).
///
/// Precondition: `weights` has a maximum of exactly 1 (so `cand` is never empty and `theta <= 1`).
pub(super) fn truncate(
    weights: &[f32],
    chunk_sums: &[f64],
    total: f64,
    f: &Filters,
    cand: &mut Vec<(u32, f32)>,
    sel: &mut Vec<u32>,
) -> f32 {
    // With top-k and top-p both on, top-p's target needs the exact top-k mass, so the candidates
    // must hold the whole top-k set even where min-p would cut deeper.
    let need_top_k_mass = f.top_k.is_some() && f.top_p.is_some();
    let min_p = f.min_p.unwrap_or(0.0);
    for (li, &level) in LEVELS.iter().enumerate() {
        let tau = if need_top_k_mass {
            level
        } else {
            level.max(min_p)
        };
        let mass = collect(weights, chunk_sums, tau, cand);
        let enough = li + 1 == LEVELS.len()
            || (!need_top_k_mass && tau <= min_p)
            || f.top_k.is_some_and(|k| cand.len() >= k)
            || (f.top_k.is_none() && f.top_p.is_some_and(|p| mass >= p * total));
        if enough {
            break;
        }
    }

    sel.clear();
    sel.extend(cand.iter().map(|&(_, w)| w.to_bits()));
    let mut theta = 0.0f32;
    let mut reference_mass = total;
    if let Some(k) = f.top_k {
        if sel.len() > k {
            let (_, &mut kth, _) = sel.select_nth_unstable_by_key(k - 1, |&b| Reverse(b));
            theta = f32::from_bits(kth);
            sel.retain(|&b| b >= kth);
        }
        reference_mass = sum_bits(sel);
    }
    if let Some(p) = f.top_p {
        if let Some(theta_p) = nucleus_threshold(sel, p * reference_mass) {
            theta = theta.max(theta_p);
        }
    }
    theta.max(min_p)
}

/// Pushes every `(i, w_i)` with `w_i >= tau` into `cand` (cleared first) and returns their mass.
fn collect(weights: &[f32], chunk_sums: &[f64], tau: f32, cand: &mut Vec<(u32, f32)>) -> f64 {
    cand.clear();
    let mut mass = 0.0f64;
    for (ci, (chunk, &sum)) in weights.chunks(CHUNK).zip(chunk_sums).enumerate() {
        // A chunk's sum bounds its largest weight from above.
        if sum < f64::from(tau) {
            continue;
        }
        let base = ci * CHUNK;
        for (j, &w) in chunk.iter().enumerate() {
            if w >= tau {
                cand.push(((base + j) as u32, w));
                mass += f64::from(w);
            }
        }
    }
    mass
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

/// Draws a token from the pairs of `cand` with weight `>= theta`, proportionally to weight, with
/// `u` uniform in `[0, 1)`. Precondition: at least one such pair has positive weight.
pub(super) fn draw_from_candidates(cand: &[(u32, f32)], theta: f32, u: f64) -> u32 {
    let z: f64 = cand
        .iter()
        .filter(|c| c.1 >= theta)
        .map(|c| f64::from(c.1))
        .sum();
    let target = u * z;
    let mut acc = 0.0f64;
    let mut last = 0u32;
    for &(id, w) in cand.iter().filter(|c| c.1 >= theta) {
        acc += f64::from(w);
        if w > 0.0 {
            last = id;
        }
        if acc > target {
            return id;
        }
    }
    // Only reachable through rounding when u is within an ulp of 1.
    last
}

/// Draws a token from all of `weights` proportionally, with `u` uniform in `[0, 1)`, walking
/// `chunk_sums` (whose sequential sum is `total`) and then one chunk.
pub(super) fn draw_from_all(weights: &[f32], chunk_sums: &[f64], total: f64, u: f64) -> u32 {
    let target = u * total;
    let mut acc = 0.0f64;
    for (ci, &sum) in chunk_sums.iter().enumerate() {
        if acc + sum <= target {
            acc += sum;
            continue;
        }
        let base = ci * CHUNK;
        for (j, &w) in weights[base..].iter().take(CHUNK).enumerate() {
            acc += f64::from(w);
            if acc > target {
                return (base + j) as u32;
            }
        }
        // The chunk's lane-order sum rounded differently from this walk; go on to the next.
    }
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
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
            assert_eq!(
                nucleus_threshold(&mut work, target),
                want,
                "target {target}"
            );
        }
        let mut work = ws.map(f32::to_bits);
        assert_eq!(nucleus_threshold(&mut work, 2.0), None);
        assert_eq!(nucleus_threshold(&mut [], 0.5), None);
    }

    #[test]
    fn draw_from_all_covers_chunk_boundaries() {
        let mut ws = vec![0.0f32; 3 * CHUNK + 5];
        ws[CHUNK - 1] = 1.0;
        ws[CHUNK] = 1.0;
        ws[3 * CHUNK + 4] = 2.0;
        let sums: Vec<f64> = ws
            .chunks(CHUNK)
            .map(|c| c.iter().map(|&w| f64::from(w)).sum())
            .collect();
        let total: f64 = sums.iter().sum();
        assert_eq!(draw_from_all(&ws, &sums, total, 0.0), (CHUNK - 1) as u32);
        assert_eq!(draw_from_all(&ws, &sums, total, 0.2499), (CHUNK - 1) as u32);
        assert_eq!(draw_from_all(&ws, &sums, total, 0.2501), CHUNK as u32);
        assert_eq!(
            draw_from_all(&ws, &sums, total, 0.5001),
            (3 * CHUNK + 4) as u32
        );
        assert_eq!(
            draw_from_all(&ws, &sums, total, 0.999_999),
            (3 * CHUNK + 4) as u32
        );
    }

    #[test]
    fn draw_from_candidates_respects_theta() {
        let cand = [(3u32, 0.5f32), (7, 1.0), (9, 0.25)];
        assert_eq!(draw_from_candidates(&cand, 0.5, 0.0), 3);
        assert_eq!(draw_from_candidates(&cand, 0.5, 0.34), 7);
        assert_eq!(draw_from_candidates(&cand, 1.0, 0.0), 7);
        assert_eq!(draw_from_candidates(&cand, 0.0, 0.99), 9);
    }
}
