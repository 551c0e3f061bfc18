//! What one engine step costs: the [`StepCosts`] trait the model is written against, and
//! [`LinearCosts`], a closed-form model that nodes' own timings re-scale ([`LinearCosts::calibrate`]).
//!
//! The simulator implements [`StepCosts`] with its model fitted from measured profiles; the
//! planner never cares which. Assumption the planner's search relies on: every time is
//! non-decreasing in each argument (more tokens, a bigger batch or more context never make a
//! step faster), which makes predictions monotone in pool sizes.

use serde::{Deserialize, Serialize};

/// Costs of engine work on one node, in seconds.
pub trait StepCosts: Send + Sync {
    /// Seconds to prefill a cold prompt of `tokens` tokens alone on one node.
    fn prefill_time(&self, tokens: usize) -> f64;
    /// Seconds of one decode step of `batch` sequences holding `total_context` tokens in all.
    fn decode_step_time(&self, batch: usize, total_context: usize) -> f64;
    /// Seconds of one step carrying a prefill chunk of `prefill_tokens` beside `batch` decodes.
    fn mixed_step_time(&self, prefill_tokens: usize, batch: usize, total_context: usize) -> f64;
    /// Seconds the KV handoff of `tokens` tokens adds after the prefill (remote path only).
    fn handoff_time(&self, tokens: usize) -> f64;
    /// KV tokens one node can hold.
    fn kv_capacity_tokens(&self) -> usize;
    /// Re-scales the model to what nodes measured (see [`LinearCosts::calibrate`]). Models
    /// fitted offline ignore it, which is the default.
    fn calibrate(&mut self, _stats: &StepStats) {}
}

/// Aggregates that nodes report over a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Prompt tokens prefilled.
    pub prefill_tokens: u64,
    /// Seconds spent in those prefills.
    pub prefill_seconds: f64,
    /// Decode steps run.
    pub decode_steps: u64,
    /// Sum of batch sizes over those steps.
    pub decode_seqs: u64,
    /// Sum over steps of the batch's total context tokens.
    pub decode_context_tokens: u64,
    /// Seconds spent in those steps.
    pub decode_seconds: f64,
}

/// A window's mean decode step: seconds, batch and total context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeanDecodeStep {
    pub seconds: f64,
    pub batch: f64,
    pub context: f64,
}

impl StepStats {
    /// Measured seconds per prefilled token, when the window holds at least
    /// [`LinearCosts::MIN_PREFILL_TOKENS`] and a usable time (else `None`: too few to calibrate).
    pub fn prefill_s_per_token(&self) -> Option<f64> {
        let ok = self.prefill_tokens >= LinearCosts::MIN_PREFILL_TOKENS
            && self.prefill_seconds.is_finite()
            && self.prefill_seconds > 0.0;
        ok.then(|| self.prefill_seconds / self.prefill_tokens as f64)
    }

    /// The mean decode step, when the window holds at least [`LinearCosts::MIN_DECODE_STEPS`]
    /// and a usable time (else `None`).
    pub fn mean_decode_step(&self) -> Option<MeanDecodeStep> {
        let ok = self.decode_steps >= LinearCosts::MIN_DECODE_STEPS
            && self.decode_seconds.is_finite()
            && self.decode_seconds > 0.0;
        let steps = self.decode_steps as f64;
        ok.then(|| MeanDecodeStep {
            seconds: self.decode_seconds / steps,
            batch: self.decode_seqs as f64 / steps,
            context: self.decode_context_tokens as f64 / steps,
        })
    }

    /// Both windows together.
    pub fn plus(&self, o: &StepStats) -> StepStats {
        StepStats {
            prefill_tokens: self.prefill_tokens + o.prefill_tokens,
            prefill_seconds: self.prefill_seconds + o.prefill_seconds,
            decode_steps: self.decode_steps + o.decode_steps,
            decode_seqs: self.decode_seqs + o.decode_seqs,
            decode_context_tokens: self.decode_context_tokens + o.decode_context_tokens,
            decode_seconds: self.decode_seconds + o.decode_seconds,
        }
    }
}

