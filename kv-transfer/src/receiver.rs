//! The sans-IO receiver: leases of destination blocks and the frames that fill them.
//!
//! No tokio, no sockets, no clock: every input carries `now`, every output is a list of
//! [`Effect`]s for a driver to carry out ([`crate::actor`] in a node, the tests directly). The
//! ownership rules it implements are the state machine in the crate docs ([`crate`]).
//!
//! The core here holds what every payload path shares: the lease table, which stream is bound
//! to which lease, expiry, cancellation, `Complete` / `Ack`, and the one release of each lease.
//! What arrives for a lease's payload is checked by the lease's [`LeasePayload`], chosen at its
//! first accepted `Open`: an `Open` that names no link gets a [`StreamLease`] (chunk frames,
//! checked and handed out as [`Effect::Write`]s); one that names a link is bound by the driver's
//! payload path ([`Effect::Bind`], [`Receiver::bound`]), which gives the lease's payload for that
//! link (over RDMA: `Landed` notices, checked once the link reports every write landed,
//! [`Effect::Expect`], [`Receiver::landed`]). The core has no branch on the kind of path.
//!
//! Each lease holds its payload as a `Box<dyn LeasePayload>` rather than the receiver taking a
//! generic parameter: the choice is made per lease at run time (one receiver serves stream and
//! linked leases side by side), the linked implementation comes from the driver's path (behind a
//! feature), and a type parameter would run through the actor, the service and every test to
//! save one allocation per handoff.
//!
//! Invariants:
//! - a lease's blocks appear in exactly one terminal effect: [`Effect::Completed`] (they now
//!   belong to the decode request) or [`Effect::Released`] (they go back to the pool), and
//!   after it the lease is gone from the table;
//! - a lease completes only once its sender sent `Complete` and its payload is
//!   [`LeasePayload::ready`] (every layer of every token in the blocks, checked);
//! - no `Write` is emitted before the stream's `Open` passed the layout check, and none for a
//!   lease after its terminal effect;
//! - a lease's payload is chosen once: an `Open` naming a link binds it only while the lease has
//!   no stream, and a lease over a link takes no second `Open` (until the path refuses the link
//!   as unknown: then the lease is as before that `Open`);
//! - `reserved_blocks()` is the sum of the block counts of live leases.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_protocol::{HandoffTicket, KvLayout, LeaseId, RequestId};

use crate::frame::{AbortCode, ChunkHeader, Control, Frame, Landed, Open};
use crate::payload::{named_link, Expect, LeaseCx, LeasePayload, LinkTag, StreamLease};
use crate::{KvTransferError, Result};

pub use crate::payload::{KvWrite, StreamId};

/// What the driver must do after an input.
#[derive(Debug)]
pub enum Effect {
    /// Write these bytes into these blocks.
    Write(KvWrite),
    /// Send a control frame on a stream.
    Send { stream: StreamId, msg: Control },
    /// Close a stream (after the sends before it).
    Close { stream: StreamId },
    /// Every layer of every token arrived and the sender said it is done: the blocks now belong
    /// to the decode request.
    Completed { lease: LeaseId, request_id: RequestId, blocks: Vec<u32>, first_token: u32 },
    /// The lease ended without completing: the blocks go back to the pool. `link`: the lease was
    /// bound to this tag of a link; if the path still holds the tag, writes may still land, so
    /// the blocks go back only once the path reports the tag safe (see
    /// [`crate::payload::RecvPath`]).
    Released { lease: LeaseId, request_id: RequestId, blocks: Vec<u32>, error: KvTransferError, link: Option<LinkTag> },
    /// An `Open` named link `link` of the driver's payload path: have the path open a lease of
    /// `num_layers` layers on it (until `deadline`) and hand its answer to [`Receiver::bound`].
    Bind { lease: LeaseId, link: u64, stream: StreamId, num_layers: u32, deadline: Instant },
    /// The sender's `Complete` came for a lease whose payload lands by itself: tell its path
    /// what to expect; once it all landed the path says so, then call [`Receiver::landed`].
    Expect { lease: LeaseId, expect: Expect },
    /// A chunk that was dropped without being written (a duplicate, or late for a lease that is
    /// gone), reported for metrics and logs.
    Dropped { stream: StreamId, lease: LeaseId, layer: u32, token_start: u32, why: DropReason },
}

