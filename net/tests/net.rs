//! Streams over every transport: echo both ways, mutual-TLS refusals, peer restart on the same
//! address, bounded connects. No sleeps: every wait is on an event, under a timeout.

use std::net::SocketAddr;
use std::time::Duration;

use cleave_net::tls::NodeIdentity;
use cleave_net::{Connector, DuplexStream, Listener, NetConfig, NetKind, PeerInfo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LOCAL: &str = "127.0.0.1:0";
/// Upper bound of any single wait in these tests; far above what each step needs.
const WAIT: Duration = Duration::from_secs(20);

fn local() -> SocketAddr {
    LOCAL.parse().unwrap()
}

fn cfg(kind: NetKind, id: Option<&NodeIdentity>) -> NetConfig {
    let mut c = NetConfig::new(kind, id.cloned());
    c.connect_timeout = Duration::from_secs(5);
    c
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f).await.unwrap_or_else(|_| panic!("{what} did not finish"))
}

/// Deterministic payload: byte i is a function of (seed, i).
fn payload(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
}

/// Server side of an echo: reads everything until EOF, then writes it back and closes.
async fn echo_one(mut s: DuplexStream) -> std::io::Result<()> {
    let mut buf = Vec::new();
    s.recv.read_to_end(&mut buf).await?;
    s.send.write_all(&buf).await?;
    s.send.shutdown().await?;
    Ok(())
}

/// Accepts streams forever, echoing each in its own task; returns the peers it saw on a channel.
fn spawn_echo_server(mut l: Listener) -> tokio::sync::mpsc::UnboundedReceiver<PeerInfo> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(r) = l.accept().await {
            let Ok((s, peer)) = r else { continue };
            let _ = tx.send(peer);
            tokio::spawn(echo_one(s));
        }
    });
    rx
}

/// Client side of an echo: sends `data`, closes its half, reads the reply to EOF.
async fn echo_roundtrip(c: &Connector, addr: SocketAddr, data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut s = c.open(addr).await?;
    s.send.write_all(data).await?;
    s.send.shutdown().await?;
    let mut back = Vec::new();
    s.recv.read_to_end(&mut back).await?;
    Ok(back)
}

fn kinds_with_ids() -> Vec<(NetKind, Vec<NodeIdentity>)> {
    NetKind::ALL.into_iter().map(|k| (k, NodeIdentity::generate_test_cluster(&["server", "client"]).unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_both_ways_on_every_transport_with_parallel_streams() {
    for (kind, ids) in kinds_with_ids() {
        let l = Listener::bind(&cfg(kind, Some(&ids[0])), local()).await.unwrap();
        let addr = l.local_addr();
        let mut peers = spawn_echo_server(l);
        let c = std::sync::Arc::new(Connector::new(&cfg(kind, Some(&ids[1]))).unwrap());
        // Small, then larger than every window, then several at once on one connection.
        for (seed, len) in [(1u8, 1usize), (2, 3 << 20)] {
            let data = payload(seed, len);
            let back = bounded("echo", echo_roundtrip(&c, addr, &data)).await.unwrap();
            assert!(back == data, "{kind:?}: echo of {len} bytes differs");
        }
        let mut tasks = Vec::new();
        for seed in 0..8u8 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                let data = payload(seed, 256 << 10);
                let back = echo_roundtrip(&c, addr, &data).await.unwrap();
                assert!(back == data);
            }));
        }
        for t in tasks {
            bounded("parallel echo", t).await.unwrap();
        }
        let peer = peers.recv().await.unwrap();
        let want = if kind == NetKind::TcpPlain { None } else { Some("client".to_string()) };
        assert_eq!(peer.name, want, "{kind:?}: server sees the client's name");
        let (_s, server) = bounded("open", c.open_with_peer(addr)).await.unwrap();
        let want = if kind == NetKind::TcpPlain { None } else { Some("server".to_string()) };
        assert_eq!(server.name, want, "{kind:?}: client sees the server's name");
    }
}

