//! Closed-loop scenarios on a deterministic toy cluster (time injected, no sleeps, no
//! randomness beyond a seeded generator): the planner's decisions against queues building,
//! decode batches growing, noise at a threshold, and colocation versus disaggregation.

mod common;

use std::time::Duration;

use cleave_planner::{Decision, Mode, Reason, Role};
use common::{config, limits, secs, Sim};

const PROMPT: u32 = 200;
const TICK: Duration = Duration::from_secs(1);

/// Seconds to prefill one 200-token prompt on one node (10 ms + 2 ms/token), and the node's
/// token rate.
const SERVICE_S: f64 = 0.410;
const NODE_TOKENS_PER_S: f64 = PROMPT as f64 / SERVICE_S;

/// (1) Demand rises toward one prefill node's capacity (2.44 req/s) and the queue on it starts
/// to build. Clients have only ever seen a small fraction of the 3 s TTFT target; a planner
/// sizing the pool from service time (0.41 s) or from the completion rate would never move.
/// The planner must add prefill capacity while observed p90 TTFT is still under target.
#[test]
fn a_building_queue_raises_prefill_before_observed_ttft_crosses_target() {
    let cfg = config(Mode::Auto, 3000.0, 200.0, limits(2, 2, 0, 3), true);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    let mut backlog = 0.0f64;
    let mut first: Option<(f64, Decision)> = None;
    let mut worst_client_ttft = 0.0f64;
    for step in 0..150 {
        let t = f64::from(step);
        let rate = 1.0 + 0.02 * t; // 1 req/s, +1.2 req/s per minute
        sim.arrive(rate, TICK, PROMPT, 100);
        // A fluid queue: prefill capacity of the prefill pool, backlog when demand exceeds it.
        let capacity = f64::from(sim.count(Role::Prefill)) * NODE_TOKENS_PER_S;
        backlog = (backlog + rate * f64::from(PROMPT) - capacity).max(0.0);
        let ttft = SERVICE_S + backlog / capacity + 0.05;
        worst_client_ttft = worst_client_ttft.max(ttft);
        // Completions come at most at the pool's capacity (a saturated system caps them).
        let served = rate.min(capacity / f64::from(PROMPT)).floor() as u32;
        sim.complete(served, secs(ttft), Duration::from_millis(45), 100);
        for n in sim.nodes_of(Role::Prefill) {
            n.queued_prefill_tokens = backlog as u64;
        }
        if let Some(d) = sim.tick() {
            sim.apply(&d);
            first.get_or_insert((t, d));
        }
    }
    let (t, d) = first.expect("the planner never added prefill capacity");
    assert_eq!((d.current.prefill, d.target.prefill, d.target.decode), (1, 2, 1), "{d:?}");
    assert_eq!(d.reason, Reason::TtftRisk, "{}", d.why);
    let observed = d.inputs.observed_ttft_ms.expect("completions were observed");
    assert!(observed < 3000.0, "decided only after clients saw {observed} ms");
    // The current configuration was predicted past the scale-up margin: TTFT or prefill
    // utilisation (the M/G/1 queue is near saturation).
    let pc = d.predicted.current;
    assert!(pc.ttft_ms.is_none_or(|p| p > 0.9 * 3000.0) || pc.prefill_utilisation > 0.9, "{d:?}");
    // Acted before the queue's fluid TTFT reached the target, and the added node held it.
    assert!(worst_client_ttft < 3.0, "clients saw {worst_client_ttft} s (decision at {t} s)");
    assert_eq!(sim.count(Role::Prefill), 2);
}

