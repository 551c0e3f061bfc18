//! The payload path of a handoff: how K and V reach the leased blocks once the receiver accepted
//! a transfer's `Open`. The handoff itself (`Open` / `Accept` / `Complete` / `Ack` / `Abort`,
//! leases, expiry) is the same on every path; what differs is where the payload travels:
//!
//! - the stream path ([`StreamPath`] and [`StreamLease`], every transport's default): chunk
//!   frames on the transfer's streams, through the receiver, which checks each and writes it
//!   into the blocks ([`crate::receiver`]);
//! - the RDMA path (`rdma::send`, `rdma::handoff` and `rdma::lease`, feature `rdma`): one-sided
//!   writes into the leased blocks over a link, and `Landed` notices on one control stream,
//!   checked against the pool once every write landed.
//!
//! A transport picks the path of each transfer ([`crate::Transport::send_path`]), so the ticket's
//! [`cleave_protocol::TransportKind`] chooses it. The sender ([`crate::sender`]) drives it through
//! [`SendPath`] and [`PayloadWriter`] and knows nothing of links.
//!
//! On the receiving side the path has two halves:
//! - per lease, a [`LeasePayload`] in the receiver's state machine, chosen at the lease's `Open`
//!   ([`named_link`]): [`StreamLease`] for an `Open` naming no link (chunk frames checked for
//!   bounds, order and CRC-32, handed out as [`KvWrite`]s), or the payload the receiver's path
//!   gives when it binds the lease to the link the `Open` names (`rdma::RdmaLease`: `Landed`
//!   notices, checked once the link says every group landed). Sans-IO, like the state machine;
//! - per receiver, a [`RecvPath`] that the receiver's actor holds, for a path that needs more
//!   than the transfer's streams (link setup streams, link completions, blocks it must hold
//!   back). A receiver without one refuses an `Open` naming a link (it has nothing to bind the
//!   lease with) and a link offer, whatever the build.
//!
//! Allowed dependencies: [`crate::frame`] and the error type; neither the sender, the receiver
//! nor any transport (they depend on this module, not the reverse).
//!
//! What every implementation guarantees:
//! - a writer's chunks of one layer reach the receiver in the order it was given them;
//! - [`PayloadWriter::complete`] sends `Complete` only once everything the writer was given is
//!   where the receiver can check it (stream: written before it on the same ordered stream;
//!   RDMA: every write completed);
//! - a [`SendPath`] dropped before [`SendPath::acknowledged`] leaves nothing behind that could
//!   still change the receiver's blocks unannounced (RDMA: it cancels its writes and tells the
//!   receiver once they drained);
//! - a [`LeasePayload`] is [`LeasePayload::ready`] only once every token of every layer is in the
//!   lease's blocks, checked; and it names its link ([`LeasePayload::link`]) for as long as a
//!   write of it might land, so that the lease's release goes through its path;
//! - a [`RecvPath`] frees a released lease's blocks only once no write of it can land, and counts
//!   them in [`RecvPath::held_blocks`] until then (they stay in `reserved_blocks`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_net::SendHalf;
use cleave_protocol::{KvLayout, LeaseId, RequestId};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;

use crate::frame::{
    check_chunk_lengths, checksum, encode_chunk_header, encode_control, write_control, ChunkHeader, Control, Frame,
    Landed, Open,
};
use crate::{KvTransferError, Result};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Identifies one accepted stream within a receiver (assigned by its driver).
pub type StreamId = u64;

/// What a stream's reader hands the receiver: a frame, its clean end (`None`), or why it broke.
pub type StreamItem = Result<Option<Frame>>;

// ---------------------------------------------------------------------------------------------
// Sending side.

/// One stream of a transfer as the sender writes it: encoded onto a byte stream, or whole frames
/// handed to a receiver in the same process.
pub struct StreamOut(Out);

enum Out {
    Bytes(BufWriter<SendHalf>),
    Frames(mpsc::Sender<Frame>),
}

fn pipe_closed() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "in-process receiver closed the stream")
}

