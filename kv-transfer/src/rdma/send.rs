//! The sending side of the RDMA payload path: [`RdmaTransport`] gives each transfer an
//! [`RdmaSendPath`] over the link to its receiver (set up on first use, reused while its stream
//! lives), whose writer posts each chunk as one-sided writes into the leased blocks and sends a
//! `Landed` notice with its CRC-32 on the transfer's one control stream.
//!
//! Invariants:
//! - the writes of a lease are posted in the order the chunks were given (one driver task per
//!   link, FIFO), and `Complete` goes out only once every one of them completed;
//! - an [`RdmaSendPath`] dropped before the receiver's `Ack` (a failed or abandoned transfer)
//!   cancels the lease on the link and, once none of its writes can land, sends `Drained` on the
//!   link's stream, so the receiver frees the blocks without resetting the queue pair; after an
//!   `Ack` it sends nothing (the receiver holds nothing of the lease any more);
//! - an `Open` refused with `UnknownLink` (the receiver restarted or dropped the link) marks the
//!   link dead, and the sender starts once more over a new one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cleave_protocol::{LeaseId, TransportKind};
use tokio::sync::mpsc;

use super::completion::Outcome;
use super::driver::{DriverConfig, SendChunk, SendDriver};
use super::link::SendLinkConfig;
use super::setup::Provider;
use crate::error::{KvTransferError, Result};
use crate::frame::{checksum, read_frame, write_control, AbortCode, ChunkHeader, Control, Landed, Limits};
use crate::payload::{Accepted, BoxFuture, PayloadWriter, SendPath, StreamOut};
use crate::transport::Transport;
use cleave_net::{Connector, DuplexStream, NetConfig, PeerInfo};

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
pub struct LinkHandle {
    pub link_id: u64,
    pub driver: SendDriver,
    /// Bytes of one staging slot: K and V of one write group must fit.
    slot_bytes: u64,
    drained: mpsc::UnboundedSender<(LeaseId, u16)>,
    alive: Arc<AtomicBool>,
}

impl LinkHandle {
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
    links: tokio::sync::Mutex<HashMap<SocketAddr, LinkHandle>>,
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

    /// The link to the receiver at `peer`: the live one, or a new one set up now.
    pub async fn link(&self, peer: SocketAddr) -> Result<LinkHandle> {
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
        let path = LinkHandle { link_id, driver, slot_bytes: self.cfg.link.slot_bytes, drained: tx, alive };
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

    fn open(&self, peer: SocketAddr) -> BoxFuture<'_, Result<(DuplexStream, Option<PeerInfo>)>> {
        Box::pin(async move {
            let (stream, who) = self.connector.open_with_peer(peer).await?;
            Ok((stream, Some(who)))
        })
    }

    fn send_path(&self, peer: SocketAddr) -> BoxFuture<'_, Result<Box<dyn SendPath>>> {
        Box::pin(async move {
            let link = self.link(peer).await?;
            Ok(Box::new(RdmaSendPath { link, lease: None, acked: false }) as Box<dyn SendPath>)
        })
    }
}

/// One transfer over a link: one control stream, the lease's tag from its `Accept`. Dropped
/// before the receiver acknowledged the lease, it abandons the lease on the link (see the
/// module docs).
pub struct RdmaSendPath {
    link: LinkHandle,
    /// Set at the `Accept`: from then on the receiver holds the lease on the link.
    lease: Option<(LeaseId, u16)>,
    acked: bool,
}

impl SendPath for RdmaSendPath {
    fn link(&self) -> Option<u64> {
        Some(self.link.link_id)
    }

    /// The payload goes through the link; one stream carries the control frames.
    fn streams(&self, _configured: usize) -> usize {
        1
    }

