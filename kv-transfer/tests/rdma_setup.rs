//! RDMA link setup: queue-pair metadata exchanged over a real, mutually authenticated QUIC
//! stream, then a lease written through the link (the in-memory provider stands in for the
//! device), and every way the exchange can go wrong: malformed frames, truncation, the wrong
//! frame, garbage metadata, a receiver without a region, a silent peer. Every wait is bounded.
#![cfg(feature = "rdma")]
#![allow(clippy::single_range_in_vec_init)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_kv_transfer::frame::{encode_control, read_frame, write_control, Control, Limits};
use cleave_kv_transfer::rdma::sim::{SimFabric, SimPort, SimSender};
use cleave_kv_transfer::rdma::*;
use cleave_kv_transfer::transport::duplex_from;
use cleave_kv_transfer::KvTransferError;
use cleave_net::tls::NodeIdentity;
use cleave_net::{Connector, Listener, NetConfig, NetKind};
use cleave_protocol::{KvDtype, KvLayout};
use tokio::io::AsyncWriteExt;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);
const LAYERS: u32 = 2;

fn layout() -> PoolLayout {
    let kv = KvLayout {
        model_fingerprint: 0,
        dtype: KvDtype::F16,
        num_layers: LAYERS,
        num_kv_heads: 2,
        head_dim: 4,
        block_size: 4,
    };
    PoolLayout::dense(&kv, 16).unwrap()
}

fn send_cfg() -> SendLinkConfig {
    SendLinkConfig { slots: 2, slot_bytes: 4096, sq_depth: 64, policy: SignalPolicy::default() }
}

fn recv_cfg() -> RecvLinkConfig {
    RecvLinkConfig { recv_depth: 64, quarantine: Duration::from_secs(5) }
}

async fn quic_pair() -> (Listener, Connector, SocketAddr) {
    let ids = NodeIdentity::generate_test_cluster(&["decode", "prefill"]).unwrap();
    let cfg = |id: &NodeIdentity| NetConfig::new(NetKind::Quic, Some(id.clone()));
    let l = Listener::bind(&cfg(&ids[0]), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = l.local_addr();
    (l, Connector::new(&cfg(&ids[1])).unwrap(), addr)
}

/// Link setup over QUIC between a decode node's queue pairs on `decode` and a prefill node's on
/// `prefill` (views of one fabric): the receiver's and the sender's results.
async fn setup(
    decode: &SimFabric,
    prefill: &SimFabric,
) -> (Result<DynRecvLink, KvTransferError>, Result<(u64, SendLink<SimSender>), KvTransferError>) {
    let (mut listener, connector, addr) = quic_pair().await;
    let rf = decode.clone();
    let receiver = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap().unwrap();
        let link = accept_link(&mut s, &rf, 7, recv_cfg(), WAIT).await;
        if link.is_err() {
            // Refused: the stream's end tells the sender.
            let _ = s.send.shutdown().await;
        }
        // Kept open until the sender read the answer (or saw the refusal).
        (link, s, listener)
    });
    let mut s = connector.open(addr).await.unwrap();
    let send = connect_link(&mut s, prefill, send_cfg(), WAIT).await;
    let (recv, rs, listener) = timeout(WAIT, receiver).await.unwrap().unwrap();
    drop((rs, listener));
    (recv, send)
}

