//! The two ends of an RDMA link (one reliable-connected queue pair), driving the planners and
//! trackers over a small operations trait: [`verbs`](super::verbs) implements it for a device,
//! [`sim`](super::sim) in memory, so the whole flow, faults included, is tested without one.
//!
//! Neither end blocks or reads a clock: the owner calls `poll(now)` when it wants progress
//! (busy-polling a completion queue, or on a timer) and acts on the returned [`LeaseEvent`]s.
//!
//! Receiver contract: a lease event returned by [`RecvLink::poll`] (or another method) is
//! final and safe: `Done` means every group landed and the blocks pass to the request;
//! `Failed` means no write of the lease can land any more, so the blocks may be freed now. A
//! lease that fails while the sender may still be writing (cancel, timeout, protocol error) is
//! quarantined first and reported only when the sender says it drained ([`RecvLink::drained`],
//! from the control stream) or, failing that by the quarantine deadline, after the link resets
//! the queue pair, which fails every other lease on it too (each reported once, safe).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::completion::{LeaseEvent, Outcome, RecvCompletion, RecvTracker, SendCompletion, SendTracker};
use super::layout::Imm;
use super::meta::QpMetadata;
use super::plan::{plan_chunk, source_len, ChunkWrite, RemoteRegion, SignalPolicy};
use crate::error::{KvTransferError, Result};

/// What the sending end needs from its queue pair.
pub trait SendOps {
    /// The registered memory writes are sent from (the link's staging slots).
    fn staging(&mut self) -> &mut [u8];
    /// Posts `writes`; source offset 0 is byte `src_base` of [`SendOps::staging`].
    fn post_writes(&mut self, src_base: u64, rkey: u32, writes: &[super::RdmaWrite], wr_ids: &[u64]) -> Result<()>;
    /// Appends the send completions available now.
    fn poll_send(&mut self, out: &mut Vec<SendCompletion>) -> Result<()>;
}

/// What the receiving end needs from its queue pair.
pub trait RecvOps {
    /// Posts `count` zero-length receives (one is consumed per immediate).
    fn post_recvs(&mut self, count: u32) -> Result<()>;
    /// Appends the receive completions available now.
    fn poll_recv(&mut self, out: &mut Vec<RecvCompletion>) -> Result<()>;
    /// Moves the queue pair to the error state; once this returns no write lands any more.
    fn reset(&mut self) -> Result<()>;
}

impl<T: RecvOps + ?Sized> RecvOps for Box<T> {
    fn post_recvs(&mut self, count: u32) -> Result<()> {
        (**self).post_recvs(count)
    }

    fn poll_recv(&mut self, out: &mut Vec<RecvCompletion>) -> Result<()> {
        (**self).poll_recv(out)
    }

    fn reset(&mut self) -> Result<()> {
        (**self).reset()
    }
}

/// Sizes of a [`SendLink`].
#[derive(Debug, Clone, Copy)]
pub struct SendLinkConfig {
    /// Staging slots (chunks in flight) and bytes per slot (at least the largest chunk's
    /// [`source_len`]); the staging memory must hold `slots * slot_bytes`.
    pub slots: usize,
    pub slot_bytes: u64,
    pub sq_depth: u32,
    pub policy: SignalPolicy,
}

/// The prefill end: copies each chunk into a registered staging slot and writes it into the
/// receiver's leased blocks.
pub struct SendLink<O: SendOps> {
    ops: O,
    tracker: SendTracker,
    region: RemoteRegion,
    max_write: u32,
    cfg: SendLinkConfig,
    free_slots: Vec<usize>,
    /// Last wr_id of a posted chunk -> its staging slot (free once that completion arrives:
    /// a reliable connection completes a queue pair's requests in order).
    slot_of: HashMap<u64, usize>,
}

impl<O: SendOps> SendLink<O> {
    /// `remote` is the receiver's metadata (with its region).
    pub fn new(mut ops: O, remote: &QpMetadata, cfg: SendLinkConfig) -> Result<Self> {
        let region = remote.region.ok_or_else(|| KvTransferError::RdmaMetadata {
            reason: "the receiver's metadata describes no memory region".into(),
        })?;
        let need = (cfg.slots as u64).checked_mul(cfg.slot_bytes);
        if cfg.slots == 0 || need.is_none_or(|n| n > ops.staging().len() as u64) {
            return Err(KvTransferError::RdmaPlan {
                reason: format!(
                    "{} slots of {} bytes do not fit {} staging bytes",
                    cfg.slots,
                    cfg.slot_bytes,
                    ops.staging().len()
                ),
            });
        }
        Ok(Self {
            ops,
            tracker: SendTracker::new(cfg.sq_depth),
            region,
            max_write: remote.max_write_bytes,
            cfg,
            free_slots: (0..cfg.slots).rev().collect(),
            slot_of: HashMap::new(),
        })
    }

    pub fn open(&mut self, tag: u16, deadline: Instant) -> Result<()> {
        self.tracker.open(tag, deadline)
    }

