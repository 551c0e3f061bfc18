//! The node side of the cluster's control plane: register with the coordinator and keep
//! reporting load over one long-lived stream (messages of [`cleave_protocol::control`]).
//!
//! Life of the link:
//! 1. open a stream to the coordinator, send `Register`, wait (bounded) for `RegisterReply`;
//!    a refusal is final: [`run_control_link`] returns [`KvTransferError::Refused`] and the node
//!    should exit loudly (a node with another model must not linger);
//! 2. send a `LoadReport` every `report_interval`;
//! 3. when the stream breaks (the coordinator restarted or the network hiccupped), reconnect
//!    with capped exponential backoff and register again; the coordinator treats the node as
//!    new (it marked the old registration dead when its reports stopped).
//!
//! The first registration is reported through `registered` so that the caller can say "ready"
//! only once the coordinator knows the node.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use cleave_protocol::control::{read_msg, write_msg, ControlMsg, LoadReport, Register, RegisterReply};
use tokio::sync::oneshot;

use crate::net::{Connector, DuplexStream};
use crate::{KvTransferError, Result};

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
}

impl ControlLinkConfig {
    pub fn new(coordinator: SocketAddr) -> Self {
        Self {
            coordinator,
            report_interval: Duration::from_millis(200),
            register_timeout: Duration::from_secs(10),
            max_backoff: Duration::from_secs(2),
        }
    }
}

/// Opens a stream, registers, and returns the stream with the node id the coordinator gave.
pub async fn register(connector: &Connector, cfg: &ControlLinkConfig, reg: &Register) -> Result<(DuplexStream, u64)> {
    let ms = cfg.register_timeout.as_millis() as u64;
    let what = || format!("registration with the coordinator at {}", cfg.coordinator);
    let attempt = async {
        let mut s = connector.open(cfg.coordinator).await?;
        write_msg(&mut s.send, &ControlMsg::Register(reg.clone())).await?;
        match read_msg(&mut s.recv).await? {
            Some(ControlMsg::RegisterReply(RegisterReply::Accepted { node_id })) => Ok((s, node_id)),
            Some(ControlMsg::RegisterReply(RegisterReply::Refused { reason })) => {
                Err(KvTransferError::Refused { reason })
            }
            Some(other) => Err(KvTransferError::Protocol {
                reason: format!("coordinator answered Register with {}", other.name()),
            }),
            None => Err(KvTransferError::ConnectionLost {
                addr: cfg.coordinator,
                reason: "closed before answering Register".into(),
            }),
        }
    };
    tokio::time::timeout(cfg.register_timeout, attempt)
        .await
        .map_err(|_| KvTransferError::Timeout { what: what(), ms })?
}

/// Runs the control link until `shutdown` resolves (Ok) or the coordinator refuses the node
/// (Err). `load` produces each report. `registered` fires once: with the first node id, or with
/// the refusal. Transient failures (coordinator not up yet, link lost) are retried forever.
pub async fn run_control_link<F, Fut>(
    connector: Connector,
    cfg: ControlLinkConfig,
    reg: Register,
    mut load: F,
    registered: oneshot::Sender<Result<u64>>,
    shutdown: impl Future<Output = ()>,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<LoadReport>>,
{
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
    let link = async {
        loop {
            match register(&connector, &cfg, &reg).await {
                Ok((mut s, node_id)) => {
                    tracing::info!(node_id, coordinator = %cfg.coordinator, "registered");
                    if let Some(tx) = registered.take() {
                        let _ = tx.send(Ok(node_id));
                    }
                    backoff = Duration::from_millis(50);
                    let mut tick = tokio::time::interval(cfg.report_interval);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tick.tick().await;
                        let Some(report) = latest.borrow().clone() else {
                            // The node's engine is gone: stop reporting so the coordinator
                            // marks it dead.
                            return Ok(());
                        };
                        record_load(&report);
                        let sent = tokio::time::timeout(
                            cfg.register_timeout,
                            write_msg(&mut s.send, &ControlMsg::LoadReport(report)),
                        )
                        .await;
                        if !matches!(sent, Ok(Ok(()))) {
                            tracing::warn!(coordinator = %cfg.coordinator, "control link lost; reconnecting");
                            break;
                        }
                    }
                }
                Err(KvTransferError::Refused { reason }) => {
                    tracing::error!(%reason, "the coordinator refused this node");
                    if let Some(tx) = registered.take() {
                        let _ = tx.send(Err(KvTransferError::Refused { reason: reason.clone() }));
                    }
                    return Err(KvTransferError::Refused { reason });
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
}
