//! The handoff over RDMA, receiving side: the same `Open` / `Accept` / `Complete` / `Ack`
//! exchange as every payload path, on one QUIC control stream per transfer, with the payload
//! moved by one-sided writes into the leased blocks instead of in `Chunk` frames. The sending
//! side is [`super::send`]; both plug into the generic handoff through [`crate::payload`].
//!
//! Per pair of nodes, once: a link ([`super::setup`]) on a stream of its own that lives as long
//! as the link. Per transfer:
//! 1. the sender's `Open` names the link (`rdma_link`); the receiver opens a lease on the link's
//!    queue pair ([`RecvPath::bind`]), which gives the lease's payload, an [`RdmaLease`], and
//!    answers `Accept` with its tag;
//! 2. per (layer, prefill chunk) the sender posts the writes (the last one WITH IMMEDIATE) and
//!    sends a [`crate::frame::Landed`] notice with the chunk's CRC-32, which the lease's
//!    [`RdmaLease`] collects;
//! 3. once every write completed the sender sends `Complete`; the receiver tells the link how
//!    many groups to expect ([`RecvPath::expect`]), and when every immediate arrived checks each
//!    notice's checksum against the bytes in its pool ([`crate::KvSink::landed_checksum`]) and
//!    answers `Ack`.
//!
//! Who frees the blocks of an RDMA lease that fails: the receiver, as for every transport, but
//! only once no write of the lease can still land ([`super::link`]'s safe events): at once
//! when the link itself failed the lease (an error completion: the queue pair accepts nothing
//! more), else after the sender's [`crate::frame::Control::Drained`] (it cancels its side and
//! waits for its writes to drain before sending it), or after the link resets the queue pair
//! when that does not come within the quarantine, or when the link's stream ends (the sender's
//! node or link is gone: the receiver drops the link, destroying its queue pair). Until then the
//! blocks count as reserved ([`crate::ReceiverStats::reserved_blocks`], through
//! [`RecvPath::held_blocks`]).
//!
//! A link serves only the peer (certificate name) that set it up; an `Open` naming a link this
//! receiver does not know is refused with `UnknownLink` and the lease kept, for the sender to
//! set up a new link and open again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_net::Listener;
use cleave_protocol::{LeaseId, RequestId};

use super::completion::{LeaseEvent, Outcome};
use super::lease::RdmaLease;
use super::link::RecvLinkConfig;
use super::setup::{Acceptor, DynRecvLink};
use crate::actor::{ReceiverConfig, ReceiverService};
use crate::error::{KvTransferError, Result};
use crate::frame::{AbortCode, Control, Frame};
use crate::payload::{Expect, LeasePayload, LinkTag, PathOutput, RecvPath, StreamId, StreamItem};
use crate::sink::KvSink;

/// A receiver's RDMA side: where its queue pairs come from and how they are sized.
#[derive(Clone)]
pub struct RdmaReceive {
    pub acceptor: Arc<dyn Acceptor>,
    pub link: RecvLinkConfig,
    /// How often the receiver polls its links' completions while a lease is open on one.
    pub poll_interval: Duration,
}

impl RdmaReceive {
    pub fn new(acceptor: Arc<dyn Acceptor>) -> Self {
        Self {
            acceptor,
            link: RecvLinkConfig { recv_depth: 1024, quarantine: Duration::from_secs(2) },
            poll_interval: Duration::from_micros(200),
        }
    }
}

impl ReceiverService {
    /// Like [`ReceiverService::spawn`], also taking RDMA links from senders: their writes land
    /// in `sink`'s memory, which must be the region `rdma`'s queue pairs expose.
    pub fn spawn_rdma<S: KvSink>(cfg: ReceiverConfig, sink: S, listener: Option<Listener>, rdma: RdmaReceive) -> Self {
        Self::spawn_with_path(cfg, sink, listener, Box::new(RecvLinks::new(rdma)))
    }
}

