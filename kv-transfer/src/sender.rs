//! The sender: pushes one request's KV cache into the blocks a ticket leased, layer by layer as
//! prefill produces it.
//!
//! Flow: [`KvSender::start`] checks the ticket against the local layout (a mismatch is refused
//! before any byte moves), opens `streams` streams, sends `Open` on each and waits for every
//! `Accept`. The compute thread then enqueues [`LayerChunk`]s through a [`ChunkSender`]
//! (`blocking_send` from a plain thread, `send` from async code); layer `l` always goes on
//! stream `l % streams`, so each layer's chunks arrive in order. [`KvSender::finish`] flushes
//! every stream, sends `Complete` with the first sampled token and waits for the receiver's
//! `Ack`.
//!
//! Where the payload goes is the transfer's [`SendPath`] (from the transport, chosen by the
//! ticket; see [`crate::payload`]): chunk frames on the streams, or RDMA writes with notices on
//! one control stream. This module drives either the same way and holds no path's logic.
//!
//! Invariants:
//! - every wait is bounded (`open_timeout`, `io_timeout`, `ack_timeout`);
//! - dropping a [`KvSender`] before `finish` returns aborts its tasks and closes its streams;
//!   the receiver sees the streams end and frees the lease;
//! - a chunk is validated against the ticket (layer, token range, byte lengths) when it is
//!   enqueued, so a bad chunk fails at the caller, not at the receiver.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_protocol::{HandoffTicket, KvLayout, LeaseId, TransportKind, HANDOFF_VERSION};
use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;

use crate::actor::AbortOnDrop;
use crate::frame::{read_frame, run_bytes, ChunkHeader, Control, Frame, Limits, Open};
use crate::payload::{Accepted, PayloadWriter, SendPath, StreamOut};
use crate::receiver::layout_mismatch;
use crate::transport::{FramePipe, Transport};
use crate::{KvTransferError, Result};
use cleave_net::{DuplexStream, RecvHalf};

/// Settings of one transfer.
#[derive(Debug, Clone)]
pub struct SendConfig {
    /// Streams per transfer (clamped to `1..=num_layers`).
    pub streams: usize,
    /// Chunks queued per stream before `send` waits (backpressure on the compute thread).
    pub queue_depth: usize,
    /// Bound on opening the streams and getting every `Accept`.
    pub open_timeout: Duration,
    /// Bound on writing one chunk and on flushing.
    pub io_timeout: Duration,
    /// Bound on waiting for the receiver's `Ack` after `Complete`.
    pub ack_timeout: Duration,
}

impl Default for SendConfig {
    fn default() -> Self {
        Self {
            streams: 4,
            queue_depth: 16,
            open_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            ack_timeout: Duration::from_secs(30),
        }
    }
}

/// K and V of tokens `token_start..token_start + token_count` of one layer, token-major
/// `[token_count, num_kv_heads, head_dim]` in the layout's dtype, little-endian.
#[derive(Debug, Clone)]
pub struct LayerChunk {
    pub layer: u32,
    pub token_start: u32,
    pub token_count: u32,
    pub k: Bytes,
    pub v: Bytes,
}

/// What a finished transfer moved.
#[derive(Debug, Clone)]
pub struct TransferReport {
    pub lease: LeaseId,
    pub transport: TransportKind,
    pub streams: usize,
    pub chunks: u64,
    /// Payload bytes (K and V) moved.
    pub bytes: u64,
    /// From `start` to the receiver's `Ack`.
    pub elapsed: Duration,
}

impl TransferReport {
    pub fn throughput_bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

enum Item {
    Chunk(LayerChunk),
    Flush(oneshot::Sender<Result<(u64, u64)>>),
    Complete(u32, oneshot::Sender<Result<()>>),
}

/// Enqueues chunks of one transfer; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct ChunkSender {
    lease: LeaseId,
    layout: KvLayout,
    num_tokens: u32,
    /// The ticket's cached prefix: the receiver holds tokens below it, so they never travel.
    cached_tokens: u32,
    txs: Arc<[mpsc::Sender<Item>]>,
    /// Set when the [`KvSender`] is finished or dropped: later chunks fail at once.
    ended: Arc<AtomicBool>,
}

