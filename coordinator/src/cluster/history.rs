//! What the built-in dashboard plots (`GET /dashboard`, data from `GET /admin/dashboard`): a
//! sample of every pool's state and of what clients saw, every [`SAMPLE_EVERY`], the last
//! [`HISTORY_LEN`] of them (15 minutes), kept by the planner actor so that a page opened now
//! shows the recent past, not only what happens after it opened.
//!
//! Sans-IO: the actor passes in time, the nodes' states and its latency window's summary; handoff
//! telemetry and routes arrive as observations between samples and are folded into the next one.
//!
//! Invariant: samples are in time order, at most [`HISTORY_LEN`]; counts in a sample (`routes`,
//! `handoffs`) cover exactly the time since the previous sample.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use super::registry::{NodeState, PoolSummary};

/// How often a sample is taken.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// Samples kept: 15 minutes at [`SAMPLE_EVERY`].
pub const HISTORY_LEN: usize = 450;

/// One pool at one time.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PoolSample {
    /// Nodes routed new work, and nodes of the pool draining, switching or parked.
    pub active_nodes: u32,
    pub inactive_nodes: u32,
    pub queued_prefill_tokens: u64,
    pub running_seqs: u64,
    /// Share of the pool's KV blocks in use (0..1).
    pub kv_usage: f64,
    /// Requests completed over the planner's window whose latency counts for this pool, per second.
    pub completions_per_s: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub tpot_p50_ms: Option<f64>,
    pub tpot_p90_ms: Option<f64>,
    /// Share of those requests that met both targets.
    pub slo_attainment: Option<f64>,
}

/// Handoffs that completed since the previous sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct HandoffSample {
    pub count: u64,
    pub bytes_per_s: f64,
    /// Mean time from the first token to the KV landed (what the transfer adds to TTFT).
    pub tail_mean_ms: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Seconds since the coordinator started.
    pub t_s: f64,
    /// `prefill`, `decode`, `colocated`, and `overall` (latency only).
    pub pools: BTreeMap<&'static str, PoolSample>,
    pub handoffs: HandoffSample,
    /// Requests completed since the previous sample, by route (`remote`, `colocated`, and the
    /// reasons of local prefills).
    pub routes: BTreeMap<&'static str, u64>,
}

#[derive(Debug, Default)]
pub struct History {
    samples: VecDeque<Sample>,
    last: Option<Duration>,
    handoffs: u64,
    handoff_bytes: u64,
    handoff_tail: Duration,
    routes: BTreeMap<&'static str, u64>,
}

impl History {
    pub fn on_handoff(&mut self, bytes: u64, tail: Duration) {
        self.handoffs += 1;
        self.handoff_bytes += bytes;
        self.handoff_tail += tail;
    }

    pub fn on_completion(&mut self, path: &'static str) {
        *self.routes.entry(path).or_default() += 1;
    }

    /// Whether a sample is due at `now`.
    pub fn due(&self, now: Duration) -> bool {
        self.last.is_none_or(|l| now.saturating_sub(l) >= SAMPLE_EVERY)
    }

    /// Takes a sample. `latency`: the latency window's summary per pool (`requests`,
    /// `ttft_ms`/`tpot_ms` `p50`/`p90`, `slo_attainment`, `window_s`, as `GET /admin/pools` shows it).
    pub fn sample(&mut self, now: Duration, states: &[NodeState], latency: &HashMap<String, Value>) {
        let since = self.last.map_or(SAMPLE_EVERY, |l| now.saturating_sub(l)).max(Duration::from_millis(1));
        self.last = Some(now);
        let summary = PoolSummary::of_states(states);
        let loads = summary.named().into_iter().map(|(k, v)| (k, Some(v)));
        let mut pools = BTreeMap::new();
        for (pool, load) in loads.chain([("overall", None)]) {
            let mut p = PoolSample::default();
            if let Some(l) = load {
                p.active_nodes = l.nodes as u32;
                p.inactive_nodes = l.inactive as u32;
                p.queued_prefill_tokens = l.queued_prefill_tokens;
                p.running_seqs = l.running_seqs;
                p.kv_usage = l.kv_usage();
            }
            if let Some(l) = latency.get(pool) {
                let window = l["window_s"].as_f64().filter(|w| *w > 0.0).unwrap_or(1.0);
                p.completions_per_s = l["requests"].as_f64().unwrap_or(0.0) / window;
                p.ttft_p50_ms = l["ttft_ms"]["p50"].as_f64();
                p.ttft_p90_ms = l["ttft_ms"]["p90"].as_f64();
                p.tpot_p50_ms = l["tpot_ms"]["p50"].as_f64();
                p.tpot_p90_ms = l["tpot_ms"]["p90"].as_f64();
                p.slo_attainment = l["slo_attainment"].as_f64();
            }
            pools.insert(pool, p);
        }
        let handoffs = HandoffSample {
            count: self.handoffs,
            bytes_per_s: self.handoff_bytes as f64 / since.as_secs_f64(),
            tail_mean_ms: (self.handoffs > 0).then(|| self.handoff_tail.as_secs_f64() * 1e3 / self.handoffs as f64),
        };
        (self.handoffs, self.handoff_bytes, self.handoff_tail) = (0, 0, Duration::ZERO);
        let routes = std::mem::take(&mut self.routes);
        if self.samples.len() == HISTORY_LEN {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample { t_s: now.as_secs_f64(), pools, handoffs, routes });
    }

