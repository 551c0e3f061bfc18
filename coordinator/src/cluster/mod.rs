//! The cluster behind the edge: the node registry, the control plane nodes register on, and
//! the request router that takes [`Dispatch`]es from the edge and drives each request through
//! prefill, handoff and decode on the nodes.
//!
//! Tasks (actors, no shared locks):
//! - the registry actor owns [`registry::Registry`]; everything else asks it through a
//!   [`ClusterHandle`] (bounded channel, `oneshot` replies); a timer expires silent nodes;
//! - the control listener accepts node streams: `Register` → reply → `LoadReport`s until the
//!   stream ends (the node is then removed at once, without waiting for `dead_after`);
//! - the router takes dispatches off the edge's channel and spawns one task per request
//!   ([`request`], the async shell of the sans-IO [`attempt::Journey`], which decides retries,
//!   migrations and the rest of a request's journey).
//!
//! Allowed dependencies: protocol (messages) and cleave-net (authenticated streams);
//! never the engine.

mod actuate;
mod admin;
mod admin_access;
mod attempt;
mod dashboard;
mod history;
#[cfg(feature = "kubernetes")]
pub mod k8s;
pub mod planning;
pub mod registry;
mod request;

pub use actuate::{Actuator, ActuatorError, LocalProcesses, RoleSwitch, LAUNCH_PREFIX};
pub use admin::{admin_router, parse_role, serve_with_cluster, validate_admin_token, AdminState};
pub use planning::PlannerHandle;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_net::tls::Roles;
use cleave_net::PeerInfo;
use cleave_net::{Connector, DuplexStream, Listener, NetConfig};
use cleave_protocol::control::{read_msg, write_msg, ControlMsg, LoadReport, Register, RegisterReply};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use crate::dispatch::Dispatch;
use cleave_protocol::control::{NodeRole, SetRole};
use registry::{
    Admission, AfterDrain, Assignment, Effect, NoRoute, NodeOpError, NodeRef, Plan, PoolSummary, Refusal, Registry,
    RouteQuery, RoutingConfig,
};

