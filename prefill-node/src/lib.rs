//! prefill-node: the prefill side of a node: prefill a request and hand its KV off. The node
//! shell (`cleave-node`) owns registration, the control link and the accept loop, and hands
//! each `PrefillRequest` stream to [`Prefiller::serve`].
//!
//! ```text
//! coordinator ──PrefillRequest (+ Ticket, now or later)──▶ rpc stream
//!   engine.submit_prefill_only ──KvChunk per layer per chunk──▶ shipper ══KV══▶ decode node
//!   first token ──TokenMsg──▶ coordinator (as soon as it is sampled: it is the client's TTFT)
//!   shipper: finish(first token) ─▶ Ack ─▶ HandoffDone (telemetry) ──▶ coordinator
//! ```
//!
//! The prefill starts before the decode node's ticket arrives (the coordinator asks both at
//! once): chunks computed before the ticket wait in the shipper's queue, so the reservation
//! round trip overlaps the prefill instead of adding to TTFT.
//!
//! Cancellation: a `Cancel`, or the rpc stream closing, drops the engine's token stream (which
//! cancels the request) and the shipper (whose sender aborts the transfer, so the decode node
//! frees the lease).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_engine::{EngineHandle, EngineRequest, KvExport, KvExportEvent, SinkError};
use cleave_kv_transfer::{KvSender, KvTransferError, LayerChunk, NetTransport, SendConfig, Transport, TransportSet};
use cleave_net::{DuplexStream, NetConfig};
use cleave_protocol::control::{read_msg, write_msg, ControlMsg, HandoffDone, PrefillRequest};
use cleave_protocol::{HandoffTicket, KvLayout, TokenEvent};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

/// Metric names of a prefill node (on its own /metrics).
pub mod metric {
    /// The request's first chunk being computed to its first token sampled (the engine's work;
    /// chunks of other requests that share its steps included).
    pub const PREFILL_SECONDS: &str = "cleave_node_prefill_seconds";
    /// Request arrival to its first chunk being computed (the wait in the engine's queue; it
    /// includes one layer of the first chunk's compute, when the first layer's KV is exported).
    pub const PREFILL_QUEUE_SECONDS: &str = "cleave_node_prefill_queue_seconds";
    /// Time the KV waited for the decode node's ticket.
    pub const TICKET_WAIT_SECONDS: &str = "cleave_node_handoff_ticket_wait_seconds";
    /// Ticket to the receiver's acknowledgement of the last layer.
    pub const TRANSFER_SECONDS: &str = "cleave_node_handoff_transfer_seconds";
    pub const TRANSFER_BYTES_TOTAL: &str = "cleave_node_handoff_transfer_bytes_total";
    /// First token sampled to the receiver's Ack: what the transfer adds after the prefill.
    pub const TRANSFER_TAIL_SECONDS: &str = "cleave_node_handoff_transfer_tail_seconds";
    /// Handoffs, labelled `outcome` (`ok`, `failed`, `not_needed`).
    pub const HANDOFFS_TOTAL: &str = "cleave_node_handoffs_total";
}

