//! QUIC streams (quinn): one endpoint per [`Connector`](super::Connector) and per
//! [`Listener`](super::Listener), [`QuicTuning::connections_per_peer`] cached connections per
//! peer address (streams opened on them in turn), one bidirectional stream per [`DuplexStream`].
//!
//! Invariants:
//! - at most one connection attempt per (peer address, connection index) is in flight:
//!   concurrent `open`s on a slot wait on its async lock for the one attempt (itself bounded by
//!   the connect timeout) and then share its connection;
//! - a cached connection with a close reason (closed, reset, timed out) is never handed out: the
//!   next `open` replaces it;
//! - every endpoint's stateless-reset key is derived from the node identity (see `net` docs).
//!
//! Throughput: a naive endpoint (1200-byte datagrams, 1.25 MB stream window) is CPU-bound at
//! ~10% of raw loopback TCP: every datagram is one trip through quinn's state machine, one AEAD
//! call and one syscall. [`QuicTuning::default`] raises the datagram size (MTU discovery up to
//! 64 KiB, so a loopback or jumbo-frame path is used at its real MTU), the flow-control windows
//! (so a 2048-token KV of 256 MiB never stalls on credit) and the socket buffers (so bursts are
//! not dropped); see BENCHMARKS.md "KV transfer" for the measured effect of each.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, EndpointConfig, TransportConfig, VarInt};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use super::{io_err, DuplexStream, NetConfig, PeerInfo};
use crate::tls::NodeIdentity;
use crate::{NetError, Result};

/// Congestion controller of a QUIC connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    Cubic,
    NewReno,
    Bbr,
}

/// QUIC transport parameters. The defaults are the ones measured best on loopback, except the
/// congestion controller (chosen under loss and delay across network namespaces); every field
/// is a knob `cleave bench transfer` varies.
#[derive(Debug, Clone)]
pub struct QuicTuning {
    /// Per-stream receive window (bytes the peer may send ahead on one stream).
    pub stream_receive_window: u32,
    /// Per-connection receive window.
    pub receive_window: u32,
    /// Per-connection send buffer.
    pub send_window: u64,
    /// Datagram size before MTU discovery (at least 1200).
    pub initial_mtu: u16,
    /// Upper bound of MTU discovery and the largest datagram accepted (at most 65527); None
    /// turns MTU discovery off.
    pub mtu_discovery_upper_bound: Option<u16>,
    /// UDP generic segmentation offload (several datagrams per syscall).
    pub gso: bool,
    /// SO_SNDBUF and SO_RCVBUF of the UDP socket (the kernel caps them at `net.core.*mem_max`).
    pub socket_buffer: usize,
    pub congestion: Congestion,
    /// Initial congestion window in bytes (None: the controller's default, 10 datagrams).
    pub initial_window: Option<u64>,
    /// A connection with no packet for this long is closed.
    pub idle_timeout: Duration,
    /// Ping interval that keeps a cached connection open while idle.
    pub keep_alive: Option<Duration>,
    /// Most bidirectional streams a peer may have open on one connection.
    pub max_concurrent_streams: u32,
    /// Connections a connector keeps to each peer; streams are opened on them in turn. Each
    /// connection has its own driver task (packet building, encryption, decryption), so with
    /// several streams per transfer more than one core can work on one peer's traffic.
    pub connections_per_peer: usize,
    /// Ask the peer (ACK frequency extension) to acknowledge only every this many
    /// ack-eliciting packets instead of every second one; None leaves the default. Fewer ACKs
    /// are fewer datagrams to build, encrypt, send and process on both ends.
    pub ack_eliciting_threshold: Option<u32>,
}

