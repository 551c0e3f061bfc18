//! SLO admission: how many streams one node may decode at once so that the time between a
//! stream's tokens stays within the TPOT target (its seat cap), and which prompts would wait
//! past the TTFT target.
//!
//! Here, not in the coordinator, so that the coordinator's registry and `cleave bench simulate`
//! run the same rules (sans-IO: cumulative step totals in, caps and rates out, no clock).
//!
//! Without it, a load past the cluster's capacity at the target is admitted anyway: every
//! node's batch grows until each step takes longer than the target, and every request misses
//! (on the recorded rate steps, 16-33% of requests within both targets on every shape). With
//! it, a node takes no new stream while it holds its cap; requests wait at the edge for a seat,
//! and one that has waited so long it could no longer make its TTFT is refused (503, nothing
//! sent: the client may retry elsewhere) instead of being served late: the cluster serves what
//! it can serve within the targets, and says no to the rest at once.
//!
//! The cap is closed-loop, from what the node says it does (its step totals, decode-only and
//! mixed steps alike: the time a running sequence waits for each token): sans-IO, no clock.
//! - No cap until the node runs over the target: an unloaded cluster routes as without
//!   admission.
//! - Over the target (mean step time above `MARGIN` x target): the cap becomes the batch the
//!   node ran times target over step time. Step time grows affinely with the batch (a fixed
//!   cost plus a per-sequence one), so from above the target this lands between the batch that
//!   meets it and the batch that ran, and repeated, converges on the first.
//! - Clearly within the target (below 0.9 x the held time) while the cap turned requests
//!   away: the cap grows by a quarter (at least one seat), or to the proportional estimate
//!   when that is more. From a batch far below capacity the proportional estimate is too low
//!   (the fixed cost is most of a small batch's step), so growth is what finds the capacity.
//!
//! The TTFT half: a request whose prefill node has more prompt work queued than it gets
//! through before the TTFT target (the request's wait so far, plus the queue at the node's
//! measured prompt rate, [`PromptRate`]) is refused at once rather than queued to miss.
//!
//! Invariant: the cap, when set, is at least 1 (a node always takes one stream).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A node's cumulative step totals as SLO admission reads them (monotonic; a node that
/// restarts starts from 0 again, which is seen as totals that went back).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepTotals {
    /// Steps that decoded (decode-only and mixed alike), the sequences they carried (sum of
    /// batch sizes), and their wall time in microseconds: the time running sequences waited
    /// for their tokens.
    pub decode_steps: u64,
    pub decode_seqs: u64,
    pub decode_us: u64,
    /// Prompt tokens computed in prefill-only steps, and those steps' wall time.
    pub prefill_tokens: u64,
    pub prefill_us: u64,
}

/// Share of the TPOT target the mean step time is held to: the p90 the target is judged by
/// sits above the mean (steps that carry a prompt chunk, the tokens' trip to the client).
pub const MARGIN: f64 = 0.85;
/// A cap that turned requests away grows only while the mean step is below this share of the
/// held time: between it and the held time the cap rests (without the band, a cap at capacity
/// grows past it at every reading that lands just inside, and falls back at the next).
const GROW_BELOW: f64 = 0.9;
/// Steps a reading spans at least (at 100 ms a step, under a second: two or more reports).
const MIN_STEPS: u64 = 8;
/// No node is capped above this many streams.
const MAX_CAP: f64 = 4096.0;

/// SLO admission's settings (the planner's targets).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Admission {
    /// A request predicted past it (its wait so far, plus the prompt work queued ahead of it on
    /// its prefill node at that node's measured rate) is refused at once.
    pub ttft_target: Duration,
    /// The time per output token a prefill or decode node's streams are held to.
    pub tpot_target: Duration,
    /// The time per output token a colocated node's streams are held to: its hold
    /// ([`crate::Targets::colocated_tpot_ms`]), at most `tpot_target`.
    pub colocated_tpot_target: Duration,
    /// How long a request may wait for a seat before it is refused: what is left of the TTFT
    /// target for its prefill after that.
    pub max_wait: Duration,
}

impl Admission {
    /// From the targets: a request may wait half its TTFT target for a seat.
    pub fn from_targets(ttft_target: Duration, tpot_target: Duration) -> Self {
        Self { ttft_target, tpot_target, colocated_tpot_target: tpot_target, max_wait: ttft_target / 2 }
    }

    /// Colocated nodes held to `hold` instead (at most the TPOT target).
    pub fn holding_colocated(mut self, hold: Duration) -> Self {
        self.colocated_tpot_target = hold.min(self.tpot_target);
        self
    }

    /// The time per token a node's seats are sized to: colocated nodes' hold, else the target.
    pub fn tpot_target_for(&self, colocated: bool) -> Duration {
        if colocated {
            self.colocated_tpot_target
        } else {
            self.tpot_target
        }
    }

