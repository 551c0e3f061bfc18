//! The sans-IO receiver, edge by edge of the ownership state machine (crate docs): every test
//! drives it with explicit instants and checks the effects and that no block stays leased.

mod common;

use std::time::{Duration, Instant};

use cleave_kv_transfer::frame::{AbortCode, Control, Frame, Open};
use cleave_kv_transfer::receiver::{DropReason, Effect, LeaseSpec, Receiver};
use cleave_kv_transfer::KvTransferError;
use cleave_protocol::{KvDtype, LeaseId, RequestId};
use common::{chunk_frame, layout};

const TTL: Duration = Duration::from_secs(5);

fn setup(num_tokens: u32) -> (Receiver, Instant, LeaseId) {
    let mut r = Receiver::new(layout(), 100);
    let now = Instant::now();
    let blocks = (0..num_tokens.div_ceil(4)).map(|b| 10 + b).collect();
    let lease = r.open_lease(now, LeaseSpec { request_id: RequestId(7), blocks, num_tokens, ttl: TTL }).unwrap();
    (r, now, lease)
}

fn open(lease: LeaseId, num_tokens: u32) -> Frame {
    Frame::Control(Control::Open(Open {
        request_id: RequestId(7),
        lease_id: lease,
        layout: layout(),
        num_tokens,
        stream_index: 0,
        stream_count: 1,
        rdma_link: None,
    }))
}

fn writes(fx: &[Effect]) -> usize {
    fx.iter().filter(|e| matches!(e, Effect::Write(_))).count()
}

fn released(fx: &[Effect]) -> Option<&KvTransferError> {
    fx.iter().find_map(|e| match e {
        Effect::Released { error, .. } => Some(error),
        _ => None,
    })
}

fn aborts(fx: &[Effect]) -> Vec<AbortCode> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Send { msg: Control::Abort { code, .. }, .. } => Some(*code),
            _ => None,
        })
        .collect()
}

/// Opens stream 1 bound to the lease.
fn bind(r: &mut Receiver, now: Instant, lease: LeaseId, num_tokens: u32) {
    r.stream_opened(1);
    let fx = r.on_frame(now, 1, open(lease, num_tokens));
    assert!(matches!(&fx[..], [Effect::Send { stream: 1, msg: Control::Accept { .. } }]), "{fx:?}");
}

#[test]
fn full_transfer_completes_and_hands_blocks_over() {
    let (mut r, now, lease) = setup(6);
    assert_eq!(r.reserved_blocks(), 2);
    bind(&mut r, now, lease, 6);
    for layer in 0..3 {
        let fx = r.on_frame(now, 1, chunk_frame(&layout(), lease, layer, 0, 4));
        assert_eq!(writes(&fx), 1);
    }
    // Complete arrives before the last chunks: nothing completes yet.
    let fx = r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 99 }));
    assert!(fx.is_empty(), "{fx:?}");
    let mut last = Vec::new();
    for layer in 0..3 {
        last = r.on_frame(now, 1, chunk_frame(&layout(), lease, layer, 4, 2));
    }
    assert!(last.iter().any(|e| matches!(e, Effect::Send { msg: Control::Ack { .. }, .. })));
    let done = last.iter().find_map(|e| match e {
        Effect::Completed { blocks, first_token, .. } => Some((blocks.clone(), *first_token)),
        _ => None,
    });
    assert_eq!(done, Some((vec![10, 11], 99)));
    assert_eq!(r.reserved_blocks(), 0);
    assert_eq!(r.stats().completed, 1);
    // The stream is idle now; closing it frees nothing.
    let fx = r.on_stream_closed(now, 1);
    assert!(released(&fx).is_none());
}

#[test]
fn duplicate_chunk_is_dropped_and_reported() {
    let (mut r, now, lease) = setup(8);
    bind(&mut r, now, lease, 8);
    assert_eq!(writes(&r.on_frame(now, 1, chunk_frame(&layout(), lease, 0, 0, 4))), 1);
    let fx = r.on_frame(now, 1, chunk_frame(&layout(), lease, 0, 0, 4));
    assert!(matches!(&fx[..], [Effect::Dropped { why: DropReason::Duplicate, .. }]), "{fx:?}");
    assert_eq!(r.stats().duplicates_dropped, 1);
    assert_eq!(r.reserved_blocks(), 2, "a duplicate does not end the lease");
}

