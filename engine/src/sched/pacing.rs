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
/// moving when decodes have no slack left. Small, because a prompt row costs about what a
/// decode row does: at 16 (the first floor tried) a step of one decode and the floor ran
/// 104 ms for SmolLM2 Q4_1 on one core of the benchmark VM, past a 100-ms target on its own.
pub const MIN_PACED_CHUNK: usize = 4;

/// Share of the target the allowance aims at: the client's time per token also counts the
/// network and the coordinator, which the node does not see.
pub const PACING_MARGIN: f64 = 0.9;

/// Chunk sizes whose prompt-token cost is tracked apart: bucket `i` holds chunks from
/// `CHUNK_BUCKETS[i]` up to the next bucket's start. A prompt token costs far more in a small
/// chunk than in a large one (a 16-token chunk is a skinny matrix product that streams the
/// weights much as a decode step does: 3.4 ms a token against 1.7 at 128 for SmolLM2 Q4_1 on
/// one core), so one average would cut chunks wrong at both ends.
pub const CHUNK_BUCKETS: [usize; 7] = [4, 8, 16, 32, 64, 128, 256];

/// The bucket of a chunk of `tokens` (None below the smallest).
pub fn chunk_bucket(tokens: usize) -> Option<usize> {
    CHUNK_BUCKETS.iter().rposition(|&lo| tokens >= lo)
}

/// What the runner measured steps to cost: a decode-only step at the current batch, and the
/// marginal time of a prompt token by chunk bucket (None: no chunk of that size seen yet).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepCosts {
    pub decode_step: Duration,
    pub prompt_token: [Option<Duration>; CHUNK_BUCKETS.len()],
}

impl StepCosts {
    /// Whether any prompt-token cost is known (pacing needs one).
    pub fn known(&self) -> bool {
        self.prompt_token.iter().any(Option::is_some)
    }
}

/// One decoding sequence's pace: when its first token here was out (the start of the step
/// after the one that sampled it), and how many tokens it had then.
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
/// seconds), the costs, and the budget left after the decodes: the largest chunk whose
/// predicted step (the decode step plus the chunk at its own bucket's cost per token) fits,
/// trying large buckets first; a bucket not measured yet is skipped (its chunks are tried
/// once the floor or a smaller bucket measured the cost). At least [`MIN_PACED_CHUNK`].
pub(super) fn paced_chunk(allowance_s: f64, costs: &StepCosts, budget: usize) -> usize {
    let room = allowance_s - costs.decode_step.as_secs_f64();
    let mut chunk = 0;
    if room.is_finite() && room > 0.0 {
        for (i, &lo) in CHUNK_BUCKETS.iter().enumerate().rev() {
            let per_token = costs.prompt_token[i].map_or(0.0, |d| d.as_secs_f64());
            if lo > budget || per_token <= 0.0 {
                continue;
            }
            let fits = (room / per_token).min(budget as f64);
            if fits >= lo as f64 {
                chunk = fits as usize;
                break;
            }
        }
    }
    chunk.max(MIN_PACED_CHUNK).min(budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same cost per prompt token in every bucket.
    fn costs(prompt_ms: f64, decode_ms: f64) -> StepCosts {
        let p = (prompt_ms > 0.0).then(|| Duration::from_secs_f64(prompt_ms / 1e3));
        StepCosts { decode_step: Duration::from_secs_f64(decode_ms / 1e3), prompt_token: [p; CHUNK_BUCKETS.len()] }
    }

    #[test]
    fn a_fresh_sequence_allows_what_fits_under_the_target() {
        let t0 = Instant::now();
        let p = Pace { since: t0, generated_then: 1 };
        let a = p.allowance_s(1, t0, Duration::from_millis(100));
        assert!((a - 0.09).abs() < 1e-9, "{a}");
        // 90 ms less a 20-ms decode step at 2.5 ms a prompt token: 28 tokens.
        assert_eq!(paced_chunk(a, &costs(2.5, 20.0), 128), 28);
    }

    #[test]
    fn banked_slack_lets_larger_chunks_through_and_lateness_floors_them() {
        let t0 = Instant::now();
        let p = Pace { since: t0, generated_then: 1 };
        let target = Duration::from_millis(100);
        // 50 tokens at 20 ms: 50 * 90 - 980 ms of allowance, far more than the budget.
        let fast = p.allowance_s(50, t0 + Duration::from_millis(980), target);
        assert_eq!(paced_chunk(fast, &costs(2.5, 20.0), 128), 128);
        // 10 tokens in 2 s: already over; the floor keeps prompts moving.
        let late = p.allowance_s(10, t0 + Duration::from_secs(2), target);
        assert!(late < 0.0);
        assert_eq!(paced_chunk(late, &costs(2.5, 20.0), 128), MIN_PACED_CHUNK);
        // The floor never exceeds what the budget left.
        assert_eq!(paced_chunk(late, &costs(2.5, 20.0), 3), 3);
        assert!(!costs(0.0, 20.0).known());
    }

    #[test]
    fn each_chunk_size_is_costed_at_its_own_bucket() {
        // SmolLM2 Q4_1 on one core: 3.4 ms a token in 16-token chunks, 1.7 ms at 128.
        let ms = |x: f64| Some(Duration::from_secs_f64(x / 1e3));
        let c = StepCosts {
            decode_step: Duration::from_millis(15),
            prompt_token: [None, None, ms(3.4), None, ms(2.3), ms(1.7), None],
        };
        // 90 ms: 75 ms of room; 44 tokens at 1.7 (below 128), 32 at 2.3 (below 64), 22 at 3.4.
        assert_eq!(paced_chunk(0.09, &c, 128), 22);
        // 300 ms: 285 ms of room, 167 tokens at 1.7: the budget caps it.
        assert_eq!(paced_chunk(0.3, &c, 128), 128);
        assert_eq!(paced_chunk(0.3, &c, 512), 167);
        // 150 ms: 135 ms, 79 at 1.7 (below 128), 58 at 2.3 (below 64), 39 at 3.4.
        assert_eq!(paced_chunk(0.15, &c, 512), 39);
        // Only the large chunk's cost known (unpaced steps so far): the floor measures the small.
        let big = StepCosts { prompt_token: [None, None, None, None, None, ms(1.7), None], ..c };
        assert_eq!(paced_chunk(0.09, &big, 128), MIN_PACED_CHUNK);
        // A budget below a bucket's start: that bucket's cost is the one for it.
        let small = StepCosts { prompt_token: [None, None, ms(3.4), None, None, None, None], ..c };
        assert_eq!(paced_chunk(0.5, &small, 100), 100);
        assert_eq!(chunk_bucket(3), None);
        assert_eq!(chunk_bucket(16), Some(2));
        assert_eq!(chunk_bucket(200), Some(5));
        assert_eq!(chunk_bucket(4096), Some(6));
    }
}