/// Metric names of the cluster (the edge's are in [`crate::metrics`]).
pub mod metric {
    /// Routing decisions, labelled `path` (`remote`/`local`) and `reason`.
    pub const ROUTE_DECISIONS_TOTAL: &str = "cleave_route_decisions_total";
    /// Retries after a prefill node failed before the first token, labelled `node`.
    pub const PREFILL_RETRIES_TOTAL: &str = "cleave_prefill_retries_total";
    /// Streams moved to another decode node, labelled `node` (the one that failed).
    pub const MIGRATIONS_TOTAL: &str = "cleave_migrations_total";
    /// Requests held at the edge because no node could take them while nodes switched roles.
    pub const HELD_FOR_SWITCH_TOTAL: &str = "cleave_requests_held_for_switch_total";
    /// Requests held at the edge because every decode node's KV cache was too full to reserve
    /// their prompt for a handoff.
    pub const HELD_FOR_DECODE_KV_TOTAL: &str = "cleave_requests_held_for_decode_kv_total";
    /// SLO admission: requests held at the edge for a seat (every decode node held as many
    /// streams as keep the TPOT target), and requests refused (503) after waiting their most.
    pub const HELD_FOR_SEAT_TOTAL: &str = "cleave_requests_held_for_seat_total";
    pub const SHED_TOTAL: &str = "cleave_requests_shed_total";
    /// Registrations refused before they reach the registry, by `cause` (`identity`: the
    /// certificate names another node, does not allow the role, or is revoked).
    pub const REGISTRATIONS_REFUSED_TOTAL: &str = "cleave_node_registrations_refused_total";
    /// Nodes alive, labelled `pool`.
    pub const POOL_NODES: &str = "cleave_pool_nodes";
    /// Prompt tokens queued for prefill, labelled `pool`.
    pub const POOL_QUEUED_PREFILL_TOKENS: &str = "cleave_pool_queued_prefill_tokens";
    /// Running sequences, labelled `pool`.
    pub const POOL_RUNNING_SEQS: &str = "cleave_pool_running_seqs";
    /// Share of the requests completed over the planner's window that met both targets, by the
    /// pool whose latency they count for (`prefill`, `decode`, `colocated`, `overall`).
    pub const POOL_SLO_ATTAINMENT: &str = "cleave_pool_slo_attainment";
    /// Share of KV blocks in use (0..1), labelled `pool`.
    pub const POOL_KV_USAGE_RATIO: &str = "cleave_pool_kv_usage_ratio";
    /// Handoff telemetry, labelled `pool` and `node`. Queue: the coordinator dispatching to the
    /// prefill node, then the request waiting in that node's engine until its first chunk is
    /// computed.
    pub const HANDOFF_QUEUE_SECONDS: &str = "cleave_handoff_queue_seconds";
    /// First chunk computed to first token sampled on the prefill node.
    pub const HANDOFF_PREFILL_SECONDS: &str = "cleave_handoff_prefill_seconds";
    pub const HANDOFF_RESERVATION_SECONDS: &str = "cleave_handoff_reservation_seconds";
    pub const HANDOFF_TICKET_WAIT_SECONDS: &str = "cleave_handoff_ticket_wait_seconds";
    /// Ticket to the receiver's Ack (overlaps the prefill layer by layer).
    pub const HANDOFF_TRANSFER_SECONDS: &str = "cleave_handoff_transfer_seconds";
    /// First token sampled to the receiver's Ack: what the transfer adds after the prefill.
    pub const HANDOFF_TRANSFER_TAIL_SECONDS: &str = "cleave_handoff_transfer_tail_seconds";
    pub const HANDOFF_TRANSFER_BYTES: &str = "cleave_handoff_transfer_bytes";
    pub const HANDOFF_DECODE_FIRST_STEP_SECONDS: &str = "cleave_handoff_decode_first_step_seconds";
    /// Handoffs that failed, labelled `node`.
    pub const HANDOFF_FAILURES_TOTAL: &str = "cleave_handoff_failures_total";
    /// Planner decisions, labelled `reason`.
    pub const PLANNER_DECISIONS_TOTAL: &str = "cleave_planner_decisions_total";
    /// The planner's target node count, labelled `pool`: its last decision's target, or the
    /// active nodes before its first decision.
    pub const PLANNER_DESIRED_NODES: &str = "cleave_planner_desired_nodes";
    /// Queued prompt tokens past which a prefill node counts as saturated: the line the planner
    /// sets in auto mode, and would set in the other modes (updated every tick).
    pub const PLANNER_SATURATION_TOKENS: &str = "cleave_planner_saturation_tokens";
    /// Share of requests in the planner's window that met both targets.
    pub const PLANNER_SLO_ATTAINMENT: &str = "cleave_planner_slo_attainment";
    /// The model's predicted share of requests within both targets under the configuration
    /// running now (beside `cleave_planner_slo_attainment`, what clients saw: the gap is how
    /// far to trust the planner's choices where nothing meets the targets).
    pub const PLANNER_PREDICTED_SLO_ATTAINMENT: &str = "cleave_planner_predicted_slo_attainment";
    /// The targets, labelled `slo` (`ttft`, `tpot`), in seconds.
    pub const PLANNER_TARGET_SECONDS: &str = "cleave_planner_target_seconds";
}

/// What the request path tells the planner (best effort: dropped when the planner lags).
#[derive(Debug, Clone)]
pub enum Observation {
    /// A request reached the router (demand counted as it arrives, not as it completes).
    Arrival { prompt_tokens: u32, max_tokens: u32 },
    /// What a client experienced; `path` is how its last attempt was routed.
    Completion {
        ttft: Duration,
        tpot: Option<Duration>,
        output_tokens: u32,
        max_tokens: u32,
        ok: bool,
        path: &'static str,
    },
    /// A handoff completed: its KV bytes, and the time from the first token to the KV landed.
    Handoff { bytes: u64, tail: Duration },
}

