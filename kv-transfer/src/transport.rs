//! Transports: how a sender reaches a receiver, chosen per peer from the ticket.
//!
//! A transport opens ordered byte streams to a receiver; the handoff protocol
//! ([`crate::frame`], [`crate::sender`]) runs unchanged on top. What an implementation must
//! guarantee:
//! - every stream is reliable and ordered in each direction, and a stream's end (clean or not)
//!   is seen by the other side as end of stream or an error, never as silence: the receiver
//!   frees a lease when a stream bound to it ends before completion;
//! - `open` is bounded in time (its own timeout) and never blocks the runtime;
//! - streams are independent: a sender may use several at once for one transfer (layers spread
//!   across them), and a stream is never shared by two transfers at the same time;
//! - a peer restart is survivable: a cached connection found dead is dropped and the next
//!   `open` reconnects (no stale state across a restart).
//!
//! A transport also gives each transfer its payload path ([`Transport::send_path`], see
//! [`crate::payload`]): by default the payload travels in chunk frames on the streams.
//!
//! Implementations: [`NetTransport`] (QUIC, TCP+TLS, plain TCP over `cleave_net`),
//! [`crate::actor::InProcessTransport`] (a node that prefills and decodes itself), and
//! `rdma::RdmaTransport` (feature `rdma`), which keeps the control frames on a QUIC stream and
//! gives the RDMA payload path (one-sided writes over a link to each receiver).
//!
//! Dependencies: [`crate::payload`] and [`crate::frame`]; no transport implementation is named
//! here (the RDMA one depends on this module, not the reverse).

use std::net::SocketAddr;

use cleave_protocol::TransportKind;

use crate::payload::{SendPath, StreamPath};
use crate::{KvTransferError, Result};
use cleave_net::tls::Roles;
use cleave_net::{Connector, DuplexStream, NetConfig, NetKind, PeerInfo};
use cleave_protocol::HandoffTicket;

pub use crate::payload::BoxFuture;

/// Opens streams to receivers.
pub trait Transport: Send + Sync {
    fn kind(&self) -> TransportKind;
    /// Opens one new stream to the receiver at `peer`, with who answered where the link says
    /// (its certificate; None in-process). The sender checks that against the ticket
    /// ([`check_receiver`]).
    fn open(&self, peer: SocketAddr) -> BoxFuture<'_, Result<(DuplexStream, Option<PeerInfo>)>>;

    /// Transports inside one process hand whole frames over (no encoding, payloads moved, not
    /// copied); the sender uses this instead of [`Transport::open`] when it is `Some`. The same
    /// guarantees hold: ordered, and the end of the pipe (a dropped sender) is seen by the peer.
    fn open_frames(&self, _peer: SocketAddr) -> Option<BoxFuture<'_, Result<FramePipe>>> {
        None
    }

    /// The payload path of one transfer to `peer` (set up on first use where it needs set-up,
    /// like an RDMA link); [`Transport::open`] then gives its streams. By default the payload
    /// travels in chunk frames on them ([`StreamPath`]).
    fn send_path(&self, _peer: SocketAddr) -> BoxFuture<'_, Result<Box<dyn SendPath>>> {
        Box::pin(async { Ok(Box::new(StreamPath) as Box<dyn SendPath>) })
    }
}

/// One in-process "stream" of whole frames in each direction.
#[derive(Debug)]
pub struct FramePipe {
    pub send: tokio::sync::mpsc::Sender<crate::frame::Frame>,
    pub recv: tokio::sync::mpsc::Receiver<crate::frame::Frame>,
}

/// Streams over the network (QUIC, TCP+TLS or plain TCP), connections reused by the
/// [`Connector`].
pub struct NetTransport {
    kind: TransportKind,
    connector: Connector,
}

impl NetTransport {
    pub fn new(cfg: &NetConfig) -> Result<Self> {
        let kind = match cfg.kind {
            NetKind::Quic => TransportKind::Quic,
            NetKind::TcpTls => TransportKind::TcpTls,
            NetKind::TcpPlain => TransportKind::TcpPlain,
        };
        Ok(Self { kind, connector: Connector::new(cfg)? })
    }
}

impl Transport for NetTransport {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    fn open(&self, peer: SocketAddr) -> BoxFuture<'_, Result<(DuplexStream, Option<PeerInfo>)>> {
        Box::pin(async move {
            let (stream, who) = self.connector.open_with_peer(peer).await?;
            Ok((stream, Some(who)))
        })
    }
}

/// Whether `peer`, who answered at the ticket's address, may receive the ticket's KV: over an
/// authenticated link its certificate must name the node that issued the ticket and allow the
/// decode role. Without this a sender would push a request's KV cache (the prompt, in effect)
/// to whichever cluster member holds that address now: another node after a restart, or one
/// that redirected the traffic. Plain TCP (no certificates) and in-process links pass: the
/// operator declared them trusted.
pub fn check_receiver(ticket: &HandoffTicket, peer: Option<&PeerInfo>) -> Result<()> {
    let Some(peer) = peer else { return Ok(()) };
    let wrong = |reason: String| Err(KvTransferError::WrongReceiver { addr: ticket.receiver_addr, reason });
    if let (Some(want), Some(got)) = (&ticket.receiver_name, &peer.name) {
        if want != got {
            return wrong(format!("the ticket names {want:?}, the certificate at that address names {got:?}"));
        }
    }
    if ticket.receiver_name.is_some() && peer.name.is_none() && peer.roles.is_some() {
        return wrong(format!(
            "the ticket names {:?}, the certificate at that address names no node",
            ticket.receiver_name
        ));
    }
    if !peer.allows(Roles::DECODE) {
        return wrong(format!("its certificate ({:?}) does not allow the decode role", peer.name));
    }
    Ok(())
}

/// A [`DuplexStream`] from any tokio stream (tests, in-process pipes, plain sockets).
pub fn duplex_from<S>(stream: S) -> DuplexStream
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (r, w) = tokio::io::split(stream);
    DuplexStream::from_io(w, r)
}

/// The transports a sender has, chosen per peer by the ticket's [`TransportKind`].
#[derive(Default, Clone)]
pub struct TransportSet {
    by_kind: Vec<(TransportKind, std::sync::Arc<dyn Transport>)>,
}

impl TransportSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the transport for its kind.
    pub fn with(mut self, t: std::sync::Arc<dyn Transport>) -> Self {
        let kind = t.kind();
        self.by_kind.retain(|(k, _)| *k != kind);
        self.by_kind.push((kind, t));
        self
    }

    /// The transport a ticket asks for. No silent fallback: a kind this node lacks is an error.
    pub fn pick(&self, ticket: &cleave_protocol::HandoffTicket) -> Result<std::sync::Arc<dyn Transport>> {
        self.by_kind.iter().find(|(k, _)| *k == ticket.transport).map(|(_, t)| t.clone()).ok_or_else(|| {
            crate::KvTransferError::InvalidRequest {
                reason: format!(
                    "ticket for {} asks for {:?}, this node has {:?}",
                    ticket.lease_id,
                    ticket.transport,
                    self.by_kind.iter().map(|(k, _)| *k).collect::<Vec<_>>()
                ),
            }
        })
    }
}
