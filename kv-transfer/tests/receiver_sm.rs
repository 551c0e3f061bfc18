//! The sans-IO receiver, edge by edge of the ownership state machine (crate docs): every test
//! drives it with explicit instants and checks the effects and that no block stays leased.

mod common;

use std::time::{Duration, Instant};

use cleave_kv_transfer::frame::{AbortCode, Control, Frame, Landed, Open};
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

// --- RDMA leases: notices on the stream, payload in the pool ---

fn open_rdma(lease: LeaseId, num_tokens: u32, stream_count: u16) -> Frame {
    Frame::Control(Control::Open(Open {
        request_id: RequestId(7),
        lease_id: lease,
        layout: layout(),
        num_tokens,
        stream_index: 0,
        stream_count,
        rdma_link: Some(3),
    }))
}

fn notice(lease: LeaseId, layer: u32, token_start: u32, token_count: u32, chunk: u32) -> Frame {
    Frame::Control(Control::Landed(Landed {
        lease_id: lease,
        layer,
        token_start,
        token_count,
        chunk,
        crc32: 0x1000 * layer + token_start,
    }))
}

/// Binds stream 1 to an RDMA lease with tag 9.
fn bind_rdma(r: &mut Receiver, now: Instant, lease: LeaseId, num_tokens: u32) {
    r.stream_opened(1);
    let fx = r.on_frame(now, 1, open_rdma(lease, num_tokens, 1));
    assert!(
        matches!(&fx[..], [Effect::BindRdma { link: 3, stream: 1, num_layers: 3, .. }]),
        "an RDMA Open asks for a tag before it is accepted: {fx:?}"
    );
    let fx = r.rdma_bound(lease, 1, Ok(9));
    assert!(matches!(&fx[..], [Effect::Send { stream: 1, msg: Control::Accept { rdma_tag: Some(9), .. } }]), "{fx:?}");
}

/// Every layer of 6 tokens in two chunks (4 + 2): the notices the tests send.
fn all_notices(lease: LeaseId) -> Vec<Frame> {
    let mut v = Vec::new();
    for (c, (start, n)) in [(0, 4), (4, 2)].into_iter().enumerate() {
        for layer in 0..3 {
            v.push(notice(lease, layer, start, n, c as u32));
        }
    }
    v
}

/// What the pool holds, as the tests' `landed` callback sees it: the notice's own CRC unless
/// `corrupt` names its (layer, token_start).
fn pool_crc(corrupt: Option<(u32, u32)>) -> impl FnMut(&[u32], &Landed) -> Result<u32, KvTransferError> {
    move |blocks, n| {
        assert_eq!(blocks, &[10, 11][..]);
        let good = 0x1000 * n.layer + n.token_start;
        Ok(if corrupt == Some((n.layer, n.token_start)) { good ^ 1 } else { good })
    }
}

#[test]
fn rdma_lease_completes_only_after_every_group_landed_and_checked() {
    let (mut r, now, lease) = setup(6);
    bind_rdma(&mut r, now, lease, 6);
    for f in all_notices(lease) {
        assert!(r.on_frame(now, 1, f).is_empty());
    }
    let fx = r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 5 }));
    assert!(matches!(&fx[..], [Effect::SetChunks { tag: 9, link: 3, chunks, .. }] if chunks == &[2, 2, 2]), "{fx:?}");
    assert_eq!(r.reserved_blocks(), 2, "still leased until the link reports every group landed");
    let fx = r.rdma_landed(lease, pool_crc(None));
    assert!(fx.iter().any(|e| matches!(e, Effect::Completed { first_token: 5, .. })), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Send { msg: Control::Ack { .. }, .. })));
    assert_eq!(r.reserved_blocks(), 0);
    assert_eq!(r.stats().bytes_written, 2 * 6 * 3 * 32, "K and V of 6 tokens of 3 layers landed");
}

