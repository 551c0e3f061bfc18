//! The cost model: step times fitted from a [`Profile`].
//!
//! - `prefill_time(n, p)`: piecewise-linear over the cold-prompt grid; below the first point the
//!   first segment's line (never below 0), beyond the last the quadratic through the last three
//!   points when it is convex and rising there (attention grows with n²), else the last segment's
//!   line. A cached prefix `p` adds `k · n · p` seconds (attention over the prefix), with `k`
//!   fitted as the mean excess per (new × cached) token pair of the profile's cached points.
//! - `prefill_step_time(chunks)`: one step prefilling several prompts' chunks shares the weight
//!   reads but not attention, which is per sequence: the cold time of the summed tokens, less the
//!   cross-sequence part of the quadratic term (`c · (N² − Σ nᵢ²)`, with `c` the leading
//!   coefficient of the quadratic through the last three grid points), never below the dearest
//!   chunk alone.
//! - `decode_step_time(b, total_ctx)`: bilinear over the batch × per-sequence-context grid,
//!   extrapolated from the edge cells.
//! - `mixed_step_time`: one forward pass over the prefill chunks' tokens and one row per decode
//!   (the weights are read once for all of them, which is why a mixed step costs far less than
//!   a prefill step plus a decode step): the batched-prefill time of the chunks plus `b` one-token
//!   rows whose attention reads their contexts (the cached-prefix term), never below the decode
//!   step alone; times a factor fitted from the mixed points (the mean measured/modelled ratio;
//!   1 without them). An earlier model summed the prefill and decode steps, which counted the
//!   weight pass twice and overpriced colocated nodes under decode-heavy load by ~10-20%.
//! - `handoff_time(n)`: `latency + n · kv_bytes_per_token / bandwidth`.
//!
//! Invariant: at every grid point of the profile the model returns the measured time exactly.

use serde::{Deserialize, Serialize};

use crate::costs::{clamp_scale, StepCosts, StepStats};
use crate::error::PlannerError;
use crate::profile::{decode_axes, Profile};

/// How KV moves from a prefill node to a decode node.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HandoffCost {
    /// Bytes per second of the transfer (BENCHMARKS.md: QUIC ≈ 1 GB/s on loopback).
    pub bandwidth_bytes_per_s: f64,
    /// Fixed time per handoff, seconds (BENCHMARKS.md: 0.7 ms tail).
    pub latency_s: f64,
}

impl Default for HandoffCost {
    fn default() -> Self {
        Self { bandwidth_bytes_per_s: 1e9, latency_s: 0.7e-3 }
    }
}

/// Step times for the simulator. Built from a profile by [`CostModel::from_profile`].
#[derive(Debug, Clone)]
pub struct CostModel {
    /// Cold prefill grid, sorted by tokens, distinct tokens.
    prefill: Vec<(f64, f64)>,
    /// Seconds per (new token × cached token) pair.
    prefix_coef: f64,
    /// Quadratic (attention) coefficient of cold prefill, seconds per token²; 0 when the grid is
    /// not convex at its end.
    attn_coef: f64,
    batches: Vec<f64>,
    contexts: Vec<f64>,
    /// `decode[i][j]`: batch `batches[i]`, context `contexts[j]`.
    decode: Vec<Vec<f64>>,
    mixed_factor: f64,
    kv_bytes_per_token: f64,
    handoff: HandoffCost,
    /// What the nodes' own timings say of the profile now ([`StepCosts::calibrate`]): factors
    /// on the planner's view of prefill and decode steps (1: as profiled). The simulator's own
    /// methods never apply them: it runs the profile as measured.
    scale: Scale,
    /// Engine limits from the profile.
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub kv_capacity_tokens: usize,
}

