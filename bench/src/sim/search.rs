//! Predictions from simulated records: latency summaries, SLO attainment, the highest request
//! rate a cluster sustains within SLOs (bisection over rate with one seed), and the configuration
//! with the most goodput per node.
//!
//! Goodput follows DistServe: the largest request rate at which at least `attainment` of requests
//! meet every SLO. Per node it is that rate over the node count.

use serde::{Deserialize, Serialize};

use super::cluster::{ClusterConfig, NodeLimits, Topology};
use super::cost::CostModel;
use super::engine::{simulate, SimRecord};
use super::workload::{SimRequest, WorkloadSpec};
use crate::error::{BenchError, Result};

/// The SLOs are `bench serve`'s (milliseconds; `None` is not checked), so a prediction and a
/// measured run are judged by one definition.
pub use crate::metrics::Slo;

/// Whether a simulated request meets every objective that is set (a shed one meets none).
pub fn meets(slo: &Slo, r: &SimRecord) -> bool {
    let within = |limit_ms: Option<f64>, v_s: f64| limit_ms.is_none_or(|ms| v_s * 1e3 <= ms);
    !r.shed && within(slo.ttft_ms, r.ttft_s) && within(slo.tpot_ms, r.tpot_s) && within(slo.e2el_ms, r.e2el_s)
}

/// Mean and percentiles of one latency, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Dist {
    /// Percentiles by linear interpolation between order statistics (numpy's default).
    pub fn of(mut xs: Vec<f64>) -> Self {
        if xs.is_empty() {
            return Self::default();
        }
        xs.sort_by(f64::total_cmp);
        let q = |p: f64| {
            let h = p * (xs.len() - 1) as f64;
            let i = h.floor() as usize;
            let j = (i + 1).min(xs.len() - 1);
            xs[i] + (h - i as f64) * (xs[j] - xs[i])
        };
        Self { mean: xs.iter().sum::<f64>() / xs.len() as f64, median: q(0.5), p90: q(0.9), p99: q(0.99) }
    }
}

/// What a run looks like, predicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PredictSummary {
    pub completed: usize,
    /// First arrival to last finish, seconds.
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub ttft: Dist,
    /// Over requests with more than one output token.
    pub tpot: Dist,
    pub e2el: Dist,
    /// Fraction of requests meeting the SLO (1 without one).
    pub attainment: f64,
    /// Requests meeting the SLO per second of `duration_s` (vLLM's goodput).
    pub goodput: f64,
}

/// Summarizes records against `slo`.
pub fn summarize(records: &[SimRecord], slo: Option<&Slo>) -> PredictSummary {
    if records.is_empty() {
        return PredictSummary::default();
    }
    let start = records.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
    let end = records.iter().map(|r| r.arrival_s + r.e2el_s).fold(f64::NEG_INFINITY, f64::max);
    let duration_s = (end - start).max(f64::MIN_POSITIVE);
    let good = records.iter().filter(|r| slo.is_none_or(|s| meets(s, r))).count();
    let out: usize = records.iter().map(|r| r.output_len).sum();
    PredictSummary {
        completed: records.len(),
        duration_s,
        request_throughput: records.len() as f64 / duration_s,
        output_throughput: out as f64 / duration_s,
        ttft: Dist::of(records.iter().map(|r| r.ttft_s).collect()),
        tpot: Dist::of(records.iter().filter(|r| r.output_len > 1).map(|r| r.tpot_s).collect()),
        e2el: Dist::of(records.iter().map(|r| r.e2el_s).collect()),
        attainment: good as f64 / records.len() as f64,
        goodput: good as f64 / duration_s,
    }
}

/// Simulates and summarizes: the number to set beside a measured run of the same requests.
pub fn predict(
    cfg: &ClusterConfig,
    cost: &CostModel,
    requests: &[SimRequest],
    slo: Option<&Slo>,
) -> Result<PredictSummary> {
    Ok(summarize(&simulate(cfg, cost, requests)?, slo))
}

/// What the goodput search looks for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SearchSpec {
    pub slo: Slo,
    /// Fraction of requests that must meet the SLO, in (0, 1].
    pub attainment: f64,
    pub workload: WorkloadSpec,
    /// Stop bisecting when the bracket is narrower than this fraction of its upper end.
    pub rel_tolerance: f64,
    /// Highest rate tried, requests per second.
    pub max_rate: f64,
}

/// One configuration's goodput.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    pub config: String,
    pub topology: Topology,
    pub nodes: usize,
    /// Largest rate found with attainment ≥ target (0: not even an idle cluster meets the SLO).
    pub max_rate: f64,
    pub per_node: f64,
    /// The prediction at `max_rate`.
    pub at_max: PredictSummary,
}

/// Attainment of `cfg` at `rate` with the spec's requests.
pub fn attainment_at(cfg: &ClusterConfig, cost: &CostModel, spec: &SearchSpec, rate: f64) -> Result<PredictSummary> {
    predict(cfg, cost, &spec.workload.generate(rate)?, Some(&spec.slo))
}