/// Settings of the cluster side of the coordinator.
#[derive(Clone)]
pub struct ClusterConfig {
    pub routing: RoutingConfig,
    /// How nodes are reached (the same cluster CA as their control links).
    pub net: NetConfig,
    /// Times a stream may move to another decode node after its node failed.
    pub max_migrations: u32,
    /// Prefill attempts on other nodes after a prefill node failed before the first token.
    pub max_prefill_retries: u32,
    /// A node that sends nothing on a request's stream for this long has failed it.
    pub node_silence_timeout: Duration,
    /// Bound on a node's answer to `Register`, and on a control stream's first message.
    pub register_timeout: Duration,
    /// The planner's settings (mode, targets, limits).
    pub planner: cleave_planner::PlannerConfig,
    /// The engine's measured costs (`cleave bench profile`) the planner predicts with,
    /// re-levelled live by the nodes' step timings; `None`: a linear model levelled by those
    /// timings alone (its shape, how a step grows with batch and context, is then a guess).
    pub planner_profile: Option<cleave_planner::Profile>,
    /// Send the TPOT target to every node to pace its prompt chunks to (see
    /// `cleave_engine::sched::pacing`); off: nodes size chunks by their step budget alone.
    pub pacing: bool,
    /// SLO admission: cap the streams each node decodes at once at what keeps the TPOT target
    /// (measured from its steps), hold requests at the edge for a seat, and refuse (503) those
    /// that waited half their TTFT target (see `registry::seats`); off: route every request at
    /// once.
    pub admission: bool,
    /// A file of revoked node certificates, one SHA-256 fingerprint (hex, of the DER) per line;
    /// read at each registration.
    pub revoked_certs: Option<std::path::PathBuf>,
}

impl ClusterConfig {
    pub fn new(net: NetConfig) -> Self {
        Self {
            routing: RoutingConfig::default(),
            net,
            max_migrations: 2,
            max_prefill_retries: 2,
            node_silence_timeout: Duration::from_secs(120),
            register_timeout: Duration::from_secs(10),
            planner: cleave_planner::PlannerConfig::default(),
            revoked_certs: None,
            planner_profile: None,
            pacing: false,
            admission: false,
        }
    }
}

enum Cmd {
    /// A node registered; the sender is its control stream's outbox.
    Register(Box<Register>, Roles, mpsc::Sender<ControlMsg>, oneshot::Sender<Result<u64, Refusal>>),
    Report(u64, LoadReport),
    Gone(u64),
    Plan(Box<RouteQuery>, oneshot::Sender<Result<(Plan, Assignment), NoRoute>>),
    Release(Assignment),
    ReleasePrefill(Assignment),
    Op(NodeOp, oneshot::Sender<Result<(), NodeOpError>>),
    Bridge(Option<u64>),
    /// The times per output token nodes pace prompt chunks to.
    Pacing(Option<Pacing>),
    /// SLO admission's targets (None: off).
    Admission(Option<Admission>),
    Pools(oneshot::Sender<(PoolSummary, Vec<NodeRef>)>),
    States(oneshot::Sender<Vec<registry::NodeState>>),
}

/// An operation on one node (admin API, planner).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeOp {
    /// Stop routing to the node; then park it, or let it leave.
    Drain { node: u64, then: AfterDrain },
    /// Change its role (and step budget), draining first what the new role does not do.
    SetRole { node: u64, role: NodeRole, step_budget: Option<u32> },
}

/// Cheap, cloneable access to the registry actor.
#[derive(Clone)]
pub struct ClusterHandle {
    tx: mpsc::Sender<Cmd>,
    observations: mpsc::Sender<Observation>,
    /// Ids of nodes removed from the registry (dead or gone), for requests running on them.
    deaths: broadcast::Sender<u64>,
}

