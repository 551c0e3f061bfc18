//! `cleave bench simulate`'s flags, and the run behind them: predict each configuration at a
//! given rate, or search each one's goodput and recommend the best per node.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::cluster::{NodeLimits, Topology};
use super::cost::{CostModel, HandoffCost};
use super::search::{predict, recommend, search_space, Goodput, PredictSummary, SearchSpec, Slo};
use super::workload::WorkloadSpec;
use super::ClusterConfig;
use crate::error::{BenchError, Result};

/// `cleave bench simulate` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Profile JSON written by `cleave bench profile`.
    #[arg(long)]
    pub profile: PathBuf,
    /// Configurations: `XpYd` (disaggregated) or `Kc` (colocated), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub config: Vec<String>,
    /// Add the search space for this many nodes: every XpYd and Kc up to it when ≤ 8, else Nc and
    /// up to 24 prefill:decode splits of exactly N nodes. With --planner: the node budget.
    #[arg(long)]
    pub max_nodes: Option<usize>,
    /// Predict at this request rate (req/s) instead of searching for goodput.
    #[arg(long, conflicts_with = "search")]
    pub rate: Option<f64>,
    /// Search each configuration's goodput (the default without --rate; needs --goodput).
    #[arg(long)]
    pub search: bool,
    /// Prompt tokens: `N` or an inclusive range `MIN..MAX` (uniform).
    #[arg(long, default_value = "512", value_parser = parse_range)]
    pub input_len: (usize, usize),
    /// Output tokens, first included: `N` or `MIN..MAX`.
    #[arg(long, default_value = "128", value_parser = parse_range)]
    pub output_len: (usize, usize),
    /// SLOs in milliseconds: `ttft:MS tpot:MS [e2el:MS]`.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Fraction of requests that must meet the SLOs.
    #[arg(long, default_value_t = 0.9)]
    pub attainment: f64,
    /// Requests per simulation (default: max(1000, 50 × nodes of the largest configuration)).
    #[arg(long)]
    pub num_requests: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Gamma shape of inter-arrival times (1: Poisson; below 1: burstier).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// KV handoff bandwidth, GB/s (BENCHMARKS.md: QUIC ≈ 1 GB/s on loopback).
    #[arg(long, default_value_t = 1.0)]
    pub handoff_bandwidth_gbps: f64,
    /// Fixed handoff latency, ms (BENCHMARKS.md: 0.7 ms tail).
    #[arg(long, default_value_t = 0.7)]
    pub handoff_latency_ms: f64,
    /// Conditional disaggregation: prompts shorter than this are prefilled on the decode node.
    #[arg(long, default_value_t = 0)]
    pub local_prefill_below: usize,
    /// Nodes pace (`cleave coordinator --pacing`) prompt chunks beside running decodes to the TPOT target (the coordinator
    /// sends it to every node; `cleave_engine::sched::pacing`). Off by default: pacing protects
    /// TPOT at the expense of TTFT and does not yet know the TTFT target, so it costs a load
    /// whose TTFT binds (BENCHMARKS.md, "Pacing").
    #[arg(long)]
    pub pacing: bool,
    /// Planner mode: SLO admission (`cleave coordinator --slo-admission`) to the targets, by the
    /// coordinator's rules: seat caps per decoding node, requests held for a seat and shed after
    /// half the TTFT target, prompts that would start past it shed at once.
    #[arg(long, requires = "planner")]
    pub slo_admission: bool,
    /// Planner mode: milliseconds the edge adds to every served request's TTFT (HTTP, tokenization, routing,
    /// the tokens' trip back), which the profile's step costs leave out.
    #[arg(long, default_value_t = 0.0, value_parser = non_negative_ms, requires = "planner")]
    pub edge_latency_ms: f64,
    /// Override the profile's per-node max_num_seqs.
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Override the profile's per-node max_num_batched_tokens.
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Override the profile's per-node KV capacity, tokens.
    #[arg(long)]
    pub kv_capacity_tokens: Option<usize>,
    /// Highest rate the search tries, req/s.
    #[arg(long, default_value_t = 1e5)]
    pub max_rate: f64,
    /// Bisection stops when the bracket is narrower than this fraction of the rate.
    #[arg(long, default_value_t = 0.01)]
    pub tolerance: f64,
    /// Predicted against measured: replay every point of the `bench sweep` in this folder (its
    /// sweep.json and result files) through the simulator and compare, under --goodput.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["rate", "search"])]
    pub compare_sweep: Option<PathBuf>,
    /// Write the report as JSON here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Planner mode: run --trace under cleave's SLO planner, from --initial within --max-nodes
    /// nodes. `auto` carries its decisions out (role switches, step budgets, node starts and
    /// stops), `advise` only records them, `off` keeps the initial topology. Reports attainment
    /// per window, nodes used, actions per hour, and the best static topology at the same
    /// attainment.
    #[arg(long, value_name = "auto|advise|off", conflicts_with_all = ["rate", "search", "compare_sweep", "config"])]
    pub planner: Option<String>,
    /// Planner mode: TTFT target at the planner's quantile (p90), ms.
    #[arg(long)]
    pub ttft_target_ms: Option<f64>,
    /// Planner mode: TPOT target at the planner's quantile (p90), ms.
    #[arg(long)]
    pub tpot_target_ms: Option<f64>,
    /// Planner mode: the topology at time 0, `XpYd` or `Kc`.
    #[arg(long, default_value = "1p1d")]
    pub initial: String,
    /// Planner mode: `day` (a diurnal rate, prefill-heavy at night and decode-heavy by day),
    /// `shift` (prefill-heavy, decode-heavy, prefill-heavy, then a rate step: four equal
    /// phases), or a JSON file with a list of phases `{"duration_s", "rate", "input_len": [MIN,
    /// MAX], "output_len": [MIN, MAX]}`.
    #[arg(long, default_value = "shift")]
    pub trace: String,
    /// Planner mode: replay the requests of a `bench serve --phases` result file (their send
    /// times and lengths; its phases are the trace), to set the simulation beside that run.
    #[arg(long, value_name = "RESULT_JSON")]
    pub replay: Option<PathBuf>,
    /// Planner mode, with --replay: scale the profile's step times to the speed the nodes of
    /// that run really had, from their cumulative step timings in a saved `GET /admin/nodes`
    /// answer (`bench/planner/shift.sh` writes NAME.nodes.json beside each run). A shared
    /// machine drifts; this puts the replay at the run's own speed.
    #[arg(long, value_name = "NODES_JSON")]
    pub scale_to_nodes: Option<PathBuf>,
    /// Planner mode: a preset's length, seconds (day: 86400, shift: 600).
    #[arg(long)]
    pub trace_duration_s: Option<f64>,
    /// Planner mode: a preset's busiest phase asks for this share of the node budget's capacity
    /// (estimated from the profile).
    #[arg(long, default_value_t = 0.6)]
    pub trace_load: f64,
    /// Planner mode: seconds of simulated time between planner ticks.
    #[arg(long, default_value_t = 1.0)]
    pub planner_tick_s: f64,
    /// Planner mode: seconds from a node start to the node serving (model load).
    #[arg(long, default_value_t = 20.0)]
    pub start_delay_s: f64,
    /// Planner mode: seconds per report window (attainment over time).
    #[arg(long, default_value_t = 60.0)]
    pub report_window_s: f64,
    /// Planner mode: the actuator can only switch roles (no node starts or stops).
    #[arg(long)]
    pub fixed_nodes: bool,
    /// Planner mode: no colocated nodes (the planner plans prefill and decode pools only).
    #[arg(long)]
    pub no_colocate: bool,
    /// Planner mode: skip the static baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Planner mode: a JSON partial update of the planner's settings (as `PUT /admin/planner`
    /// takes: `window_s`, `cooldown_s`, `targets.quantile`, `limits.step_budgets`, ...).
    #[arg(long, value_name = "FILE")]
    pub planner_update: Option<PathBuf>,
    /// Planner mode: plot attainment and nodes over time to STEM-attainment.{png,svg} and
    /// STEM-nodes.{png,svg}.
    #[arg(long, value_name = "STEM")]
    pub plot: Option<PathBuf>,
}

