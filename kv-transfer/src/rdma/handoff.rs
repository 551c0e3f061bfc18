//! The handoff over RDMA: the same `Open` / `Accept` / `Complete` / `Ack` exchange as every
//! transport, on one QUIC control stream per transfer, with the payload moved by one-sided
//! writes into the leased blocks instead of in `Chunk` frames.
//!
//! Per pair of nodes, once: a link ([`super::setup`]) on a stream of its own that lives as long
//! as the link. Per transfer:
//! 1. the sender's `Open` names the link (`rdma_link`); the receiver opens a lease on the link's
//!    queue pair and answers `Accept` with its tag;
//! 2. per (layer, prefill chunk) the sender posts the writes (the last one WITH IMMEDIATE) and
//!    sends a [`crate::frame::Landed`] notice with the chunk's CRC-32;
//! 3. once every write completed the sender sends `Complete`; the receiver tells the link how
//!    many groups to expect, and when every immediate arrived checks each notice's checksum
//!    against the bytes in its pool ([`crate::KvSink::landed_checksum`]) and answers `Ack`.
//!
//! Who frees the blocks of an RDMA lease that fails: the receiver, as for every transport, but
//! only once no write of the lease can still land ([`super::link`]'s safe events): at once
//! when the link itself failed the lease (an error completion: the queue pair accepts nothing
//! more), else after the sender's [`crate::frame::Control::Drained`] (it cancels its side and
//! waits for its writes to drain before sending it), or after the link resets the queue pair
//! when that does not come within the quarantine, or when the link's stream ends (the sender's
//! node or link is gone: the receiver drops the link, destroying its queue pair). Until then the
//! blocks count as reserved ([`crate::ReceiverStats::reserved_blocks`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_protocol::{LeaseId, RequestId, TransportKind};
use tokio::sync::mpsc;

use super::completion::{LeaseEvent, Outcome};
use super::driver::{DriverConfig, SendDriver};
use super::link::{RecvLinkConfig, SendLinkConfig};
use super::setup::{Acceptor, DynRecvLink, Provider};
use crate::error::{KvTransferError, Result};
use crate::frame::{read_frame, write_control, Control, Limits};
use crate::receiver::StreamId;
use crate::transport::{BoxFuture, Transport};
use cleave_net::{Connector, DuplexStream, NetConfig};

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

/// What a receiver's links report, for its actor to act on.
#[derive(Debug)]
pub(crate) enum LinkOutput {
    /// Every write group of the lease landed: check the notices and complete.
    Landed(LeaseId),
    /// The link failed the lease (safe: nothing more lands): release it.
    Failed(LeaseId, KvTransferError),
    /// A failed lease's blocks are safe to free now.
    Free(RequestId, Vec<u32>),
    /// A link was dropped (its queue pair failed): close its stream, which tells the sender to
    /// set up a new one.
    CloseStream(StreamId),
}

struct LinkEntry {
    link: DynRecvLink,
    stream: StreamId,
    /// The certificate name of the peer that set the link up.
    peer: Option<String>,
}