struct LinkEntry {
    link: DynRecvLink,
    stream: StreamId,
    /// The certificate name of the peer that set the link up.
    peer: Option<String>,
}

/// The receiver's links, owned by its actor (no task of their own: the actor polls them).
struct RecvLinks {
    cfg: RdmaReceive,
    next_id: u64,
    links: HashMap<u64, LinkEntry>,
    by_stream: HashMap<StreamId, u64>,
    /// Live leases bound to a (link, tag).
    tags: HashMap<(u64, u16), LeaseId>,
    /// Released leases whose writes may still land: their blocks, freed on the safe event.
    quarantine: HashMap<(u64, u16), Quarantined>,
    /// Live leases whose sender already said `Drained` (its control stream's end may reach the
    /// actor after the link stream's notice): released, they are safe at once.
    drained_early: std::collections::HashSet<(u64, u16)>,
}

struct Quarantined {
    lease: LeaseId,
    request_id: RequestId,
    blocks: Vec<u32>,
}

impl RecvLinks {
    fn new(cfg: RdmaReceive) -> Self {
        use std::hash::{BuildHasher, Hasher};
        // A random start, so that a sender still holding a link id of this receiver's previous
        // life names no link of this one.
        let base = std::collections::hash_map::RandomState::new().build_hasher().finish() >> 1;
        Self {
            cfg,
            next_id: base.max(1),
            links: HashMap::new(),
            by_stream: HashMap::new(),
            tags: HashMap::new(),
            quarantine: HashMap::new(),
            drained_early: Default::default(),
        }
    }

    fn poll_interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    /// True while some link has a lease open (active or quarantined): poll it.
    fn busy(&self) -> bool {
        self.links.values().any(|l| l.link.open_leases() > 0)
    }

    fn is_link_stream(&self, stream: StreamId) -> bool {
        self.by_stream.contains_key(&stream)
    }

    /// Blocks of released leases still waiting for their safe event.
    fn quarantined_blocks(&self) -> usize {
        self.quarantine.values().map(|q| q.blocks.len()).sum()
    }

    /// A sender's link offer on `stream`: a new link, and the answer to send.
    fn offer(&mut self, stream: StreamId, metadata: &[u8], peer: Option<String>) -> Result<Control> {
        let (link, answer) = self.cfg.acceptor.answer(metadata, self.cfg.link)?;
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        self.links.insert(id, LinkEntry { link, stream, peer });
        self.by_stream.insert(stream, id);
        tracing::debug!(link = id, stream, "kv receiver: rdma link set up");
        Ok(Control::LinkAnswer { link_id: id, metadata: answer })
    }

    /// Opens `lease` on `link`'s queue pair for an `Open` from `peer`; the tag goes to the sender
    /// in the `Accept`. A link serves only the peer that set it up.
    fn open_tag(
        &mut self,
        link: u64,
        lease: LeaseId,
        num_layers: u32,
        deadline: Instant,
        peer: Option<&str>,
    ) -> Result<u16> {
        let entry = self.links.get_mut(&link).ok_or(KvTransferError::RdmaUnknownLink { link })?;
        if entry.peer.as_deref() != peer {
            return Err(KvTransferError::RdmaLink {
                link,
                reason: format!("set up by {:?}, named by {peer:?}", entry.peer),
            });
        }
        let tag = entry.link.open_lease(num_layers, deadline)?;
        self.tags.insert((link, tag), lease);
        Ok(tag)
    }

    fn set_link_chunks(&mut self, link: u64, tag: u16, chunks: &[u32], now: Instant) -> Vec<PathOutput> {
        let r = match self.links.get_mut(&link) {
            Some(e) => e.link.set_layer_chunks(tag, chunks, now),
            None => Err(KvTransferError::RdmaLink { link, reason: "gone".into() }),
        };
        self.settle(link, r)
    }

