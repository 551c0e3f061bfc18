//! Every edge of the RDMA completion state machines (sender and receiver), without a device.
#![cfg(feature = "rdma")]

use std::time::{Duration, Instant};

use cleave_kv_transfer::rdma::*;
use proptest::prelude::*;

fn w(signaled: bool) -> RdmaWrite {
    RdmaWrite { remote_addr: 0, len: 8, src_offset: 0, imm: None, signaled }
}

fn ok(wr_id: u64) -> SendCompletion {
    SendCompletion { wr_id, status: WcStatus::Success, vendor_err: 0 }
}

fn done(tag: u16) -> LeaseEvent {
    LeaseEvent { tag, outcome: Outcome::Done }
}

fn failed(tag: u16, reason: FailReason, must_reset_qp: bool) -> LeaseEvent {
    LeaseEvent { tag, outcome: Outcome::Failed { reason, must_reset_qp } }
}

// ---------------------------------------------------------------- sender

#[test]
fn send_completions_in_any_order_then_done_once() {
    let t0 = Instant::now();
    let mut s = SendTracker::new(16);
    s.open(1, t0 + Duration::from_secs(5)).unwrap();
    let a = s.post(1, &[w(false), w(false), w(true)]).unwrap();
    let b = s.post(1, &[w(true)]).unwrap();
    assert_eq!(s.slots_used(), 4);
    assert_eq!(s.finish(1).unwrap(), None, "writes still outstanding");
    assert_eq!(s.on_completion(ok(b[0])).unwrap(), vec![], "later group first");
    assert_eq!(s.slots_used(), 3);
    assert_eq!(s.on_completion(ok(a[2])).unwrap(), vec![done(1)]);
    assert_eq!(s.slots_used(), 0, "the signaled completion freed its unsignaled predecessors");
    assert_eq!(s.open_leases(), 0);
    // Unsignaled wr_ids never complete on their own: a completion for one is unknown.
    assert!(s.on_completion(ok(a[0])).is_err());
}

#[test]
fn finish_with_nothing_outstanding_is_done_at_once() {
    let mut s = SendTracker::new(4);
    s.open(3, Instant::now()).unwrap();
    assert_eq!(s.finish(3).unwrap(), Some(done(3)));
    assert!(s.finish(3).is_err(), "the lease is gone");
    s.open(3, Instant::now()).unwrap();
}

#[test]
fn full_send_queue_refuses_without_side_effects() {
    let mut s = SendTracker::new(4);
    s.open(1, Instant::now()).unwrap();
    let a = s.post(1, &[w(false), w(true)]).unwrap();
    let e = s.post(1, &[w(false), w(false), w(true)]).unwrap_err();
    assert!(e.to_string().contains("send queue full: need 3 slots, 2 free of 4"), "{e}");
    assert_eq!(s.slots_used(), 2);
    s.on_completion(ok(a[1])).unwrap();
    let b = s.post(1, &[w(false), w(false), w(true)]).unwrap();
    assert_eq!(b[0], a[1] + 1, "wr_ids stay unique");
}

#[test]
fn batches_must_end_signaled_and_target_an_open_lease() {
    let mut s = SendTracker::new(8);
    assert!(s.post(9, &[w(true)]).is_err());
    s.open(1, Instant::now()).unwrap();
    assert!(s.open(1, Instant::now()).is_err(), "tag already open");
    assert!(s.post(1, &[w(true), w(false)]).is_err());
    assert_eq!(s.slots_used(), 0);
    assert_eq!(s.post(1, &[]).unwrap(), Vec::<u64>::new());
    assert_eq!(s.finish(1).unwrap(), Some(done(1)));
}

#[test]
fn unknown_and_duplicate_completions_are_errors_that_change_nothing() {
    let mut s = SendTracker::new(8);
    s.open(1, Instant::now()).unwrap();
    let a = s.post(1, &[w(true), w(true)]).unwrap();
    s.finish(1).unwrap();
    assert!(s.on_completion(ok(999)).is_err());
    assert_eq!(s.on_completion(ok(a[0])).unwrap(), vec![]);
    assert!(s.on_completion(ok(a[0])).is_err(), "duplicate");
    assert_eq!(s.slots_used(), 1);
    assert_eq!(s.on_completion(ok(a[1])).unwrap(), vec![done(1)]);
}

