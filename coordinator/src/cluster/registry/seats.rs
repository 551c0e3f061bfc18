//! What SLO admission ([`cleave_planner::admission`]) reads of a node's load report: the rules
//! live in the planner crate so that `cleave bench simulate` runs them too; this is the
//! mapping from the wire's step totals to theirs.

use cleave_planner::admission::StepTotals;

/// A report's cumulative step totals as admission reads them. Mixed steps (a prompt chunk
/// beside decodes) count as decode steps: their time is time every running sequence waited
/// for its token, which is what the TPOT target bounds. Prompt tokens count from prefill-only
/// steps (a colocated node's chunks beside decodes go slower: the rate errs toward admitting).
pub(super) fn admission_totals(t: &cleave_protocol::control::StepTotals) -> StepTotals {
    StepTotals {
        decode_steps: t.decode_steps + t.mixed_steps,
        decode_seqs: t.decode_seqs + t.mixed_seqs,
        decode_us: t.decode_us + t.mixed_us,
        prefill_tokens: t.prefill_tokens,
        prefill_us: t.prefill_us,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_planner::admission::Seats;
    use std::time::Duration;

    #[test]
    fn mixed_steps_count_as_time_waited_for_a_token() {
        let mut wire = cleave_protocol::control::StepTotals::default();
        let mut s = Seats::default();
        let t = Duration::from_millis(100);
        s.observe(&admission_totals(&wire), t);
        // 20 decode-only steps of 4 sequences at 40 ms, and 20 mixed ones at 250 ms.
        wire.decode_steps += 20;
        wire.decode_seqs += 80;
        wire.decode_us += 20 * 40_000;
        wire.mixed_steps += 20;
        wire.mixed_seqs += 80;
        wire.mixed_us += 20 * 250_000;
        wire.prefill_tokens += 1000;
        wire.prefill_us += 1_000_000;
        let a = admission_totals(&wire);
        assert_eq!((a.decode_steps, a.decode_seqs, a.decode_us), (40, 160, 5_800_000));
        assert_eq!((a.prefill_tokens, a.prefill_us), (1000, 1_000_000));
        s.observe(&a, t);
        assert_eq!(s.cap(), Some(2), "mean step 145 ms at batch 4: 4 x 85 / 145");
    }
}