impl StreamOut {
    pub(crate) fn bytes(send: SendHalf) -> Self {
        Self(Out::Bytes(BufWriter::with_capacity(64 << 10, send)))
    }

    pub(crate) fn frames(send: mpsc::Sender<Frame>) -> Self {
        Self(Out::Frames(send))
    }

    /// Writes a control frame and flushes it.
    pub async fn control(&mut self, c: Control) -> Result<()> {
        match &mut self.0 {
            Out::Bytes(w) => write_control(w, &c).await,
            Out::Frames(tx) => tx
                .send(Frame::Control(c))
                .await
                .map_err(|_| KvTransferError::Io { what: "control frame".into(), source: pipe_closed() }),
        }
    }

    /// Queues a control frame behind what is buffered; the next flush sends it.
    pub async fn queue_control(&mut self, c: Control) -> std::io::Result<()> {
        match &mut self.0 {
            Out::Bytes(w) => w.write_all(&encode_control(&c)).await,
            Out::Frames(tx) => tx.send(Frame::Control(c)).await.map_err(|_| pipe_closed()),
        }
    }

    pub async fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.0 {
            Out::Bytes(w) => w.flush().await,
            Out::Frames(_) => Ok(()),
        }
    }

    /// A chunk frame with its checksum: the stream path's payload.
    async fn chunk(&mut self, h: ChunkHeader, k: Bytes, v: Bytes) -> std::io::Result<()> {
        let h = ChunkHeader { crc32: checksum(&k, &v), ..h };
        match &mut self.0 {
            // QUIC takes the payload by reference count: header (tiny) through the buffer, K
            // and V handed over whole, no copy.
            Out::Bytes(w) if w.get_ref().zero_copy() => {
                w.write_all(&encode_chunk_header(&h)).await?;
                w.flush().await?;
                w.get_mut().write_bytes(k).await?;
                w.get_mut().write_bytes(v).await
            }
            Out::Bytes(w) => {
                w.write_all(&encode_chunk_header(&h)).await?;
                w.write_all(&k).await?;
                w.write_all(&v).await
            }
            Out::Frames(tx) => tx.send(Frame::Chunk { header: h, k, v }).await.map_err(|_| pipe_closed()),
        }
    }
}

/// Writes one stream's share of a transfer, from the receiver's `Accept` to `Complete`.
pub trait PayloadWriter: Send {
    /// Moves K and V of one run of tokens of one layer towards the leased blocks. `h.crc32` is
    /// left for the path to fill in (the RDMA path checksums each write group instead).
    fn chunk(&mut self, h: ChunkHeader, k: Bytes, v: Bytes) -> BoxFuture<'_, std::io::Result<()>>;
    /// Sends what is buffered.
    fn flush(&mut self) -> BoxFuture<'_, std::io::Result<()>>;
    /// Sends `Complete`, once everything this writer was given can be checked by the receiver.
    fn complete(&mut self, lease_id: LeaseId, first_token: u32) -> BoxFuture<'_, Result<()>>;
}

/// What the receiver's `Accept` gave one stream, with what a path needs to write the lease.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub lease: LeaseId,
    /// The lease's tag on the link `Open` named (`Accept::rdma_tag`).
    pub tag: Option<u16>,
    /// The leased blocks, in position order (from the ticket).
    pub blocks: Arc<[u32]>,
    pub num_layers: u32,
    /// When the lease runs out at the receiver (from the ticket's ttl).
    pub expires: Instant,
    /// The transfer's open deadline, which bounds getting the writer ready, and its length.
    pub deadline: tokio::time::Instant,
    pub open_timeout: Duration,
}

/// One transfer's payload path on the sending side, from its streams' `Open` to its end.
/// Dropping it ends what it holds of the lease (see the module docs).
pub trait SendPath: Send + Sync {
    /// The link every `Open` names (`Open::rdma_link`); `None`: the payload goes in chunk frames.
    fn link(&self) -> Option<u64>;
    /// Streams the transfer opens, given the configured count (already within `1..=layers`).
    fn streams(&self, configured: usize) -> usize;
    /// A stream was accepted: the writer of its payload from now on.
    fn accepted(&mut self, out: StreamOut, accept: Accepted) -> BoxFuture<'_, Result<Box<dyn PayloadWriter>>>;
    /// The receiver refused an `Open` with `err`. True when one more start over a fresh path
    /// may succeed (the RDMA path: the receiver did not know the link, which is then set up
    /// anew); the sender retries once.
    fn refused(&mut self, err: &KvTransferError) -> bool;
    /// The receiver acknowledged the lease: it holds nothing of it any more.
    fn acknowledged(&mut self);
}

