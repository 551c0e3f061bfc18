//! The handoff over RDMA, end to end: a receiver actor over a [`MemoryPool`] whose memory is the
//! region the queue pairs write into, a sender through [`RdmaTransport`], control streams over
//! real mutually authenticated QUIC, and the in-memory fabric standing in for the device.
//!
//! Each fault ends with a clear error on both sides, no hang, and every block back in the pool,
//! freed only once no write can land: after the sender's `Drained`, after the receiver reset the
//! queue pair, or at once when the link itself failed.
#![cfg(feature = "rdma")]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cleave_kv_transfer::rdma::sim::SimFabric;
use cleave_kv_transfer::rdma::*;
use cleave_kv_transfer::{
    KvSender, KvTransferError, LayerChunk, MemoryPool, ReceiverConfig, ReceiverHandle, ReceiverService, SendConfig,
};
use cleave_net::tls::NodeIdentity;
use cleave_net::{Listener, NetConfig, NetKind};
use cleave_protocol::{KvDtype, KvLayout, RequestId, TransportKind};
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);
const BLOCKS: usize = 64;
/// Prefill chunk length: a 37-token prompt is 3 chunks per layer (16, 16, 5).
const CHUNK: u32 = 16;

fn layout() -> KvLayout {
    KvLayout {
        model_fingerprint: 0xabc,
        dtype: KvDtype::F16,
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 8,
        block_size: 4,
    }
}

/// K (or V) of `tokens` of `layer`, distinct per request, layer, token and byte.
fn kv(seed: u64, layer: u32, tokens: std::ops::Range<u32>, v: bool) -> Vec<u8> {
    let tb = 2 * 8 * 2;
    let mut out = Vec::with_capacity(tokens.len() * tb);
    for t in tokens {
        for i in 0..tb {
            let x = seed.wrapping_mul(0x9E37_79B9) ^ ((layer as u64) << 24) ^ ((t as u64) << 8) ^ i as u64;
            out.push((x.wrapping_mul(2654435761) >> 13) as u8 ^ v as u8);
        }
    }
    out
}

struct Rig {
    decode: NodeIdentity,
    /// A third node of the same cluster (valid certificate, not the link's owner).
    intruder: NodeIdentity,
    pool: MemoryPool,
    fabric: SimFabric,
    service: Option<ReceiverService>,
    handle: ReceiverHandle,
    transport: Arc<RdmaTransport<SimFabric>>,
    addr: SocketAddr,
}

fn staging() -> usize {
    // Four slots of a whole chunk (K and V of CHUNK tokens).
    4 * 2 * CHUNK as usize * 32
}

/// Four staging slots of one prefill step each.
fn send_cfg() -> RdmaSendConfig {
    RdmaSendConfig {
        link: SendLinkConfig {
            slots: 4,
            slot_bytes: 2 * CHUNK as u64 * 32,
            sq_depth: 256,
            policy: SignalPolicy::default(),
        },
        driver: DriverConfig::default(),
        setup_timeout: WAIT,
        write_timeout: WAIT,
    }
}

async fn rig(quarantine: Duration) -> Rig {
    let layout = layout();
    let ids = NodeIdentity::generate_test_cluster(&["decode", "prefill", "intruder"]).unwrap();
    let net = |id: &NodeIdentity| NetConfig::new(NetKind::Quic, Some(id.clone()));
    let listener = Listener::bind(&net(&ids[0]), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr();
    let pool = MemoryPool::new(layout.clone(), BLOCKS);
    let fabric = SimFabric::over_pool(pool.clone(), &layout, staging()).unwrap();
    let mut rdma = RdmaReceive::new(Arc::new(fabric.clone()));
    rdma.link.quarantine = quarantine;
    let mut cfg = ReceiverConfig::new(layout, addr, TransportKind::Rdma);
    // Short, so that the reuse test sees the link outlive it (the link's stream is quiet).
    cfg.stream_idle_timeout = Duration::from_millis(800);
    let service = ReceiverService::spawn_rdma(cfg, pool.clone(), Some(listener), rdma);
    let handle = service.handle().clone();
    let transport = Arc::new(RdmaTransport::new(&net(&ids[1]), fabric.clone(), send_cfg()).unwrap());
    Rig {
        decode: ids[0].clone(),
        intruder: ids[2].clone(),
        pool,
        fabric,
        service: Some(service),
        handle,
        transport,
        addr,
    }
}

fn chunks(seed: u64, tokens: u32) -> Vec<LayerChunk> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < tokens {
        let end = (start + CHUNK).min(tokens);
        for layer in 0..layout().num_layers {
            out.push(LayerChunk {
                layer,
                token_start: start,
                token_count: end - start,
                k: Bytes::from(kv(seed, layer, start..end, false)),
                v: Bytes::from(kv(seed, layer, start..end, true)),
            });
        }
        start = end;
    }
    out
}