/// A client that must be refused: its open or its first echo fails, within the wait bound.
async fn assert_refused(kind: NetKind, c: &Connector, addr: SocketAddr, why: &str) {
    let r = bounded(why, echo_roundtrip(c, addr, b"secret")).await;
    assert!(r.is_err(), "{kind:?}: {why}: a refused peer got {:?}", r.map(|v| v.len()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_other_ca_both_ways_and_missing_client_cert() {
    for kind in [NetKind::Quic, NetKind::TcpTls] {
        let ids = NodeIdentity::generate_test_cluster(&["server", "client"]).unwrap();
        let strangers = NodeIdentity::generate_test_cluster(&["server", "intruder"]).unwrap();

        // A client from another CA, against our server.
        let l = Listener::bind(&cfg(kind, Some(&ids[0])), local()).await.unwrap();
        let addr = l.local_addr();
        let mut peers = spawn_echo_server(l);
        let intruder = Connector::new(&cfg(kind, Some(&strangers[1]))).unwrap();
        assert_refused(kind, &intruder, addr, "client cert from another CA").await;

        // A client with no certificate at all (plain TLS client trusting our CA).
        match kind {
            NetKind::TcpTls => {
                let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                let r = bounded("no-cert client", no_cert_tls_echo(&ids[0], tcp)).await;
                assert!(r.is_err(), "tcp-tls: a client without a certificate was served");
            }
            _ => {
                let r = bounded("no-cert client", no_cert_quic_echo(&ids[0], addr)).await;
                assert!(r.is_err(), "quic: a client without a certificate was served");
            }
        }

        // Our client still gets through, and it is the first peer the server ever accepted.
        let good = Connector::new(&cfg(kind, Some(&ids[1]))).unwrap();
        assert_eq!(bounded("good echo", echo_roundtrip(&good, addr, b"ok")).await.unwrap(), b"ok");
        assert_eq!(peers.recv().await.unwrap().name.as_deref(), Some("client"));

        // A server from another CA, against our client.
        let l = Listener::bind(&cfg(kind, Some(&strangers[0])), local()).await.unwrap();
        let bad_addr = l.local_addr();
        let _peers = spawn_echo_server(l);
        assert_refused(kind, &good, bad_addr, "server cert from another CA").await;
    }
}

/// Client configs without a client certificate, trusting the cluster CA through `id`'s config
/// builder (its verifier), to show the server itself refuses.
fn no_cert_client_config(id: &NodeIdentity) -> rustls::ClientConfig {
    id.anonymous_client_config().unwrap()
}

async fn no_cert_tls_echo(id: &NodeIdentity, tcp: tokio::net::TcpStream) -> anyhow::Result<Vec<u8>> {
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(no_cert_client_config(id)));
    let name = rustls::pki_types::ServerName::try_from("cleave-node").unwrap();
    let mut s = connector.connect(name, tcp).await?;
    s.write_all(b"secret").await?;
    s.shutdown().await?;
    let mut back = Vec::new();
    s.read_to_end(&mut back).await?;
    anyhow::ensure!(!back.is_empty(), "server closed without echo");
    Ok(back)
}

async fn no_cert_quic_echo(id: &NodeIdentity, addr: SocketAddr) -> anyhow::Result<Vec<u8>> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(no_cert_client_config(id))?;
    let mut ep = quinn::Endpoint::client(local())?;
    ep.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(crypto)));
    let conn = ep.connect(addr, "cleave-node")?.await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(b"secret").await?;
    send.finish()?;
    let back = recv.read_to_end(1 << 20).await?;
    anyhow::ensure!(!back.is_empty(), "server closed without echo");
    Ok(back)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_restart_on_the_same_address_is_survived() {
    for (kind, ids) in kinds_with_ids() {
        let server_cfg = cfg(kind, Some(&ids[0]));
        let l = Listener::bind(&server_cfg, local()).await.unwrap();
        let addr = l.local_addr();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        // First life: echo until told to stop, then shut down (QUIC: CONNECTION_CLOSE).
        let first = tokio::spawn(async move {
            let mut l = l;
            let mut stop_rx = stop_rx;
            loop {
                tokio::select! {
                    r = l.accept() => { if let Some(Ok((s, _))) = r { tokio::spawn(echo_one(s)); } }
                    _ = &mut stop_rx => break,
                }
            }
            l.shutdown().await;
        });
        let c = Connector::new(&cfg(kind, Some(&ids[1]))).unwrap();
        assert_eq!(bounded("echo 1", echo_roundtrip(&c, addr, b"one")).await.unwrap(), b"one");
        stop_tx.send(()).unwrap();
        bounded("shutdown", first).await.unwrap();

        // Second life on the same port, same identity (a restarted node).
        let l2 = bounded("rebind", rebind(&server_cfg, addr)).await;
        let _peers = spawn_echo_server(l2);
        // The connector must notice the old connection is gone; at most one attempt may fail
        // (the one in flight when it learns), and it must fail fast, not hang.
        let mut ok = false;
        for _ in 0..2 {
            match bounded("echo 2", echo_roundtrip(&c, addr, b"two")).await {
                Ok(v) => {
                    assert_eq!(v, b"two");
                    ok = true;
                    break;
                }
                Err(e) => eprintln!("{kind:?}: attempt after restart failed: {e:#}"),
            }
        }
        assert!(ok, "{kind:?}: no echo after the peer restarted");
        // And it keeps working.
        assert_eq!(bounded("echo 3", echo_roundtrip(&c, addr, b"three")).await.unwrap(), b"three");
    }
}