/// The receiver's links, owned by its actor (no task of their own: the actor polls them).
pub(crate) struct RecvLinks {
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
    pub(crate) fn new(cfg: RdmaReceive) -> Self {
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

    pub(crate) fn poll_interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    /// True while some link has a lease open (active or quarantined): poll it.
    pub(crate) fn busy(&self) -> bool {
        self.links.values().any(|l| l.link.open_leases() > 0)
    }

    pub(crate) fn is_link_stream(&self, stream: StreamId) -> bool {
        self.by_stream.contains_key(&stream)
    }

    /// Blocks of released leases still waiting for their safe event.
    pub(crate) fn quarantined_blocks(&self) -> usize {
        self.quarantine.values().map(|q| q.blocks.len()).sum()
    }

    /// A sender's link offer on `stream`: a new link, and the answer to send.
    pub(crate) fn offer(&mut self, stream: StreamId, metadata: &[u8], peer: Option<String>) -> Result<Control> {
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
    pub(crate) fn open_tag(
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

    pub(crate) fn set_chunks(&mut self, link: u64, tag: u16, chunks: &[u32], now: Instant) -> Vec<LinkOutput> {
        let r = match self.links.get_mut(&link) {
            Some(e) => e.link.set_layer_chunks(tag, chunks, now),
            None => Err(KvTransferError::RdmaLink { link, reason: "gone".into() }),
        };
        self.settle(link, r)
    }

    /// A lease bound to (link, tag) was released. Returns the blocks when they may be freed now
    /// (the link no longer holds the tag: its event already said nothing more lands); otherwise
    /// cancels the tag on the link and keeps the blocks until the safe event.
    pub(crate) fn release(
        &mut self,
        link: u64,
        tag: u16,
        request_id: RequestId,
        blocks: Vec<u32>,
        now: Instant,
    ) -> (Option<Vec<u32>>, Vec<LinkOutput>) {
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
    pub(crate) fn drained(&mut self, stream: StreamId, lease: LeaseId, tag: u16) -> Vec<LinkOutput> {
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
    pub(crate) fn stream_ended(&mut self, stream: StreamId, why: &str) -> Vec<LinkOutput> {
        let Some(link) = self.by_stream.remove(&stream) else { return Vec::new() };
        self.drop_link(link, why)
    }

    fn drop_link(&mut self, link: u64, why: &str) -> Vec<LinkOutput> {
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
                out.push(LinkOutput::Failed(lease, KvTransferError::RdmaLink { link, reason: why.to_string() }));
            }
        }
        let mut freed: Vec<(u64, u16)> = self.quarantine.keys().filter(|(l, _)| *l == link).copied().collect();
        freed.sort_unstable();
        for key in freed {
            if let Some(q) = self.quarantine.remove(&key) {
                out.push(LinkOutput::Free(q.request_id, q.blocks));
            }
        }
        out
    }

    /// Polls every busy link. A link whose queue pair was reset or failed is dropped once its
    /// leases are reported (they are safe: nothing lands on it any more), and its stream closed.
    pub(crate) fn poll(&mut self, now: Instant) -> Vec<LinkOutput> {
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
                out.push(LinkOutput::CloseStream(stream));
            }
        }
        out
    }

    /// Turns a link's events into outputs; a link whose provider failed is dropped.
    fn settle(&mut self, link: u64, r: Result<Vec<LeaseEvent>>) -> Vec<LinkOutput> {
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
                    Outcome::Done => LinkOutput::Landed(lease),
                    Outcome::Failed { reason, .. } => {
                        LinkOutput::Failed(lease, KvTransferError::RdmaLink { link, reason: reason.to_string() })
                    }
                });
            } else if let Some(q) = self.quarantine.remove(&key) {
                out.push(LinkOutput::Free(q.request_id, q.blocks));
            }
        }
        out
    }
}

/// Sizes and limits of the sending side.
#[derive(Debug, Clone, Copy)]
pub struct RdmaSendConfig {
    pub link: SendLinkConfig,
    pub driver: DriverConfig,
    /// Bound on setting up a link (metadata exchange and connect).
    pub setup_timeout: Duration,
    /// Bound on writing one `Drained` on a link's stream.
    pub write_timeout: Duration,
}

/// A sender's way into one receiver's pool: the link's id (named by `Open`), the driver that
/// owns its queue pair, and the link stream's `Drained` queue.
#[derive(Clone)]
pub struct SendPath {
    pub link_id: u64,
    pub driver: SendDriver,
    /// Bytes of one staging slot: K and V of one write group must fit.
    slot_bytes: u64,
    drained: mpsc::UnboundedSender<(LeaseId, u16)>,
    alive: Arc<AtomicBool>,
}

impl SendPath {
    /// Abandons a lease: once none of its writes can still land, tells the receiver so it frees
    /// the blocks without resetting the queue pair. Runs in the background (called from drops).
    pub fn abandon(&self, lease: LeaseId, tag: u16) {
        let (driver, drained) = (self.driver.clone(), self.drained.clone());
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
            if driver.cancel(tag).await.is_ok() {
                let _ = drained.send((lease, tag));
            }
        });
    }

    /// Tokens of one write group whose K and V fit a staging slot (`token_bytes` per token of
    /// K, and as many of V).
    pub fn max_chunk_tokens(&self, token_bytes: usize) -> u32 {
        (self.slot_bytes / (2 * token_bytes.max(1) as u64)).min(u32::MAX as u64) as u32
    }

    /// Marks the link dead (the receiver does not know it): the next transfer sets up a new one.
    pub fn invalidate(&self) {
        self.alive.store(false, Ordering::Release);
    }

    /// False once the link's stream ended or its queue pair broke: set up a new one.
    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && !self.drained.is_closed() && !self.driver.is_broken()
    }
}

