//! The async owners of both link ends ([`SendDriver`], [`RecvDriver`]) over the in-memory
//! connection: chunks land like the byte-by-byte reference, back-pressure queues chunks in
//! order, `finish` waits for queued chunks, a cancel with writes in flight frees the blocks only
//! after the sender drained, and a dropped driver answers every waiter. Every wait is bounded.
#![cfg(feature = "rdma")]
// `&[0..8]` is a list of one chunk's token range here, not a mistaken array of numbers.
#![allow(clippy::single_range_in_vec_init)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_kv_transfer::rdma::sim::*;
use cleave_kv_transfer::rdma::*;
use cleave_protocol::{KvDtype, KvLayout};
use tokio::time::timeout;

const ADDR: u64 = 0x7000_0000;
const RKEY: u32 = 0x55;
const WAIT: Duration = Duration::from_secs(10);
const LAYERS: u32 = 3;

struct Rig {
    net: SimNet,
    tx: SendDriver,
    rx: RecvDriver,
    events: tokio::sync::mpsc::UnboundedReceiver<LeaseEvent>,
    layout: PoolLayout,
}

fn rig(slots: usize) -> Rig {
    let kv = KvLayout {
        model_fingerprint: 0,
        dtype: KvDtype::F16,
        num_layers: LAYERS,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 4,
    };
    let layout = PoolLayout::dense(&kv, 32).unwrap();
    let len = layout.extent().unwrap();
    let net = SimNet::new(ADDR, len as usize, RKEY);
    let remote = QpMetadata {
        qp_num: 1,
        lid: 1,
        gid: [0; 16],
        psn: 0,
        mtu: PathMtu::Mtu4096,
        max_write_bytes: 1 << 20,
        region: Some(RemoteRegion { addr: ADDR, len, rkey: RKEY, layout }),
    };
    let slot_bytes = 1024;
    let scfg = SendLinkConfig { slots, slot_bytes, sq_depth: 64, policy: SignalPolicy { every: 4 } };
    let send = SendLink::new(net.sender(slots * slot_bytes as usize), &remote, scfg).unwrap();
    let recv =
        RecvLink::new(net.receiver(), RecvLinkConfig { recv_depth: 64, quarantine: Duration::from_secs(5) }).unwrap();
    let dcfg = DriverConfig { poll_interval: Duration::from_micros(100), queue: 16 };
    let tx = SendDriver::spawn(send, dcfg);
    let (rx, events) = RecvDriver::spawn(recv, dcfg);
    Rig { net, tx, rx, events, layout }
}

/// Deterministic K and V of (tag, layer, tokens).
fn kv_bytes(layout: &PoolLayout, tag: u16, layer: u32, tokens: std::ops::Range<u32>) -> (Bytes, Bytes) {
    let n = (tokens.end - tokens.start) as usize * layout.token_bytes as usize;
    let f = |h: usize, i: usize| {
        (tag as usize * 31 + layer as usize * 7 + h * 101 + tokens.start as usize * 3 + i) as u8 | 1
    };
    (Bytes::from((0..n).map(|i| f(0, i)).collect::<Vec<_>>()), Bytes::from((0..n).map(|i| f(1, i)).collect::<Vec<_>>()))
}

/// The region after the reference copy of every (layer, chunk) of one lease.
fn reference(layout: &PoolLayout, len: usize, blocks: &[u32], tag: u16, chunks: &[std::ops::Range<u32>]) -> Vec<u8> {
    let mut region = vec![0u8; len];
    let tb = layout.token_bytes as usize;
    for layer in 0..LAYERS {
        for tokens in chunks {
            let (k, v) = kv_bytes(layout, tag, layer, tokens.clone());
            for (half, src) in [(Half::K, &k), (Half::V, &v)] {
                for p in tokens.clone() {
                    let off = layout
                        .offset(layer, half, blocks[(p / layout.block_size) as usize], p % layout.block_size)
                        .unwrap() as usize;
                    let i = (p - tokens.start) as usize * tb;
                    region[off..off + tb].copy_from_slice(&src[i..i + tb]);
                }
            }
        }
    }
    region
}

/// Sends every layer of every chunk, each `send` awaited (so back-pressure shows as waiting).
async fn send_all(r: &Rig, tag: u16, blocks: &Arc<[u32]>, chunks: &[std::ops::Range<u32>]) {
    for (ci, tokens) in chunks.iter().enumerate() {
        for layer in 0..LAYERS {
            let (k, v) = kv_bytes(&r.layout, tag, layer, tokens.clone());
            let c = SendChunk { blocks: blocks.clone(), layer, tokens: tokens.clone(), tag, chunk: ci as u32, k, v };
            timeout(WAIT, r.tx.send(c)).await.expect("send bounded").unwrap();
        }
    }
}