impl Default for QuicTuning {
    fn default() -> Self {
        Self {
            stream_receive_window: 16 << 20,
            receive_window: 64 << 20,
            send_window: 64 << 20,
            initial_mtu: 1200,
            mtu_discovery_upper_bound: Some(65_527),
            // Off: quinn sizes a GSO batch as segments x MTU without the kernel's 64 KiB cap,
            // so with large datagrams every batch is refused (measured: 0.3 GB/s with, 1.0
            // without, on loopback). With 64 KiB datagrams a batch would hold one anyway.
            gso: false,
            socket_buffer: 32 << 20,
            // BBR, not Cubic: quinn's Cubic (and NewReno) collapse under random loss on a path
            // with any RTT, where BBR, which does not read loss as congestion, holds its rate.
            // Measured across network namespaces (BENCHMARKS.md "KV transfer under faults"):
            // a 4 MiB handoff under 20 +- 10 ms and 1% loss took 14.3 s with Cubic, 0.79 s with
            // BBR (TLS-TCP: 0.77 s); under 5% loss 3.4 s against 0.28 s (TLS-TCP: 2.1 s).
            congestion: Congestion::Bbr,
            initial_window: None,
            // A peer that dies without closing (SIGKILL, power loss) is noticed within 5 s;
            // keep-alives every second keep idle but live connections open.
            idle_timeout: Duration::from_secs(5),
            keep_alive: Some(Duration::from_secs(1)),
            max_concurrent_streams: 1024,
            connections_per_peer: 1,
            ack_eliciting_threshold: None,
        }
    }
}

impl QuicTuning {
    /// quinn's own defaults: the "naive" baseline of the benchmark.
    pub fn naive() -> Self {
        Self {
            stream_receive_window: 1_250_000,
            receive_window: u32::MAX,
            send_window: 10_000_000,
            initial_mtu: 1200,
            mtu_discovery_upper_bound: Some(1452),
            gso: true,
            socket_buffer: 0,
            congestion: Congestion::Cubic,
            initial_window: None,
            idle_timeout: Duration::from_secs(30),
            keep_alive: None,
            max_concurrent_streams: 100,
            connections_per_peer: 1,
            ack_eliciting_threshold: None,
        }
    }

    fn transport(&self) -> Result<Arc<TransportConfig>> {
        let mut t = TransportConfig::default();
        t.stream_receive_window(VarInt::from_u32(self.stream_receive_window))
            .receive_window(VarInt::from_u32(self.receive_window))
            .send_window(self.send_window)
            .initial_mtu(self.initial_mtu)
            .enable_segmentation_offload(self.gso)
            .max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_streams))
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            .keep_alive_interval(self.keep_alive);
        if let Some(n) = self.ack_eliciting_threshold {
            let mut a = quinn::AckFrequencyConfig::default();
            a.ack_eliciting_threshold(VarInt::from_u32(n));
            t.ack_frequency_config(Some(a));
        }
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout)
            .map_err(|e| NetError::Tls(format!("quic idle timeout: {e}")))?;
        t.max_idle_timeout(Some(idle));
        match self.mtu_discovery_upper_bound {
            Some(ub) => {
                let mut m = quinn::MtuDiscoveryConfig::default();
                m.upper_bound(ub.max(self.initial_mtu));
                t.mtu_discovery_config(Some(m));
            }
            None => {
                t.mtu_discovery_config(None);
            }
        }
        match self.congestion {
            Congestion::Cubic => {
                let mut c = quinn::congestion::CubicConfig::default();
                if let Some(w) = self.initial_window {
                    c.initial_window(w);
                }
                t.congestion_controller_factory(Arc::new(c));
            }
            Congestion::NewReno => {
                let mut c = quinn::congestion::NewRenoConfig::default();
                if let Some(w) = self.initial_window {
                    c.initial_window(w);
                }
                t.congestion_controller_factory(Arc::new(c));
            }
            Congestion::Bbr => {
                let mut c = quinn::congestion::BbrConfig::default();
                if let Some(w) = self.initial_window {
                    c.initial_window(w);
                }
                t.congestion_controller_factory(Arc::new(c));
            }
        }
        Ok(Arc::new(t))
    }

    fn endpoint_config(&self, identity: &NodeIdentity) -> Result<EndpointConfig> {
        let secret = identity.secret_digest();
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret);
        let mut cfg = EndpointConfig::new(Arc::new(key));
        // quinn's default generator keys its connection-id tag randomly per process, so a
        // restarted node would drop packets for its previous life's connections as "invalid
        // CID" instead of answering them with the stateless reset above, and peers would wait
        // for the idle timeout. Key it by the identity too.
        let cid_key = u64::from_le_bytes(secret[24..32].try_into().expect("8 bytes"));
        cfg.cid_generator(move || Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key)));
        let max = self.mtu_discovery_upper_bound.unwrap_or(self.initial_mtu).max(self.initial_mtu);
        cfg.max_udp_payload_size(max.clamp(1200, 65_527))
            .map_err(|e| NetError::Tls(format!("quic max udp payload: {e}")))?;
        Ok(cfg)
    }

    fn socket(&self, addr: SocketAddr) -> Result<std::net::UdpSocket> {
        use socket2::{Domain, Protocol, Socket, Type};
        let what = || format!("udp socket {addr}");
        let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(io_err(what()))?;
        if self.socket_buffer > 0 {
            set_buffers(&sock, self.socket_buffer);
        }
        sock.bind(&addr.into()).map_err(io_err(what()))?;
        Ok(sock.into())
    }

    fn endpoint(
        &self,
        identity: &NodeIdentity,
        addr: SocketAddr,
        server: Option<quinn::ServerConfig>,
    ) -> Result<Endpoint> {
        let runtime =
            quinn::default_runtime().ok_or_else(|| NetError::Tls("quic endpoint needs a tokio runtime".into()))?;
        Endpoint::new(self.endpoint_config(identity)?, server, self.socket(addr)?, runtime)
            .map_err(io_err(format!("quic endpoint {addr}")))
    }
}