/// Binds `addr` again. The old socket is released by the runtime when its driver task ends,
/// which `Listener::shutdown` awaits for QUIC; for safety this retries a bounded number of times,
/// yielding to the runtime in between (no sleeps).
async fn rebind(cfg: &NetConfig, addr: SocketAddr) -> Listener {
    let mut last = None;
    for _ in 0..10_000 {
        match Listener::bind(cfg, addr).await {
            Ok(l) => return l,
            Err(e) => last = Some(e),
        }
        tokio::task::yield_now().await;
    }
    panic!("could not rebind {addr}: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_silent_peer_times_out_without_hanging() {
    let ids = NodeIdentity::generate_test_cluster(&["client"]).unwrap();
    // A UDP socket that never answers, and a TCP listener that never accepts (the kernel
    // completes the TCP handshake, nobody speaks TLS).
    let udp = std::net::UdpSocket::bind(local()).unwrap();
    let tcp = std::net::TcpListener::bind(local()).unwrap();
    for (kind, addr) in [(NetKind::Quic, udp.local_addr().unwrap()), (NetKind::TcpTls, tcp.local_addr().unwrap())] {
        let mut c = cfg(kind, Some(&ids[0]));
        c.connect_timeout = Duration::from_millis(200);
        let conn = Connector::new(&c).unwrap();
        let t0 = std::time::Instant::now();
        let r = bounded("silent connect", conn.open(addr)).await;
        assert!(r.is_err(), "{kind:?}: connected to a silent peer");
        assert!(t0.elapsed() < Duration::from_secs(5), "{kind:?}: took {:?}", t0.elapsed());
        eprintln!("{kind:?}: {}", r.err().unwrap());
    }
    // Plain TCP to an address with no listener: refused or unreachable, promptly.
    let closed = {
        let l = std::net::TcpListener::bind(local()).unwrap();
        l.local_addr().unwrap()
    };
    let mut c = cfg(NetKind::TcpPlain, None);
    c.connect_timeout = Duration::from_millis(200);
    let conn = Connector::new(&c).unwrap();
    assert!(bounded("closed port", conn.open(closed)).await.is_err());
    // (No unroutable-address case: sandboxes with a transparent proxy accept any TCP connect.)
}

/// Callers queued on one silent QUIC address share the failing attempt's answer: a peer that
/// died mid-handshake answers no datagram, so each attempt costs the whole connect timeout,
/// and twelve requests routed to a prefill node just before it was killed failed one after
/// another over a minute (`tests/cluster.rs::killing_a_prefill_node_leaves_no_request_hanging`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_connects_to_a_silent_peer_fail_together() {
    let ids = NodeIdentity::generate_test_cluster(&["client"]).unwrap();
    let udp = std::net::UdpSocket::bind(local()).unwrap();
    let addr = udp.local_addr().unwrap();
    let mut c = cfg(NetKind::Quic, Some(&ids[0]));
    let timeout = Duration::from_millis(400);
    c.connect_timeout = timeout;
    let conn = std::sync::Arc::new(Connector::new(&c).unwrap());
    let t0 = std::time::Instant::now();
    let tries: Vec<_> = (0..12)
        .map(|_| {
            let conn = conn.clone();
            tokio::spawn(async move { conn.open(addr).await.map(|_| ()) })
        })
        .collect();
    for t in tries {
        assert!(bounded("silent connect", t).await.unwrap().is_err(), "connected to a silent peer");
    }
    // One attempt's timeout, not twelve in a row (4.8 s); the margin is for a loaded machine.
    let took = t0.elapsed();
    assert!(took < timeout * 4, "12 callers took {took:?} with a {timeout:?} connect timeout");
    // A caller that comes after the failure tries afresh (and fails on its own timeout).
    let t1 = std::time::Instant::now();
    assert!(bounded("fresh connect", conn.open(addr)).await.is_err());
    assert!(t1.elapsed() >= timeout / 2, "a later caller reused an old failure: {:?}", t1.elapsed());
}