/// (1b) A burst queues 30 prompts (6000 tokens) on the prefill node at once. The window's
/// arrival rate barely moves (the burst is spread over 30 s), and no completion has been slow
/// yet; the backlog alone must raise the prediction and add a prefill node.
#[test]
fn a_queued_burst_adds_prefill_before_any_client_sees_it() {
    let cfg = config(Mode::Auto, 3000.0, 200.0, limits(2, 2, 0, 3), true);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    for _ in 0..60 {
        sim.arrive(0.5, TICK, PROMPT, 100);
        sim.complete(1, Duration::from_millis(500), Duration::from_millis(45), 100);
        assert!(sim.tick().is_none());
    }
    let e = sim.planner.estimate(&sim.snapshot());
    assert!(e.predicted.ttft_ms.unwrap() < 0.9 * 3000.0, "{e:?}");
    // The burst's arrivals, spread over the last 30 s (the window holds 20 of them).
    for i in 0..30 {
        sim.planner.on_arrival(cleave_planner::Arrival {
            at: sim.now - secs(30.0) + secs(f64::from(i)),
            prompt_tokens: PROMPT,
            max_tokens: 100,
        });
    }
    let mut decision = None;
    for _ in 0..5 {
        sim.arrive(0.5, TICK, PROMPT, 100);
        for n in sim.nodes_of(Role::Prefill) {
            n.queued_prefill_tokens = 6000;
        }
        if let Some(d) = sim.tick() {
            decision = Some(d);
            break;
        }
    }
    let d = decision.expect("a 6000-token backlog (12 s of prefill) did not raise the prefill target");
    assert_eq!((d.target.prefill, d.target.decode), (2, 1), "{d:?}");
    assert_eq!(d.reason, Reason::TtftRisk);
    assert!(d.inputs.observed_ttft_ms.unwrap() < 3000.0);
    assert!(d.inputs.arrival_rate < 2.0, "the rate alone explains nothing: {}", d.inputs.arrival_rate);
    assert!(d.why.contains("queue 6000 tokens"), "{}", d.why);
}

/// (2) Demand rises and decode batches grow (the decode node reports its running sequences,
/// clients report TPOT) until TPOT nears its 100 ms target. With the node count fixed, the
/// planner must move a prefill node to decode: 2p1d -> 1p2d.
#[test]
fn decode_batch_growth_moves_a_prefill_node_to_decode() {
    let cfg = config(Mode::Auto, 3000.0, 100.0, limits(2, 2, 0, 3), false);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Prefill, Role::Decode]);
    let output = 200u32;
    let mut decided = None;
    for step in 0..120 {
        let rate = 1.0 + 0.02 * f64::from(step);
        sim.arrive(rate, TICK, 100, output);
        // Little's law on the decode pool: B = rate * O * TPOT / m with TPOT = 40 ms + 1 ms * B.
        let m = f64::from(sim.count(Role::Decode));
        let k = rate * f64::from(output) / m;
        let batch = k * 0.040 / (1.0 - k * 0.001);
        let tpot = 0.040 + 0.001 * batch;
        sim.complete(rate.floor() as u32, Duration::from_millis(300), secs(tpot), output);
        for n in sim.nodes_of(Role::Decode) {
            n.running_seqs = batch.round() as u32;
        }
        if let Some(d) = sim.tick() {
            sim.apply(&d);
            assert!(decided.is_none(), "second decision {d:?}");
            decided = Some((tpot, d));
        }
    }
    let (tpot, d) = decided.expect("decode growth never moved capacity");
    assert_eq!((d.current.prefill, d.current.decode), (2, 1));
    assert_eq!((d.target.prefill, d.target.decode, d.target.colocated), (1, 2, 0), "{d:?}");
    assert!(matches!(d.reason, Reason::TpotRisk | Reason::TpotBreach), "{:?}: {}", d.reason, d.why);
    assert!(tpot < 0.100, "moved only once clients saw {tpot} s TPOT");
    assert_eq!(d.actions.len(), 1);
    assert!(matches!(d.actions[0], cleave_planner::Action::SwitchRole { from: Role::Prefill, to: Role::Decode, .. }));
}

/// A small seeded generator (xorshift64*), so the noise is the same on every run.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The arrival rate at which the prediction for `roles` sits exactly at the scale-up threshold.
fn borderline_rate(roles: &[Role]) -> f64 {
    let (mut lo, mut hi) = (0.5, 2.4);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        let mut sim = Sim::new(config(Mode::Off, 3000.0, 200.0, limits(2, 2, 0, 3), true), roles);
        for _ in 0..40 {
            sim.arrive(mid, TICK, PROMPT, 100);
        }
        let e = sim.planner.estimate(&sim.snapshot());
        let ratio = (e.predicted.ttft_ms.unwrap_or(f64::INFINITY) / 3000.0).max(e.predicted.prefill_utilisation);
        if ratio > 0.9 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    lo
}