impl ClusterHandle {
    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).await.ok()?;
        rx.await.ok()
    }

    pub async fn register(
        &self,
        reg: Register,
        allowed: Roles,
        outbox: mpsc::Sender<ControlMsg>,
    ) -> Result<u64, Refusal> {
        self.call(|tx| Cmd::Register(Box::new(reg), allowed, outbox, tx))
            .await
            .unwrap_or_else(|| Err(Refusal("coordinator shutting down".into())))
    }

    pub async fn report(&self, id: u64, load: LoadReport) {
        let _ = self.tx.send(Cmd::Report(id, load)).await;
    }

    pub async fn gone(&self, id: u64) {
        let _ = self.tx.send(Cmd::Gone(id)).await;
    }

    pub async fn plan(&self, q: RouteQuery) -> Result<(Plan, Assignment), NoRoute> {
        self.call(|tx| Cmd::Plan(Box::new(q), tx))
            .await
            .unwrap_or_else(|| Err(NoRoute::new("coordinator shutting down")))
    }

    /// Returns an attempt's booking (see [`Registry::release`]); never waits.
    pub fn release(&self, a: Assignment) {
        if let Err(mpsc::error::TrySendError::Full(cmd)) = self.tx.try_send(Cmd::Release(a)) {
            // A lost release would keep a drain waiting forever: deliver it late instead.
            let tx = self.tx.clone();
            tokio::spawn(async move { tx.send(cmd).await });
        }
    }

    /// The prefill part of an attempt ended while its stream goes on (see
    /// [`Registry::release_prefill`]); `a` forgets it.
    pub fn release_prefill(&self, a: &mut Assignment) {
        if a.prefill.is_none() {
            return;
        }
        let part = Assignment { prefill: a.prefill.take(), decode: None, blocks: 0 };
        if let Err(mpsc::error::TrySendError::Full(cmd)) = self.tx.try_send(Cmd::ReleasePrefill(part)) {
            let tx = self.tx.clone();
            tokio::spawn(async move { tx.send(cmd).await });
        }
    }

    /// Tells the planner what happened (never waits; dropped when its queue is full).
    pub fn observe(&self, o: Observation) {
        let _ = self.observations.try_send(o);
    }

    /// Sets the planner's prefill saturation line (see [`Registry::set_bridge`]).
    pub async fn set_bridge(&self, tokens: Option<u64>) {
        let _ = self.tx.send(Cmd::Bridge(tokens)).await;
    }

    /// Sets the times per output token nodes pace their prompt chunks to (sent to the live
    /// nodes now, to each node that registers later, and with each role switch).
    pub async fn set_pacing(&self, pacing: Option<Pacing>) {
        let _ = self.tx.send(Cmd::Pacing(pacing)).await;
    }

    /// Turns SLO admission on with these targets, or off (see [`Registry::set_admission`]).
    pub async fn set_admission(&self, admission: Option<Admission>) {
        let _ = self.tx.send(Cmd::Admission(admission)).await;
    }

    /// Drains a node, or changes its role (see [`NodeOp`]).
    pub async fn node_op(&self, op: NodeOp) -> Result<(), NodeOpError> {
        self.call(|tx| Cmd::Op(op, tx)).await.unwrap_or(Err(NodeOpError::ShuttingDown))
    }

    /// Ids of nodes as they are removed (a request on a dead node fails over at once instead of
    /// waiting for its stream to time out).
    pub fn deaths(&self) -> broadcast::Receiver<u64> {
        self.deaths.subscribe()
    }

    /// Every live node with its last load report.
    pub async fn node_states(&self) -> Option<Vec<registry::NodeState>> {
        self.call(Cmd::States).await
    }

    /// Pool totals and the live nodes.
    pub async fn pools(&self) -> Option<(PoolSummary, Vec<NodeRef>)> {
        self.call(Cmd::Pools).await
    }
}