    /// From the planner's targets in milliseconds (validated finite and positive, but not
    /// bounded: a target past what a `Duration` holds saturates instead of panicking).
    pub fn from_target_ms(ttft_ms: f64, tpot_ms: f64) -> Self {
        let d = |ms: f64| Duration::try_from_secs_f64(ms / 1e3).unwrap_or(Duration::MAX);
        Self::from_targets(d(ttft_ms), d(tpot_ms))
    }
}

/// One node's seat cap and the step totals it was last read from.
#[derive(Debug, Clone, Default)]
pub struct Seats {
    /// Steps that decoded, the sequences they carried, their time (us): at the last reading.
    base: Option<[u64; 3]>,
    cap: Option<f64>,
    /// The cap turned a request away since the last reading.
    bound: bool,
}

impl Seats {
    /// The most streams the node takes now (None: no cap).
    pub fn cap(&self) -> Option<u32> {
        self.cap.map(|c| (c.floor() as u32).max(1))
    }

    /// Whether the node is full: `active` streams routed to it hold every seat.
    pub fn is_full(&self, active: u32) -> bool {
        self.cap().is_some_and(|c| active >= c)
    }

    /// The cap turned a request away (it may grow at the next reading if the node keeps up).
    pub fn turned_away(&mut self) {
        self.bound = true;
    }

    /// Folds a load report's cumulative step totals in.
    pub fn observe(&mut self, t: &StepTotals, target: Duration) {
        let cur = [t.decode_steps, t.decode_seqs, t.decode_us];
        let Some(base) = self.base else {
            self.base = Some(cur);
            return;
        };
        if cur.iter().zip(base).any(|(c, b)| *c < b) {
            // Totals went back: the node restarted. Start over from here.
            self.base = Some(cur);
            return;
        }
        let [steps, seqs, us] = [cur[0] - base[0], cur[1] - base[1], cur[2] - base[2]];
        if steps < MIN_STEPS {
            return;
        }
        self.base = Some(cur);
        let target = target.as_secs_f64();
        if us == 0 || target <= 0.0 {
            return;
        }
        let step = us as f64 / 1e6 / steps as f64;
        let batch = seqs as f64 / steps as f64;
        let goal = MARGIN * target;
        let est = batch * goal / step;
        self.cap = if step > goal {
            Some(est)
        } else if self.bound && step < GROW_BELOW * goal {
            let c = self.cap.unwrap_or(batch);
            Some(est.max(c * 1.25).max(c + 1.0))
        } else {
            self.cap.map(|c| c.max(est))
        }
        .map(|c| c.clamp(1.0, MAX_CAP));
        self.bound = false;
    }
}

/// Prompt tokens a second a node prefills, from its prefill-only steps (a colocated node's
/// prompts beside decodes go slower: the estimate errs toward admitting).
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptRate {
    /// Prompt tokens and their time (us) at the last reading.
    base: Option<[u64; 2]>,
    rate: Option<f64>,
}

/// Prompt tokens a reading spans at least.
const MIN_PROMPT_TOKENS: u64 = 256;

impl PromptRate {
    pub fn tokens_per_s(&self) -> Option<f64> {
        self.rate
    }