    /// A lease bound to (link, tag) was released. Returns the blocks when they may be freed now
    /// (the link no longer holds the tag: its event already said nothing more lands); otherwise
    /// cancels the tag on the link and keeps the blocks until the safe event.
    fn release_tag(
        &mut self,
        link: u64,
        tag: u16,
        request_id: RequestId,
        blocks: Vec<u32>,
        now: Instant,
    ) -> (Option<Vec<u32>>, Vec<PathOutput>) {
        let Some(lease) = self.tags.remove(&(link, tag)) else { return (Some(blocks), Vec::new()) };
        let Some(entry) = self.links.get_mut(&link) else { return (Some(blocks), Vec::new()) };
        self.quarantine.insert((link, tag), Quarantined { lease, request_id, blocks });
        let r = entry.link.cancel(tag, now);
        let mut out = self.settle(link, r);
        if self.drained_early.remove(&(link, tag)) {
            let r = match self.links.get_mut(&link) {
                Some(e) => e.link.drained(tag).map(|e| e.into_iter().collect()),
                None => Ok(Vec::new()),
            };
            out.extend(self.settle(link, r));
        }
        (None, out)
    }

    /// The sender's `Drained` on a link's stream. One for a lease that is not quarantined
    /// under that tag (it completed, or the tag went to another lease since) changes nothing.
    fn drained(&mut self, stream: StreamId, lease: LeaseId, tag: u16) -> Vec<PathOutput> {
        let Some(&link) = self.by_stream.get(&stream) else { return Vec::new() };
        if self.quarantine.get(&(link, tag)).is_none_or(|q| q.lease != lease) {
            if self.tags.get(&(link, tag)) == Some(&lease) {
                self.drained_early.insert((link, tag));
            }
            return Vec::new();
        }
        let r = match self.links.get_mut(&link) {
            Some(e) => e.link.drained(tag).map(|e| e.into_iter().collect()),
            None => Ok(Vec::new()),
        };
        self.settle(link, r)
    }

    /// A link's stream ended or broke: the sender dropped the link (or died). The link is
    /// dropped, destroying its queue pair, so every lease on it is safe to fail and free.
    fn stream_ended(&mut self, stream: StreamId, why: &str) -> Vec<PathOutput> {
        let Some(link) = self.by_stream.remove(&stream) else { return Vec::new() };
        self.drop_link(link, why)
    }

    fn drop_link(&mut self, link: u64, why: &str) -> Vec<PathOutput> {
        tracing::debug!(link, why, "kv receiver: rdma link dropped");
        if let Some(e) = self.links.remove(&link) {
            self.by_stream.remove(&e.stream);
        }
        let mut out = Vec::new();
        let mut gone: Vec<(u64, u16)> = self.tags.keys().filter(|(l, _)| *l == link).copied().collect();
        gone.sort_unstable();
        for key in gone {
            self.drained_early.remove(&key);
            if let Some(lease) = self.tags.remove(&key) {
                out.push(PathOutput::Failed(lease, KvTransferError::RdmaLink { link, reason: why.to_string() }));
            }
        }
        let mut freed: Vec<(u64, u16)> = self.quarantine.keys().filter(|(l, _)| *l == link).copied().collect();
        freed.sort_unstable();
        for key in freed {
            if let Some(q) = self.quarantine.remove(&key) {
                out.push(PathOutput::Free(q.request_id, q.blocks));
            }
        }
        out
    }

    /// Polls every busy link. A link whose queue pair was reset or failed is dropped once its
    /// leases are reported (they are safe: nothing lands on it any more), and its stream closed.
    fn poll_links(&mut self, now: Instant) -> Vec<PathOutput> {
        let busy: Vec<u64> = self.links.iter().filter(|(_, e)| e.link.open_leases() > 0).map(|(id, _)| *id).collect();
        let mut out = Vec::new();
        for link in busy {
            let r = match self.links.get_mut(&link) {
                Some(e) => e.link.poll(now),
                None => continue,
            };
            out.extend(self.settle(link, r));
            if let Some(stream) = self.links.get(&link).filter(|e| e.link.is_broken()).map(|e| e.stream) {
                out.extend(self.drop_link(link, "its queue pair failed"));
                out.push(PathOutput::Close(stream));
            }
        }
        out
    }

