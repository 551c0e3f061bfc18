//! Both ends of an RDMA link over the in-memory connection ([`sim`]): the happy path against
//! the byte-by-byte reference, back-pressure, and every fault, with the receiver's rule that a
//! failed lease is reported only once no write of it can land.
#![cfg(feature = "rdma")]
// `&[0..8]` is a list of one chunk's token range here, not a mistaken array of numbers.
#![allow(clippy::single_range_in_vec_init)]

use std::time::{Duration, Instant};

use cleave_kv_transfer::rdma::sim::*;
use cleave_kv_transfer::rdma::*;
use cleave_protocol::{KvDtype, KvLayout};

const ADDR: u64 = 0x7000_0000;
const RKEY: u32 = 0x55;

struct Rig {
    net: SimNet,
    tx: SendLink<SimSender>,
    rx: RecvLink<SimReceiver>,
    layout: PoolLayout,
    t0: Instant,
}

fn rig(slots: usize, recv_depth: u32) -> Rig {
    let kv = KvLayout {
        model_fingerprint: 0,
        dtype: KvDtype::F16,
        num_layers: 3,
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
    let cfg = SendLinkConfig { slots, slot_bytes, sq_depth: 64, policy: SignalPolicy { every: 4 } };
    let tx = SendLink::new(net.sender(slots * slot_bytes as usize), &remote, cfg).unwrap();
    let rx = RecvLink::new(net.receiver(), RecvLinkConfig { recv_depth, quarantine: Duration::from_secs(1) }).unwrap();
    Rig { net, tx, rx, layout, t0: Instant::now() }
}

/// Deterministic K and V bytes of (lease, layer, tokens).
fn kv_bytes(layout: &PoolLayout, tag: u16, layer: u32, tokens: std::ops::Range<u32>) -> (Vec<u8>, Vec<u8>) {
    let n = (tokens.end - tokens.start) as usize * layout.token_bytes as usize;
    let f = |h: u32, i: usize| {
        (tag as usize * 31 + layer as usize * 7 + h as usize * 101 + tokens.start as usize * 3 + i) as u8 | 1
    };
    ((0..n).map(|i| f(0, i)).collect(), (0..n).map(|i| f(1, i)).collect())
}

/// Where the reference copy puts (tag, layer, tokens) into the region.
fn expect(layout: &PoolLayout, region: &mut [u8], blocks: &[u32], tag: u16, layer: u32, tokens: std::ops::Range<u32>) {
    let (k, v) = kv_bytes(layout, tag, layer, tokens.clone());
    let tb = layout.token_bytes as usize;
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

/// Sends every layer of `chunks` (token ranges) for a lease, polling when back-pressured.
fn send_all(
    r: &mut Rig,
    tag: u16,
    blocks: &[u32],
    chunks: &[std::ops::Range<u32>],
    events: &mut (Vec<LeaseEvent>, Vec<LeaseEvent>),
) {
    for (ci, tokens) in chunks.iter().enumerate() {
        for layer in 0..3 {
            let (k, v) = kv_bytes(&r.layout, tag, layer, tokens.clone());
            let c = ChunkWrite { blocks, layer, tokens: tokens.clone(), tag, chunk: ci as u32 };
            let mut tries = 0;
            while !r.tx.send_chunk(&c, &k, &v).unwrap() {
                tries += 1;
                assert!(tries < 100, "no progress");
                events.0.extend(r.tx.poll(r.t0).unwrap());
                events.1.extend(r.rx.poll(r.t0).unwrap());
            }
        }
    }
}

#[test]
fn two_interleaved_leases_land_like_the_reference_and_end_done_on_both_sides() {
    let mut r = rig(2, 64);
    let dl = r.t0 + Duration::from_secs(5);
    let a = r.rx.open_lease(3, dl).unwrap();
    let b = r.rx.open_lease(3, dl).unwrap();
    r.tx.open(a, dl).unwrap();
    r.tx.open(b, dl).unwrap();
    let (blocks_a, blocks_b) = ([4u32, 5, 6, 9], [0u32, 1, 20]);
    let mut ev = (Vec::new(), Vec::new());
    send_all(&mut r, a, &blocks_a, &[0..5, 5..13], &mut ev);
    send_all(&mut r, b, &blocks_b, &[0..3, 3..6, 6..10], &mut ev);
    // Back-pressure polled completions already: finishing may report Done at once.
    ev.0.extend(r.tx.finish(a).unwrap());
    ev.0.extend(r.tx.finish(b).unwrap());
    ev.1.extend(r.rx.set_chunks(a, 2, r.t0).unwrap());
    ev.1.extend(r.rx.set_chunks(b, 3, r.t0).unwrap());
    ev.0.extend(r.tx.poll(r.t0).unwrap());
    ev.1.extend(r.rx.poll(r.t0).unwrap());
    for side in [&mut ev.0, &mut ev.1] {
        side.sort_by_key(|e| e.tag);
        assert_eq!(
            side,
            &vec![LeaseEvent { tag: a, outcome: Outcome::Done }, LeaseEvent { tag: b, outcome: Outcome::Done }]
        );
    }
    let mut want = vec![0u8; r.net.region().len()];
    for layer in 0..3 {
        expect(&r.layout, &mut want, &blocks_a, a, layer, 0..5);
        expect(&r.layout, &mut want, &blocks_a, a, layer, 5..13);
        expect(&r.layout, &mut want, &blocks_b, b, layer, 0..3);
        expect(&r.layout, &mut want, &blocks_b, b, layer, 3..6);
        expect(&r.layout, &mut want, &blocks_b, b, layer, 6..10);
    }
    assert!(r.net.region() == want, "region differs from the reference");
    // The receiver's in-place checksum equals the sender's frame checksum of K and V.
    let pool = r.net.region();
    for layer in 0..3 {
        let (k, v) = kv_bytes(&r.layout, a, layer, 5..13);
        let landed = landed_checksum(&pool, &r.layout, &blocks_a, layer, 5..13).unwrap();
        assert_eq!(landed, cleave_kv_transfer::frame::checksum(&k, &v));
        assert_ne!(landed_checksum(&pool, &r.layout, &blocks_b, layer, 0..3).unwrap(), landed);
    }
    assert!(landed_checksum(&pool, &r.layout, &blocks_a, 0, 5..17).is_err(), "beyond the lease");
    assert_eq!((r.tx.free_slots(), r.tx.tracker().slots_used(), r.rx.open_leases()), (2, 0, 0));
}

#[test]
fn a_full_staging_area_pushes_back_until_completions_free_a_slot() {
    let mut r = rig(1, 64);
    let dl = r.t0 + Duration::from_secs(5);
    let tag = r.rx.open_lease(3, dl).unwrap();
    r.tx.open(tag, dl).unwrap();
    let (k, v) = kv_bytes(&r.layout, tag, 0, 0..4);
    let c = ChunkWrite { blocks: &[3], layer: 0, tokens: 0..4, tag, chunk: 0 };
    r.net.hold(true);
    assert!(r.tx.send_chunk(&c, &k, &v).unwrap());
    let c1 = ChunkWrite { layer: 1, ..c.clone() };
    assert!(!r.tx.send_chunk(&c1, &k, &v).unwrap(), "the one slot is in flight");
    r.net.release();
    assert_eq!(r.tx.poll(r.t0).unwrap(), vec![]);
    assert!(r.tx.send_chunk(&c1, &k, &v).unwrap());
    // Sizes that do not match the token range are refused before anything is posted.
    assert!(r.tx.send_chunk(&c1, &k[1..], &v).is_err());
    assert!(r.tx.send_chunk(&ChunkWrite { tag: 99, ..c1 }, &k, &v).is_err());
}

#[test]
fn a_failed_write_fails_the_lease_on_both_sides_without_a_reset() {
    let mut r = rig(4, 64);
    let dl = r.t0 + Duration::from_secs(5);
    let a = r.rx.open_lease(3, dl).unwrap();
    let b = r.rx.open_lease(3, dl).unwrap();
    r.tx.open(a, dl).unwrap();
    r.tx.open(b, dl).unwrap();
    r.net.fail_write(1, WcStatus::RetryExceeded);
    let (k, v) = kv_bytes(&r.layout, a, 0, 0..4);
    for layer in 0..2 {
        assert!(r.tx.send_chunk(&ChunkWrite { blocks: &[0], layer, tokens: 0..4, tag: a, chunk: 0 }, &k, &v).unwrap());
    }
    let tx = r.tx.poll(r.t0).unwrap();
    assert!(
        matches!(&tx[0], LeaseEvent { tag, outcome: Outcome::Failed { reason: FailReason::Completion { status: WcStatus::RetryExceeded, .. }, .. } } if *tag == a),
        "{tx:?}"
    );
    assert!(
        matches!(&tx[1], LeaseEvent { tag, outcome: Outcome::Failed { reason: FailReason::QueuePairBroken { .. }, .. } } if *tag == b),
        "{tx:?}"
    );
    let rx = r.rx.poll(r.t0).unwrap();
    assert_eq!(rx.len(), 2, "{rx:?}");
    assert!(
        rx.iter().all(|e| matches!(e.outcome, Outcome::Failed { must_reset_qp: false, .. })),
        "safe to free at once: {rx:?}"
    );
    assert_eq!(r.rx.open_leases(), 0);
    assert!(!r.rx.is_reset(), "the connection broke by itself");
    assert!(r.tx.send_chunk(&ChunkWrite { blocks: &[0], layer: 2, tokens: 0..4, tag: b, chunk: 0 }, &k, &v).is_err());
}

#[test]
fn cancel_waits_for_the_senders_drain_and_spares_the_other_leases() {
    let mut r = rig(4, 64);
    let dl = r.t0 + Duration::from_secs(5);
    let a = r.rx.open_lease(3, dl).unwrap();
    let b = r.rx.open_lease(3, dl).unwrap();
    r.tx.open(a, dl).unwrap();
    r.tx.open(b, dl).unwrap();
    let mut ev = (Vec::new(), Vec::new());
    r.net.hold(true);
    send_all(&mut r, a, &[7], &[0..2], &mut ev);
    assert_eq!(r.rx.cancel(a, r.t0).unwrap(), vec![], "writes may still land: quarantined");
    assert_eq!(r.tx.cancel(a).map(|e| e.tag), Some(a), "the abort reached the sender");
    assert!(!r.tx.is_drained(a));
    r.net.release();
    ev.0.extend(r.tx.poll(r.t0).unwrap());
    assert!(r.tx.is_drained(a));
    let freed = r.rx.drained(a).unwrap().unwrap();
    assert_eq!(
        freed,
        LeaseEvent { tag: a, outcome: Outcome::Failed { reason: FailReason::Cancelled, must_reset_qp: false } }
    );
    // Lease b is untouched and completes.
    send_all(&mut r, b, &[8, 9], &[0..8], &mut ev);
    r.tx.finish(b).unwrap();
    ev.1.extend(r.rx.set_chunks(b, 1, r.t0).unwrap());
    ev.0.extend(r.tx.poll(r.t0).unwrap());
    ev.1.extend(r.rx.poll(r.t0).unwrap());
    assert_eq!(ev.0, vec![LeaseEvent { tag: b, outcome: Outcome::Done }]);
    assert_eq!(ev.1, vec![LeaseEvent { tag: b, outcome: Outcome::Done }]);
    assert!(!r.rx.is_reset());
}

#[test]
fn a_timed_out_lease_with_writes_in_flight_is_freed_only_after_a_reset_and_late_writes_never_land() {
    let mut r = rig(4, 64);
    let a = r.rx.open_lease(3, r.t0 + Duration::from_millis(100)).unwrap();
    let b = r.rx.open_lease(3, r.t0 + Duration::from_secs(60)).unwrap();
    r.tx.open(a, r.t0 + Duration::from_secs(60)).unwrap();
    let mut ev = (Vec::new(), Vec::new());
    r.net.hold(true);
    send_all(&mut r, a, &[2, 3], &[0..8], &mut ev);
    let t1 = r.t0 + Duration::from_millis(100);
    assert_eq!(r.rx.poll(t1).unwrap(), vec![], "timed out but quarantined");
    let before = r.net.region();
    // No drain message within the quarantine: the link resets the queue pair.
    let t2 = t1 + Duration::from_secs(1);
    let out = r.rx.poll(t2).unwrap();
    assert_eq!(out.len(), 2, "{out:?}");
    assert!(
        matches!(&out[0], LeaseEvent { tag, outcome: Outcome::Failed { reason: FailReason::TimedOut { .. }, must_reset_qp: false } } if *tag == a)
    );
    assert!(
        matches!(&out[1], LeaseEvent { tag, outcome: Outcome::Failed { reason: FailReason::QueuePairBroken { .. }, must_reset_qp: false } } if *tag == b)
    );
    assert!(r.rx.is_reset());
    assert!(r.rx.open_lease(3, t2).is_err(), "a reset link takes no new lease");
    r.net.release();
    assert_eq!(r.net.region(), before, "no write landed after the reset");
    assert_eq!(r.net.landed_writes(), 0);
    let tx = r.tx.poll(t2).unwrap();
    assert!(
        matches!(
            &tx[..],
            [LeaseEvent {
                outcome: Outcome::Failed { reason: FailReason::QueuePairBroken { status: WcStatus::Flushed }, .. },
                ..
            }]
        ),
        "{tx:?}"
    );
    assert_eq!(r.tx.free_slots(), 4, "flushes free the staging slots");
}

#[test]
fn too_few_posted_receives_surface_as_rnr_errors() {
    let mut r = rig(4, 1);
    let dl = r.t0 + Duration::from_secs(5);
    let a = r.rx.open_lease(3, dl).unwrap();
    r.tx.open(a, dl).unwrap();
    let (k, v) = kv_bytes(&r.layout, a, 0, 0..4);
    for layer in 0..2 {
        r.tx.send_chunk(&ChunkWrite { blocks: &[0], layer, tokens: 0..4, tag: a, chunk: 0 }, &k, &v).unwrap();
    }
    let tx = r.tx.poll(r.t0).unwrap();
    assert!(
        matches!(
            &tx[..],
            [LeaseEvent {
                outcome: Outcome::Failed {
                    reason: FailReason::Completion { status: WcStatus::RnrRetryExceeded, .. },
                    ..
                },
                ..
            }]
        ),
        "{tx:?}"
    );
    // The responder saw one group and no error: it learns from the sender's abort on the
    // control stream, and frees the blocks at once because the sender has nothing in flight.
    assert_eq!(r.rx.poll(r.t0).unwrap(), vec![]);
    assert!(r.tx.is_drained(a));
    assert_eq!(r.rx.cancel(a, r.t0).unwrap(), vec![]);
    let freed = r.rx.drained(a).unwrap();
    assert!(matches!(
        freed,
        Some(LeaseEvent { outcome: Outcome::Failed { reason: FailReason::Cancelled, must_reset_qp: false }, .. })
    ));
    assert_eq!(r.rx.open_leases(), 0);
}

#[test]
fn a_wrong_rkey_is_a_remote_access_error() {
    let kv = KvLayout {
        model_fingerprint: 0,
        dtype: KvDtype::F16,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 4,
    };
    let layout = PoolLayout::dense(&kv, 4).unwrap();
    let len = layout.extent().unwrap();
    let net = SimNet::new(ADDR, len as usize, RKEY);
    let remote = QpMetadata {
        qp_num: 1,
        lid: 1,
        gid: [0; 16],
        psn: 0,
        mtu: PathMtu::Mtu1024,
        max_write_bytes: 64,
        region: Some(RemoteRegion { addr: ADDR, len, rkey: RKEY + 1, layout }),
    };
    let cfg = SendLinkConfig { slots: 1, slot_bytes: 256, sq_depth: 8, policy: SignalPolicy::default() };
    let mut tx = SendLink::new(net.sender(256), &remote, cfg).unwrap();
    let mut rx =
        RecvLink::new(net.receiver(), RecvLinkConfig { recv_depth: 4, quarantine: Duration::from_secs(1) }).unwrap();
    let t0 = Instant::now();
    let tag = rx.open_lease(1, t0 + Duration::from_secs(1)).unwrap();
    tx.open(tag, t0 + Duration::from_secs(1)).unwrap();
    tx.send_chunk(&ChunkWrite { blocks: &[1], layer: 0, tokens: 0..4, tag, chunk: 0 }, &[1; 32], &[2; 32]).unwrap();
    let ev = tx.poll(t0).unwrap();
    assert!(
        matches!(
            &ev[..],
            [LeaseEvent {
                outcome: Outcome::Failed { reason: FailReason::Completion { status: WcStatus::RemoteAccess, .. }, .. },
                ..
            }]
        ),
        "{ev:?}"
    );
    assert_eq!(net.region(), vec![0; len as usize]);
    assert_eq!(rx.poll(t0).unwrap().len(), 1);
}

#[test]
fn links_refuse_bad_setups() {
    let net = SimNet::new(ADDR, 1024, RKEY);
    let no_region = QpMetadata {
        qp_num: 1,
        lid: 0,
        gid: [0; 16],
        psn: 0,
        mtu: PathMtu::Mtu1024,
        max_write_bytes: 64,
        region: None,
    };
    let cfg = SendLinkConfig { slots: 2, slot_bytes: 512, sq_depth: 8, policy: SignalPolicy::default() };
    assert!(SendLink::new(net.sender(1024), &no_region, cfg).is_err());
    let kv = KvLayout {
        model_fingerprint: 0,
        dtype: KvDtype::F16,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 4,
    };
    let layout = PoolLayout::dense(&kv, 4).unwrap();
    let with = QpMetadata { region: Some(RemoteRegion { addr: ADDR, len: 1024, rkey: RKEY, layout }), ..no_region };
    assert!(SendLink::new(net.sender(1023), &with, cfg).is_err(), "staging too small for the slots");
    assert!(SendLink::new(net.sender(1024), &with, SendLinkConfig { slots: 0, ..cfg }).is_err());
    SendLink::new(net.sender(1024), &with, cfg).unwrap();
}

#[test]
fn a_quarantined_lease_is_released_at_once_when_the_connection_fails_by_itself() {
    let mut r = rig(4, 64);
    let dl = r.t0 + Duration::from_secs(5);
    let a = r.rx.open_lease(3, dl).unwrap();
    let b = r.rx.open_lease(3, dl).unwrap();
    r.tx.open(b, dl).unwrap();
    assert_eq!(r.rx.cancel(a, r.t0).unwrap(), vec![], "quarantined");
    r.net.fail_write(0, WcStatus::RetryExceeded);
    let (k, v) = kv_bytes(&r.layout, b, 0, 0..4);
    r.tx.send_chunk(&ChunkWrite { blocks: &[1], layer: 0, tokens: 0..4, tag: b, chunk: 0 }, &k, &v).unwrap();
    let mut out = r.rx.poll(r.t0).unwrap();
    out.sort_by_key(|e| e.tag);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(
        out[0],
        LeaseEvent { tag: a, outcome: Outcome::Failed { reason: FailReason::Cancelled, must_reset_qp: false } }
    );
    assert!(matches!(
        out[1].outcome,
        Outcome::Failed { reason: FailReason::QueuePairBroken { .. }, must_reset_qp: false }
    ));
    assert!(!r.rx.is_reset(), "no reset needed");
    assert_eq!(r.rx.open_leases(), 0);
}