/// A linear (plus quadratic attention) step-cost model.
///
/// - `prefill_time(n) = prefill_fixed_s + n * prefill_s_per_token + n^2 * prefill_s_per_token2`
/// - `decode_step_time(b, c) = decode_fixed_s + b * decode_s_per_seq + c * decode_s_per_context_token`
/// - `mixed_step_time(n, b, c)`: the decode step plus the prefill chunk's per-token terms, with
///   one fixed cost, the larger of the two (one forward pass):
///   `max(decode_fixed_s, prefill_fixed_s) + b * decode_s_per_seq + c * decode_s_per_context_token
///   + n * prefill_s_per_token + n^2 * prefill_s_per_token2` (n = 0: exactly the decode step)
/// - `handoff_time(n) = handoff_fixed_s + n * handoff_s_per_token`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearCosts {
    pub prefill_fixed_s: f64,
    pub prefill_s_per_token: f64,
    /// Attention's quadratic share of a prefill.
    pub prefill_s_per_token2: f64,
    pub decode_fixed_s: f64,
    pub decode_s_per_seq: f64,
    pub decode_s_per_context_token: f64,
    pub handoff_fixed_s: f64,
    pub handoff_s_per_token: f64,
    pub kv_capacity_tokens: usize,
}

impl Default for LinearCosts {
    /// A small model on one CPU core: prefill about 2 ms per token, a decode step 40 ms plus
    /// 1 ms per sequence, a local handoff of a few ms.
    fn default() -> Self {
        Self {
            prefill_fixed_s: 0.010,
            prefill_s_per_token: 0.002,
            prefill_s_per_token2: 0.0,
            decode_fixed_s: 0.040,
            decode_s_per_seq: 0.001,
            decode_s_per_context_token: 0.0,
            handoff_fixed_s: 0.005,
            handoff_s_per_token: 1e-6,
            kv_capacity_tokens: 65_536,
        }
    }
}

/// What [`LinearCosts::calibrate`] changed: the factor each group of terms was multiplied by,
/// `None` where the window had too few samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Calibration {
    pub prefill_scale: Option<f64>,
    pub decode_scale: Option<f64>,
}

impl LinearCosts {
    /// Fewest prefilled tokens in a window worth calibrating from.
    pub const MIN_PREFILL_TOKENS: u64 = 256;
    /// Fewest decode steps in a window worth calibrating from.
    pub const MIN_DECODE_STEPS: u64 = 16;
    /// Prompt length at which the prefill terms are matched to the measured seconds per token:
    /// nodes report totals, not prompt counts, so the fixed cost cannot be separated and is
    /// left alone; the per-token cost is taken at a typical prompt.
    pub const CALIBRATION_PROMPT_TOKENS: f64 = 512.0;
    /// Largest factor (and smallest, inverted) one window may apply: a window of garbage
    /// timings cannot move the model by more than 10x.
    pub const MAX_RESCALE: f64 = 10.0;

    /// Re-scales the model to what nodes measured over a window.
    ///
    /// - Prefill, when `prefill_tokens >= MIN_PREFILL_TOKENS` and `prefill_seconds > 0`: the
    ///   measured seconds per token `m = prefill_seconds / prefill_tokens` is compared with the
    ///   model's per-token cost at `CALIBRATION_PROMPT_TOKENS` (`R`),
    ///   `prefill_s_per_token + R * prefill_s_per_token2`; both per-token terms are multiplied
    ///   by their ratio (keeping the linear/quadratic split). `prefill_fixed_s` is unchanged.
    /// - Decode, when `decode_steps >= MIN_DECODE_STEPS` and `decode_seconds > 0`: the model's
    ///   step time at the measured mean batch `decode_seqs / decode_steps` and mean context
    ///   `decode_context_tokens / decode_steps` is compared with the measured mean step time
    ///   `decode_seconds / decode_steps`; the three decode terms are multiplied by the ratio.
    /// - Each factor is clamped to `[1 / MAX_RESCALE, MAX_RESCALE]`. Handoff and KV capacity
    ///   are untouched. Windows below the sample minimums change nothing.
    ///
    /// Matching is exact in one call (not smoothed): each window re-measures, so repeated calls
    /// track drift, and the planner's observed/predicted correction absorbs what is left.
    pub fn calibrate(&mut self, s: &StepStats) -> Calibration {
        let mut out = Calibration::default();
        if let Some(measured) = s.prefill_s_per_token() {
            let model = self.prefill_s_per_token + Self::CALIBRATION_PROMPT_TOKENS * self.prefill_s_per_token2;
            if model > 0.0 {
                let f = clamp_scale(measured / model);
                self.prefill_s_per_token *= f;
                self.prefill_s_per_token2 *= f;
                out.prefill_scale = Some(f);
            } else {
                // A model with no per-token cost cannot be scaled; take the measurement.
                self.prefill_s_per_token = measured;
                out.prefill_scale = Some(1.0);
            }
        }
        if let Some(m) = s.mean_decode_step() {
            let model =
                self.decode_fixed_s + m.batch * self.decode_s_per_seq + m.context * self.decode_s_per_context_token;
            if model > 0.0 {
                let f = clamp_scale(m.seconds / model);
                self.decode_fixed_s *= f;
                self.decode_s_per_seq *= f;
                self.decode_s_per_context_token *= f;
                out.decode_scale = Some(f);
            }
        }
        out
    }

