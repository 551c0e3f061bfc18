//! decode-node: the decode side of a node: receive KV (or prefill locally) and decode.
//!
//! ```text
//! coordinator ──DecodeRequest──▶ rpc stream ─┬─ local prefill: engine.submit ─────────────┐
//!                                            └─ remote: reserve (kv receiver) ─▶ Ticket   │
//!                                               prefill node ══KV══▶ receiver ─▶ engine   │
//!                                               lease completes ─▶ submit_imported ───────┤
//! coordinator ◀──────────────── TokenMsg per token ◀──────────────────────────────────────┘
//! ```
//!
//! The node shell (`cleave-node`) owns registration, the control link and the accept loop, and
//! hands each `DecodeRequest` stream to [`Decoder::serve`]. Every node runs a decoder (its KV
//! receiver listens from the start), whatever its role: a role is what the coordinator routes
//! to a node, so a prefill node can be switched to decode without a restart. A colocated node
//! (`--role both`) is simply sent every request with `local_prefill`.
//!
//! Ownership of KV blocks: a remote request's blocks are reserved in the engine through the
//! [`EngineSink`] when the receiver grants the lease; the receiver releases them on every failed
//! lease path (see kv-transfer's crate docs); after completion they belong to the engine
//! request, which frees them when it ends, is cancelled (the rpc stream closing drops its
//! [`TokenStream`], which cancels it) or fails. A completed lease whose request cannot be
//! submitted is released here.
//!
//! Over RDMA (feature `rdma`, [`RdmaLanding`]) prefill nodes write the KV one-sided into a
//! landing pool registered once at start; the node reserves engine blocks and landing blocks
//! together ([`LandingSink`]), and when the lease completes copies the KV out of the landing
//! blocks (one gather per layer) into the engine's cache (one more copy, on the engine thread,
//! as the QUIC path's block write is) and frees the landing blocks. The engine's own cache is not a registered region:
//! it is one buffer per layer, and a device backend keeps it in device memory.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_engine::{EngineHandle, EngineRequest, ImportStart, TokenStream};
use cleave_kv_transfer::{
    Ask, Grant, KvSink, KvTransferError, KvWrite, ReceiverConfig, ReceiverHandle, ReceiverService, Reservation,
    Reserved,
};
use cleave_net::{DuplexStream, Listener, NetConfig, NetKind, RecvHalf, SendHalf};
use cleave_protocol::control::{write_msg, ControlMsg, DecodeRequest, MsgReader};
use cleave_protocol::{RequestId, TokenEvent, TransportKind};
use tracing::Instrument;
use wait::{Action, Event, KvWait, Metric};

mod wait;

/// Metric names of a decode node (on its own /metrics).
pub mod metric {
    /// Requests, labelled `path` (`local` prefill here, `remote` KV from a prefill node,
    /// `resumed` after a migration).
    pub const REQUESTS_TOTAL: &str = "cleave_node_decode_requests_total";
    /// Granting a lease (reserving blocks in the engine).
    pub const RESERVATION_SECONDS: &str = "cleave_node_reservation_seconds";
    /// Ticket sent to every layer of the KV received.
    pub const KV_WAIT_SECONDS: &str = "cleave_node_kv_wait_seconds";
    /// Handoffs whose KV never completed.
    pub const HANDOFF_FAILURES_TOTAL: &str = "cleave_node_handoff_failures_total";
    /// Prompt tokens whose K/V a handoff did not move: the node's prefix cache held them.
    pub const HANDOFF_CACHED_TOKENS_TOTAL: &str = "cleave_node_handoff_cached_tokens_total";
    /// Handoff reservations that waited for KV blocks to free (see `RESERVE_WAIT`).
    pub const RESERVATIONS_WAITED_TOTAL: &str = "cleave_node_reservations_waited_total";
}