/// Ten minutes of demand jittering +-10% (a new level every 20 s) around the rate where the
/// starting configuration is borderline: its prediction crosses the scale-up threshold both
/// ways many times. Returns the changes made.
fn noisy_run(roles: &[Role], can_add_nodes: bool) -> Vec<Decision> {
    let level = borderline_rate(roles);
    let mut sim = Sim::new(config(Mode::Auto, 3000.0, 200.0, limits(2, 2, 0, 3), can_add_nodes), roles);
    // A shadow planner that never acts, to watch the starting configuration's prediction.
    let mut shadow = Sim::new(config(Mode::Off, 3000.0, 200.0, limits(2, 2, 0, 3), can_add_nodes), roles);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rate = level;
    let (mut above, mut below) = (0, 0);
    let mut changes = Vec::new();
    for step in 0..600 {
        if step % 20 == 0 {
            rate = level * (0.9 + 0.2 * rng.uniform());
        }
        sim.arrive(rate, TICK, PROMPT, 100);
        shadow.arrive(rate, TICK, PROMPT, 100);
        if step >= 30 {
            let e = shadow.planner.estimate(&shadow.snapshot());
            let ratio = (e.predicted.ttft_ms.unwrap_or(f64::INFINITY) / 3000.0).max(e.predicted.prefill_utilisation);
            if ratio > 0.9 {
                above += 1;
            } else {
                below += 1;
            }
        }
        if let Some(d) = sim.tick() {
            sim.apply(&d);
            changes.push(d);
        }
    }
    assert!(above >= 30 && below >= 30, "the noise never straddled the threshold: {above} above, {below} below");
    changes
}

/// (3) Noise around the threshold does not flap: at most one change in ten minutes, whether
/// nodes can be added (1p1d, budget 3) or only roles can move (3 nodes, 1p2d).
#[test]
fn noise_around_the_threshold_does_not_flap() {
    for (roles, can_add) in
        [(&[Role::Prefill, Role::Decode][..], true), (&[Role::Prefill, Role::Decode, Role::Decode][..], false)]
    {
        let changes = noisy_run(roles, can_add);
        let whys: Vec<_> = changes.iter().map(|d| (d.at_ms, d.why.as_str())).collect();
        assert!(changes.len() <= 1, "{roles:?}, can_add_nodes {can_add}: {} changes: {whys:#?}", changes.len());
    }
}

/// (6) Short prompts (64 tokens, 32 outputs) at 2 req/s on the small CPU model. With a loose
/// TPOT target (150 ms) one colocated node serves everything, fewer nodes than any
/// disaggregated split; with a tight one (55 ms) the prefill steps it interleaves (~170 ms)
/// break TPOT, and disaggregated pools are chosen.
fn colocation_run(tpot_ms: f64, roles: &[Role]) -> (Sim, Vec<Decision>) {
    let cfg = config(Mode::Auto, 3000.0, tpot_ms, limits(4, 4, 4, 4), true);
    let mut sim = Sim::new(cfg, roles);
    let mut decisions = Vec::new();
    for _ in 0..90 {
        sim.arrive(2.0, TICK, 64, 32);
        if let Some(d) = sim.tick() {
            sim.apply(&d);
            decisions.push(d);
        }
    }
    (sim, decisions)
}

#[test]
fn loose_tpot_with_short_prompts_colocates() {
    let (sim, decisions) = colocation_run(150.0, &[Role::Prefill, Role::Decode]);
    let d = decisions.first().expect("kept 1p1d although one colocated node suffices");
    assert_eq!(d.reason, Reason::Colocate, "{}", d.why);
    assert_eq!((d.target.prefill, d.target.decode, d.target.colocated), (0, 0, 1), "{d:?}");
    assert!(d.target.step_budget.is_some());
    assert_eq!((sim.count(Role::Prefill), sim.count(Role::Decode), sim.count(Role::Both)), (0, 0, 1));
    assert_eq!(decisions.len(), 1, "{decisions:?}");
}

