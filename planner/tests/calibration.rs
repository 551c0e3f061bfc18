//! The cost model follows what nodes measure over a window, not their last step; and the
//! planner does not re-split a fixed cluster on what its first seconds (cold nodes, no client
//! feedback yet) suggest.

mod common;

use std::time::Duration;

use cleave_planner::{Mode, Planner, Role, StepStats, CALIBRATION_WINDOW};
use common::{config, cpu_costs, limits, Sim};

fn prefill(tokens: u64, seconds: f64) -> StepStats {
    StepStats { prefill_tokens: tokens, prefill_seconds: seconds, ..Default::default() }
}

#[test]
fn one_slow_first_prefill_does_not_set_the_model() {
    let cfg = config(Mode::Auto, 3000.0, 100.0, limits(1, 1, 2, 2), false);
    let mut p = Planner::new(cfg, Box::new(cpu_costs())).unwrap();
    // The node's first prefill (weights paging in) takes twice what the next nine take.
    p.calibrate(Duration::from_secs(1), &prefill(384, 1.6));
    let after_first = p.costs().prefill_time(384);
    assert!((after_first - (0.010 + 384.0 * 1.6 / 384.0)).abs() < 1e-9, "{after_first}");
    for s in 2..=10 {
        p.calibrate(Duration::from_secs(s), &prefill(384, 0.8));
        // Ticks with no step in them change nothing.
        p.calibrate(Duration::from_secs(s) + Duration::from_millis(500), &StepStats::default());
    }
    // Per token: (1.6 + 9 x 0.8) / (10 x 384) seconds, the window's mean.
    let want = 0.010 + 384.0 * (1.6 + 9.0 * 0.8) / (10.0 * 384.0);
    let got = p.costs().prefill_time(384);
    assert!((got - want).abs() < 1e-9, "model {got} s, window mean {want} s");
    // Once the slow step has left the window, the model is the recent steps'.
    let later = Duration::from_secs(10) + CALIBRATION_WINDOW;
    p.calibrate(later, &prefill(384, 0.8));
    let got = p.costs().prefill_time(384);
    assert!((got - (0.010 + 0.8)).abs() < 1e-9, "{got}");
}

/// A fixed pair (1 prefill + 1 decode) whose model, in its first seconds, says the prefill node
/// is overloaded: a re-split waits for one window of observation (clients then correct the
/// model); adding a node would not have waited.
#[test]
fn no_resplit_before_one_window_of_observation() {
    let cfg = config(Mode::Auto, 3000.0, 200.0, limits(1, 1, 2, 2), false);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    let mut first = None;
    for step in 0..60u64 {
        // 2 req/s of 400-token prompts: 0.81 s each, 1.6x one prefill node's capacity.
        sim.arrive(2.0, Duration::from_secs(1), 400, 16);
        for n in sim.nodes_of(Role::Prefill) {
            n.queued_prefill_tokens = 400 * step;
        }
        if let Some(d) = sim.tick() {
            first.get_or_insert((sim.now, d));
        }
    }
    let (at, d) = first.expect("the overload is real: a re-split comes after the first window");
    assert!(at >= Duration::from_secs(30), "re-split at {at:?}, before one window (30 s) of observation: {}", d.why);
    assert_eq!(d.target.nodes(), 2);
}

/// What clients showed of colocated nodes corrects colocated predictions only: the two
/// families are predicted by different formulas whose errors differ, and one shared factor
/// carried the colocated model's pessimism over to disaggregated pools after every switch
/// (making them look better than they ran).
#[test]
fn clients_correct_the_family_they_were_served_by() {
    let cfg = common::config(Mode::Advise, 3000.0, 200.0, common::limits(2, 2, 2, 2), false);
    let mut sim = Sim::new(cfg, &[Role::Both, Role::Both]);
    let mut colocated = None;
    for _ in 0..90 {
        let n = sim.arrive(1.0, Duration::from_secs(1), 64, 32);
        // Clients see TPOT far under anything predicted.
        sim.complete(n, Duration::from_millis(100), Duration::from_millis(5), 32);
        sim.tick();
        colocated = Some(sim.planner.estimate(&sim.snapshot()));
    }
    let colocated = colocated.unwrap();
    assert!(colocated.tpot_correction < 0.8, "{colocated:?}");
    for (i, n) in sim.nodes.iter_mut().enumerate() {
        n.role = if i == 0 { Role::Prefill } else { Role::Decode };
    }
    let split = sim.planner.estimate(&sim.snapshot());
    let c = split.current;
    assert_eq!((c.prefill, c.decode, c.colocated), (1, 1, 0), "{split:?}");
    assert_eq!((split.ttft_correction, split.tpot_correction), (1.0, 1.0), "{split:?}");
}
