//! Async owners of the two link ends. Each queue pair gets one task that owns its [`SendLink`]
//! or [`RecvLink`] (the links are sans-IO: they never block or read a clock), polls its
//! completions while it has work outstanding, and talks to the rest of the node through a
//! cloneable handle and a channel of [`LeaseEvent`]s. Nothing else touches the queue pair.
//!
//! Contracts:
//! - [`RecvDriver`]: every lease event the link reports (see [`super::link`]: final and safe)
//!   goes out on the event channel, once. When the channel closes the task has dropped the link,
//!   and with it the queue pair (a destroyed queue pair lands nothing), so every lease still open
//!   on it may be freed.
//! - [`SendDriver`]: chunks of one lease are posted in the order `send` was called; a chunk
//!   that finds no staging slot or send-queue room waits in the task (FIFO, so later chunks wait
//!   behind it) and its `send` returns once it is posted. `finish` returns the lease's outcome
//!   once every posted write completed (or the lease failed); `cancel` returns once no write of
//!   the lease can still be in flight, which is when the receiver may be told it drained.
//! - Every wait on a handle ends: a task that stops answers every pending request with
//!   [`KvTransferError::Closed`].

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::completion::LeaseEvent;
use super::link::{RecvLink, RecvOps, SendLink, SendOps};
use super::plan::ChunkWrite;
use crate::error::{KvTransferError, Result};

const CLOSED: KvTransferError = KvTransferError::Closed { what: "rdma link driver" };

/// How often a driver polls its completion queue while it has work outstanding. With a device a
/// driver would rather sleep on the completion channel's file descriptor; polling keeps the
/// loop identical for the in-memory connection of tests.
#[derive(Debug, Clone, Copy)]
pub struct DriverConfig {
    pub poll_interval: Duration,
    /// Bound of each handle's command queue.
    pub queue: usize,
}

impl Default for DriverConfig {
    fn default() -> Self {
        Self { poll_interval: Duration::from_micros(200), queue: 256 }
    }
}

/// Sends a command to a driver task and waits for its reply; a stopped task is [`CLOSED`].
async fn call<C, T>(tx: &mpsc::Sender<C>, make: impl FnOnce(oneshot::Sender<Result<T>>) -> C) -> Result<T> {
    let (reply, rx) = oneshot::channel();
    tx.send(make(reply)).await.map_err(|_| CLOSED)?;
    rx.await.map_err(|_| CLOSED)?
}

/// A driver loop's next step: `Some(Some(cmd))`, or `Some(None)` after one poll interval while
/// there is work to poll for, or `None` when every handle is gone and nothing is outstanding
/// (the task ends). Once the handles are gone a busy driver keeps polling at the interval
/// instead of spinning on the closed channel.
async fn next_command<C>(rx: &mut mpsc::Receiver<C>, busy: bool, poll: Duration) -> Option<Option<C>> {
    let open = !(rx.is_closed() && rx.is_empty());
    tokio::select! {
        cmd = rx.recv(), if open => match cmd {
            Some(c) => Some(Some(c)),
            None if busy => Some(None),
            None => None,
        },
        _ = tokio::time::sleep(poll), if busy => Some(None),
        else => None,
    }
}

enum RecvCmd {
    Open { num_layers: u32, deadline: Instant, reply: oneshot::Sender<Result<u16>> },
    SetChunks { tag: u16, chunks: u32, reply: oneshot::Sender<Result<()>> },
    Cancel { tag: u16, reply: oneshot::Sender<Result<()>> },
    Drained { tag: u16, reply: oneshot::Sender<Result<()>> },
}

/// Handle to the task that owns a [`RecvLink`].
#[derive(Clone)]
pub struct RecvDriver {
    tx: mpsc::Sender<RecvCmd>,
}