/// The RDMA transport of a sender: control streams over QUIC (mutual TLS, like every link), the
/// payload over one queue pair per receiver, set up on first use and reused while its stream
/// lives.
pub struct RdmaTransport<P: Provider> {
    connector: Connector,
    provider: Arc<P>,
    cfg: RdmaSendConfig,
    /// Links by receiver address. An async lock: setting a link up awaits the peer, and two
    /// transfers to the same new peer must share one link rather than race for two.
    links: tokio::sync::Mutex<HashMap<SocketAddr, SendPath>>,
}

impl<P: Provider + 'static> RdmaTransport<P> {
    /// `net` must describe QUIC: control streams of an RDMA handoff travel over it.
    pub fn new(net: &NetConfig, provider: P, cfg: RdmaSendConfig) -> Result<Self> {
        if net.kind != cleave_net::NetKind::Quic {
            return Err(KvTransferError::InvalidRequest {
                reason: "the RDMA transport's control streams go over QUIC".into(),
            });
        }
        Ok(Self {
            connector: Connector::new(net)?,
            provider: Arc::new(provider),
            cfg,
            links: tokio::sync::Mutex::new(HashMap::new()),
        })
    }

    async fn path(&self, peer: SocketAddr) -> Result<SendPath> {
        let mut links = self.links.lock().await;
        if let Some(p) = links.get(&peer).filter(|p| p.is_alive()) {
            return Ok(p.clone());
        }
        links.remove(&peer);
        let mut stream = self.connector.open(peer).await?;
        let (link_id, link) =
            super::setup::connect(&mut stream, &*self.provider, self.cfg.link, self.cfg.setup_timeout).await?;
        let driver = SendDriver::spawn(link, self.cfg.driver);
        let (tx, rx) = mpsc::unbounded_channel();
        let alive = Arc::new(AtomicBool::new(true));
        tokio::spawn(link_stream(stream, rx, alive.clone(), self.cfg.write_timeout));
        let path = SendPath { link_id, driver, slot_bytes: self.cfg.link.slot_bytes, drained: tx, alive };
        links.insert(peer, path.clone());
        tracing::debug!(%peer, link_id, "kv sender: rdma link set up");
        Ok(path)
    }
}

/// Keeps a link's stream: writes `Drained` notices, and marks the link dead when the receiver
/// ends the stream (it dropped the link) or the stream breaks.
async fn link_stream(
    mut stream: DuplexStream,
    mut drained: mpsc::UnboundedReceiver<(LeaseId, u16)>,
    alive: Arc<AtomicBool>,
    limit: Duration,
) {
    let limits = Limits { max_payload: 0, layout: None };
    loop {
        tokio::select! {
            tag = drained.recv() => match tag {
                Some((lease_id, tag)) => {
                    let msg = Control::Drained { lease_id, tag };
                    let w = write_control(&mut stream.send, &msg);
                    if !matches!(tokio::time::timeout(limit, w).await, Ok(Ok(()))) {
                        break;
                    }
                }
                None => break,
            },
            // The receiver sends nothing after its answer: any frame, end or error ends the link.
            _ = read_frame(&mut stream.recv, &limits) => break,
        }
    }
    alive.store(false, Ordering::Release);
}

impl<P: Provider + 'static> Transport for RdmaTransport<P> {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn open(&self, peer: SocketAddr) -> BoxFuture<'_, Result<DuplexStream>> {
        Box::pin(async move { Ok(self.connector.open(peer).await?) })
    }

    fn rdma_path(&self, peer: SocketAddr) -> Option<BoxFuture<'_, Result<SendPath>>> {
        Some(Box::pin(self.path(peer)))
    }
}
