//! Actuators: how the planner's actions reach the cluster. One trait, because there are real
//! implementations of each kind of capacity change: role switches of live nodes (here, the
//! cheapest: no new process), node processes started and stopped by `cleave up`, and
//! Kubernetes Deployments scaled through their scale subresource. The planner never knows
//! which one carries out its actions.

use cleave_planner::{Action, Role};
use cleave_protocol::control::NodeRole;

use super::registry::AfterDrain;
use super::{ClusterHandle, NodeOp};

/// An action that could not be carried out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActuatorError {
    #[error("{actuator} cannot {what}")]
    Unsupported { actuator: &'static str, what: &'static str },
    #[error("{actuator}: {reason}")]
    Failed { actuator: &'static str, reason: String },
}

/// Carries out planner actions. `apply` must not block: it queues the work and returns.
pub trait Actuator: Send {
    fn apply(&mut self, action: &Action) -> Result<(), ActuatorError>;
    /// Whether [`Action::StartNode`] can be carried out (the planner then may add nodes).
    fn can_add_nodes(&self) -> bool;
    fn name(&self) -> &'static str;
}

pub(super) fn node_role(r: Role) -> NodeRole {
    match r {
        Role::Prefill => NodeRole::Prefill,
        Role::Decode => NodeRole::Decode,
        Role::Both => NodeRole::Both,
    }
}

/// Switches roles (and step budgets) of live nodes through the registry; stopping a node is a
/// drain that ends in `Leave`. Starting nodes is not its to do.
pub struct RoleSwitch {
    cluster: ClusterHandle,
}

impl RoleSwitch {
    pub fn new(cluster: ClusterHandle) -> Self {
        Self { cluster }
    }
}

impl Actuator for RoleSwitch {
    fn apply(&mut self, action: &Action) -> Result<(), ActuatorError> {
        let op = match *action {
            Action::SwitchRole { node, to, .. } => NodeOp::SetRole { node, role: node_role(to), step_budget: None },
            Action::SetStepBudget { node, tokens } => {
                NodeOp::SetRole { node, role: NodeRole::Both, step_budget: Some(tokens) }
            }
            Action::StopNode { node } => NodeOp::Drain { node, then: AfterDrain::Leave },
            Action::StartNode { .. } => {
                return Err(ActuatorError::Unsupported { actuator: self.name(), what: "start node processes" })
            }
        };
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            if let Err(e) = cluster.node_op(op).await {
                tracing::warn!(?op, error = %e, "planner action refused by the registry");
            }
        });
        Ok(())
    }

    fn can_add_nodes(&self) -> bool {
        false
    }

    fn name(&self) -> &'static str {
        "role-switch"
    }
}

/// The line a [`LocalProcesses`] actuator writes on stdout to ask its supervisor (`cleave up`,
/// which reads the coordinator's stdout) for a node: `LAUNCH role=<prefill|decode|both>`.
pub const LAUNCH_PREFIX: &str = "LAUNCH role=";

/// Node processes on this machine, started by the supervisor that runs the coordinator
/// (`cleave up --max-nodes N`): a new node is asked for with one [`LAUNCH_PREFIX`] line on
/// stdout (the supervisor holds the pipe and starts it pinned to a core); a node is stopped by
/// draining it until it leaves (its process exits cleanly, and the supervisor does not start it
/// again). Role switches and step budgets go through [`RoleSwitch`].
pub struct LocalProcesses {
    roles: RoleSwitch,
}

impl LocalProcesses {
    pub fn new(cluster: ClusterHandle) -> Self {
        Self { roles: RoleSwitch::new(cluster) }
    }
}

impl Actuator for LocalProcesses {
    fn apply(&mut self, action: &Action) -> Result<(), ActuatorError> {
        match *action {
            Action::StartNode { role } => {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                writeln!(out, "{LAUNCH_PREFIX}{}", node_role(role).as_str())
                    .and_then(|()| out.flush())
                    .map_err(|e| ActuatorError::Failed { actuator: self.name(), reason: format!("stdout: {e}") })
            }
            _ => self.roles.apply(action),
        }
    }

    fn can_add_nodes(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "local-processes"
    }
}
