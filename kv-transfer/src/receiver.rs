//! The sans-IO receiver: leases of destination blocks and the frames that fill them.
//!
//! No tokio, no sockets, no clock: every input carries `now`, every output is a list of
//! [`Effect`]s for a driver to carry out ([`crate::actor`] in a node, the tests directly). The
//! ownership rules it implements are the state machine in the crate docs ([`crate`]).
//!
//! Invariants:
//! - a lease's blocks appear in exactly one terminal effect: [`Effect::Completed`] (they now
//!   belong to the decode request) or [`Effect::Released`] (they go back to the pool), and
//!   after it the lease is gone from the table;
//! - for every live lease and layer, tokens `[0, next[layer])` have been handed out as
//!   [`Effect::Write`]s exactly once, in token order, each with a verified checksum;
//! - no `Write` is emitted before the stream's `Open` passed the layout check;
//! - `reserved_blocks()` is the sum of the block counts of live leases.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_protocol::{HandoffTicket, KvLayout, LeaseId, RequestId};

use crate::frame::{check_chunk_lengths, checksum, run_bytes, AbortCode, ChunkHeader, Control, Frame, Landed, Open};
use crate::{KvTransferError, Result};

pub use crate::payload::StreamId;

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
    /// The lease ended without completing: the blocks go back to the pool. `rdma`: the lease
    /// was bound to this (link, tag); if the link still holds the tag, writes may still land,
    /// so the blocks go back only once the path reports the tag safe (see [`crate::payload::RecvPath`]).
    Released {
        lease: LeaseId,
        request_id: RequestId,
        blocks: Vec<u32>,
        error: KvTransferError,
        rdma: Option<(u64, u16)>,
    },
    /// An `Open` named RDMA link `link`: open a lease of `num_layers` layers on it (until
    /// `deadline`) and report the tag with [`Receiver::rdma_bound`].
    BindRdma { lease: LeaseId, link: u64, stream: StreamId, num_layers: u32, deadline: Instant },
    /// Every notice of an RDMA lease arrived and the sender sent `Complete`: tell the link that
    /// layer `l` has `chunks[l]` write groups; its `Done` comes once they all landed, then call
    /// [`Receiver::rdma_landed`].
    SetChunks { lease: LeaseId, link: u64, tag: u16, chunks: Vec<u32> },
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
    expires_at: Instant,
    /// Next expected token per layer.
    next: Vec<u32>,
    layers_done: u32,
    /// First token and the stream that sent Complete (the Ack goes there).
    complete: Option<(u32, StreamId)>,
    streams: Vec<StreamId>,
    /// Set when the payload travels over an RDMA link.
    rdma: Option<RdmaLease>,
}

/// An RDMA lease's side of the handoff: the payload lands by itself; the stream carries a
/// [`Landed`] notice per (layer, chunk) group, checked against the pool once every group landed.
struct RdmaLease {
    link: u64,
    /// The link's tag, once [`Receiver::rdma_bound`] reported it.
    tag: Option<u16>,
    notices: Vec<Landed>,
    /// Notices so far per layer (the next expected chunk index).
    chunks: Vec<u32>,
    /// The link reported every group landed and every checksum matched.
    verified: bool,
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

