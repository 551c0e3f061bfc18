//! Completion handling, sans-IO: the sender's [`SendTracker`] (posted work requests, send
//! completions in any order, error completions, lease deadlines) and the receiver's
//! [`RecvTracker`] (immediates of WRITE WITH IMMEDIATE, which (lease, layer, chunk) groups have
//! landed). Time is passed in; nothing here touches a device.
//!
//! Lease outcome state machine (both sides; a lease is named by its tag on one queue pair):
//!
//! ```text
//!            open                     all groups complete
//!   (none) -------> Active ----------------------------------> Written / Complete
//!                     |  error completion on this lease's WR
//!                     |  error completion on another lease (the QP is in the error state)
//!                     |  deadline passed (on_timeout) / cancel
//!                     v
//!                   Failed(reason) --(receiver: release after the QP is reset)--> (none)
//! ```
//!
//! Every lease reaches exactly one outcome, reported once. Ownership of the receiver's blocks:
//! while a lease is Active they belong to the transfer; on Complete they pass to the decode
//! engine; on Failed the receiver frees them, but only after no write of the lease can still
//! land: when `must_reset_qp` is set (the queue pair is still healthy, so the sender may still
//! be writing), the receiver first moves the queue pair to the error state (or destroys it),
//! then frees the blocks and calls [`RecvTracker::release`]. A failure caused by an error
//! completion needs no reset: a reliable-connected queue pair in the error state accepts no
//! more writes.
//!
//! The sender's send-queue accounting: a signaled work request's completion frees its slot and
//! the slots of the unsignaled requests posted before it since the previous signaled one (the
//! verbs rule), so `post` requires each batch to end with a signaled request. Once the queue
//! pair has failed, every outstanding request completes (flushed), signaled or not; requests
//! that succeeded silently just before the failure never report, so `slots_used` may stay above
//! zero on a broken queue pair, which takes no more posts anyway.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Instant;

use super::layout::Imm;
use super::plan::RdmaWrite;
use crate::error::{KvTransferError, Result};

/// Status of a work completion, as far as the trackers care (`ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    Success,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer stopped acknowledging (dead node, broken link).
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the receiver had no receive posted for an immediate.
    RnrRetryExceeded,
    /// `IBV_WC_REM_ACCESS_ERR`: bad rkey or address outside the remote region.
    RemoteAccess,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because the queue pair was already in the error state.
    Flushed,
    /// Any other status code.
    Other(u32),
}

impl WcStatus {
    /// From the numeric `ibv_wc_status` (values fixed by the verbs ABI).
    pub fn from_verbs(code: u32) -> Self {
        match code {
            0 => Self::Success,
            12 => Self::RetryExceeded,
            13 => Self::RnrRetryExceeded,
            10 => Self::RemoteAccess,
            5 => Self::Flushed,
            other => Self::Other(other),
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Success => f.write_str("success"),
            Self::RetryExceeded => f.write_str("IBV_WC_RETRY_EXC_ERR (peer unreachable)"),
            Self::RnrRetryExceeded => f.write_str("IBV_WC_RNR_RETRY_EXC_ERR (receiver posted no receive)"),
            Self::RemoteAccess => f.write_str("IBV_WC_REM_ACCESS_ERR (bad rkey or address)"),
            Self::Flushed => f.write_str("IBV_WC_WR_FLUSH_ERR (queue pair in error state)"),
            Self::Other(c) => write!(f, "ibv_wc_status {c}"),
        }
    }
}

/// A send-side work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub vendor_err: u32,
}

/// Why a lease failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailReason {
    /// A work request of this lease completed with an error.
    Completion {
        wr_id: u64,
        status: WcStatus,
        vendor_err: u32,
    },
    /// Another lease's work request failed first; the queue pair is in the error state.
    QueuePairBroken {
        status: WcStatus,
    },
    /// The lease's deadline passed with `missing` signaled writes (sender) or groups
    /// (receiver) outstanding.
    TimedOut {
        missing: u64,
    },
    Cancelled,
    /// The peer broke the protocol (duplicate or out-of-range immediate, ...).
    Protocol {
        reason: String,
    },
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Completion { wr_id, status, vendor_err } => {
                write!(f, "work request {wr_id} failed: {status} (vendor {vendor_err:#x})")
            }
            Self::QueuePairBroken { status } => write!(f, "queue pair broken by an earlier completion: {status}"),
            Self::TimedOut { missing } => write!(f, "deadline passed with {missing} outstanding"),
            Self::Cancelled => f.write_str("cancelled"),
            Self::Protocol { reason } => write!(f, "protocol violation: {reason}"),
        }
    }
}