impl ChunkSender {
    fn check(&self, c: &LayerChunk) -> Result<usize> {
        if self.ended.load(Ordering::Acquire) {
            return Err(self.closed());
        }
        let bad = |reason: String| Err(KvTransferError::ChunkOutOfBounds { lease: self.lease, reason });
        if c.layer >= self.layout.num_layers {
            return bad(format!("layer {} of {}", c.layer, self.layout.num_layers));
        }
        if c.token_count == 0 || c.token_start as u64 + c.token_count as u64 > self.num_tokens as u64 {
            return bad(format!("tokens {}+{} of {}", c.token_start, c.token_count, self.num_tokens));
        }
        let want = run_bytes(&self.layout, c.token_count);
        if c.k.len() != want || c.v.len() != want {
            return bad(format!("k {} / v {} bytes, layout needs {want}", c.k.len(), c.v.len()));
        }
        Ok(c.layer as usize % self.txs.len())
    }

    /// The part of `c` the receiver lacks: `None` when the whole chunk lies in the cached
    /// prefix, else the chunk from the prefix's end on (a zero-copy slice of its bytes).
    fn uncached(&self, c: LayerChunk) -> Option<LayerChunk> {
        let end = c.token_start + c.token_count;
        if end <= self.cached_tokens {
            return None;
        }
        if c.token_start >= self.cached_tokens {
            return Some(c);
        }
        let skip = self.cached_tokens - c.token_start;
        let at = run_bytes(&self.layout, skip);
        Some(LayerChunk {
            layer: c.layer,
            token_start: self.cached_tokens,
            token_count: c.token_count - skip,
            k: c.k.slice(at..),
            v: c.v.slice(at..),
        })
    }

    fn closed(&self) -> KvTransferError {
        KvTransferError::Closed { what: "kv transfer (see finish() for the cause)" }
    }

    /// Enqueues a chunk, waiting while the stream's queue is full. The wait is bounded: a
    /// stream that cannot write fails its writer within `io_timeout`, which closes the queue.
    ///
    /// Tokens of the ticket's cached prefix are dropped here, checked but never sent (the
    /// engine exports a prompt's every token; only this side knows what the receiver holds).
    pub async fn send(&self, c: LayerChunk) -> Result<()> {
        let i = self.check(&c)?;
        let Some(c) = self.uncached(c) else { return Ok(()) };
        self.txs[i].send(Item::Chunk(c)).await.map_err(|_| self.closed())
    }

    /// Enqueues a chunk from a thread outside the runtime (the engine's compute thread),
    /// blocking while the stream's queue is full. Must not be called from async code.
    pub fn blocking_send(&self, c: LayerChunk) -> Result<()> {
        let i = self.check(&c)?;
        let Some(c) = self.uncached(c) else { return Ok(()) };
        self.txs[i].blocking_send(Item::Chunk(c)).map_err(|_| self.closed())
    }

    /// Enqueues a chunk without waiting; `Ok(false)` when the queue is full.
    pub fn try_send(&self, c: LayerChunk) -> Result<bool> {
        let i = self.check(&c)?;
        let Some(c) = self.uncached(c) else { return Ok(true) };
        match self.txs[i].try_send(Item::Chunk(c)) {
            Ok(()) => Ok(true),
            Err(mpsc::error::TrySendError::Full(_)) => Ok(false),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(self.closed()),
        }
    }
}

/// One transfer in flight. Drop it to abort.
pub struct KvSender {
    ticket: HandoffTicket,
    transport: TransportKind,
    cfg: SendConfig,
    chunks: ChunkSender,
    events: mpsc::Receiver<(usize, Result<Option<Frame>>)>,
    started: Instant,
    _tasks: Vec<AbortOnDrop<()>>,
    /// Declared after the tasks: they are aborted before the path lets go of the lease.
    path: Box<dyn SendPath>,
}

impl KvSender {
    /// Checks the ticket against `local` and opens the transfer's streams.
    pub async fn start(
        transport: &dyn Transport,
        ticket: &HandoffTicket,
        local: &KvLayout,
        cfg: &SendConfig,
    ) -> Result<Self> {
        let mut retry = false;
        let mut r = Self::start_inner(transport, ticket, local, cfg, &mut retry).await;
        if retry {
            // The path says a fresh one may succeed (RDMA: the receiver did not know our link,
            // it restarted or dropped it before we noticed, and kept the lease): once more.
            tracing::debug!(lease = %ticket.lease_id, error = ?r.as_ref().err(), "kv sender: starting again over a new path");
            r = Self::start_inner(transport, ticket, local, cfg, &mut false).await;
        }
        if let Err(e) = &r {
            crate::metrics::record_failure("sender", transport.kind(), e);
        }
        r
    }

