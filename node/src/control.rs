//! The node side of the cluster's control plane: register with the coordinator, keep reporting
//! load, and take the coordinator's commands, over one long-lived stream (messages of
//! [`cleave_protocol::control`]).
//!
//! Life of the link:
//! 1. open a stream to the coordinator, send `Register` (built afresh by the caller each time:
//!    it carries the node's current role), wait (bounded) for `RegisterReply`; a refusal is
//!    final: [`run_control_link`] returns [`NodeError::Refused`] and the node exits loudly (a
//!    node with another model must not linger);
//! 2. send a `LoadReport` every `report_interval`; the coordinator's `SetRole` and `Leave`
//!    arrive on the same stream and go to the caller as [`Command`]s;
//! 3. when the stream breaks (the coordinator restarted or the network hiccupped), reconnect
//!    with capped exponential backoff and register again; the coordinator treats the node as
//!    new (it marked the old registration dead when its reports stopped) and rebuilds its table
//!    from these re-registrations.
//!
//! The stream is read by its own task (frames are not cancel-safe to read inside a `select!`)
//! and written by the report loop.
//!
//! The first registration is reported through `registered` so that the caller can say "ready"
//! only once the coordinator knows the node.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use cleave_net::tls::{fingerprint_hex, NodeIdentity, Roles};
use cleave_net::{Connector, DuplexStream, NetConfig, Reloader};
use cleave_protocol::control::{read_msg, write_msg, ControlMsg, LoadReport, Register, RegisterReply, SetRole};
use tokio::sync::{mpsc, oneshot};

use crate::NodeError;

/// Settings of the control link.
#[derive(Debug, Clone)]
pub struct ControlLinkConfig {
    pub coordinator: SocketAddr,
    /// How often load is reported (the coordinator marks a node dead after a few missed ones).
    pub report_interval: Duration,
    /// Bound on connecting and on waiting for `RegisterReply`.
    pub register_timeout: Duration,
    /// Longest pause between reconnection attempts.
    pub max_backoff: Duration,
    /// Where the node's certificate lives, read again before each registration: a rotated
    /// certificate is used from the next reconnect on, without a restart.
    pub identity: Option<IdentityFiles>,
}

/// A node's certificate files and what to hand a new one to.
#[derive(Debug, Clone)]
pub struct IdentityFiles {
    /// `cleave certs` directory and the node's name (`<name>.crt`, `<name>.key`, `ca.crt`).
    pub dir: std::path::PathBuf,
    pub name: String,
    /// The network settings the control link's connector is rebuilt with.
    pub net: NetConfig,
    /// Listeners that present the node's certificate to peers (QUIC ones swap it in place).
    pub listeners: Vec<Reloader>,
}

impl IdentityFiles {
    /// The identity on disk when it differs from `current` (by certificate fingerprint), with
    /// the listeners already serving it; `None` when unchanged or unreadable (logged).
    fn changed(&self, current: Option<[u8; 32]>) -> Option<NodeIdentity> {
        let id = match NodeIdentity::load(&self.dir, &self.name) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(error = %e, "reading this node's certificate failed; keeping the one in use");
                return None;
            }
        };
        if Some(id.fingerprint()) == current {
            return None;
        }
        for l in &self.listeners {
            if let Err(e) = l.set_identity(&id) {
                tracing::warn!(error = %e, "a listener kept its old certificate");
            }
        }
        Some(id)
    }
}

impl ControlLinkConfig {
    pub fn new(coordinator: SocketAddr) -> Self {
        Self {
            coordinator,
            report_interval: Duration::from_millis(200),
            register_timeout: Duration::from_secs(10),
            max_backoff: Duration::from_secs(2),
            identity: None,
        }
    }
}

/// What the coordinator told the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    SetRole(SetRole),
    /// Stop serving and exit (the node drained); the reason, for the log.
    Leave(String),
}