#[test]
fn retry_exceeded_fails_its_lease_and_breaks_the_others_then_flushes_drain() {
    let mut s = SendTracker::new(16);
    let dl = Instant::now() + Duration::from_secs(1);
    for t in [1, 2, 3] {
        s.open(t, dl).unwrap();
    }
    let a = s.post(1, &[w(true)]).unwrap();
    let b = s.post(2, &[w(false), w(true)]).unwrap();
    let ev =
        s.on_completion(SendCompletion { wr_id: a[0], status: WcStatus::RetryExceeded, vendor_err: 0x81 }).unwrap();
    assert_eq!(
        ev,
        vec![
            failed(1, FailReason::Completion { wr_id: a[0], status: WcStatus::RetryExceeded, vendor_err: 0x81 }, false),
            failed(2, FailReason::QueuePairBroken { status: WcStatus::RetryExceeded }, false),
            failed(3, FailReason::QueuePairBroken { status: WcStatus::RetryExceeded }, false),
        ]
    );
    assert_eq!(s.broken(), Some(WcStatus::RetryExceeded));
    assert_eq!(s.open_leases(), 1, "lease 2 still has a write in flight");
    assert!(s.post(2, &[w(true)]).is_err());
    assert!(s.open(4, dl).is_err(), "a broken queue pair takes no new lease");
    // In the error state every outstanding request completes as flushed, signaled or not.
    let flush = |wr_id| SendCompletion { wr_id, status: WcStatus::Flushed, vendor_err: 0 };
    assert_eq!(s.on_completion(flush(b[0])).unwrap(), vec![]);
    assert_eq!(s.open_leases(), 1, "lease 2's signaled write is still due");
    assert_eq!(s.on_completion(flush(b[1])).unwrap(), vec![], "already reported");
    assert_eq!((s.open_leases(), s.slots_used()), (0, 0));
    assert_eq!(s.on_completion(flush(b[1])).unwrap(), vec![], "stray flushes on a broken queue pair are absorbed");
    assert!(s.on_completion(ok(12345)).is_err());
    assert!(s.on_timeout(dl + Duration::from_secs(9)).is_empty());
}

#[test]
fn first_error_being_a_flush_reports_a_broken_queue_pair() {
    let mut s = SendTracker::new(4);
    s.open(1, Instant::now()).unwrap();
    let a = s.post(1, &[w(true)]).unwrap();
    let ev = s.on_completion(SendCompletion { wr_id: a[0], status: WcStatus::Flushed, vendor_err: 0 }).unwrap();
    assert_eq!(ev, vec![failed(1, FailReason::QueuePairBroken { status: WcStatus::Flushed }, false)]);
}

#[test]
fn error_on_an_unsignaled_write_fails_its_lease_and_the_run_drains_by_flushes() {
    let mut s = SendTracker::new(8);
    s.open(1, Instant::now()).unwrap();
    let a = s.post(1, &[w(false), w(false), w(true)]).unwrap();
    s.finish(1).unwrap();
    // a[0] succeeded silently; a[1] failed; a[2] is flushed.
    let ev = s.on_completion(SendCompletion { wr_id: a[1], status: WcStatus::RetryExceeded, vendor_err: 0 }).unwrap();
    assert_eq!(
        ev,
        vec![failed(1, FailReason::Completion { wr_id: a[1], status: WcStatus::RetryExceeded, vendor_err: 0 }, false)]
    );
    assert_eq!(s.open_leases(), 1);
    assert_eq!(
        s.on_completion(SendCompletion { wr_id: a[2], status: WcStatus::Flushed, vendor_err: 0 }).unwrap(),
        vec![]
    );
    assert_eq!(s.open_leases(), 0);
}

#[test]
fn error_after_finish_is_a_failure_not_done() {
    let mut s = SendTracker::new(4);
    s.open(1, Instant::now()).unwrap();
    let a = s.post(1, &[w(true)]).unwrap();
    s.finish(1).unwrap();
    let c = SendCompletion { wr_id: a[0], status: WcStatus::RemoteAccess, vendor_err: 0 };
    let ev = s.on_completion(c).unwrap();
    assert_eq!(ev.len(), 1);
    assert!(matches!(
        ev[0].outcome,
        Outcome::Failed { reason: FailReason::Completion { status: WcStatus::RemoteAccess, .. }, .. }
    ));
}