/// The running cluster side; dropping it stops its tasks.
pub struct Cluster {
    handle: ClusterHandle,
    planner: PlannerHandle,
    ready: watch::Receiver<crate::state::Readiness>,
    control_addr: std::net::SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Cluster {
    /// Starts the registry, the control listener, the router and the planner, which acts
    /// through role switches of live nodes ([`RoleSwitch`]). `fingerprint`: the model's, when
    /// the coordinator knows it (nodes must match it).
    pub fn start(
        cfg: ClusterConfig,
        fingerprint: Option<u64>,
        control: Listener,
        dispatches: mpsc::Receiver<Dispatch>,
    ) -> Result<Self, crate::CoordinatorError> {
        Self::start_with(cfg, fingerprint, control, dispatches, |h| Box::new(RoleSwitch::new(h)))
    }

    /// [`Self::start`] with the planner acting through the actuator `make` builds.
    pub fn start_with(
        cfg: ClusterConfig,
        fingerprint: Option<u64>,
        control: Listener,
        dispatches: mpsc::Receiver<Dispatch>,
        make: impl FnOnce(ClusterHandle) -> Box<dyn Actuator>,
    ) -> Result<Self, crate::CoordinatorError> {
        let control_addr = control.local_addr();
        let (tx, rx) = mpsc::channel(1024);
        let (obs_tx, obs_rx) = mpsc::channel(8192);
        let (deaths, _) = broadcast::channel(256);
        let (ready_tx, ready) = watch::channel(Err("no decode node has registered yet".to_string()));
        let handle = ClusterHandle { tx, observations: obs_tx, deaths: deaths.clone() };
        let registry = Registry::new(cfg.routing.clone(), fingerprint);
        let connector = Arc::new(
            Connector::new(&cfg.net).map_err(|e| crate::CoordinatorError::Internal { reason: e.to_string() })?,
        );
        let actuator = make(handle.clone());
        let (planner, planner_task) = planning::spawn(
            cfg.planner.clone(),
            cfg.planner_profile.as_ref(),
            cfg.pacing,
            cfg.admission,
            handle.clone(),
            obs_rx,
            actuator,
        )
        .map_err(|e| crate::CoordinatorError::Planner(e.to_string()))?;
        let cfg = Arc::new(cfg);
        let tasks = vec![
            tokio::spawn(registry_actor(registry, rx, deaths, ready_tx)),
            tokio::spawn(control_loop(control, handle.clone(), cfg.clone())),
            tokio::spawn(router(dispatches, handle.clone(), connector, cfg)),
            planner_task,
        ];
        Ok(Self { handle, planner, ready, control_addr, tasks })
    }

    pub fn planner(&self) -> &PlannerHandle {
        &self.planner
    }

    pub fn handle(&self) -> &ClusterHandle {
        &self.handle
    }

    /// Ok while at least one node can decode (what `/health` reports).
    pub fn readiness(&self) -> watch::Receiver<crate::state::Readiness> {
        self.ready.clone()
    }

    /// Where nodes register.
    pub fn control_addr(&self) -> std::net::SocketAddr {
        self.control_addr
    }
}

/// The times per output token nodes pace prompt chunks to, in microseconds: colocated nodes
/// to their hold, every other node to the target. Invariant: `colocated_us <= tpot_us` (the
/// hold is clamped where it is read, `Targets::colocated_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    pub tpot_us: u32,
    pub colocated_us: u32,
}

impl Pacing {
    /// What a node in `role` paces to.
    pub fn for_role(&self, role: NodeRole) -> u32 {
        if role == NodeRole::Both {
            self.colocated_us
        } else {
            self.tpot_us
        }
    }
}

