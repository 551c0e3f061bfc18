//! The payload path of a handoff: how K and V reach the leased blocks once the receiver accepted
//! a transfer's `Open`. The handoff itself (`Open` / `Accept` / `Complete` / `Ack` / `Abort`,
//! leases, expiry) is the same on every path; what differs is where the payload travels:
//!
//! - the stream path ([`StreamPath`], every transport's default): chunk frames on the transfer's
//!   streams, through the receiver, which checks each and writes it into the blocks
//!   ([`crate::receiver`]);
//! - the RDMA path (`rdma::send` and `rdma::handoff`, feature `rdma`): one-sided writes into
//!   the leased blocks over a link, and `Landed` notices on one control stream, checked against
//!   the pool once every write landed.
//!
//! A transport picks the path of each transfer ([`crate::Transport::send_path`]), so the ticket's
//! [`cleave_protocol::TransportKind`] chooses it. The sender ([`crate::sender`]) drives it through
//! [`SendPath`] and [`PayloadWriter`] and knows nothing of links. On the receiving side a path
//! that needs more than the transfer's streams (link setup streams, link completions, blocks it
//! must hold back) is a [`RecvPath`] that the receiver's actor holds; a receiver without one
//! refuses an `Open` naming a link and a link offer, whatever the build.
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
//! - a [`RecvPath`] frees a released lease's blocks only once no write of it can land, and counts
//!   them in [`RecvPath::held_blocks`] until then (they stay in `reserved_blocks`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_net::SendHalf;
use cleave_protocol::{LeaseId, RequestId};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;

use crate::frame::{checksum, encode_chunk_header, encode_control, write_control, ChunkHeader, Control, Frame};
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
// Receiving side.

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
/// the receiver's actor (no task of its own: the actor polls it). The lease state machine names
/// a lease's link and tag (`Effect::BindRdma`, `SetChunks`, `Released`); this is where they go.
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
    /// `deadline`) on it; the tag goes back to the sender in the `Accept`.
    fn bind(
        &mut self,
        link: u64,
        lease: LeaseId,
        num_layers: u32,
        deadline: Instant,
        peer: Option<&str>,
    ) -> Result<u16>;
    /// Every notice of a bound lease arrived with its `Complete`: layer `l` has `chunks[l]` write
    /// groups. Its `Landed` (or `Failed`) comes once they all arrived.
    fn set_chunks(&mut self, link: u64, tag: u16, chunks: &[u32], now: Instant) -> Vec<PathOutput>;
    /// A bound lease was released: its blocks back when they may be freed now, else `None` (held
    /// until no write can land; a `Free` reports them then).
    fn release(
        &mut self,
        link: u64,
        tag: u16,
        request_id: RequestId,
        blocks: Vec<u32>,
        now: Instant,
    ) -> (Option<Vec<u32>>, Vec<PathOutput>);
    /// Progress: completions that arrived, deadlines that passed.
    fn poll(&mut self, now: Instant) -> Vec<PathOutput>;
}