/// What happened to a lease, reported once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Sender: every posted write completed after `finish`. Receiver: every (layer, chunk)
    /// group arrived.
    Done,
    /// `must_reset_qp` (receiver only; always false on the sender): writes of this lease may still
    /// land, so reset the queue pair before freeing the blocks.
    Failed { reason: FailReason, must_reset_qp: bool },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEvent {
    pub tag: u16,
    pub outcome: Outcome,
}

fn tracker_err(reason: String) -> KvTransferError {
    KvTransferError::RdmaTracker { reason }
}

#[derive(Debug, Clone, Copy)]
struct PostedWr {
    tag: u16,
    signaled: bool,
    /// First wr_id of the run this request belongs to (runs end with a signaled request).
    run_start: u64,
}

#[derive(Debug)]
struct SendLease {
    deadline: Instant,
    /// Signaled work requests posted and not completed.
    outstanding: u64,
    finished: bool,
    /// Some once the outcome was reported; the entry stays until `outstanding` is 0.
    reported: bool,
}

/// The sender's view of one queue pair's send queue.
#[derive(Debug)]
pub struct SendTracker {
    sq_depth: u32,
    used: u32,
    next_wr_id: u64,
    /// Every posted wr_id whose completion (or a covering one) has not been seen.
    inflight: BTreeMap<u64, PostedWr>,
    leases: HashMap<u16, SendLease>,
    broken: Option<WcStatus>,
}

impl SendTracker {
    pub fn new(sq_depth: u32) -> Self {
        Self { sq_depth, used: 0, next_wr_id: 1, inflight: BTreeMap::new(), leases: HashMap::new(), broken: None }
    }

    /// Send-queue slots in use (posted, completion not yet seen).
    pub fn slots_used(&self) -> u32 {
        self.used
    }

    /// Send-queue slots free for the next `post`.
    pub fn room(&self) -> u32 {
        self.sq_depth - self.used
    }

    /// True when the lease has no entry: never opened, or ended with nothing in flight (the
    /// moment a sender may tell the receiver that no write of this lease can still land).
    pub fn is_drained(&self, tag: u16) -> bool {
        !self.leases.contains_key(&tag)
    }

    /// The first error status seen; every post after it is refused.
    pub fn broken(&self) -> Option<WcStatus> {
        self.broken
    }

    /// Leases with an entry (active, or failed with completions still due).
    pub fn open_leases(&self) -> usize {
        self.leases.len()
    }

    pub fn open(&mut self, tag: u16, deadline: Instant) -> Result<()> {
        if self.leases.contains_key(&tag) {
            return Err(tracker_err(format!("lease tag {tag} is already open")));
        }
        if let Some(s) = self.broken {
            return Err(tracker_err(format!("queue pair is broken ({s})")));
        }
        self.leases.insert(tag, SendLease { deadline, outstanding: 0, finished: false, reported: false });
        Ok(())
    }

    /// Claims send-queue slots for `writes` (one group or several, ending with a signaled write)
    /// and returns their wr_ids, in order. Refused without side effects when the lease is not
    /// active, the queue pair is broken, or the queue lacks room (poll completions, then retry).
    pub fn post(&mut self, tag: u16, writes: &[RdmaWrite]) -> Result<Vec<u64>> {
        let lease = self.leases.get(&tag).ok_or_else(|| tracker_err(format!("post on unknown lease tag {tag}")))?;
        if lease.reported || lease.finished {
            return Err(tracker_err(format!("post on lease tag {tag} after its end")));
        }
        if let Some(s) = self.broken {
            return Err(tracker_err(format!("queue pair is broken ({s})")));
        }
        match writes.last() {
            None => return Ok(Vec::new()),
            Some(w) if !w.signaled => return Err(tracker_err("a batch must end with a signaled write".into())),
            Some(_) => {}
        }
        let n = u32::try_from(writes.len()).unwrap_or(u32::MAX);
        if n > self.sq_depth - self.used {
            return Err(tracker_err(format!(
                "send queue full: need {n} slots, {} free of {}",
                self.sq_depth - self.used,
                self.sq_depth
            )));
        }
        let mut ids = Vec::with_capacity(writes.len());
        let mut run_start = self.next_wr_id;
        let mut signaled = 0;
        for w in writes {
            let id = self.next_wr_id;
            self.next_wr_id += 1;
            self.inflight.insert(id, PostedWr { tag, signaled: w.signaled, run_start });
            if w.signaled {
                run_start = id + 1;
                signaled += 1;
            }
            ids.push(id);
        }
        self.used += n;
        if let Some(l) = self.leases.get_mut(&tag) {
            l.outstanding += signaled;
        }
        Ok(ids)
    }

