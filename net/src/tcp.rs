//! TCP streams: one TCP connection per [`DuplexStream`], TLS 1.3 with the cluster certificates
//! (tokio-rustls) or plain. TCP_NODELAY on both ends (control messages are small and must not
//! wait for Nagle). Connect plus handshake is bounded by the connect timeout on the client; the
//! server bounds each handshake by the same timeout in its own task, so a peer that connects and
//! says nothing never holds up other peers.
//!
//! Not pooled (see the `net` module docs for why).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::{io_err, DuplexStream, NetConfig, NetKind, PeerInfo};
use crate::tls;
use crate::{NetError, Result};

fn plain(stream: TcpStream) -> DuplexStream {
    let (recv, send) = stream.into_split();
    DuplexStream::from_io(send, recv)
}

fn tls_duplex<S>(stream: S) -> DuplexStream
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (recv, send) = tokio::io::split(stream);
    DuplexStream::from_io(send, recv)
}

pub(super) struct TcpConnector {
    tls: Option<TlsConnector>,
    connect_timeout: Duration,
}

impl TcpConnector {
    pub(super) fn new(cfg: &NetConfig) -> Result<Self> {
        let tls = match cfg.kind {
            NetKind::TcpTls => Some(TlsConnector::from(Arc::new(cfg.identity()?.client_config()?))),
            _ => None,
        };
        Ok(Self { tls, connect_timeout: cfg.connect_timeout })
    }

    pub(super) async fn open(&self, addr: SocketAddr) -> Result<(DuplexStream, PeerInfo)> {
        let ms = self.connect_timeout.as_millis() as u64;
        match tokio::time::timeout(self.connect_timeout, self.open_unbounded(addr)).await {
            Ok(r) => r,
            Err(_) => Err(NetError::Timeout { what: format!("tcp connect to {addr}"), ms }),
        }
    }

    async fn open_unbounded(&self, addr: SocketAddr) -> Result<(DuplexStream, PeerInfo)> {
        let tcp = TcpStream::connect(addr).await.map_err(|e| NetError::Connect { addr, reason: e.to_string() })?;
        tcp.set_nodelay(true).map_err(io_err(format!("TCP_NODELAY to {addr}")))?;
        let Some(tls) = &self.tls else {
            return Ok((plain(tcp), PeerInfo::new(addr, None)));
        };
        let stream = tls
            .connect(tls::placeholder_name(), tcp)
            .await
            .map_err(|e| NetError::Connect { addr, reason: format!("tls: {e}") })?;
        let peer = PeerInfo::new(addr, stream.get_ref().1.peer_certificates());
        Ok((tls_duplex(stream), peer))
    }
}

type Accepted = Result<(DuplexStream, PeerInfo)>;

pub(super) struct TcpListenerImpl {
    local: SocketAddr,
    rx: mpsc::Receiver<Accepted>,
    task: JoinHandle<()>,
    /// The acceptor new connections are served with (None: plain TCP); see [`TcpReloader`].
    tls: Option<watch::Sender<TlsAcceptor>>,
}

/// Swaps the certificate a TLS-TCP listener presents to new connections (those open keep
/// theirs): the accept loop takes the acceptor from this watch for each connection.
#[derive(Clone)]
pub(super) struct TcpReloader(watch::Sender<TlsAcceptor>);

impl TcpReloader {
    pub(super) fn set_identity(&self, identity: &crate::tls::NodeIdentity) -> Result<()> {
        self.0.send_replace(TlsAcceptor::from(Arc::new(identity.server_config()?)));
        Ok(())
    }
}

impl TcpListenerImpl {
    pub(super) async fn bind(cfg: &NetConfig, addr: SocketAddr) -> Result<Self> {
        let tls = match cfg.kind {
            NetKind::TcpTls => Some(TlsAcceptor::from(Arc::new(cfg.identity()?.server_config()?))),
            _ => None,
        };
        let listener = TcpListener::bind(addr).await.map_err(io_err(format!("tcp bind {addr}")))?;
        let local = listener.local_addr().map_err(io_err("tcp local address"))?;
        let (tx, rx) = mpsc::channel(64);
        let tls = tls.map(|a| watch::channel(a).0);
        let task =
            tokio::spawn(accept_loop(listener, tls.as_ref().map(watch::Sender::subscribe), tx, cfg.connect_timeout));
        Ok(Self { local, rx, task, tls })
    }

    /// None for plain TCP (no certificate to swap).
    pub(super) fn reloader(&self) -> Option<TcpReloader> {
        self.tls.clone().map(TcpReloader)
    }

    pub(super) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub(super) async fn accept(&mut self) -> Option<Accepted> {
        self.rx.recv().await
    }
}

impl Drop for TcpListenerImpl {
    fn drop(&mut self) {
        // Aborting the task drops the socket (the port is free again) and the handshakes.
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<watch::Receiver<TlsAcceptor>>,
    tx: mpsc::Sender<Accepted>,
    handshake_timeout: Duration,
) {
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            res = listener.accept() => {
                let (tcp, addr) = match res {
                    Ok(x) => x,
                    Err(e) => {
                        // Transient (EMFILE, ECONNABORTED): report and keep listening.
                        if tx.send(Err(io_err("tcp accept")(e))).await.is_err() {
                            return;
                        }
                        continue;
                    }
                };
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(%addr, error = %e, "TCP_NODELAY refused");
                }
                match &tls {
                    None => {
                        if tx.send(Ok((plain(tcp), PeerInfo::new(addr, None)))).await.is_err() {
                            return;
                        }
                    }
                    Some(acceptor) => {
                        let acceptor = acceptor.borrow().clone();
                        let tx = tx.clone();
                        handshakes.spawn(async move {
                            match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                                Ok(Ok(stream)) => {
                                    let peer = PeerInfo::new(addr, stream.get_ref().1.peer_certificates());
                                    let _ = tx.send(Ok((tls_duplex(stream), peer))).await;
                                }
                                Ok(Err(e)) => tracing::warn!(%addr, error = %e, "tls handshake refused"),
                                Err(_) => tracing::warn!(%addr, "tls handshake timed out"),
                            }
                        });
                    }
                }
            }
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
        }
    }
}