    /// Folds a load report's cumulative step totals in (an even mix of the last reading and
    /// the one before).
    pub fn observe(&mut self, t: &StepTotals) {
        let cur = [t.prefill_tokens, t.prefill_us];
        let Some(base) = self.base else {
            self.base = Some(cur);
            return;
        };
        if cur[0] < base[0] || cur[1] < base[1] {
            self.base = Some(cur);
            return;
        }
        let [tokens, us] = [cur[0] - base[0], cur[1] - base[1]];
        if tokens < MIN_PROMPT_TOKENS || us == 0 {
            return;
        }
        self.base = Some(cur);
        let r = tokens as f64 * 1e6 / us as f64;
        self.rate = Some(self.rate.map_or(r, |old| 0.5 * old + 0.5 * r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node whose step takes `fixed + per_seq * batch` seconds, run at `batch` for `steps`.
    fn run(t: &mut StepTotals, batch: u64, steps: u64, fixed: f64, per_seq: f64) {
        t.decode_steps += steps;
        t.decode_seqs += batch * steps;
        t.decode_us += (steps as f64 * (fixed + per_seq * batch as f64) * 1e6) as u64;
    }

    const T: Duration = Duration::from_millis(100);

    #[test]
    fn targets_past_what_a_duration_holds_saturate() {
        let a = Admission::from_target_ms(1e300, 100.0);
        assert_eq!((a.ttft_target, a.tpot_target), (Duration::MAX, Duration::from_millis(100)));
        assert_eq!(a.max_wait, Duration::MAX / 2);
        let a = Admission::from_target_ms(3000.0, 0.01);
        assert_eq!((a.ttft_target, a.tpot_target), (Duration::from_secs(3), Duration::from_micros(10)));
    }

    /// A request asks for a seat on a node holding `active` streams: refused when it is full.
    fn ask(s: &mut Seats, active: u32) -> bool {
        let full = s.is_full(active);
        if full {
            s.turned_away();
        }
        full
    }

    #[test]
    fn no_cap_until_the_node_runs_over_the_target() {
        let (mut s, mut t) = (Seats::default(), StepTotals::default());
        s.observe(&t, T);
        for b in [1, 4, 8] {
            run(&mut t, b, 20, 0.020, 0.005);
            s.observe(&t, T);
            assert_eq!(s.cap(), None, "batch {b} runs within the target");
            assert!(!ask(&mut s, 1000));
        }
    }

    #[test]
    fn over_the_target_the_cap_converges_on_the_batch_that_meets_it() {
        // 20 ms + 5 ms a sequence: 85 ms (the margin) is 13 sequences.
        let (mut s, mut t) = (Seats::default(), StepTotals::default());
        s.observe(&t, T);
        let mut batch = 30;
        for _ in 0..12 {
            run(&mut t, batch, 20, 0.020, 0.005);
            s.observe(&t, T);
            let cap = s.cap().expect("over the target");
            // The node fills every seat it has (a load past capacity).
            assert!(ask(&mut s, cap));
            batch = u64::from(cap);
        }
        assert!((12..=14).contains(&batch), "converged on {batch}");
    }

    #[test]
    fn a_cap_that_turns_requests_away_within_the_target_grows_to_capacity() {
        // Capped low after a burst of slow steps (mixed steps), then the steps are quick: the
        // proportional estimate from 2 sequences is 85 / 30 * 2 = 5.7, the capacity 13.
        let (mut s, mut t) = (Seats::default(), StepTotals::default());
        s.observe(&t, T);
        run(&mut t, 4, 20, 0.300, 0.0);
        s.observe(&t, T);
        assert_eq!(s.cap(), Some(1));
        let mut batch = 1;
        for _ in 0..20 {
            assert!(ask(&mut s, batch as u32), "a load past capacity fills every seat");
            run(&mut t, batch, 20, 0.020, 0.005);
            s.observe(&t, T);
            batch = u64::from(s.cap().unwrap());
        }
        assert!((12..=17).contains(&batch), "grew to {batch}");
    }

    #[test]
    fn a_cap_nothing_presses_on_does_not_grow_on_its_own() {
        let (mut s, mut t) = (Seats::default(), StepTotals::default());
        s.observe(&t, T);
        run(&mut t, 20, 20, 0.020, 0.005);
        s.observe(&t, T);
        let cap = s.cap().unwrap();
        run(&mut t, 2, 50, 0.020, 0.005);
        s.observe(&t, T);
        // The estimate from 2 sequences (5.7) is below the cap: it stays.
        assert_eq!(s.cap(), Some(cap));
    }

    #[test]
    fn few_steps_are_not_a_reading_and_a_restart_starts_over() {
        let (mut s, mut t) = (Seats::default(), StepTotals::default());
        s.observe(&t, T);
        run(&mut t, 30, 3, 0.020, 0.005);
        s.observe(&t, T);
        assert_eq!(s.cap(), None, "3 steps are too few");
        run(&mut t, 30, 10, 0.020, 0.005);
        s.observe(&t, T);
        assert!(s.cap().is_some());
        let cap = s.cap();
        let mut fresh = StepTotals::default();
        run(&mut fresh, 1, 20, 0.5, 0.0);
        s.observe(&fresh, T);
        assert_eq!(s.cap(), cap, "the totals went back: no reading across the restart");
    }

    #[test]
    fn the_prompt_rate_is_read_over_enough_prompt_tokens() {
        let (mut r, mut t) = (PromptRate::default(), StepTotals::default());
        r.observe(&t);
        t.prefill_tokens += 100;
        t.prefill_us += 100_000;
        r.observe(&t);
        assert_eq!(r.tokens_per_s(), None, "100 tokens are too few");
        t.prefill_tokens += 300;
        t.prefill_us += 300_000;
        r.observe(&t);
        assert_eq!(r.tokens_per_s(), Some(1000.0));
        t.prefill_tokens += 2000;
        t.prefill_us += 1_000_000;
        r.observe(&t);
        assert_eq!(r.tokens_per_s(), Some(1500.0), "half the old, half the new");
    }

    #[test]
    fn over_the_target_the_cap_is_the_batch_times_the_margin_over_the_mean_step() {
        let (mut s, mut t) = (Seats::default(), StepTotals::default());
        s.observe(&t, T);
        run(&mut t, 4, 20, 0.020, 0.005);
        // Twenty more steps of the same four sequences at 250 ms (a chunk beside them).
        t.decode_steps += 20;
        t.decode_seqs += 80;
        t.decode_us += 20 * 250_000;
        s.observe(&t, T);
        assert_eq!(s.cap(), Some(2), "mean step 145 ms at batch 4: 4 x 85 / 145");
    }
}