/// Opens a stream, registers, and returns the stream with the node id the coordinator gave.
pub async fn register(
    connector: &Connector,
    cfg: &ControlLinkConfig,
    reg: &Register,
) -> Result<(DuplexStream, u64), NodeError> {
    let ms = cfg.register_timeout.as_millis() as u64;
    let attempt = async {
        let (mut s, peer) = connector.open_with_peer(cfg.coordinator).await?;
        if !peer.allows(Roles::COORDINATOR) {
            // Registering would hand our reports and requests' routing to an impostor.
            return Err(NodeError::Refused {
                reason: format!(
                    "the peer at {} ({}) is not a coordinator: its certificate allows {}",
                    cfg.coordinator,
                    peer.name.as_deref().unwrap_or("?"),
                    peer.roles.map(|r| r.to_string()).unwrap_or_default()
                ),
            });
        }
        write_msg(&mut s.send, &ControlMsg::Register(reg.clone())).await?;
        match read_msg(&mut s.recv).await? {
            Some(ControlMsg::RegisterReply(RegisterReply::Accepted { node_id })) => Ok((s, node_id)),
            Some(ControlMsg::RegisterReply(RegisterReply::Refused { reason })) => Err(NodeError::Refused { reason }),
            Some(other) => {
                Err(NodeError::Protocol { reason: format!("coordinator answered Register with {}", other.name()) })
            }
            None => Err(NodeError::Protocol {
                reason: "the coordinator closed the stream before answering Register".into(),
            }),
        }
    };
    tokio::time::timeout(cfg.register_timeout, attempt).await.map_err(|_| NodeError::Timeout {
        what: format!("registration with the coordinator at {}", cfg.coordinator),
        ms,
    })?
}

/// The channels a running link talks through.
pub struct LinkIo {
    /// Fires once: with the first node id, or with the refusal.
    pub registered: oneshot::Sender<Result<u64, NodeError>>,
    /// The coordinator's commands, in order.
    pub commands: mpsc::Sender<Command>,
}

/// Runs the control link until `shutdown` resolves (Ok) or the coordinator refuses the node
/// (Err). `registration` builds each `Register` (the node's role may have changed since the
/// last one); `load` produces each report. Transient failures (coordinator not up yet, link
/// lost) are retried forever.
pub async fn run_control_link<R, F, Fut>(
    mut connector: Connector,
    cfg: ControlLinkConfig,
    mut registration: R,
    mut load: F,
    io: LinkIo,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError>
where
    R: FnMut() -> Register,
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<LoadReport>>,
{
    let LinkIo { registered, commands } = io;
    let mut registered = Some(registered);
    let mut backoff = Duration::from_millis(50);
    // Load is sampled by its own loop: an engine busy with a long step answers late, but the
    // reports (the node's heartbeat) must keep their pace, so the link sends the latest sample
    // every interval, stale or not. `None` in the channel: the engine stopped.
    let (latest_tx, latest) = tokio::sync::watch::channel(Some(LoadReport::default()));
    let interval = cfg.report_interval;
    let sampler = async move {
        loop {
            let r = load().await;
            let stopped = r.is_none();
            if latest_tx.send(r).is_err() || stopped {
                return std::future::pending::<()>().await;
            }
            tokio::time::sleep(interval).await;
        }
    };
    let mut in_use = cfg.identity.as_ref().and_then(|f| f.net.identity.as_ref()).map(NodeIdentity::fingerprint);
    let link = async {
        loop {
            if let Some(files) = &cfg.identity {
                if let Some(id) = files.changed(in_use) {
                    let net = NetConfig { identity: Some(id.clone()), ..files.net.clone() };
                    match Connector::new(&net) {
                        Ok(c) => {
                            tracing::info!(fingerprint = %fingerprint_hex(&id.fingerprint()), "picked up a new certificate");
                            connector = c;
                            in_use = Some(id.fingerprint());
                        }
                        Err(e) => tracing::warn!(error = %e, "the new certificate is unusable; keeping the old one"),
                    }
                }
            }
            let reg = registration();
            match register(&connector, &cfg, &reg).await {
                Ok((s, node_id)) => {
                    tracing::info!(node_id, coordinator = %cfg.coordinator, role = reg.role.as_str(), "registered");
                    if let Some(tx) = registered.take() {
                        let _ = tx.send(Ok(node_id));
                    }
                    backoff = Duration::from_millis(50);
                    if !serve_link(s, &cfg, &latest, &commands).await {
                        // The node's engine is gone: stop reporting so the coordinator marks
                        // it dead.
                        return Ok(());
                    }
                    tracing::warn!(coordinator = %cfg.coordinator, "control link lost; reconnecting");
                }
                Err(NodeError::Refused { reason }) => {
                    tracing::error!(%reason, "the coordinator refused this node");
                    if let Some(tx) = registered.take() {
                        let _ = tx.send(Err(NodeError::Refused { reason: reason.clone() }));
                    }
                    return Err(NodeError::Refused { reason });
                }
                Err(e) => {
                    // The coordinator may not be up yet, or restarting: keep trying.
                    tracing::debug!(error = %e, "registration failed; retrying");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(cfg.max_backoff);
        }
    };
    tokio::select! {
        r = link => r,
        () = sampler => Ok(()),
        () = shutdown => Ok(()),
    }
}

/// Reports over one registered stream and forwards the coordinator's commands until the stream
/// breaks (true) or the engine stopped (false).
async fn serve_link(
    s: DuplexStream,
    cfg: &ControlLinkConfig,
    latest: &tokio::sync::watch::Receiver<Option<LoadReport>>,
    commands: &mpsc::Sender<Command>,
) -> bool {
    let DuplexStream { mut send, mut recv } = s;
    let (lost_tx, mut lost) = oneshot::channel::<()>();
    let forward = commands.clone();
    let reader = tokio::spawn(async move {
        loop {
            match read_msg(&mut recv).await {
                Ok(Some(ControlMsg::SetRole(r))) => {
                    if forward.send(Command::SetRole(r)).await.is_err() {
                        break;
                    }
                }
                Ok(Some(ControlMsg::Leave(reason))) => {
                    let _ = forward.send(Command::Leave(reason)).await;
                }
                Ok(Some(other)) => tracing::debug!(message = other.name(), "ignored on the control link"),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "bad message on the control link");
                    break;
                }
            }
        }
        let _ = lost_tx.send(());
    });
    let mut tick = tokio::time::interval(cfg.report_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let alive = loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut lost => break true,
        }
        let Some(report) = latest.borrow().clone() else { break false };
        record_load(&report);
        let sent =
            tokio::time::timeout(cfg.register_timeout, write_msg(&mut send, &ControlMsg::LoadReport(report))).await;
        if !matches!(sent, Ok(Ok(()))) {
            break true;
        }
    };
    reader.abort();
    alive
}