/// The payload in chunk frames on the transfer's streams, through the receiver.
#[derive(Debug, Default, Clone, Copy)]
pub struct StreamPath;

impl SendPath for StreamPath {
    fn link(&self) -> Option<u64> {
        None
    }

    fn streams(&self, configured: usize) -> usize {
        configured
    }

    fn accepted(&mut self, out: StreamOut, _accept: Accepted) -> BoxFuture<'_, Result<Box<dyn PayloadWriter>>> {
        Box::pin(async move { Ok(Box::new(StreamWriter(out)) as Box<dyn PayloadWriter>) })
    }

    fn refused(&mut self, _err: &KvTransferError) -> bool {
        false
    }

    fn acknowledged(&mut self) {}
}

struct StreamWriter(StreamOut);

impl PayloadWriter for StreamWriter {
    fn chunk(&mut self, h: ChunkHeader, k: Bytes, v: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(self.0.chunk(h, k, v))
    }

    fn flush(&mut self) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(self.0.flush())
    }

    fn complete(&mut self, lease_id: LeaseId, first_token: u32) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.0.control(Control::Complete { lease_id, first_token }))
    }
}

// ---------------------------------------------------------------------------------------------
// Receiving side: one lease's payload, inside the receiver's state machine.

/// One contiguous run of tokens of one layer, to be written into the lease's blocks.
///
/// `k` and `v` are each `token_count * num_kv_heads * head_dim` values of the layout's dtype,
/// little-endian, token-major. Token `t` lives in block `blocks[t / block_size]` at slot
/// `t % block_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvWrite {
    pub lease: LeaseId,
    pub request_id: RequestId,
    pub blocks: Arc<[u32]>,
    pub layer: u32,
    pub token_start: u32,
    pub token_count: u32,
    pub k: Bytes,
    pub v: Bytes,
}

/// The link an `Open` names (`Open::rdma_link`): its lease's payload then travels over that link
/// of the receiver's [`RecvPath`], not in chunk frames on its streams.
pub fn named_link(open: &Open) -> Option<u64> {
    open.rdma_link
}

/// A lease's place on a link of the receiver's [`RecvPath`]: the link its `Open` named and the
/// tag the path gave the lease there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinkTag {
    pub link: u64,
    pub tag: u16,
}

/// What a linked payload asks its path once the sender's `Complete` came: report
/// ([`PathOutput::Landed`]) once layer `l`'s `chunks[l]` write groups all landed on `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expect {
    pub at: LinkTag,
    pub chunks: Vec<u32>,
}

/// What a lease's payload may read of its lease.
#[derive(Debug, Clone, Copy)]
pub struct LeaseCx<'a> {
    pub id: LeaseId,
    pub request_id: RequestId,
    /// The leased blocks, in position order.
    pub blocks: &'a Arc<[u32]>,
    pub num_tokens: u32,
    /// Leading tokens the blocks already held when the lease opened (none travel).
    pub cached_tokens: u32,
    /// The receiver's layout (the `Open` was checked against it).
    pub layout: &'a KvLayout,
}

/// Computes a `Landed` notice's CRC-32 from what landed in the lease's blocks (given in position
/// order), as [`crate::KvSink::landed_checksum`] does from the pool.
pub type LandedCheck<'a> = &'a mut dyn FnMut(&[u32], &Landed) -> Result<u32>;

