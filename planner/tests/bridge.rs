//! The saturation line the coordinator routes by while capacity moves: what a prefill node may
//! have queued and still meet the TTFT target.

mod common;

use cleave_planner::{Arrival, Mode, Planner, Role, Snapshot, StepCosts};
use common::*;

fn planner(ttft_ms: f64) -> Planner {
    let cfg = config(Mode::Auto, ttft_ms, 100.0, limits(4, 4, 4, 4), false);
    Planner::new(cfg, Box::new(cpu_costs())).unwrap()
}

#[test]
fn the_line_is_the_prefill_rate_times_what_the_target_leaves() {
    let costs = cpu_costs();
    // Before any arrival the planner assumes 512-token prompts.
    let t = costs.prefill_time(512);
    let want = 512.0 / t * (3.0 - t);
    let got = planner(3000.0).saturation_tokens() as f64;
    assert!((got - want).abs() <= 1.0, "{got} vs {want}");
    // A looser target allows a longer queue; one a single prompt cannot meet still lets one in.
    assert!(planner(10_000.0).saturation_tokens() > planner(3000.0).saturation_tokens());
    assert_eq!(planner(1.0).saturation_tokens(), 512);
}

#[test]
fn the_line_follows_the_prompts_seen() {
    let mut p = planner(3000.0);
    for i in 0..50 {
        p.on_arrival(Arrival { at: secs(i as f64 * 0.1), prompt_tokens: 64, max_tokens: 16 });
    }
    p.tick(&Snapshot { now: secs(5.0), nodes: vec![node(1, Role::Prefill), node(2, Role::Decode)] });
    // 64-token prompts: the node's rate and the time one prompt takes are those of 64 tokens.
    let t = cpu_costs().prefill_time(64);
    let want = 64.0 / t * (3.0 - t);
    let got = p.saturation_tokens() as f64;
    assert!((got - want).abs() <= 1.0, "{got} vs {want}");
}