#[tokio::test]
async fn tls_kinds_need_an_identity() {
    for kind in [NetKind::Quic, NetKind::TcpTls] {
        assert!(Connector::new(&cfg(kind, None)).is_err());
        assert!(Listener::bind(&cfg(kind, None), local()).await.is_err());
    }
}

/// A QUIC peer that dies without a word (its runtime vanishes: no CONNECTION_CLOSE) and comes
/// back on the same address with the same identity: the client's cached connection is reset by
/// the new process's stateless reset (same identity, same reset key) at its next packet, so the
/// client fails one attempt fast and reconnects, instead of waiting for the idle timeout (30 s,
/// beyond this test's wait bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_peer_crash_and_restart_is_noticed_through_stateless_reset() {
    let ids = NodeIdentity::generate_test_cluster(&["server", "client"]).unwrap();
    let server_cfg = cfg(NetKind::Quic, Some(&ids[0]));
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
    let (crash_tx, crash_rx) = tokio::sync::oneshot::channel::<()>();
    let cfg2 = server_cfg.clone();
    // First life on its own runtime in its own thread; "crash" = leave block_on and drop the
    // runtime, so no task (the endpoint driver included) runs again.
    let life = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut l = Listener::bind(&cfg2, local()).await.unwrap();
            addr_tx.send(l.local_addr()).unwrap();
            let mut crash_rx = crash_rx;
            loop {
                tokio::select! {
                    r = l.accept() => { if let Some(Ok((s, _))) = r { tokio::spawn(echo_one(s)); } }
                    _ = &mut crash_rx => break,
                }
            }
            drop(l); // queues a close that no task will ever send
        });
        drop(rt);
    });
    let addr = bounded("first life", addr_rx).await.unwrap();
    let c = Connector::new(&cfg(NetKind::Quic, Some(&ids[1]))).unwrap();
    assert_eq!(bounded("echo 1", echo_roundtrip(&c, addr, b"one")).await.unwrap(), b"one");
    crash_tx.send(()).unwrap();
    bounded("crash", tokio::task::spawn_blocking(move || life.join().unwrap())).await.unwrap();

    let l2 = bounded("rebind", rebind(&server_cfg, addr)).await;
    let _peers = spawn_echo_server(l2);
    let t0 = std::time::Instant::now();
    let mut ok = false;
    for _ in 0..2 {
        match bounded("echo after crash", echo_roundtrip(&c, addr, b"two")).await {
            Ok(v) => {
                assert_eq!(v, b"two");
                ok = true;
                break;
            }
            Err(e) => eprintln!("attempt after crash failed after {:?}: {e:#}", t0.elapsed()),
        }
    }
    assert!(ok, "no echo after the peer crashed and restarted");
}