/// One lease's payload as the receiver's state machine ([`crate::receiver`]) holds it, from the
/// `Open` that chose it to the lease's end. It checks what arrives for the lease's payload; the
/// lease table, expiry, cancellation, completion and the one release are the state machine's.
/// An error from any method ends the lease with that error.
///
/// Two implementations: [`StreamLease`] (chunk frames through the receiver, chosen by an `Open`
/// that names no link) and `rdma::RdmaLease` (feature `rdma`: the payload lands by itself, the
/// streams carry `Landed` notices), which the RDMA [`RecvPath`] gives when it binds a lease to a
/// link ([`RecvPath::bind`]).
pub trait LeasePayload: Send {
    /// The `Accept` that answers the lease's `Open`s: it tells the sender how to write.
    fn accept(&self, lease: LeaseId) -> Control;
    /// The link the payload travels over: while the path holds the lease's tag there, writes may
    /// still land after the lease ended.
    fn link(&self) -> Option<LinkTag>;
    /// A chunk frame for the lease: the write to carry out, or `None` for a duplicate (its
    /// tokens already arrived: dropped and reported).
    fn chunk(&mut self, cx: &LeaseCx<'_>, h: ChunkHeader, k: Bytes, v: Bytes) -> Result<Option<KvWrite>>;
    /// A `Landed` notice for the lease.
    fn notice(&mut self, cx: &LeaseCx<'_>, n: Landed) -> Result<()>;
    /// The sender's `Complete` (the first; a second one is the state machine's error). `Some`:
    /// the path must first report that every write landed ([`crate::receiver::Effect::Expect`]).
    fn complete(&mut self, cx: &LeaseCx<'_>) -> Result<Option<Expect>>;
    /// The path reported that every write landed: checks it all against the blocks and returns
    /// the bytes it verified.
    fn landed(&mut self, cx: &LeaseCx<'_>, check: LandedCheck<'_>) -> Result<u64>;
    /// Every token of every layer is in the blocks, checked: the lease completes once the
    /// sender's `Complete` came too.
    fn ready(&self) -> bool;
}

/// The stream payload of a lease: chunk frames on its streams, each checked (bounds, order,
/// CRC-32) and handed out as one [`KvWrite`].
///
/// Invariant: for every layer, tokens `[cached, next[layer])` were handed out exactly once, in
/// token order, each with a verified checksum; nothing else was (`cached`: the lease's cached
/// prefix, which the blocks held from the start).
#[derive(Debug, Clone)]
pub struct StreamLease {
    /// Next expected token per layer.
    next: Vec<u32>,
    /// Layers that hold every token.
    layers_done: u32,
}

impl StreamLease {
    /// A lease whose blocks already hold tokens `0..cached` (below the lease's token count).
    pub fn new(num_layers: u32, cached: u32) -> Self {
        Self { next: vec![cached; num_layers as usize], layers_done: 0 }
    }
}

impl LeasePayload for StreamLease {
    fn accept(&self, lease: LeaseId) -> Control {
        Control::Accept { lease_id: lease, rdma_tag: None }
    }

    fn link(&self) -> Option<LinkTag> {
        None
    }

    fn chunk(&mut self, cx: &LeaseCx<'_>, h: ChunkHeader, k: Bytes, v: Bytes) -> Result<Option<KvWrite>> {
        let id = cx.id;
        check_chunk_lengths(&h, k.len() + v.len(), Some(cx.layout))?;
        let end = h.token_start as u64 + h.token_count as u64;
        if end > cx.num_tokens as u64 {
            return Err(KvTransferError::ChunkOutOfBounds {
                lease: id,
                reason: format!("layer {} tokens {}..{end} past {}", h.layer, h.token_start, cx.num_tokens),
            });
        }
        let next = self.next[h.layer as usize];
        if end as u32 <= next {
            return Ok(None);
        }
        if h.token_start != next {
            return Err(KvTransferError::ChunkGap { lease: id, layer: h.layer, expected: next, got: h.token_start });
        }
        let got = checksum(&k, &v);
        if got != h.crc32 {
            return Err(KvTransferError::ChecksumMismatch {
                lease: id,
                layer: h.layer,
                token_start: h.token_start,
                token_count: h.token_count,
                expected: h.crc32,
                got,
            });
        }
        self.next[h.layer as usize] = end as u32;
        if end as u32 == cx.num_tokens {
            self.layers_done += 1;
        }
        Ok(Some(KvWrite {
            lease: id,
            request_id: cx.request_id,
            blocks: cx.blocks.clone(),
            layer: h.layer,
            token_start: h.token_start,
            token_count: h.token_count,
            k,
            v,
        }))
    }

    fn notice(&mut self, cx: &LeaseCx<'_>, _n: Landed) -> Result<()> {
        Err(KvTransferError::Protocol { reason: format!("a Landed notice for {}, not an RDMA lease", cx.id) })
    }

    fn complete(&mut self, _cx: &LeaseCx<'_>) -> Result<Option<Expect>> {
        Ok(None)
    }

    /// Nothing lands by itself on the streams (no path reports for a stream lease).
    fn landed(&mut self, _cx: &LeaseCx<'_>, _check: LandedCheck<'_>) -> Result<u64> {
        Ok(0)
    }

    fn ready(&self) -> bool {
        self.layers_done as usize == self.next.len()
    }
}

/// What a [`RecvPath`] reports, for the receiver's actor to carry out in order.
#[derive(Debug)]
pub enum PathOutput {
    /// Every write of the lease landed: check its notices against the pool and complete it.
    Landed(LeaseId),
    /// The path failed the lease, and nothing of it can land any more: release it.
    Failed(LeaseId, KvTransferError),
    /// A released lease's blocks are safe to free now.
    Free(RequestId, Vec<u32>),
    /// Send a control frame on a stream (a link's answer or refusal).
    Send { stream: StreamId, msg: Control },
    /// Close a stream.
    Close(StreamId),
    /// The stream is the path's own (a link's): the lease state machine forgets it.
    Forget(StreamId),
}

/// The receiving side of a payload path that needs more than the transfer's streams, owned by
/// the receiver's actor (no task of its own: the actor polls it). The lease state machine asks
/// for a lease's binding to a link (`Effect::Bind`), for what to expect of it (`Effect::Expect`)
/// and names its tag when it releases it (`Effect::Released`); this is where they go.
pub trait RecvPath: Send {
    /// When the actor should call [`RecvPath::poll`] next; `None`: nothing to poll for.
    fn next_poll(&self, now: Instant) -> Option<Instant>;
    /// Blocks of released leases that a write may still reach: not free yet, counted reserved.
    fn held_blocks(&self) -> usize;
    /// A frame (or the end) of `stream`, whose peer has certificate name `peer`. The path takes
    /// what belongs to it (a link offer, and everything on a link's stream) and gives the rest
    /// back for the lease state machine.
    fn on_frame(
        &mut self,
        stream: StreamId,
        item: StreamItem,
        peer: Option<&str>,
        now: Instant,
    ) -> std::result::Result<Vec<PathOutput>, StreamItem>;
    /// An `Open` from `peer` named `link`: opens the lease (of `num_layers` layers, until
    /// `deadline`) on it and gives the lease's payload (its tag goes back to the sender in the
    /// `Accept`). An error whose abort code is `UnknownLink` refuses the stream but keeps the
    /// lease, for the sender to open again over a new link.
    fn bind(
        &mut self,
        link: u64,
        lease: LeaseId,
        num_layers: u32,
        deadline: Instant,
        peer: Option<&str>,
    ) -> Result<Box<dyn LeasePayload>>;
    /// Every notice of a bound lease arrived with its `Complete`: what to expect. Its `Landed`
    /// (or `Failed`) comes once it all arrived.
    fn expect(&mut self, expect: Expect, now: Instant) -> Vec<PathOutput>;
    /// A bound lease was released: its blocks back when they may be freed now, else `None` (held
    /// until no write can land; a `Free` reports them then).
    fn release(
        &mut self,
        at: LinkTag,
        request_id: RequestId,
        blocks: Vec<u32>,
        now: Instant,
    ) -> (Option<Vec<u32>>, Vec<PathOutput>);
    /// Progress: completions that arrived, deadlines that passed.
    fn poll(&mut self, now: Instant) -> Vec<PathOutput>;
}