async fn registry_actor(
    mut reg: Registry,
    mut rx: mpsc::Receiver<Cmd>,
    deaths: broadcast::Sender<u64>,
    ready: watch::Sender<crate::state::Readiness>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Each registered node's control-stream outbox (what [`Effect`]s are written to).
    let mut outboxes: std::collections::HashMap<u64, mpsc::Sender<ControlMsg>> = Default::default();
    // The pacing targets nodes are told (a node hears its own right after its registration
    // reply, and again with each role switch: a colocated node's differs).
    let mut pacing: Option<Pacing> = None;
    let pace = |role: NodeRole, p: Pacing| {
        ControlMsg::SetRole(SetRole { role, step_budget: None, tpot_target_us: Some(p.for_role(role)) })
    };
    loop {
        tokio::select! {
            cmd = rx.recv() => {
                let Some(cmd) = cmd else { return };
                let now = Instant::now();
                match cmd {
                    Cmd::Register(r, allowed, outbox, reply) => {
                        let (name, role) = (r.name.clone(), r.role);
                        let res = reg.register_with(*r, allowed, now);
                        match &res {
                            Ok(id) => {
                                tracing::info!(node_id = id, %name, role = role.as_str(), "node registered");
                                if let Some(p) = pacing {
                                    // Queued: the stream's writer starts after the reply.
                                    let _ = outbox.try_send(pace(role, p));
                                }
                                outboxes.insert(*id, outbox);
                            }
                            Err(e) => tracing::error!(%name, reason = %e, "node refused"),
                        }
                        // Ready before the node hears it is registered: a node that prints READY
                        // (and `cleave up`, which then prints the URL) is routable at once.
                        publish_pools(&reg, &ready);
                        let _ = reply.send(res);
                    }
                    Cmd::Report(id, load) => {
                        reg.report(id, load, now);
                    }
                    Cmd::Gone(id) => {
                        outboxes.remove(&id);
                        if let Some(n) = reg.remove(id) {
                            tracing::warn!(node_id = id, name = %n.name, "node left (control stream ended); removed from routing");
                            let _ = deaths.send(id);
                            publish_pools(&reg, &ready);
                        }
                    }
                    Cmd::Plan(q, reply) => {
                        let _ = reply.send(reg.plan(&q));
                    }
                    Cmd::Release(a) => reg.release(&a, now),
                    Cmd::ReleasePrefill(mut a) => reg.release_prefill(&mut a, now),
                    Cmd::Op(op, reply) => {
                        let r = match op {
                            NodeOp::Drain { node, then } => reg.drain(node, then, now),
                            NodeOp::SetRole { node, role, step_budget } => reg.set_role(node, role, step_budget, now),
                        };
                        match &r {
                            Ok(()) => tracing::info!(?op, "node operation"),
                            Err(e) => tracing::warn!(?op, error = %e, "node operation refused"),
                        }
                        let _ = reply.send(r);
                        publish_pools(&reg, &ready);
                    }
                    Cmd::Pacing(p) => {
                        pacing = p;
                        if let Some(p) = p {
                            tracing::info!(
                                tpot_target_us = p.tpot_us,
                                colocated_us = p.colocated_us,
                                "nodes pace prompt chunks to the TPOT target (colocated nodes to the hold)"
                            );
                            // The role each node registered (or last switched to): a node in
                            // a switch keeps its old role until the switch's own SetRole.
                            for n in reg.nodes() {
                                if let Some(outbox) = outboxes.get(&n.id) {
                                    let _ = outbox.try_send(pace(n.role, p));
                                }
                            }
                        }
                    }
                    Cmd::Admission(a) => {
                        tracing::info!(?a, "SLO admission");
                        reg.set_admission(a);
                    }
                    Cmd::Bridge(tokens) => {
                        tracing::debug!(?tokens, "the planner moved the prefill saturation line");
                        reg.set_bridge(tokens);
                    }
                    Cmd::Pools(reply) => {
                        let _ = reply.send((reg.pools(), reg.nodes()));
                    }
                    Cmd::States(reply) => {
                        let _ = reply.send(reg.node_states(now));
                    }
                }
            }
            _ = tick.tick() => {
                for n in reg.expire(Instant::now()) {
                    tracing::warn!(node_id = n.id, name = %n.name, "node stopped reporting; marked dead");
                    outboxes.remove(&n.id);
                    let _ = deaths.send(n.id);
                }
                publish_pools(&reg, &ready);
            }
        }
        let effects = reg.lifecycle();
        if !effects.is_empty() {
            publish_pools(&reg, &ready);
        }
        for e in effects {
            let (node, msg) = match e {
                Effect::SetRole { node, role, step_budget } => {
                    tracing::info!(node_id = node, role = role.as_str(), ?step_budget, "node takes its new role");
                    // The new role's pacing target with it (a colocated node's is the hold).
                    let tpot_target_us = pacing.map(|p| p.for_role(role));
                    (node, ControlMsg::SetRole(SetRole { role, step_budget, tpot_target_us }))
                }
                Effect::Leave { node, reason } => {
                    tracing::info!(node_id = node, %reason, "node drained; telling it to leave");
                    (node, ControlMsg::Leave(reason))
                }
            };
            if let Some(outbox) = outboxes.get(&node) {
                if outbox.try_send(msg).is_err() {
                    tracing::warn!(
                        node_id = node,
                        "control stream outbox full or closed; the node will hear on re-registration"
                    );
                }
            }
        }
    }
}

/// Records the pool gauges and publishes readiness (ready while any node can decode).
fn publish_pools(reg: &Registry, ready: &watch::Sender<crate::state::Readiness>) {
    let pools = reg.pools();
    record_pools(&pools);
    let now_ready =
        if pools.decode.nodes + pools.colocated.nodes > 0 { Ok(()) } else { Err("no live decode node".to_string()) };
    ready.send_if_modified(|r| {
        let changed = *r != now_ready;
        *r = now_ready;
        changed
    });
}