impl CostModel {
    /// Fits the model; fails on a profile that breaks [`Profile::validate`].
    pub fn from_profile(p: &Profile, handoff: HandoffCost) -> Result<Self, PlannerError> {
        p.validate()?;
        if !(handoff.bandwidth_bytes_per_s > 0.0 && handoff.latency_s >= 0.0) {
            return Err(PlannerError::InvalidProfile(format!(
                "handoff bandwidth {} B/s and latency {} s must be positive",
                handoff.bandwidth_bytes_per_s, handoff.latency_s
            )));
        }
        let mut cold: Vec<(usize, f64)> =
            p.prefill.iter().filter(|x| x.cached_prefix == 0 && x.tokens > 0).map(|x| (x.tokens, x.seconds)).collect();
        cold.sort_by_key(|x| x.0);
        cold.dedup_by_key(|x| x.0);
        let prefill: Vec<(f64, f64)> = cold.into_iter().map(|(n, t)| (n as f64, t)).collect();
        let (b, c) = decode_axes(&p.decode);
        let decode = b
            .iter()
            .map(|&bb| {
                c.iter()
                    .map(|&cc| p.decode.iter().find(|d| d.batch == bb && d.context == cc).map_or(0.0, |d| d.seconds))
                    .collect()
            })
            .collect();
        let mut model = Self {
            attn_coef: quadratic_coef(&prefill),
            prefill,
            prefix_coef: 0.0,
            batches: b.iter().map(|&x| x as f64).collect(),
            contexts: c.iter().map(|&x| x as f64).collect(),
            decode,
            mixed_factor: 1.0,
            kv_bytes_per_token: p.kv_bytes_per_token as f64,
            handoff,
            max_num_batched_tokens: p.max_num_batched_tokens,
            max_num_seqs: p.max_num_seqs,
            kv_capacity_tokens: p.kv_capacity_tokens,
            scale: Scale { prefill: 1.0, decode: 1.0 },
        };
        let excess: Vec<f64> = p
            .prefill
            .iter()
            .filter(|x| x.cached_prefix > 0 && x.tokens > 0)
            .map(|x| (x.seconds - model.cold_prefill(x.tokens as f64)) / (x.tokens as f64 * x.cached_prefix as f64))
            .collect();
        if !excess.is_empty() {
            model.prefix_coef = (excess.iter().sum::<f64>() / excess.len() as f64).max(0.0);
        }
        let ratios: Vec<f64> = p
            .mixed
            .iter()
            .map(|m| {
                let total = m.decode_batch * m.context;
                let pass = model.one_pass([(m.prefill_tokens, 0)], m.decode_batch, total);
                m.seconds / pass.max(model.decode_step_time(m.decode_batch, total))
            })
            .filter(|r| r.is_finite() && *r > 0.0)
            .collect();
        if !ratios.is_empty() {
            model.mixed_factor = ratios.iter().sum::<f64>() / ratios.len() as f64;
        }
        Ok(model)
    }

    /// Seconds to prefill `tokens` new tokens after `cached_prefix` cached ones (0 for 0 tokens).
    pub fn prefill_time(&self, tokens: usize, cached_prefix: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        self.cold_prefill(tokens as f64) + self.prefix_coef * tokens as f64 * cached_prefix as f64
    }

    /// Seconds of one step that prefills the chunks `(new_tokens, cached_prefix)` together: the
    /// cold cost of their summed tokens (one pass over the weights) plus each chunk's prefix term.
    pub fn prefill_step_time(&self, chunks: impl IntoIterator<Item = (usize, usize)>) -> f64 {
        self.one_pass(chunks, 0, 0)
    }

    /// One forward pass over the `chunks` and `batch` one-token decode rows whose contexts sum to
    /// `total_context`: the cold time of all the rows, less the cross-sequence part of the
    /// attention term, plus the prefix term of every chunk and decode row; never below the
    /// dearest chunk alone. 0 for no rows.
    fn one_pass(&self, chunks: impl IntoIterator<Item = (usize, usize)>, batch: usize, total_context: usize) -> f64 {
        let mut tokens = batch;
        let mut extra = self.prefix_coef * total_context as f64;
        let mut squares = batch as f64;
        let mut dearest: f64 = 0.0;
        for (n, p) in chunks {
            tokens += n;
            extra += self.prefix_coef * n as f64 * p as f64;
            squares += (n as f64).powi(2);
            dearest = dearest.max(self.cold_prefill(n as f64));
        }
        if tokens == 0 {
            return 0.0;
        }
        let n = tokens as f64;
        (self.cold_prefill(n) - self.attn_coef * (n * n - squares)).max(dearest) + extra
    }