#[test]
fn gap_releases_the_lease() {
    let (mut r, now, lease) = setup(8);
    bind(&mut r, now, lease, 8);
    let fx = r.on_frame(now, 1, chunk_frame(&layout(), lease, 1, 4, 4));
    assert!(matches!(released(&fx), Some(KvTransferError::ChunkGap { expected: 0, got: 4, .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Gap]);
    assert!(fx.iter().any(|e| matches!(e, Effect::Close { stream: 1 })));
    assert_eq!(writes(&fx), 0);
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn corrupt_chunk_releases_the_lease() {
    let (mut r, now, lease) = setup(4);
    bind(&mut r, now, lease, 4);
    let Frame::Chunk { header, k, v } = chunk_frame(&layout(), lease, 0, 0, 4) else { unreachable!() };
    let mut bad = k.to_vec();
    bad[3] ^= 0x40;
    let fx = r.on_frame(now, 1, Frame::Chunk { header, k: bad.into(), v });
    assert!(matches!(released(&fx), Some(KvTransferError::ChecksumMismatch { layer: 0, .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Checksum]);
    assert_eq!(writes(&fx), 0);
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn chunk_past_the_lease_is_out_of_bounds() {
    let (mut r, now, lease) = setup(4);
    bind(&mut r, now, lease, 4);
    let fx = r.on_frame(now, 1, chunk_frame(&layout(), lease, 0, 0, 5));
    assert!(matches!(released(&fx), Some(KvTransferError::ChunkOutOfBounds { .. })), "{fx:?}");
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn lease_expires_and_late_chunks_are_dropped() {
    let (mut r, now, lease) = setup(4);
    bind(&mut r, now, lease, 4);
    assert_eq!(r.next_deadline(), Some(now + TTL));
    assert!(r.poll_expired(now + TTL - Duration::from_millis(1)).is_empty());
    let fx = r.poll_expired(now + TTL);
    assert!(matches!(released(&fx), Some(KvTransferError::LeaseExpired { .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::LeaseExpired]);
    assert_eq!(r.reserved_blocks(), 0);
    assert_eq!(r.next_deadline(), None);
    // A chunk that was already queued on the closed stream: late, dropped, nothing freed twice.
    let fx = r.on_frame(now + TTL, 1, chunk_frame(&layout(), lease, 0, 0, 4));
    assert!(matches!(&fx[..], [Effect::Dropped { why: DropReason::Late, .. }]), "{fx:?}");
    assert_eq!(r.stats().released, 1);
}

#[test]
fn open_after_expiry_is_refused_even_before_the_timer() {
    let (mut r, now, lease) = setup(4);
    r.stream_opened(1);
    let fx = r.on_frame(now + TTL, 1, open(lease, 4));
    assert_eq!(aborts(&fx), vec![AbortCode::LeaseExpired]);
    assert!(matches!(released(&fx), Some(KvTransferError::LeaseExpired { .. })));
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn sender_death_releases_the_lease() {
    let (mut r, now, lease) = setup(8);
    bind(&mut r, now, lease, 8);
    r.on_frame(now, 1, chunk_frame(&layout(), lease, 0, 0, 4));
    let fx = r.on_stream_closed(now, 1);
    assert!(matches!(released(&fx), Some(KvTransferError::SenderGone { .. })), "{fx:?}");
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn truncated_frame_on_a_bound_stream_releases_the_lease() {
    let (mut r, now, lease) = setup(8);
    bind(&mut r, now, lease, 8);
    let fx = r.on_stream_error(now, 1, KvTransferError::Truncated { expected: 100, got: 50 });
    assert!(matches!(released(&fx), Some(KvTransferError::Truncated { .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Malformed]);
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn cancel_releases_and_tells_the_sender() {
    let (mut r, now, lease) = setup(8);
    bind(&mut r, now, lease, 8);
    let fx = r.cancel(lease);
    assert!(matches!(released(&fx), Some(KvTransferError::Cancelled { .. })));
    assert_eq!(aborts(&fx), vec![AbortCode::Cancelled]);
    assert_eq!(r.reserved_blocks(), 0);
    assert!(r.cancel(lease).is_empty(), "a second cancel frees nothing");
}

#[test]
fn cancel_before_any_stream_releases() {
    let (mut r, _now, lease) = setup(8);
    let fx = r.cancel(lease);
    assert!(matches!(released(&fx), Some(KvTransferError::Cancelled { .. })));
    assert!(aborts(&fx).is_empty());
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn layout_mismatch_is_refused_before_any_byte() {
    let (mut r, now, lease) = setup(4);
    r.stream_opened(1);
    let mut l = layout();
    l.dtype = KvDtype::Bf16;
    let frame = Frame::Control(Control::Open(Open {
        request_id: RequestId(7),
        lease_id: lease,
        layout: l,
        num_tokens: 4,
        stream_index: 0,
        stream_count: 1,
        rdma_link: None,
    }));
    let fx = r.on_frame(now, 1, frame);
    assert_eq!(aborts(&fx), vec![AbortCode::LayoutMismatch]);
    assert!(matches!(released(&fx), Some(KvTransferError::LayoutMismatch { field: "dtype", .. })), "{fx:?}");
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn unknown_lease_is_refused_without_touching_others() {
    let (mut r, now, _lease) = setup(4);
    r.stream_opened(1);
    let fx = r.on_frame(now, 1, open(LeaseId(1), 4));
    assert_eq!(aborts(&fx), vec![AbortCode::UnknownLease]);
    assert!(released(&fx).is_none());
    assert_eq!(r.reserved_blocks(), 1);
}

#[test]
fn chunk_before_open_is_a_protocol_error_on_that_stream_only() {
    let (mut r, now, lease) = setup(4);
    r.stream_opened(1);
    let fx = r.on_frame(now, 1, chunk_frame(&layout(), lease, 0, 0, 4));
    assert_eq!(aborts(&fx), vec![AbortCode::Malformed]);
    assert_eq!(writes(&fx), 0);
    assert_eq!(r.reserved_blocks(), 1, "a stray stream cannot free someone else's lease");
}

#[test]
fn failed_block_write_releases() {
    let (mut r, now, lease) = setup(4);
    bind(&mut r, now, lease, 4);
    let fx = r.fail(lease, KvTransferError::SinkWrite { lease, reason: "test".into() });
    assert_eq!(aborts(&fx), vec![AbortCode::Internal]);
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn two_streams_one_lease_layers_in_parallel() {
    let (mut r, now, lease) = setup(4);
    r.stream_opened(1);
    r.stream_opened(2);
    assert_eq!(r.on_frame(now, 1, open(lease, 4)).len(), 1);
    assert_eq!(r.on_frame(now, 2, open(lease, 4)).len(), 1);
    r.on_frame(now, 2, chunk_frame(&layout(), lease, 1, 0, 4));
    r.on_frame(now, 1, chunk_frame(&layout(), lease, 0, 0, 4));
    r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 5 }));
    let fx = r.on_frame(now, 1, chunk_frame(&layout(), lease, 2, 0, 4));
    assert!(fx.iter().any(|e| matches!(e, Effect::Completed { first_token: 5, .. })), "{fx:?}");
    // One stream dying after completion frees nothing.
    assert!(released(&r.on_stream_closed(now, 2)).is_none());
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn a_dying_stream_aborts_its_siblings() {
    let (mut r, now, lease) = setup(4);
    r.stream_opened(1);
    r.stream_opened(2);
    r.on_frame(now, 1, open(lease, 4));
    r.on_frame(now, 2, open(lease, 4));
    let fx = r.on_stream_closed(now, 2);
    assert!(matches!(released(&fx), Some(KvTransferError::SenderGone { .. })));
    assert!(fx.iter().any(|e| matches!(e, Effect::Close { stream: 1 })));
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn lease_spec_must_fit_its_tokens() {
    let mut r = Receiver::new(layout(), 1);
    let now = Instant::now();
    let err = r
        .open_lease(now, LeaseSpec { request_id: RequestId(1), blocks: vec![1], num_tokens: 5, ttl: TTL })
        .unwrap_err();
    assert!(matches!(err, KvTransferError::InvalidRequest { .. }), "{err}");
    assert_eq!(r.reserved_blocks(), 0);
}
