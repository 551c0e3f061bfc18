//! The receiver actor: one task per node owns the [`Receiver`] state machine and the
//! [`KvSink`]; everything else talks to it through a bounded command channel with `oneshot`
//! replies.
//!
//! Tasks and channels:
//! - the actor: commands in (reserve, cancel, stats, new stream, frames), lease timer;
//! - per accepted stream, a reader (frames -> actor, bounded: a slow pool slows the sender)
//!   and a writer (control frames from the actor, bounded; a stream that does not read its
//!   control frames is closed);
//! - optionally an accept loop feeding streams from a [`Listener`].
//!
//! Every wait is bounded: reads by `stream_idle_timeout`, writes by `write_timeout`, leases by
//! their ttl, handle calls by `command_timeout`. Dropping the [`ReceiverService`] stops all of
//! them (the node died: its streams close, senders see the loss).
//!
//! A payload path that needs more than the streams (RDMA: link setup, link completions, blocks
//! held until no write can land) is a [`RecvPath`] the actor holds and polls
//! ([`ReceiverService::spawn_with_path`]); the actor carries out what it reports and hands it
//! what the state machine says of linked leases (`Effect::Bind`, whose answer, the lease's
//! payload, goes back to the state machine; `Effect::Expect`; `Effect::Released` naming a link
//! tag), and knows nothing of links itself. Without one, an `Open` naming a link and a link
//! offer are refused.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cleave_protocol::{HandoffTicket, KvLayout, LeaseId, RequestId, TransportKind, HANDOFF_VERSION};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout, Instant as TokioInstant};

use crate::frame::{read_frame_recycling, write_control, Control, Frame, Limits};
use crate::metrics as m;
use crate::payload::{PathOutput, RecvPath};
use crate::receiver::{DropReason, Effect, LeaseSpec, Receiver, ReceiverStats, StreamId};
use crate::sink::{Ask, Grant, KvSink, Reserved};
use crate::transport::{BoxFuture, FramePipe, Transport};
use crate::{KvTransferError, Result};
use cleave_net::{DuplexStream, Listener, PeerInfo, RecvHalf, SendHalf};

/// Settings of a receiver.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// The layout of this node's KV pool; senders with any other are refused.
    pub layout: KvLayout,
    /// The address put in tickets (where the listener is reachable).
    pub advertise_addr: SocketAddr,
    /// The transport put in tickets.
    pub transport: TransportKind,
    /// Default lease lifetime.
    pub lease_ttl: Duration,
    /// Capacity of the command channel (frames from all streams share it).
    pub command_queue: usize,
    /// Bound on a handle call (the actor answers at once unless overloaded).
    pub command_timeout: Duration,
    /// A stream that sends nothing for this long is closed.
    pub stream_idle_timeout: Duration,
    /// Bound on writing one control frame.
    pub write_timeout: Duration,
    /// Largest chunk payload accepted (K and V together).
    pub max_payload: usize,
    /// The name in this node's certificate, put in tickets so that a sender can tell it is
    /// talking to this node ([`crate::transport::check_receiver`]). None where links are not
    /// authenticated.
    pub name: Option<String>,
}

impl ReceiverConfig {
    pub fn new(layout: KvLayout, advertise_addr: SocketAddr, transport: TransportKind) -> Self {
        Self {
            layout,
            advertise_addr,
            transport,
            lease_ttl: Duration::from_secs(120),
            command_queue: 256,
            command_timeout: Duration::from_secs(10),
            stream_idle_timeout: Duration::from_secs(120),
            write_timeout: Duration::from_secs(10),
            max_payload: crate::frame::DEFAULT_MAX_PAYLOAD,
            name: None,
        }
    }
}

/// A lease that completed: its blocks now belong to the decode request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub lease: LeaseId,
    pub request_id: RequestId,
    pub blocks: Vec<u32>,
    pub first_token: u32,
}

/// Resolves when the lease completes or ends.
#[derive(Debug)]
pub struct LeaseWaiter {
    lease: LeaseId,
    rx: oneshot::Receiver<Result<Completed>>,
}