    pub fn samples(&self) -> impl Iterator<Item = &Sample> {
        self.samples.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::registry::Lifecycle;
    use cleave_protocol::control::{LoadReport, NodeRole};
    use serde_json::json;

    fn node(id: u64, role: NodeRole, lifecycle: Lifecycle, queued: u64) -> NodeState {
        let load = LoadReport {
            queued_prefill_tokens: queued,
            running_seqs: 3,
            free_blocks: 60,
            cached_blocks: 10,
            total_blocks: 100,
            ..Default::default()
        };
        NodeState::for_test(id, role, lifecycle, load)
    }

    #[test]
    fn samples_fold_pools_latency_and_what_happened_since_the_last_one() {
        let mut h = History::default();
        let states = [
            node(1, NodeRole::Prefill, Lifecycle::Active, 500),
            node(2, NodeRole::Decode, Lifecycle::Active, 0),
            node(3, NodeRole::Decode, Lifecycle::Drained, 0),
        ];
        let latency: HashMap<String, Value> = [(
            "decode".to_string(),
            json!({"requests": 40, "window_s": 20.0, "ttft_ms": {"p50": 100.0, "p90": 300.0},
                   "tpot_ms": {"p50": 50.0, "p90": 80.0}, "slo_attainment": 0.95}),
        )]
        .into();
        assert!(h.due(Duration::ZERO));
        h.on_handoff(1000, Duration::from_millis(4));
        h.on_handoff(3000, Duration::from_millis(2));
        h.on_completion("remote");
        h.on_completion("short_prompt");
        h.on_completion("remote");
        h.sample(Duration::from_secs(2), &states, &latency);
        assert!(!h.due(Duration::from_secs(3)));
        assert!(h.due(Duration::from_secs(4)));
        h.sample(Duration::from_secs(4), &states, &HashMap::new());
        let s: Vec<&Sample> = h.samples().collect();
        let (p, d) = (&s[0].pools["prefill"], &s[0].pools["decode"]);
        assert_eq!((p.active_nodes, p.inactive_nodes, p.queued_prefill_tokens), (1, 0, 500));
        assert_eq!((d.active_nodes, d.inactive_nodes, d.running_seqs), (1, 1, 6));
        assert!((d.kv_usage - 0.3).abs() < 1e-12);
        assert_eq!((d.completions_per_s, d.tpot_p90_ms, d.slo_attainment), (2.0, Some(80.0), Some(0.95)));
        assert_eq!(s[0].handoffs, HandoffSample { count: 2, bytes_per_s: 2000.0, tail_mean_ms: Some(3.0) });
        assert_eq!(s[0].routes, [("remote", 2), ("short_prompt", 1)].into());
        // The second sample counts only what came after the first.
        assert_eq!(s[1].handoffs, HandoffSample::default());
        assert!(s[1].routes.is_empty());
        assert_eq!(s[1].pools["decode"].ttft_p90_ms, None);
    }

    #[test]
    fn history_keeps_the_last_fifteen_minutes() {
        let mut h = History::default();
        for i in 0..(HISTORY_LEN as u64 + 10) {
            h.sample(Duration::from_secs(2 * i), &[], &HashMap::new());
        }
        let s: Vec<&Sample> = h.samples().collect();
        assert_eq!(s.len(), HISTORY_LEN);
        assert_eq!(s[0].t_s, 20.0);
        assert!(s.windows(2).all(|w| w[0].t_s < w[1].t_s));
    }
}
