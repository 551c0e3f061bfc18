//! The cluster as the planner counts it (from a [`Snapshot`]), and the actions that take it from
//! its current configuration to a target.
//!
//! Counting: a node counts in the pool of the role it is becoming (`Active`/`Starting`: its
//! role; `Switching { to }`: `to`); a `Draining` node counts nowhere. Nodes that are not
//! `Active` are pinned: no action names them, so a target never asks a pool to shrink below
//! its pinned nodes (the search's lower bounds).
//!
//! Actions, in order: `StopNode`s, `SwitchRole`s, `StartNode`s, `SetStepBudget`s. Stops come
//! before starts so the node total never exceeds the larger of the current and the target
//! total. Every action moves one count toward the target, so no pool ever passes its limit.
//! Role switches are preferred (no new process); the least loaded `Active` nodes (fewest
//! running + waiting sequences, then fewest queued tokens, then lowest id) move or stop first.
//! Starts and stops happen only when the actuator can add nodes.

use crate::config::Role;
use crate::types::{Action, NodeObs, NodeState, PoolTarget, Snapshot};

/// What the planner takes from a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ClusterView {
    /// Pool counts; the step budget is the one most colocated nodes report (ties: the smaller).
    pub current: PoolTarget,
    /// Non-active, non-draining nodes per pool (`Role::index`).
    pub pinned: [u32; 3],
    /// Nodes counted in a pool.
    pub live: u32,
    /// Prompt tokens queued on counted nodes.
    pub backlog_tokens: u64,
    /// Running + waiting sequences on counted decode and colocated nodes.
    pub inflight_seqs: u64,
    /// Running sequences on counted nodes.
    pub running_seqs: u64,
}

impl ClusterView {
    pub fn new(snap: &Snapshot) -> Self {
        let mut counts = [0u32; 3];
        let mut pinned = [0u32; 3];
        let mut budgets: Vec<(u32, u32)> = Vec::new();
        let (mut backlog, mut inflight, mut running) = (0u64, 0u64, 0u64);
        for n in &snap.nodes {
            let Some(role) = n.effective_role() else { continue };
            counts[role.index()] += 1;
            if n.state != NodeState::Active {
                pinned[role.index()] += 1;
            }
            backlog += n.queued_prefill_tokens;
            running += u64::from(n.running_seqs);
            if role != Role::Prefill {
                inflight += u64::from(n.running_seqs) + u64::from(n.waiting_seqs);
            }
            if let (Role::Both, Some(b)) = (role, n.step_budget) {
                match budgets.iter_mut().find(|(v, _)| *v == b) {
                    Some((_, c)) => *c += 1,
                    None => budgets.push((b, 1)),
                }
            }
        }
        let step_budget = budgets.iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))).map(|(b, _)| *b);
        let current = PoolTarget {
            prefill: counts[0],
            decode: counts[1],
            colocated: counts[2],
            step_budget: if counts[2] > 0 { step_budget } else { None },
        };
        Self {
            current,
            pinned,
            live: counts.iter().sum(),
            backlog_tokens: backlog,
            inflight_seqs: inflight,
            running_seqs: running,
        }
    }

    /// The current configuration with the budget colocated nodes run at when they report
    /// none (`largest`, the engine's default being the largest budget).
    pub fn normalized(&self, largest: u32) -> PoolTarget {
        let mut t = self.current;
        if t.colocated > 0 && t.step_budget.is_none() {
            t.step_budget = Some(largest);
        }
        t
    }
}

fn load_key(n: &NodeObs) -> (u64, u64, u64) {
    (u64::from(n.running_seqs) + u64::from(n.waiting_seqs), n.queued_prefill_tokens, n.id)
}