#[test]
fn tight_tpot_keeps_or_picks_disaggregated_pools() {
    let (_, decisions) = colocation_run(55.0, &[Role::Prefill, Role::Decode]);
    assert!(decisions.is_empty(), "left disaggregated pools: {decisions:?}");
    let (sim, decisions) = colocation_run(55.0, &[Role::Both, Role::Both]);
    let d = decisions.first().expect("kept colocated nodes that miss a tight TPOT");
    assert_eq!(d.reason, Reason::Disaggregate, "{}", d.why);
    assert_eq!(d.target.colocated, 0, "{d:?}");
    assert!(d.target.prefill >= 1 && d.target.decode >= 1);
    assert_eq!(sim.count(Role::Both), 0);
    // The same workload on the same colocated nodes is fine with the loose target.
    let (_, loose) = colocation_run(150.0, &[Role::Both, Role::Both]);
    assert!(loose.iter().all(|d| d.target.prefill + d.target.decode == 0), "{loose:?}");
}

/// (7) Two configurations that both miss the targets, each predicted better than the other
/// measured (the model is wrong about both: the prefill node queues more than predicted, the
/// colocated nodes' decodes stall more than predicted). A planner that trusts its predictions
/// over what clients saw trades them back and forth every cooldown (40 changes in these 10
/// minutes); this one remembers what each was like under the same demand, so it tries each
/// once and tries again only when that memory expires (ten windows, 5 minutes here).
#[test]
fn two_failing_configurations_are_not_traded_forever() {
    let cfg = config(Mode::Auto, 3000.0, 100.0, limits(2, 2, 2, 2), false);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    let mut decisions = Vec::new();
    for step in 0..600 {
        let rate = 1.6;
        let n = sim.arrive(rate, TICK, PROMPT, 64);
        let colocated = sim.count(Role::Both) > 0;
        // What clients see: 1p1d misses TTFT three times over, 2c misses TPOT 2.5 times over.
        let (ttft, tpot) = if colocated { (0.3, 0.25) } else { (9.0, 0.05) };
        sim.complete(n, secs(ttft), secs(tpot), 64);
        for node in sim.nodes.iter_mut() {
            node.queued_prefill_tokens = if node.role == Role::Prefill { 4000 } else { 0 };
        }
        if let Some(d) = sim.tick() {
            decisions.push((step, d.current, d.target, d.why.clone()));
            let d = sim.planner.decisions().last().cloned().unwrap();
            sim.apply(&d);
        }
    }
    assert!(!decisions.is_empty(), "the planner never left a failing configuration");
    assert!(decisions.len() <= 5, "traded configurations {} times: {decisions:#?}", decisions.len());
    // Out, back (the model's first guess), out again to the better of the two, and stay.
    let first_five_minutes: Vec<_> = decisions.iter().filter(|d| d.0 < 300).collect();
    assert!(first_five_minutes.len() <= 3, "{} changes in 5 minutes: {decisions:#?}", first_five_minutes.len());
    assert_eq!(first_five_minutes.last().unwrap().2.colocated, 2, "settled on the worse one: {decisions:#?}");
}

/// (8) The mix shifts: a minute of long prompts with short outputs at 0.5 req/s, which one
/// prefill and one decode node serve, then short prompts with long outputs at 3 req/s, whose
/// decode batch breaks a 70 ms TPOT on one decode node but not on two colocated ones. A window
/// straddling the shift averages the two mixes and describes neither; the planner must read
/// the new mix from the recent half of its window and re-split within half a window (15 s
/// here). Reading the whole window it moved 26 s after the shift.
#[test]
fn a_shift_in_the_mix_is_acted_on_within_half_a_window() {
    let cfg = config(Mode::Auto, 3000.0, 70.0, limits(2, 2, 2, 2), false);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    let mut decisions = Vec::new();
    for step in 0..120u32 {
        let (rate, prompt, out) = if step < 60 { (0.5, 400, 16) } else { (3.0, 32, 128) };
        sim.arrive(rate, TICK, prompt, out);
        if let Some(d) = sim.tick() {
            sim.apply(&d);
            decisions.push((step, d));
        }
    }
    let (step, d) = decisions.first().expect("never left 1p1d after the shift");
    assert!(*step >= 60, "moved during the steady first minute: {d:?}");
    assert_eq!(d.target.colocated, 2, "{d:?}");
    assert!(*step <= 60 + 15, "re-split {} s after the shift (window 30 s)", step - 60);
    assert_eq!(d.inputs.demand_span_s, 15.0, "demand not read from the recent half: {:?}", d.inputs);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
}