    /// The sender posted its last group for `tag`; reports `Done` now if nothing is outstanding.
    pub fn finish(&mut self, tag: u16) -> Result<Option<LeaseEvent>> {
        let l = self.leases.get_mut(&tag).ok_or_else(|| tracker_err(format!("finish on unknown lease tag {tag}")))?;
        if l.reported {
            return Ok(None);
        }
        l.finished = true;
        Ok(self.settle(tag))
    }

    /// Gives up on a lease; its in-flight completions are still absorbed later.
    pub fn cancel(&mut self, tag: u16) -> Option<LeaseEvent> {
        self.fail(tag, FailReason::Cancelled)
    }

    /// Applies one completion. An unknown or repeated wr_id is an error and changes nothing,
    /// except a flush on a broken queue pair (verbs flushes every outstanding request, signaled
    /// or not, and some of those were already accounted for by a covering completion).
    ///
    /// A successful signaled completion retires its whole run (the unsignaled requests posted
    /// before it since the previous signaled one); an error or flush completion retires only
    /// its own request, since each outstanding request gets one once the queue pair failed.
    pub fn on_completion(&mut self, c: SendCompletion) -> Result<Vec<LeaseEvent>> {
        let Some(wr) = self.inflight.get(&c.wr_id).copied() else {
            if self.broken.is_some() && c.status == WcStatus::Flushed {
                return Ok(Vec::new());
            }
            return Err(tracker_err(format!("completion for unknown or already completed wr_id {}", c.wr_id)));
        };
        let tag = wr.tag;
        if c.status == WcStatus::Success {
            let run: Vec<u64> = self.inflight.range(wr.run_start..=c.wr_id).map(|(id, _)| *id).collect();
            for id in &run {
                self.inflight.remove(id);
            }
            self.used -= run.len() as u32;
        } else {
            self.inflight.remove(&c.wr_id);
            self.used -= 1;
        }
        if wr.signaled {
            if let Some(l) = self.leases.get_mut(&tag) {
                l.outstanding -= 1;
            }
        }
        let mut events = Vec::new();
        if c.status != WcStatus::Success {
            if self.broken.is_none() {
                self.broken = Some(c.status);
            }
            let first = self.broken.unwrap_or(c.status);
            let reason = if c.status == WcStatus::Flushed {
                FailReason::QueuePairBroken { status: first }
            } else {
                FailReason::Completion { wr_id: c.wr_id, status: c.status, vendor_err: c.vendor_err }
            };
            events.extend(self.fail(tag, reason));
            let mut others: Vec<u16> = self.leases.keys().copied().filter(|t| *t != tag).collect();
            others.sort_unstable();
            for t in others {
                events.extend(self.fail(t, FailReason::QueuePairBroken { status: first }));
            }
        }
        events.extend(self.settle(tag));
        Ok(events)
    }

    /// Fails every active lease whose deadline is at or before `now`.
    pub fn on_timeout(&mut self, now: Instant) -> Vec<LeaseEvent> {
        let mut due: Vec<u16> =
            self.leases.iter().filter(|(_, l)| !l.reported && l.deadline <= now).map(|(t, _)| *t).collect();
        due.sort_unstable();
        due.into_iter()
            .filter_map(|t| {
                let missing = self.leases[&t].outstanding;
                self.fail(t, FailReason::TimedOut { missing })
            })
            .collect()
    }

    /// The earliest deadline of an active lease, for the driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.leases.values().filter(|l| !l.reported).map(|l| l.deadline).min()
    }

    fn fail(&mut self, tag: u16, reason: FailReason) -> Option<LeaseEvent> {
        let l = self.leases.get_mut(&tag)?;
        if l.reported {
            return None;
        }
        l.reported = true;
        let event = LeaseEvent { tag, outcome: Outcome::Failed { reason, must_reset_qp: false } };
        if l.outstanding == 0 {
            self.leases.remove(&tag);
        }
        Some(event)
    }

    /// Reports Done when finished and drained; drops reported entries once drained.
    fn settle(&mut self, tag: u16) -> Option<LeaseEvent> {
        let l = self.leases.get(&tag)?;
        if l.outstanding > 0 {
            return None;
        }
        let done = !l.reported && l.finished;
        if l.reported || done {
            self.leases.remove(&tag);
        }
        done.then_some(LeaseEvent { tag, outcome: Outcome::Done })
    }
}