    /// One start; `retry` is set when it failed in a way the path says a fresh path may not.
    async fn start_inner(
        transport: &dyn Transport,
        ticket: &HandoffTicket,
        local: &KvLayout,
        cfg: &SendConfig,
        retry: &mut bool,
    ) -> Result<Self> {
        if ticket.version != HANDOFF_VERSION {
            return Err(KvTransferError::VersionUnsupported { got: ticket.version, supported: HANDOFF_VERSION });
        }
        if let Some(err) = layout_mismatch(local, &ticket.layout) {
            return Err(err);
        }
        if !ticket.is_consistent() || ticket.num_tokens == 0 {
            return Err(KvTransferError::InvalidRequest {
                reason: format!("ticket of {} tokens with {} blocks", ticket.num_tokens, ticket.block_ids.len()),
            });
        }
        let started = Instant::now();
        let lease = ticket.lease_id;
        let open_ms = cfg.open_timeout.as_millis() as u64;
        let deadline = tokio::time::Instant::now() + cfg.open_timeout;
        let timed_out = |what: String| KvTransferError::Timeout { what, ms: open_ms };
        let path = tokio::time::timeout_at(deadline, transport.send_path(ticket.receiver_addr))
            .await
            .map_err(|_| timed_out(format!("setting up the payload path to {}", ticket.receiver_addr)))??;
        let link = path.link();
        let n = path.streams(cfg.streams.clamp(1, local.num_layers.max(1) as usize));
        let (etx, events) = mpsc::channel(4 * n + 4);
        let mut tasks = Vec::with_capacity(2 * n);
        let mut outs = Vec::with_capacity(n);
        for i in 0..n {
            let open = Control::Open(Open {
                request_id: ticket.request_id,
                lease_id: lease,
                layout: local.clone(),
                num_tokens: ticket.num_tokens,
                stream_index: i as u16,
                stream_count: n as u16,
                rdma_link: link,
            });
            let mut out = if let Some(pipe) = transport.open_frames(ticket.receiver_addr) {
                let FramePipe { send, recv } = tokio::time::timeout_at(deadline, pipe)
                    .await
                    .map_err(|_| timed_out(format!("opening stream {i} to {}", ticket.receiver_addr)))??;
                tasks.push(AbortOnDrop(tokio::spawn(forward_events(i, recv, etx.clone()))));
                StreamOut::frames(send)
            } else {
                let (DuplexStream { send, recv }, who) =
                    tokio::time::timeout_at(deadline, transport.open(ticket.receiver_addr))
                        .await
                        .map_err(|_| timed_out(format!("opening stream {i} to {}", ticket.receiver_addr)))??;
                crate::transport::check_receiver(ticket, who.as_ref())?;
                tasks.push(AbortOnDrop(tokio::spawn(read_events(i, recv, etx.clone()))));
                StreamOut::bytes(send)
            };
            tokio::time::timeout_at(deadline, out.control(open))
                .await
                .map_err(|_| timed_out(format!("sending Open on stream {i}")))??;
            outs.push(Some(out));
        }
        drop(etx);
        let mut this = Self {
            ticket: ticket.clone(),
            transport: transport.kind(),
            cfg: cfg.clone(),
            chunks: ChunkSender {
                lease,
                layout: local.clone(),
                num_tokens: ticket.num_tokens,
                cached_tokens: ticket.cached_tokens,
                txs: Arc::from(Vec::new()),
                ended: Arc::new(AtomicBool::new(false)),
            },
            events,
            started,
            _tasks: tasks,
            path,
        };
        let blocks: Arc<[u32]> = ticket.block_ids.clone().into();
        let mut writers: Vec<Option<Box<dyn PayloadWriter>>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let (i, accept) = match this.next_event(deadline, "Accept").await {
                Ok(ev) => ev,
                Err(e) => {
                    *retry = this.path.refused(&e);
                    return Err(e);
                }
            };
            let (Control::Accept { lease_id, rdma_tag }, Some(out)) = (&accept, outs[i].take()) else {
                return Err(unexpected(lease, &accept));
            };
            if *lease_id != lease {
                return Err(unexpected(lease, &accept));
            }
            let accepted = Accepted {
                lease,
                tag: *rdma_tag,
                blocks: blocks.clone(),
                num_layers: local.num_layers,
                expires: Instant::now() + ticket.lease_ttl,
                deadline,
                open_timeout: cfg.open_timeout,
            };
            writers[i] = Some(this.path.accepted(out, accepted).await?);
        }
        let mut txs = Vec::with_capacity(n);
        for w in writers.into_iter().flatten() {
            let (tx, rx) = mpsc::channel(cfg.queue_depth.max(1));
            this._tasks.push(AbortOnDrop(tokio::spawn(write_items(lease, w, rx, cfg.io_timeout))));
            txs.push(tx);
        }
        this.chunks.txs = Arc::from(txs);
        Ok(this)
    }

    pub fn lease(&self) -> LeaseId {
        self.ticket.lease_id
    }

    /// The enqueue side, to hand to the compute thread.
    pub fn chunks(&self) -> ChunkSender {
        self.chunks.clone()
    }

    /// Enqueues a chunk (see [`ChunkSender::send`]).
    pub async fn send(&self, c: LayerChunk) -> Result<()> {
        self.chunks.send(c).await
    }

    /// The next control frame from the receiver, with the stream it came on.
    async fn next_event(&mut self, deadline: tokio::time::Instant, what: &str) -> Result<(usize, Control)> {
        let lease = self.ticket.lease_id;
        let addr = self.ticket.receiver_addr;
        match tokio::time::timeout_at(deadline, self.events.recv()).await {
            Err(_) => Err(KvTransferError::Timeout { what: format!("{what} from {addr} for {lease}"), ms: 0 }),
            Ok(None) => Err(KvTransferError::ConnectionLost { addr, reason: "every stream ended".into() }),
            Ok(Some((_, Ok(Some(Frame::Control(Control::Abort { lease_id, code, reason })))))) => {
                Err(KvTransferError::PeerAborted { lease: lease_id, code: code.to_string(), reason })
            }
            Ok(Some((i, Ok(Some(Frame::Control(c)))))) => Ok((i, c)),
            Ok(Some((i, Ok(Some(Frame::Chunk { .. }))))) => {
                Err(KvTransferError::Protocol { reason: format!("receiver sent a chunk on stream {i}") })
            }
            Ok(Some((i, Ok(None)))) => {
                Err(KvTransferError::ConnectionLost { addr, reason: format!("stream {i} closed by the receiver") })
            }
            Ok(Some((i, Err(e)))) => Err(KvTransferError::ConnectionLost { addr, reason: format!("stream {i}: {e}") }),
        }
    }

    /// Flushes every stream, sends `Complete(first_token)` and waits for the `Ack`.
    pub async fn finish(self, first_token: u32) -> Result<TransferReport> {
        let kind = self.transport;
        let r = self.finish_inner(first_token).await;
        match &r {
            Ok(rep) => crate::metrics::record_success("sender", kind, Some((rep.bytes, rep.elapsed))),
            Err(e) => crate::metrics::record_failure("sender", kind, e),
        }
        r
    }

    async fn finish_inner(mut self, first_token: u32) -> Result<TransferReport> {
        let lease = self.ticket.lease_id;
        let io_deadline = tokio::time::Instant::now() + self.cfg.io_timeout;
        let mut bytes = 0;
        let mut chunks = 0;
        let txs = self.chunks.txs.clone();
        for tx in txs.iter() {
            let (reply, rx) = oneshot::channel();
            if tx.send(Item::Flush(reply)).await.is_err() {
                return Err(self.failure().await);
            }
            let (b, c) = tokio::select! {
                r = tokio::time::timeout_at(io_deadline, rx) => match r {
                    Err(_) => return Err(KvTransferError::Timeout { what: format!("flushing {lease}"), ms: self.cfg.io_timeout.as_millis() as u64 }),
                    Ok(Err(_)) => return Err(self.failure().await),
                    Ok(Ok(Err(e))) => return Err(self.explain(e).await),
                    Ok(Ok(Ok(r))) => r,
                },
                ev = self.next_event(io_deadline, "flush") => return Err(match ev { Ok((_, c)) => unexpected(lease, &c), Err(e) => e }),
            };
            bytes += b;
            chunks += c;
        }
        let (reply, rx) = oneshot::channel();
        if txs[0].send(Item::Complete(first_token, reply)).await.is_err() {
            return Err(self.failure().await);
        }
        match tokio::time::timeout_at(io_deadline, rx).await {
            Err(_) => {
                return Err(KvTransferError::Timeout {
                    what: format!("sending Complete for {lease}"),
                    ms: self.cfg.io_timeout.as_millis() as u64,
                })
            }
            Ok(Err(_)) => return Err(self.failure().await),
            Ok(Ok(Err(e))) => return Err(self.explain(e).await),
            Ok(Ok(Ok(()))) => {}
        }
        let ack_deadline = tokio::time::Instant::now() + self.cfg.ack_timeout;
        match self.next_event(ack_deadline, "Ack").await {
            Ok((_, Control::Ack { lease_id })) if lease_id == lease => self.path.acknowledged(),
            Ok((_, other)) => return Err(unexpected(lease, &other)),
            Err(KvTransferError::Timeout { what, .. }) => {
                return Err(KvTransferError::Timeout { what, ms: self.cfg.ack_timeout.as_millis() as u64 })
            }
            Err(e) => return Err(e),
        }
        Ok(TransferReport {
            lease,
            transport: self.transport,
            streams: txs.len(),
            chunks,
            bytes,
            elapsed: self.started.elapsed(),
        })
    }

    /// A local write failed: the receiver's Abort explains it better if one arrives soon.
    async fn explain(&mut self, local: KvTransferError) -> KvTransferError {
        match self.failure().await {
            e @ KvTransferError::PeerAborted { .. } => e,
            _ => local,
        }
    }

    /// Why a writer went away: the receiver's word if it sent one soon, else a lost connection.
    async fn failure(&mut self) -> KvTransferError {
        let soon = tokio::time::Instant::now() + Duration::from_millis(500).min(self.cfg.io_timeout);
        match self.next_event(soon, "abort reason").await {
            Err(e) => e,
            Ok((_, c)) => unexpected(self.ticket.lease_id, &c),
        }
    }
}