/// (9) Outputs are read as the share of `max_tokens` that completions used, applied to what
/// arrives now: after a minute of requests stopping at half their 64 `max_tokens`, arrivals
/// asking for 256 are expected to produce 128 tokens, not the 32 that the window's
/// completions (all from before the change) averaged.
#[test]
fn expected_outputs_are_the_used_share_of_what_arrivals_ask_for() {
    let cfg = config(Mode::Advise, 3000.0, 200.0, limits(2, 2, 0, 3), true);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    for _ in 0..60 {
        sim.arrive(1.0, TICK, PROMPT, 64);
        sim.complete(1, Duration::from_millis(300), Duration::from_millis(45), 32);
        sim.tick();
    }
    let e = sim.planner.estimate(&sim.snapshot());
    assert!((e.inputs.mean_output_tokens - 32.0).abs() < 1e-9, "{:?}", e.inputs);
    for _ in 0..20 {
        sim.arrive(1.0, TICK, PROMPT, 256);
        sim.tick();
    }
    let e = sim.planner.estimate(&sim.snapshot());
    assert_eq!(e.inputs.completions, 10, "{:?}", e.inputs);
    assert!((e.inputs.mean_output_tokens - 128.0).abs() < 1e-9, "{:?}", e.inputs);
}

/// (10) Nothing meets the targets: a decode step of one sequence is 66 ms against a 70 ms TPOT
/// target, and every second sequence in a batch adds 8 ms, so at p90 both 1p1d (one decoder
/// holding every sequence) and two colocated nodes (half the sequences each, a prompt's chunks
/// now and then) miss it. What differs is how many requests stay under it: on the one decoder
/// a request meets the target only when it decodes alone for most of its life, on two
/// colocated nodes whenever no prompt lands on its node meanwhile. Ranked by the p90 ratio the
/// planner stayed on 1p1d (and measured 15-23% against 28-31% for two colocated nodes); ranked
/// by predicted attainment it colocates, once, and says why.
#[test]
fn with_no_configuration_meeting_the_targets_the_one_keeping_most_requests_within_them_wins() {
    let costs = cleave_planner::LinearCosts {
        decode_fixed_s: 0.058,
        decode_s_per_seq: 0.008,
        prefill_fixed_s: 0.010,
        prefill_s_per_token: 0.0015,
        ..common::cpu_costs()
    };
    let cfg = config(Mode::Auto, 3000.0, 70.0, limits(2, 2, 2, 2), false);
    let mut sim = Sim::with_costs(cfg, &[Role::Prefill, Role::Decode], costs);
    let mut decisions = Vec::new();
    for step in 0..300u32 {
        sim.arrive(0.3, TICK, 384, 32);
        if let Some(d) = sim.tick() {
            sim.apply(&d);
            decisions.push((step, d));
        }
    }
    let (_, d) = decisions.first().expect("stayed on the split that keeps fewer requests within the targets");
    assert_eq!(d.target.colocated, 2, "{d:?}");
    let (now, then) = (d.predicted.current, d.predicted.target);
    assert!(now.tpot_ms.unwrap() > 70.0 && then.tpot_ms.unwrap() > 70.0, "something met the target: {d:?}");
    let (a_now, a_then) = (now.attainment.unwrap(), then.attainment.unwrap());
    assert!(a_then >= a_now + 0.05, "moved for {a_then} against {a_now}");
    assert!(d.why.contains("predicted to keep"), "{}", d.why);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
}

/// (10) Nodes that pace their prompt chunks to the TPOT target (as cleave's do) hold a colocated
/// node's TPOT near the target's margin however long the prompts. Under a light prefill-heavy
/// load that 1p1d serves, two colocated nodes serve it too: the planner hedges to them once
/// (a later decode-heavy shift then finds capacity on both nodes) and stays. Unpaced, the
/// same nodes stay 1p1d: a prompt's chunks would stall the decodes beside them.
#[test]
fn paced_nodes_are_hedged_to_colocation_once_under_a_load_both_shapes_serve() {
    let run = |paced: bool| {
        let cfg = config(Mode::Auto, 3000.0, 100.0, limits(2, 2, 2, 2), false);
        let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
        for n in sim.nodes.iter_mut() {
            n.paced = paced;
        }
        let mut decisions = Vec::new();
        for _ in 0..180 {
            sim.arrive(0.5, TICK, 384, 8);
            if let Some(d) = sim.tick() {
                sim.apply(&d);
                decisions.push(d);
            }
        }
        (sim, decisions)
    };
    let (sim, decisions) = run(true);
    assert_eq!(decisions.len(), 1, "{decisions:#?}");
    let d = &decisions[0];
    assert_eq!(d.reason, Reason::Colocate, "{}", d.why);
    assert_eq!(d.target.colocated, 2, "{d:?}");
    assert_eq!(sim.count(Role::Both), 2);
    let (_, unpaced) = run(false);
    assert!(unpaced.is_empty(), "unpaced nodes left 1p1d: {unpaced:#?}");
}

