//! Pacing: how many prompt tokens a step may carry beside running decodes so that no running
//! sequence's time per output token goes over a target.
//!
//! A colocated node (or a decode node prefilling a short prompt locally) runs prompt chunks in
//! the same forward pass as its decodes: every decoding sequence waits for the chunk. A fixed
//! token budget trades the two blindly: 128 prompt tokens cost ~300 ms on one core of the
//! machines cleave is benchmarked on, so each step that carries one turns an 8-token reply's
//! 20-ms steps into a reply averaging over 100 ms per token. Pacing sizes the chunk from the
//! decodes' slack instead:
//!
//! - a decoding sequence that produced its first token here at `t0` and `n` tokens since will,
//!   after the next step, have averaged `(now + step - t0) / (n + 1)` per token (counting as if
//!   it ended there: its real length is unknown, EOS may come next);
//! - the step may therefore last `margin * target * (n + 1) - (now - t0)`: the least of that
//!   over the decoding sequences is the step's time allowance;
//! - less the decode step's own cost, divided by the cost of a prompt token, is the prompt
//!   tokens it may carry: never fewer than [`MIN_PACED_CHUNK`] (prompts must progress however
//!   late the decodes are) nor more than the step budget.
//!
//! A sequence with slack banked (fast steps so far) lets larger chunks through: the target is
//! a mean per request, as clients and `cleave bench` measure it, not a cap on each interval.
//! Without a target, without decodes, or before the step costs are known, only the budget
//! limits prompt tokens. Costs come from the runner's measurements ([`StepCosts`]); the
//! scheduler itself reads no clock.

use std::time::{Duration, Instant};

/// Fewest prompt tokens a paced step carries when any wait: the floor that keeps prefill
/// moving when decodes have no slack left (one KV block at the default block size).
pub const MIN_PACED_CHUNK: usize = 16;

/// Share of the target the allowance aims at: the client's time per token also counts the
/// network and the coordinator, which the node does not see.
pub const PACING_MARGIN: f64 = 0.9;

/// What the runner measured a step to cost: the marginal time of one prompt token, and a
/// decode-only step at the current batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCosts {
    pub prompt_token: Duration,
    pub decode_step: Duration,
}

/// One decoding sequence's pace: when it produced its first token on this node, and how many
/// tokens it had then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pace {
    pub since: Instant,
    pub generated_then: usize,
}

impl Pace {
    /// The longest the next step may take for this sequence's mean time per token to stay
    /// within `margin * target` if it ended after that step (negative: already over).
    pub fn allowance_s(&self, generated_now: usize, now: Instant, target: Duration) -> f64 {
        let intervals = (generated_now.saturating_sub(self.generated_then) + 1) as f64;
        let elapsed = now.saturating_duration_since(self.since).as_secs_f64();
        PACING_MARGIN * target.as_secs_f64() * intervals - elapsed
    }
}

/// Prompt tokens a step may carry, given the least allowance over its decoding sequences (in
/// seconds), the costs, and the budget left after the decodes.
pub(super) fn paced_chunk(allowance_s: f64, costs: StepCosts, budget: usize) -> usize {
    let per_token = costs.prompt_token.as_secs_f64();
    if per_token <= 0.0 {
        return budget;
    }
    let room = (allowance_s - costs.decode_step.as_secs_f64()) / per_token;
    let tokens = if room.is_finite() && room > 0.0 { room.min(budget as f64) as usize } else { 0 };
    tokens.max(MIN_PACED_CHUNK).min(budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(prompt_ms: f64, decode_ms: f64) -> StepCosts {
        StepCosts {
            prompt_token: Duration::from_secs_f64(prompt_ms / 1e3),
            decode_step: Duration::from_secs_f64(decode_ms / 1e3),
        }
    }

    #[test]
    fn a_fresh_sequence_allows_what_fits_under_the_target() {
        let t0 = Instant::now();
        let p = Pace { since: t0, generated_then: 1 };
        let a = p.allowance_s(1, t0, Duration::from_millis(100));
        assert!((a - 0.09).abs() < 1e-9, "{a}");
        // 90 ms less a 20-ms decode step at 2.5 ms a prompt token: 28 tokens.
        assert_eq!(paced_chunk(a, costs(2.5, 20.0), 128), 28);
    }

    #[test]
    fn banked_slack_lets_larger_chunks_through_and_lateness_floors_them() {
        let t0 = Instant::now();
        let p = Pace { since: t0, generated_then: 1 };
        let target = Duration::from_millis(100);
        // 50 tokens at 20 ms: 50 * 90 - 980 ms of allowance, far more than the budget.
        let fast = p.allowance_s(50, t0 + Duration::from_millis(980), target);
        assert_eq!(paced_chunk(fast, costs(2.5, 20.0), 128), 128);
        // 10 tokens in 2 s: already over; the floor keeps prompts moving.
        let late = p.allowance_s(10, t0 + Duration::from_secs(2), target);
        assert!(late < 0.0);
        assert_eq!(paced_chunk(late, costs(2.5, 20.0), 128), MIN_PACED_CHUNK);
        // The floor never exceeds what the budget left.
        assert_eq!(paced_chunk(late, costs(2.5, 20.0), 5), 5);
        // Unknown prompt cost: the budget alone.
        assert_eq!(paced_chunk(late, costs(0.0, 20.0), 128), 128);
    }
}
