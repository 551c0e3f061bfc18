//! net: authenticated, ordered byte streams between the coordinator and the nodes: the one
//! thing the KV handoff, the request streams and the control links need from the network.
//!
//! Modules: this root ([`Connector`], [`Listener`], [`DuplexStream`]: streams over QUIC, TLS-TCP
//! or plain TCP, chosen by [`NetKind`]); [`tls`] (the cluster CA, node certificates and the
//! rustls configs every link uses); [`edge`] (TLS for the HTTP edge's clients); `quic` and `tcp` (the two connection kinds behind the root's
//! types); [`error`] (this crate's one error enum). What travels on a stream is someone else's:
//! the control link's messages and their framing are `cleave_protocol::control`, the handoff's
//! frames are `cleave_kv_transfer::frame`.
//!
//! Allowed dependencies: tokio, quinn, rustls and the certificate crates; no other crate of
//! cleave (everything else depends on this one, not the other way round).
//!
//! A [`DuplexStream`] is one reliable ordered stream in each direction. Over QUIC it is one
//! bidirectional QUIC stream of a connection that is reused across requests (so opening a stream
//! costs no round trip once connected, and many streams run in parallel on one connection); over
//! TCP it is one TCP connection per stream (TLS by default, plain only when the operator declares
//! the network trusted). TCP connections are not pooled: a byte stream has no end-of-message
//! marker that would let a connection be handed back, and a loopback/LAN connect costs tens of
//! microseconds (TLS 1.3 resumes sessions, so a reconnect skips the certificate exchange).
//!
//! Conventions for users of a stream:
//! - the opener writes first: a QUIC peer learns of a stream only when its first bytes arrive;
//! - shutting down `send` (`AsyncWriteExt::shutdown`) is the end-of-stream the peer reads as EOF;
//! - dropping both halves closes the stream (QUIC: the connection stays for other streams).
//!
//! Invariants:
//! - every stream is mutually authenticated with the cluster CA unless [`NetKind::TcpPlain`];
//! - [`Connector::open`] never hangs: connecting is bounded by [`NetConfig::connect_timeout`];
//! - a connection the peer closed or reset is dropped from the cache and reopened on the next
//!   `open`, so a peer restart on the same address never poisons later requests. A QUIC node
//!   derives its stateless-reset key from its identity, so a node restarted with the same
//!   identity resets its previous life's connections at their next packet (one round trip), and
//!   the stream in flight on such a connection fails quickly instead of waiting for the idle
//!   timeout.

pub mod edge;
pub mod error;
mod quic;
mod tcp;
pub mod tls;

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::tls::NodeIdentity;
pub use error::{io_err, NetError, Result};

pub use quic::{Congestion, QuicTuning};

pub type BoxWrite = Pin<Box<dyn AsyncWrite + Send>>;
pub type BoxRead = Pin<Box<dyn AsyncRead + Send>>;

/// One reliable, ordered stream in each direction.
pub struct DuplexStream {
    pub send: SendHalf,
    pub recv: RecvHalf,
}

impl DuplexStream {
    /// A stream over any byte pipe (TCP, TLS, an in-memory duplex).
    pub fn from_io(send: impl AsyncWrite + Send + 'static, recv: impl AsyncRead + Send + 'static) -> Self {
        Self { send: SendHalf(SendImpl::Io(Box::pin(send))), recv: RecvHalf(RecvImpl::Io(Box::pin(recv))) }
    }

    pub(crate) fn quic(send: quinn::SendStream, recv: quinn::RecvStream) -> Self {
        Self { send: SendHalf(SendImpl::Quic(send)), recv: RecvHalf(RecvImpl::Quic(recv)) }
    }
}

/// The sending half of a [`DuplexStream`]: an `AsyncWrite`, plus [`SendHalf::write_bytes`], which
/// hands a `Bytes` to a QUIC stream without copying it (quinn keeps the buffer until it is
/// acknowledged; a KV chunk is already a `Bytes`, so the copy into quinn's send buffer, one of the
/// six copies per byte an `AsyncWrite` path makes end to end, is gone).
pub struct SendHalf(SendImpl);

enum SendImpl {
    Quic(quinn::SendStream),
    Io(BoxWrite),
}