/// The actions from the snapshot's configuration to `target`.
pub(crate) fn plan_actions(snap: &Snapshot, target: &PoolTarget, can_add_nodes: bool) -> Vec<Action> {
    let view = ClusterView::new(snap);
    let mut count = view.current.counts();
    let goal = target.counts();
    // Active nodes per role, least loaded first; `next[r]` is the first not yet used.
    let mut active: [Vec<&NodeObs>; 3] = Default::default();
    for n in snap.nodes.iter().filter(|n| n.state == NodeState::Active) {
        active[n.role.index()].push(n);
    }
    for pool in &mut active {
        pool.sort_by_key(|n| load_key(n));
    }
    let mut next = [0usize; 3];
    let mut switches = Vec::new();
    let mut joined_both = Vec::new();
    for to in Role::ALL {
        while count[to.index()] < goal[to.index()] {
            let donor = Role::ALL
                .into_iter()
                .filter(|r| *r != to && count[r.index()] > goal[r.index()] && next[r.index()] < active[r.index()].len())
                .min_by_key(|r| load_key(active[r.index()][next[r.index()]]));
            let Some(from) = donor else { break };
            let node = active[from.index()][next[from.index()]];
            next[from.index()] += 1;
            count[from.index()] -= 1;
            count[to.index()] += 1;
            switches.push(Action::SwitchRole { node: node.id, from, to });
            if to == Role::Both {
                joined_both.push(node.id);
            }
        }
    }
    let mut stops = Vec::new();
    let mut starts = Vec::new();
    if can_add_nodes {
        for r in Role::ALL {
            let i = r.index();
            while count[i] > goal[i] && next[i] < active[i].len() {
                stops.push(Action::StopNode { node: active[i][next[i]].id });
                next[i] += 1;
                count[i] -= 1;
            }
        }
        for r in Role::ALL {
            let i = r.index();
            while count[i] < goal[i] {
                starts.push(Action::StartNode { role: r });
                count[i] += 1;
            }
        }
    }
    let mut budgets = Vec::new();
    if let (Some(tokens), true) = (target.step_budget, goal[Role::Both.index()] > 0) {
        let staying = active[Role::Both.index()][next[Role::Both.index()]..].iter();
        for n in staying.filter(|n| n.step_budget != Some(tokens)) {
            budgets.push(Action::SetStepBudget { node: n.id, tokens });
        }
        budgets.extend(joined_both.into_iter().map(|node| Action::SetStepBudget { node, tokens }));
    }
    stops.into_iter().chain(switches).chain(starts).chain(budgets).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn node(id: u64, role: Role, state: NodeState, running: u32) -> NodeObs {
        NodeObs {
            id,
            role,
            state,
            queued_prefill_tokens: 0,
            waiting_seqs: 0,
            running_seqs: running,
            kv_used_ratio: 0.0,
            step_budget: (role == Role::Both).then_some(256),
            paced: false,
        }
    }

    fn pt(p: u32, d: u32, k: u32, b: Option<u32>) -> PoolTarget {
        PoolTarget { prefill: p, decode: d, colocated: k, step_budget: b }
    }

    #[test]
    fn counts_follow_the_role_a_node_is_becoming() {
        let snap = Snapshot {
            now: Duration::ZERO,
            nodes: vec![
                node(1, Role::Prefill, NodeState::Active, 0),
                node(2, Role::Prefill, NodeState::Switching { to: Role::Decode }, 0),
                node(3, Role::Decode, NodeState::Draining, 5),
                node(4, Role::Both, NodeState::Starting, 0),
            ],
        };
        let v = ClusterView::new(&snap);
        assert_eq!(v.current, pt(1, 1, 1, Some(256)));
        assert_eq!(v.pinned, [0, 1, 1]);
        assert_eq!(v.live, 3);
        assert_eq!(v.inflight_seqs, 0, "draining node's sequences are not counted");
    }

    #[test]
    fn switches_the_least_loaded_then_stops_and_starts() {
        let snap = Snapshot {
            now: Duration::ZERO,
            nodes: vec![
                node(1, Role::Decode, NodeState::Active, 9),
                node(2, Role::Decode, NodeState::Active, 2),
                node(3, Role::Decode, NodeState::Active, 5),
                node(4, Role::Prefill, NodeState::Starting, 0),
            ],
        };
        let a = plan_actions(&snap, &pt(2, 1, 0, None), false);
        assert_eq!(a, vec![Action::SwitchRole { node: 2, from: Role::Decode, to: Role::Prefill }]);
        let a = plan_actions(&snap, &pt(1, 0, 1, Some(128)), true);
        assert_eq!(
            a,
            vec![
                Action::StopNode { node: 3 },
                Action::StopNode { node: 1 },
                Action::SwitchRole { node: 2, from: Role::Decode, to: Role::Both },
                Action::SetStepBudget { node: 2, tokens: 128 },
            ]
        );
        let a = plan_actions(&snap, &pt(1, 3, 1, Some(64)), true);
        assert_eq!(a, vec![Action::StartNode { role: Role::Both }]);
        assert_eq!(plan_actions(&snap, &pt(1, 3, 1, Some(64)), false), vec![]);
    }
}