    /// Writes one layer of one chunk (`k` and `v` of `chunk.tokens`). `Ok(false)`: no staging
    /// slot or send-queue room now; poll, then retry. Errors (bad sizes, a lease not active, a
    /// broken queue pair) post nothing. An error from the provider's post leaves the link
    /// broken: drop it, which destroys the queue pair.
    pub fn send_chunk(&mut self, chunk: &ChunkWrite<'_>, k: &[u8], v: &[u8]) -> Result<bool> {
        let n = chunk.tokens.end.saturating_sub(chunk.tokens.start);
        let half = source_len(n, self.region.layout.token_bytes) / 2;
        if k.len() as u64 != half || v.len() as u64 != half || 2 * half > self.cfg.slot_bytes {
            return Err(KvTransferError::RdmaPlan {
                reason: format!(
                    "chunk of {n} tokens needs {half} bytes of K and of V (got {} and {}) within a {}-byte slot",
                    k.len(),
                    v.len(),
                    self.cfg.slot_bytes
                ),
            });
        }
        let writes = plan_chunk(&self.region, chunk, self.max_write, self.cfg.policy)?;
        if self.tracker.is_drained(chunk.tag) {
            return Err(KvTransferError::RdmaTracker { reason: format!("lease tag {} is not open", chunk.tag) });
        }
        let Some(&slot) = self.free_slots.last() else { return Ok(false) };
        if writes.len() as u64 > self.tracker.room() as u64 {
            return Ok(false);
        }
        let ids = self.tracker.post(chunk.tag, &writes)?;
        self.free_slots.pop();
        let base = slot as u64 * self.cfg.slot_bytes;
        let staging = &mut self.ops.staging()[base as usize..(base + 2 * half) as usize];
        staging[..half as usize].copy_from_slice(k);
        staging[half as usize..].copy_from_slice(v);
        if let Some(&last) = ids.last() {
            self.slot_of.insert(last, slot);
        }
        self.ops.post_writes(base, self.region.rkey, &writes, &ids)?;
        Ok(true)
    }

    /// No more chunks for `tag`.
    pub fn finish(&mut self, tag: u16) -> Result<Option<LeaseEvent>> {
        self.tracker.finish(tag)
    }

    pub fn cancel(&mut self, tag: u16) -> Option<LeaseEvent> {
        self.tracker.cancel(tag)
    }

    /// True once no write of `tag` can still be in flight: tell the receiver
    /// ([`RecvLink::drained`]) so it frees the blocks without resetting the queue pair.
    pub fn is_drained(&self, tag: u16) -> bool {
        self.tracker.is_drained(tag)
    }

    pub fn free_slots(&self) -> usize {
        self.free_slots.len()
    }

    pub fn tracker(&self) -> &SendTracker {
        &self.tracker
    }

    /// Applies the completions available now and the deadlines at `now`.
    pub fn poll(&mut self, now: Instant) -> Result<Vec<LeaseEvent>> {
        let mut wcs = Vec::new();
        self.ops.poll_send(&mut wcs)?;
        let mut events = Vec::new();
        for c in wcs {
            if let Some(slot) = self.slot_of.remove(&c.wr_id) {
                self.free_slots.push(slot);
            }
            events.extend(self.tracker.on_completion(c)?);
        }
        events.extend(self.tracker.on_timeout(now));
        Ok(events)
    }
}

/// Sizes and timing of a [`RecvLink`].
#[derive(Debug, Clone, Copy)]
pub struct RecvLinkConfig {
    /// Receives kept posted: at least the number of (layer, chunk) groups the sender can have
    /// in flight between two polls, or its immediates fail with IBV_WC_RNR_RETRY_EXC_ERR.
    pub recv_depth: u32,
    /// How long a failed lease waits for the sender's "drained" before the queue pair is reset.
    pub quarantine: Duration,
}

/// The decode end: assigns lease tags, counts immediates, and decides when a failed lease's
/// blocks are safe to free (see the module docs).
pub struct RecvLink<O: RecvOps> {
    ops: O,
    tracker: RecvTracker,
    cfg: RecvLinkConfig,
    free_tags: Vec<u16>,
    posted: u32,
    /// Failed leases the sender may still write: event to report, and the reset deadline.
    quarantined: HashMap<u16, (LeaseEvent, Instant)>,
    reset_done: bool,
}

impl<O: RecvOps> RecvLink<O> {
    pub fn new(mut ops: O, cfg: RecvLinkConfig) -> Result<Self> {
        ops.post_recvs(cfg.recv_depth)?;
        Ok(Self {
            ops,
            tracker: RecvTracker::new(),
            cfg,
            free_tags: (0..=Imm::MAX_TAG).rev().collect(),
            posted: cfg.recv_depth,
            quarantined: HashMap::new(),
            reset_done: false,
        })
    }