/// Why a chunk was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Its tokens were already received.
    Duplicate,
    /// Its lease completed or was released.
    Late,
}

/// A reservation the decode node made, handed to the receiver to hold.
#[derive(Debug, Clone)]
pub struct LeaseSpec {
    pub request_id: RequestId,
    /// Destination blocks in position order.
    pub blocks: Vec<u32>,
    pub num_tokens: u32,
    /// Leading tokens the blocks already hold ([`HandoffTicket::cached_tokens`]): the lease
    /// covers `cached_tokens..num_tokens`, and a chunk below it is a duplicate.
    pub cached_tokens: u32,
    pub ttl: Duration,
}

/// Counters of a receiver (for tests, stats and metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    pub live_leases: usize,
    pub reserved_blocks: usize,
    pub completed: u64,
    pub released: u64,
    pub duplicates_dropped: u64,
    pub late_dropped: u64,
    pub bytes_written: u64,
}

struct Lease {
    request_id: RequestId,
    blocks: Arc<[u32]>,
    num_tokens: u32,
    cached_tokens: u32,
    expires_at: Instant,
    /// First token and the stream that sent Complete (the Ack goes there).
    complete: Option<(u32, StreamId)>,
    streams: Vec<StreamId>,
    /// How the payload reaches the blocks, chosen at the first accepted `Open`. `None` before
    /// it, and while the path binds the link an `Open` named (see [`Lease::binding`]).
    payload: Option<Box<dyn LeasePayload>>,
}

impl Lease {
    /// An `Open` named a link and the path has not answered yet (a stream is bound, but no
    /// payload chosen).
    fn binding(&self) -> bool {
        self.payload.is_none() && !self.streams.is_empty()
    }

    /// Whether the payload travels over a link (or is being bound to one).
    fn linked(&self) -> bool {
        self.binding() || self.payload.as_ref().is_some_and(|p| p.link().is_some())
    }

    /// The payload (if chosen) and what it may read of the lease.
    fn split<'a>(
        &'a mut self,
        id: LeaseId,
        layout: &'a KvLayout,
    ) -> (Option<&'a mut Box<dyn LeasePayload>>, LeaseCx<'a>) {
        let cx = LeaseCx {
            id,
            request_id: self.request_id,
            blocks: &self.blocks,
            num_tokens: self.num_tokens,
            cached_tokens: self.cached_tokens,
            layout,
        };
        (self.payload.as_mut(), cx)
    }
}