impl LeaseWaiter {
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// Waits for the outcome at most `limit` (the lease's own expiry ends it sooner or later
    /// anyway; this bounds the caller).
    pub async fn wait(self, limit: Duration) -> Result<Completed> {
        match timeout(limit, self.rx).await {
            Err(_) => Err(KvTransferError::Timeout {
                what: format!("handoff of {}", self.lease),
                ms: limit.as_millis() as u64,
            }),
            Ok(Err(_)) => Err(KvTransferError::Closed { what: "kv receiver" }),
            Ok(Ok(r)) => r,
        }
    }
}

/// A granted reservation: the ticket for the sender and the waiter for the decode node.
#[derive(Debug)]
pub struct Reservation {
    pub ticket: HandoffTicket,
    pub done: LeaseWaiter,
}

enum Cmd {
    Reserve {
        request_id: RequestId,
        num_tokens: u32,
        prompt: Option<Arc<[u32]>>,
        ttl: Option<Duration>,
        reply: oneshot::Sender<Result<Reservation>>,
    },
    /// The pool's later answer to a `Reserve` ([`crate::sink::Reserved::Later`]).
    Reserved {
        request_id: RequestId,
        num_tokens: u32,
        ttl: Option<Duration>,
        grant: Result<Grant>,
        reply: oneshot::Sender<Result<Reservation>>,
    },
    Cancel {
        lease: LeaseId,
        reply: oneshot::Sender<bool>,
    },
    Stats {
        reply: oneshot::Sender<ReceiverStats>,
    },
    Stream {
        stream: DuplexStream,
        peer: Option<PeerInfo>,
    },
    Frames {
        from_sender: mpsc::Receiver<Frame>,
        to_sender: mpsc::Sender<Frame>,
    },
    Frame {
        stream: StreamId,
        item: Result<Option<Frame>>,
    },
}

/// Cheap, cloneable access to a receiver actor.
#[derive(Clone)]
pub struct ReceiverHandle {
    tx: mpsc::Sender<Cmd>,
    command_timeout: Duration,
}

impl ReceiverHandle {
    async fn call<T>(&self, what: &'static str, make: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        let ms = self.command_timeout.as_millis() as u64;
        let sent = timeout(self.command_timeout, self.tx.send(make(reply))).await;
        match sent {
            Err(_) => return Err(KvTransferError::Timeout { what: format!("kv receiver queue ({what})"), ms }),
            Ok(Err(_)) => return Err(KvTransferError::Closed { what: "kv receiver" }),
            Ok(Ok(())) => {}
        }
        match timeout(self.command_timeout, rx).await {
            Err(_) => Err(KvTransferError::Timeout { what: format!("kv receiver reply ({what})"), ms }),
            Ok(Err(_)) => Err(KvTransferError::Closed { what: "kv receiver" }),
            Ok(Ok(v)) => Ok(v),
        }
    }

    /// Reserves blocks for `num_tokens` tokens of a request and returns the ticket. Refused up
    /// front ([`KvTransferError::OutOfBlocks`]) when the pool cannot hold them.
    pub async fn reserve(&self, request_id: RequestId, num_tokens: u32, ttl: Option<Duration>) -> Result<Reservation> {
        self.reserve_inner(request_id, num_tokens, None, ttl).await
    }

    /// [`ReceiverHandle::reserve`] for the K and V of `prompt`: the pool may grant blocks that
    /// already hold a prefix of it (its prefix cache), and the ticket then asks the sender for
    /// the rest only ([`HandoffTicket::cached_tokens`]).
    pub async fn reserve_prompt(
        &self,
        request_id: RequestId,
        prompt: Arc<[u32]>,
        ttl: Option<Duration>,
    ) -> Result<Reservation> {
        let num_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        self.reserve_inner(request_id, num_tokens, Some(prompt), ttl).await
    }