    /// Opens a lease of `num_layers` layers; the returned tag goes to the sender in the ticket.
    pub fn open_lease(&mut self, num_layers: u32, deadline: Instant) -> Result<u16> {
        if self.reset_done {
            return Err(KvTransferError::RdmaTracker { reason: "queue pair was reset; reconnect".into() });
        }
        let tag = *self.free_tags.last().ok_or_else(|| KvTransferError::RdmaTracker {
            reason: format!("all {} lease tags of this queue pair are in use", Imm::MAX_TAG as u32 + 1),
        })?;
        self.tracker.open(tag, num_layers, deadline)?;
        self.free_tags.pop();
        Ok(tag)
    }

    /// The sender's chunk count arrived (control stream).
    pub fn set_chunks(&mut self, tag: u16, chunks: u32, now: Instant) -> Result<Vec<LeaseEvent>> {
        let e = self.tracker.set_chunks(tag, chunks)?;
        self.settle(e.into_iter().collect(), now)
    }

    /// The sender's chunk count of each layer arrived (see [`RecvTracker::set_layer_chunks`]).
    pub fn set_layer_chunks(&mut self, tag: u16, chunks: &[u32], now: Instant) -> Result<Vec<LeaseEvent>> {
        let e = self.tracker.set_layer_chunks(tag, chunks)?;
        self.settle(e.into_iter().collect(), now)
    }

    /// Cancels a lease; its blocks are reported free after the sender drains or a reset.
    pub fn cancel(&mut self, tag: u16, now: Instant) -> Result<Vec<LeaseEvent>> {
        let e = self.tracker.cancel(tag);
        self.settle(e.into_iter().collect(), now)
    }

    /// The sender reports (control stream) that no write of `tag` is in flight.
    pub fn drained(&mut self, tag: u16) -> Result<Option<LeaseEvent>> {
        match self.quarantined.remove(&tag) {
            Some((event, _)) => {
                self.tracker.release(tag)?;
                self.free_tags.push(tag);
                Ok(Some(event))
            }
            None => Ok(None),
        }
    }

    /// Leases with an entry (active or quarantined).
    pub fn open_leases(&self) -> usize {
        self.tracker.open_leases()
    }

    pub fn is_reset(&self) -> bool {
        self.reset_done
    }

    /// True once the queue pair was reset or failed: it takes no new lease; drop the link.
    pub fn is_broken(&self) -> bool {
        self.reset_done || self.tracker.broken().is_some()
    }

    /// Applies the receive completions available now and the deadlines at `now`; keeps
    /// `recv_depth` receives posted.
    pub fn poll(&mut self, now: Instant) -> Result<Vec<LeaseEvent>> {
        let mut wcs = Vec::new();
        self.ops.poll_recv(&mut wcs)?;
        let mut events = Vec::new();
        for c in wcs {
            self.posted = self.posted.saturating_sub(1);
            match self.tracker.on_recv(c) {
                Ok(e) => events.extend(e),
                // A stray immediate (no such lease) changes nothing; the peer is buggy.
                Err(e) => tracing::warn!(error = %e, "rdma: ignored receive completion"),
            }
        }
        events.extend(self.tracker.on_timeout(now));
        let mut out = self.settle(events, now)?;
        if self.tracker.broken().is_some() && !self.quarantined.is_empty() {
            // The queue pair failed by itself: nothing lands any more, release at once.
            let mut q: Vec<u16> = self.quarantined.keys().copied().collect();
            q.sort_unstable();
            for tag in q {
                out.extend(self.drained(tag)?);
            }
        } else if self.quarantined.values().any(|(_, deadline)| *deadline <= now) {
            out.extend(self.reset()?);
        }
        if !self.reset_done && self.tracker.broken().is_none() && self.posted < self.cfg.recv_depth {
            self.ops.post_recvs(self.cfg.recv_depth - self.posted)?;
            self.posted = self.cfg.recv_depth;
        }
        Ok(out)
    }

    /// Reports what is safe, quarantines what is not.
    fn settle(&mut self, events: Vec<LeaseEvent>, now: Instant) -> Result<Vec<LeaseEvent>> {
        let mut out = Vec::new();
        for e in events {
            match &e.outcome {
                Outcome::Done => {
                    self.free_tags.push(e.tag);
                    out.push(e);
                }
                Outcome::Failed { reason, must_reset_qp: true } => {
                    let safe = LeaseEvent {
                        tag: e.tag,
                        outcome: Outcome::Failed { reason: reason.clone(), must_reset_qp: false },
                    };
                    self.quarantined.insert(e.tag, (safe, now + self.cfg.quarantine));
                }
                Outcome::Failed { must_reset_qp: false, .. } => {
                    self.tracker.release(e.tag)?;
                    self.free_tags.push(e.tag);
                    out.push(e);
                }
            }
        }
        Ok(out)
    }

    /// Resets the queue pair: every quarantined and active lease is reported failed (safe).
    fn reset(&mut self) -> Result<Vec<LeaseEvent>> {
        self.ops.reset()?;
        self.reset_done = true;
        let mut out: Vec<LeaseEvent> = self.quarantined.drain().map(|(_, (e, _))| e).collect();
        out.sort_by_key(|e| e.tag);
        out.extend(self.tracker.on_qp_reset());
        Ok(out)
    }
}