impl SendHalf {
    /// Whether [`SendHalf::write_bytes`] avoids a copy (QUIC); on the other pipes it is
    /// `write_all`, and callers that batch small writes (a `BufWriter`) should keep doing so.
    pub fn zero_copy(&self) -> bool {
        matches!(self.0, SendImpl::Quic(_))
    }

    /// Writes all of `buf`.
    pub async fn write_bytes(&mut self, buf: bytes::Bytes) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        match &mut self.0 {
            SendImpl::Quic(s) => s.write_chunk(buf).await.map_err(std::io::Error::from),
            SendImpl::Io(w) => w.write_all(&buf).await,
        }
    }
}

impl AsyncWrite for SendHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match &mut self.get_mut().0 {
            SendImpl::Quic(s) => AsyncWrite::poll_write(Pin::new(s), cx, buf),
            SendImpl::Io(w) => w.as_mut().poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        match &mut self.get_mut().0 {
            SendImpl::Quic(s) => AsyncWrite::poll_flush(Pin::new(s), cx),
            SendImpl::Io(w) => w.as_mut().poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        match &mut self.get_mut().0 {
            SendImpl::Quic(s) => AsyncWrite::poll_shutdown(Pin::new(s), cx),
            SendImpl::Io(w) => w.as_mut().poll_shutdown(cx),
        }
    }
}

/// The receiving half of a [`DuplexStream`]: an `AsyncRead`, plus [`RecvHalf::read_chunk`], which
/// over QUIC returns the received bytes as they sit in quinn's buffers, without a copy.
pub struct RecvHalf(RecvImpl);

enum RecvImpl {
    Quic(quinn::RecvStream),
    Io(BoxRead),
}

impl RecvHalf {
    /// Whether [`RecvHalf::read_chunk`] avoids a copy (QUIC).
    pub fn zero_copy(&self) -> bool {
        matches!(self.0, RecvImpl::Quic(_))
    }

    /// The next bytes of the stream in order, at most `max` (> 0) of them; `None` at the end of
    /// the stream. Over QUIC no byte is copied; over the other pipes the bytes are read into a
    /// fresh buffer of at most `max` (and at most 256 KiB).
    pub async fn read_chunk(&mut self, max: usize) -> std::io::Result<Option<bytes::Bytes>> {
        use tokio::io::AsyncReadExt;
        match &mut self.0 {
            RecvImpl::Quic(r) => match r.read_chunk(max, true).await {
                Ok(c) => Ok(c.map(|c| c.bytes)),
                Err(e) => Err(std::io::Error::from(e)),
            },
            RecvImpl::Io(r) => {
                let mut buf = bytes::BytesMut::with_capacity(max.min(256 << 10));
                match r.read_buf(&mut buf).await? {
                    0 => Ok(None),
                    _ => Ok(Some(buf.freeze())),
                }
            }
        }
    }
}

impl AsyncRead for RecvHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match &mut self.get_mut().0 {
            RecvImpl::Quic(r) => AsyncRead::poll_read(Pin::new(r), cx, buf),
            RecvImpl::Io(r) => r.as_mut().poll_read(cx, buf),
        }
    }
}

impl std::fmt::Debug for DuplexStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DuplexStream").finish_non_exhaustive()
    }
}

/// Which network carries the streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetKind {
    Quic,
    TcpTls,
    /// No encryption, no authentication: only on networks the operator declared trusted, and
    /// as the baseline in benchmarks.
    TcpPlain,
}

impl NetKind {
    pub const ALL: [NetKind; 3] = [NetKind::Quic, NetKind::TcpTls, NetKind::TcpPlain];

    pub fn name(self) -> &'static str {
        match self {
            NetKind::Quic => "quic",
            NetKind::TcpTls => "tcp-tls",
            NetKind::TcpPlain => "tcp-plain",
        }
    }
}

impl std::str::FromStr for NetKind {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self> {
        NetKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| NetError::UnknownKind(s.to_string()))
    }
}

/// Network settings of a node. `identity` is required for every kind but `TcpPlain`.
#[derive(Debug, Clone)]
pub struct NetConfig {
    pub kind: NetKind,
    pub identity: Option<NodeIdentity>,
    pub connect_timeout: Duration,
}