    /// Starts holding a reservation. Refuses a block list that does not fit the token count.
    pub fn open_lease(&mut self, now: Instant, spec: LeaseSpec) -> Result<LeaseId> {
        let need = HandoffTicket::blocks_for(spec.num_tokens, self.layout.block_size);
        if spec.num_tokens == 0 || spec.blocks.len() != need {
            return Err(KvTransferError::InvalidRequest {
                reason: format!(
                    "{} tokens need {need} blocks of {}, got {}",
                    spec.num_tokens,
                    self.layout.block_size,
                    spec.blocks.len()
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
                expires_at: now + spec.ttl,
                next: vec![0; self.layout.num_layers as usize],
                layers_done: 0,
                complete: None,
                streams: Vec::new(),
                rdma: None,
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
                    // Bound streams always name a live lease (release unbinds them).
                    let Some(lease) = self.leases.get_mut(&id) else { return fx };
                    if lease.complete.is_some() {
                        let err = KvTransferError::Protocol { reason: format!("second Complete for {id}") };
                        self.release(id, err, &mut fx);
                    } else {
                        lease.complete = Some((first_token, stream));
                        if lease.rdma.is_some() {
                            self.rdma_complete(id, &mut fx);
                        } else {
                            self.maybe_complete(id, &mut fx);
                        }
                    }
                }
            }
            Frame::Control(Control::Landed(n)) => self.on_landed(stream, state, n, &mut fx),
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
            } else if open.rdma_link.is_some() && (open.stream_count != 1 || !lease.streams.is_empty()) {
                Some(KvTransferError::Protocol {
                    reason: format!("an RDMA handoff of {} uses exactly one control stream", open.lease_id),
                })
            } else if lease.rdma.is_some() {
                Some(KvTransferError::Protocol {
                    reason: format!("a second Open for {}, whose payload travels over RDMA", open.lease_id),
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
        match open.rdma_link {
            None => fx.push(Effect::Send { stream, msg: Control::Accept { lease_id: open.lease_id, rdma_tag: None } }),
            Some(link) => {
                let layers = self.layout.num_layers as usize;
                lease.rdma =
                    Some(RdmaLease { link, tag: None, notices: Vec::new(), chunks: vec![0; layers], verified: false });
                fx.push(Effect::BindRdma {
                    lease: open.lease_id,
                    link,
                    stream,
                    num_layers: self.layout.num_layers,
                    deadline: lease.expires_at,
                });
            }
        }
    }

    /// The driver's answer to [`Effect::BindRdma`]: the lease's tag on the link, or why the link
    /// could not take it (unknown link, no free tag, broken queue pair).
    pub fn rdma_bound(&mut self, lease: LeaseId, stream: StreamId, tag: Result<u16>) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some(l) = self.leases.get_mut(&lease) else { return fx };
        let Some(r) = l.rdma.as_mut().filter(|r| r.tag.is_none()) else {
            let err = KvTransferError::Protocol { reason: format!("an RDMA tag for {lease}, which awaits none") };
            self.release(lease, err, &mut fx);
            return fx;
        };
        match tag {
            Ok(tag) => {
                r.tag = Some(tag);
                fx.push(Effect::Send { stream, msg: Control::Accept { lease_id: lease, rdma_tag: Some(tag) } });
            }
            // A link this receiver does not know (a sender's stale id after a restart or a
            // dropped link): the stream is refused but the lease stays, for the sender to open
            // again over a new link. Nothing was written, so nothing needs freeing.
            Err(err @ KvTransferError::RdmaUnknownLink { .. }) => {
                l.rdma = None;
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

    fn on_landed(&mut self, stream: StreamId, state: StreamState, n: Landed, fx: &mut Vec<Effect>) {
        if self.dropped_late(stream, state, n.lease_id, n.layer, n.token_start, fx) {
            return;
        }
        let Some(id) = self.bound_lease(stream, state, n.lease_id, fx) else { return };
        let Some(lease) = self.leases.get_mut(&id) else { return };
        let end = n.token_start as u64 + n.token_count as u64;
        let err = match lease.rdma.as_mut() {
            None => Some(KvTransferError::Protocol { reason: format!("a Landed notice for {id}, not an RDMA lease") }),
            Some(r) if r.tag.is_none() || lease.complete.is_some() => Some(KvTransferError::Protocol {
                reason: format!("a Landed notice for {id} before its Accept or after its Complete"),
            }),
            Some(_) if n.layer >= self.layout.num_layers || n.token_count == 0 || end > lease.num_tokens as u64 => {
                Some(KvTransferError::ChunkOutOfBounds {
                    lease: id,
                    reason: format!("layer {} tokens {}..{end} of {}", n.layer, n.token_start, lease.num_tokens),
                })
            }
            Some(_) if n.token_start != lease.next[n.layer as usize] => Some(KvTransferError::ChunkGap {
                lease: id,
                layer: n.layer,
                expected: lease.next[n.layer as usize],
                got: n.token_start,
            }),
            Some(r) if n.chunk != r.chunks[n.layer as usize] => Some(KvTransferError::Protocol {
                reason: format!(
                    "{id} layer {}: notice of chunk {}, chunk {} expected",
                    n.layer, n.chunk, r.chunks[n.layer as usize]
                ),
            }),
            Some(r) => {
                r.chunks[n.layer as usize] += 1;
                r.notices.push(n);
                lease.next[n.layer as usize] = end as u32;
                if end as u32 == lease.num_tokens {
                    lease.layers_done += 1;
                }
                None
            }
        };
        if let Some(err) = err {
            self.release(id, err, fx);
        }
    }

    /// `Complete` on an RDMA lease: every layer must have every token (in any number of chunks:
    /// a preempted prefill may have chunked its layers differently).
    fn rdma_complete(&mut self, id: LeaseId, fx: &mut Vec<Effect>) {
        let Some(lease) = self.leases.get(&id) else { return };
        let Some(r) = lease.rdma.as_ref() else { return };
        let short = lease.next.iter().enumerate().find(|(_, n)| **n != lease.num_tokens);
        let err = short.map(|(layer, next)| KvTransferError::ChunkGap {
            lease: id,
            layer: layer as u32,
            expected: *next,
            got: lease.num_tokens,
        });
        match (err, r.tag) {
            (Some(err), _) => self.release(id, err, fx),
            (None, Some(tag)) => fx.push(Effect::SetChunks { lease: id, link: r.link, tag, chunks: r.chunks.clone() }),
            (None, None) => {}
        }
    }

    /// The link reported every write group of `lease` landed: checks each notice's checksum
    /// against what landed (`landed(blocks, notice)` computes it from the pool) and completes.
    pub fn rdma_landed(
        &mut self,
        lease: LeaseId,
        mut landed: impl FnMut(&[u32], &Landed) -> Result<u32>,
    ) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some(l) = self.leases.get_mut(&lease) else { return fx };
        let Some(r) = l.rdma.as_mut() else { return fx };
        let mut failure = None;
        for n in &r.notices {
            match landed(&l.blocks, n) {
                Ok(got) if got == n.crc32 => {}
                Ok(got) => {
                    failure = Some(KvTransferError::ChecksumMismatch {
                        lease,
                        layer: n.layer,
                        token_start: n.token_start,
                        token_count: n.token_count,
                        expected: n.crc32,
                        got,
                    });
                    break;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        match failure {
            Some(err) => self.release(lease, err, &mut fx),
            None => {
                r.verified = true;
                let tokens: u64 = r.notices.iter().map(|n| n.token_count as u64).sum();
                self.stats.bytes_written += 2 * tokens * run_bytes(&self.layout, 1) as u64;
                self.maybe_complete(lease, &mut fx);
            }
        }
        fx
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
        if self.leases.get(&id).is_some_and(|l| l.rdma.is_some()) {
            let err = KvTransferError::Protocol {
                reason: format!("a payload chunk for {id}, whose payload travels over RDMA"),
            };
            self.release(id, err, fx);
            return;
        }
        if let Err(err) = check_chunk_lengths(&h, k.len() + v.len(), Some(&self.layout)) {
            self.release(id, err, fx);
            return;
        }
        // Bound streams always name a live lease (release unbinds them).
        let Some(lease) = self.leases.get_mut(&id) else { return };
        let end = h.token_start as u64 + h.token_count as u64;
        if end > lease.num_tokens as u64 {
            let err = KvTransferError::ChunkOutOfBounds {
                lease: id,
                reason: format!("layer {} tokens {}..{end} past {}", h.layer, h.token_start, lease.num_tokens),
            };
            self.release(id, err, fx);
            return;
        }
        let next = lease.next[h.layer as usize];
        if end as u32 <= next {
            self.stats.duplicates_dropped += 1;
            fx.push(Effect::Dropped {
                stream,
                lease: id,
                layer: h.layer,
                token_start: h.token_start,
                why: DropReason::Duplicate,
            });
            return;
        }
        if h.token_start != next {
            let err = KvTransferError::ChunkGap { lease: id, layer: h.layer, expected: next, got: h.token_start };
            self.release(id, err, fx);
            return;
        }
        let got = checksum(&k, &v);
        if got != h.crc32 {
            let err = KvTransferError::ChecksumMismatch {
                lease: id,
                layer: h.layer,
                token_start: h.token_start,
                token_count: h.token_count,
                expected: h.crc32,
                got,
            };
            self.release(id, err, fx);
            return;
        }
        lease.next[h.layer as usize] = end as u32;
        if end as u32 == lease.num_tokens {
            lease.layers_done += 1;
        }
        self.stats.bytes_written += (k.len() + v.len()) as u64;
        fx.push(Effect::Write(KvWrite {
            lease: id,
            request_id: lease.request_id,
            blocks: lease.blocks.clone(),
            layer: h.layer,
            token_start: h.token_start,
            token_count: h.token_count,
            k,
            v,
        }));
        self.maybe_complete(id, fx);
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
        if lease.layers_done != self.layout.num_layers || lease.rdma.as_ref().is_some_and(|r| !r.verified) {
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
        let rdma = lease.rdma.and_then(|r| Some((r.link, r.tag?)));
        fx.push(Effect::Released {
            lease: id,
            request_id: lease.request_id,
            blocks: lease.blocks.to_vec(),
            error,
            rdma,
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
