//! Planner mode: cleave's SLO planner driving the simulated cluster.

mod common;

use cleave_bench::sim::*;
use cleave_planner::{Limits, Mode, PlannerConfig, Role, Targets};

fn profile(prefill_per_token: f64, decode_s: f64) -> Profile {
    common::linear_profile(prefill_per_token, decode_s)
}

fn cost(prefill_per_token: f64, decode_s: f64) -> CostModel {
    CostModel::from_profile(&profile(prefill_per_token, decode_s), HandoffCost::default()).unwrap()
}

fn planner(
    mode: Mode,
    ttft_ms: f64,
    tpot_ms: f64,
    max_nodes: u32,
    colocate: bool,
    can_add_nodes: bool,
) -> PlannerConfig {
    PlannerConfig {
        mode,
        targets: Targets { ttft_ms, tpot_ms, ..Targets::default() },
        limits: Limits {
            max_prefill: max_nodes,
            max_decode: max_nodes,
            max_colocated: if colocate { max_nodes } else { 0 },
            max_nodes,
            ..Limits::default()
        },
        can_add_nodes,
        ..PlannerConfig::default()
    }
}

fn cluster(s: &str, cost: &CostModel) -> ClusterConfig {
    ClusterConfig::new(s.parse().unwrap(), NodeLimits::from_cost(cost))
}

/// Mean active nodes of a role over `[from, to)`, from the run's transitions.
fn mean_active(run: &PlannedRun, role: Role, from: f64, to: f64) -> f64 {
    let w = cleave_bench::sim::planned::node_seconds(&run.transitions, to - from, to);
    let last = w.last().unwrap().per(to - from);
    assert!((w.len() as f64 - to / (to - from)).abs() < 1e-9, "windows must align");
    match role {
        Role::Prefill => last.prefill,
        Role::Decode => last.decode,
        Role::Both => last.colocated,
    }
}

#[test]
fn with_the_planner_off_or_advising_the_records_are_the_fixed_topologys() {
    let c = cost(5e-5, 0.01);
    let w = WorkloadSpec { num_requests: 600, input_len: (16, 2048), output_len: (1, 64), burstiness: 0.5, seed: 3 };
    let reqs = w.generate(40.0).unwrap();
    let slo = Slo { ttft_ms: Some(300.0), tpot_ms: Some(15.0), e2el_ms: None };
    let admission = [None, Some(cleave_planner::admission::Admission::from_target_ms(300.0, 15.0))];
    for (topo, admission) in ["3p5d", "4c", "1p1d"].into_iter().flat_map(|t| admission.map(|a| (t, a))) {
        let mut cfg = cluster(topo, &c).admitted(admission);
        cfg.local_prefill_below = 100;
        let fixed = simulate(&cfg, &c, &reqs).unwrap();
        for mode in [Mode::Off, Mode::Advise] {
            let spec = PlannedSpec::new(planner(mode, 300.0, 15.0, 8, true, true));
            let run = simulate_planned(&cfg, &c, &reqs, &spec).unwrap();
            assert_eq!(run.records, fixed, "{topo} {mode:?} {admission:?}");
            assert_eq!(run.counts, ActionCounts::default());
        }
        let want = summarize(&fixed, Some(&slo)).attainment;
        let got = static_attainment(&cfg, &c, &reqs, &slo, 0.0).unwrap();
        assert!(!got.stopped && (got.attainment - want).abs() < 1e-12, "{topo}: {got:?} vs {want}");
        // Stopping early gives an upper bound below the target, and only then.
        if want < 1.0 {
            let stopped = static_attainment(&cfg, &c, &reqs, &slo, (want + 1.0) / 2.0).unwrap();
            assert!(stopped.stopped && stopped.attainment < (want + 1.0) / 2.0, "{stopped:?}");
        }
    }
}