    /// Seconds of one decode step of `batch` sequences holding `total_context` tokens together.
    pub fn decode_step_time(&self, batch: usize, total_context: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let b = batch as f64;
        let c = total_context as f64 / b;
        let (i0, i1, wb) = bracket(&self.batches, b);
        let (j0, j1, wc) = bracket(&self.contexts, c);
        let g = &self.decode;
        let lo = g[i0][j0] + wc * (g[i0][j1] - g[i0][j0]);
        let hi = g[i1][j0] + wc * (g[i1][j1] - g[i1][j0]);
        let t = lo + wb * (hi - lo);
        // Extrapolation may undershoot; never go below the cheapest measured step.
        t.max(self.min_decode())
    }

    /// Seconds of a step carrying prefill `chunks` (see [`Self::prefill_step_time`]) and `batch`
    /// decodes of `total_context` tokens.
    pub fn mixed_step_time(
        &self,
        chunks: impl IntoIterator<Item = (usize, usize)>,
        batch: usize,
        total_context: usize,
    ) -> f64 {
        let chunks: Vec<(usize, usize)> = chunks.into_iter().filter(|c| c.0 > 0).collect();
        if chunks.is_empty() || batch == 0 {
            return self.prefill_step_time(chunks) + self.decode_step_time(batch, total_context);
        }
        let pass = self.one_pass(chunks, batch, total_context);
        pass.max(self.decode_step_time(batch, total_context)) * self.mixed_factor
    }

    /// Seconds to move the KV of `tokens` tokens to a decode node.
    pub fn handoff_time(&self, tokens: usize) -> f64 {
        self.handoff.latency_s + tokens as f64 * self.kv_bytes_per_token / self.handoff.bandwidth_bytes_per_s
    }

    fn min_decode(&self) -> f64 {
        self.decode.iter().flatten().copied().fold(f64::INFINITY, f64::min)
    }

    fn cold_prefill(&self, n: f64) -> f64 {
        let g = &self.prefill;
        if g.len() == 1 {
            return g[0].1 * n / g[0].0;
        }
        let last = g.len() - 1;
        if n == g[last].0 {
            return g[last].1;
        }
        if n < g[last].0 {
            let (i0, i1, w) = bracket(&g.iter().map(|x| x.0).collect::<Vec<_>>(), n);
            return (g[i0].1 + w * (g[i1].1 - g[i0].1)).max(0.0);
        }
        let linear = g[last].1 + (n - g[last].0) * (g[last].1 - g[last - 1].1) / (g[last].0 - g[last - 1].0);
        if g.len() >= 3 {
            let (x0, y0) = g[last - 2];
            let (x1, y1) = g[last - 1];
            let (x2, y2) = g[last];
            // Lagrange quadratic through the last three points.
            let l = |x: f64| {
                y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2))
                    + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
                    + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1))
            };
            let a = y0 / ((x0 - x1) * (x0 - x2)) + y1 / ((x1 - x0) * (x1 - x2)) + y2 / ((x2 - x0) * (x2 - x1));
            let slope_at_end = {
                let h = 1e-3 * x2;
                (l(x2 + h) - l(x2)) / h
            };
            if a >= 0.0 && slope_at_end > 0.0 {
                return l(n).max(linear);
            }
        }
        linear
    }
}

/// Calibration factors (see [`CostModel::scale`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Scale {
    prefill: f64,
    decode: f64,
}

/// The planner predicts with the very costs the simulator runs on. Cold prompts (the planner
/// models no prefix cache); a mixed step's prefill part is one chunk. The fitted model keeps the
/// profile's measurements exactly, so where those are not monotone (a noisy grid) neither is
/// the model, which the planner's search assumes; its predictions then err a little.
///
/// Calibration keeps the profile's shape (how time grows with tokens, batch and context, which
/// the profile measured and a node's totals cannot tell) and matches its level to the nodes':
/// the prefill factor is measured seconds per token over the profile's per-token time at
/// [`LinearCosts::CALIBRATION_PROMPT_TOKENS`] (nodes report token totals, not prompt counts); the
/// decode factor is measured seconds per step over the profile's at the window's mean batch
/// and context. Same sample minimums and clamp as [`LinearCosts::calibrate`].
///
/// [`LinearCosts::CALIBRATION_PROMPT_TOKENS`]: crate::LinearCosts::CALIBRATION_PROMPT_TOKENS
/// [`LinearCosts::calibrate`]: crate::LinearCosts::calibrate
impl StepCosts for CostModel {
    fn prefill_time(&self, tokens: usize) -> f64 {
        CostModel::prefill_time(self, tokens, 0) * self.scale.prefill
    }

