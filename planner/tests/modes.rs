//! (5) Modes: advise records exactly the decisions auto would make, with `applied = false`;
//! off records nothing (and still estimates).

mod common;

use std::time::Duration;

use cleave_planner::{Decision, Mode, Role};
use common::{config, limits, Sim};

/// Drives a planner in `mode` through a load that needs more prefill and then less. Snapshots
/// are the same whatever the planner says (nobody applies anything), so auto and advise see
/// identical inputs.
fn run(mode: Mode) -> (Vec<Decision>, Vec<Decision>, Sim) {
    let cfg = config(mode, 3000.0, 200.0, limits(3, 2, 0, 4), true);
    let mut sim = Sim::new(cfg, &[Role::Prefill, Role::Decode]);
    let mut returned = Vec::new();
    for step in 0..240u32 {
        let rate = if step < 120 { 1.0 + 0.04 * f64::from(step) } else { 0.5 };
        sim.arrive(rate, Duration::from_secs(1), 200, 100);
        sim.complete(rate.floor() as u32, Duration::from_millis(600), Duration::from_millis(45), 100);
        if let Some(d) = sim.tick() {
            returned.push(d);
        }
    }
    let logged = sim.planner.decisions().cloned().collect();
    (returned, logged, sim)
}

#[test]
fn advise_records_what_auto_would_do_and_applies_nothing() {
    let (auto, auto_log, _) = run(Mode::Auto);
    let (advise, advise_log, _) = run(Mode::Advise);
    assert!(auto.len() >= 2, "the scenario must produce several decisions: {auto:?}");
    assert_eq!(auto, auto_log);
    assert_eq!(advise, advise_log);
    assert_eq!(auto.len(), advise.len());
    for (a, b) in auto.iter().zip(&advise) {
        assert!(a.applied && !b.applied);
        assert_eq!((a.mode, b.mode), (Mode::Auto, Mode::Advise));
        let same = Decision { applied: a.applied, mode: a.mode, ..b.clone() };
        assert_eq!(a, &same);
    }
    // A target already advised is not advised again every tick while nobody applies it.
    let targets: Vec<_> = advise.iter().map(|d| d.target).collect();
    assert!(targets.windows(2).all(|w| w[0] != w[1]), "{targets:?}");
    assert!(advise[0]
        .actions
        .iter()
        .any(|a| matches!(a, cleave_planner::Action::SwitchRole { .. } | cleave_planner::Action::StartNode { .. })));
}

#[test]
fn off_records_nothing_but_still_estimates() {
    let (returned, logged, sim) = run(Mode::Off);
    assert!(returned.is_empty() && logged.is_empty());
    let e = sim.planner.estimate(&sim.snapshot());
    assert_eq!(e.mode, Mode::Off);
    assert!((e.inputs.arrival_rate - 0.5).abs() < 0.1, "{e:?}");
    assert!(e.predicted.ttft_ms.is_some());
    assert_eq!((e.current.prefill, e.current.decode), (1, 1));
}
