//! What goes into the planner (arrivals, completions, snapshots of the nodes) and what comes out
//! (decisions and estimates). All of it is plain data with a JSON form; times are
//! `Duration`s since an origin the caller chooses, or whole milliseconds in outputs.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{Mode, Role};

/// A request admitted at the edge (counted when it arrives, not when it completes: a saturated
/// cluster completes at its own capacity, which hides the demand it cannot serve).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    pub at: Duration,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
}

/// A request that ended, with what its client experienced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    pub at: Duration,
    pub ttft: Duration,
    /// Mean gap between output tokens; `None` for one-token outputs.
    pub tpot: Option<Duration>,
    pub output_tokens: u32,
    /// The request's `max_tokens`: outputs are read as a share of it, which carries over when
    /// the mix of requests changes (a window of short-output completions says nothing about
    /// the long-output requests arriving now, but "requests run to 80% of max_tokens" does).
    pub max_tokens: u32,
    /// False when the request failed; failures count against attainment and are left out of
    /// the latency percentiles.
    pub ok: bool,
}

impl Completion {
    /// When the request started, as far as its timings tell: `at - ttft - tpot * (outputs - 1)`.
    pub(crate) fn started(&self) -> Duration {
        let decode = self.tpot.unwrap_or_default().saturating_mul(self.output_tokens.saturating_sub(1));
        self.at.saturating_sub(self.ttft).saturating_sub(decode)
    }
}

/// Where a node is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Serving in its role; the only state the planner acts on.
    Active,
    /// Finishing its work before it stops; counts in no pool.
    Draining,
    /// Changing role; counts toward `to`.
    Switching { to: Role },
    /// Process starting; counts toward its role.
    Starting,
}

/// One node as the coordinator sees it now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeObs {
    pub id: u64,
    pub role: Role,
    pub state: NodeState,
    /// Prompt tokens admitted to the node and not yet prefilled.
    pub queued_prefill_tokens: u64,
    pub waiting_seqs: u32,
    pub running_seqs: u32,
    pub kv_used_ratio: f64,
    /// Colocated nodes: tokens per engine step.
    pub step_budget: Option<u32>,
    /// The node paces prompt chunks beside decodes to the TPOT target (it reports a target).
    #[serde(default)]
    pub paced: bool,
}

impl NodeObs {
    /// The pool the node counts in: the role it is becoming; `None` while draining.
    pub fn effective_role(&self) -> Option<Role> {
        match self.state {
            NodeState::Active | NodeState::Starting => Some(self.role),
            NodeState::Switching { to } => Some(to),
            NodeState::Draining => None,
        }
    }
}

/// The cluster at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub now: Duration,
    pub nodes: Vec<NodeObs>,
}

/// A configuration: how many nodes in each pool, and the step budget of the colocated ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct PoolTarget {
    pub prefill: u32,
    pub decode: u32,
    pub colocated: u32,
    /// Tokens per step of colocated nodes (`None` when there are none, or none reported one).
    pub step_budget: Option<u32>,
}

impl PoolTarget {
    /// Nodes in all.
    pub fn nodes(&self) -> u32 {
        self.prefill + self.decode + self.colocated
    }

    /// The count of a role's pool.
    pub fn count(&self, role: Role) -> u32 {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
            Role::Both => self.colocated,
        }
    }

    pub(crate) fn counts(&self) -> [u32; 3] {
        [self.prefill, self.decode, self.colocated]
    }
}

/// One thing the actuators must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// Drain `node` of its current work and give it role `to`.
    SwitchRole { node: u64, from: Role, to: Role },
    /// Set a colocated node's tokens per step.
    SetStepBudget { node: u64, tokens: u32 },
    /// Start a node process in `role` (a colocated one with the target's step budget).
    StartNode { role: Role },
    /// Drain `node` and stop its process.
    StopNode { node: u64 },
}

/// Why a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Predicted TTFT above target x scale_up_margin while clients still meet the target.
    TtftRisk,
    /// Clients' TTFT at the quantile is above target.
    TtftBreach,
    /// Predicted TPOT above target x scale_up_margin while clients still meet the target.
    TpotRisk,
    /// Clients' TPOT at the quantile is above target.
    TpotBreach,
    /// Fewer nodes meet the targets with margin.
    Overprovisioned,
    /// Colocated nodes serve the load better than the disaggregated pools.
    Colocate,
    /// Disaggregated pools serve the load better than colocated nodes.
    Disaggregate,
    /// Only colocated nodes' step budget changes.
    StepBudget,
    /// The current configuration breaks the limits.
    Bounds,
}