impl NetConfig {
    /// Default connect timeout: long enough for a TLS handshake across a data centre, short
    /// enough that a dead peer fails a request fast.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

    pub fn new(kind: NetKind, identity: Option<NodeIdentity>) -> Self {
        Self { kind, identity, connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT }
    }

    fn identity(&self) -> Result<&NodeIdentity> {
        self.identity
            .as_ref()
            .ok_or_else(|| NetError::Tls(format!("transport {} needs a node identity", self.kind.name())))
    }
}

/// The address peers should use for a listener bound at `bound`: `explicit` when given (NAT,
/// a proxy, a Service address), else `bound` with an unspecified IP (`0.0.0.0`, `::`), which
/// no peer can connect to, replaced by this host's source address on the route to `toward`
/// (asked of the kernel by connecting a UDP socket: no packet is sent). When the kernel has
/// no route, `bound` is kept and the failure logged: the peer's connects will say the rest.
pub fn advertised(bound: SocketAddr, explicit: Option<SocketAddr>, toward: SocketAddr) -> SocketAddr {
    if let Some(a) = explicit {
        return a;
    }
    if !bound.ip().is_unspecified() {
        return bound;
    }
    let any: SocketAddr =
        if toward.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let routed = std::net::UdpSocket::bind(any).and_then(|s| s.connect(toward).and_then(|()| s.local_addr()));
    match routed {
        Ok(local) => SocketAddr::new(local.ip(), bound.port()),
        Err(e) => {
            tracing::warn!(%bound, %toward, error = %e, "no route to find this host's address; advertising the bound one");
            bound
        }
    }
}

/// Who is on the other end of a stream.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub addr: SocketAddr,
    /// The node name from the peer's certificate (None over plain TCP).
    pub name: Option<String>,
    /// What the peer's certificate allows it to be ([`tls::cert_roles`]; None over plain TCP).
    pub roles: Option<tls::Roles>,
    /// SHA-256 of the peer's certificate (DER), what a revocation list names (None over plain
    /// TCP).
    pub fingerprint: Option<[u8; 32]>,
}

impl PeerInfo {
    /// A peer at `addr` that presented `certs` (leaf first), or none (plain TCP).
    pub(crate) fn new(addr: SocketAddr, certs: Option<&[rustls_pki_types::CertificateDer<'_>]>) -> Self {
        let leaf = certs.and_then(|c| c.first());
        PeerInfo {
            addr,
            name: leaf.and_then(tls::cert_name),
            roles: leaf.map(tls::cert_roles),
            fingerprint: leaf.map(tls::fingerprint),
        }
    }

    /// Whether the peer may act as `role` here: always over plain TCP (the operator declared the
    /// network trusted), else when its certificate allows it.
    pub fn allows(&self, role: tls::Roles) -> bool {
        self.roles.is_none_or(|r| r.contains(role))
    }
}

enum ConnectorImpl {
    Quic(Box<quic::QuicConnector>),
    Tcp(tcp::TcpConnector),
}

/// Client side: opens streams to peers, reusing connections.
pub struct Connector {
    inner: ConnectorImpl,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").finish_non_exhaustive()
    }
}

impl Connector {
    /// A connector with the default tuning. Must be called inside a tokio runtime for QUIC (the
    /// endpoint's driver task is spawned here).
    pub fn new(cfg: &NetConfig) -> Result<Self> {
        Self::with_tuning(cfg, &QuicTuning::default())
    }

    /// A connector with explicit QUIC tuning (ignored by the TCP kinds).
    pub fn with_tuning(cfg: &NetConfig, tuning: &QuicTuning) -> Result<Self> {
        let inner = match cfg.kind {
            NetKind::Quic => ConnectorImpl::Quic(Box::new(quic::QuicConnector::new(cfg, tuning)?)),
            NetKind::TcpTls | NetKind::TcpPlain => ConnectorImpl::Tcp(tcp::TcpConnector::new(cfg)?),
        };
        Ok(Self { inner })
    }

    /// Opens a new stream to `addr`, reusing a live connection when there is one.
    pub async fn open(&self, addr: SocketAddr) -> Result<DuplexStream> {
        Ok(self.open_with_peer(addr).await?.0)
    }