#[test]
fn deadline_fails_the_lease_and_late_completions_are_absorbed() {
    let t0 = Instant::now();
    let mut s = SendTracker::new(8);
    s.open(1, t0 + Duration::from_millis(100)).unwrap();
    s.open(2, t0 + Duration::from_millis(300)).unwrap();
    assert_eq!(s.next_deadline(), Some(t0 + Duration::from_millis(100)));
    let a = s.post(1, &[w(true), w(true)]).unwrap();
    assert!(s.on_timeout(t0 + Duration::from_millis(99)).is_empty());
    assert_eq!(
        s.on_timeout(t0 + Duration::from_millis(100)),
        vec![failed(1, FailReason::TimedOut { missing: 2 }, false)]
    );
    assert!(s.on_timeout(t0 + Duration::from_millis(150)).is_empty(), "reported once");
    assert_eq!(s.next_deadline(), Some(t0 + Duration::from_millis(300)));
    assert!(s.open(1, t0).is_err(), "tag not reusable while its writes are in flight");
    assert_eq!(s.on_completion(ok(a[0])).unwrap(), vec![]);
    assert_eq!(s.on_completion(ok(a[1])).unwrap(), vec![]);
    s.open(1, t0 + Duration::from_secs(1)).unwrap();
    assert_eq!(s.slots_used(), 0);
}

#[test]
fn cancel_reports_once_and_refuses_further_posts() {
    let mut s = SendTracker::new(8);
    s.open(1, Instant::now()).unwrap();
    assert_eq!(s.cancel(1), Some(failed(1, FailReason::Cancelled, false)));
    assert_eq!(s.cancel(1), None);
    assert_eq!(s.open_leases(), 0);
    assert!(s.post(1, &[w(true)]).is_err());
}

// ---------------------------------------------------------------- receiver

fn imm(tag: u16, layer: u32, chunk: u32) -> RecvCompletion {
    RecvCompletion { status: WcStatus::Success, imm: Some(Imm::new(tag, layer, chunk).unwrap().encode()) }
}

#[test]
fn receiver_completes_when_every_group_and_the_count_are_in_either_order() {
    let dl = Instant::now() + Duration::from_secs(1);
    let mut r = RecvTracker::new();
    r.open(7, 2, dl).unwrap();
    r.open(8, 2, dl).unwrap();
    // Lease 7: count first.
    assert_eq!(r.set_chunks(7, 2).unwrap(), None);
    for (l, c) in [(1, 1), (0, 0), (0, 1)] {
        assert_eq!(r.on_recv(imm(7, l, c)).unwrap(), vec![]);
    }
    assert_eq!(r.on_recv(imm(7, 1, 0)).unwrap(), vec![done(7)]);
    // Lease 8: count last.
    for (l, c) in [(1, 0), (0, 0)] {
        assert_eq!(r.on_recv(imm(8, l, c)).unwrap(), vec![]);
    }
    assert_eq!(r.set_chunks(8, 1).unwrap(), Some(done(8)));
    assert_eq!(r.open_leases(), 0);
}

#[test]
fn layers_with_different_chunk_counts_complete_on_their_own_counts() {
    let dl = Instant::now() + Duration::from_secs(1);
    let mut r = RecvTracker::new();
    r.open(3, 2, dl).unwrap();
    for (l, c) in [(0, 0), (1, 0)] {
        assert_eq!(r.on_recv(imm(3, l, c)).unwrap(), vec![]);
    }
    assert_eq!(r.set_layer_chunks(3, &[1, 2]).unwrap(), None, "layer 1's second chunk is missing");
    assert_eq!(r.on_recv(imm(3, 1, 1)).unwrap(), vec![done(3)]);
    // A chunk beyond its own layer's count, or counts of the wrong length, fail the lease.
    r.open(4, 2, dl).unwrap();
    r.set_layer_chunks(4, &[1, 2]).unwrap();
    let e = r.on_recv(imm(4, 0, 1)).unwrap();
    assert!(matches!(&e[..], [LeaseEvent { tag: 4, outcome: Outcome::Failed { must_reset_qp: true, .. } }]), "{e:?}");
    r.open(5, 2, dl).unwrap();
    let e = r.set_layer_chunks(5, &[1]).unwrap();
    assert!(matches!(e, Some(LeaseEvent { tag: 5, outcome: Outcome::Failed { .. } })), "{e:?}");
    r.open(6, 2, dl).unwrap();
    r.on_recv(imm(6, 0, 1)).unwrap();
    let e = r.set_layer_chunks(6, &[1, 2]).unwrap();
    assert!(matches!(e, Some(LeaseEvent { tag: 6, outcome: Outcome::Failed { .. } })), "{e:?}");
}