/// Sets SO_SNDBUF/SO_RCVBUF to `size`. Best effort: the kernel caps them at
/// `net.core.{w,r}mem_max` (4 MiB on this machine); a process with CAP_NET_ADMIN passes the cap
/// with SO_*BUFFORCE. A receive buffer smaller than a burst drops datagrams, and every drop costs a
/// retransmission and a congestion-window cut (measured on loopback: 5-15% of 64 KiB datagrams
/// lost and a 2048-token KV at ~34% of raw TCP with 4 MiB, ~52% with 32 MiB), so a capped buffer is
/// logged once per process with the sysctl that lifts it.
fn set_buffers(sock: &socket2::Socket, size: usize) {
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    let val = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    for (force, plain) in [(libc::SO_SNDBUFFORCE, libc::SO_SNDBUF), (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF)] {
        let set = |opt| {
            // SAFETY: fd is a live socket owned by `sock`; the option value is a c_int of the
            // size passed.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&val as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            }
        };
        if set(force) != 0 {
            let _ = set(plain);
        }
    }
    // The kernel reports twice the size it granted (it counts its own bookkeeping).
    let granted = sock.recv_buffer_size().unwrap_or(0) / 2;
    static WARNED: std::sync::Once = std::sync::Once::new();
    if granted < size {
        WARNED.call_once(|| {
            tracing::warn!(
                requested = size,
                granted,
                "QUIC receive buffer capped by the kernel; KV transfers will drop datagrams and slow down: \
                 raise it with `sysctl -w net.core.rmem_max={size} net.core.wmem_max={size}` (or run with CAP_NET_ADMIN)"
            );
        });
    }
}

fn peer_info(addr: SocketAddr, conn: &quinn::Connection) -> PeerInfo {
    let certs =
        conn.peer_identity().and_then(|any| any.downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>().ok());
    PeerInfo::new(addr, certs.as_deref().map(Vec::as_slice))
}

fn duplex(send: quinn::SendStream, recv: quinn::RecvStream) -> DuplexStream {
    DuplexStream::quic(send, recv)
}

type Slot = Arc<tokio::sync::Mutex<SlotState>>;

/// What a connection slot holds.
#[derive(Default)]
enum SlotState {
    #[default]
    Empty,
    Live(quinn::Connection),
    /// The last attempt failed, when and why: callers that were already waiting on the slot
    /// take this answer instead of trying again. A peer that died mid-handshake answers no
    /// datagram, so each attempt costs the whole connect timeout; twelve requests queued behind
    /// one dead address took a minute to fail one after another.
    Failed {
        at: tokio::time::Instant,
        reason: String,
    },
}