/// A frame for a lease's payload while the path is still binding it.
fn unbound(id: LeaseId) -> KvTransferError {
    KvTransferError::Protocol { reason: format!("a payload frame for {id} before its Accept") }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamState {
    /// No lease bound (new, or its lease ended): chunks on it are late.
    Idle,
    Bound(LeaseId),
}

/// The receiver state machine of one node.
pub struct Receiver {
    layout: KvLayout,
    leases: HashMap<LeaseId, Lease>,
    streams: HashMap<StreamId, StreamState>,
    next_lease: u64,
    stats: ReceiverStats,
}

impl Receiver {
    /// `lease_base` seeds lease ids; a restarted receiver should pick a fresh random one so that
    /// tickets of its previous life name no live lease.
    pub fn new(layout: KvLayout, lease_base: u64) -> Self {
        Self {
            layout,
            leases: HashMap::new(),
            streams: HashMap::new(),
            next_lease: lease_base,
            stats: ReceiverStats::default(),
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Starts holding a reservation. Refuses a block list that does not fit the token count, and
    /// a cached prefix that is not whole blocks below the token count.
    pub fn open_lease(&mut self, now: Instant, spec: LeaseSpec) -> Result<LeaseId> {
        let bs = self.layout.block_size;
        let need = HandoffTicket::blocks_for(spec.num_tokens, bs);
        if spec.num_tokens == 0 || spec.blocks.len() != need {
            return Err(KvTransferError::InvalidRequest {
                reason: format!("{} tokens need {need} blocks of {bs}, got {}", spec.num_tokens, spec.blocks.len()),
            });
        }
        if spec.cached_tokens >= spec.num_tokens || (bs > 0 && !spec.cached_tokens.is_multiple_of(bs)) {
            return Err(KvTransferError::InvalidRequest {
                reason: format!(
                    "{} cached of {} tokens: need whole blocks of {bs} below the token count",
                    spec.cached_tokens, spec.num_tokens
                ),
            });
        }
        let id = loop {
            let id = LeaseId(self.next_lease);
            self.next_lease = self.next_lease.wrapping_add(1);
            if !self.leases.contains_key(&id) {
                break id;
            }
        };
        self.leases.insert(
            id,
            Lease {
                request_id: spec.request_id,
                blocks: spec.blocks.into(),
                num_tokens: spec.num_tokens,
                cached_tokens: spec.cached_tokens,
                expires_at: now + spec.ttl,
                complete: None,
                streams: Vec::new(),
                payload: None,
            },
        );
        Ok(id)
    }

    /// Blocks of a live lease.
    pub fn lease_blocks(&self, lease: LeaseId) -> Option<&[u32]> {
        self.leases.get(&lease).map(|l| &l.blocks[..])
    }

    pub fn stats(&self) -> ReceiverStats {
        let mut s = self.stats.clone();
        s.live_leases = self.leases.len();
        s.reserved_blocks = self.leases.values().map(|l| l.blocks.len()).sum();
        s
    }

    pub fn reserved_blocks(&self) -> usize {
        self.leases.values().map(|l| l.blocks.len()).sum()
    }

    /// The earliest lease expiry, for the driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.leases.values().map(|l| l.expires_at).min()
    }

    /// A new stream was accepted.
    pub fn stream_opened(&mut self, stream: StreamId) {
        self.streams.insert(stream, StreamState::Idle);
    }

    /// One decoded frame from a stream.
    pub fn on_frame(&mut self, now: Instant, stream: StreamId, frame: Frame) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some(state) = self.streams.get(&stream).copied() else {
            // A frame queued before its stream was closed: the stream holds nothing any more.
            if let Frame::Chunk { header: h, .. } = frame {
                self.stats.late_dropped += 1;
                fx.push(Effect::Dropped {
                    stream,
                    lease: h.lease_id,
                    layer: h.layer,
                    token_start: h.token_start,
                    why: DropReason::Late,
                });
            }
            return fx;
        };
        match frame {
            Frame::Control(Control::Open(open)) => self.on_open(now, stream, state, open, &mut fx),
            Frame::Chunk { header, k, v } => self.on_chunk(now, stream, state, header, k, v, &mut fx),
            Frame::Control(Control::Complete { lease_id, first_token }) => {
                if let Some(id) = self.bound_lease(stream, state, lease_id, &mut fx) {
                    self.on_complete(id, first_token, stream, &mut fx);
                }
            }
            Frame::Control(Control::Landed(n)) => self.on_notice(stream, state, n, &mut fx),
            Frame::Control(Control::Abort { lease_id, code, reason }) => {
                if let StreamState::Bound(id) = state {
                    if id == lease_id {
                        let err = KvTransferError::PeerAborted { lease: id, code: code.to_string(), reason };
                        self.release(id, err, &mut fx);
                        return fx;
                    }
                }
                // An abort for something this stream does not hold: nothing to free.
                fx.push(Effect::Close { stream });
                self.streams.remove(&stream);
            }
            Frame::Control(
                other @ (Control::Accept { .. }
                | Control::Ack { .. }
                | Control::LinkOffer { .. }
                | Control::LinkAnswer { .. }
                | Control::Drained { .. }),
            ) => {
                let err = KvTransferError::Protocol { reason: format!("receiver got a sender-bound frame {other:?}") };
                self.stream_failed(stream, state, err, &mut fx);
            }
        }
        fx
    }

    fn on_open(&mut self, now: Instant, stream: StreamId, state: StreamState, open: Open, fx: &mut Vec<Effect>) {
        if let StreamState::Bound(id) = state {
            let err =
                KvTransferError::Protocol { reason: format!("Open for {} on a stream bound to {id}", open.lease_id) };
            self.release(id, err, fx);
            return;
        }
        let abort = |fx: &mut Vec<Effect>, err: &KvTransferError| {
            fx.push(Effect::Send {
                stream,
                msg: Control::Abort { lease_id: open.lease_id, code: AbortCode::of(err), reason: err.to_string() },
            });
            fx.push(Effect::Close { stream });
        };
        let Some(lease) = self.leases.get_mut(&open.lease_id) else {
            abort(fx, &KvTransferError::UnknownLease { lease: open.lease_id });
            self.streams.remove(&stream);
            return;
        };
        if now >= lease.expires_at {
            // The timer has not fired yet; treat it as fired.
            abort(fx, &KvTransferError::LeaseExpired { lease: open.lease_id });
            self.streams.remove(&stream);
            self.release(open.lease_id, KvTransferError::LeaseExpired { lease: open.lease_id }, fx);
            return;
        }
        let link = named_link(&open);
        let mismatch = layout_mismatch(&self.layout, &open.layout).or_else(|| {
            if open.request_id != lease.request_id {
                Some(KvTransferError::InvalidRequest {
                    reason: format!("{} is leased to {}, not {}", open.lease_id, lease.request_id, open.request_id),
                })
            } else if open.num_tokens != lease.num_tokens {
                Some(KvTransferError::InvalidRequest {
                    reason: format!(
                        "{} holds {} tokens, sender has {}",
                        open.lease_id, lease.num_tokens, open.num_tokens
                    ),
                })
            } else if link.is_some() && lease.cached_tokens > 0 {
                Some(KvTransferError::Protocol {
                    reason: format!(
                        "{} holds a cached prefix of {} tokens; a link carries whole prompts only",
                        open.lease_id, lease.cached_tokens
                    ),
                })
            } else if link.is_some() && (open.stream_count != 1 || !lease.streams.is_empty()) {
                Some(KvTransferError::Protocol {
                    reason: format!("a handoff of {} over a link uses exactly one control stream", open.lease_id),
                })
            } else if lease.linked() {
                Some(KvTransferError::Protocol {
                    reason: format!("a second Open for {}, whose payload travels over a link", open.lease_id),
                })
            } else {
                None
            }
        });
        if let Some(err) = mismatch {
            // A sender that cannot write this lease: the handoff is over before any byte moved.
            abort(fx, &err);
            self.streams.remove(&stream);
            self.release(open.lease_id, err, fx);
            return;
        }
        lease.streams.push(stream);
        self.streams.insert(stream, StreamState::Bound(open.lease_id));
        match link {
            None => {
                let (layers, cached) = (self.layout.num_layers, lease.cached_tokens);
                let payload = lease.payload.get_or_insert_with(|| Box::new(StreamLease::new(layers, cached)));
                fx.push(Effect::Send { stream, msg: payload.accept(open.lease_id) });
            }
            Some(link) => fx.push(Effect::Bind {
                lease: open.lease_id,
                link,
                stream,
                num_layers: self.layout.num_layers,
                deadline: lease.expires_at,
            }),
        }
    }

    /// The driver's answer to [`Effect::Bind`]: the lease's payload on the link, or why the link
    /// could not take it (unknown link, no free tag, broken link, no path at all).
    pub fn bound(&mut self, lease: LeaseId, stream: StreamId, payload: Result<Box<dyn LeasePayload>>) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some(l) = self.leases.get_mut(&lease) else { return fx };
        if !l.binding() {
            let err = KvTransferError::Protocol { reason: format!("a link binding for {lease}, which awaits none") };
            self.release(lease, err, &mut fx);
            return fx;
        }
        match payload {
            Ok(payload) => {
                fx.push(Effect::Send { stream, msg: payload.accept(lease) });
                l.payload = Some(payload);
            }
            // A link this receiver does not know (a sender's stale id after a restart or a
            // dropped link): the stream is refused but the lease stays, for the sender to open
            // again over a new link. Nothing was written, so nothing needs freeing.
            Err(err) if AbortCode::of(&err) == AbortCode::UnknownLink => {
                l.streams.retain(|s| *s != stream);
                self.streams.remove(&stream);
                let msg = Control::Abort { lease_id: lease, code: AbortCode::of(&err), reason: err.to_string() };
                fx.push(Effect::Send { stream, msg });
                fx.push(Effect::Close { stream });
            }
            Err(err) => self.release(lease, err, &mut fx),
        }
        fx
    }

    /// The path reported that every write of `lease` landed: its payload checks what it was
    /// told against what landed (`check` computes a notice's checksum from the pool) and the
    /// lease completes.
    pub fn landed(&mut self, lease: LeaseId, mut check: impl FnMut(&[u32], &Landed) -> Result<u32>) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some(l) = self.leases.get_mut(&lease) else { return fx };
        let (Some(payload), cx) = l.split(lease, &self.layout) else { return fx };
        match payload.landed(&cx, &mut check) {
            Ok(bytes) => {
                self.stats.bytes_written += bytes;
                self.maybe_complete(lease, &mut fx);
            }
            Err(err) => self.release(lease, err, &mut fx),
        }
        fx
    }

    fn on_complete(&mut self, id: LeaseId, first_token: u32, stream: StreamId, fx: &mut Vec<Effect>) {
        // Bound streams always name a live lease (release unbinds them).
        let Some(lease) = self.leases.get_mut(&id) else { return };
        if lease.complete.is_some() {
            let err = KvTransferError::Protocol { reason: format!("second Complete for {id}") };
            self.release(id, err, fx);
            return;
        }
        lease.complete = Some((first_token, stream));
        let r = match lease.split(id, &self.layout) {
            (Some(payload), cx) => payload.complete(&cx),
            (None, _) => Err(unbound(id)),
        };
        match r {
            Ok(None) => self.maybe_complete(id, fx),
            Ok(Some(expect)) => fx.push(Effect::Expect { lease: id, expect }),
            Err(err) => self.release(id, err, fx),
        }
    }

    fn on_notice(&mut self, stream: StreamId, state: StreamState, n: Landed, fx: &mut Vec<Effect>) {
        if self.dropped_late(stream, state, n.lease_id, n.layer, n.token_start, fx) {
            return;
        }
        let Some(id) = self.bound_lease(stream, state, n.lease_id, fx) else { return };
        let Some(lease) = self.leases.get_mut(&id) else { return };
        let r = match lease.split(id, &self.layout) {
            (Some(payload), cx) => payload.notice(&cx, n),
            (None, _) => Err(unbound(id)),
        };
        if let Err(err) = r {
            self.release(id, err, fx);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_chunk(
        &mut self,
        now: Instant,
        stream: StreamId,
        state: StreamState,
        h: ChunkHeader,
        k: Bytes,
        v: Bytes,
        fx: &mut Vec<Effect>,
    ) {
        let _ = now;
        if self.dropped_late(stream, state, h.lease_id, h.layer, h.token_start, fx) {
            return;
        }
        let Some(id) = self.bound_lease(stream, state, h.lease_id, fx) else { return };
        // Bound streams always name a live lease (release unbinds them).
        let Some(lease) = self.leases.get_mut(&id) else { return };
        let r = match lease.split(id, &self.layout) {
            (Some(payload), cx) => payload.chunk(&cx, h, k, v),
            (None, _) => Err(unbound(id)),
        };
        match r {
            Ok(Some(w)) => {
                self.stats.bytes_written += (w.k.len() + w.v.len()) as u64;
                fx.push(Effect::Write(w));
                self.maybe_complete(id, fx);
            }
            Ok(None) => {
                self.stats.duplicates_dropped += 1;
                fx.push(Effect::Dropped {
                    stream,
                    lease: id,
                    layer: h.layer,
                    token_start: h.token_start,
                    why: DropReason::Duplicate,
                });
            }
            Err(err) => self.release(id, err, fx),
        }
    }

    /// A chunk or notice on an unbound stream for a lease that is gone is late: dropped quietly
    /// (true) rather than treated as a violation.
    fn dropped_late(
        &mut self,
        stream: StreamId,
        state: StreamState,
        lease: LeaseId,
        layer: u32,
        token_start: u32,
        fx: &mut Vec<Effect>,
    ) -> bool {
        if state != StreamState::Idle || self.leases.contains_key(&lease) {
            return false;
        }
        self.stats.late_dropped += 1;
        fx.push(Effect::Dropped { stream, lease, layer, token_start, why: DropReason::Late });
        true
    }

    /// The lease a frame on `stream` may touch, or `None` after handling the violation.
    fn bound_lease(
        &mut self,
        stream: StreamId,
        state: StreamState,
        lease: LeaseId,
        fx: &mut Vec<Effect>,
    ) -> Option<LeaseId> {
        match state {
            StreamState::Bound(id) if id == lease => Some(id),
            StreamState::Bound(id) => {
                let err = KvTransferError::Protocol { reason: format!("frame for {lease} on a stream bound to {id}") };
                self.release(id, err, fx);
                None
            }
            StreamState::Idle => {
                let err = KvTransferError::Protocol { reason: format!("frame for {lease} before Open") };
                fx.push(Effect::Send {
                    stream,
                    msg: Control::Abort { lease_id: lease, code: AbortCode::of(&err), reason: err.to_string() },
                });
                fx.push(Effect::Close { stream });
                self.streams.remove(&stream);
                None
            }
        }
    }

    fn maybe_complete(&mut self, id: LeaseId, fx: &mut Vec<Effect>) {
        let Some(lease) = self.leases.get(&id) else { return };
        let Some((first_token, ack_stream)) = lease.complete else { return };
        if !lease.payload.as_ref().is_some_and(|p| p.ready()) {
            return;
        }
        let Some(lease) = self.leases.remove(&id) else { return };
        fx.push(Effect::Send { stream: ack_stream, msg: Control::Ack { lease_id: id } });
        for s in &lease.streams {
            self.streams.insert(*s, StreamState::Idle);
        }
        self.stats.completed += 1;
        fx.push(Effect::Completed {
            lease: id,
            request_id: lease.request_id,
            blocks: lease.blocks.to_vec(),
            first_token,
        });
    }

    /// Ends a lease without completion: tells its streams, closes them, frees its blocks.
    fn release(&mut self, id: LeaseId, error: KvTransferError, fx: &mut Vec<Effect>) {
        let Some(lease) = self.leases.remove(&id) else { return };
        let code = AbortCode::of(&error);
        for s in &lease.streams {
            fx.push(Effect::Send { stream: *s, msg: Control::Abort { lease_id: id, code, reason: error.to_string() } });
            fx.push(Effect::Close { stream: *s });
            self.streams.remove(s);
        }
        self.stats.released += 1;
        let link = lease.payload.as_ref().and_then(|p| p.link());
        fx.push(Effect::Released {
            lease: id,
            request_id: lease.request_id,
            blocks: lease.blocks.to_vec(),
            error,
            link,
        });
    }

    fn stream_failed(&mut self, stream: StreamId, state: StreamState, err: KvTransferError, fx: &mut Vec<Effect>) {
        match state {
            StreamState::Bound(id) => self.release(id, err, fx),
            StreamState::Idle => {
                fx.push(Effect::Send {
                    stream,
                    msg: Control::Abort { lease_id: LeaseId(0), code: AbortCode::of(&err), reason: err.to_string() },
                });
                fx.push(Effect::Close { stream });
                self.streams.remove(&stream);
            }
        }
    }

    /// A stream could not be read (malformed or truncated frame, i/o error, idle timeout).
    pub fn on_stream_error(&mut self, now: Instant, stream: StreamId, err: KvTransferError) -> Vec<Effect> {
        let _ = now;
        let mut fx = Vec::new();
        let Some(state) = self.streams.get(&stream).copied() else { return fx };
        self.stream_failed(stream, state, err, &mut fx);
        fx
    }

    /// A stream ended cleanly. If its lease is still incomplete the sender is gone.
    pub fn on_stream_closed(&mut self, now: Instant, stream: StreamId) -> Vec<Effect> {
        let _ = now;
        let mut fx = Vec::new();
        match self.streams.remove(&stream) {
            Some(StreamState::Bound(id)) => {
                let err = KvTransferError::SenderGone {
                    lease: id,
                    reason: "stream closed before the transfer completed".into(),
                };
                self.release(id, err, &mut fx);
            }
            Some(StreamState::Idle) | None => fx.push(Effect::Close { stream }),
        }
        fx
    }

    /// The request was cancelled (by the decode node or the coordinator).
    pub fn cancel(&mut self, lease: LeaseId) -> Vec<Effect> {
        let mut fx = Vec::new();
        self.release(lease, KvTransferError::Cancelled { lease }, &mut fx);
        fx
    }

    /// Ends a lease because the driver could not carry out one of its effects (a failed block
    /// write).
    pub fn fail(&mut self, lease: LeaseId, error: KvTransferError) -> Vec<Effect> {
        let mut fx = Vec::new();
        self.release(lease, error, &mut fx);
        fx
    }

    /// Releases every lease whose expiry is at or before `now`.
    pub fn poll_expired(&mut self, now: Instant) -> Vec<Effect> {
        let mut fx = Vec::new();
        let mut expired: Vec<LeaseId> =
            self.leases.iter().filter(|(_, l)| l.expires_at <= now).map(|(id, _)| *id).collect();
        expired.sort();
        for id in expired {
            self.release(id, KvTransferError::LeaseExpired { lease: id }, &mut fx);
        }
        fx
    }
}

/// The first field on which two layouts differ, as an error.
pub fn layout_mismatch(ours: &KvLayout, theirs: &KvLayout) -> Option<KvTransferError> {
    let field =
        |field: &'static str, a: String, b: String| Some(KvTransferError::LayoutMismatch { field, ours: a, theirs: b });
    if ours.model_fingerprint != theirs.model_fingerprint {
        return field(
            "model_fingerprint",
            format!("{:#x}", ours.model_fingerprint),
            format!("{:#x}", theirs.model_fingerprint),
        );
    }
    if ours.dtype != theirs.dtype {
        return field("dtype", format!("{:?}", ours.dtype), format!("{:?}", theirs.dtype));
    }
    if ours.num_layers != theirs.num_layers {
        return field("num_layers", ours.num_layers.to_string(), theirs.num_layers.to_string());
    }
    if ours.num_kv_heads != theirs.num_kv_heads {
        return field("num_kv_heads", ours.num_kv_heads.to_string(), theirs.num_kv_heads.to_string());
    }
    if ours.head_dim != theirs.head_dim {
        return field("head_dim", ours.head_dim.to_string(), theirs.head_dim.to_string());
    }
    if ours.block_size != theirs.block_size {
        return field("block_size", ours.block_size.to_string(), theirs.block_size.to_string());
    }
    None
}