    async fn reserve_inner(
        &self,
        request_id: RequestId,
        num_tokens: u32,
        prompt: Option<Arc<[u32]>>,
        ttl: Option<Duration>,
    ) -> Result<Reservation> {
        let t0 = std::time::Instant::now();
        let r = self
            .call("reserve", |reply| Cmd::Reserve { request_id, num_tokens, prompt, ttl, reply })
            .await
            .and_then(|r| r);
        match &r {
            Ok(_) => metrics::histogram!(m::RESERVATION_WAIT_SECONDS).record(t0.elapsed().as_secs_f64()),
            Err(e) => metrics::counter!(m::RESERVATIONS_REFUSED_TOTAL, "cause" => m::cause(e)).increment(1),
        }
        r
    }

    /// Cancels a lease (the request was cancelled): its blocks go back to the pool, its sender
    /// gets an abort. Returns false when the lease had already ended.
    pub async fn cancel(&self, lease: LeaseId) -> Result<bool> {
        self.call("cancel", |reply| Cmd::Cancel { lease, reply }).await
    }

    pub async fn stats(&self) -> Result<ReceiverStats> {
        self.call("stats", |reply| Cmd::Stats { reply }).await
    }

    /// Hands an accepted stream to the receiver.
    pub async fn attach(&self, stream: DuplexStream, peer: Option<PeerInfo>) -> Result<()> {
        let ms = self.command_timeout.as_millis() as u64;
        match timeout(self.command_timeout, self.tx.send(Cmd::Stream { stream, peer })).await {
            Err(_) => Err(KvTransferError::Timeout { what: "kv receiver queue (attach)".into(), ms }),
            Ok(Err(_)) => Err(KvTransferError::Closed { what: "kv receiver" }),
            Ok(Ok(())) => Ok(()),
        }
    }

    /// Hands an in-process frame pipe to the receiver.
    async fn attach_frames(&self, from_sender: mpsc::Receiver<Frame>, to_sender: mpsc::Sender<Frame>) -> Result<()> {
        let ms = self.command_timeout.as_millis() as u64;
        match timeout(self.command_timeout, self.tx.send(Cmd::Frames { from_sender, to_sender })).await {
            Err(_) => Err(KvTransferError::Timeout { what: "kv receiver queue (attach)".into(), ms }),
            Ok(Err(_)) => Err(KvTransferError::Closed { what: "kv receiver" }),
            Ok(Ok(())) => Ok(()),
        }
    }

    /// A transport for a sender in the same process: frames are handed over whole (the
    /// receiver's copy into its blocks is the only copy); raw byte streams (for tests) are
    /// in-memory pipes.
    pub fn in_process(&self) -> InProcessTransport {
        InProcessTransport { handle: self.clone(), pipe_bytes: 4 << 20 }
    }
}

/// In-process transport: a transfer's streams are channels of whole frames handed to the
/// receiver directly (payload `Bytes` moved, not copied; the receiver's write into its blocks is
/// the one memory copy). `open` still gives byte streams ([`tokio::io::duplex`] pipes), for
/// tests that speak raw frames.
#[derive(Clone)]
pub struct InProcessTransport {
    handle: ReceiverHandle,
    pipe_bytes: usize,
}

impl Transport for InProcessTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::InProcess
    }

    fn open(&self, _peer: SocketAddr) -> BoxFuture<'_, Result<(DuplexStream, Option<PeerInfo>)>> {
        Box::pin(async move {
            let (a, b) = tokio::io::duplex(self.pipe_bytes);
            self.handle.attach(crate::transport::duplex_from(b), None).await?;
            Ok((crate::transport::duplex_from(a), None))
        })
    }

    fn open_frames(&self, _peer: SocketAddr) -> Option<BoxFuture<'_, Result<FramePipe>>> {
        Some(Box::pin(async move {
            let (to_receiver, from_sender) = mpsc::channel(16);
            let (to_sender, from_receiver) = mpsc::channel(16);
            self.handle.attach_frames(from_sender, to_sender).await?;
            Ok(FramePipe { send: to_receiver, recv: from_receiver })
        }))
    }
}

