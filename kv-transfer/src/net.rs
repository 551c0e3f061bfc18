//! Authenticated, ordered byte streams to peers: the one thing every transport of this crate and
//! the cluster's control plane need from the network.
//!
//! A [`DuplexStream`] is one reliable ordered stream in each direction. Over QUIC it is one
//! bidirectional QUIC stream of a connection that is reused across requests (so opening a stream
//! costs no round trip once connected); over TCP it is one TCP connection (TLS by default, plain
//! only when the operator declares the network trusted), pooled for reuse.
//!
//! Invariants:
//! - every stream is mutually authenticated with the cluster CA unless [`NetKind::TcpPlain`];
//! - [`Connector::open`] never hangs: connecting is bounded by [`NetConfig::connect_timeout`];
//! - a connection the peer closed or restarted is dropped from the cache and reopened on the
//!   next `open`, so a peer restart on the same address never poisons later requests.

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::tls::NodeIdentity;
use crate::Result;

pub type BoxWrite = Pin<Box<dyn AsyncWrite + Send>>;
pub type BoxRead = Pin<Box<dyn AsyncRead + Send>>;

/// One reliable, ordered stream in each direction.
pub struct DuplexStream {
    pub send: BoxWrite,
    pub recv: BoxRead,
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

/// Network settings of a node. `identity` is required for every kind but `TcpPlain`.
#[derive(Clone)]
pub struct NetConfig {
    pub kind: NetKind,
    pub identity: Option<NodeIdentity>,
    pub connect_timeout: Duration,
}

/// Who is on the other end of an accepted stream.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub addr: SocketAddr,
    /// The node name from the peer's certificate (None over plain TCP).
    pub name: Option<String>,
}

/// Client side: opens streams to peers, reusing connections.
pub struct Connector {
    _cfg: NetConfig,
}

impl Connector {
    pub fn new(cfg: &NetConfig) -> Result<Self> {
        Ok(Self { _cfg: cfg.clone() })
    }

    /// Opens a new stream to `addr`, reusing a live connection when there is one.
    pub async fn open(&self, addr: SocketAddr) -> Result<DuplexStream> {
        Err(crate::KvTransferError::Connect { addr, reason: "net: not implemented yet".into() })
    }
}

/// Server side: accepts streams from authenticated peers.
pub struct Listener {
    local: SocketAddr,
}

impl Listener {
    pub async fn bind(_cfg: &NetConfig, addr: SocketAddr) -> Result<Self> {
        Ok(Self { local: addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next incoming stream; `None` once the listener is closed.
    pub async fn accept(&mut self) -> Option<Result<(DuplexStream, PeerInfo)>> {
        None
    }
}