/// (11) Clients see the split miss while the model says it meets the targets: a fifth of the
/// requests fail (refused, say) under 1p1d, which the latencies the model is corrected by do
/// not show. Unpaced colocated nodes under a light prefill-heavy load are predicted to keep the
/// attainment target but fewer requests than 1p1d, so the planner stays on 1p1d while clients
/// see it serve well (as in (10)); judged against the lower of the predicted and the observed
/// share, it hedges to them once when clients see it miss.
#[test]
fn a_split_clients_see_missing_is_judged_by_what_they_see() {
    let run = |failing: bool| {
        let cfg = config(Mode::Auto, 3000.0, 100.0, limits(2, 2, 2, 2), false);
        let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
        for n in sim.nodes.iter_mut() {
            n.paced = false;
        }
        let mut decisions = Vec::new();
        for step in 0..120u32 {
            sim.arrive(0.2, TICK, 384, 8);
            // A completion every other second; with `failing`, every fifth of them fails.
            if step % 10 == 9 && failing {
                sim.fail(1, Duration::from_millis(1500));
            } else if step % 2 == 1 {
                sim.complete(1, Duration::from_millis(900), Duration::from_millis(30), 8);
            }
            if let Some(d) = sim.tick() {
                sim.apply(&d);
                decisions.push(d);
            }
        }
        decisions
    };
    assert!(run(false).is_empty(), "{:#?}", run(false));
    let decisions = run(true);
    assert_eq!(decisions.len(), 1, "{decisions:#?}");
    let d = &decisions[0];
    assert_eq!((d.reason, d.target.colocated), (Reason::Colocate, 2), "{}", d.why);
}

/// (12) A switch from 1p1d to two colocated nodes inherits the prefill node's queue: the
/// requests that arrive in the seconds after it wait behind prompts the old split left, and
/// their clients see 3-4 s TTFT that no colocated node caused (measured: 3.6-6.8 s for the
/// first ten requests after such a switch, 0.2 s after them). What the new configuration is
/// judged by starts once the old requests had their first tokens: the colocated correction
/// stays near 1 and the colocated nodes stay, where counting those requests made colocation
/// look 2-3x slower than it ran and sent the cluster back to a split 90 s later.
#[test]
fn requests_queued_behind_the_old_split_do_not_judge_colocation() {
    let run = |inherited_ttft_s: f64| {
        let cfg = config(Mode::Advise, 3000.0, 100.0, limits(2, 2, 2, 2), false);
        let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
        let (out, tpot) = (8u32, Duration::from_millis(30));
        // 1p1d on 384-token prompts at 1 req/s: one prefill node 77% busy, clients at 2.5 s.
        for _ in 0..40 {
            sim.arrive(1.0, TICK, 384, out);
            sim.complete(1, secs(2.5), tpot, out);
            sim.tick();
        }
        for n in sim.nodes.iter_mut() {
            n.role = Role::Both;
            n.step_budget = Some(2048);
        }
        let tc = sim.now;
        let mut late_split = Vec::new();
        for step in 0..45u32 {
            sim.arrive(1.0, TICK, 384, out);
            match step {
                // The old split's last prompts get their first tokens up to tc + 4.8 s.
                0..=4 => sim.complete(1, secs(8.0), tpot, out),
                // Requests that arrived from tc on, queued behind them.
                5..=7 => sim.complete(1, secs(inherited_ttft_s), tpot, out),
                // Then the colocated nodes' own: 0.9 s.
                _ => sim.complete(1, secs(0.9), tpot, out),
            }
            if let Some(d) = sim.tick() {
                if d.target.prefill > 0 {
                    late_split.push(d);
                }
            }
        }
        assert_eq!(sim.now - tc, TICK * 45);
        let e = sim.planner.estimate(&sim.snapshot());
        (e, late_split)
    };
    // The inherited requests started from tc + 1.3 s to tc + 3.3 s (start = completion - TTFT
    // - 7 x 30 ms).
    let (calm, splits) = run(0.9);
    assert!(splits.is_empty(), "{splits:#?}");
    let (inherited, splits) = run(4.5);
    assert!(splits.is_empty(), "{splits:#?}");
    assert!(
        (inherited.ttft_correction - calm.ttft_correction).abs() < 0.05,
        "inherited queueing corrected colocation to {} (calm: {})",
        inherited.ttft_correction,
        calm.ttft_correction
    );
}

