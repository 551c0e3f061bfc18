//! Link setup: before any RDMA write, the two sides of a new link exchange their queue-pair
//! metadata over a control stream (a QUIC stream between the nodes, mutually authenticated like
//! every other), each connects its queue pair to the other's, and each gets its link end.
//!
//! On the stream, as handoff frames ([`crate::frame`]): the sender writes
//! [`Control::LinkOffer`] with its [`QpMetadata`] (no region); the receiver answers
//! [`Control::LinkAnswer`] with the link's id (which later `Open`s name) and its own metadata,
//! which carries the KV pool's [`super::RemoteRegion`], or [`Control::Abort`] when it cannot
//! take the link. The stream then stays open for the link's life: the sender sends
//! [`Control::Drained`] on it, and its end tells each side that the other dropped the link.
//!
//! A malformed frame, garbage or invalid metadata, a receiver without a region, an abort, or a
//! peer silent past the limit is a clear error on that side, and nothing is left half set up: a
//! queue pair not handed out is dropped (destroyed) with the error.
//!
//! Queue pairs come from a [`Provider`]: [`super::verbs`] on a device and [`super::sim`] in
//! memory are its two implementations.

use std::time::Duration;

use super::link::{RecvLink, RecvLinkConfig, RecvOps, SendLink, SendLinkConfig, SendOps};
use super::meta::QpMetadata;
use crate::error::{KvTransferError, Result};
use crate::frame::{read_frame, write_control, Control, Frame, Limits};
use cleave_net::DuplexStream;

/// Where queue pairs come from. Creating one yields its metadata for the peer; connecting it to
/// the peer's metadata yields the link end's operations.
pub trait Provider: Send + Sync {
    type PendingSend: Send;
    type Send: SendOps + Send + 'static;
    type PendingRecv: Send;
    type Recv: RecvOps + Send + 'static;
    /// A sending queue pair (with its registered staging memory); its metadata has no region.
    fn create_send(&self) -> Result<(Self::PendingSend, QpMetadata)>;
    fn connect_send(&self, pending: Self::PendingSend, remote: &QpMetadata) -> Result<Self::Send>;
    /// A receiving queue pair; its metadata carries the registered KV pool.
    fn create_recv(&self) -> Result<(Self::PendingRecv, QpMetadata)>;
    fn connect_recv(&self, pending: Self::PendingRecv, remote: &QpMetadata) -> Result<Self::Recv>;
}

/// A receiving link end whose queue pair's type is erased: a receiver holds links of one
/// provider, chosen at run time (device or memory).
pub type DynRecvLink = RecvLink<Box<dyn RecvOps + Send>>;

/// The receiving side of setup without the stream, for a receiver that reads its frames
/// elsewhere: takes the sender's offer (the encoded metadata of a [`Control::LinkOffer`]),
/// creates and connects a queue pair, and returns the link end with the encoded metadata to
/// answer with.
pub trait Acceptor: Send + Sync {
    fn answer(&self, offer: &[u8], cfg: RecvLinkConfig) -> Result<(DynRecvLink, Vec<u8>)>;
}

impl<P: Provider> Acceptor for P {
    fn answer(&self, offer: &[u8], cfg: RecvLinkConfig) -> Result<(DynRecvLink, Vec<u8>)> {
        let remote = QpMetadata::decode(offer)?;
        let (pending, local) = self.create_recv()?;
        let answer = local.encode()?;
        let ops = self.connect_recv(pending, &remote)?;
        Ok((RecvLink::new(Box::new(ops) as Box<dyn RecvOps + Send>, cfg)?, answer))
    }
}

async fn bounded<T>(limit: Duration, what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| KvTransferError::Timeout { what: what.into(), ms: limit.as_millis() as u64 })?
}

fn link_limits() -> Limits {
    Limits { max_payload: 0, layout: None }
}

/// The sending side (prefill node): offers its metadata, reads the receiver's answer, connects.
/// Returns the link's id (to name in `Open`) and the link end.
pub async fn connect<P: Provider>(
    stream: &mut DuplexStream,
    provider: &P,
    cfg: SendLinkConfig,
    limit: Duration,
) -> Result<(u64, SendLink<P::Send>)> {
    let (pending, local) = provider.create_send()?;
    bounded(limit, "rdma link setup (sender)", async {
        write_control(&mut stream.send, &Control::LinkOffer { metadata: local.encode()? }).await?;
        let (link_id, remote) = match read_frame(&mut stream.recv, &link_limits()).await? {
            Some(Frame::Control(Control::LinkAnswer { link_id, metadata })) => {
                (link_id, QpMetadata::decode(&metadata)?)
            }
            Some(Frame::Control(Control::Abort { lease_id, code, reason })) => {
                return Err(KvTransferError::PeerAborted { lease: lease_id, code: code.to_string(), reason })
            }
            Some(other) => {
                return Err(KvTransferError::Protocol { reason: format!("{other:?} in answer to a link offer") })
            }
            None => return Err(KvTransferError::Truncated { expected: 1, got: 0 }),
        };
        if remote.region.is_none() {
            return Err(KvTransferError::RdmaMetadata {
                reason: "the receiver's metadata describes no memory region".into(),
            });
        }
        let ops = provider.connect_send(pending, &remote)?;
        Ok((link_id, SendLink::new(ops, &remote, cfg)?))
    })
    .await
}

/// The receiving side (decode node) on a stream of its own: reads the offer, answers with
/// `link_id` and its metadata (with the pool's region), connects.
pub async fn accept(
    stream: &mut DuplexStream,
    acceptor: &dyn Acceptor,
    link_id: u64,
    cfg: RecvLinkConfig,
    limit: Duration,
) -> Result<DynRecvLink> {
    bounded(limit, "rdma link setup (receiver)", async {
        let offer = match read_frame(&mut stream.recv, &link_limits()).await? {
            Some(Frame::Control(Control::LinkOffer { metadata })) => metadata,
            Some(other) => {
                return Err(KvTransferError::Protocol { reason: format!("{other:?} instead of a link offer") })
            }
            None => return Err(KvTransferError::Truncated { expected: 1, got: 0 }),
        };
        let (link, metadata) = acceptor.answer(&offer, cfg)?;
        write_control(&mut stream.send, &Control::LinkAnswer { link_id, metadata }).await?;
        Ok(link)
    })
    .await
}