/// Writes 6 tokens of every layer into blocks 3 and 11 through a connected link and checks the
/// receiver's region against the reference.
async fn a_lease_lands(fabric: &SimFabric, send: SendLink<SimSender>, recv: DynRecvLink) {
    let pool = layout();
    let dcfg = DriverConfig { poll_interval: Duration::from_micros(100), queue: 16 };
    let tx = SendDriver::spawn(send, dcfg);
    let (rx, mut events) = RecvDriver::spawn(recv, dcfg);

    let dl = Instant::now() + WAIT;
    let tag = rx.open_lease(LAYERS, dl).await.unwrap();
    tx.open(tag, dl).await.unwrap();
    let blocks: Arc<[u32]> = Arc::from(vec![3u32, 11]);
    let tb = pool.token_bytes as usize;
    let mut want = vec![0u8; pool.extent().unwrap() as usize];
    for layer in 0..LAYERS {
        let k: Vec<u8> = (0..6 * tb).map(|i| (i + layer as usize * 13) as u8 | 1).collect();
        let v: Vec<u8> = (0..6 * tb).map(|i| (i * 3 + layer as usize) as u8 | 2).collect();
        for (half, src) in [(Half::K, &k), (Half::V, &v)] {
            for p in 0..6u32 {
                let off = pool.offset(layer, half, blocks[(p / 4) as usize], p % 4).unwrap() as usize;
                want[off..off + tb].copy_from_slice(&src[p as usize * tb..(p as usize + 1) * tb]);
            }
        }
        let c = SendChunk {
            blocks: blocks.clone(),
            layer,
            tokens: 0..6,
            tag,
            chunk: 0,
            k: Bytes::from(k),
            v: Bytes::from(v),
        };
        timeout(WAIT, tx.send(c)).await.unwrap().unwrap();
    }
    assert_eq!(timeout(WAIT, tx.finish(tag)).await.unwrap().unwrap().outcome, Outcome::Done);
    rx.set_chunks(tag, 1).await.unwrap();
    let e = timeout(WAIT, events.recv()).await.unwrap().unwrap();
    assert_eq!(e, LeaseEvent { tag, outcome: Outcome::Done });
    // The sender found the receiver's queue pair through the metadata it read from the stream.
    let net = (1..=4).find_map(|qp| fabric.net(qp)).expect("the receiver's queue pair");
    assert!(net.region() == want, "the region differs from the reference");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_over_quic_then_a_lease_lands_through_the_link() {
    let fabric = SimFabric::new(layout(), 0x10_0000, 0x77, 2 * 4096);
    let (recv, send) = setup(&fabric, &fabric).await;
    let (link_id, send) = send.unwrap();
    assert_eq!(link_id, 7, "the sender learns the id the receiver gave the link");
    a_lease_lands(&fabric, send, recv.unwrap()).await;
}

/// IPv4-mapped GIDs (`::ffff:10.0.0.x`), as RoCE v2 ports carry them.
const GID_DECODE: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];
const GID_PREFILL: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2];

/// RoCE: ports without LIDs. The link comes up only because each side's metadata carries its
/// port's GID and the other connects through a global route to exactly that GID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roce_link_connects_through_the_exchanged_gids() {
    let fabric = SimFabric::new(layout(), 0x10_0000, 0x77, 2 * 4096);
    let decode = fabric.on_port(SimPort::roce(GID_DECODE));
    let prefill = fabric.on_port(SimPort::roce(GID_PREFILL));
    let (recv, send) = setup(&decode, &prefill).await;
    let (_, send) = send.unwrap();
    a_lease_lands(&fabric, send, recv.unwrap()).await;
}

/// What the serving CLI did before `--rdma-gid-index`: queue pairs without a GID on a RoCE port.
/// The peer cannot reach them (LID 0), and a connect naming a GID other than the peer's fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roce_connect_without_the_peers_gid_fails() {
    let fabric = SimFabric::new(layout(), 0x10_0000, 0x77, 2 * 4096);
    let decode = fabric.on_port(SimPort::roce(GID_DECODE));
    let no_gid = fabric.on_port(SimPort { lid: 0, gid: None });
    let (recv, send) = setup(&decode, &no_gid).await;
    let e = recv.err().expect("the receiver cannot reach a RoCE queue pair without its GID");
    assert!(e.to_string().contains("reachable by GID only"), "{e}");
    assert!(send.is_err(), "the sender sees the refusal");

    // A connect naming a GID that is not the peer's (the metadata of another port).
    let prefill = fabric.on_port(SimPort::roce(GID_PREFILL));
    let (pending, _) = decode.create_recv().unwrap();
    let (_, mut offer) = prefill.create_send().unwrap();
    offer.gid[15] = 9;
    let e = decode.connect_recv(pending, &offer).expect_err("a GID the peer does not have");
    assert!(e.to_string().contains("is not the GID"), "{e}");
    // And a global route needs a GID of one's own.
    let (pending, _) = no_gid.create_send().unwrap();
    let (_, answer) = decode.create_recv().unwrap();
    let e = no_gid.connect_send(pending, &answer).expect_err("no source GID");
    assert!(e.to_string().contains("without a GID"), "{e}");
}

fn metadata(region: bool) -> QpMetadata {
    let l = layout();
    QpMetadata {
        qp_num: 5,
        lid: 1,
        gid: [0; 16],
        psn: 9,
        mtu: PathMtu::Mtu4096,
        max_write_bytes: 1 << 20,
        region: region.then(|| RemoteRegion { addr: 0x1000, len: l.extent().unwrap(), rkey: 1, layout: l }),
    }
}