impl RecvDriver {
    /// Spawns the owner task on the current tokio runtime; lease events arrive on the returned
    /// channel.
    pub fn spawn<O: RecvOps + Send + 'static>(
        link: RecvLink<O>,
        cfg: DriverConfig,
    ) -> (Self, mpsc::UnboundedReceiver<LeaseEvent>) {
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let (etx, erx) = mpsc::unbounded_channel();
        tokio::spawn(recv_task(link, rx, etx, cfg.poll_interval));
        (Self { tx }, erx)
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T>>) -> RecvCmd) -> Result<T> {
        call(&self.tx, make).await
    }

    /// Opens a lease of `num_layers` layers; the tag goes to the sender.
    pub async fn open_lease(&self, num_layers: u32, deadline: Instant) -> Result<u16> {
        self.call(|reply| RecvCmd::Open { num_layers, deadline, reply }).await
    }

    /// The sender's chunk count (from the control stream).
    pub async fn set_chunks(&self, tag: u16, chunks: u32) -> Result<()> {
        self.call(|reply| RecvCmd::SetChunks { tag, chunks, reply }).await
    }

    /// Cancels a lease; its `Failed` event comes once no write of it can land.
    pub async fn cancel(&self, tag: u16) -> Result<()> {
        self.call(|reply| RecvCmd::Cancel { tag, reply }).await
    }

    /// The sender reports that no write of `tag` is in flight (control stream).
    pub async fn drained(&self, tag: u16) -> Result<()> {
        self.call(|reply| RecvCmd::Drained { tag, reply }).await
    }
}

async fn recv_task<O: RecvOps>(
    mut link: RecvLink<O>,
    mut rx: mpsc::Receiver<RecvCmd>,
    events: mpsc::UnboundedSender<LeaseEvent>,
    poll: Duration,
) {
    while let Some(cmd) = next_command(&mut rx, link.open_leases() > 0, poll).await {
        let now = Instant::now();
        let mut out = Vec::new();
        match cmd {
            Some(RecvCmd::Open { num_layers, deadline, reply }) => {
                let _ = reply.send(link.open_lease(num_layers, deadline));
            }
            Some(RecvCmd::SetChunks { tag, chunks, reply }) => {
                let _ = reply.send(link.set_chunks(tag, chunks, now).map(|e| out.extend(e)));
            }
            Some(RecvCmd::Cancel { tag, reply }) => {
                let _ = reply.send(link.cancel(tag, now).map(|e| out.extend(e)));
            }
            Some(RecvCmd::Drained { tag, reply }) => {
                let _ = reply.send(link.drained(tag).map(|e| out.extend(e)));
            }
            None => {}
        }
        match link.poll(now) {
            Ok(e) => out.extend(e),
            Err(error) => {
                // The provider failed: drop the link (destroying the queue pair) and close the
                // channel, which tells the owner every open lease is safe to free.
                tracing::warn!(%error, "rdma receive link failed; closing it");
                for e in out {
                    let _ = events.send(e);
                }
                break;
            }
        }
        for e in out {
            let _ = events.send(e);
        }
    }
    drop(link);
}

enum SendCmd {
    Open { tag: u16, deadline: Instant, reply: oneshot::Sender<Result<()>> },
    Chunk(PendingChunk),
    Finish { tag: u16, reply: oneshot::Sender<Result<LeaseEvent>> },
    Cancel { tag: u16, reply: oneshot::Sender<Result<()>> },
}

/// One layer of one prefill chunk for a lease (see [`ChunkWrite`]).
#[derive(Debug, Clone)]
pub struct SendChunk {
    pub blocks: Arc<[u32]>,
    pub layer: u32,
    pub tokens: Range<u32>,
    pub tag: u16,
    pub chunk: u32,
    pub k: Bytes,
    pub v: Bytes,
}

struct PendingChunk {
    chunk: SendChunk,
    reply: oneshot::Sender<Result<()>>,
}