/// Errors of a decode node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Transfer(#[from] KvTransferError),
    #[error(transparent)]
    Net(#[from] cleave_net::NetError),
    #[error(transparent)]
    Engine(#[from] cleave_engine::EngineError),
    #[error("node setup: {0}")]
    Setup(String),
    /// A remote request's KV never completed (the coordinator reads this in the error event).
    #[error("kv handoff failed: {0}")]
    HandoffFailed(KvTransferError),
    /// A completed RDMA lease's KV could not be moved into the engine.
    #[error("moving the landed kv into the engine: {0}")]
    Landing(Box<NodeError>),
}

/// Settings of the decode side of a node.
#[derive(Clone)]
pub struct DecodeConfig {
    /// Where prefill nodes push KV (port 0: any), and over what.
    pub kv_bind: SocketAddr,
    /// The address put in tickets, when peers reach the listener at another address than the
    /// one bound (NAT, a proxy, a Kubernetes Service, an unspecified bind address). None: the
    /// bound address, an unspecified IP replaced by this host's address toward `route_to`.
    pub kv_advertise: Option<SocketAddr>,
    /// A peer whose route picks the advertised IP when the bind IP is unspecified (the
    /// coordinator).
    pub route_to: SocketAddr,
    pub net: NetConfig,
    /// How long a lease waits for its KV before the blocks are freed.
    pub lease_ttl: Duration,
    /// Receive KV over RDMA instead of streams (`net` must then be QUIC: control streams).
    #[cfg(feature = "rdma")]
    pub rdma: Option<RdmaLanding>,
}

/// A decode node's RDMA side: the registered landing pool (its layout must be the engine's)
/// and where its queue pairs come from (a device, or the in-memory fabric in tests).
#[cfg(feature = "rdma")]
#[derive(Clone)]
pub struct RdmaLanding {
    pub pool: cleave_kv_transfer::MemoryPool,
    pub receive: cleave_kv_transfer::rdma::RdmaReceive,
}

/// The sink of an RDMA decode node: reservations take engine blocks and landing blocks (the
/// ticket names the landing blocks: that is where the writes go); a failed lease gives both
/// back. A completed lease's KV is moved into the engine by [`land_into_engine`].
pub struct LandingSink {
    engine: EngineSink,
    landing: cleave_kv_transfer::MemoryPool,
}

impl LandingSink {
    pub fn new(engine: EngineHandle, landing: cleave_kv_transfer::MemoryPool) -> Self {
        Self { engine: EngineSink { engine }, landing }
    }
}

impl KvSink for LandingSink {
    /// The engine's reservation first (its answer comes later), then the landing blocks the
    /// ticket names; landing blocks short: the engine's reservation is released again.
    ///
    /// The whole prompt lands (no cached prefix): the landing blocks are copied into the
    /// engine's reservation as a whole ([`land_into_engine`]), and an engine block holding a
    /// cached prefix is shared, never written.
    fn reserve(&mut self, ask: Ask) -> Reserved {
        let (request_id, num_blocks) = (ask.request_id, ask.num_blocks);
        let engine = self.engine.reserve(Ask { prompt: None, ..ask });
        let (handle, landing) = (self.engine.engine.clone(), self.landing.clone());
        Reserved::Later(Box::pin(async move {
            engine.wait().await?;
            landing.take_blocks(num_blocks).map(Grant::fresh).inspect_err(|_| release_import(&handle, request_id))
        }))
    }

    fn write(&mut self, w: &KvWrite) -> cleave_kv_transfer::Result<()> {
        // A byte-stream chunk goes to the engine directly (RDMA leases never take one).
        self.engine.write(w)
    }

    fn release(&mut self, request_id: RequestId, blocks: &[u32]) {
        self.engine.release(request_id, &[]);
        self.landing.release(request_id, blocks);
    }

    fn landed_checksum(
        &self,
        blocks: &[u32],
        layer: u32,
        tokens: std::ops::Range<u32>,
    ) -> cleave_kv_transfer::Result<u32> {
        self.landing.landed_checksum(blocks, layer, tokens)
    }
}

/// Copies a completed lease's KV (`num_tokens` tokens of every layer) from its landing blocks
/// into the engine's reservation of the same request, then frees the landing blocks. The
/// engine applies the copies in order before the request it is then given.
pub fn land_into_engine(
    engine: &EngineHandle,
    landing: &cleave_kv_transfer::MemoryPool,
    request_id: RequestId,
    blocks: &[u32],
    num_tokens: u32,
) -> Result<(), NodeError> {
    let layers = engine.info().kv_layout.num_layers;
    let r = (0..layers).try_for_each(|layer| {
        let (k, v) = landing.gather(blocks, layer, 0, num_tokens);
        engine.import_kv(request_id, layer, 0, bytes::Bytes::from(k), bytes::Bytes::from(v)).map(|_| ())
    });
    landing.free_request(blocks);
    r.map_err(NodeError::from)
}

/// The node's [`KvSink`]: reservations and writes go to the engine thread in order. A
/// reservation's answer comes back between engine steps ([`Reserved::Later`]); the receiver's
/// actor does not wait for it.
pub struct EngineSink {
    engine: EngineHandle,
}

impl EngineSink {
    pub fn new(engine: EngineHandle) -> Self {
        Self { engine }
    }
}

impl KvSink for EngineSink {
    /// With the prompt, the engine reuses the blocks of its prefix cache that hold a prefix of
    /// it (pinned for the lease), and the ticket asks the prefill node for the rest only.
    fn reserve(&mut self, ask: Ask) -> Reserved {
        let refused = |e: cleave_engine::EngineError| KvTransferError::InvalidRequest {
            reason: format!("engine refused the reservation: {e}"),
        };
        let (engine, id) = (self.engine.clone(), ask.request_id);
        let answer: Pin<Box<dyn Future<Output = cleave_kv_transfer::Result<Grant>> + Send>> = match ask.prompt {
            Some(prompt) => {
                let prompt = prompt.to_vec();
                let first = match engine.reserve_import_prompt(id, prompt.clone()) {
                    Ok(rx) => rx,
                    Err(e) => return Reserved::Now(Err(sink_err(e))),
                };
                Box::pin(async move {
                    let again = || engine.reserve_import_prompt(id, prompt.clone());
                    match when_room(&engine, first, again).await {
                        Ok(g) => {
                            let cached_tokens = u32::try_from(g.cached_tokens).unwrap_or(0);
                            metrics::counter!(metric::HANDOFF_CACHED_TOKENS_TOTAL).increment(u64::from(cached_tokens));
                            Ok(Grant { blocks: g.blocks, cached_tokens })
                        }
                        Err(cleave_engine::EngineError::Stopped) => Err(KvTransferError::Closed { what: "engine" }),
                        Err(e) => Err(refused(e)),
                    }
                })
            }
            None => {
                let num_tokens = ask.num_tokens as usize;
                let first = match engine.reserve_import(id, num_tokens) {
                    Ok(rx) => rx,
                    Err(e) => return Reserved::Now(Err(sink_err(e))),
                };
                Box::pin(async move {
                    match when_room(&engine, first, || engine.reserve_import(id, num_tokens)).await {
                        Ok(blocks) => Ok(Grant::fresh(blocks)),
                        Err(cleave_engine::EngineError::Stopped) => Err(KvTransferError::Closed { what: "engine" }),
                        Err(e) => Err(refused(e)),
                    }
                })
            }
        };
        Reserved::Later(answer)
    }

    fn write(&mut self, w: &KvWrite) -> cleave_kv_transfer::Result<()> {
        // Applied on the engine thread in order, before the request is submitted. The reply is
        // not awaited (no task per chunk): a failed write leaves rows uncovered, which
        // `submit_imported` refuses with an error event naming them.
        drop(self.engine.import_kv(w.request_id, w.layer, w.token_start, w.k.clone(), w.v.clone()).map_err(sink_err)?);
        Ok(())
    }

    fn release(&mut self, request_id: RequestId, _blocks: &[u32]) {
        release_import(&self.engine, request_id);
    }
}

/// How long a handoff reservation waits for KV blocks before the node refuses it. The
/// coordinator routes a handoff only to a node whose last report had room, but reports are
/// 200 ms apart and running sequences grow (or come back after a preemption) meanwhile: rather
/// than fail the request, the reservation waits for streams to finish and free blocks (the
/// prefill node goes on computing; the ticket follows when the blocks are there).
pub const RESERVE_WAIT: Duration = Duration::from_secs(10);
/// How often a waiting reservation asks the engine again.
const RESERVE_RETRY: Duration = Duration::from_millis(20);

/// The answer to a reservation (`first`), asked again with `again` every [`RESERVE_RETRY`]
/// while the engine lacks free blocks (and could hold the request at all), for at most
/// [`RESERVE_WAIT`].
async fn when_room<T>(
    engine: &EngineHandle,
    first: tokio::sync::oneshot::Receiver<cleave_engine::Result<T>>,
    mut again: impl FnMut() -> cleave_engine::Result<tokio::sync::oneshot::Receiver<cleave_engine::Result<T>>>,
) -> cleave_engine::Result<T> {
    let deadline = Instant::now() + RESERVE_WAIT;
    let total = engine.info().kv_blocks_total;
    let mut rx = first;
    let mut waited = false;
    loop {
        match rx.await {
            Ok(Err(cleave_engine::EngineError::ImportRefused { need, .. }))
                if need <= total && Instant::now() < deadline =>
            {
                if !waited {
                    waited = true;
                    metrics::counter!(metric::RESERVATIONS_WAITED_TOTAL).increment(1);
                }
                tokio::time::sleep(RESERVE_RETRY).await;
                rx = again()?;
            }
            Ok(r) => return r,
            Err(_) => return Err(cleave_engine::EngineError::Stopped),
        }
    }
}

fn release_import(engine: &EngineHandle, request_id: RequestId) {
    if let Err(e) = engine.release_import(request_id) {
        tracing::warn!(%request_id, error = %e, "releasing a reservation failed (engine stopped?)");
    }
}

fn sink_err(e: cleave_engine::EngineError) -> KvTransferError {
    KvTransferError::Closed {
        what: if matches!(e, cleave_engine::EngineError::Stopped) { "engine" } else { "engine queue" },
    }
}

/// The decode side of a node: the KV receiver (always running, so that any node can be
/// switched to decode) and the handler of `DecodeRequest` streams.
pub struct Decoder {
    shared: Arc<Shared>,
    kv_addr: SocketAddr,
    /// Swaps the KV listener's certificate (rotation); None over plain TCP.
    kv_reloader: Option<cleave_net::Reloader>,
    /// Stops the receiver when the decoder is dropped.
    _receiver: ReceiverService,
}

impl Decoder {
    /// Binds the KV listener and starts the receiver.
    pub async fn start(engine: EngineHandle, cfg: DecodeConfig) -> Result<Self, NodeError> {
        let kv = Listener::bind(&cfg.net, cfg.kv_bind).await?;
        let kv_addr = kv.local_addr();
        let kv_reloader = kv.reloader();
        let layout = engine.info().kv_layout.clone();
        let transport = match cfg.net.kind {
            NetKind::Quic => TransportKind::Quic,
            NetKind::TcpTls => TransportKind::TcpTls,
            NetKind::TcpPlain => TransportKind::TcpPlain,
        };
        let advertise = cleave_net::advertised(kv_addr, cfg.kv_advertise, cfg.route_to);
        let mut rcfg = ReceiverConfig::new(layout, advertise, transport);
        rcfg.lease_ttl = cfg.lease_ttl;
        // Tickets name this node where links are authenticated: the sender checks the name.
        rcfg.name =
            cfg.net.identity.as_ref().filter(|_| cfg.net.kind != NetKind::TcpPlain).map(|i| i.name().to_string());
        #[cfg(feature = "rdma")]
        let receiver = match &cfg.rdma {
            None => ReceiverService::spawn(rcfg, EngineSink { engine: engine.clone() }, Some(kv)),
            Some(r) => {
                if cfg.net.kind != NetKind::Quic {
                    return Err(NodeError::Setup("RDMA needs QUIC for its control streams".into()));
                }
                rcfg.transport = TransportKind::Rdma;
                let sink = LandingSink::new(engine.clone(), r.pool.clone());
                ReceiverService::spawn_rdma(rcfg, sink, Some(kv), r.receive.clone())
            }
        };
        #[cfg(not(feature = "rdma"))]
        let receiver = ReceiverService::spawn(rcfg, EngineSink { engine: engine.clone() }, Some(kv));
        let shared = Arc::new(Shared { engine, receiver: receiver.handle().clone(), cfg });
        Ok(Self { shared, kv_addr: advertise, kv_reloader, _receiver: receiver })
    }

    /// Where prefill nodes push KV (the advertised address: what tickets carry).
    pub fn kv_addr(&self) -> SocketAddr {
        self.kv_addr
    }

    /// Swaps the certificate the KV listener presents to new connections (a rotated node
    /// certificate); None over plain TCP.
    pub fn kv_reloader(&self) -> Option<cleave_net::Reloader> {
        self.kv_reloader.clone()
    }

    /// Serves one request: prefills locally or receives its KV, then streams its tokens until
    /// the last one, a `Cancel`, or the stream closing.
    pub async fn serve(&self, req: DecodeRequest, s: &mut DuplexStream) {
        let span = tracing::info_span!("decode", request_id = %req.work.id, local = req.local_prefill);
        serve_request(req, s, &self.shared).instrument(span).await
    }
}

struct Shared {
    engine: EngineHandle,
    receiver: ReceiverHandle,
    cfg: DecodeConfig,
}

impl Shared {
    /// Gives a completed lease's landing blocks back (RDMA) when its request goes no further.
    fn free_landing(&self, blocks: &[u32]) {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.cfg.rdma {
            r.pool.free_request(blocks);
        }
        let _ = blocks;
    }
}

async fn serve_request(req: DecodeRequest, s: &mut DuplexStream, shared: &Shared) {
    let id = req.work.id;
    let prompt_tokens = req.work.prompt.len() as u32;
    if req.work.params.constraint.is_some() {
        shared.engine.prepare_constraints().await;
    }
    // One reader for the request's life: it keeps a message read halfway when a `select!`
    // below drops its call.
    let mut rx = MsgReader::new(&mut s.recv);
    let stream = if req.local_prefill { local(shared, req) } else { remote(shared, req, &mut s.send, &mut rx).await };
    match stream {
        Ok(Some(ts)) => forward(ts, &mut s.send, &mut rx).await,
        Ok(None) => {}
        Err(e) => {
            let ev = TokenEvent::failed(id, prompt_tokens, 0, e.to_string());
            let _ = write_msg(&mut s.send, &ControlMsg::Token(ev)).await;
        }
    }
}

fn engine_request(w: cleave_protocol::control::Work) -> EngineRequest {
    EngineRequest { id: w.id, prompt: w.prompt, params: w.params, stop: w.stop }
}

/// Prefills here. A migrated stream resumes: its tokens already sent extend the prompt, count
/// toward `max_tokens` and are not sent again; with the request's seed, sampling continues the
/// same random stream.
fn local(shared: &Shared, req: DecodeRequest) -> Result<Option<TokenStream>, NodeError> {
    let generated = req.generated;
    let ereq = engine_request(req.work);
    let path = if generated.is_empty() { "local" } else { "resumed" };
    metrics::counter!(metric::REQUESTS_TOTAL, "path" => path).increment(1);
    let ts = if generated.is_empty() {
        shared.engine.submit(ereq)
    } else {
        shared.engine.submit_resumed(ereq, generated, None)
    };
    Ok(Some(ts?))
}

/// Leases blocks, answers the ticket, waits for the KV (or a cancel), then starts decoding: the
/// shell of [`wait::KvWait`], which decides what each outcome means.
async fn remote(
    shared: &Shared,
    req: DecodeRequest,
    send: &mut SendHalf,
    rx: &mut MsgReader<&mut RecvHalf>,
) -> Result<Option<TokenStream>, NodeError> {
    let id = req.work.id;
    let started = Instant::now();
    let prompt: Arc<[u32]> = req.work.prompt.as_slice().into();
    let mut m = KvWait::new(started);
    let (mut ticket, done, mut actions) =
        match shared.receiver.reserve_prompt(id, prompt, Some(shared.cfg.lease_ttl)).await {
            Ok(Reservation { ticket, done }) => {
                let reserve_us = started.elapsed().as_micros() as u64;
                tracing::debug!(lease = %ticket.lease_id, reserve_us, "leased");
                (Some(ticket), Some(done), m.handle(Instant::now(), Event::Reserved(Ok(()))))
            }
            Err(e) => (None, None, m.handle(Instant::now(), Event::Reserved(Err(e)))),
        };
    let lease = ticket.as_ref().map(|t| t.lease_id);
    let limit = shared.cfg.lease_ttl + Duration::from_secs(1);
    let wait = async move {
        match done {
            Some(done) => done.wait(limit).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(wait);
    loop {
        let mut answer = None;
        for a in actions {
            match a {
                Action::SendTicket => {
                    let Some(t) = ticket.take() else { continue };
                    answer = Some(match write_msg(send, &ControlMsg::Ticket(t)).await {
                        Ok(()) => Event::TicketSent,
                        Err(error) => {
                            tracing::warn!(%error, "sending the ticket failed");
                            Event::TicketNotSent
                        }
                    });
                }
                Action::CancelLease { release_completed } => {
                    if let Some(lease) = lease {
                        let _ = shared.receiver.cancel(lease).await;
                    }
                    // A lease that completed meanwhile comes back through its waiter.
                    if release_completed {
                        if let Ok(c) = (&mut wait).await {
                            shared.free_landing(&c.blocks);
                            let _ = shared.engine.release_import(c.request_id);
                        }
                    }
                }
                Action::Fail(e) => return Err(e),
                Action::Start(c) => return start(shared, req.work, c, started),
                Action::Record(metric) => record(metric),
                Action::Finish => return Ok(None),
            }
        }
        let event = match answer {
            Some(ev) => ev,
            None => tokio::select! {
                r = &mut wait => Event::Landed(r),
                msg = rx.next() => match msg {
                    Ok(Some(msg)) => Event::Message(Box::new(msg)),
                    Ok(None) => Event::Lost(None),
                    Err(e) => Event::Lost(Some(e)),
                },
            },
        };
        actions = m.handle(Instant::now(), event);
    }
}

/// Submits a request whose KV landed (over RDMA, after moving it into the engine). On an error
/// the command never reached the engine: the blocks are given back here.
fn start(
    shared: &Shared,
    work: cleave_protocol::control::Work,
    completed: cleave_kv_transfer::Completed,
    started: Instant,
) -> Result<Option<TokenStream>, NodeError> {
    let id = work.id;
    #[cfg(feature = "rdma")]
    if let Some(r) = &shared.cfg.rdma {
        let num_tokens = work.prompt.len() as u32;
        if let Err(e) = land_into_engine(&shared.engine, &r.pool, id, &completed.blocks, num_tokens) {
            let _ = shared.engine.release_import(id);
            return Err(NodeError::Landing(Box::new(e)));
        }
    }
    tracing::debug!(wait_us = started.elapsed().as_micros() as u64, "kv complete");
    let start = ImportStart { first_token: completed.first_token, sampler_seed: None, cached_tokens: 0 };
    shared.engine.submit_imported(engine_request(work), start).map(Some).map_err(|e| {
        let _ = shared.engine.release_import(id);
        e.into()
    })
}

fn record(m: Metric) {
    match m {
        Metric::RemoteRequest => metrics::counter!(metric::REQUESTS_TOTAL, "path" => "remote").increment(1),
        Metric::Reservation(d) => metrics::histogram!(metric::RESERVATION_SECONDS).record(d.as_secs_f64()),
        Metric::KvWait(d) => metrics::histogram!(metric::KV_WAIT_SECONDS).record(d.as_secs_f64()),
        Metric::HandoffFailure => metrics::counter!(metric::HANDOFF_FAILURES_TOTAL).increment(1),
    }
}

/// Streams a request's events to the coordinator until the final one, a Cancel, or the stream
/// closing (dropping `ts` cancels the request in the engine).
async fn forward(mut ts: TokenStream, send: &mut SendHalf, rx: &mut MsgReader<&mut RecvHalf>) {
    loop {
        tokio::select! {
            ev = ts.next() => {
                let Some(ev) = ev else { return };
                let last = ev.finish_reason.is_some();
                if write_msg(send, &ControlMsg::Token(ev)).await.is_err() || last {
                    return;
                }
            }
            m = rx.next() => match m {
                Ok(Some(ControlMsg::Cancel(_))) | Ok(None) | Err(_) => return,
                Ok(Some(_)) => {}
            },
        }
    }
}