/// The largest rate whose attainment meets the target: doubling from 1 req/s (or halving) to a
/// bracket, then bisection. Assumes attainment falls with rate, which common random numbers
/// make true in practice (see [`super::workload`]).
pub fn max_goodput(cfg: &ClusterConfig, cost: &CostModel, spec: &SearchSpec) -> Result<Goodput> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    let attainment_ok = spec.attainment > 0.0 && spec.attainment <= 1.0;
    if !attainment_ok || !positive(spec.rel_tolerance) || !positive(spec.max_rate) {
        return Err(BenchError::InvalidArg(format!(
            "attainment {} must be in (0, 1], tolerance {} and max rate {} positive",
            spec.attainment, spec.rel_tolerance, spec.max_rate
        )));
    }
    let ok = |s: &PredictSummary| s.attainment >= spec.attainment;
    let mut rate = 1.0f64.min(spec.max_rate);
    let mut s = attainment_at(cfg, cost, spec, rate)?;
    let (mut lo, mut hi, mut best);
    if ok(&s) {
        lo = rate;
        best = s;
        loop {
            if rate >= spec.max_rate {
                return Ok(goodput(cfg, spec.max_rate, best));
            }
            rate = (rate * 2.0).min(spec.max_rate);
            s = attainment_at(cfg, cost, spec, rate)?;
            if !ok(&s) {
                hi = rate;
                break;
            }
            lo = rate;
            best = s;
        }
    } else {
        hi = rate;
        loop {
            rate /= 2.0;
            if rate < 1e-6 {
                return Ok(goodput(cfg, 0.0, PredictSummary::default()));
            }
            s = attainment_at(cfg, cost, spec, rate)?;
            if ok(&s) {
                lo = rate;
                best = s;
                break;
            }
            hi = rate;
        }
    }
    while hi - lo > spec.rel_tolerance * hi {
        let mid = 0.5 * (lo + hi);
        let s = attainment_at(cfg, cost, spec, mid)?;
        if ok(&s) {
            lo = mid;
            best = s;
        } else {
            hi = mid;
        }
    }
    Ok(goodput(cfg, lo, best))
}

fn goodput(cfg: &ClusterConfig, rate: f64, at_max: PredictSummary) -> Goodput {
    let nodes = cfg.topology.nodes();
    Goodput {
        config: cfg.topology.to_string(),
        topology: cfg.topology,
        nodes,
        max_rate: rate,
        per_node: rate / nodes as f64,
        at_max,
    }
}

/// Every `XpYd` with x + y ≤ `max_nodes` and every `Kc` with K ≤ `max_nodes` when
/// `max_nodes ≤ 8`; beyond that, the clusters of exactly `max_nodes` nodes: `Nc` and up to 24
/// prefill:decode splits spread evenly over 1..N−1.
pub fn search_space(max_nodes: usize) -> Vec<Topology> {
    let mut out = Vec::new();
    if max_nodes <= 8 {
        for n in 1..=max_nodes {
            out.push(Topology::Colocated { nodes: n });
            for p in 1..n {
                out.push(Topology::Disaggregated { prefill: p, decode: n - p });
            }
        }
        return out;
    }
    let n = max_nodes;
    out.push(Topology::Colocated { nodes: n });
    let splits = 24.min(n - 1);
    let mut ps: Vec<usize> = (0..splits).map(|i| 1 + i * (n - 2) / (splits - 1).max(1)).collect();
    ps.dedup();
    out.extend(ps.into_iter().map(|p| Topology::Disaggregated { prefill: p, decode: n - p }));
    out
}

/// Goodput of each topology, best per node first (ties: fewer nodes, then the order given).
/// Topologies are searched in parallel on the machine's cores; the result does not depend on it.
pub fn recommend(
    topologies: &[Topology],
    limits: NodeLimits,
    local_prefill_below: usize,
    cost: &CostModel,
    spec: &SearchSpec,
) -> Result<Vec<Goodput>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(topologies.len().max(1));
    let mut results: Vec<Option<Result<Goodput>>> = (0..topologies.len()).map(|_| None).collect();
    std::thread::scope(|s| {
        let chunks: Vec<_> = results.chunks_mut(topologies.len().div_ceil(threads).max(1)).collect();
        let mut start = 0;
        for chunk in chunks {
            let first = start;
            start += chunk.len();
            s.spawn(move || {
                for (k, slot) in chunk.iter_mut().enumerate() {
                    let mut cfg = ClusterConfig::new(topologies[first + k], limits);
                    if matches!(cfg.topology, Topology::Disaggregated { .. }) {
                        cfg.local_prefill_below = local_prefill_below;
                    }
                    *slot = Some(max_goodput(&cfg, cost, spec));
                }
            });
        }
    });
    let mut out = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(BenchError::Profile("lost".into()))))
        .collect::<Result<Vec<_>>>()?;
    // Stable: equal goodput keeps the given order after the node-count tie-break.
    out.sort_by(|a, b| b.per_node.total_cmp(&a.per_node).then(a.nodes.cmp(&b.nodes)));
    Ok(out)
}

/// Predicted beside measured for one real run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub predicted: PredictSummary,
    pub measured: PredictSummary,
}

/// Replays a measured run's requests (their arrival times and lengths) through the simulator and
/// summarizes both sides against the same SLO. `measured` holds the real run's per-request
/// latencies in [`SimRecord`] form (node fields are ignored).
pub fn compare(cfg: &ClusterConfig, cost: &CostModel, measured: &[SimRecord], slo: Option<&Slo>) -> Result<Comparison> {
    let requests: Vec<SimRequest> = measured
        .iter()
        .map(|r| SimRequest { arrival_s: r.arrival_s, input_len: r.input_len, output_len: r.output_len })
        .collect();
    Ok(Comparison { predicted: predict(cfg, cost, &requests, slo)?, measured: summarize(measured, slo) })
}