/// Handle to the task that owns a [`SendLink`].
#[derive(Clone)]
pub struct SendDriver {
    tx: mpsc::Sender<SendCmd>,
    /// Set by the task once its queue pair broke (an error completion) or the task ended.
    broken: Arc<std::sync::atomic::AtomicBool>,
}

impl SendDriver {
    /// Spawns the owner task on the current tokio runtime.
    pub fn spawn<O: SendOps + Send + 'static>(link: SendLink<O>, cfg: DriverConfig) -> Self {
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        tokio::spawn(send_task(link, rx, cfg.poll_interval, broken.clone()));
        Self { tx, broken }
    }

    /// True once the queue pair broke or the task stopped: nothing more can be sent on it.
    pub fn is_broken(&self) -> bool {
        self.broken.load(std::sync::atomic::Ordering::Acquire)
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T>>) -> SendCmd) -> Result<T> {
        call(&self.tx, make).await
    }

    /// Opens the lease the receiver tagged `tag`.
    pub async fn open(&self, tag: u16, deadline: Instant) -> Result<()> {
        self.call(|reply| SendCmd::Open { tag, deadline, reply }).await
    }

    /// Posts one chunk's writes; returns once they are posted (not completed).
    pub async fn send(&self, chunk: SendChunk) -> Result<()> {
        self.call(|reply| SendCmd::Chunk(PendingChunk { chunk, reply })).await
    }

    /// No more chunks: waits for the lease's outcome.
    pub async fn finish(&self, tag: u16) -> Result<LeaseEvent> {
        self.call(|reply| SendCmd::Finish { tag, reply }).await
    }

    /// Abandons the lease; returns once none of its writes can still be in flight.
    pub async fn cancel(&self, tag: u16) -> Result<()> {
        self.call(|reply| SendCmd::Cancel { tag, reply }).await
    }
}

struct SendState<O: SendOps> {
    link: SendLink<O>,
    /// Chunks waiting for a staging slot or send-queue room, in call order.
    pending: VecDeque<PendingChunk>,
    /// Outcomes not yet asked for, and `finish` calls waiting for one.
    outcomes: HashMap<u16, LeaseEvent>,
    finishing: HashMap<u16, oneshot::Sender<Result<LeaseEvent>>>,
    /// Leases whose `finish` came while some of their chunks still waited to be posted.
    deferred_finish: Vec<u16>,
    /// `cancel` calls waiting for their lease to drain.
    cancelling: Vec<(u16, oneshot::Sender<Result<()>>)>,
}

impl<O: SendOps> SendState<O> {
    fn busy(&self) -> bool {
        !self.pending.is_empty() || !self.finishing.is_empty() || !self.cancelling.is_empty()
    }

    /// Finishes `tag` in the link, the `finish` call already waiting in `finishing`.
    fn finish_now(&mut self, tag: u16) {
        match self.link.finish(tag) {
            Ok(Some(e)) => self.record(e),
            // Otherwise the outcome comes with the last completion.
            Ok(None) => {
                if let Some(e) = self.outcomes.remove(&tag) {
                    self.record(e);
                }
            }
            Err(e) => match self.outcomes.remove(&tag) {
                // Failed earlier (timeout, broken queue pair): that is the outcome.
                Some(ev) => self.record(ev),
                None => {
                    if let Some(w) = self.finishing.remove(&tag) {
                        let _ = w.send(Err(e));
                    }
                }
            },
        }
    }

    /// Posts waiting chunks in order until one does not fit.
    fn post_pending(&mut self) {
        while let Some(p) = self.pending.front() {
            let c = &p.chunk;
            let w =
                ChunkWrite { blocks: &c.blocks, layer: c.layer, tokens: c.tokens.clone(), tag: c.tag, chunk: c.chunk };
            match self.link.send_chunk(&w, &c.k, &c.v) {
                Ok(false) => return,
                r => {
                    let p = self.pending.pop_front().expect("front exists");
                    let _ = p.reply.send(r.map(|_| ()));
                }
            }
        }
    }

