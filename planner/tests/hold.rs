//! The colocated hold (`targets.colocated_tpot_ms`): colocated nodes held to a tighter TPOT
//! than the target, in every mode (it is the operator's, like the target); the planner
//! predicts colocated nodes paced to it; at most the target; validated; a live update sets
//! or clears it.

mod common;

use std::time::Duration;

use cleave_planner::{Mode, PlannerUpdate, Role};
use common::{config, limits, Sim};

fn update(v: serde_json::Value) -> PlannerUpdate {
    serde_json::from_value(v).unwrap()
}

#[test]
fn colocated_nodes_are_held_to_the_hold_at_most_the_target_in_every_mode() {
    for mode in [Mode::Off, Mode::Advise, Mode::Auto] {
        let mut cfg = config(mode, 3000.0, 150.0, limits(2, 2, 2, 2), false);
        assert_eq!(cfg.targets.colocated_ms(), 150.0, "none set: the target");
        cfg.targets.colocated_tpot_ms = Some(70.0);
        let mut sim = Sim::new(cfg, &[Role::Both, Role::Both]);
        assert_eq!(sim.planner.colocated_tpot_ms(), 70.0, "{mode:?}");
        // A target tightened past the hold binds.
        sim.planner.update(&update(serde_json::json!({"targets": {"tpot_ms": 50.0}}))).unwrap();
        assert_eq!(sim.planner.colocated_tpot_ms(), 50.0, "{mode:?}");
        // 0 clears it; the target again.
        sim.planner.update(&update(serde_json::json!({"targets": {"colocated_tpot_ms": 0.0}}))).unwrap();
        assert_eq!((sim.planner.config().targets.colocated_tpot_ms, sim.planner.colocated_tpot_ms()), (None, 50.0));
        // Any other value must be a positive number of milliseconds; a bad one changes nothing.
        for bad in [-1.0, f64::INFINITY] {
            let u = PlannerUpdate {
                targets: Some(cleave_planner::TargetsUpdate { colocated_tpot_ms: Some(bad), ..Default::default() }),
                ..Default::default()
            };
            let e = sim.planner.update(&u).unwrap_err().to_string();
            assert!(e.contains("colocated_tpot_ms"), "{e}");
            assert_eq!(sim.planner.config().targets.colocated_tpot_ms, None);
        }
        sim.arrive(1.0, Duration::from_secs(1), 64, 64);
        sim.tick();
    }
}

/// Paced colocated nodes are predicted at their hold: a hold near what a step of the
/// batch takes predicts a longer TTFT (prompt chunks cut to the floor beside the decodes).
#[test]
fn the_planner_predicts_colocated_nodes_paced_to_their_hold() {
    let run = |hold: Option<f64>| {
        let mut cfg = config(Mode::Advise, 3000.0, 150.0, limits(2, 2, 2, 2), false);
        cfg.targets.colocated_tpot_ms = hold;
        let mut sim = Sim::new(cfg, &[Role::Both, Role::Both]);
        for n in &mut sim.nodes {
            n.paced = true;
            n.running_seqs = 2;
        }
        for _ in 0..10 {
            sim.arrive(0.3, Duration::from_secs(1), 512, 64);
            sim.tick();
        }
        sim.planner.estimate(&sim.snapshot()).predicted.ttft_ms.expect("a bounded prediction")
    };
    let (free, held) = (run(None), run(Some(60.0)));
    assert!(held > free, "held to 60 ms: TTFT {held} ms, to the 150-ms target: {free} ms");
}