async fn next_event(r: &mut Rig) -> LeaseEvent {
    timeout(WAIT, r.events.recv()).await.expect("event bounded").expect("driver alive")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lands_like_the_reference_and_ends_done_on_both_sides_even_with_one_staging_slot() {
    for slots in [1, 4] {
        let mut r = rig(slots);
        let dl = Instant::now() + WAIT;
        let tag = r.rx.open_lease(LAYERS, dl).await.unwrap();
        r.tx.open(tag, dl).await.unwrap();
        let blocks: Arc<[u32]> = Arc::from(vec![4u32, 5, 6, 9]);
        let chunks = [0..5, 5..13, 13..16];
        send_all(&r, tag, &blocks, &chunks).await;
        let sent = timeout(WAIT, r.tx.finish(tag)).await.unwrap().unwrap();
        assert_eq!(sent, LeaseEvent { tag, outcome: Outcome::Done });
        r.rx.set_chunks(tag, chunks.len() as u32).await.unwrap();
        assert_eq!(next_event(&mut r).await, LeaseEvent { tag, outcome: Outcome::Done });
        let want = reference(&r.layout, r.net.region().len(), &blocks, tag, &chunks);
        assert!(r.net.region() == want, "slots {slots}: region differs from the reference");
    }
}

/// `finish` called while the lease's chunks still wait for a staging slot (the writes are
/// held on the wire) reports Done only after they were all posted and completed. One thread:
/// the spawned callers then issue their commands in spawn order (chunks, then `finish`), as
/// one sender task would.
#[tokio::test(flavor = "current_thread")]
async fn finish_waits_for_chunks_still_queued_behind_back_pressure() {
    let mut r = rig(1);
    let dl = Instant::now() + WAIT;
    let tag = r.rx.open_lease(LAYERS, dl).await.unwrap();
    r.tx.open(tag, dl).await.unwrap();
    let blocks: Arc<[u32]> = Arc::from(vec![0u32, 1]);
    r.net.hold(true);
    // Queue every layer's chunk without awaiting: with one slot and the wire held, only the
    // first can be posted.
    let mut sends = Vec::new();
    for layer in 0..LAYERS {
        let (k, v) = kv_bytes(&r.layout, tag, layer, 0..8);
        let c = SendChunk { blocks: blocks.clone(), layer, tokens: 0..8, tag, chunk: 0, k, v };
        let tx = r.tx.clone();
        sends.push(tokio::spawn(async move { tx.send(c).await }));
        tokio::task::yield_now().await;
    }
    let tx = r.tx.clone();
    let finish = tokio::spawn(async move { tx.finish(tag).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!finish.is_finished(), "finish returned while chunks were queued");
    r.net.hold(false);
    r.net.release();
    for s in sends {
        timeout(WAIT, s).await.unwrap().unwrap().unwrap();
    }
    let out = timeout(WAIT, finish).await.unwrap().unwrap().unwrap();
    assert_eq!(out, LeaseEvent { tag, outcome: Outcome::Done });
    r.rx.set_chunks(tag, 1).await.unwrap();
    assert_eq!(next_event(&mut r).await, LeaseEvent { tag, outcome: Outcome::Done });
    assert_eq!(r.net.region(), reference(&r.layout, r.net.region().len(), &blocks, tag, &[0..8]));
}

/// A cancel while writes are in flight: the receiver reports nothing (the blocks are not safe)
/// until the sender's cancel returns (drained) and the receiver is told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lease_is_freed_only_after_the_sender_drained() {
    let mut r = rig(4);
    let dl = Instant::now() + WAIT;
    let tag = r.rx.open_lease(LAYERS, dl).await.unwrap();
    r.tx.open(tag, dl).await.unwrap();
    let blocks: Arc<[u32]> = Arc::from(vec![2u32, 3]);
    r.net.hold(true);
    send_all(&r, tag, &blocks, &[0..8]).await;
    r.rx.cancel(tag).await.unwrap();
    let tx = r.tx.clone();
    let cancel = tokio::spawn(async move { tx.cancel(tag).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!cancel.is_finished(), "the sender's cancel returned with writes in flight");
    assert!(r.events.try_recv().is_err(), "the receiver freed blocks that writes may still reach");
    r.net.hold(false);
    r.net.release();
    timeout(WAIT, cancel).await.unwrap().unwrap().unwrap();
    r.rx.drained(tag).await.unwrap();
    let e = next_event(&mut r).await;
    assert_eq!(e.tag, tag);
    assert!(matches!(e.outcome, Outcome::Failed { must_reset_qp: false, .. }), "{e:?}");
}

/// A failed write fails the lease: `finish` returns the failure, the receiver's lease fails
/// too (its deadline or the broken queue pair), and nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_is_the_outcome_of_finish() {
    let r = rig(4);
    let dl = Instant::now() + WAIT;
    let tag = r.rx.open_lease(LAYERS, dl).await.unwrap();
    r.tx.open(tag, dl).await.unwrap();
    let blocks: Arc<[u32]> = Arc::from(vec![7u32, 8]);
    r.net.fail_write(1, WcStatus::RetryExceeded);
    // Later posts may already see the broken queue pair: each send either posts or errs.
    for layer in 0..LAYERS {
        let (k, v) = kv_bytes(&r.layout, tag, layer, 0..8);
        let c = SendChunk { blocks: blocks.clone(), layer, tokens: 0..8, tag, chunk: 0, k, v };
        let _ = timeout(WAIT, r.tx.send(c)).await.expect("send bounded");
    }
    let out = timeout(WAIT, r.tx.finish(tag)).await.expect("finish bounded");
    match out {
        Ok(e) => assert!(matches!(e.outcome, Outcome::Failed { .. }), "{e:?}"),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// Dropping every handle stops an idle driver; its event channel closes (the link and its
/// queue pair are gone, so open leases are safe to free).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_handles_stops_the_drivers_and_closes_the_event_channel() {
    let mut r = rig(2);
    drop(r.tx);
    drop(r.rx);
    assert!(timeout(WAIT, r.events.recv()).await.expect("bounded").is_none());
}