    fn decode_step_time(&self, batch: usize, total_context: usize) -> f64 {
        CostModel::decode_step_time(self, batch, total_context) * self.scale.decode
    }

    fn mixed_step_time(&self, prefill_tokens: usize, batch: usize, total_context: usize) -> f64 {
        let dec = CostModel::decode_step_time(self, batch, total_context) * self.scale.decode;
        if prefill_tokens == 0 || batch == 0 {
            return self.prefill_step_time([(prefill_tokens, 0)]) * self.scale.prefill + dec;
        }
        let pass = self.one_pass([(prefill_tokens, 0)], batch, total_context) * self.scale.prefill;
        pass.max(dec) * self.mixed_factor
    }

    fn calibrate(&mut self, s: &StepStats) {
        if let Some(measured) = s.prefill_s_per_token() {
            let n = crate::LinearCosts::CALIBRATION_PROMPT_TOKENS;
            let profiled = CostModel::prefill_time(self, n as usize, 0) / n;
            if profiled > 0.0 {
                self.scale.prefill = clamp_scale(measured / profiled);
            }
        }
        if let Some(m) = s.mean_decode_step() {
            let batch = m.batch.round().max(1.0) as usize;
            let profiled = CostModel::decode_step_time(self, batch, m.context.round() as usize);
            if profiled > 0.0 {
                self.scale.decode = clamp_scale(m.seconds / profiled);
            }
        }
    }

    fn handoff_time(&self, tokens: usize) -> f64 {
        CostModel::handoff_time(self, tokens)
    }

    fn kv_capacity_tokens(&self) -> usize {
        self.kv_capacity_tokens
    }
}

/// Leading coefficient of the quadratic through the last three points of a sorted grid, when
/// positive (the attention term of prefill); else 0.
fn quadratic_coef(g: &[(f64, f64)]) -> f64 {
    if g.len() < 3 {
        return 0.0;
    }
    let n = g.len();
    let ((x0, y0), (x1, y1), (x2, y2)) = (g[n - 3], g[n - 2], g[n - 1]);
    let a = y0 / ((x0 - x1) * (x0 - x2)) + y1 / ((x1 - x0) * (x1 - x2)) + y2 / ((x2 - x0) * (x2 - x1));
    if a.is_finite() && a > 0.0 {
        a
    } else {
        0.0
    }
}

