//! A deterministic toy cluster for driving the planner: arrivals at a given rate (evenly
//! spaced, no randomness), nodes whose loads the test sets, and decisions applied instantly.
#![allow(dead_code)]

use std::time::Duration;

use cleave_planner::{
    Action, Arrival, Completion, Decision, Limits, LinearCosts, Mode, NodeObs, NodeState, Planner, PlannerConfig, Role,
    Snapshot, Targets,
};

/// A small model on one CPU core: prefill 10 ms + 2 ms/token, a decode step 40 ms + 1 ms per
/// sequence, a local handoff of 5 ms.
pub fn cpu_costs() -> LinearCosts {
    LinearCosts {
        prefill_fixed_s: 0.010,
        prefill_s_per_token: 0.002,
        prefill_s_per_token2: 0.0,
        decode_fixed_s: 0.040,
        decode_s_per_seq: 0.001,
        decode_s_per_context_token: 0.0,
        handoff_fixed_s: 0.005,
        handoff_s_per_token: 0.0,
        kv_capacity_tokens: 65_536,
    }
}

pub fn limits(max_prefill: u32, max_decode: u32, max_colocated: u32, max_nodes: u32) -> Limits {
    Limits {
        min_prefill: 0,
        max_prefill,
        min_decode: 0,
        max_decode,
        min_colocated: 0,
        max_colocated,
        max_nodes,
        step_budgets: vec![64, 128, 256, 512, 2048],
    }
}

pub fn config(mode: Mode, ttft_ms: f64, tpot_ms: f64, limits: Limits, can_add_nodes: bool) -> PlannerConfig {
    PlannerConfig {
        mode,
        targets: Targets { ttft_ms, tpot_ms, quantile: 0.9, attainment: 0.9, colocated_tpot_ms: None },
        limits,
        window: Duration::from_secs(30),
        cooldown: Duration::from_secs(15),
        confirm_ticks: 2,
        scale_up_margin: 0.9,
        scale_down_margin: 0.7,
        can_add_nodes,
    }
}

pub fn node(id: u64, role: Role) -> NodeObs {
    NodeObs {
        id,
        role,
        state: NodeState::Active,
        queued_prefill_tokens: 0,
        waiting_seqs: 0,
        running_seqs: 0,
        kv_used_ratio: 0.0,
        step_budget: (role == Role::Both).then_some(2048),
        // The scenarios' clients report what unpaced nodes do.
        paced: false,
    }
}

pub fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// A cluster of nodes with a clock and an arrival generator.
pub struct Sim {
    pub planner: Planner,
    pub now: Duration,
    pub nodes: Vec<NodeObs>,
    next_id: u64,
    /// Fractional arrivals carried to the next step.
    carry: f64,
    /// `max_tokens` of the last arrivals (what completions report as asked).
    max_tokens: u32,
}

impl Sim {
    pub fn new(cfg: PlannerConfig, roles: &[Role]) -> Self {
        Self::with_costs(cfg, roles, cpu_costs())
    }

    pub fn with_costs(cfg: PlannerConfig, roles: &[Role], costs: LinearCosts) -> Self {
        let planner = Planner::new(cfg, Box::new(costs)).expect("valid config");
        let nodes: Vec<NodeObs> = roles.iter().enumerate().map(|(i, r)| node(i as u64 + 1, *r)).collect();
        let next_id = nodes.len() as u64 + 1;
        Self { planner, now: Duration::ZERO, nodes, next_id, carry: 0.0, max_tokens: 0 }
    }

    /// Feeds `rate * dt` arrivals, evenly spaced over the next `dt`, and advances the clock.
    /// Returns how many arrived.
    pub fn arrive(&mut self, rate: f64, dt: Duration, prompt_tokens: u32, max_tokens: u32) -> u32 {
        let start = self.now;
        let total = self.carry + rate * dt.as_secs_f64();
        let n = total.floor() as u32;
        self.carry = total - f64::from(n);
        self.max_tokens = max_tokens;
        for i in 0..n {
            let at = start + dt.mul_f64((f64::from(i) + 1.0) / (f64::from(n) + 1.0));
            self.planner.on_arrival(Arrival { at, prompt_tokens, max_tokens });
        }
        self.now = start + dt;
        n
    }

    /// `n` successful completions at `now` with these timings, of requests that asked for the
    /// last arrivals' `max_tokens` (or `output_tokens` when more).
    pub fn complete(&mut self, n: u32, ttft: Duration, tpot: Duration, output_tokens: u32) {
        for _ in 0..n {
            let max_tokens = self.max_tokens.max(output_tokens);
            self.planner.on_completion(Completion {
                at: self.now,
                ttft,
                tpot: Some(tpot),
                output_tokens,
                max_tokens,
                ok: true,
            });
        }
    }

    /// `n` failed completions at `now` (refused, or an error: no latency to learn from).
    pub fn fail(&mut self, n: u32, waited: Duration) {
        for _ in 0..n {
            self.planner.on_completion(Completion {
                at: self.now,
                ttft: waited,
                tpot: None,
                output_tokens: 0,
                max_tokens: self.max_tokens,
                ok: false,
            });
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot { now: self.now, nodes: self.nodes.clone() }
    }

    pub fn tick(&mut self) -> Option<Decision> {
        let snap = self.snapshot();
        self.planner.tick(&snap)
    }

    pub fn count(&self, role: Role) -> u32 {
        self.nodes.iter().filter(|n| n.role == role).count() as u32
    }

    pub fn nodes_of(&mut self, role: Role) -> impl Iterator<Item = &mut NodeObs> {
        self.nodes.iter_mut().filter(move |n| n.role == role)
    }

    /// Carries the actions out at once (an instant actuator).
    pub fn apply(&mut self, d: &Decision) {
        for a in &d.actions {
            match *a {
                Action::SwitchRole { node, from, to } => {
                    let n = self.nodes.iter_mut().find(|n| n.id == node).expect("named node exists");
                    assert_eq!(n.role, from);
                    n.role = to;
                    n.step_budget = (to == Role::Both).then_some(2048);
                }
                Action::SetStepBudget { node, tokens } => {
                    let n = self.nodes.iter_mut().find(|n| n.id == node).expect("named node exists");
                    n.step_budget = Some(tokens);
                }
                Action::StartNode { role } => {
                    let mut n = node(self.next_id, role);
                    n.step_budget = d.target.step_budget.filter(|_| role == Role::Both);
                    self.nodes.push(n);
                    self.next_id += 1;
                }
                Action::StopNode { node } => self.nodes.retain(|n| n.id != node),
            }
        }
    }
}
