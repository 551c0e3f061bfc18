//! The static baseline of a planner-mode run: the fixed topology with the fewest nodes that
//! reaches the same overall SLO attainment on the same requests.
//!
//! - Budgets up to [`EXHAUSTIVE_MAX_NODES`] nodes: every `XpYd` and `Kc` within the budget is run
//!   to the end ([`super::search::search_space`]).
//! - Larger budgets: a search over shapes, each a prefill share of the nodes (plus colocated),
//!   the planner's own mix first (colocated when it ran colocated nodes most of the time, else
//!   its mean prefill share, then the other shares nearest to it). Each shape is run once at
//!   one node fewer than the best found so far (at first at the planner's peak node count, then
//!   at the whole budget if nothing passed there); a shape that passes gets the fewest nodes
//!   that reach the target by k-section over the node count, one run per core per round. Runs
//!   stop as soon as the target is out of reach ([`super::planned::static_attainment`]), so
//!   failing ones are cheap. This assumes attainment does not fall as nodes are added at a
//!   fixed shape, true in practice.
//!
//! Runs are spread over the machine's cores; the result does not depend on how many.

use serde::{Deserialize, Serialize};

use super::cluster::{ClusterConfig, NodeLimits, Topology};
use super::cost::CostModel;
use super::planned::static_attainment;
use super::search::{search_space, Slo};
use super::workload::SimRequest;
use crate::error::{BenchError, Result};

/// Budgets up to this many nodes are searched exhaustively.
pub const EXHAUSTIVE_MAX_NODES: usize = 8;

/// Prefill shares tried for large budgets (besides colocated and the planner's own split).
pub const SHARES: [f64; 7] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7];

/// One fixed topology on the trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StaticRun {
    pub config: String,
    pub topology: Topology,
    pub nodes: usize,
    /// Share of requests meeting the SLO (an upper bound when `stopped`).
    pub attainment: f64,
    /// Stopped early: the target was out of reach.
    pub stopped: bool,
    pub meets: bool,
}

/// What the baseline search found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// The attainment a static topology must reach (the planner run's).
    pub target_attainment: f64,
    /// Every topology tried: all of them when `exhaustive`.
    pub runs: Vec<StaticRun>,
    pub exhaustive: bool,
    /// The fewest nodes meeting the target (ties: higher attainment, then the order tried).
    pub best: Option<StaticRun>,
}

/// Everything a static run needs.
#[derive(Debug, Clone, Copy)]
pub struct BaselineSpec<'a> {
    pub limits: NodeLimits,
    pub local_prefill_below: usize,
    /// Nodes pace to this TPOT (s), as the planner's run did (`ClusterConfig::paced`).
    pub pacing_tpot_s: Option<f64>,
    /// SLO admission and the edge's latency, as the planner's run had them.
    pub admission: Option<cleave_planner::admission::Admission>,
    pub edge_s: f64,
    pub cost: &'a CostModel,
    pub requests: &'a [SimRequest],
    pub slo: &'a Slo,
    pub target: f64,
    pub max_nodes: usize,
    /// The planner's mean prefill share of disaggregated nodes, tried first.
    pub hint_share: Option<f64>,
    /// The planner ran colocated nodes most of the time: try colocated first.
    pub hint_colocated: bool,
    /// Node count to try first (the planner's peak); the whole budget when none passes there.
    pub first_probe: Option<usize>,
}

impl BaselineSpec<'_> {
    fn run(&self, t: Topology, stop_early: bool) -> Result<StaticRun> {
        let mut cfg = ClusterConfig::new(t, self.limits)
            .paced(self.pacing_tpot_s)
            .admitted(self.admission)
            .with_edge(self.edge_s);
        if matches!(t, Topology::Disaggregated { .. }) {
            cfg.local_prefill_below = self.local_prefill_below;
        }
        let target = if stop_early { self.target } else { 0.0 };
        let a = static_attainment(&cfg, self.cost, self.requests, self.slo, target)?;
        Ok(StaticRun {
            config: t.to_string(),
            topology: t,
            nodes: t.nodes(),
            attainment: a.attainment,
            stopped: a.stopped,
            meets: !a.stopped && a.attainment >= self.target,
        })
    }

    /// Runs each topology, in parallel on the machine's cores; results in the given order.
    fn run_all(&self, tops: &[Topology], stop_early: bool) -> Result<Vec<StaticRun>> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(tops.len().max(1));
        let mut results: Vec<Option<Result<StaticRun>>> = (0..tops.len()).map(|_| None).collect();
        std::thread::scope(|s| {
            let per = tops.len().div_ceil(threads).max(1);
            for (k, chunk) in results.chunks_mut(per).enumerate() {
                let first = k * per;
                s.spawn(move || {
                    for (j, slot) in chunk.iter_mut().enumerate() {
                        *slot = Some(self.run(tops[first + j], stop_early));
                    }
                });
            }
        });
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(BenchError::Task("static run lost".into())))).collect()
    }
}

/// A shape: colocated, or a prefill share of the nodes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Colocated,
    Share(f64),
}