    /// Like [`Connector::open`], also saying who answered (the name in the server's cert).
    pub async fn open_with_peer(&self, addr: SocketAddr) -> Result<(DuplexStream, PeerInfo)> {
        match &self.inner {
            ConnectorImpl::Quic(c) => c.open(addr).await,
            ConnectorImpl::Tcp(c) => c.open(addr).await,
        }
    }

    /// Closes every cached connection (QUIC: CONNECTION_CLOSE to each peer). Streams already
    /// open on them fail.
    pub fn close(&self) {
        if let ConnectorImpl::Quic(c) = &self.inner {
            c.close();
        }
    }
}

/// See [`Listener::reloader`].
#[derive(Clone)]
pub struct Reloader(ReloaderImpl);

#[derive(Clone)]
enum ReloaderImpl {
    Quic(quic::QuicReloader),
    Tcp(tcp::TcpReloader),
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reloader")
    }
}

impl Reloader {
    /// New connections are served with `identity`'s certificate.
    pub fn set_identity(&self, identity: &NodeIdentity) -> Result<()> {
        match &self.0 {
            ReloaderImpl::Quic(r) => r.set_identity(identity),
            ReloaderImpl::Tcp(r) => r.set_identity(identity),
        }
    }
}

enum ListenerImpl {
    Quic(quic::QuicListener),
    Tcp(tcp::TcpListenerImpl),
}

/// Server side: accepts streams from authenticated peers.
///
/// Dropping it stops accepting and closes its connections (QUIC sends CONNECTION_CLOSE).
pub struct Listener {
    local: SocketAddr,
    inner: ListenerImpl,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("local", &self.local).finish_non_exhaustive()
    }
}

impl Listener {
    pub async fn bind(cfg: &NetConfig, addr: SocketAddr) -> Result<Self> {
        Self::bind_with_tuning(cfg, addr, &QuicTuning::default()).await
    }

    pub async fn bind_with_tuning(cfg: &NetConfig, addr: SocketAddr, tuning: &QuicTuning) -> Result<Self> {
        let inner = match cfg.kind {
            NetKind::Quic => ListenerImpl::Quic(quic::QuicListener::bind(cfg, addr, tuning)?),
            NetKind::TcpTls | NetKind::TcpPlain => ListenerImpl::Tcp(tcp::TcpListenerImpl::bind(cfg, addr).await?),
        };
        let local = match &inner {
            ListenerImpl::Quic(l) => l.local_addr(),
            ListenerImpl::Tcp(l) => l.local_addr(),
        };
        Ok(Self { local, inner })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// A handle that swaps the certificate this listener presents to new connections (a
    /// rotated node certificate, without a restart); connections already open keep theirs.
    /// None for plain TCP, which has no certificate.
    pub fn reloader(&self) -> Option<Reloader> {
        match &self.inner {
            ListenerImpl::Quic(l) => Some(Reloader(ReloaderImpl::Quic(l.reloader()))),
            ListenerImpl::Tcp(l) => l.reloader().map(|r| Reloader(ReloaderImpl::Tcp(r))),
        }
    }

    /// The next incoming stream; `None` once the listener is closed. A peer that fails the
    /// handshake (no certificate, another CA) is logged and skipped, not returned.
    pub async fn accept(&mut self) -> Option<Result<(DuplexStream, PeerInfo)>> {
        match &mut self.inner {
            ListenerImpl::Quic(l) => l.accept().await,
            ListenerImpl::Tcp(l) => l.accept().await,
        }
    }

    /// Accepts streams until the listener closes, running `handler` on its own task for each
    /// (a failed accept is logged and skipped).
    pub async fn serve<F, Fut>(mut self, handler: F)
    where
        F: Fn(DuplexStream, PeerInfo) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        while let Some(r) = self.accept().await {
            match r {
                Ok((stream, peer)) => {
                    tokio::spawn(handler(stream, peer));
                }
                Err(e) => tracing::warn!(local = %self.local_addr(), error = %e, "accept failed"),
            }
        }
    }

    /// Stops accepting, closes every connection and waits (bounded) until the peers were told,
    /// then releases the address so a new listener can bind it.
    pub async fn shutdown(self) {
        match self.inner {
            ListenerImpl::Quic(l) => l.shutdown().await,
            ListenerImpl::Tcp(l) => drop(l),
        }
    }
}
