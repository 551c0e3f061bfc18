//! Cluster shapes: `XpYd` (X prefill nodes handing KV to Y decode nodes) and `Kc` (K colocated
//! nodes, each running vLLM-style chunked prefill beside its decodes).

use std::fmt;
use std::str::FromStr;

use cleave_planner::admission::Admission;
use serde::{Deserialize, Serialize};

use crate::error::BenchError;

/// Node counts of one cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Topology {
    /// `prefill` prefill nodes and `decode` decode nodes (both ≥ 1).
    Disaggregated { prefill: usize, decode: usize },
    /// `nodes` colocated nodes (≥ 1).
    Colocated { nodes: usize },
}

impl Topology {
    pub fn nodes(&self) -> usize {
        match *self {
            Topology::Disaggregated { prefill, decode } => prefill + decode,
            Topology::Colocated { nodes } => nodes,
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Disaggregated { prefill, decode } => write!(f, "{prefill}p{decode}d"),
            Topology::Colocated { nodes } => write!(f, "{nodes}c"),
        }
    }
}

impl FromStr for Topology {
    type Err = BenchError;

    /// `1p1d`, `4p12d`, `8c` (case-insensitive).
    fn from_str(s: &str) -> Result<Self, BenchError> {
        let bad = || BenchError::InvalidArg(format!("config `{s}`: expected XpYd (like 2p6d) or Kc (like 4c)"));
        let t = s.trim().to_ascii_lowercase();
        let num = |x: &str| x.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(bad);
        if let Some(k) = t.strip_suffix('c') {
            return Ok(Topology::Colocated { nodes: num(k)? });
        }
        let body = t.strip_suffix('d').ok_or_else(bad)?;
        let (p, d) = body.split_once('p').ok_or_else(bad)?;
        Ok(Topology::Disaggregated { prefill: num(p)?, decode: num(d)? })
    }
}

/// Per-node engine limits and cleave's routing options. `Default` takes the engine defaults;
/// [`NodeLimits::from_cost`] takes them from a profile.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NodeLimits {
    /// Most tokens per step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most sequences admitted at once on a decode or colocated node.
    pub max_num_seqs: usize,
    /// KV capacity of a decode or colocated node, tokens. A sequence reserves prompt + output at
    /// admission (no preemption); one that alone exceeds it is admitted on an empty node anyway.
    pub kv_capacity_tokens: usize,
}

impl Default for NodeLimits {
    fn default() -> Self {
        Self { max_num_batched_tokens: 2048, max_num_seqs: 64, kv_capacity_tokens: usize::MAX }
    }
}

impl NodeLimits {
    pub fn from_cost(cost: &super::cost::CostModel) -> Self {
        Self {
            max_num_batched_tokens: cost.max_num_batched_tokens,
            max_num_seqs: cost.max_num_seqs,
            kv_capacity_tokens: cost.kv_capacity_tokens,
        }
    }
}

/// A cluster to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClusterConfig {
    pub topology: Topology,
    pub limits: NodeLimits,
    /// Conditional disaggregation (disaggregated topologies only): prompts shorter than this many
    /// tokens are prefilled on their decode node as a chunk of a mixed step. 0: always hand off.
    pub local_prefill_below: usize,
    /// Nodes pace prompt chunks beside decodes to this time per output token, seconds (as
    /// `cleave_engine::sched::pacing` does to the coordinator's target); None: the step budget
    /// alone sizes chunks.
    pub pacing_tpot_s: Option<f64>,
    /// SLO admission (`cleave coordinator --slo-admission`), by the coordinator's own rules
    /// ([`cleave_planner::admission`]): each decoding node takes no new stream while it holds
    /// its seat cap, requests wait at the edge for a seat up to `max_wait` and are then shed,
    /// and a prompt whose node has more prompt work queued than it gets through before the TTFT
    /// target is shed at once. None: every request is routed at once.
    #[serde(default)]
    pub admission: Option<Admission>,
    /// Seconds every request's first token (and so its end) takes beyond what the nodes do:
    /// the HTTP edge, tokenization, routing and the tokens' trip back to the client, which a
    /// measured TTFT includes and the step costs do not (BENCHMARKS.md, "Simulated against
    /// measured"). 0: none.
    #[serde(default)]
    pub edge_s: f64,
}

impl ClusterConfig {
    pub fn new(topology: Topology, limits: NodeLimits) -> Self {
        Self { topology, limits, local_prefill_below: 0, pacing_tpot_s: None, admission: None, edge_s: 0.0 }
    }

    /// SLO admission to these targets (see [`Self::admission`]).
    pub fn admitted(mut self, admission: Option<Admission>) -> Self {
        self.admission = admission;
        self
    }

    /// The edge's own latency, seconds (see [`Self::edge_s`]); a negative or non-finite one
    /// is 0.
    pub fn with_edge(mut self, edge_s: f64) -> Self {
        self.edge_s = if edge_s.is_finite() { edge_s.max(0.0) } else { 0.0 };
        self
    }

    /// Paces prompt chunks to `tpot_s` (see [`Self::pacing_tpot_s`]).
    pub fn paced(mut self, tpot_s: Option<f64>) -> Self {
        self.pacing_tpot_s = tpot_s.filter(|t| t.is_finite() && *t > 0.0);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for s in ["1p1d", "4p12d", "8c", "120P380D"] {
            let t: Topology = s.parse().unwrap();
            assert_eq!(t.to_string(), s.to_ascii_lowercase());
        }
        assert_eq!("3p5d".parse::<Topology>().unwrap().nodes(), 8);
        for s in ["", "p1d", "0c", "1p0d", "1p", "2x", "c", "1p1dd"] {
            assert!(s.parse::<Topology>().is_err(), "{s}");
        }
    }
}
