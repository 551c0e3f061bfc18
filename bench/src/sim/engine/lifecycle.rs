//! Nodes that change during a run (planner mode): role switches with their drains, stops,
//! starts within the node budget, step budgets, and what the planner sees of the nodes. The
//! rules are in the parent module's docs ("Nodes that change"); this is their only
//! implementation.

use std::time::Duration;

use cleave_planner::{NodeObs, NodeState, Role, Snapshot};
use serde::{Deserialize, Serialize};

use super::{Event, Node, Sim};

/// Where a node is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Life {
    /// Asked for; waits for a slot in the node budget.
    Queued,
    /// Holds a slot and loads its model.
    Loading,
    Active,
    /// Finishing the work its next role does not do; not routed.
    Switching {
        to: Role,
    },
    /// Finishing all its work before it goes; not routed.
    Stopping,
    Gone,
}

impl Life {
    /// Whether the node occupies a machine of the budget.
    pub fn holds_machine(self) -> bool {
        !matches!(self, Life::Queued | Life::Gone)
    }
}

/// A node's life or role changed (planner mode): its new life and role.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub t: f64,
    pub node: usize,
    pub life: Life,
    pub role: Role,
}

/// What planner mode adds: a node budget and a start delay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(in crate::sim) struct Dynamics {
    pub max_nodes: usize,
    pub start_delay_s: f64,
}