/// Gauges of the node's load, refreshed with every report (on the node's own /metrics).
pub mod metric {
    /// Prompt tokens waiting for prefill.
    pub const NODE_QUEUED_PREFILL_TOKENS: &str = "cleave_node_queued_prefill_tokens";
    /// Sequences waiting / running.
    pub const NODE_WAITING_SEQS: &str = "cleave_node_waiting_seqs";
    pub const NODE_RUNNING_SEQS: &str = "cleave_node_running_seqs";
    /// KV blocks by state (`free`, `cached`, `used`).
    pub const NODE_KV_BLOCKS: &str = "cleave_node_kv_blocks";
    /// Share of KV blocks in use (0..1).
    pub const NODE_KV_USAGE_RATIO: &str = "cleave_node_kv_usage_ratio";
    /// Bytes of the KV cache resident in host memory (grows as blocks are first used, up to the
    /// cache's size).
    pub const NODE_KV_RESIDENT_BYTES: &str = "cleave_node_kv_resident_bytes";
    /// The time per output token prompt chunks are paced to (0: not paced), and the steps
    /// whose prompt tokens pacing held below the step budget since the node started.
    pub const NODE_PACING_TARGET_SECONDS: &str = "cleave_node_pacing_target_seconds";
    pub const NODE_PACED_STEPS: &str = "cleave_node_paced_steps_total";
}

fn record_load(r: &LoadReport) {
    let used = r.total_blocks.saturating_sub(r.free_blocks + r.cached_blocks);
    metrics::gauge!(metric::NODE_QUEUED_PREFILL_TOKENS).set(r.queued_prefill_tokens as f64);
    metrics::gauge!(metric::NODE_WAITING_SEQS).set(f64::from(r.waiting_seqs));
    metrics::gauge!(metric::NODE_RUNNING_SEQS).set(f64::from(r.running_seqs));
    metrics::gauge!(metric::NODE_KV_BLOCKS, "state" => "free").set(f64::from(r.free_blocks));
    metrics::gauge!(metric::NODE_KV_BLOCKS, "state" => "cached").set(f64::from(r.cached_blocks));
    metrics::gauge!(metric::NODE_KV_BLOCKS, "state" => "used").set(f64::from(used));
    let ratio = if r.total_blocks == 0 { 0.0 } else { f64::from(used) / f64::from(r.total_blocks) };
    metrics::gauge!(metric::NODE_KV_USAGE_RATIO).set(ratio);
    metrics::gauge!(metric::NODE_KV_RESIDENT_BYTES).set(r.kv_resident_bytes as f64);
    metrics::gauge!(metric::NODE_PACING_TARGET_SECONDS).set(r.tpot_target_us.map_or(0.0, |us| f64::from(us) / 1e6));
    metrics::counter!(metric::NODE_PACED_STEPS).absolute(r.paced_steps);
}