/// Aborts a task when dropped.
pub(crate) struct AbortOnDrop<T>(pub(crate) JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A running receiver. Dropping it stops the actor, its streams and its accept loop (as if the
/// node died).
pub struct ReceiverService {
    handle: ReceiverHandle,
    _actor: AbortOnDrop<()>,
    _accept: Option<AcceptLoop>,
}

struct AcceptLoop {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Drop for AcceptLoop {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ReceiverService {
    /// Starts a receiver over `sink`, accepting streams from `listener` when given.
    pub fn spawn<S: KvSink>(cfg: ReceiverConfig, sink: S, listener: Option<Listener>) -> Self {
        Self::start(cfg, sink, listener, None)
    }

    /// Like [`ReceiverService::spawn`], with a payload path's receiving side (`spawn_rdma`, in
    /// `rdma::handoff`, gives the RDMA one).
    pub fn spawn_with_path<S: KvSink>(
        cfg: ReceiverConfig,
        sink: S,
        listener: Option<Listener>,
        path: Box<dyn RecvPath>,
    ) -> Self {
        Self::start(cfg, sink, listener, Some(path))
    }

    fn start<S: KvSink>(
        cfg: ReceiverConfig,
        sink: S,
        listener: Option<Listener>,
        path: Option<Box<dyn RecvPath>>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(cfg.command_queue.max(1));
        let handle = ReceiverHandle { tx: tx.clone(), command_timeout: cfg.command_timeout };
        let base = RandomState::new().build_hasher().finish() >> 1;
        let actor = Actor {
            sm: Receiver::new(cfg.layout.clone(), base),
            sink,
            tx,
            limits: Limits { max_payload: cfg.max_payload, layout: Some(cfg.layout.clone()) },
            cfg,
            waiters: HashMap::new(),
            streams: HashMap::new(),
            next_stream: 1,
            path,
        };
        let actor = AbortOnDrop(tokio::spawn(actor.run(rx)));
        let accept = listener.map(|mut l| {
            let h = handle.clone();
            let (stop, mut stopped) = oneshot::channel::<()>();
            let task = tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = &mut stopped => break,
                        r = l.accept() => match r {
                            None => return,
                            Some(Ok((s, peer))) if !may_send_kv(&peer) => {
                                tracing::warn!(peer = %peer.addr, name = ?peer.name, roles = ?peer.roles, "kv stream from a peer without the prefill role refused");
                                metrics::counter!(m::STREAMS_REFUSED_TOTAL).increment(1);
                                drop(s);
                            }
                            Some(Ok((s, peer))) => {
                                if h.attach(s, Some(peer)).await.is_err() {
                                    break;
                                }
                            }
                            Some(Err(e)) => tracing::warn!(error = %e, "kv receiver: accept failed"),
                        },
                    }
                }
                l.shutdown().await;
            });
            AcceptLoop { stop, task }
        });
        Self { handle, _actor: actor, _accept: accept }
    }

    pub fn handle(&self) -> &ReceiverHandle {
        &self.handle
    }

    /// Stops like a restart: stops accepting, closes the listener so its address can be bound
    /// again (waits at most `limit` for that), then stops the actor and every stream.
    pub async fn shutdown(mut self, limit: Duration) {
        if let Some(mut a) = self._accept.take() {
            let (stop, _) = oneshot::channel();
            let stop = std::mem::replace(&mut a.stop, stop);
            let _ = stop.send(());
            let _ = timeout(limit, &mut a.task).await;
        }
    }
}

/// Whether `peer` may push KV here: KV comes from prefill work, so over an authenticated link
/// the certificate must allow the prefill role (a decode-only or coordinator certificate may
/// not write into this node's blocks). Plain TCP passes: the operator declared it trusted.
fn may_send_kv(peer: &PeerInfo) -> bool {
    peer.allows(cleave_net::tls::Roles::PREFILL)
}