fn record_pools(s: &PoolSummary) {
    for (pool, p) in s.named() {
        metrics::gauge!(metric::POOL_NODES, "pool" => pool).set(p.nodes as f64);
        metrics::gauge!(metric::POOL_QUEUED_PREFILL_TOKENS, "pool" => pool).set(p.queued_prefill_tokens as f64);
        metrics::gauge!(metric::POOL_RUNNING_SEQS, "pool" => pool).set(p.running_seqs as f64);
        metrics::gauge!(metric::POOL_KV_USAGE_RATIO, "pool" => pool).set(p.kv_usage());
    }
}

async fn control_loop(l: Listener, cluster: ClusterHandle, cfg: Arc<ClusterConfig>) {
    l.serve(move |s, peer| {
        tracing::debug!(peer = %peer.addr, name = ?peer.name, roles = ?peer.roles, "control stream");
        control_stream(s, peer, cluster.clone(), cfg.clone())
    })
    .await
}

/// Why the certificate of `peer` may not register `reg`: it names another node, does not allow
/// the role claimed, or is on the revocation list (read at each registration, so a revocation
/// takes effect without a restart; an unreadable list refuses everyone, loudly).
fn identity_refusal(reg: &Register, peer: &PeerInfo, revoked: Option<&std::path::Path>) -> Option<String> {
    if let Some(name) = peer.name.as_deref().filter(|n| *n != reg.name) {
        return Some(format!("node registers as `{}` but its certificate names `{name}`", reg.name));
    }
    let needed = registry::roles_needed(reg.role);
    if !peer.allows(needed) {
        let allowed = peer.roles.map(|r| r.to_string()).unwrap_or_default();
        return Some(format!(
            "node `{}` registers as {} but its certificate allows {allowed}",
            reg.name,
            reg.role.as_str()
        ));
    }
    if let (Some(path), Some(fp)) = (revoked, peer.fingerprint) {
        let hex = cleave_net::tls::fingerprint_hex(&fp);
        match std::fs::read_to_string(path) {
            Ok(list) => {
                let listed = list
                    .lines()
                    .map(|l| l.split('#').next().unwrap_or("").trim())
                    .any(|l| l.eq_ignore_ascii_case(&hex) || l.replace(':', "").eq_ignore_ascii_case(&hex));
                if listed {
                    return Some(format!("the certificate of `{}` (sha256 {hex}) is revoked", reg.name));
                }
            }
            Err(e) => return Some(format!("revocation list {} unreadable: {e}", path.display())),
        }
    }
    None
}

/// One node's control stream: register, then reports until it ends; the coordinator's
/// commands to the node (role changes, leave) are written by a task of their own.
async fn control_stream(s: DuplexStream, peer: PeerInfo, cluster: ClusterHandle, cfg: Arc<ClusterConfig>) {
    let DuplexStream { mut send, mut recv } = s;
    let reg = match tokio::time::timeout(cfg.register_timeout, read_msg(&mut recv)).await {
        Ok(Ok(Some(ControlMsg::Register(r)))) => r,
        Ok(Ok(Some(other))) => {
            tracing::warn!(message = other.name(), "control stream must start with Register");
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "bad control stream");
            return;
        }
        Ok(Ok(None)) | Err(_) => return,
    };
    if let Some(reason) = identity_refusal(&reg, &peer, cfg.revoked_certs.as_deref()) {
        tracing::error!(peer = %peer.addr, %reason, "node refused");
        metrics::counter!(metric::REGISTRATIONS_REFUSED_TOTAL, "cause" => "identity").increment(1);
        let _ = write_msg(&mut send, &ControlMsg::RegisterReply(RegisterReply::Refused { reason })).await;
        return;
    }
    let (outbox, mut outgoing) = mpsc::channel::<ControlMsg>(16);
    let allowed = peer.roles.unwrap_or(Roles::NODE);
    let id = match cluster.register(reg, allowed, outbox).await {
        Ok(id) => id,
        Err(Refusal(reason)) => {
            let _ = write_msg(&mut send, &ControlMsg::RegisterReply(RegisterReply::Refused { reason })).await;
            return;
        }
    };
    if write_msg(&mut send, &ControlMsg::RegisterReply(RegisterReply::Accepted { node_id: id })).await.is_err() {
        cluster.gone(id).await;
        return;
    }
    let writer = tokio::spawn(async move {
        while let Some(m) = outgoing.recv().await {
            if write_msg(&mut send, &m).await.is_err() {
                break;
            }
        }
    });
    // A live node reports every interval; twice dead_after of silence ends the stream (the
    // registry has expired it by then anyway).
    let limit = cfg.routing.dead_after * 2;
    loop {
        match tokio::time::timeout(limit, read_msg(&mut recv)).await {
            Ok(Ok(Some(ControlMsg::LoadReport(l)))) => cluster.report(id, l).await,
            Ok(Ok(Some(other))) => tracing::debug!(message = other.name(), node_id = id, "ignored on control stream"),
            Ok(Ok(None)) | Ok(Err(_)) | Err(_) => break,
        }
    }
    writer.abort();
    cluster.gone(id).await;
}