pub(super) struct QuicConnector {
    /// One client endpoint per address family, created on first use.
    endpoints: Mutex<[Option<Endpoint>; 2]>,
    /// Connection cache. The std mutex guards only the map (never held across an await); each
    /// slot's async mutex serializes connecting to that address.
    conns: Mutex<HashMap<(SocketAddr, usize), Slot>>,
    /// Round-robin position over a peer's `connections_per_peer` connections.
    next: std::sync::atomic::AtomicUsize,
    client: quinn::ClientConfig,
    identity: NodeIdentity,
    tuning: QuicTuning,
    connect_timeout: Duration,
}

impl QuicConnector {
    pub(super) fn new(cfg: &NetConfig, tuning: &QuicTuning) -> Result<Self> {
        let identity = cfg.identity()?.clone();
        let crypto = QuicClientConfig::try_from(identity.client_config()?)
            .map_err(|e| NetError::Tls(format!("quic client config: {e}")))?;
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(tuning.transport()?);
        Ok(Self {
            endpoints: Mutex::new([None, None]),
            conns: Mutex::new(HashMap::new()),
            next: std::sync::atomic::AtomicUsize::new(0),
            client,
            identity,
            tuning: tuning.clone(),
            connect_timeout: cfg.connect_timeout,
        })
    }

    fn endpoint_for(&self, addr: SocketAddr) -> Result<Endpoint> {
        let (i, any): (usize, SocketAddr) = if addr.is_ipv4() {
            (0, (std::net::Ipv4Addr::UNSPECIFIED, 0).into())
        } else {
            (1, (std::net::Ipv6Addr::UNSPECIFIED, 0).into())
        };
        let mut eps = self.endpoints.lock().expect("endpoint lock poisoned");
        if let Some(ep) = &eps[i] {
            return Ok(ep.clone());
        }
        let ep = self.tuning.endpoint(&self.identity, any, None)?;
        eps[i] = Some(ep.clone());
        Ok(ep)
    }

    async fn connect(&self, addr: SocketAddr) -> Result<quinn::Connection> {
        let ep = self.endpoint_for(addr)?;
        let connecting = ep
            .connect_with(self.client.clone(), addr, "cleave-node")
            .map_err(|e| NetError::Connect { addr, reason: e.to_string() })?;
        let ms = self.connect_timeout.as_millis() as u64;
        match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(NetError::Connect { addr, reason: e.to_string() }),
            Err(_) => Err(NetError::Timeout { what: format!("quic connect to {addr}"), ms }),
        }
    }

    /// The cached live connection to `addr`, or a new one.
    async fn connection(&self, addr: SocketAddr) -> Result<quinn::Connection> {
        let index =
            self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.tuning.connections_per_peer.max(1);
        let slot = {
            let mut map = self.conns.lock().expect("connection cache lock poisoned");
            map.entry((addr, index)).or_default().clone()
        };
        let asked = tokio::time::Instant::now();
        let mut guard = slot.lock().await;
        match &*guard {
            SlotState::Live(c) if c.close_reason().is_none() => return Ok(c.clone()),
            SlotState::Live(c) => {
                tracing::debug!(%addr, reason = ?c.close_reason(), "evicting closed quic connection");
            }
            SlotState::Failed { at, reason } if *at >= asked => {
                // It failed while this caller waited for the slot: the same answer, now.
                return Err(NetError::Connect { addr, reason: format!("{reason} (a concurrent attempt)") });
            }
            SlotState::Failed { .. } | SlotState::Empty => {}
        }
        match self.connect(addr).await {
            Ok(conn) => {
                *guard = SlotState::Live(conn.clone());
                Ok(conn)
            }
            Err(e) => {
                *guard = SlotState::Failed { at: tokio::time::Instant::now(), reason: e.to_string() };
                Err(e)
            }
        }
    }

    pub(super) async fn open(&self, addr: SocketAddr) -> Result<(DuplexStream, PeerInfo)> {
        // Two tries: a connection that closes between the check and `open_bi` (peer restart
        // noticed just now) is replaced once; a second failure is the peer's real state.
        let mut last = None;
        for _ in 0..2 {
            let conn = self.connection(addr).await?;
            let ms = self.connect_timeout.as_millis() as u64;
            match tokio::time::timeout(self.connect_timeout, conn.open_bi()).await {
                Ok(Ok((send, recv))) => {
                    let peer = peer_info(addr, &conn);
                    return Ok((duplex(send, recv), peer));
                }
                Ok(Err(e)) => last = Some(NetError::ConnectionLost { addr, reason: e.to_string() }),
                Err(_) => return Err(NetError::Timeout { what: format!("quic stream credit from {addr}"), ms }),
            }
        }
        Err(last.expect("loop ran"))
    }

    pub(super) fn close(&self) {
        let map = std::mem::take(&mut *self.conns.lock().expect("connection cache lock poisoned"));
        drop(map);
        for ep in self.endpoints.lock().expect("endpoint lock poisoned").iter().flatten() {
            ep.close(VarInt::from_u32(0), b"connector closed");
        }
    }
}

