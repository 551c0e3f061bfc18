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
//!
//! The decisions of a request (which ticket goes to the shipper, what the first event means,
//! when the handoff report goes out) are the sans-IO [`request::Request`]; `prefill()` here is
//! its shell.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_engine::{EngineHandle, EngineRequest, KvExport, KvExportEvent, SinkError};
use cleave_kv_transfer::{KvSender, KvTransferError, LayerChunk, NetTransport, SendConfig, Transport, TransportSet};
use cleave_net::{DuplexStream, NetConfig};
use cleave_protocol::control::{write_msg, ControlMsg, MsgReader, PrefillRequest};
use cleave_protocol::{HandoffTicket, KvLayout};
use request::{Action, Event, Metric, Request, Shipped};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

mod request;

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

/// Errors of a prefill node, and why a request's prefill or handoff failed (the coordinator
/// reads those rendered, in a failed token event or a `HandoffDone`).
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Transfer(#[from] KvTransferError),
    #[error(transparent)]
    Net(#[from] cleave_net::NetError),
    #[error(transparent)]
    Engine(#[from] cleave_engine::EngineError),
    /// The engine's stream ended before the request's first event.
    #[error("engine stopped")]
    EngineStopped,
    /// The decode node's ticket did not come within the request timeout.
    #[error("no handoff ticket arrived in time")]
    NoTicket,
    /// The request ended (cancelled, failed) before its ticket came.
    #[error("request ended before its ticket arrived")]
    EndedBeforeTicket,
    #[error("opening the transfer to {addr}: {error}")]
    OpenTransfer { addr: std::net::SocketAddr, error: KvTransferError },
    #[error("sending kv: {0}")]
    SendKv(KvTransferError),
    #[error("completing the handoff: {0}")]
    CompleteHandoff(KvTransferError),
    /// The first token ended the request: there is nothing to hand off.
    #[error("the request ended at its first token")]
    EndedAtFirstToken,
    #[error("the engine dropped the request before its kv was out")]
    EngineDropped,
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

async fn prefill(req: PrefillRequest, s: &mut DuplexStream, shared: &Prefiller) {
    let id = req.work.id;
    let submitted = Instant::now();
    let mut m = Request::new(id, req.work.prompt.len() as u32, submitted);
    let (xtx, xrx) = mpsc::unbounded_channel();
    let w = req.work;
    if w.params.constraint.is_some() {
        shared.engine.prepare_constraints().await;
    }
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
            for a in m.refused(e.into()) {
                if let Action::Send(msg) = a {
                    let _ = write_msg(&mut s.send, &msg).await;
                }
            }
            return;
        }
    };
    let (ticket_tx, ticket_rx) = oneshot::channel();
    let mut ticket_tx = Some(ticket_tx);
    // Read in the `select!` below beside the engine and the shipper: the reader keeps a message
    // read halfway when another branch wins.
    let mut rx = MsgReader::new(&mut s.recv);
    let shipper = ship(shared, ticket_rx, xrx);
    tokio::pin!(shipper);
    let mut actions = match req.ticket {
        Some(t) => m.handle(Instant::now(), Event::Ticket(t)),
        None => Vec::new(),
    };
    loop {
        let mut answer = None;
        for a in actions {
            match a {
                Action::GiveTicket(t) => {
                    if let Some(tx) = ticket_tx.take() {
                        let _ = tx.send(t);
                    }
                }
                Action::SendFirst(ev) => {
                    let sent = write_msg(&mut s.send, &ControlMsg::Token(ev)).await.is_ok();
                    answer = Some(if sent { Event::Sent } else { Event::Lost });
                }
                Action::Send(msg) => {
                    let _ = write_msg(&mut s.send, &msg).await;
                }
                Action::Record(metric) => record(metric),
                Action::Finish => {}
            }
        }
        if m.is_done() {
            return;
        }
        let event = match answer {
            Some(ev) => ev,
            None => tokio::select! {
                ev = ts.next(), if m.reading_engine() => {
                    Event::Engine { event: ev, computing: computing_rx.try_recv().ok() }
                }
                r = &mut shipper, if m.shipping() => Event::Shipped(r),
                msg = rx.next() => match msg {
                    Ok(Some(msg)) => Event::Message(msg),
                    Ok(None) | Err(_) => Event::Lost,
                },
            },
        };
        actions = m.handle(Instant::now(), event);
    }
}

fn record(m: Metric) {
    match m {
        Metric::Handoff { outcome } => metrics::counter!(metric::HANDOFFS_TOTAL, "outcome" => outcome).increment(1),
        Metric::PrefillQueue(d) => metrics::histogram!(metric::PREFILL_QUEUE_SECONDS).record(d.as_secs_f64()),
        Metric::Prefill(d) => metrics::histogram!(metric::PREFILL_SECONDS).record(d.as_secs_f64()),
        Metric::TicketWait(d) => metrics::histogram!(metric::TICKET_WAIT_SECONDS).record(d.as_secs_f64()),
        Metric::Transfer(d) => metrics::histogram!(metric::TRANSFER_SECONDS).record(d.as_secs_f64()),
        Metric::TransferTail(d) => metrics::histogram!(metric::TRANSFER_TAIL_SECONDS).record(d.as_secs_f64()),
        Metric::TransferBytes(b) => metrics::counter!(metric::TRANSFER_BYTES_TOTAL).increment(b),
    }
}

/// Waits for the ticket, opens the transfer, forwards every chunk, and completes it with the
/// first token. Chunks produced before the ticket wait in the channel.
async fn ship(
    shared: &Prefiller,
    ticket: oneshot::Receiver<HandoffTicket>,
    mut chunks: mpsc::UnboundedReceiver<KvExportEvent>,
) -> Result<Shipped, NodeError> {
    let waited = Instant::now();
    let ticket = tokio::time::timeout(shared.cfg.request_timeout, ticket)
        .await
        .map_err(|_| NodeError::NoTicket)?
        .map_err(|_| NodeError::EndedBeforeTicket)?;
    let ticket_wait = waited.elapsed();
    let started = Instant::now();
    let transport = shared.transports.pick(&ticket)?;
    let sender = KvSender::start(transport.as_ref(), &ticket, &shared.layout, &shared.cfg.send)
        .await
        .map_err(|error| NodeError::OpenTransfer { addr: ticket.receiver_addr, error })?;
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
                sender.send(c).await.map_err(NodeError::SendKv)?;
            }
            KvExportEvent::Done(d) => {
                let done_at = Instant::now();
                if d.finish.is_some() {
                    return Err(NodeError::EndedAtFirstToken);
                }
                let report = sender.finish(d.first_token).await.map_err(NodeError::CompleteHandoff)?;
                return Ok(Shipped {
                    ticket_wait,
                    bytes: report.bytes,
                    transfer: started.elapsed(),
                    tail: done_at.elapsed(),
                });
            }
        }
    }
    Err(NodeError::EngineDropped)
}