/// Waits until the receiver holds no block and the pool has every block but `adopted` free.
async fn settled(r: &Rig, adopted: usize) {
    let t0 = std::time::Instant::now();
    loop {
        let s = r.handle.stats().await.unwrap();
        if s.reserved_blocks == 0 && r.pool.free_blocks() == BLOCKS - adopted {
            return;
        }
        assert!(t0.elapsed() < WAIT, "not settled: {s:?}, {} free", r.pool.free_blocks());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_lands_in_the_leased_blocks_and_the_link_is_reused() {
    let r = rig(Duration::from_secs(5)).await;
    let cfg = SendConfig::default();
    let mut adopted = Vec::new();
    for (seed, tokens) in [(1u64, 37u32), (2, 16), (3, 5)] {
        let res = r.handle.reserve(RequestId(seed), tokens, None).await.unwrap();
        let sender =
            timeout(WAIT, KvSender::start(&*r.transport, &res.ticket, &layout(), &cfg)).await.unwrap().unwrap();
        for c in chunks(seed, tokens) {
            timeout(WAIT, sender.send(c)).await.unwrap().unwrap();
        }
        let report = timeout(WAIT, sender.finish(100 + seed as u32)).await.unwrap().unwrap();
        assert_eq!(report.transport, TransportKind::Rdma);
        assert_eq!(report.streams, 1, "one control stream; the payload goes through the link");
        assert_eq!(report.bytes, 4 * 2 * tokens as u64 * 32);
        let done = res.done.wait(WAIT).await.unwrap();
        assert_eq!(done.first_token, 100 + seed as u32);
        assert_eq!(done.blocks, res.ticket.block_ids);
        for layer in 0..4 {
            let (k, v) = r.pool.gather(&done.blocks, layer, 0, tokens);
            assert!(k == kv(seed, layer, 0..tokens, false), "K of request {seed} layer {layer} differs");
            assert!(v == kv(seed, layer, 0..tokens, true), "V of request {seed} layer {layer} differs");
        }
        adopted.extend(done.blocks);
        // Quiet for longer than the receiver's stream idle timeout: the link must survive it.
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    // The data went through one-sided writes, not the pool's write path, over one link.
    assert_eq!(r.pool.writes(), 0);
    assert!(r.fabric.net(2).is_some() && r.fabric.net(4).is_none(), "one receiving queue pair for three transfers");
    settled(&r, adopted.len()).await;
    r.pool.free_request(&adopted);
    settled(&r, 0).await;
}

/// Starts a transfer of 37 tokens and sends its first prefill chunk (every layer).
async fn half_sent(r: &Rig, seed: u64, ttl: Option<Duration>) -> (KvSender, cleave_kv_transfer::LeaseWaiter) {
    let (s, w, _) = half_sent_to(r, seed, ttl).await;
    (s, w)
}

async fn half_sent_to(
    r: &Rig,
    seed: u64,
    ttl: Option<Duration>,
) -> (KvSender, cleave_kv_transfer::LeaseWaiter, Vec<u32>) {
    let res = r.handle.reserve(RequestId(seed), 37, ttl).await.unwrap();
    let sender = timeout(WAIT, KvSender::start(&*r.transport, &res.ticket, &layout(), &SendConfig::default()))
        .await
        .unwrap()
        .unwrap();
    for c in chunks(seed, 37).into_iter().take(4) {
        timeout(WAIT, sender.send(c)).await.unwrap().unwrap();
    }
    (sender, res.done, res.ticket.block_ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_dropped_mid_transfer_drains_then_the_blocks_are_freed() {
    // A long quarantine: only the sender's Drained can free the blocks within the test's wait.
    let r = rig(Duration::from_secs(60)).await;
    let (sender, done) = half_sent(&r, 7, None).await;
    drop(sender);
    let e = done.wait(WAIT).await.unwrap_err();
    assert!(matches!(e, KvTransferError::SenderGone { .. } | KvTransferError::Io { .. }), "{e}");
    settled(&r, 0).await;
    // The link survives: the next transfer goes through.
    let res = r.handle.reserve(RequestId(8), 5, None).await.unwrap();
    let s = KvSender::start(&*r.transport, &res.ticket, &layout(), &SendConfig::default()).await.unwrap();
    for c in chunks(8, 5) {
        s.send(c).await.unwrap();
    }
    s.finish(1).await.unwrap();
    let done = res.done.wait(WAIT).await.unwrap();
    r.pool.free_request(&done.blocks);
    settled(&r, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lease_aborts_the_sender_and_frees_its_blocks() {
    let r = rig(Duration::from_secs(60)).await;
    let (sender, done) = half_sent(&r, 9, None).await;
    assert!(r.handle.cancel(done.lease()).await.unwrap());
    let e = timeout(WAIT, sender.finish(0)).await.unwrap().unwrap_err();
    assert!(e.to_string().contains("Cancelled"), "{e}");
    assert!(matches!(done.wait(WAIT).await, Err(KvTransferError::Cancelled { .. })));
    settled(&r, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_writes_are_fenced_off_by_a_queue_pair_reset() {
    // The sender's writes hang in flight (a stuck path), so it can never report them drained:
    // the receiver frees the blocks only after its quarantine resets the queue pair.
    let r = rig(Duration::from_secs(1)).await;
    let (sender, done, blocks) = half_sent_to(&r, 11, None).await;
    let net = r.fabric.net(2).expect("the receiving queue pair");
    // The first prefill chunk's writes (4 layers, 4 scattered blocks, K and V) all landed.
    let t0 = std::time::Instant::now();
    while net.landed_writes() < 32 {
        assert!(t0.elapsed() < WAIT, "{} writes landed", net.landed_writes());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    net.hold(true);
    let c = chunks(11, 37).into_iter().nth(4).unwrap();
    timeout(WAIT, sender.send(c)).await.unwrap().unwrap();
    // `send` only queued it: wait until it is posted (and held) before the sender goes.
    while net.in_flight() == 0 {
        assert!(t0.elapsed() < WAIT, "the chunk was never posted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(sender);
    assert!(done.wait(WAIT).await.is_err());
    let s = r.handle.stats().await.unwrap();
    assert_eq!(s.reserved_blocks, 10, "quarantined, not freed, while a write may land: {s:?}");
    settled(&r, 0).await;
    assert!(net.is_broken(), "freed only after the reset");
    net.release();
    // The held write (layer 0, tokens 16..32) never landed: the reset flushed it.
    let (k, v) = r.pool.gather(&blocks, 0, 16, 16);
    assert!(k.iter().chain(&v).all(|b| *b == 0), "a fenced write landed after the blocks were freed");
    let (k, _) = r.pool.gather(&blocks, 0, 0, 16);
    assert!(k == kv(11, 0, 0..16, false), "the first chunk landed before the hold");
    // The reset link was dropped and its stream closed: the next transfer sets up a new one.
    let res = r.handle.reserve(RequestId(12), 5, None).await.unwrap();
    let s = timeout(WAIT, KvSender::start(&*r.transport, &res.ticket, &layout(), &SendConfig::default()))
        .await
        .unwrap()
        .unwrap();
    for c in chunks(12, 5) {
        timeout(WAIT, s.send(c)).await.unwrap().unwrap();
    }
    timeout(WAIT, s.finish(1)).await.unwrap().unwrap();
    let done = res.done.wait(WAIT).await.unwrap();
    assert!(r.fabric.net(4).is_some(), "a second receiving queue pair");
    r.pool.free_request(&done.blocks);
    settled(&r, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_fails_both_sides_and_frees_at_once() {
    let r = rig(Duration::from_secs(60)).await;
    let (sender, done) = half_sent(&r, 13, None).await;
    r.fabric.net(2).unwrap().fail_write(0, WcStatus::RetryExceeded);
    let rest: Vec<_> = chunks(13, 37).into_iter().skip(4).collect();
    for c in rest {
        if timeout(WAIT, sender.send(c)).await.unwrap().is_err() {
            break;
        }
    }
    let e = timeout(WAIT, sender.finish(0)).await.unwrap().unwrap_err();
    println!("sender: {e}");
    let e = done.wait(WAIT).await.unwrap_err();
    assert!(e.to_string().contains("rdma") || matches!(e, KvTransferError::SenderGone { .. }), "{e}");
    settled(&r, 0).await;
    // A broken link is replaced on next use.
    let res = r.handle.reserve(RequestId(14), 5, None).await.unwrap();
    let s = timeout(WAIT, KvSender::start(&*r.transport, &res.ticket, &layout(), &SendConfig::default()))
        .await
        .unwrap()
        .unwrap();
    for c in chunks(14, 5) {
        s.send(c).await.unwrap();
    }
    timeout(WAIT, s.finish(1)).await.unwrap().unwrap();
    let done = res.done.wait(WAIT).await.unwrap();
    r.pool.free_request(&done.blocks);
    settled(&r, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_refused_and_freed() {
    let r = rig(Duration::from_secs(60)).await;
    let (sender, done) = half_sent(&r, 15, Some(Duration::from_millis(400))).await;
    let e = done.wait(WAIT).await.unwrap_err();
    assert!(matches!(e, KvTransferError::LeaseExpired { .. }), "{e}");
    let e = timeout(WAIT, sender.finish(0)).await.unwrap().unwrap_err();
    assert!(e.to_string().contains("LeaseExpired"), "{e}");
    settled(&r, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_without_rdma_refuses_the_link() {
    let ids = NodeIdentity::generate_test_cluster(&["decode", "prefill"]).unwrap();
    let net = |id: &NodeIdentity| NetConfig::new(NetKind::Quic, Some(id.clone()));
    let listener = Listener::bind(&net(&ids[0]), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr();
    let pool = MemoryPool::new(layout(), BLOCKS);
    let service =
        ReceiverService::spawn(ReceiverConfig::new(layout(), addr, TransportKind::Quic), pool.clone(), Some(listener));
    let fabric = SimFabric::over_pool(MemoryPool::new(layout(), BLOCKS), &layout(), staging()).unwrap();
    let cfg = send_cfg();
    let transport = RdmaTransport::new(&net(&ids[1]), fabric, cfg).unwrap();
    let mut res = service.handle().reserve(RequestId(1), 5, None).await.unwrap();
    res.ticket.transport = TransportKind::Rdma;
    let e = timeout(WAIT, KvSender::start(&transport, &res.ticket, &layout(), &SendConfig::default()))
        .await
        .unwrap()
        .err()
        .expect("refused");
    assert!(e.to_string().contains("does not take RDMA links"), "{e}");
    assert!(service.handle().cancel(res.done.lease()).await.unwrap());
    assert!(matches!(res.done.wait(WAIT).await, Err(KvTransferError::Cancelled { .. })));
    assert_eq!(pool.free_blocks(), BLOCKS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_dies_mid_transfer_fails_the_sender_without_a_hang() {
    let mut r = rig(Duration::from_secs(60)).await;
    let (sender, _done) = half_sent(&r, 17, None).await;
    drop(r.service.take());
    let mut failed = false;
    for c in chunks(17, 37).into_iter().skip(4) {
        if timeout(WAIT, sender.send(c)).await.unwrap().is_err() {
            failed = true;
            break;
        }
    }
    let e = timeout(WAIT, sender.finish(0)).await.unwrap();
    assert!(failed || e.is_err(), "the transfer to a dead receiver succeeded");
    let _ = r.addr;
}

/// A chunk longer than a staging slot (a prefix-cache hit sent at once) goes as several write
/// groups, and layers chunked differently (a preempted prefill) complete all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_and_unevenly_chunked_layers_land() {
    let r = rig(Duration::from_secs(5)).await;
    let tokens = 45u32;
    let res = r.handle.reserve(RequestId(21), tokens, None).await.unwrap();
    let s = timeout(WAIT, KvSender::start(&*r.transport, &res.ticket, &layout(), &SendConfig::default()))
        .await
        .unwrap()
        .unwrap();
    for layer in 0..4u32 {
        // Layer 0 whole (3 slots' worth), layer 1 in two uneven pieces, the others in steps.
        let cuts: Vec<u32> = match layer {
            0 => vec![0, tokens],
            1 => vec![0, 7, tokens],
            _ => (0..tokens).step_by(CHUNK as usize).chain([tokens]).collect(),
        };
        for w in cuts.windows(2) {
            let c = LayerChunk {
                layer,
                token_start: w[0],
                token_count: w[1] - w[0],
                k: Bytes::from(kv(21, layer, w[0]..w[1], false)),
                v: Bytes::from(kv(21, layer, w[0]..w[1], true)),
            };
            timeout(WAIT, s.send(c)).await.unwrap().unwrap();
        }
    }
    timeout(WAIT, s.finish(3)).await.unwrap().unwrap();
    let done = res.done.wait(WAIT).await.unwrap();
    for layer in 0..4 {
        let (k, v) = r.pool.gather(&done.blocks, layer, 0, tokens);
        assert!(k == kv(21, layer, 0..tokens, false) && v == kv(21, layer, 0..tokens, true), "layer {layer}");
    }
    r.pool.free_request(&done.blocks);
    settled(&r, 0).await;
}

/// A link serves only the peer that set it up: another node of the cluster naming it in an
/// `Open` is refused, and the lease it named is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_named_by_another_peer_is_refused() {
    use cleave_kv_transfer::frame::{read_frame, write_control, Control, Limits, Open};
    use cleave_net::Connector;
    let r = rig(Duration::from_secs(60)).await;
    let link = r.transport.link(r.addr).await.unwrap().link_id;
    let res = r.handle.reserve(RequestId(31), 8, None).await.unwrap();
    let intruder = Connector::new(&NetConfig::new(NetKind::Quic, Some(r.intruder.clone()))).unwrap();
    let mut s = intruder.open(r.addr).await.unwrap();
    let open = Control::Open(Open {
        request_id: RequestId(31),
        lease_id: res.ticket.lease_id,
        layout: layout(),
        num_tokens: 8,
        stream_index: 0,
        stream_count: 1,
        rdma_link: Some(link),
    });
    write_control(&mut s.send, &open).await.unwrap();
    let answer = timeout(WAIT, read_frame(&mut s.recv, &Limits::default())).await.unwrap().unwrap();
    match answer {
        Some(cleave_kv_transfer::frame::Frame::Control(Control::Abort { reason, .. })) => {
            assert!(reason.contains("set up by"), "{reason}")
        }
        other => panic!("expected an abort, got {other:?}"),
    }
    assert!(res.done.wait(WAIT).await.is_err());
    settled(&r, 0).await;
}

/// The receiver restarts on the same address: the sender's link to its previous life is stale
/// (the new receiver does not know its id). The next transfer sets up a new link, whether the
/// sender noticed the old one's end first or learns it from the receiver's refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_restart_on_the_same_address_gets_a_new_link() {
    let mut r = rig(Duration::from_secs(60)).await;
    let send = |handle: cleave_kv_transfer::ReceiverHandle, t: Arc<RdmaTransport<SimFabric>>, seed: u64| async move {
        let res = handle.reserve(RequestId(seed), 9, None).await.unwrap();
        let s =
            timeout(WAIT, KvSender::start(&*t, &res.ticket, &layout(), &SendConfig::default())).await.unwrap().unwrap();
        for c in chunks(seed, 9) {
            timeout(WAIT, s.send(c)).await.unwrap().unwrap();
        }
        timeout(WAIT, s.finish(1)).await.unwrap().unwrap();
        res.done.wait(WAIT).await.unwrap()
    };
    let done = send(r.handle.clone(), r.transport.clone(), 41).await;
    r.pool.free_request(&done.blocks);
    r.service.take().unwrap().shutdown(WAIT).await;
    let cfg = NetConfig::new(NetKind::Quic, Some(r.decode.clone()));
    let listener = common::rebind(&cfg, r.addr).await;
    let rdma = RdmaReceive::new(Arc::new(r.fabric.clone()));
    let rcfg = ReceiverConfig::new(layout(), r.addr, TransportKind::Rdma);
    let service = ReceiverService::spawn_rdma(rcfg, r.pool.clone(), Some(listener), rdma);
    r.handle = service.handle().clone();
    r.service = Some(service);
    let done = send(r.handle.clone(), r.transport.clone(), 42).await;
    for layer in 0..4 {
        let (k, _) = r.pool.gather(&done.blocks, layer, 0, 9);
        assert!(k == kv(42, layer, 0..9, false), "layer {layer}");
    }
    r.pool.free_request(&done.blocks);
    settled(&r, 0).await;
}
