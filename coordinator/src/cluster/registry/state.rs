//! What the registry shows of its nodes and pools: [`NodeState`] per node (the admin API's
//! `GET /admin/nodes`), [`PoolLoad`] and [`PoolSummary`] per pool (the planner's and the
//! metrics' view). Plain data, built by [`super::Registry`] from its table.

use std::net::SocketAddr;
use std::time::Duration;

use cleave_protocol::control::{LoadReport, NodeRole};

use super::{Lifecycle, NodeRef};

/// One node as the admin API shows it.
#[derive(Debug, Clone)]
pub struct NodeState {
    pub node: NodeRef,
    pub lifecycle: Lifecycle,
    /// Attempts routed to the node that have not ended.
    pub active_prefill: u32,
    pub active_decode: u32,
    /// SLO admission's cap on the streams it decodes at once (None: admission off, or the node
    /// has not yet run over the TPOT target).
    pub seat_cap: Option<u32>,
    pub step_budget: Option<u32>,
    pub model_name: String,
    /// Where the node serves its metrics, as it registered it.
    pub metrics_addr: Option<SocketAddr>,
    /// What its weights are (nodes of one model may hold it in different formats).
    pub weights: cleave_protocol::WeightsInfo,
    /// The last report, without its prefix hashes.
    pub load: LoadReport,
    /// Prompt tokens queued on the node as routing counts them: the report's, plus those routed
    /// since it, and at least those of the remote prefills routed to it and not ended. What the
    /// planner reads: a report snapshotted before a prompt arrived says nothing is queued.
    pub queued_prefill: u64,
    /// Sequences on the node as routing counts them: the report's running and waiting ones plus
    /// those routed since, and at least the streams routed to it and not ended.
    pub routed_seqs: u32,
    pub cached_prefix_blocks: usize,
    pub report_age: Duration,
}

#[cfg(test)]
impl NodeState {
    /// A node as a test needs it: `id`, named `n{id}`, with `load`; nothing routed to it.
    pub(crate) fn for_test(id: u64, role: NodeRole, lifecycle: Lifecycle, load: LoadReport) -> NodeState {
        NodeState {
            node: NodeRef { id, name: format!("n{id}"), role, rpc_addr: ([127, 0, 0, 1], 1).into() },
            lifecycle,
            active_prefill: 0,
            active_decode: 0,
            seat_cap: None,
            step_budget: None,
            model_name: "m".into(),
            metrics_addr: None,
            weights: Default::default(),
            queued_prefill: load.queued_prefill_tokens,
            routed_seqs: load.running_seqs + load.waiting_seqs,
            load,
            cached_prefix_blocks: 0,
            report_age: Duration::ZERO,
        }
    }
}

/// Load of one pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolLoad {
    /// Nodes routed new work.
    pub nodes: u64,
    /// Nodes of this role that are draining, switching, parked or leaving.
    pub inactive: u64,
    pub queued_prefill_tokens: u64,
    pub running_seqs: u64,
    pub waiting_seqs: u64,
    pub free_blocks: u64,
    pub cached_blocks: u64,
    pub total_blocks: u64,
}

impl PoolLoad {
    /// Share of the pool's KV blocks in use (neither free nor holding cached prefixes), 0..1.
    pub fn kv_usage(&self) -> f64 {
        let used = self.total_blocks.saturating_sub(self.free_blocks + self.cached_blocks);
        if self.total_blocks == 0 {
            0.0
        } else {
            used as f64 / self.total_blocks as f64
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolSummary {
    pub prefill: PoolLoad,
    pub decode: PoolLoad,
    pub colocated: PoolLoad,
}

impl PoolSummary {
    /// The pools of the nodes the admin API lists (what [`Registry::pools`] says of the live ones).
    pub fn of_states(states: &[NodeState]) -> Self {
        let mut s = Self::default();
        for n in states {
            s.add(n.node.role, n.lifecycle == Lifecycle::Active, &n.load);
        }
        s
    }

    pub(super) fn add(&mut self, role: NodeRole, active: bool, load: &LoadReport) {
        let p = match role {
            NodeRole::Prefill => &mut self.prefill,
            NodeRole::Decode => &mut self.decode,
            NodeRole::Both => &mut self.colocated,
        };
        if active {
            p.nodes += 1;
        } else {
            p.inactive += 1;
        }
        p.queued_prefill_tokens += load.queued_prefill_tokens;
        p.running_seqs += u64::from(load.running_seqs);
        p.waiting_seqs += u64::from(load.waiting_seqs);
        p.free_blocks += u64::from(load.free_blocks);
        p.cached_blocks += u64::from(load.cached_blocks);
        p.total_blocks += u64::from(load.total_blocks);
    }

    /// The pools by name (`prefill`, `decode`, `colocated`).
    pub fn named(&self) -> [(&'static str, &PoolLoad); 3] {
        [("prefill", &self.prefill), ("decode", &self.decode), ("colocated", &self.colocated)]
    }
}