/// Six nodes, no starts, no colocation: prefill-heavy, then decode-heavy, then prefill-heavy
/// again. The planner must move nodes to decode in the second phase and back in the third,
/// and every request must complete exactly once.
#[test]
fn on_a_shifting_trace_the_planner_moves_nodes_to_decode_and_back() {
    let c = cost(2e-4, 0.02);
    let phase = 300.0;
    let trace = Preset::Shift.build(&c, 6, 0.5, 4.0 * phase).unwrap();
    let reqs = trace.generate(1.0, 5).unwrap();
    let spec = PlannedSpec::new(planner(Mode::Auto, 600.0, 25.0, 6, false, false));
    let run = simulate_planned(&cluster("3p3d", &c), &c, &reqs, &spec).unwrap();
    let decode = |k: f64| mean_active(&run, Role::Decode, (k + 0.5) * phase, (k + 1.0) * phase);
    let (d1, d2, d3) = (decode(0.0), decode(1.0), decode(2.0));
    assert!(d2 > d1 + 0.9 && d2 > d3 + 0.9, "decode nodes late in each phase: {d1:.2}, {d2:.2}, {d3:.2}");
    assert!(run.counts.role_changes >= 2 && run.counts.refused == 0, "{:?}", run.counts);
    assert_eq!((run.counts.starts, run.counts.stops), (0, 0), "fixed nodes");
    assert_eq!(run.records.len(), reqs.len());
    for (i, (r, q)) in run.records.iter().zip(&reqs).enumerate() {
        assert_eq!((r.id, r.input_len, r.output_len), (i, q.input_len, q.output_len));
        assert!(r.ttft_s > 0.0 && r.e2el_s >= r.ttft_s && r.e2el_s.is_finite(), "{r:?}");
    }
    // The same inputs give the same run.
    let again = simulate_planned(&cluster("3p3d", &c), &c, &reqs, &spec).unwrap();
    assert_eq!((again.records, again.decisions), (run.records, run.decisions));
}

/// Demand grows past what the initial nodes serve: the planner starts nodes, never holding more
/// machines than its budget (draining ones included), and every request completes.
#[test]
fn the_node_budget_holds_while_the_planner_adds_nodes() {
    let c = cost(2e-4, 0.02);
    let phase = |rate: f64| Phase { duration_s: 200.0, rate, input_len: (256, 1024), output_len: (16, 128) };
    let trace = Trace { name: "ramp".into(), phases: vec![phase(1.0), phase(4.0), phase(8.0), phase(2.0), phase(0.5)] };
    let reqs = trace.generate(1.0, 9).unwrap();
    for max_nodes in [3u32, 5] {
        let spec = PlannedSpec {
            start_delay_s: 20.0,
            ..PlannedSpec::new(planner(Mode::Auto, 3000.0, 80.0, max_nodes, true, true))
        };
        let run = simulate_planned(&cluster("1p1d", &c), &c, &reqs, &spec).unwrap();
        assert!(run.counts.starts > 0, "{max_nodes}: {:?}", run.counts);
        assert!(run.peak_nodes <= max_nodes as usize, "{max_nodes}: peak {}", run.peak_nodes);
        assert!(run.decisions.iter().all(|d| d.target.nodes() <= max_nodes));
        // Replay: nodes holding a machine at every instant.
        let mut holding = std::collections::HashMap::new();
        for t in &run.transitions {
            holding.insert(t.node, t.life.holds_machine());
            let now = holding.values().filter(|&&h| h).count();
            assert!(now <= max_nodes as usize, "{now} nodes at {} s", t.t);
        }
        assert_eq!(run.records.len(), reqs.len());
        assert!(run.records.iter().all(|r| r.e2el_s.is_finite() && r.e2el_s >= r.ttft_s));
    }
}