impl Reason {
    /// Every reason, for exporters that list them all (a counter at 0 says "none yet" where an
    /// absent one says nothing).
    pub const ALL: [Reason; 9] = [
        Reason::TtftRisk,
        Reason::TtftBreach,
        Reason::TpotRisk,
        Reason::TpotBreach,
        Reason::Overprovisioned,
        Reason::Colocate,
        Reason::Disaggregate,
        Reason::StepBudget,
        Reason::Bounds,
    ];

    /// The JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TtftRisk => "ttft_risk",
            Reason::TtftBreach => "ttft_breach",
            Reason::TpotRisk => "tpot_risk",
            Reason::TpotBreach => "tpot_breach",
            Reason::Overprovisioned => "overprovisioned",
            Reason::Colocate => "colocate",
            Reason::Disaggregate => "disaggregate",
            Reason::StepBudget => "step_budget",
            Reason::Bounds => "bounds",
        }
    }
}

/// What the planner saw: demand in the window, work on the nodes, what clients experienced.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Inputs {
    /// Requests per second arriving at the edge.
    pub arrival_rate: f64,
    pub mean_prompt_tokens: f64,
    /// Expected output tokens per request: the arrivals' mean `max_tokens` times the share of
    /// it that completions used (when enough completions, else the share is 1).
    pub mean_output_tokens: f64,
    /// Seconds of arrivals the demand (rate, prompt and output means) was measured over: the
    /// window, or its recent half when the demand shifted within it (see the crate docs).
    /// Absent from decisions recorded before it existed (read as 0).
    #[serde(default)]
    pub demand_span_s: f64,
    /// Prompt tokens queued on the nodes, not yet prefilled.
    pub queued_prefill_tokens: u64,
    /// Sequences running on the nodes.
    pub running_seqs: u64,
    /// Clients' TTFT at the target quantile over the window.
    pub observed_ttft_ms: Option<f64>,
    /// Clients' TPOT at the target quantile over the window.
    pub observed_tpot_ms: Option<f64>,
    /// Share of the window's completions that met both targets.
    pub attainment: Option<f64>,
    /// Completions in the window.
    pub completions: u32,
}

/// The model's prediction for one configuration, corrected by observation. `None` latencies
/// mean unbounded: some pool is at or past saturation.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ConfigPrediction {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    /// Busy share of the prefill servers (prefill nodes, or colocated nodes' prefill steps).
    pub prefill_utilisation: f64,
    /// Mean sequences in flight per decoding node.
    pub decode_batch: f64,
    /// Predicted share of requests within both targets (TTFT and TPOT), 0 to 1: what decides
    /// between configurations when none meets the targets at the quantile. Absent in records
    /// from before it was predicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attainment: Option<f64>,
}

impl ConfigPrediction {
    pub fn with_attainment(mut self, attainment: Option<f64>) -> Self {
        self.attainment = attainment;
        self
    }
}

/// Predictions behind a decision.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Prediction {
    pub current: ConfigPrediction,
    pub target: ConfigPrediction,
    /// Observed/predicted TTFT factor multiplied into the current configuration's
    /// prediction (its family's; the target is corrected by its own family's).
    pub ttft_correction: f64,
    /// Observed/predicted TPOT factor, likewise.
    pub tpot_correction: f64,
}

/// One planning decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub at_ms: u64,
    pub mode: Mode,
    pub current: PoolTarget,
    pub target: PoolTarget,
    pub actions: Vec<Action>,
    /// True in auto mode: the caller must carry the actions out. Advise mode records decisions
    /// with applied = false.
    pub applied: bool,
    pub reason: Reason,
    /// One human sentence with the numbers.
    pub why: String,
    pub inputs: Inputs,
    pub predicted: Prediction,
}

/// Window statistics and predictions for the current configuration (any mode, even off).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub at_ms: u64,
    pub mode: Mode,
    pub current: PoolTarget,
    /// Nodes counted in a pool (everything but draining nodes).
    pub live_nodes: u32,
    pub inputs: Inputs,
    pub predicted: ConfigPrediction,
    pub ttft_correction: f64,
    pub tpot_correction: f64,
}
