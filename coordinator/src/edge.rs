//! How the HTTP edge accepts connections: TCP_NODELAY on every one, and TLS when the operator
//! gave a certificate (`--tls-cert`, `--tls-key`).
//!
//! TCP_NODELAY: without it, Nagle's algorithm holds each small SSE chunk (one token) until the
//! client acknowledges the previous segment, and the client's delayed ACK turns that into added
//! milliseconds on time to first token and between tokens.
//!
//! TLS handshakes run on their own tasks (bounded by [`HANDSHAKE_TIMEOUT`]), never inside
//! `accept`, so a slow or silent client cannot hold up the next one; a failed handshake is
//! logged and dropped. Invariant: the acceptor task lives exactly as long as the listener
//! (aborted on drop), so a stopped server leaves nothing listening.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::config::CoordinatorArgs;
use crate::error::CoordinatorError;

/// Longest a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection of the edge: plain TCP or TLS over it.
pub trait EdgeIo: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> EdgeIo for T {}

/// The edge's listener, for [`axum::serve`].
pub struct EdgeListener {
    local: SocketAddr,
    inner: Inner,
}

enum Inner {
    Plain(TcpListener),
    Tls { ready: mpsc::Receiver<(Box<dyn EdgeIo>, SocketAddr)>, acceptor: tokio::task::JoinHandle<()> },
}

impl Drop for EdgeListener {
    fn drop(&mut self) {
        if let Inner::Tls { acceptor, .. } = &self.inner {
            acceptor.abort();
        }
    }
}

impl std::fmt::Debug for EdgeListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tls = matches!(self.inner, Inner::Tls { .. });
        f.debug_struct("EdgeListener").field("local", &self.local).field("tls", &tls).finish()
    }
}

impl EdgeListener {
    /// Plain HTTP on `listener`.
    pub fn plain(listener: TcpListener) -> Result<Self, CoordinatorError> {
        let local = listener.local_addr().map_err(|source| CoordinatorError::Bind { addr: unspecified(), source })?;
        Ok(Self { local, inner: Inner::Plain(listener) })
    }

    /// HTTPS on `listener` with `tls`. Must be called inside a tokio runtime.
    pub fn tls(listener: TcpListener, tls: Arc<rustls::ServerConfig>) -> Result<Self, CoordinatorError> {
        let local = listener.local_addr().map_err(|source| CoordinatorError::Bind { addr: unspecified(), source })?;
        let (tx, ready) = mpsc::channel(64);
        let acceptor = tokio::spawn(accept_tls(listener, tokio_rustls::TlsAcceptor::from(tls), tx));
        Ok(Self { local, inner: Inner::Tls { ready, acceptor } })
    }

    /// Plain or TLS as `args` say (`--tls-cert` and `--tls-key`, both or neither).
    pub fn from_args(listener: TcpListener, args: &CoordinatorArgs) -> Result<Self, CoordinatorError> {
        match (&args.tls_cert, &args.tls_key) {
            (None, None) => Self::plain(listener),
            (Some(cert), Some(key)) => {
                let cfg = cleave_net::edge::server_config(cert, key)
                    .map_err(|e| CoordinatorError::EdgeTls { reason: e.to_string() })?;
                Self::tls(listener, cfg)
            }
            _ => Err(CoordinatorError::EdgeTls { reason: "--tls-cert and --tls-key go together".into() }),
        }
    }

    /// The bound address (for logs).
    pub fn local_addr_or_unspecified(&self) -> SocketAddr {
        self.local
    }

    /// Whether clients speak TLS here.
    pub fn is_tls(&self) -> bool {
        matches!(self.inner, Inner::Tls { .. })
    }
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

fn no_delay(tcp: &TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "could not set TCP_NODELAY on an accepted connection");
    }
}

/// Accepts TCP connections and hands each to its own handshake task.
async fn accept_tls(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    ready: mpsc::Sender<(Box<dyn EdgeIo>, SocketAddr)>,
) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                accept_failed(e).await;
                continue;
            }
        };
        no_delay(&tcp);
        let (acceptor, ready) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => {
                    let _ = ready.send((Box::new(tls), peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

/// An accept error (out of file descriptors, a connection reset before accept): logged, and a
/// pause so that a persistent one does not spin.
async fn accept_failed(e: std::io::Error) {
    tracing::warn!(error = %e, "accepting an HTTP connection failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

impl axum::serve::Listener for EdgeListener {
    type Io = Box<dyn EdgeIo>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match &mut self.inner {
            Inner::Plain(l) => loop {
                match TcpListener::accept(l).await {
                    Ok((tcp, peer)) => {
                        no_delay(&tcp);
                        return (Box::new(tcp), peer);
                    }
                    Err(e) => accept_failed(e).await,
                }
            },
            Inner::Tls { ready, .. } => match ready.recv().await {
                Some(conn) => conn,
                // The acceptor task ended (it does not while the listener lives): accept nothing.
                None => std::future::pending().await,
            },
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
