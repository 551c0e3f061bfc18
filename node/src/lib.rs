//! node: the one shell every cleave node runs, whatever its role.
//!
//! ```text
//! coordinator ◀══control link══▶ Register, LoadReport every interval ◀── engine load
//!               SetRole (role, step budget, TPOT pacing), Leave ──▶ role state, shutdown
//! coordinator ──rpc stream──▶ accept loop ─┬─ PrefillRequest ─▶ Prefiller::serve (prefill-node)
//!                                          └─ DecodeRequest  ─▶ Decoder::serve   (decode-node)
//! prefill nodes ══KV══▶ Decoder's receiver (always listening)
//! ```
//!
//! A role is state, not a process identity: every node runs both sides on one engine, so it
//! serves whatever request the coordinator sends it. The role says what the coordinator routes
//! here and what the node registers as (after a reconnect too); the coordinator changes it with
//! `SetRole` once the node has drained the work its old role had and the new one does not (see
//! the coordinator's registry), so a switch reloads nothing and loses nothing. The same message
//! carries the coordinator's TPOT target (at registration, and when it changes), which the
//! engine paces its prompt chunks to (`cleave_engine::sched::pacing`) unless `pacing` is off.
//!
//! Allowed dependencies: engine, net, kv-transfer, protocol and the two role crates; the coordinator
//! never depends on this crate.

pub mod control;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cleave_decode_node::{DecodeConfig, Decoder};
use cleave_engine::EngineHandle;
use cleave_kv_transfer::{KvTransferError, SendConfig, Transport};
use cleave_net::{Connector, DuplexStream, Listener, NetConfig};
use cleave_prefill_node::{PrefillConfig, Prefiller};
use cleave_protocol::control::{read_msg, ControlMsg, NodeRole, Register, WireError};
use tokio::sync::{mpsc, oneshot, watch};

pub use control::{Command, ControlLinkConfig, IdentityFiles};

/// Cap on prefix hashes per load report (4096 x 8 bytes = 32 KiB per report interval).
pub const MAX_REPORTED_HASHES: usize = 4096;