    /// Turns a link's events into outputs; a link whose provider failed is dropped.
    fn settle(&mut self, link: u64, r: Result<Vec<LeaseEvent>>) -> Vec<PathOutput> {
        let events = match r {
            Ok(e) => e,
            Err(e) => return self.drop_link(link, &e.to_string()),
        };
        let mut out = Vec::new();
        for e in events {
            let key = (link, e.tag);
            self.drained_early.remove(&key);
            if let Some(lease) = self.tags.remove(&key) {
                out.push(match e.outcome {
                    Outcome::Done => PathOutput::Landed(lease),
                    Outcome::Failed { reason, .. } => {
                        PathOutput::Failed(lease, KvTransferError::RdmaLink { link, reason: reason.to_string() })
                    }
                });
            } else if let Some(q) = self.quarantine.remove(&key) {
                out.push(PathOutput::Free(q.request_id, q.blocks));
            }
        }
        out
    }
}

impl RecvPath for RecvLinks {
    fn next_poll(&self, now: Instant) -> Option<Instant> {
        self.busy().then(|| now + self.poll_interval())
    }

    fn held_blocks(&self) -> usize {
        self.quarantined_blocks()
    }

    /// Frames of link streams (`Drained`, their end) are the links'; a `LinkOffer` makes its
    /// stream a link stream (it holds no lease: the state machine forgets it). Everything else
    /// goes back to the state machine.
    fn on_frame(
        &mut self,
        stream: StreamId,
        item: StreamItem,
        peer: Option<&str>,
        _now: Instant,
    ) -> std::result::Result<Vec<PathOutput>, StreamItem> {
        if self.is_link_stream(stream) {
            return Ok(match item {
                Ok(Some(Frame::Control(Control::Drained { lease_id, tag }))) => self.drained(stream, lease_id, tag),
                ended => {
                    let why = match ended {
                        Ok(None) => "its stream ended".to_string(),
                        Ok(Some(other)) => format!("unexpected frame on the link's stream: {other:?}"),
                        Err(e) => e.to_string(),
                    };
                    let mut out = vec![PathOutput::Close(stream)];
                    out.extend(self.stream_ended(stream, &why));
                    out
                }
            });
        }
        let Ok(Some(Frame::Control(Control::LinkOffer { metadata }))) = &item else { return Err(item) };
        let mut out = vec![PathOutput::Forget(stream)];
        match self.offer(stream, metadata, peer.map(str::to_string)) {
            Ok(msg) => out.push(PathOutput::Send { stream, msg }),
            Err(e) => {
                tracing::warn!(stream, error = %e, "kv receiver: rdma link refused");
                let msg = Control::Abort { lease_id: LeaseId(0), code: AbortCode::of(&e), reason: e.to_string() };
                out.push(PathOutput::Send { stream, msg });
                out.push(PathOutput::Close(stream));
            }
        }
        Ok(out)
    }

    fn bind(
        &mut self,
        link: u64,
        lease: LeaseId,
        num_layers: u32,
        deadline: Instant,
        peer: Option<&str>,
    ) -> Result<Box<dyn LeasePayload>> {
        let tag = self.open_tag(link, lease, num_layers, deadline, peer)?;
        Ok(Box::new(RdmaLease::new(LinkTag { link, tag }, num_layers)))
    }

    fn expect(&mut self, expect: Expect, now: Instant) -> Vec<PathOutput> {
        self.set_link_chunks(expect.at.link, expect.at.tag, &expect.chunks, now)
    }

    fn release(
        &mut self,
        at: LinkTag,
        request_id: RequestId,
        blocks: Vec<u32>,
        now: Instant,
    ) -> (Option<Vec<u32>>, Vec<PathOutput>) {
        self.release_tag(at.link, at.tag, request_id, blocks, now)
    }

    fn poll(&mut self, now: Instant) -> Vec<PathOutput> {
        self.poll_links(now)
    }
}