impl Sim<'_> {
    /// Starts switching an active node from `from` to `to`; false when it is not an active
    /// `from` node.
    pub(in crate::sim) fn switch_role(&mut self, n: usize, from: Role, to: Role, t: f64) -> bool {
        let ok = self.nodes.get(n).is_some_and(|x| x.life == Life::Active && x.role == from && from != to);
        if ok {
            self.leave(n);
            self.nodes[n].life = Life::Switching { to };
            self.log(n, t);
            self.check_drain(n, t);
        }
        ok
    }

    /// Starts draining an active node for good; false when it is not active.
    pub(in crate::sim) fn stop_node(&mut self, n: usize, t: f64) -> bool {
        let ok = self.nodes.get(n).is_some_and(|x| x.life == Life::Active);
        if ok {
            self.leave(n);
            self.nodes[n].life = Life::Stopping;
            self.log(n, t);
            self.check_drain(n, t);
        }
        ok
    }

    /// Sets a colocated node's tokens per step (from its next step on); false for other nodes.
    pub(in crate::sim) fn set_step_budget(&mut self, n: usize, tokens: usize) -> bool {
        let ok = self.nodes.get(n).is_some_and(|x| x.role == Role::Both && x.life != Life::Gone && tokens > 0);
        if ok {
            self.nodes[n].budget = tokens;
        }
        ok
    }

    /// Holds colocated nodes' streams to `tpot_s` (their pacing, when the cluster paces, and
    /// their seats, under SLO admission), at most the TPOT target; None: to the target. What
    /// the coordinator sends colocated nodes (`targets.colocated_tpot_ms`).
    pub(in crate::sim) fn set_colocated_hold(&mut self, tpot_s: Option<f64>) {
        self.colocated_hold_s = tpot_s.filter(|t| t.is_finite() && *t > 0.0);
    }

    /// Asks for a new node in `role` (colocated: with `budget` tokens per step); it loads once a
    /// slot of the node budget is free. Returns its id.
    pub(in crate::sim) fn start_node(&mut self, role: Role, budget: Option<usize>, t: f64) -> usize {
        let default = self.cfg.limits.max_num_batched_tokens;
        let budget = if role == Role::Both { budget.filter(|&b| b > 0).unwrap_or(default) } else { default };
        let n = self.nodes.len();
        self.nodes.push(Node::new(role, Life::Queued, budget));
        self.log(n, t);
        self.queued_starts.push_back(n);
        self.grant_slots(t);
        n
    }

    fn grant_slots(&mut self, t: f64) {
        let Some(d) = self.dynamics else { return };
        while self.holding < d.max_nodes {
            let Some(n) = self.queued_starts.pop_front() else { break };
            self.holding += 1;
            self.peak_holding = self.peak_holding.max(self.holding);
            self.nodes[n].life = Life::Loading;
            self.log(n, t);
            self.push(t + d.start_delay_s, Event::Ready(n));
        }
    }

    /// A node now active in its role: routed, and given what waited for it.
    pub(super) fn activate(&mut self, n: usize, t: f64) {
        self.join(n);
        self.log(n, t);
        self.flush(t);
        self.kick(n, t);
    }

    /// Ends a switch or a stop whose drained work is done.
    pub(super) fn check_drain(&mut self, n: usize, t: f64) {
        let node = &self.nodes[n];
        let life = node.life;
        let prefills = |r: Role| r != Role::Decode;
        let decodes = |r: Role| r != Role::Prefill;
        let (prefill_kind, stream_kind) = match life {
            Life::Switching { to } => (prefills(node.role) && !prefills(to), decodes(node.role) && !decodes(to)),
            Life::Stopping => (true, true),
            _ => return,
        };
        if (prefill_kind && node.prefill_work()) || (stream_kind && node.stream_work()) {
            return;
        }
        match life {
            Life::Switching { to } => {
                let node = &mut self.nodes[n];
                node.role = to;
                if to != Role::Both {
                    node.budget = self.cfg.limits.max_num_batched_tokens;
                }
                node.life = Life::Active;
                self.activate(n, t);
            }
            _ => {
                self.nodes[n].life = Life::Gone;
                self.holding -= 1;
                self.log(n, t);
                self.grant_slots(t);
            }
        }
    }

    /// What the planner sees: every node that is not gone.
    pub(in crate::sim) fn snapshot(&self, t: f64) -> Snapshot {
        let cap = self.cfg.limits.kv_capacity_tokens.max(1) as f64;
        let nodes = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let state = match n.life {
                    Life::Queued | Life::Loading => NodeState::Starting,
                    Life::Active => NodeState::Active,
                    Life::Switching { to } => NodeState::Switching { to },
                    Life::Stopping => NodeState::Draining,
                    Life::Gone => return None,
                };
                Some(NodeObs {
                    id: i as u64,
                    role: n.role,
                    state,
                    queued_prefill_tokens: n.queued + n.unprefilled_local,
                    waiting_seqs: u32::try_from(n.waiting.len()).unwrap_or(u32::MAX),
                    running_seqs: u32::try_from(n.running.len() + n.ready.len() + n.prefilling.len())
                        .unwrap_or(u32::MAX),
                    kv_used_ratio: (n.reserved as f64 / cap).min(1.0),
                    step_budget: (n.role == Role::Both).then(|| u32::try_from(n.budget).unwrap_or(u32::MAX)),
                    paced: self.cfg.pacing_tpot_s.is_some(),
                })
            })
            .collect();
        Snapshot { now: Duration::from_secs_f64(t.max(0.0)), nodes }
    }

    /// Checks the invariants of the module docs and that drains were respected (planner mode;
    /// for tests): every unfinished request that has arrived is in exactly one queue or in
    /// flight, finished ones in none; routed iff active; no stream on an active prefill node and
    /// no prompt queued for handoff on a decode node; the node budget holds.
    #[cfg(test)]
    pub(in crate::sim) fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut places = vec![0u8; self.reqs.len()];
        let mut inbound = 0;
        let mut holding = 0;
        let mut active = 0;
        for (i, n) in self.nodes.iter().enumerate() {
            holding += usize::from(n.life.holds_machine());
            active += usize::from(n.life == Life::Active);
            inbound += n.inbound;
            let load = if n.role == Role::Prefill { n.queued } else { n.outstanding };
            let routed = self.pools[super::pool_of(n.role)].set.contains(&(load, n.stamp, i));
            if routed != (n.life == Life::Active) {
                return Err(format!("node {i} ({:?}, {:?}) routed: {routed}", n.life, n.role));
            }
            if n.role == Role::Prefill && n.life == Life::Active && n.stream_work() {
                return Err(format!("active prefill node {i} holds streams"));
            }
            if n.role == Role::Decode && !n.remote.is_empty() {
                return Err(format!("decode node {i} ({:?}) holds prompts for handoff", n.life));
            }
            if n.life == Life::Gone && (n.prefill_work() || n.stream_work()) {
                return Err(format!("node {i} left with work"));
            }
            let queues = n.remote.iter().chain(&n.waiting).chain(&n.ready).chain(&n.prefilling).chain(&n.running);
            for &r in queues {
                places[r] += 1;
            }
        }
        for &r in self.edge.iter().chain(self.parked.iter().map(|(r, _)| r)) {
            places[r] += 1;
        }
        if self.cfg.admission.is_some() {
            let remote: usize = self.nodes.iter().map(|n| n.remote.len()).sum();
            if remote as u64 != self.pending_remote {
                return Err(format!("{remote} prompts queued for handoff, {} counted", self.pending_remote));
            }
        }
        for &r in &self.edge {
            if !self.state[r].at_edge || self.state[r].shed {
                return Err(format!("request {r} at the edge is marked otherwise"));
            }
        }
        let pooled: usize = self.pools.iter().map(|p| p.set.len()).sum();
        if pooled != active {
            return Err(format!("{pooled} nodes routed, {active} active"));
        }
        if holding != self.holding || self.dynamics.is_some_and(|d| holding > d.max_nodes) {
            return Err(format!(
                "{holding} nodes hold machines (counted {}), budget {:?}",
                self.holding, self.dynamics
            ));
        }
        let mut in_flight = 0;
        for &r in &self.arrivals[..self.next_arrival] {
            match (self.finished[r], places[r]) {
                (true, 0) | (false, 1) => {}
                (false, 0) => in_flight += 1,
                (done, k) => return Err(format!("request {r} (finished: {done}) is in {k} places")),
            }
        }
        if in_flight != inbound + self.landing {
            return Err(format!("{in_flight} requests in flight, {inbound} handoffs and {} landing", self.landing));
        }
        Ok(())
    }
}