impl Drop for QuicConnector {
    fn drop(&mut self) {
        self.close();
    }
}

type Accepted = Result<(DuplexStream, PeerInfo)>;

pub(super) struct QuicListener {
    endpoint: Endpoint,
    tuning: QuicTuning,
    local: SocketAddr,
    rx: mpsc::Receiver<Accepted>,
    task: JoinHandle<()>,
}

fn server_config(identity: &NodeIdentity, tuning: &QuicTuning) -> Result<quinn::ServerConfig> {
    let crypto = QuicServerConfig::try_from(identity.server_config()?)
        .map_err(|e| NetError::Tls(format!("quic server config: {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(tuning.transport()?);
    Ok(server)
}

/// Swaps the certificate a QUIC listener presents to new connections (those open keep theirs).
#[derive(Clone)]
pub(super) struct QuicReloader {
    endpoint: Endpoint,
    tuning: QuicTuning,
}

impl QuicReloader {
    pub(super) fn set_identity(&self, identity: &NodeIdentity) -> Result<()> {
        self.endpoint.set_server_config(Some(server_config(identity, &self.tuning)?));
        Ok(())
    }
}

impl QuicListener {
    pub(super) fn reloader(&self) -> QuicReloader {
        QuicReloader { endpoint: self.endpoint.clone(), tuning: self.tuning.clone() }
    }

    pub(super) fn bind(cfg: &NetConfig, addr: SocketAddr, tuning: &QuicTuning) -> Result<Self> {
        let identity = cfg.identity()?;
        let server = server_config(identity, tuning)?;
        let endpoint = tuning.endpoint(identity, addr, Some(server))?;
        let local = endpoint.local_addr().map_err(io_err("quic local address"))?;
        let (tx, rx) = mpsc::channel(64);
        let task = tokio::spawn(accept_loop(endpoint.clone(), tx, cfg.connect_timeout));
        Ok(Self { endpoint, tuning: tuning.clone(), local, rx, task })
    }

    pub(super) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub(super) async fn accept(&mut self) -> Option<Accepted> {
        self.rx.recv().await
    }

    pub(super) async fn shutdown(self) {
        self.endpoint.close(VarInt::from_u32(0), b"listener shut down");
        self.task.abort();
        // Bounded: peers that never acknowledge the close are given up on after 1 s.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.endpoint.wait_idle()).await;
    }
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        self.endpoint.close(VarInt::from_u32(0), b"listener dropped");
        self.task.abort();
    }
}

/// Accepts connections (each handshake bounded by `handshake_timeout`) and forwards every
/// stream of every connection to `tx`. Aborting this task aborts the per-connection tasks.
async fn accept_loop(endpoint: Endpoint, tx: mpsc::Sender<Accepted>, handshake_timeout: Duration) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break };
                conns.spawn(serve_connection(incoming, tx.clone(), handshake_timeout));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn serve_connection(incoming: quinn::Incoming, tx: mpsc::Sender<Accepted>, handshake_timeout: Duration) {
    let addr = incoming.remote_address();
    let conn = match tokio::time::timeout(handshake_timeout, incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            tracing::warn!(%addr, error = %e, "quic handshake refused");
            return;
        }
        Err(_) => {
            tracing::warn!(%addr, "quic handshake timed out");
            return;
        }
    };
    let info = peer_info(addr, &conn);
    loop {
        match conn.accept_bi().await {
            Ok((send, recv)) => {
                let peer = info.clone();
                if tx.send(Ok((duplex(send, recv), peer))).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(%addr, error = %e, "quic connection ended");
                return;
            }
        }
    }
}