async fn router(
    mut dispatches: mpsc::Receiver<Dispatch>,
    cluster: ClusterHandle,
    connector: Arc<Connector>,
    cfg: Arc<ClusterConfig>,
) {
    while let Some(d) = dispatches.recv().await {
        cluster.observe(Observation::Arrival { prompt_tokens: d.prompt.len() as u32, max_tokens: d.stop.max_tokens });
        tokio::spawn(request::run(d, cluster.clone(), connector.clone(), cfg.clone()));
    }
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    fn register(name: &str, role: cleave_protocol::control::NodeRole) -> Register {
        Register {
            role,
            name: name.into(),
            model_name: "m".into(),
            layout: cleave_protocol::KvLayout {
                model_fingerprint: 1,
                dtype: cleave_protocol::KvDtype::F32,
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 2,
                block_size: 4,
            },
            kv_capacity_blocks: 1,
            max_model_len: 16,
            rpc_addr: ([127, 0, 0, 1], 1).into(),
            kv_addr: None,
            step_budget: None,
            metrics_addr: None,
            weights: Default::default(),
        }
    }

    fn peer(name: Option<&str>, roles: Option<Roles>, fingerprint: Option<[u8; 32]>) -> PeerInfo {
        PeerInfo { addr: ([127, 0, 0, 1], 2).into(), name: name.map(String::from), roles, fingerprint }
    }

    #[test]
    fn a_registration_must_match_its_certificate_s_name_roles_and_standing() {
        use cleave_protocol::control::NodeRole;
        let ok = identity_refusal(&register("n1", NodeRole::Both), &peer(Some("n1"), Some(Roles::NODE), None), None);
        assert_eq!(ok, None);
        let other =
            identity_refusal(&register("n2", NodeRole::Decode), &peer(Some("n1"), Some(Roles::NODE), None), None);
        assert!(other.is_some_and(|r| r.contains("names `n1`")));
        let role =
            identity_refusal(&register("n1", NodeRole::Both), &peer(Some("n1"), Some(Roles::DECODE), None), None);
        assert!(role.is_some_and(|r| r.contains("allows decode")));
        // Plain TCP: the operator declared the network trusted; nothing to check.
        assert_eq!(identity_refusal(&register("n1", NodeRole::Prefill), &peer(None, None, None), None), None);
        let dir = std::env::temp_dir().join(format!("cleave-revoked-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let list = dir.join("revoked");
        let fp = [0xabu8; 32];
        std::fs::write(&list, format!("# list\n{}  # n1\n", "AB".repeat(32))).unwrap();
        let p = peer(Some("n1"), Some(Roles::NODE), Some(fp));
        let revoked = identity_refusal(&register("n1", NodeRole::Prefill), &p, Some(&list));
        assert!(revoked.is_some_and(|r| r.contains("revoked")));
        std::fs::write(&list, "").unwrap();
        assert_eq!(identity_refusal(&register("n1", NodeRole::Prefill), &p, Some(&list)), None);
        let missing = identity_refusal(&register("n1", NodeRole::Prefill), &p, Some(&dir.join("nope")));
        assert!(missing.is_some_and(|r| r.contains("unreadable")));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