/// A stream's tasks. The writer task is detached: it ends once `writer` is dropped and what
/// was queued is written (each write bounded), so an Abort still reaches the peer.
struct StreamTasks {
    writer: mpsc::Sender<Control>,
    /// The peer's certificate name (None in-process and over plain TCP), for the payload path:
    /// an RDMA link serves only `Open`s from the peer that set it up.
    peer: Option<String>,
    _reader: AbortOnDrop<()>,
}

struct Actor<S> {
    /// The receiving side of a payload path beyond the streams (RDMA links), when it has one.
    path: Option<Box<dyn RecvPath>>,
    sm: Receiver,
    sink: S,
    tx: mpsc::Sender<Cmd>,
    cfg: ReceiverConfig,
    limits: Limits,
    waiters: HashMap<LeaseId, oneshot::Sender<Result<Completed>>>,
    streams: HashMap<StreamId, StreamTasks>,
    next_stream: StreamId,
}

fn now() -> std::time::Instant {
    TokioInstant::now().into_std()
}

impl<S: KvSink> Actor<S> {
    async fn run(mut self, mut rx: mpsc::Receiver<Cmd>) {
        loop {
            let mut deadline = self.sm.next_deadline();
            if let Some(poll) = self.path.as_ref().and_then(|p| p.next_poll(now())) {
                deadline = Some(deadline.map_or(poll, |d| d.min(poll)));
            }
            let timer = async move {
                match deadline {
                    Some(d) => sleep_until(TokioInstant::from_std(d)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(cmd) => {
                        self.command(cmd);
                        metrics::gauge!(m::LEASED_BLOCKS).set(self.reserved_blocks() as f64);
                    }
                    None => break,
                },
                () = timer => {
                    let fx = self.sm.poll_expired(now());
                    self.apply(fx);
                    if let Some(path) = self.path.as_mut() {
                        let out = path.poll(now());
                        let fx = self.path_effects(out);
                        self.apply(fx);
                    }
                    metrics::gauge!(m::LEASED_BLOCKS).set(self.reserved_blocks() as f64);
                }
            }
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Reserve { request_id, num_tokens, prompt, ttl, reply } => {
                self.reserve(request_id, num_tokens, prompt, ttl, reply)
            }
            Cmd::Reserved { request_id, num_tokens, ttl, grant, reply } => {
                if reply.is_closed() {
                    // Nobody waits for this reservation any more (the request went away while
                    // the pool made room): its blocks go back now, not at a lease's expiry.
                    if let Ok(g) = grant {
                        self.sink.release(request_id, &g.blocks);
                    }
                    return;
                }
                let r = grant.and_then(|grant| self.open_lease(request_id, num_tokens, ttl, grant));
                let _ = reply.send(r);
            }
            Cmd::Cancel { lease, reply } => {
                let fx = self.sm.cancel(lease);
                let _ = reply.send(!fx.is_empty());
                self.apply(fx);
            }
            Cmd::Stats { reply } => {
                let stats = ReceiverStats { reserved_blocks: self.reserved_blocks(), ..self.sm.stats() };
                let _ = reply.send(stats);
            }
            Cmd::Stream { stream, peer } => self.add_stream(stream, peer),
            Cmd::Frames { from_sender, to_sender } => self.add_frames(from_sender, to_sender),
            Cmd::Frame { stream, item } => {
                let item = match self.path.as_mut() {
                    Some(path) => {
                        let peer = self.streams.get(&stream).and_then(|t| t.peer.as_deref());
                        match path.on_frame(stream, item, peer, now()) {
                            Ok(out) => {
                                let fx = self.path_effects(out);
                                self.apply(fx);
                                return;
                            }
                            Err(item) => item,
                        }
                    }
                    None => item,
                };
                if let Ok(Some(Frame::Control(Control::LinkOffer { .. }))) = &item {
                    // This receiver takes no RDMA links (a path that does took it above).
                    let reason = "this receiver does not take RDMA links".to_string();
                    let abort =
                        Control::Abort { lease_id: LeaseId(0), code: crate::frame::AbortCode::Internal, reason };
                    self.apply(vec![Effect::Send { stream, msg: abort }, Effect::Close { stream }]);
                    let _ = self.sm.on_stream_closed(now(), stream);
                    return;
                }
                let fx = match item {
                    Ok(Some(frame)) => self.sm.on_frame(now(), stream, frame),
                    Ok(None) => self.sm.on_stream_closed(now(), stream),
                    Err(e) => self.sm.on_stream_error(now(), stream, e),
                };
                self.apply(fx);
            }
        }
    }

    /// Blocks out of the pool for leases: live ones, and released ones the payload path holds
    /// back (a write may still land).
    fn reserved_blocks(&self) -> usize {
        self.sm.reserved_blocks() + self.path.as_ref().map_or(0, |p| p.held_blocks())
    }

    /// Asks the pool for blocks; an answer now opens the lease at once, a later one comes back
    /// as [`Cmd::Reserved`] while the actor goes on (the pool's thread may be mid-step).
    ///
    /// Should the actor be gone when a later answer arrives, its blocks are not released here:
    /// the receiver and its pool stop together (a node's shutdown).
    fn reserve(
        &mut self,
        request_id: RequestId,
        num_tokens: u32,
        prompt: Option<Arc<[u32]>>,
        ttl: Option<Duration>,
        reply: oneshot::Sender<Result<Reservation>>,
    ) {
        if num_tokens == 0 {
            let _ = reply.send(Err(KvTransferError::InvalidRequest { reason: "a handoff of zero tokens".into() }));
            return;
        }
        let num_blocks = HandoffTicket::blocks_for(num_tokens, self.cfg.layout.block_size);
        match self.sink.reserve(Ask { request_id, num_tokens, num_blocks, prompt }) {
            Reserved::Now(grant) => {
                let r = grant.and_then(|grant| self.open_lease(request_id, num_tokens, ttl, grant));
                let _ = reply.send(r);
            }
            Reserved::Later(answer) => {
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    let grant = answer.await;
                    let _ = tx.send(Cmd::Reserved { request_id, num_tokens, ttl, grant, reply }).await;
                });
            }
        }
    }

    /// A lease over blocks the pool granted; the blocks go back to the pool if it cannot open
    /// (a grant that does not fit the ask included).
    fn open_lease(
        &mut self,
        request_id: RequestId,
        num_tokens: u32,
        ttl: Option<Duration>,
        grant: Grant,
    ) -> Result<Reservation> {
        let ttl = ttl.unwrap_or(self.cfg.lease_ttl);
        let Grant { blocks, cached_tokens } = grant;
        let spec = LeaseSpec { request_id, blocks: blocks.clone(), num_tokens, cached_tokens, ttl };
        let lease = match self.sm.open_lease(now(), spec) {
            Ok(l) => l,
            Err(e) => {
                self.sink.release(request_id, &blocks);
                return Err(e);
            }
        };
        let (tx, rx) = oneshot::channel();
        self.waiters.insert(lease, tx);
        Ok(Reservation {
            ticket: HandoffTicket {
                version: HANDOFF_VERSION,
                request_id,
                lease_id: lease,
                receiver_addr: self.cfg.advertise_addr,
                transport: self.cfg.transport,
                layout: self.cfg.layout.clone(),
                block_ids: blocks,
                num_tokens,
                lease_ttl: ttl,
                receiver_name: self.cfg.name.clone(),
                cached_tokens,
            },
            done: LeaseWaiter { lease, rx },
        })
    }

    fn add_stream(&mut self, stream: DuplexStream, peer: Option<PeerInfo>) {
        let id = self.next_stream;
        self.next_stream += 1;
        tracing::debug!(stream = id, peer = ?peer.as_ref().map(|p| p.addr), "kv receiver: stream accepted");
        let peer_name = peer.and_then(|p| p.name);
        let DuplexStream { send, recv } = stream;
        let reader =
            tokio::spawn(read_loop(id, recv, self.limits.clone(), self.cfg.stream_idle_timeout, self.tx.clone()));
        let (wtx, wrx) = mpsc::channel(16);
        tokio::spawn(write_loop(send, wrx, self.cfg.write_timeout));
        self.streams.insert(id, StreamTasks { writer: wtx, peer: peer_name, _reader: AbortOnDrop(reader) });
        self.sm.stream_opened(id);
    }

    fn add_frames(&mut self, from_sender: mpsc::Receiver<Frame>, to_sender: mpsc::Sender<Frame>) {
        let id = self.next_stream;
        self.next_stream += 1;
        let reader = tokio::spawn(forward_frames(id, from_sender, self.cfg.stream_idle_timeout, self.tx.clone()));
        let (wtx, mut wrx) = mpsc::channel::<Control>(16);
        let limit = self.cfg.write_timeout;
        tokio::spawn(async move {
            while let Some(msg) = wrx.recv().await {
                if !matches!(timeout(limit, to_sender.send(Frame::Control(msg))).await, Ok(Ok(()))) {
                    return;
                }
            }
        });
        self.streams.insert(id, StreamTasks { writer: wtx, peer: None, _reader: AbortOnDrop(reader) });
        self.sm.stream_opened(id);
    }

    fn apply(&mut self, fx: Vec<Effect>) {
        let mut queue: std::collections::VecDeque<Effect> = fx.into();
        while let Some(e) = queue.pop_front() {
            match e {
                Effect::Write(w) => {
                    metrics::counter!(m::BYTES_TOTAL, "side" => "receiver", "transport" => m::transport_label(self.cfg.transport))
                        .increment((w.k.len() + w.v.len()) as u64);
                    if let Err(err) = self.sink.write(&w) {
                        queue.extend(self.sm.fail(w.lease, err));
                    }
                }
                Effect::Send { stream, msg } => {
                    if let Some(t) = self.streams.get(&stream) {
                        if t.writer.try_send(msg).is_err() {
                            tracing::warn!(stream, "kv receiver: control queue full or closed; closing stream");
                            self.close_stream(stream);
                        }
                    }
                }
                Effect::Close { stream } => self.close_stream(stream),
                Effect::Completed { lease, request_id, blocks, first_token } => {
                    tracing::debug!(%lease, %request_id, "kv receiver: handoff complete");
                    m::record_success("receiver", self.cfg.transport, None);
                    if let Some(w) = self.waiters.remove(&lease) {
                        let _ = w.send(Ok(Completed { lease, request_id, blocks, first_token }));
                    }
                }
                Effect::Released { lease, request_id, blocks, error, link } => {
                    tracing::warn!(%lease, %request_id, %error, "kv receiver: lease released");
                    m::record_failure("receiver", self.cfg.transport, &error);
                    let blocks = match (link, self.path.as_mut()) {
                        (Some(at), Some(path)) => {
                            let (now_free, out) = path.release(at, request_id, blocks, now());
                            queue.extend(self.path_effects(out));
                            now_free
                        }
                        _ => Some(blocks),
                    };
                    if let Some(blocks) = blocks {
                        self.sink.release(request_id, &blocks);
                    }
                    // After the release: a waiter that sees the error finds the blocks free
                    // (or, over a link, still counted reserved until no write can land).
                    if let Some(w) = self.waiters.remove(&lease) {
                        let _ = w.send(Err(error));
                    }
                }
                Effect::Bind { lease, link, stream, num_layers, deadline } => {
                    let peer = self.streams.get(&stream).and_then(|t| t.peer.as_deref());
                    let payload = match self.path.as_mut() {
                        Some(path) => path.bind(link, lease, num_layers, deadline, peer),
                        None => {
                            Err(KvTransferError::RdmaLink { link, reason: "this receiver takes no RDMA links".into() })
                        }
                    };
                    queue.extend(self.sm.bound(lease, stream, payload));
                }
                Effect::Expect { lease: _, expect } => {
                    if let Some(path) = self.path.as_mut() {
                        let out = path.expect(expect, now());
                        queue.extend(self.path_effects(out));
                    }
                }
                Effect::Dropped { stream, lease, layer, token_start, why } => {
                    tracing::debug!(stream, %lease, layer, token_start, ?why, "kv receiver: chunk dropped");
                    let reason = match why {
                        DropReason::Duplicate => "duplicate",
                        DropReason::Late => "late",
                    };
                    metrics::counter!(m::CHUNKS_DROPPED_TOTAL, "reason" => reason).increment(1);
                }
            }
        }
    }

    /// What the payload path reported, as state-machine effects (freeing safe blocks on the
    /// way, in order).
    fn path_effects(&mut self, out: Vec<PathOutput>) -> Vec<Effect> {
        let mut fx = Vec::new();
        for o in out {
            match o {
                PathOutput::Landed(lease) => {
                    let sink = &self.sink;
                    let before = self.sm.stats().bytes_written;
                    fx.extend(self.sm.landed(lease, |blocks, n| {
                        sink.landed_checksum(blocks, n.layer, n.token_start..n.token_start + n.token_count)
                    }));
                    let landed = self.sm.stats().bytes_written - before;
                    metrics::counter!(m::BYTES_TOTAL, "side" => "receiver", "transport" => m::transport_label(self.cfg.transport))
                        .increment(landed);
                }
                PathOutput::Failed(lease, err) => fx.extend(self.sm.fail(lease, err)),
                PathOutput::Free(request_id, blocks) => self.sink.release(request_id, &blocks),
                PathOutput::Send { stream, msg } => fx.push(Effect::Send { stream, msg }),
                PathOutput::Close(stream) => fx.push(Effect::Close { stream }),
                PathOutput::Forget(stream) => {
                    // Its Close is not ours: the stream stays open, as the path's.
                    let _ = self.sm.on_stream_closed(now(), stream);
                }
            }
        }
        fx
    }

    /// Stops a stream's reader now; its writer sends what is queued (an Abort) and shuts down.
    fn close_stream(&mut self, stream: StreamId) {
        self.streams.remove(&stream);
    }
}