/// A finite, non-negative number of milliseconds.
fn non_negative_ms(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{s}`: expected a finite number of milliseconds, 0 or more")),
    }
}

/// Parses `N` or `MIN..MAX` (also `MIN..=MAX`).
pub fn parse_range(s: &str) -> std::result::Result<(usize, usize), String> {
    let num = |x: &str| x.trim().parse::<usize>().map_err(|_| format!("`{s}`: expected N or MIN..MAX"));
    match s.split_once("..") {
        Some((a, b)) => {
            let (a, b) = (num(a)?, num(b.trim_start_matches('='))?);
            if a == 0 || a > b {
                return Err(format!("`{s}`: need 0 < MIN ≤ MAX"));
            }
            Ok((a, b))
        }
        None => {
            let n = num(s)?;
            if n == 0 {
                return Err(format!("`{s}`: must be positive"));
            }
            Ok((n, n))
        }
    }
}

/// What `--output` gets.
#[derive(Debug, Clone, Serialize)]
pub struct SimulateReport {
    pub model: String,
    pub profile_threads: usize,
    pub limits: NodeLimits,
    pub handoff: HandoffCost,
    pub workload: WorkloadSpec,
    pub slo: Slo,
    pub attainment_target: f64,
    /// Set when predicting at one rate.
    pub rate: Option<f64>,
    /// Per configuration, at `rate` (predict mode).
    pub predictions: Vec<(String, PredictSummary)>,
    /// Per configuration, best goodput per node first (search mode).
    pub goodput: Vec<Goodput>,
    /// The configuration with the most goodput per node (search mode).
    pub recommended: Option<String>,
    /// Predicted against measured, per sweep point (--compare-sweep).
    pub comparisons: Vec<super::validate::PointComparison>,
    /// Planner mode (--planner).
    pub planner: Option<super::plan_report::PlannerReport>,
    /// The factors the profile was scaled by (--scale-to-nodes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speed: Option<super::speed::SpeedScale>,
}

/// Runs the subcommand: prints a table and writes `--output`.
pub fn run(args: &SimulateArgs) -> Result<SimulateReport> {
    let profile = super::profile::load(&args.profile)?;
    let handoff = HandoffCost {
        bandwidth_bytes_per_s: args.handoff_bandwidth_gbps * 1e9,
        latency_s: args.handoff_latency_ms / 1e3,
    };
    let (profile, speed) = match &args.scale_to_nodes {
        Some(nodes) => {
            let run = args.replay.as_ref().ok_or_else(|| {
                BenchError::InvalidArg("--scale-to-nodes needs --replay (the run those nodes served)".into())
            })?;
            let (_, requests) = super::plan_report::replay(run)?;
            let steps = super::speed::node_steps(nodes)?;
            let s = super::speed::measure(&profile, handoff, &steps, &requests, args.max_num_batched_tokens)?;
            println!(
                "speed of {}: prefill x{:.3} ({} tokens), decode x{:.3} ({} steps) against the profile",
                nodes.display(),
                s.prefill,
                s.prefill_tokens,
                s.decode,
                s.decode_steps
            );
            (super::speed::apply(&profile, &s), Some(s))
        }
        None => (profile, None),
    };
    let cost = CostModel::from_profile(&profile, handoff)?;
    let mut limits = NodeLimits::from_cost(&cost);
    if let Some(x) = args.max_num_seqs {
        limits.max_num_seqs = x;
    }
    if let Some(x) = args.max_num_batched_tokens {
        limits.max_num_batched_tokens = x;
    }
    if let Some(x) = args.kv_capacity_tokens {
        limits.kv_capacity_tokens = x;
    }
    if args.planner.is_some() {
        let p = super::plan_report::run(args, &cost, limits)?;
        let report = SimulateReport {
            model: profile.model.clone(),
            profile_threads: profile.threads,
            speed,
            limits,
            handoff,
            workload: WorkloadSpec {
                num_requests: p.summary.requests,
                input_len: args.input_len,
                output_len: args.output_len,
                burstiness: args.burstiness,
                seed: args.seed,
            },
            slo: p.slo,
            attainment_target: args.attainment,
            rate: None,
            predictions: Vec::new(),
            goodput: Vec::new(),
            recommended: None,
            comparisons: Vec::new(),
            planner: Some(p),
        };
        if let Some(path) = &args.output {
            write_json(path, &report)?;
        }
        return Ok(report);
    }
    if let Some(dir) = &args.compare_sweep {
        let slo = Slo::parse(&args.goodput)?;
        let rows = super::validate::compare_sweep(dir, &cost, limits, &slo)?;
        print!("{}", super::validate::table(&rows));
        let report = SimulateReport {
            model: profile.model.clone(),
            profile_threads: profile.threads,
            speed,
            limits,
            handoff,
            workload: WorkloadSpec {
                num_requests: 0,
                input_len: args.input_len,
                output_len: args.output_len,
                burstiness: args.burstiness,
                seed: args.seed,
            },
            slo,
            attainment_target: args.attainment,
            rate: None,
            predictions: Vec::new(),
            goodput: Vec::new(),
            recommended: None,
            comparisons: rows,
            planner: None,
        };
        if let Some(path) = &args.output {
            write_json(path, &report)?;
        }
        return Ok(report);
    }
    let mut topologies = args.config.iter().map(|s| s.parse()).collect::<Result<Vec<Topology>>>()?;
    if let Some(n) = args.max_nodes {
        if n == 0 {
            return Err(BenchError::InvalidArg("--max-nodes must be positive".into()));
        }
        topologies.extend(search_space(n));
    }
    let mut seen = std::collections::HashSet::new();
    topologies.retain(|t| seen.insert(*t));
    if topologies.is_empty() {
        return Err(BenchError::InvalidArg("give --config and/or --max-nodes".into()));
    }
    let largest = topologies.iter().map(Topology::nodes).max().unwrap_or(1);
    let workload = WorkloadSpec {
        num_requests: args.num_requests.unwrap_or(1000.max(50 * largest)),
        input_len: args.input_len,
        output_len: args.output_len,
        burstiness: args.burstiness,
        seed: args.seed,
    };
    let slo = Slo::parse(&args.goodput)?;
    let mut report = SimulateReport {
        model: profile.model.clone(),
        profile_threads: profile.threads,
        speed,
        limits,
        handoff,
        workload,
        slo,
        attainment_target: args.attainment,
        rate: args.rate,
        predictions: Vec::new(),
        goodput: Vec::new(),
        recommended: None,
        comparisons: Vec::new(),
        planner: None,
    };
    println!(
        "profile: {} ({} threads); {} requests, input {:?}, output {:?}, seed {}",
        profile.model, profile.threads, workload.num_requests, workload.input_len, workload.output_len, workload.seed
    );
    match args.rate {
        Some(rate) => {
            let reqs = workload.generate(rate)?;
            let slo_opt = (!args.goodput.is_empty()).then_some(&slo);
            println!(
                "{:<10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9}",
                "config", "ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99", "attain", "goodput"
            );
            for t in &topologies {
                let mut cfg = ClusterConfig::new(*t, limits);
                if matches!(t, Topology::Disaggregated { .. }) {
                    cfg.local_prefill_below = args.local_prefill_below;
                }
                let s = predict(&cfg, &cost, &reqs, slo_opt)?;
                println!(
                    "{:<10} {:>9.1} {:>9.1} {:>9.1} {:>9.2} {:>9.2} {:>9.2} {:>8.3} {:>9.2}",
                    t.to_string(),
                    s.ttft.mean * 1e3,
                    s.ttft.median * 1e3,
                    s.ttft.p99 * 1e3,
                    s.tpot.mean * 1e3,
                    s.tpot.median * 1e3,
                    s.tpot.p99 * 1e3,
                    s.attainment,
                    s.goodput
                );
                report.predictions.push((t.to_string(), s));
            }
            println!("(latencies in ms at {rate} req/s)");
        }
        None => {
            if args.goodput.is_empty() {
                return Err(BenchError::InvalidArg(
                    "goodput search needs --goodput ttft:MS tpot:MS (or give --rate)".into(),
                ));
            }
            let spec = SearchSpec {
                slo,
                attainment: args.attainment,
                workload,
                rel_tolerance: args.tolerance,
                max_rate: args.max_rate,
            };
            let results = recommend(&topologies, limits, args.local_prefill_below, &cost, &spec)?;
            print_goodput(&results);
            report.recommended = results.first().filter(|g| g.max_rate > 0.0).map(|g| g.config.clone());
            match &report.recommended {
                Some(c) => println!("recommended: {c} (most goodput per node)"),
                None => println!("no configuration meets the SLOs even when idle"),
            }
            report.goodput = results;
        }
    }
    if let Some(path) = &args.output {
        write_json(path, &report)?;
    }
    Ok(report)
}

fn print_goodput(results: &[Goodput]) {
    println!(
        "{:<10} {:>5} {:>10} {:>10} {:>8} {:>9} {:>9}",
        "config", "nodes", "rate", "per_node", "attain", "ttft_p90", "tpot_p90"
    );
    for g in results {
        println!(
            "{:<10} {:>5} {:>10.3} {:>10.4} {:>8.3} {:>9.1} {:>9.2}",
            g.config,
            g.nodes,
            g.max_rate,
            g.per_node,
            g.at_max.attainment,
            g.at_max.ttft.p90 * 1e3,
            g.at_max.tpot.p90 * 1e3
        );
    }
    println!("(rate: req/s at the attainment target; latencies in ms at that rate)");
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").map_err(|e| BenchError::io(path, e))
}