#[test]
fn cli_runs_a_trace_under_the_planner_and_compares_static_topologies() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimulateArgs,
    }
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("p.json");
    cleave_bench::sim::profile::save(&profile(2e-4, 0.02), &prof).unwrap();
    let out = dir.path().join("r.json");
    let trace = dir.path().join("steps.json");
    std::fs::write(
        &trace,
        r#"[{"duration_s": 120, "rate": 1.5, "input_len": [512, 1024], "output_len": [8, 32]},
            {"duration_s": 120, "rate": 1.5, "input_len": [32, 128], "output_len": [128, 256]}]"#,
    )
    .unwrap();
    let (p, o, tr) = (prof.to_str().unwrap(), out.to_str().unwrap(), trace.to_str().unwrap());
    let args = [
        "x",
        "--profile",
        p,
        "--planner",
        "auto",
        "--ttft-target-ms",
        "2000",
        "--tpot-target-ms",
        "60",
        "--max-nodes",
        "2",
        "--initial",
        "1p1d",
        "--trace",
        tr,
        "--report-window-s",
        "30",
        "--output",
        o,
    ];
    let report = cli::run(&Cli::parse_from(args).args).unwrap();
    let pr = report.planner.as_ref().unwrap();
    assert_eq!(pr.windows.len(), 8);
    assert_eq!(pr.summary.requests, pr.windows.iter().map(|w| w.arrivals).sum::<usize>());
    let baseline = pr.baseline.as_ref().unwrap();
    assert!(baseline.exhaustive);
    assert_eq!(baseline.runs.len(), 3); // 1c, 2c, 1p1d
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let v = &json["planner"]["versus"];
    assert!(v["planner_mean_nodes"].as_f64().unwrap() > 0.0);
    assert!(v["role_changes_per_hour"].as_f64().is_some());
    assert!(json["planner"]["windows"][0]["attainment"].as_f64().is_some());
    assert!(json["planner"]["summary"]["node_seconds"].as_f64().unwrap() > 0.0);
    // The preset traces and bad settings.
    let shift = [
        "x",
        "--profile",
        p,
        "--planner",
        "auto",
        "--ttft-target-ms",
        "2000",
        "--tpot-target-ms",
        "60",
        "--max-nodes",
        "3",
        "--trace",
        "shift",
        "--trace-duration-s",
        "240",
        "--no-baseline",
    ];
    let r = cli::run(&Cli::parse_from(shift).args).unwrap();
    assert_eq!(r.planner.unwrap().trace.phases.len(), 4);
    let no_targets = ["x", "--profile", p, "--planner", "auto", "--max-nodes", "2"];
    assert!(cli::run(&Cli::parse_from(no_targets).args).is_err());
    let too_big = [
        "x",
        "--profile",
        p,
        "--planner",
        "auto",
        "--ttft-target-ms",
        "2000",
        "--tpot-target-ms",
        "60",
        "--max-nodes",
        "2",
        "--initial",
        "2p2d",
        "--no-baseline",
    ];
    assert!(cli::run(&Cli::parse_from(too_big).args).is_err());
}

/// A measured steady load (`bench/results/planner-quantized/steady/auto.json`: 254 requests
/// of 512/128 tokens, Poisson at 0.84 req/s for 300 s, sent to two SmolLM2 nodes), replayed
/// under the planner on the profile measured with it, scaled to the speed the run's nodes
/// had. Near this rate 1p1d and two colocated nodes trade places as the 20-s window's count
/// moves (it reads 0.5-1.4 req/s), and both miss the targets for part of the requests. Before
/// the re-split had to hold across the rate's standard error and experience was kept across
/// readings within noise, the planner switched shape 10 times (20 role changes) in these 300
/// s; a change of shape costs the streams it drains.
#[test]
fn a_measured_steady_load_is_not_re_split_on_its_rate_noise() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimulateArgs,
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let run = format!("{root}/bench/results/planner-quantized/steady");
    let profile = format!("{root}/bench/profiles/smollm2-q4_1-quantized-1thread.json");
    let (replay, nodes) = (format!("{run}/auto.json"), format!("{run}/auto.nodes.json"));
    let args = [
        "x",
        "--profile",
        &profile,
        "--planner",
        "auto",
        "--initial",
        "1p1d",
        "--max-nodes",
        "2",
        "--fixed-nodes",
        "--ttft-target-ms",
        "3000",
        "--tpot-target-ms",
        "100",
        "--replay",
        &replay,
        "--scale-to-nodes",
        &nodes,
        "--no-baseline",
    ];
    let report = cli::run(&Cli::parse_from(args).args).unwrap();
    let pr = report.planner.unwrap();
    let s = &pr.summary;
    let shapes: Vec<_> = pr.decisions.iter().map(|d| (d.at_s, d.current, d.target)).collect();
    assert_eq!(s.requests, 254);
    assert!(s.role_changes <= 6, "{} role changes: {shapes:#?}", s.role_changes);
    // It still leaves 1p1d, which cannot carry this load (the measured run left it at 53 s).
    let first = pr.decisions.iter().find(|d| d.target.colocated > 0).expect("never colocated");
    assert!(first.at_s <= 90.0, "colocated only at {} s", first.at_s);
    assert!(s.attainment >= 0.72, "attainment {}", s.attainment);
}