#[test]
fn rdma_checksum_mismatch_releases_with_the_binding() {
    let (mut r, now, lease) = setup(6);
    bind_rdma(&mut r, now, lease, 6);
    for f in all_notices(lease) {
        r.on_frame(now, 1, f);
    }
    r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 5 }));
    let fx = r.rdma_landed(lease, pool_crc(Some((1, 4))));
    assert!(
        matches!(released(&fx), Some(KvTransferError::ChecksumMismatch { layer: 1, token_start: 4, .. })),
        "{fx:?}"
    );
    assert!(fx.iter().any(|e| matches!(e, Effect::Released { rdma: Some((3, 9)), .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Checksum]);
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn rdma_notice_violations_release_the_lease() {
    // setup() opens the first lease of a receiver seeded at 100.
    let l = LeaseId(100);
    let cases: Vec<(&str, Vec<Frame>)> = vec![
        ("gap", vec![notice(l, 0, 0, 4, 0), notice(l, 0, 5, 1, 1)]),
        ("out of bounds", vec![notice(l, 1, 4, 3, 0)]),
        ("chunk index skipped", vec![notice(l, 0, 0, 4, 1)]),
        ("payload chunk on an RDMA lease", vec![chunk_frame(&layout(), l, 0, 0, 4)]),
        ("complete with a layer short", {
            vec![
                notice(l, 0, 0, 6, 0),
                notice(l, 1, 0, 4, 0),
                notice(l, 2, 0, 6, 0),
                Frame::Control(Control::Complete { lease_id: l, first_token: 1 }),
            ]
        }),
    ];
    for (what, frames) in cases {
        let (mut r, now, lease) = setup(6);
        assert_eq!(lease, LeaseId(100));
        bind_rdma(&mut r, now, lease, 6);
        let mut fx = Vec::new();
        for f in frames {
            fx.extend(r.on_frame(now, 1, f));
        }
        let e = released(&fx).unwrap_or_else(|| panic!("{what}: not released: {fx:?}"));
        println!("{what}: {e}");
        assert!(fx.iter().any(|e| matches!(e, Effect::Released { rdma: Some((3, 9)), .. })), "{what}");
        assert_eq!(r.reserved_blocks(), 0, "{what}");
    }
}

#[test]
fn rdma_open_is_refused_on_several_streams_or_without_a_tag() {
    // Several streams: the payload needs none, so it is a broken sender.
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    let fx = r.on_frame(now, 1, open_rdma(lease, 6, 2));
    assert!(released(&fx).is_some(), "{fx:?}");
    // The link could not take the lease (no such link, no tag free): released, no binding.
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    r.on_frame(now, 1, open_rdma(lease, 6, 1));
    let fx = r.rdma_bound(lease, 1, Err(KvTransferError::RdmaLink { link: 3, reason: "gone".into() }));
    assert!(fx.iter().any(|e| matches!(e, Effect::Released { rdma: None, .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Internal]);
    // A notice before the tag: a protocol violation.
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    r.on_frame(now, 1, open_rdma(lease, 6, 1));
    let fx = r.on_frame(now, 1, notice(lease, 0, 0, 4, 0));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "{fx:?}");
    // A notice on a byte-stream lease.
    let (mut r, now, lease) = setup(6);
    bind(&mut r, now, lease, 6);
    let fx = r.on_frame(now, 1, notice(lease, 0, 0, 4, 0));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "{fx:?}");
}

#[test]
fn rdma_layers_may_be_chunked_differently() {
    // A prefill preempted between two layers resumes where each stopped: layer 1 arrives in two
    // chunks, the others in one. The link is told each layer's count.
    let (mut r, now, lease) = setup(6);
    bind_rdma(&mut r, now, lease, 6);
    for f in
        [notice(lease, 0, 0, 6, 0), notice(lease, 1, 0, 4, 0), notice(lease, 1, 4, 2, 1), notice(lease, 2, 0, 6, 0)]
    {
        assert!(r.on_frame(now, 1, f).is_empty());
    }
    let fx = r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 5 }));
    assert!(matches!(&fx[..], [Effect::SetChunks { chunks, .. }] if chunks == &[1, 2, 1]), "{fx:?}");
}

#[test]
fn rdma_open_naming_an_unknown_link_keeps_the_lease_for_a_new_link() {
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    r.on_frame(now, 1, open_rdma(lease, 6, 1));
    let fx = r.rdma_bound(lease, 1, Err(KvTransferError::RdmaUnknownLink { link: 3 }));
    assert_eq!(aborts(&fx), vec![AbortCode::UnknownLink]);
    assert!(released(&fx).is_none(), "the lease stays: {fx:?}");
    assert_eq!(r.reserved_blocks(), 2);
    // The sender comes back over another stream (and link) and completes.
    r.stream_opened(2);
    let fx = r.on_frame(now, 2, open_rdma(lease, 6, 1));
    assert!(matches!(&fx[..], [Effect::BindRdma { stream: 2, .. }]), "{fx:?}");
    let fx = r.rdma_bound(lease, 2, Ok(5));
    assert!(matches!(&fx[..], [Effect::Send { stream: 2, msg: Control::Accept { rdma_tag: Some(5), .. } }]), "{fx:?}");
}
