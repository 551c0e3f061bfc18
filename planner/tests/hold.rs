//! The colocated hold: in auto mode colocated nodes are held to the TPOT at which their decode
//! rate stops growing much with the batch (never above the target); advise shows it and holds
//! nothing; off has none. It follows the calibrated costs, but only past its band.

mod common;

use std::time::Duration;

use cleave_planner::{LinearCosts, Mode, Role, StepStats, HOLD_BAND, HOLD_RATE_SHARE};
use common::{config, cpu_costs, limits, Sim};

/// A decode step of 12 ms plus 3.5 ms a sequence: held at 12 / (1 - 0.8) / 0.85 = 70.6 ms.
fn smol() -> LinearCosts {
    LinearCosts { decode_fixed_s: 0.012, decode_s_per_seq: 0.0035, ..cpu_costs() }
}

fn want_ms(fixed_s: f64) -> f64 {
    fixed_s / (1.0 - HOLD_RATE_SHARE) / cleave_planner::admission::MARGIN * 1e3
}

fn run(mode: Mode, tpot_ms: f64) -> Sim {
    let cfg = config(mode, 3000.0, tpot_ms, limits(2, 2, 2, 2), false);
    let mut sim = Sim::with_costs(cfg, &[Role::Both, Role::Both], smol());
    for _ in 0..5 {
        sim.arrive(1.0, Duration::from_secs(1), 64, 64);
        sim.tick();
    }
    sim
}

#[test]
fn auto_holds_colocated_nodes_below_a_loose_target() {
    let sim = run(Mode::Auto, 150.0);
    let p = &sim.planner;
    let hold = p.hold_tpot_ms().expect("auto chose a hold");
    assert!((hold - want_ms(0.012)).abs() < 1e-6, "{hold}");
    assert_eq!(p.colocated_tpot_ms(), hold);
    // What status shows.
    assert_eq!(p.estimate(&sim.snapshot()).hold_tpot_ms, Some(hold));
    // A target tighter than the hold is what binds.
    let sim = run(Mode::Auto, 50.0);
    assert_eq!((sim.planner.colocated_tpot_ms(), sim.planner.hold_tpot_ms()), (50.0, Some(50.0)));
}

#[test]
fn advise_shows_the_hold_and_holds_nothing_and_off_has_none() {
    let sim = run(Mode::Advise, 150.0);
    assert!((sim.planner.hold_tpot_ms().unwrap() - want_ms(0.012)).abs() < 1e-6);
    assert_eq!(sim.planner.colocated_tpot_ms(), 150.0);
    let sim = run(Mode::Off, 150.0);
    assert_eq!((sim.planner.hold_tpot_ms(), sim.planner.colocated_tpot_ms()), (None, 150.0));
    // Before its first tick auto holds nothing either.
    let cfg = config(Mode::Auto, 3000.0, 150.0, limits(2, 2, 2, 2), false);
    let sim = Sim::with_costs(cfg, &[Role::Both], smol());
    assert_eq!(sim.planner.colocated_tpot_ms(), 150.0);
}

/// Decode steps measured `f` times the model's: the model scales by `f`, so would the hold.
fn steps(f: f64) -> StepStats {
    StepStats {
        decode_steps: 100,
        decode_seqs: 800,
        decode_seconds: 100.0 * f * (0.012 + 8.0 * 0.0035),
        ..Default::default()
    }
}

#[test]
fn the_hold_follows_calibration_past_its_band_only() {
    let mut sim = run(Mode::Auto, 150.0);
    let first = sim.planner.colocated_tpot_ms();
    // 5% slower steps: inside the band, the hold stays.
    sim.planner.calibrate(sim.now, &steps(1.05));
    sim.arrive(1.0, Duration::from_secs(1), 64, 64);
    sim.tick();
    assert_eq!(sim.planner.colocated_tpot_ms(), first);
    assert!(0.05 < HOLD_BAND);
    // 30% slower than the first: the hold moves with them.
    sim.now += Duration::from_secs(120);
    sim.planner.calibrate(sim.now, &steps(1.3));
    sim.tick();
    let moved = sim.planner.colocated_tpot_ms();
    assert!((moved - 1.3 * first).abs() < 1e-6, "{first} -> {moved}");
    // A target loosened later does not lift the hold; tightened, the target binds at once.
    let u = serde_json::from_value(serde_json::json!({"targets": {"tpot_ms": 60.0}})).unwrap();
    sim.planner.update(&u).unwrap();
    assert_eq!(sim.planner.colocated_tpot_ms(), 60.0);
}