#[test]
fn duplicate_and_out_of_range_immediates_fail_the_lease_and_ask_for_a_reset() {
    let dl = Instant::now() + Duration::from_secs(1);
    let mut r = RecvTracker::new();
    r.open(1, 2, dl).unwrap();
    r.on_recv(imm(1, 0, 0)).unwrap();
    let ev = r.on_recv(imm(1, 0, 0)).unwrap();
    assert!(
        matches!(
            &ev[..],
            [LeaseEvent {
                tag: 1,
                outcome: Outcome::Failed { reason: FailReason::Protocol { .. }, must_reset_qp: true }
            }]
        ),
        "{ev:?}"
    );
    assert_eq!(r.on_recv(imm(1, 1, 0)).unwrap(), vec![], "late immediates of a failed lease are absorbed");

    r.open(2, 2, dl).unwrap();
    let ev = r.on_recv(imm(2, 2, 0)).unwrap();
    assert!(matches!(ev[0].outcome, Outcome::Failed { reason: FailReason::Protocol { .. }, .. }), "layer 2 of 2");

    r.open(3, 2, dl).unwrap();
    r.set_chunks(3, 1).unwrap();
    assert!(matches!(r.on_recv(imm(3, 0, 1)).unwrap()[0].outcome, Outcome::Failed { .. }), "chunk beyond count");

    r.open(4, 2, dl).unwrap();
    r.on_recv(imm(4, 0, 3)).unwrap();
    assert!(matches!(r.set_chunks(4, 3).unwrap().unwrap().outcome, Outcome::Failed { .. }), "count below a seen chunk");

    r.open(5, 2, dl).unwrap();
    r.set_chunks(5, 3).unwrap();
    assert!(matches!(r.set_chunks(5, 3).unwrap().unwrap().outcome, Outcome::Failed { .. }), "count twice");
    r.open(6, 2, dl).unwrap();
    assert!(matches!(r.set_chunks(6, 0).unwrap().unwrap().outcome, Outcome::Failed { .. }), "zero chunks");
}

#[test]
fn stray_immediates_and_bad_completions_are_errors_without_effect() {
    let mut r = RecvTracker::new();
    r.open(1, 1, Instant::now() + Duration::from_secs(1)).unwrap();
    assert!(r.on_recv(imm(2, 0, 0)).is_err(), "unknown tag");
    assert!(r.on_recv(RecvCompletion { status: WcStatus::Success, imm: None }).is_err());
    assert!(r.set_chunks(2, 1).is_err());
    assert!(r.open(1, 1, Instant::now()).is_err(), "tag in use");
    assert!(r.open(4096, 1, Instant::now()).is_err());
    assert!(r.open(9, 0, Instant::now()).is_err());
    assert!(r.open(9, 257, Instant::now()).is_err());
    assert_eq!(r.on_recv(imm(1, 0, 0)).unwrap(), vec![]);
    assert_eq!(r.set_chunks(1, 1).unwrap(), Some(done(1)));
}

#[test]
fn receive_error_fails_everything_without_reset_until_the_qp_is_replaced() {
    let dl = Instant::now() + Duration::from_secs(1);
    let mut r = RecvTracker::new();
    r.open(1, 1, dl).unwrap();
    r.open(2, 1, dl).unwrap();
    let ev = r.on_recv(RecvCompletion { status: WcStatus::Flushed, imm: None }).unwrap();
    let broken = FailReason::QueuePairBroken { status: WcStatus::Flushed };
    assert_eq!(ev, vec![failed(1, broken.clone(), false), failed(2, broken, false)]);
    assert_eq!(r.on_recv(RecvCompletion { status: WcStatus::Flushed, imm: None }).unwrap(), vec![]);
    assert!(r.open(3, 1, dl).is_err());
    assert_eq!(r.on_qp_reset(), vec![]);
    assert_eq!(r.open_leases(), 0);
    r.open(1, 1, dl).unwrap();
}