/// The zero-copy halves: `write_bytes` interleaved with plain writes, `read_chunk` to EOF, on
/// every transport (QUIC hands its buffers over; the others copy), with several connections per
/// peer on QUIC. The bytes arrive whole and in order, and `zero_copy` says which is which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_bytes_and_read_chunk_keep_order_on_every_transport() {
    for (kind, ids) in kinds_with_ids() {
        let tuning = cleave_net::QuicTuning { connections_per_peer: 2, ..Default::default() };
        let mut l = Listener::bind_with_tuning(&cfg(kind, Some(&ids[0])), local(), &tuning).await.unwrap();
        let addr = l.local_addr();
        let server = tokio::spawn(async move {
            let mut got = Vec::new();
            for _ in 0..3 {
                let (mut s, _) = bounded("accept", l.accept()).await.unwrap().unwrap();
                assert_eq!(s.recv.zero_copy(), kind == NetKind::Quic);
                let mut data = Vec::new();
                while let Some(c) = bounded("read_chunk", s.recv.read_chunk(100_000)).await.unwrap() {
                    assert!(!c.is_empty() && c.len() <= 100_000);
                    data.extend_from_slice(&c);
                }
                s.send.write_all(&[7]).await.unwrap();
                s.send.shutdown().await.unwrap();
                got.push(data);
            }
            // The listener lives until the client has its acks (dropping it closes the
            // connections at once, unsent bytes included).
            (got, l)
        });
        let c = Connector::with_tuning(&cfg(kind, Some(&ids[1])), &tuning).unwrap();
        let mut sent = Vec::new();
        for round in 0..3u8 {
            let mut s = bounded("open", c.open(addr)).await.unwrap();
            assert_eq!(s.send.zero_copy(), kind == NetKind::Quic);
            let (a, b, tail) = (payload(round, 1 << 20), payload(round + 10, 777), payload(round + 20, 5));
            s.send.write_bytes(bytes::Bytes::from(a.clone())).await.unwrap();
            s.send.write_all(&tail).await.unwrap();
            s.send.write_bytes(bytes::Bytes::from(b.clone())).await.unwrap();
            s.send.shutdown().await.unwrap();
            let mut ack = [0u8; 1];
            bounded("ack", s.recv.read_exact(&mut ack)).await.unwrap();
            sent.push([a, tail, b].concat());
        }
        let (got, _listener) = bounded("server", server).await.unwrap();
        // Streams may be accepted in any order across two connections.
        let (mut got, mut sent) = (got, sent);
        got.sort();
        sent.sort();
        assert_eq!(got, sent, "{kind:?}");
    }
}

/// A listener's reloader swaps the certificate new connections see, on both TLS kinds;
/// connections already open keep theirs. Plain TCP has nothing to swap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_listener_presents_the_new_certificate_to_new_connections() {
    let ca = cleave_net::tls::ClusterCa::generate().unwrap();
    let (old, new, client) =
        (ca.issue("node-old").unwrap(), ca.issue("node-new").unwrap(), ca.issue("client").unwrap());
    for kind in [NetKind::Quic, NetKind::TcpTls] {
        let l = bounded("bind", Listener::bind(&cfg(kind, Some(&old)), local())).await.unwrap();
        let (addr, reloader) = (l.local_addr(), l.reloader().expect("a TLS listener has a reloader"));
        let _peers = spawn_echo_server(l);
        let first = Connector::new(&cfg(kind, Some(&client))).unwrap();
        let (_s, peer) = bounded("open", first.open_with_peer(addr)).await.unwrap();
        assert_eq!(peer.name.as_deref(), Some("node-old"), "{kind:?}");
        reloader.set_identity(&new).unwrap();
        // A fresh connector makes a new connection (the first one caches its QUIC connection).
        let second = Connector::new(&cfg(kind, Some(&client))).unwrap();
        let (_s, peer) = bounded("open", second.open_with_peer(addr)).await.unwrap();
        assert_eq!(peer.name.as_deref(), Some("node-new"), "{kind:?}: the reloaded certificate");
        assert_eq!(bounded("echo", echo_roundtrip(&second, addr, b"after")).await.unwrap(), b"after");
    }
    let l = bounded("bind", Listener::bind(&cfg(NetKind::TcpPlain, None), local())).await.unwrap();
    assert!(l.reloader().is_none());
}

#[test]
fn the_advertised_address_is_the_explicit_one_or_a_routable_bound_one() {
    let coordinator: SocketAddr = "127.0.0.1:7000".parse().unwrap();
    let explicit: SocketAddr = "192.0.2.7:9000".parse().unwrap();
    let bound: SocketAddr = "127.0.0.1:4321".parse().unwrap();
    assert_eq!(cleave_net::advertised(bound, Some(explicit), coordinator), explicit);
    assert_eq!(cleave_net::advertised(bound, None, coordinator), bound);
    // 0.0.0.0 is not an address a peer can connect to: the source address toward the
    // coordinator (loopback here) with the bound port.
    let any: SocketAddr = "0.0.0.0:4321".parse().unwrap();
    assert_eq!(cleave_net::advertised(any, None, coordinator), bound);
}