/// Errors of a prefill node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Transfer(#[from] KvTransferError),
    #[error(transparent)]
    Net(#[from] cleave_net::NetError),
    #[error(transparent)]
    Engine(#[from] cleave_engine::EngineError),
}

/// Settings of the prefill side of a node.
#[derive(Clone)]
pub struct PrefillConfig {
    /// The node's stream transport (QUIC, TLS over TCP, plain TCP), for KV it pushes.
    pub net: NetConfig,
    /// Bound on waiting for a request's ticket.
    pub request_timeout: Duration,
    pub send: SendConfig,
    /// Transports besides `net`'s (RDMA): a ticket names the one to use, and a ticket for one
    /// this node lacks fails its handoff with a clear error, never a silent fallback.
    pub extra_transports: Vec<Arc<dyn Transport>>,
}

/// The prefill side of a node: serves `PrefillRequest` streams (the node shell reads the first
/// message and hands the stream over).
pub struct Prefiller {
    engine: EngineHandle,
    /// The node's stream transport and `extra_transports`; each ticket picks one.
    transports: TransportSet,
    layout: KvLayout,
    cfg: PrefillConfig,
}

impl Prefiller {
    pub fn new(engine: EngineHandle, cfg: PrefillConfig) -> Result<Self, NodeError> {
        let transports = cfg
            .extra_transports
            .iter()
            .fold(TransportSet::new().with(Arc::new(NetTransport::new(&cfg.net)?)), |set, t| set.with(t.clone()));
        Ok(Self { layout: engine.info().kv_layout.clone(), engine, transports, cfg })
    }

    /// Prefills one request and hands its KV off; returns when the stream's work is done (the
    /// caller drops the stream, which the coordinator reads as the end).
    pub async fn serve(&self, req: PrefillRequest, s: &mut DuplexStream) {
        let span = tracing::info_span!("prefill", request_id = %req.work.id);
        prefill(req, s, self).instrument(span).await
    }
}

/// What the shipper reports when the KV has landed (or not).
struct Shipped {
    ticket_wait: Duration,
    bytes: u64,
    transfer: Duration,
    /// First token sampled (every chunk computed) to the receiver's Ack.
    tail: Duration,
}

async fn prefill(req: PrefillRequest, s: &mut DuplexStream, shared: &Prefiller) {
    let id = req.work.id;
    let prompt_tokens = req.work.prompt.len() as u32;
    let submitted = Instant::now();
    let (xtx, xrx) = mpsc::unbounded_channel();
    let w = req.work;
    let ereq = EngineRequest { id, prompt: w.prompt, params: w.params, stop: w.stop };
    // When the first layer's KV leaves the engine, the request's first chunk is being computed:
    // submit to then is its wait in the engine's queue (plus one layer of compute).
    let (computing_tx, mut computing_rx) = oneshot::channel::<Instant>();
    let mut computing_tx = Some(computing_tx);
    let export = KvExport::new(move |ev| {
        if let Some(tx) = computing_tx.take() {
            let _ = tx.send(Instant::now());
        }
        xtx.send(ev).map_err(|_| SinkError::Closed)
    });
    let mut ts = match shared.engine.submit_prefill_only(ereq, export) {
        Ok(ts) => ts,
        Err(e) => {
            let _ = write_msg(&mut s.send, &ControlMsg::Token(TokenEvent::failed(id, prompt_tokens, 0, e.to_string())))
                .await;
            return;
        }
    };
    let (ticket_tx, ticket_rx) = oneshot::channel();
    let mut ticket_tx = Some(ticket_tx);
    if let Some(t) = req.ticket {
        let _ = ticket_tx.take().map(|tx| tx.send(t));
    }
    let shipper = ship(shared, ticket_rx, xrx);
    tokio::pin!(shipper);
    let mut first_at = None;
    let mut handed_off = None::<bool>;
    let mut shipped = None;
    loop {
        tokio::select! {
            ev = ts.next(), if handed_off.is_none() => {
                let Some(ev) = ev else {
                    let ev = TokenEvent::failed(id, prompt_tokens, 0, "engine stopped".into());
                    let _ = write_msg(&mut s.send, &ControlMsg::Token(ev)).await;
                    return;
                };
                let computing = computing_rx.try_recv().map_or(Duration::ZERO, |t| t.saturating_duration_since(submitted));
                first_at = Some((computing, submitted.elapsed()));
                let ends = ev.finish_reason.is_some();
                if write_msg(&mut s.send, &ControlMsg::Token(ev)).await.is_err() {
                    return;
                }
                if ends {
                    // Nothing to hand off (the first token ended it, or it failed).
                    metrics::counter!(metric::HANDOFFS_TOTAL, "outcome" => "not_needed").increment(1);
                    return;
                }
                handed_off = Some(true);
            }
            r = &mut shipper, if shipped.is_none() => {
                shipped = Some(r);
            }
            m = read_msg(&mut s.recv) => match m {
                Ok(Some(ControlMsg::Ticket(t))) => {
                    if let Some(tx) = ticket_tx.take() {
                        let _ = tx.send(t);
                    }
                }
                Ok(Some(ControlMsg::Cancel(_))) | Ok(None) | Err(_) => return,
                Ok(Some(other)) => tracing::debug!(message = other.name(), "ignored"),
            },
        }
        if handed_off == Some(true) && shipped.is_some() {
            let Some(r) = shipped.take() else { return };
            let (queued, first) = first_at.unwrap_or_default();
            let prefill = first.saturating_sub(queued);
            metrics::histogram!(metric::PREFILL_QUEUE_SECONDS).record(queued.as_secs_f64());
            metrics::histogram!(metric::PREFILL_SECONDS).record(prefill.as_secs_f64());
            let outcome = if r.is_ok() { "ok" } else { "failed" };
            metrics::counter!(metric::HANDOFFS_TOTAL, "outcome" => outcome).increment(1);
            if let Ok(sh) = &r {
                metrics::histogram!(metric::TICKET_WAIT_SECONDS).record(sh.ticket_wait.as_secs_f64());
                metrics::histogram!(metric::TRANSFER_SECONDS).record(sh.transfer.as_secs_f64());
                metrics::histogram!(metric::TRANSFER_TAIL_SECONDS).record(sh.tail.as_secs_f64());
                metrics::counter!(metric::TRANSFER_BYTES_TOTAL).increment(sh.bytes);
            }
            let done = match r {
                Ok(sh) => HandoffDone {
                    request_id: id,
                    error: None,
                    queue_us: queued.as_micros() as u64,
                    prefill_us: prefill.as_micros() as u64,
                    ticket_wait_us: sh.ticket_wait.as_micros() as u64,
                    transfer_bytes: sh.bytes,
                    transfer_us: sh.transfer.as_micros() as u64,
                    tail_us: sh.tail.as_micros() as u64,
                },
                Err(e) => HandoffDone { request_id: id, error: Some(e), ..Default::default() },
            };
            let _ = write_msg(&mut s.send, &ControlMsg::HandoffDone(done)).await;
            return;
        }
    }
}

/// Waits for the ticket, opens the transfer, forwards every chunk, and completes it with the
/// first token. Chunks produced before the ticket wait in the channel.
async fn ship(
    shared: &Prefiller,
    ticket: oneshot::Receiver<HandoffTicket>,
    mut chunks: mpsc::UnboundedReceiver<KvExportEvent>,
) -> Result<Shipped, String> {
    let waited = Instant::now();
    let ticket = tokio::time::timeout(shared.cfg.request_timeout, ticket)
        .await
        .map_err(|_| "no handoff ticket arrived in time".to_string())?
        .map_err(|_| "request ended before its ticket arrived".to_string())?;
    let ticket_wait = waited.elapsed();
    let started = Instant::now();
    let transport = shared.transports.pick(&ticket).map_err(|e| e.to_string())?;
    let sender = KvSender::start(transport.as_ref(), &ticket, &shared.layout, &shared.cfg.send)
        .await
        .map_err(|e| format!("opening the transfer to {}: {e}", ticket.receiver_addr))?;
    while let Some(ev) = chunks.recv().await {
        match ev {
            KvExportEvent::Chunk(c) => {
                let c = LayerChunk {
                    layer: c.layer,
                    token_start: c.token_start,
                    token_count: c.token_count,
                    k: c.k,
                    v: c.v,
                };
                sender.send(c).await.map_err(|e| format!("sending kv: {e}"))?;
            }
            KvExportEvent::Done(d) => {
                let done_at = Instant::now();
                if d.finish.is_some() {
                    return Err("the request ended at its first token".into());
                }
                let report = sender.finish(d.first_token).await.map_err(|e| format!("completing the handoff: {e}"))?;
                return Ok(Shipped {
                    ticket_wait,
                    bytes: report.bytes,
                    transfer: started.elapsed(),
                    tail: done_at.elapsed(),
                });
            }
        }
    }
    Err("the engine dropped the request before its kv was out".into())
}