#[test]
fn timeout_and_cancel_ask_for_a_reset_and_hold_the_tag_until_release() {
    let t0 = Instant::now();
    let mut r = RecvTracker::new();
    r.open(1, 2, t0 + Duration::from_millis(10)).unwrap();
    r.open(2, 2, t0 + Duration::from_millis(20)).unwrap();
    r.set_chunks(1, 2).unwrap();
    r.on_recv(imm(1, 0, 0)).unwrap();
    assert_eq!(r.next_deadline(), Some(t0 + Duration::from_millis(10)));
    assert_eq!(
        r.on_timeout(t0 + Duration::from_millis(10)),
        vec![failed(1, FailReason::TimedOut { missing: 3 }, true)]
    );
    assert_eq!(r.cancel(2), Some(failed(2, FailReason::Cancelled, true)));
    assert_eq!(r.cancel(2), None);
    assert_eq!(r.next_deadline(), None);
    assert!(r.open(1, 1, t0).is_err(), "quarantined until released");
    r.release(1).unwrap();
    assert!(r.release(1).is_err());
    r.open(1, 1, t0).unwrap();
    assert!(r.release(1).is_err(), "active leases are cancelled, not released");
    // A reset fails what is active without asking for another reset, and frees every tag.
    assert_eq!(r.on_qp_reset(), vec![failed(1, FailReason::QueuePairBroken { status: WcStatus::Flushed }, false)]);
    assert_eq!(r.open_leases(), 0);
}

// ---------------------------------------------------------------- both, randomized

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]

    /// Several leases, groups of random sizes, completions and immediates delivered in a random
    /// order: every lease ends Done exactly once on both sides and the send queue drains.
    #[test]
    fn random_orders_end_done_once_on_both_sides(
        leases in proptest::collection::vec((1u32..4, 1u32..4, 1usize..4), 1..5),
        order in any::<u64>(),
    ) {
        let dl = Instant::now() + Duration::from_secs(60);
        let mut s = SendTracker::new(1 << 16);
        let mut r = RecvTracker::new();
        let mut send_c = Vec::new();
        let mut recv_c = Vec::new();
        for (tag, &(layers, chunks, writes)) in leases.iter().enumerate() {
            let tag = tag as u16;
            s.open(tag, dl).unwrap();
            r.open(tag, layers, dl).unwrap();
            for c in 0..chunks {
                for l in 0..layers {
                    let mut batch = vec![w(false); writes];
                    batch.last_mut().unwrap().signaled = true;
                    let ids = s.post(tag, &batch).unwrap();
                    send_c.push(ok(*ids.last().unwrap()));
                    recv_c.push(imm(tag, l, c));
                }
            }
            prop_assert_eq!(s.finish(tag).unwrap(), None);
        }
        // Deterministic shuffle from `order`.
        let mut x = order | 1;
        let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
        for v in [&mut send_c as &mut dyn ShuffleLen, &mut recv_c] { v.shuffle(&mut next); }
        let mut sent_done = Vec::new();
        for c in send_c { sent_done.extend(s.on_completion(c).unwrap()); }
        let mut recv_done = Vec::new();
        for c in recv_c { recv_done.extend(r.on_recv(c).unwrap()); }
        for (tag, &(_, chunks, _)) in leases.iter().enumerate() {
            recv_done.extend(r.set_chunks(tag as u16, chunks).unwrap());
        }
        sent_done.sort_by_key(|e| e.tag);
        recv_done.sort_by_key(|e| e.tag);
        let want: Vec<LeaseEvent> = (0..leases.len() as u16).map(done).collect();
        prop_assert_eq!(sent_done, want.clone());
        prop_assert_eq!(recv_done, want);
        prop_assert_eq!((s.slots_used(), s.open_leases(), r.open_leases()), (0, 0, 0));
    }
}

trait ShuffleLen {
    fn shuffle(&mut self, next: &mut dyn FnMut() -> u64);
}

impl<T> ShuffleLen for Vec<T> {
    fn shuffle(&mut self, next: &mut dyn FnMut() -> u64) {
        for i in (1..self.len()).rev() {
            let j = (next() % (i as u64 + 1)) as usize;
            self.swap(i, j);
        }
    }
}