    fn prefill_tokens_cost(&self, n: f64) -> f64 {
        n * self.prefill_s_per_token + n * n * self.prefill_s_per_token2
    }
}

/// A calibration factor within `[1 / MAX_RESCALE, MAX_RESCALE]`.
pub(crate) fn clamp_scale(f: f64) -> f64 {
    f.clamp(1.0 / LinearCosts::MAX_RESCALE, LinearCosts::MAX_RESCALE)
}

impl StepCosts for LinearCosts {
    fn prefill_time(&self, tokens: usize) -> f64 {
        self.prefill_fixed_s + self.prefill_tokens_cost(tokens as f64)
    }

    fn decode_step_time(&self, batch: usize, total_context: usize) -> f64 {
        self.decode_fixed_s
            + batch as f64 * self.decode_s_per_seq
            + total_context as f64 * self.decode_s_per_context_token
    }

    fn mixed_step_time(&self, prefill_tokens: usize, batch: usize, total_context: usize) -> f64 {
        if prefill_tokens == 0 {
            return self.decode_step_time(batch, total_context);
        }
        let fixed = self.decode_fixed_s.max(self.prefill_fixed_s);
        fixed
            + batch as f64 * self.decode_s_per_seq
            + total_context as f64 * self.decode_s_per_context_token
            + self.prefill_tokens_cost(prefill_tokens as f64)
    }

    fn handoff_time(&self, tokens: usize) -> f64 {
        self.handoff_fixed_s + tokens as f64 * self.handoff_s_per_token
    }

    fn kv_capacity_tokens(&self) -> usize {
        self.kv_capacity_tokens
    }

    fn calibrate(&mut self, stats: &StepStats) {
        LinearCosts::calibrate(self, stats);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibrate_matches_measured_prefill_rate_and_decode_step() {
        let mut c = LinearCosts { prefill_s_per_token2: 1e-6, decode_s_per_context_token: 1e-6, ..Default::default() };
        // Nodes measured prefill twice as slow as the model at the reference length.
        let model_per_token = c.prefill_s_per_token + LinearCosts::CALIBRATION_PROMPT_TOKENS * c.prefill_s_per_token2;
        let tokens = 10_000u64;
        // Decode: 100 steps of batch 8 with 4000 context tokens each, 0.1 s per step measured.
        let stats = StepStats {
            prefill_tokens: tokens,
            prefill_seconds: 2.0 * model_per_token * tokens as f64,
            decode_steps: 100,
            decode_seqs: 800,
            decode_context_tokens: 400_000,
            decode_seconds: 10.0,
        };
        let cal = c.calibrate(&stats);
        assert!((cal.prefill_scale.unwrap() - 2.0).abs() < 1e-9);
        let after = c.prefill_s_per_token + LinearCosts::CALIBRATION_PROMPT_TOKENS * c.prefill_s_per_token2;
        assert!((after - 2.0 * model_per_token).abs() < 1e-12);
        assert!((c.decode_step_time(8, 4000) - 0.1).abs() < 1e-12);
        assert_eq!(c.prefill_fixed_s, LinearCosts::default().prefill_fixed_s);
    }

    #[test]
    fn calibrate_ignores_small_windows_and_clamps_outliers() {
        let mut c = LinearCosts::default();
        let before = c.clone();
        c.calibrate(&StepStats {
            prefill_tokens: 10,
            prefill_seconds: 100.0,
            decode_steps: 3,
            decode_seconds: 9.0,
            ..Default::default()
        });
        assert_eq!(c, before);
        let cal =
            c.calibrate(&StepStats { decode_steps: 100, decode_seqs: 100, decode_seconds: 1e6, ..Default::default() });
        assert_eq!(cal.decode_scale, Some(LinearCosts::MAX_RESCALE));
        assert!((c.decode_fixed_s - before.decode_fixed_s * LinearCosts::MAX_RESCALE).abs() < 1e-12);
    }

    #[test]
    fn mixed_step_without_prefill_is_the_decode_step() {
        let c = LinearCosts::default();
        assert_eq!(c.mixed_step_time(0, 4, 100), c.decode_step_time(4, 100));
        assert!(c.mixed_step_time(64, 4, 100) > c.decode_step_time(4, 100) + 64.0 * c.prefill_s_per_token - 1e-12);
    }
}