/// A receive-side work completion (one per WRITE WITH IMMEDIATE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvCompletion {
    pub status: WcStatus,
    /// Host-order immediate; `None` when the completion carried none.
    pub imm: Option<u32>,
}

#[derive(Debug)]
struct RecvLease {
    num_layers: u32,
    /// Chunks (write groups) of each layer, once the sender said (over the control stream).
    chunks: Option<Vec<u32>>,
    deadline: Instant,
    arrived: HashSet<(u16, u8)>,
    /// Failed and waiting for `release` (late immediates are absorbed meanwhile).
    failed: bool,
}

/// The receiver's view of one queue pair: which groups of which leases have landed.
#[derive(Debug, Default)]
pub struct RecvTracker {
    leases: HashMap<u16, RecvLease>,
    broken: Option<WcStatus>,
}

impl RecvTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Tags with an entry (active or failed and not yet released).
    pub fn open_leases(&self) -> usize {
        self.leases.len()
    }

    pub fn broken(&self) -> Option<WcStatus> {
        self.broken
    }

    pub fn open(&mut self, tag: u16, num_layers: u32, deadline: Instant) -> Result<()> {
        if tag > Imm::MAX_TAG || num_layers == 0 || num_layers > Imm::MAX_LAYER + 1 {
            return Err(tracker_err(format!("lease tag {tag} / {num_layers} layers out of range")));
        }
        if self.leases.contains_key(&tag) {
            return Err(tracker_err(format!("lease tag {tag} is already open")));
        }
        if let Some(s) = self.broken {
            return Err(tracker_err(format!("queue pair is broken ({s})")));
        }
        self.leases
            .insert(tag, RecvLease { num_layers, chunks: None, deadline, arrived: HashSet::new(), failed: false });
        Ok(())
    }

    /// The sender announced `chunks` chunks in all, the same for every layer.
    pub fn set_chunks(&mut self, tag: u16, chunks: u32) -> Result<Option<LeaseEvent>> {
        let layers = self.leases.get(&tag).map_or(1, |l| l.num_layers as usize);
        self.set_layer_chunks(tag, &vec![chunks; layers])
    }

    /// The sender announced `chunks[l]` chunks (write groups) of layer `l`: layers may have been
    /// chunked differently (a prefill preempted between two layers resumes where each stopped).
    pub fn set_layer_chunks(&mut self, tag: u16, chunks: &[u32]) -> Result<Option<LeaseEvent>> {
        let l =
            self.leases.get_mut(&tag).ok_or_else(|| tracker_err(format!("chunk count for unknown lease tag {tag}")))?;
        if l.failed {
            return Ok(None);
        }
        if l.chunks.is_some() {
            return Ok(self.fail(tag, protocol("chunk count announced twice".into()), true));
        }
        let bad_len = chunks.len() != l.num_layers as usize;
        if bad_len || chunks.iter().any(|c| *c == 0 || *c > Imm::MAX_CHUNK as u32 + 1) {
            return Ok(self.fail(tag, protocol(format!("chunk counts {chunks:?} out of range")), true));
        }
        if let Some((c, layer)) = l.arrived.iter().find(|(c, layer)| *c as u32 >= chunks[*layer as usize]) {
            let (c, layer) = (*c, *layer);
            let n = chunks[layer as usize];
            return Ok(self.fail(
                tag,
                protocol(format!("layer {layer} chunk {c} arrived but only {n} announced")),
                true,
            ));
        }
        l.chunks = Some(chunks.to_vec());
        Ok(self.settle(tag))
    }

    /// Applies one receive completion. An immediate for a tag with no entry is an error that
    /// changes nothing (the caller counts it); one for a failed, unreleased lease is absorbed.
    pub fn on_recv(&mut self, c: RecvCompletion) -> Result<Vec<LeaseEvent>> {
        if c.status != WcStatus::Success {
            let first = *self.broken.get_or_insert(c.status);
            return Ok(self.fail_all(FailReason::QueuePairBroken { status: first }, false));
        }
        let imm = c.imm.ok_or_else(|| tracker_err("receive completion without an immediate".into()))?;
        let imm = Imm::decode(imm);
        let l = self
            .leases
            .get_mut(&imm.tag)
            .ok_or_else(|| tracker_err(format!("immediate {imm:?} names no open lease")))?;
        if l.failed {
            return Ok(Vec::new());
        }
        if imm.layer as u32 >= l.num_layers {
            let r = protocol(format!("layer {} of {}", imm.layer, l.num_layers));
            return Ok(self.fail(imm.tag, r, true).into_iter().collect());
        }
        if l.chunks.as_ref().is_some_and(|n| imm.chunk as u32 >= n[imm.layer as usize]) {
            let r = protocol(format!("chunk {} beyond the announced count", imm.chunk));
            return Ok(self.fail(imm.tag, r, true).into_iter().collect());
        }
        if !l.arrived.insert((imm.chunk, imm.layer)) {
            let r = protocol(format!("duplicate immediate for layer {} chunk {}", imm.layer, imm.chunk));
            return Ok(self.fail(imm.tag, r, true).into_iter().collect());
        }
        Ok(self.settle(imm.tag).into_iter().collect())
    }

    /// Fails every active lease whose deadline is at or before `now`.
    pub fn on_timeout(&mut self, now: Instant) -> Vec<LeaseEvent> {
        let mut due: Vec<u16> =
            self.leases.iter().filter(|(_, l)| !l.failed && l.deadline <= now).map(|(t, _)| *t).collect();
        due.sort_unstable();
        due.into_iter()
            .filter_map(|t| {
                let l = &self.leases[&t];
                let expected = l.chunks.as_ref().map_or(0, |c| c.iter().map(|n| *n as u64).sum());
                let missing = expected.saturating_sub(l.arrived.len() as u64).max(1);
                self.fail(t, FailReason::TimedOut { missing }, true)
            })
            .collect()
    }

    pub fn cancel(&mut self, tag: u16) -> Option<LeaseEvent> {
        self.fail(tag, FailReason::Cancelled, true)
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.leases.values().filter(|l| !l.failed).map(|l| l.deadline).min()
    }

    /// Forgets a failed lease once no write of it can land (after the queue-pair reset the
    /// failure asked for): its tag may then be reused.
    pub fn release(&mut self, tag: u16) -> Result<()> {
        match self.leases.get(&tag) {
            Some(l) if l.failed => {
                self.leases.remove(&tag);
                Ok(())
            }
            Some(_) => Err(tracker_err(format!("release of active lease tag {tag}; cancel it first"))),
            None => Err(tracker_err(format!("release of unknown lease tag {tag}"))),
        }
    }

    /// The queue pair was reset or destroyed: fail what is active (no further reset needed) and
    /// forget every lease. The tracker then accepts new leases (for the next queue pair).
    pub fn on_qp_reset(&mut self) -> Vec<LeaseEvent> {
        let events = self.fail_all(FailReason::QueuePairBroken { status: WcStatus::Flushed }, false);
        self.leases.clear();
        self.broken = None;
        events
    }

    fn fail_all(&mut self, reason: FailReason, must_reset_qp: bool) -> Vec<LeaseEvent> {
        let mut tags: Vec<u16> = self.leases.keys().copied().collect();
        tags.sort_unstable();
        tags.into_iter().filter_map(|t| self.fail(t, reason.clone(), must_reset_qp)).collect()
    }

    fn fail(&mut self, tag: u16, reason: FailReason, must_reset_qp: bool) -> Option<LeaseEvent> {
        let l = self.leases.get_mut(&tag)?;
        if l.failed {
            return None;
        }
        l.failed = true;
        let must_reset_qp = must_reset_qp && self.broken.is_none();
        Some(LeaseEvent { tag, outcome: Outcome::Failed { reason, must_reset_qp } })
    }

    fn settle(&mut self, tag: u16) -> Option<LeaseEvent> {
        let l = self.leases.get(&tag)?;
        let n: u64 = l.chunks.as_ref()?.iter().map(|c| *c as u64).sum();
        if l.failed || (l.arrived.len() as u64) < n {
            return None;
        }
        self.leases.remove(&tag);
        Some(LeaseEvent { tag, outcome: Outcome::Done })
    }
}

fn protocol(reason: String) -> FailReason {
    FailReason::Protocol { reason }
}