    fn record(&mut self, e: LeaseEvent) {
        match self.finishing.remove(&e.tag) {
            Some(reply) => {
                let _ = reply.send(Ok(e));
            }
            None => {
                self.outcomes.insert(e.tag, e);
            }
        }
    }

    fn settle_cancels(&mut self) {
        let (done, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.cancelling).into_iter().partition(|(tag, _)| self.link.is_drained(*tag));
        self.cancelling = waiting;
        for (_, reply) in done {
            let _ = reply.send(Ok(()));
        }
    }
}

async fn send_task<O: SendOps>(
    link: SendLink<O>,
    mut rx: mpsc::Receiver<SendCmd>,
    poll: Duration,
    broken: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut s = SendState {
        link,
        pending: VecDeque::new(),
        outcomes: HashMap::new(),
        finishing: HashMap::new(),
        deferred_finish: Vec::new(),
        cancelling: Vec::new(),
    };
    while let Some(cmd) = next_command(&mut rx, s.busy(), poll).await {
        match cmd {
            Some(SendCmd::Open { tag, deadline, reply }) => {
                s.outcomes.remove(&tag);
                let _ = reply.send(s.link.open(tag, deadline));
            }
            Some(SendCmd::Chunk(p)) => {
                s.pending.push_back(p);
                s.post_pending();
            }
            Some(SendCmd::Finish { tag, reply }) => {
                s.finishing.insert(tag, reply);
                // Finishing while chunks of the lease still wait would report Done before they
                // are written: finish once they are posted.
                if s.pending.iter().any(|p| p.chunk.tag == tag) {
                    s.deferred_finish.push(tag);
                } else {
                    s.finish_now(tag);
                }
            }
            Some(SendCmd::Cancel { tag, reply }) => {
                // Waiting chunks of the lease are dropped; posted ones must drain.
                let (drop_these, keep): (VecDeque<_>, VecDeque<_>) =
                    std::mem::take(&mut s.pending).into_iter().partition(|p| p.chunk.tag == tag);
                s.pending = keep;
                s.deferred_finish.retain(|t| *t != tag);
                for p in drop_these {
                    let _ = p
                        .reply
                        .send(Err(KvTransferError::RdmaTracker { reason: format!("lease tag {tag} cancelled") }));
                }
                if let Some(e) = s.link.cancel(tag) {
                    s.record(e);
                }
                if let Some(w) = s.finishing.remove(&tag) {
                    let _ = w.send(Err(KvTransferError::RdmaTracker { reason: format!("lease tag {tag} cancelled") }));
                }
                s.cancelling.push((tag, reply));
            }
            None => {}
        }
        match s.link.poll(Instant::now()) {
            Ok(events) => {
                for e in events {
                    s.record(e);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "rdma send link failed; closing it");
                break;
            }
        }
        s.post_pending();
        let ready: Vec<u16> =
            s.deferred_finish.iter().copied().filter(|t| !s.pending.iter().any(|p| p.chunk.tag == *t)).collect();
        s.deferred_finish.retain(|t| !ready.contains(t));
        for tag in ready {
            s.finish_now(tag);
        }
        s.settle_cancels();
        if s.link.tracker().broken().is_some() {
            broken.store(true, std::sync::atomic::Ordering::Release);
        }
    }
    broken.store(true, std::sync::atomic::Ordering::Release);
    // Dropping the link destroys the queue pair: nothing of ours can land any more, so waiting
    // cancels are answered as drained; everything else learns the task is gone.
    let SendState { link, pending, finishing, cancelling, .. } = s;
    drop(link);
    for p in pending {
        let _ = p.reply.send(Err(CLOSED));
    }
    for (_, w) in finishing {
        let _ = w.send(Err(CLOSED));
    }
    for (_, c) in cancelling {
        let _ = c.send(Ok(()));
    }
}