impl Shape {
    fn min_nodes(self) -> usize {
        match self {
            Shape::Colocated => 1,
            Shape::Share(_) => 2,
        }
    }

    fn at(self, n: usize) -> Topology {
        match self {
            Shape::Colocated => Topology::Colocated { nodes: n },
            Shape::Share(f) => {
                let p = ((f * n as f64).round() as usize).clamp(1, n - 1);
                Topology::Disaggregated { prefill: p, decode: n - p }
            }
        }
    }
}

fn better(a: &StaticRun, b: &StaticRun) -> bool {
    a.nodes < b.nodes || (a.nodes == b.nodes && a.attainment > b.attainment)
}

/// Finds the static baseline (see the module docs).
pub fn best_static(spec: &BaselineSpec<'_>) -> Result<Baseline> {
    if spec.max_nodes == 0 {
        return Err(BenchError::InvalidArg("the static baseline needs a node budget ≥ 1".into()));
    }
    if spec.max_nodes <= EXHAUSTIVE_MAX_NODES {
        let runs = spec.run_all(&search_space(spec.max_nodes), false)?;
        let mut best: Option<StaticRun> = None;
        for r in runs.iter().filter(|r| r.meets) {
            if best.as_ref().is_none_or(|b| better(r, b)) {
                best = Some(r.clone());
            }
        }
        return Ok(Baseline { target_attainment: spec.target, runs, exhaustive: true, best });
    }
    let hint = spec.hint_share.filter(|h| *h > 0.0 && *h < 1.0);
    let mut shares: Vec<f64> = SHARES.to_vec();
    if let Some(h) = hint {
        shares.sort_by(|a, b| (a - h).abs().total_cmp(&(b - h).abs()));
        shares.insert(0, h);
    }
    let mut shapes: Vec<Shape> = shares.into_iter().map(Shape::Share).collect();
    shapes.insert(if spec.hint_colocated { 0 } else { shapes.len() }, Shape::Colocated);
    let mut runs: Vec<StaticRun> = Vec::new();
    let mut best: Option<StaticRun> = None;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).max(1);
    let first = spec.first_probe.unwrap_or(spec.max_nodes).clamp(1, spec.max_nodes);
    let mut probes = vec![first, spec.max_nodes];
    probes.dedup();
    for probe in probes {
        if best.is_some() {
            break;
        }
        for chunk in shapes.chunks(threads) {
            // Shapes that could beat the best so far, tested at one node fewer (or at the probe).
            let hi = best.as_ref().map_or(probe, |b| b.nodes - 1).min(probe);
            let batch: Vec<Shape> = chunk.iter().copied().filter(|s| s.min_nodes() <= hi).collect();
            if batch.is_empty() {
                continue;
            }
            let tops: Vec<Topology> = batch.iter().map(|s| s.at(hi)).collect();
            let tested = spec.run_all(&tops, true)?;
            runs.extend(tested.iter().cloned());
            for (shape, r) in batch.iter().zip(tested) {
                let hi_now = best.as_ref().map_or(probe, |b| b.nodes - 1);
                if !r.meets || r.nodes > hi_now {
                    continue;
                }
                let (found, mut tried) = fewest_nodes(spec, *shape, r.nodes, r, threads)?;
                runs.append(&mut tried);
                if best.as_ref().is_none_or(|b| better(&found, b)) {
                    best = Some(found);
                }
            }
        }
    }
    Ok(Baseline { target_attainment: spec.target, runs, exhaustive: false, best })
}

/// The fewest nodes of `shape` meeting the target, given that `hi` nodes (run `at_hi`) meet it:
/// k-section over `[min_nodes − 1, hi]`, `threads` runs per round.
fn fewest_nodes(
    spec: &BaselineSpec<'_>,
    shape: Shape,
    hi: usize,
    at_hi: StaticRun,
    threads: usize,
) -> Result<(StaticRun, Vec<StaticRun>)> {
    let mut lo = shape.min_nodes() - 1; // known (or taken) to fail
    let mut hi = hi;
    let mut best = at_hi;
    let mut tried = Vec::new();
    while hi - lo > 1 {
        let k = threads.min(hi - lo - 1);
        let mut points: Vec<usize> =
            (1..=k).map(|j| lo + j * (hi - lo) / (k + 1)).filter(|&n| n > lo && n < hi).collect();
        points.dedup();
        if points.is_empty() {
            break;
        }
        let tops: Vec<Topology> = points.iter().map(|&n| shape.at(n)).collect();
        let res = spec.run_all(&tops, true)?;
        let mut new_lo = lo;
        let mut new_hi = hi;
        for (&n, r) in points.iter().zip(&res) {
            if r.meets {
                if n < new_hi {
                    new_hi = n;
                    best = r.clone();
                }
            } else if n > new_lo && n < new_hi {
                new_lo = n;
            }
        }
        // A failing point above a passing one (non-monotone): trust the passing one.
        lo = new_lo.min(new_hi - 1);
        hi = new_hi;
        tried.extend(res);
    }
    Ok((best, tried))
}