async fn forward_frames(id: StreamId, mut rx: mpsc::Receiver<Frame>, idle: Duration, tx: mpsc::Sender<Cmd>) {
    loop {
        let item = match timeout(idle, rx.recv()).await {
            Err(_) => {
                Err(KvTransferError::Timeout { what: format!("a frame on stream {id}"), ms: idle.as_millis() as u64 })
            }
            Ok(f) => Ok(f),
        };
        let last = !matches!(item, Ok(Some(_)));
        if tx.send(Cmd::Frame { stream: id, item }).await.is_err() || last {
            return;
        }
    }
}

/// Reads a stream's frames for the actor. A stream silent for `idle` is an error, except an
/// RDMA link's stream (its first frame a `LinkOffer`): it is quiet by design while the link
/// carries transfers, and ends with its connection.
async fn read_loop(id: StreamId, mut recv: RecvHalf, limits: Limits, idle: Duration, tx: mpsc::Sender<Cmd>) {
    let mut buf = bytes::BytesMut::new();
    let mut idle = Some(idle);
    loop {
        let read = read_frame_recycling(&mut recv, &limits, &mut buf);
        let item = match idle {
            Some(limit) => match timeout(limit, read).await {
                Err(_) => Err(KvTransferError::Timeout {
                    what: format!("a frame on stream {id}"),
                    ms: limit.as_millis() as u64,
                }),
                Ok(r) => r,
            },
            None => read.await,
        };
        if let Ok(Some(Frame::Control(Control::LinkOffer { .. }))) = &item {
            idle = None;
        }
        let last = !matches!(item, Ok(Some(_)));
        if tx.send(Cmd::Frame { stream: id, item }).await.is_err() || last {
            return;
        }
    }
}

async fn write_loop(mut send: SendHalf, mut rx: mpsc::Receiver<Control>, limit: Duration) {
    while let Some(msg) = rx.recv().await {
        match timeout(limit, write_control(&mut send, &msg)).await {
            Ok(Ok(())) => {}
            _ => return,
        }
    }
    let _ = timeout(limit, send.shutdown()).await;
}