/// For sorted `axis` and `x`: the segment `(i0, i1)` that holds `x` (the edge segment outside the
/// axis) and the weight of `i1`, which is outside [0, 1] when extrapolating. A one-point axis
/// gives `(0, 0, 0)`.
fn bracket(axis: &[f64], x: f64) -> (usize, usize, f64) {
    if axis.len() < 2 {
        return (0, 0, 0.0);
    }
    let i = axis.partition_point(|&a| a <= x).clamp(1, axis.len() - 1);
    let (a0, a1) = (axis[i - 1], axis[i]);
    (i - 1, i, (x - a0) / (a1 - a0))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::profile::{MixedPoint, PrefillPoint};

    fn profile() -> Profile {
        Profile::synthetic()
    }

    #[test]
    fn batched_prompts_share_weights_but_not_attention() {
        let m = CostModel::from_profile(&profile(), HandoffCost::default()).unwrap();
        let one = m.prefill_time(1024, 0);
        assert_eq!(m.prefill_step_time([(1024, 0)]), one, "one chunk is the grid's own time");
        let two = m.prefill_step_time([(1024, 0), (1024, 0)]);
        let long = m.prefill_time(2048, 0);
        assert!(two < long, "two 1024-token prompts ({two}) cost less than one 2048-token prompt ({long})");
        assert!(two >= one, "never below the dearest chunk alone");
        // Linear grids have no attention term: batching is additive.
        let mut lin = profile();
        for x in &mut lin.prefill {
            x.seconds = 1e-4 * x.tokens as f64;
        }
        let m = CostModel::from_profile(&lin, HandoffCost::default()).unwrap();
        assert!((m.prefill_step_time([(256, 0), (768, 0)]) - m.prefill_time(1024, 0)).abs() < 1e-12);
    }

    #[test]
    fn reproduces_every_grid_point() {
        let p = profile();
        let m = CostModel::from_profile(&p, HandoffCost::default()).unwrap();
        for x in &p.prefill {
            assert_eq!(m.prefill_time(x.tokens, 0), x.seconds, "prefill {}", x.tokens);
        }
        for d in &p.decode {
            let got = m.decode_step_time(d.batch, d.batch * d.context);
            assert!((got - d.seconds).abs() < 1e-15, "decode {}x{}: {got} vs {}", d.batch, d.context, d.seconds);
        }
    }

    #[test]
    fn interpolates_and_extrapolates() {
        let m = CostModel::from_profile(&profile(), HandoffCost::default()).unwrap();
        // Halfway between 256 (0.03) and 1024 (0.15).
        assert!((m.prefill_time(640, 0) - 0.09).abs() < 1e-12);
        // Beyond the grid: rising, and at least the last segment's slope.
        let slope = (1.0 - 0.15) / 3072.0;
        assert!(m.prefill_time(8192, 0) >= 1.0 + 4096.0 * slope - 1e-9);
        // Below the grid: the first segment's line, clamped at 0.
        assert!((m.prefill_time(8, 0) - (0.004 - 8.0 * 0.006 / 48.0)).abs() < 1e-12);
        // Bilinear midpoint of batch 1..4 and context 128..1024.
        let mid = m.decode_step_time(2, 2 * 576);
        let want = 0.01 + 0.002 * (1.0 / 3.0) + 0.001 * 0.5;
        assert!((mid - want).abs() < 1e-12, "{mid} vs {want}");
        // Extrapolated past batch 16 keeps the last slope.
        assert!(m.decode_step_time(32, 32 * 128) > m.decode_step_time(16, 16 * 128));
        assert_eq!(m.decode_step_time(0, 0), 0.0);
        assert!((m.handoff_time(1000) - (0.7e-3 + 1e6 / 1e9)).abs() < 1e-15);
    }

    #[test]
    fn cached_prefix_and_mixed_factors_fit_from_points() {
        let mut p = profile();
        // 256 new tokens after 1024 cached cost 0.03 + 256·1024·1e-8.
        p.prefill.push(PrefillPoint { tokens: 256, cached_prefix: 1024, seconds: 0.03 + 256.0 * 1024.0 * 1e-8 });
        let unfitted = CostModel::from_profile(&p, HandoffCost::default()).unwrap();
        assert!((unfitted.prefill_time(256, 1024) - p.prefill[5].seconds).abs() < 1e-12);
        let modelled = unfitted.mixed_step_time([(256, 0)], 4, 512);
        p.mixed.push(MixedPoint { prefill_tokens: 256, decode_batch: 4, context: 128, seconds: 0.9 * modelled });
        let m = CostModel::from_profile(&p, HandoffCost::default()).unwrap();
        assert!((m.mixed_step_time([(256, 0)], 4, 512) - 0.9 * modelled).abs() < 1e-12, "the point is reproduced");
        assert_eq!(m.mixed_step_time([(0, 0)], 4, 512), m.decode_step_time(4, 512));
        assert_eq!(m.mixed_step_time([(256, 0)], 0, 0), m.prefill_time(256, 0));
    }

    /// A mixed step is one pass over the weights: dearer than either part alone (unfitted), far
    /// cheaper than both, and its decode rows pay for attention over their contexts.
    #[test]
    fn a_mixed_step_reads_the_weights_once() {
        let mut p = profile();
        p.prefill.push(PrefillPoint { tokens: 256, cached_prefix: 1024, seconds: 0.03 + 256.0 * 1024.0 * 1e-8 });
        let m = CostModel::from_profile(&p, HandoffCost::default()).unwrap();
        for (chunk, batch, ctx) in [(16, 16, 1024), (128, 8, 256), (256, 4, 128), (1024, 16, 1024)] {
            let (pre, dec) = (m.prefill_time(chunk, 0), m.decode_step_time(batch, batch * ctx));
            let mixed = m.mixed_step_time([(chunk, 0)], batch, batch * ctx);
            assert!(mixed >= pre.max(dec), "{chunk}+{batch}x{ctx}: {mixed} below a part alone");
            assert!(mixed < pre + dec, "{chunk}+{batch}x{ctx}: {mixed} not below the sum {}", pre + dec);
        }
        let short = m.mixed_step_time([(256, 0)], 8, 8 * 64);
        let long = m.mixed_step_time([(256, 0)], 8, 8 * 2048);
        assert!((long - short - 1e-8 * 8.0 * (2048.0 - 64.0)).abs() < 1e-12, "{long} - {short}");
    }

    #[test]
    fn the_planner_sees_the_same_costs() {
        use crate::StepCosts;
        let m = CostModel::from_profile(&profile(), HandoffCost::default()).unwrap();
        let p: &dyn StepCosts = &m;
        assert_eq!(p.prefill_time(640), m.prefill_time(640, 0));
        assert_eq!(p.decode_step_time(4, 2000), m.decode_step_time(4, 2000));
        assert_eq!(p.mixed_step_time(256, 4, 2000), m.mixed_step_time([(256, 0)], 4, 2000));
        assert_eq!(p.mixed_step_time(0, 4, 2000), m.decode_step_time(4, 2000));
        assert_eq!(p.handoff_time(1000), m.handoff_time(1000));
        assert_eq!(p.kv_capacity_tokens(), 100_000);
    }

    #[test]
    fn rejects_a_holey_grid() {
        let mut p = profile();
        p.decode.pop();
        assert!(CostModel::from_profile(&p, HandoffCost::default()).is_err());
        let mut p = profile();
        p.prefill[0].seconds = f64::NAN;
        assert!(CostModel::from_profile(&p, HandoffCost::default()).is_err());
    }
    /// The nodes' timings re-level the planner's view and keep the profile's shape; the
    /// simulator's own methods stay as profiled.
    #[test]
    fn calibration_relevels_the_planner_view_only() {
        use crate::costs::StepStats;
        let mut m = CostModel::from_profile(&profile(), HandoffCost::default()).unwrap();
        let (p256, p1024) = (StepCosts::prefill_time(&m, 256), StepCosts::prefill_time(&m, 1024));
        let (d1, d16) = (StepCosts::decode_step_time(&m, 1, 128), StepCosts::decode_step_time(&m, 16, 16 * 1024));
        // Nodes measure prefill 1.5x and decode 2x the profile (at 512 tokens; at batch 4,
        // context 128 per sequence).
        let per_token = CostModel::prefill_time(&m, 512, 0) / 512.0;
        let step = CostModel::decode_step_time(&m, 4, 4 * 128);
        StepCosts::calibrate(
            &mut m,
            &StepStats {
                prefill_tokens: 5120,
                prefill_seconds: 1.5 * per_token * 5120.0,
                decode_steps: 100,
                decode_seqs: 400,
                decode_context_tokens: 100 * 4 * 128,
                decode_seconds: 2.0 * step * 100.0,
            },
        );
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b.max(1.0);
        assert!(close(StepCosts::prefill_time(&m, 256), 1.5 * p256));
        assert!(close(StepCosts::prefill_time(&m, 1024), 1.5 * p1024));
        assert!(close(StepCosts::decode_step_time(&m, 1, 128), 2.0 * d1));
        assert!(close(StepCosts::decode_step_time(&m, 16, 16 * 1024), 2.0 * d16));
        assert!(close(CostModel::prefill_time(&m, 256, 0), p256), "the simulator's model is unchanged");
        // Too few samples change nothing; garbage is clamped.
        let before = StepCosts::decode_step_time(&m, 1, 128);
        StepCosts::calibrate(
            &mut m,
            &StepStats { decode_steps: 3, decode_seqs: 3, decode_seconds: 1e3, ..Default::default() },
        );
        assert!(close(StepCosts::decode_step_time(&m, 1, 128), before));
        StepCosts::calibrate(
            &mut m,
            &StepStats {
                decode_steps: 100,
                decode_seqs: 100,
                decode_context_tokens: 12_800,
                decode_seconds: 1e9,
                ..Default::default()
            },
        );
        assert!(close(StepCosts::decode_step_time(&m, 1, 128), 10.0 * d1));
    }
}