    fn accepted(&mut self, out: StreamOut, a: Accepted) -> BoxFuture<'_, Result<Box<dyn PayloadWriter>>> {
        Box::pin(async move {
            let Some(tag) = a.tag else {
                return Err(KvTransferError::Protocol {
                    reason: format!("Accept of {} over RDMA without a lease tag", a.lease),
                });
            };
            // From here until the Ack, a failure tells the receiver when our writes have drained
            // (this path's drop).
            self.lease = Some((a.lease, tag));
            tokio::time::timeout_at(a.deadline, self.link.driver.open(tag, a.expires)).await.map_err(|_| {
                KvTransferError::Timeout {
                    what: format!("opening RDMA lease tag {tag}"),
                    ms: a.open_timeout.as_millis() as u64,
                }
            })??;
            let writer = RdmaWriter {
                out,
                link: self.link.clone(),
                tag,
                blocks: a.blocks,
                counts: vec![0; a.num_layers as usize],
            };
            Ok(Box::new(writer) as Box<dyn PayloadWriter>)
        })
    }

    /// The receiver did not know the link (it restarted, or dropped the link before we noticed)
    /// and kept the lease: the link is dead, a new one may succeed.
    fn refused(&mut self, err: &KvTransferError) -> bool {
        let unknown =
            matches!(err, KvTransferError::PeerAborted { code, .. } if *code == AbortCode::UnknownLink.to_string());
        if unknown {
            self.link.invalidate();
        }
        unknown
    }

    fn acknowledged(&mut self) {
        self.acked = true;
    }
}

impl Drop for RdmaSendPath {
    fn drop(&mut self) {
        if let (Some((lease, tag)), false) = (self.lease, self.acked) {
            self.link.abandon(lease, tag);
        }
    }
}

/// The writer of an RDMA transfer's control stream: chunks through the link, notices and
/// `Complete` on the stream.
struct RdmaWriter {
    out: StreamOut,
    link: LinkHandle,
    tag: u16,
    blocks: Arc<[u32]>,
    /// Chunks posted per layer: the next chunk index of each.
    counts: Vec<u32>,
}

impl RdmaWriter {
    /// Posts a chunk as one write group per staging slot's worth of tokens (a prefix-cache hit
    /// can be longer than a prefill step), each with its own notice and checksum.
    async fn chunk(&mut self, h: ChunkHeader, k: Bytes, v: Bytes) -> std::io::Result<()> {
        let other = |e: KvTransferError| std::io::Error::other(e.to_string());
        let layer = h.layer as usize;
        let token_bytes = k.len() / h.token_count.max(1) as usize;
        let per_piece = self.link.max_chunk_tokens(token_bytes).max(1);
        let mut start = 0;
        while start < h.token_count {
            let n = per_piece.min(h.token_count - start);
            let bytes = start as usize * token_bytes..(start + n) as usize * token_bytes;
            let (pk, pv) = (k.slice(bytes.clone()), v.slice(bytes));
            let chunk = self.counts[layer];
            let crc32 = checksum(&pk, &pv);
            let first = h.token_start + start;
            let c = SendChunk {
                blocks: self.blocks.clone(),
                layer: h.layer,
                tokens: first..first + n,
                tag: self.tag,
                chunk,
                k: pk,
                v: pv,
            };
            self.link.driver.send(c).await.map_err(other)?;
            self.counts[layer] += 1;
            let notice =
                Landed { lease_id: h.lease_id, layer: h.layer, token_start: first, token_count: n, chunk, crc32 };
            self.out.queue_control(Control::Landed(notice)).await?;
            start += n;
        }
        Ok(())
    }

    /// Waits until every write of the lease completed; after that nothing of it is in flight.
    async fn drain(&mut self) -> Result<()> {
        let e = self.link.driver.finish(self.tag).await?;
        match e.outcome {
            Outcome::Done => Ok(()),
            Outcome::Failed { reason, .. } => {
                Err(KvTransferError::RdmaLink { link: self.link.link_id, reason: reason.to_string() })
            }
        }
    }
}

impl PayloadWriter for RdmaWriter {
    fn chunk(&mut self, h: ChunkHeader, k: Bytes, v: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(RdmaWriter::chunk(self, h, k, v))
    }

    fn flush(&mut self) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(self.out.flush())
    }

    /// `Complete` once every write of the lease completed.
    fn complete(&mut self, lease_id: LeaseId, first_token: u32) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.drain().await?;
            self.out.control(Control::Complete { lease_id, first_token }).await
        })
    }
}