impl Drop for KvSender {
    fn drop(&mut self) {
        self.chunks.ended.store(true, Ordering::Release);
    }
}

fn unexpected(lease: LeaseId, c: &Control) -> KvTransferError {
    KvTransferError::Protocol { reason: format!("unexpected {c:?} during the transfer of {lease}") }
}

async fn read_events(i: usize, mut recv: RecvHalf, tx: mpsc::Sender<(usize, Result<Option<Frame>>)>) {
    let limits = Limits { max_payload: 0, layout: None };
    loop {
        let r = read_frame(&mut recv, &limits).await;
        let last = !matches!(r, Ok(Some(_)));
        if tx.send((i, r)).await.is_err() || last {
            return;
        }
    }
}

async fn forward_events(i: usize, mut rx: mpsc::Receiver<Frame>, tx: mpsc::Sender<(usize, Result<Option<Frame>>)>) {
    loop {
        let f = rx.recv().await;
        let last = f.is_none();
        if tx.send((i, Ok(f))).await.is_err() || last {
            return;
        }
    }
}

async fn write_items(lease: LeaseId, mut w: Box<dyn PayloadWriter>, mut rx: mpsc::Receiver<Item>, limit: Duration) {
    let mut bytes = 0u64;
    let mut chunks = 0u64;
    let ms = limit.as_millis() as u64;
    let timed = |what: &str| KvTransferError::Timeout { what: format!("{what} for {lease}"), ms };
    while let Some(item) = rx.recv().await {
        match item {
            Item::Chunk(c) => {
                let h = ChunkHeader {
                    lease_id: lease,
                    layer: c.layer,
                    token_start: c.token_start,
                    token_count: c.token_count,
                    k_len: c.k.len() as u32,
                    v_len: c.v.len() as u32,
                    // Filled in by the path (RDMA checksums each write group instead).
                    crc32: 0,
                };
                let n = (c.k.len() + c.v.len()) as u64;
                let write = w.chunk(h, c.k, c.v);
                match timeout(limit, write).await {
                    Ok(Ok(())) => {
                        bytes += n;
                        chunks += 1;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%lease, error = %e, "kv sender: chunk write failed");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(%lease, "kv sender: chunk write timed out");
                        return;
                    }
                }
            }
            Item::Flush(reply) => {
                let r = match timeout(limit, w.flush()).await {
                    Ok(Ok(())) => Ok((bytes, chunks)),
                    Ok(Err(source)) => Err(KvTransferError::Io { what: format!("flushing {lease}"), source }),
                    Err(_) => Err(timed("flush")),
                };
                let failed = r.is_err();
                let _ = reply.send(r);
                if failed {
                    return;
                }
            }
            Item::Complete(first_token, reply) => {
                let r = match timeout(limit, w.complete(lease, first_token)).await {
                    Ok(r) => r,
                    Err(_) => Err(timed("Complete")),
                };
                let _ = reply.send(r);
            }
        }
    }
    // Every ChunkSender is gone, so the KvSender is too: nothing more will be written.
}