/// (13) A 1p1d on long prompts with short replies: clients see TTFT past the target, and TPOT
/// a third above a lone decode step (the few milliseconds every token pays outside the batch).
/// That TPOT, over a prediction at the lone step, reads as a large TPOT factor; carried to the
/// paced colocated nodes nobody has observed, it predicted their TPOT far past the target and
/// kept the failing split for the whole phase (measured: a factor of 4 from 22 ms seen against
/// 17 ms predicted, 60 s on a 1p1d that clients saw at 67-75%). The colocated nodes are judged
/// by their own formula, and the planner colocates within its first window and a half.
#[test]
fn a_split_s_tpot_factor_does_not_keep_it_from_paced_colocation() {
    let cfg = config(Mode::Auto, 3000.0, 100.0, limits(2, 2, 2, 2), false);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    for n in sim.nodes.iter_mut() {
        n.paced = true;
    }
    let mut decided = None;
    for step in 0..60u32 {
        // 1 req/s of 384-token prompts: one prefill node 78% busy.
        let n = sim.arrive(1.0, TICK, 384, 8);
        // A lone decode step is 41 ms; clients see 55.
        sim.complete(n, secs(4.0), Duration::from_millis(55), 8);
        if let Some(d) = sim.tick() {
            sim.apply(&d);
            decided.get_or_insert((step, d));
        }
    }
    let (step, d) = decided.expect("the planner kept a split that clients saw miss TTFT for 60 s");
    assert_eq!(d.target.colocated, 2, "{d:?}");
    assert!(step <= 45, "colocated only at {step} s: {}", d.why);
    let e = sim.planner.estimate(&sim.snapshot());
    assert_eq!(e.current.colocated, 2, "{e:?}");
}

/// (14) Past capacity, admission holds requests at the edge for a seat, and clients' TTFT is
/// mostly that wait: a second where the model has no bounded figure at all (it calls the
/// configuration overloaded). Compared with the few calmer readings' figures alone, that TTFT
/// read as a colocated TTFT factor of 2-3.5 (measured, in a decode-heavy phase at 1.3 req/s),
/// which then predicted 7 s for the next phase's prompts and sent the cluster to a split that
/// held 46% of that phase. Where the model called the configuration overloaded for most of the
/// window, the factors do not learn.
#[test]
fn an_overload_the_model_has_no_figure_for_teaches_no_factor() {
    let run = |rates: [f64; 2]| {
        let cfg = config(Mode::Advise, 3000.0, 150.0, limits(2, 2, 2, 2), false);
        let mut sim = Sim::new(cfg, &[Role::Both, Role::Both]);
        for step in 0..160u32 {
            // Short prompts, long replies, the rate swinging every 20 s.
            let n = sim.arrive(rates[(step / 20 % 2) as usize], TICK, 32, 256);
            // What clients see: a seat wait of a second, then 140 ms a token.
            sim.complete(n.min(3), secs(1.2), Duration::from_millis(140), 256);
            sim.tick();
        }
        sim.planner.estimate(&sim.snapshot())
    };
    // Mostly overloaded: the factor stays where it was.
    let e = run([2.0, 10.0]);
    assert!(e.ttft_correction < 1.05, "learnt {} from an overload", e.ttft_correction);
    // The same clients under a load the model has figures for all along do correct it.
    let calm = run([2.0, 2.0]);
    assert!(calm.ttft_correction > 1.5, "{calm:?}");
}