/// The receiving side of setup over an in-memory pipe, fed `bytes` by the sender.
async fn accept_bytes(bytes: &[u8]) -> KvTransferError {
    let fabric = SimFabric::new(layout(), 0x10_0000, 0x77, 8192);
    let (a, b) = tokio::io::duplex(1 << 16);
    let mut theirs = duplex_from(a);
    theirs.send.write_all(bytes).await.unwrap();
    theirs.send.shutdown().await.unwrap();
    let mut ours = duplex_from(b);
    let r = accept_link(&mut ours, &fabric, 1, recv_cfg(), WAIT).await;
    r.err().expect("refused")
}

#[tokio::test]
async fn bad_offers_are_clear_errors() {
    let good = metadata(true).encode().unwrap();
    assert_eq!(QpMetadata::decode(&good).unwrap(), metadata(true));
    let offer = |m: Vec<u8>| encode_control(&Control::LinkOffer { metadata: m }).to_vec();
    let open = encode_control(&Control::Ack { lease_id: cleave_protocol::LeaseId(1) }).to_vec();
    let good_offer = offer(metadata(false).encode().unwrap());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty stream", vec![]),
        ("half a prefix", vec![0, 0, 0]),
        ("zero-length header", vec![0; 8]),
        ("header over the limit", [&[0xFF, 0xFF, 0, 0][..], &[0; 4]].concat()),
        ("truncated offer", good_offer[..good_offer.len() - 3].to_vec()),
        ("garbage header", [&[16, 0, 0, 0, 0, 0, 0, 0][..], &[0xAB; 16]].concat()),
        ("another frame", open),
        ("garbage metadata", offer(vec![0xAB; 16])),
    ];
    for (what, bytes) in cases {
        let e = accept_bytes(&bytes).await;
        assert!(
            matches!(
                e,
                KvTransferError::Truncated { .. }
                    | KvTransferError::MalformedFrame { .. }
                    | KvTransferError::FrameTooLarge { .. }
                    | KvTransferError::Protocol { .. }
                    | KvTransferError::RdmaMetadata { .. }
            ),
            "{what}: {e}"
        );
        println!("{what}: {e}");
    }
    // Every single-byte corruption of good metadata is refused or decodes to valid metadata.
    for i in 0..good.len() {
        let mut b = good.clone();
        b[i] ^= 0x5A;
        if let Ok(m) = QpMetadata::decode(&b) {
            m.validate().unwrap();
        }
    }
}

/// The receiver's answer must carry a region; a peer answering like a sender is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_without_a_region_is_refused() {
    let fabric = SimFabric::new(layout(), 0x10_0000, 0x77, 8192);
    let (mut listener, connector, addr) = quic_pair().await;
    let peer = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap().unwrap();
        read_frame(&mut s.recv, &Limits::default()).await.unwrap();
        let answer = Control::LinkAnswer { link_id: 1, metadata: metadata(false).encode().unwrap() };
        write_control(&mut s.send, &answer).await.unwrap();
        s.send.shutdown().await.unwrap();
        // Returned, not dropped: the listener (and its connection) lives until the client has
        // read the answer and the test awaits this task.
        (s, listener)
    });
    let mut s = connector.open(addr).await.unwrap();
    let e = connect_link(&mut s, &fabric, send_cfg(), WAIT).await.err().expect("refused");
    assert!(e.to_string().contains("no memory region"), "{e}");
    let _ = peer.await;
}

/// A peer that never answers: setup fails with a timeout on both sides, never hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out() {
    let fabric = SimFabric::new(layout(), 0x10_0000, 0x77, 8192);
    let (mut listener, connector, addr) = quic_pair().await;
    let limit = Duration::from_millis(300);
    let rf = fabric.clone();
    let receiver = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap().unwrap();
        // The opener's first bytes arrived (the accept); nothing more will.
        let r = accept_link(&mut s, &rf, 1, recv_cfg(), limit).await;
        (r.err(), listener)
    });
    let mut s = connector.open(addr).await.unwrap();
    // Only the first byte of a frame: the receiver learns of the stream, then waits.
    s.send.write_all(&[0]).await.unwrap();
    s.send.flush().await.unwrap();
    let (e, _l) = timeout(WAIT, receiver).await.unwrap().unwrap();
    assert!(matches!(e, Some(KvTransferError::Timeout { .. })), "{e:?}");
}