/// Errors of a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Transfer(#[from] KvTransferError),
    #[error(transparent)]
    Net(#[from] cleave_net::NetError),
    #[error(transparent)]
    Engine(#[from] cleave_engine::EngineError),
    #[error(transparent)]
    Prefill(#[from] cleave_prefill_node::NodeError),
    #[error(transparent)]
    Decode(#[from] cleave_decode_node::NodeError),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("the coordinator refused this node: {reason}")]
    Refused { reason: String },
    #[error("control protocol: {reason}")]
    Protocol { reason: String },
    #[error("{what} timed out after {ms} ms")]
    Timeout { what: String, ms: u64 },
    #[error("node task: {0}")]
    Task(String),
}

/// Settings of a node (both sides; [`NodeConfig::new`] fills the usual defaults).
#[derive(Clone)]
pub struct NodeConfig {
    pub name: String,
    /// The role it starts in.
    pub role: NodeRole,
    pub model_name: String,
    pub coordinator: SocketAddr,
    /// Where the coordinator's per-request streams arrive (port 0: any).
    pub rpc_bind: SocketAddr,
    /// Where prefill nodes push KV (port 0: any).
    pub kv_bind: SocketAddr,
    /// Where the coordinator reaches the RPC listener, when not at the bound address (NAT, a
    /// proxy). None: the bound address, an unspecified IP (0.0.0.0) replaced by this host's
    /// address on the route to the coordinator.
    pub rpc_advertise: Option<SocketAddr>,
    /// Where prefill nodes reach the KV listener, likewise.
    pub kv_advertise: Option<SocketAddr>,
    pub net: NetConfig,
    pub report_interval: Duration,
    /// Bound on reading a request's first message, and on a prefill waiting for its ticket.
    pub request_timeout: Duration,
    /// How long a lease waits for its KV before the blocks are freed.
    pub lease_ttl: Duration,
    /// The engine's step budget at start (reported at registration).
    pub step_budget: Option<u32>,
    /// Where this process serves its metrics (reported at registration, for Prometheus).
    pub metrics_addr: Option<SocketAddr>,
    pub send: SendConfig,
    /// Transports to push KV over besides `net`'s (RDMA).
    pub extra_transports: Vec<Arc<dyn Transport>>,
    /// The certificate's files, read again at each reconnect (rotation without a restart).
    pub identity_dir: Option<std::path::PathBuf>,
    /// Pace prompt chunks beside running decodes to the TPOT target the coordinator sends
    /// (`cleave_engine::sched::pacing`); false: the step budget alone sizes them.
    pub pacing: bool,
    /// Receive KV over RDMA (decode side).
    #[cfg(feature = "rdma")]
    pub rdma: Option<cleave_decode_node::RdmaLanding>,
}

impl NodeConfig {
    pub fn new(name: &str, role: NodeRole, coordinator: SocketAddr, net: NetConfig) -> Self {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        Self {
            name: name.to_string(),
            role,
            model_name: "model".into(),
            coordinator,
            rpc_bind: any,
            kv_bind: any,
            rpc_advertise: None,
            kv_advertise: None,
            net,
            report_interval: Duration::from_millis(200),
            request_timeout: Duration::from_secs(60),
            lease_ttl: Duration::from_secs(60),
            step_budget: None,
            metrics_addr: None,
            send: SendConfig::default(),
            extra_transports: Vec::new(),
            identity_dir: None,
            pacing: true,
            #[cfg(feature = "rdma")]
            rdma: None,
        }
    }
}

/// Why a node stopped serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// The caller's shutdown fired (a signal).
    Shutdown,
    /// The coordinator told the node to leave (it drained); the reason.
    Left(String),
}

/// A running node.
pub struct Node {
    pub rpc_addr: SocketAddr,
    pub kv_addr: SocketAddr,
    /// Resolves with the node id once the coordinator accepted the node.
    pub registered: Option<oneshot::Receiver<Result<u64, NodeError>>>,
    role: watch::Receiver<NodeRole>,
    task: tokio::task::JoinHandle<Result<Exit, NodeError>>,
}

struct Sides {
    prefill: Prefiller,
    decode: Decoder,
    request_timeout: Duration,
}

impl Node {
    /// Binds, starts both sides and the control link, and serves until `shutdown`, a `Leave`
    /// from the coordinator, or a refusal.
    pub async fn start(
        engine: EngineHandle,
        cfg: NodeConfig,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<Self, NodeError> {
        let rpc = Listener::bind(&cfg.net, cfg.rpc_bind).await?;
        let rpc_addr = cleave_net::advertised(rpc.local_addr(), cfg.rpc_advertise, cfg.coordinator);
        let rpc_reloader = rpc.reloader();
        let decode = Decoder::start(
            engine.clone(),
            DecodeConfig {
                kv_bind: cfg.kv_bind,
                kv_advertise: cfg.kv_advertise,
                route_to: cfg.coordinator,
                net: cfg.net.clone(),
                lease_ttl: cfg.lease_ttl,
                #[cfg(feature = "rdma")]
                rdma: cfg.rdma.clone(),
            },
        )
        .await?;
        let kv_addr = decode.kv_addr();
        let listeners: Vec<cleave_net::Reloader> = rpc_reloader.into_iter().chain(decode.kv_reloader()).collect();
        let prefill = Prefiller::new(
            engine.clone(),
            PrefillConfig {
                net: cfg.net.clone(),
                request_timeout: cfg.request_timeout,
                send: cfg.send.clone(),
                extra_transports: cfg.extra_transports.clone(),
            },
        )?;
        let sides = Arc::new(Sides { prefill, decode, request_timeout: cfg.request_timeout });
        let (role_tx, role) = watch::channel(cfg.role);
        let (budget_tx, budget) = watch::channel(cfg.step_budget);
        let info = engine.info().clone();
        let (name, model_name) = (cfg.name.clone(), cfg.model_name.clone());
        let (role_now, budget_now) = (role.clone(), budget.clone());
        let metrics_addr = cfg.metrics_addr;
        let registration = move || Register {
            role: *role_now.borrow(),
            name: name.clone(),
            model_name: model_name.clone(),
            layout: info.kv_layout.clone(),
            kv_capacity_blocks: info.kv_blocks_total as u32,
            max_model_len: info.max_model_len as u32,
            rpc_addr,
            kv_addr: Some(kv_addr),
            step_budget: *budget_now.borrow(),
            metrics_addr,
            weights: info.weights.clone(),
        };
        let connector = Connector::new(&cfg.net)?;
        let mut link_cfg = ControlLinkConfig::new(cfg.coordinator);
        link_cfg.report_interval = cfg.report_interval;
        link_cfg.identity =
            cfg.identity_dir.as_ref().filter(|_| cfg.net.identity.is_some()).map(|dir| control::IdentityFiles {
                dir: dir.clone(),
                name: cfg.name.clone(),
                net: cfg.net.clone(),
                listeners: listeners.clone(),
            });
        let (reg_tx, reg_rx) = oneshot::channel();
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let task = tokio::spawn(async move {
            let accept = tokio::spawn(rpc.serve(move |s, peer| {
                // Requests come from the coordinator alone: another member of the cluster (a
                // node's certificate) may not make this node prefill or decode for it.
                let allowed = peer.allows(cleave_net::tls::Roles::COORDINATOR);
                if !allowed {
                    tracing::warn!(peer = %peer.addr, name = ?peer.name, roles = ?peer.roles, "request stream from a non-coordinator refused");
                }
                let sides = sides.clone();
                async move {
                    if allowed {
                        serve_stream(s, sides).await
                    }
                }
            }));
            let (left_tx, mut left) = watch::channel(None::<String>);
            let commands =
                tokio::spawn(apply_commands(cmd_rx, engine.clone(), cfg.pacing, role_tx, budget_tx, left_tx));
            let load_engine = engine.clone();
            let mut left_rx = left.clone();
            let stop = async move {
                tokio::select! {
                    () = shutdown => {}
                    gone = async { left_rx.wait_for(Option::is_some).await.is_err() } => {
                        if gone {
                            std::future::pending::<()>().await;
                        }
                    }
                }
            };
            let r = control::run_control_link(
                connector,
                link_cfg,
                registration,
                move || {
                    let e = load_engine.clone();
                    async move { e.load_report(MAX_REPORTED_HASHES).await }
                },
                control::LinkIo { registered: reg_tx, commands: cmd_tx },
                stop,
            )
            .await;
            accept.abort();
            commands.abort();
            r?;
            let reason = left.borrow_and_update().clone();
            Ok(reason.map_or(Exit::Shutdown, Exit::Left))
        });
        Ok(Self { rpc_addr, kv_addr, registered: Some(reg_rx), role, task })
    }

    /// The node's role now.
    pub fn role(&self) -> NodeRole {
        *self.role.borrow()
    }

    /// Waits for the node to stop, and says why it did.
    pub async fn wait(self) -> Result<Exit, NodeError> {
        self.task.await.map_err(|e| NodeError::Task(e.to_string()))?
    }
}

/// Carries out the coordinator's commands in order: a role change (and step budget) becomes the
/// node's state, its TPOT target the engine's pacing (unless `pacing` is off); `Leave` stops
/// the node.
async fn apply_commands(
    mut rx: mpsc::Receiver<Command>,
    engine: EngineHandle,
    pacing: bool,
    role: watch::Sender<NodeRole>,
    budget: watch::Sender<Option<u32>>,
    left: watch::Sender<Option<String>>,
) {
    while let Some(cmd) = rx.recv().await {
        match cmd {
            Command::SetRole(r) => {
                if let Some(us) = r.tpot_target_us.filter(|_| pacing) {
                    let target = Duration::from_micros(u64::from(us));
                    match engine.set_tpot_target(Some(target)).await {
                        Ok(()) => tracing::info!(tpot_target_us = us, "prompt chunks paced to the TPOT target"),
                        Err(e) => tracing::warn!(tpot_target_us = us, error = %e, "pacing target refused"),
                    }
                }
                if let Some(b) = r.step_budget {
                    match engine.set_step_budget(b as usize).await {
                        Ok(()) => {
                            budget.send_replace(Some(b));
                        }
                        Err(e) => tracing::warn!(step_budget = b, error = %e, "step budget refused"),
                    }
                }
                let old = role.send_replace(r.role);
                if old != r.role {
                    tracing::info!(from = old.as_str(), to = r.role.as_str(), "role changed");
                }
            }
            Command::Leave(reason) => {
                tracing::info!(%reason, "the coordinator asked this node to leave");
                left.send_if_modified(|l| l.is_none() && l.replace(reason).is_none());
            }
        }
    }
}

/// One rpc stream: its first message says which side serves it.
async fn serve_stream(mut s: DuplexStream, sides: Arc<Sides>) {
    let first = tokio::time::timeout(sides.request_timeout, read_msg(&mut s.recv)).await;
    match first {
        Ok(Ok(Some(ControlMsg::PrefillRequest(p)))) => sides.prefill.serve(p, &mut s).await,
        Ok(Ok(Some(ControlMsg::DecodeRequest(d)))) => sides.decode.serve(d, &mut s).await,
        Ok(Ok(Some(other))) => {
            tracing::warn!(message = other.name(), "a request stream must start with PrefillRequest or DecodeRequest");
        }
        Ok(Ok(None)) => tracing::debug!("rpc stream closed before its request"),
        Ok(Err(e)) => tracing::warn!(error = %e, "bad rpc stream"),
        Err(_) => tracing::warn!(
            timeout_ms = sides.request_timeout.as_millis() as u64,
            "no request on an rpc stream in time; closing it"
        ),
    }
}
