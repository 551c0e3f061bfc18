//! The sans-IO receiver, edge by edge of the ownership state machine (crate docs): every test
//! drives it with explicit instants and checks the effects and that no block stays leased.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_kv_transfer::frame::{AbortCode, ChunkHeader, Control, Frame, Landed, Open};
use cleave_kv_transfer::payload::{Expect, KvWrite, LandedCheck, LeaseCx, LeasePayload, LinkTag};
use cleave_kv_transfer::receiver::{DropReason, Effect, LeaseSpec, Receiver};
use cleave_kv_transfer::KvTransferError;
use cleave_protocol::{KvDtype, LeaseId, RequestId};
use common::{chunk_frame, layout};

const TTL: Duration = Duration::from_secs(5);

fn setup(num_tokens: u32) -> (Receiver, Instant, LeaseId) {
    let mut r = Receiver::new(layout(), 100);
    let now = Instant::now();
    let blocks = (0..num_tokens.div_ceil(4)).map(|b| 10 + b).collect();
    let lease = r
        .open_lease(now, LeaseSpec { request_id: RequestId(7), blocks, num_tokens, cached_tokens: 0, ttl: TTL })
        .unwrap();
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
        .open_lease(
            now,
            LeaseSpec { request_id: RequestId(1), blocks: vec![1], num_tokens: 5, cached_tokens: 0, ttl: TTL },
        )
        .unwrap_err();
    assert!(matches!(err, KvTransferError::InvalidRequest { .. }), "{err}");
    assert_eq!(r.reserved_blocks(), 0);
}

// --- Leases over a link: the core's side, with a stand-in for a path's payload ---
// (The RDMA payload itself, notice by notice, is tests/rdma_lease.rs, feature `rdma`.)

fn open_linked(lease: LeaseId, num_tokens: u32, stream_count: u16) -> Frame {
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
    Frame::Control(Control::Landed(Landed { lease_id: lease, layer, token_start, token_count, chunk, crc32: 0 }))
}

/// A payload that lands by itself, as a path's does: it takes any notice, asks its path for one
/// group per layer at `Complete`, and is ready once the path said it all landed (and `check`
/// agreed with the notice's CRC of 0).
struct StandIn {
    tag: u16,
    notices: Vec<Landed>,
    landed: bool,
}

fn stand_in(tag: u16) -> Box<dyn LeasePayload> {
    Box::new(StandIn { tag, notices: Vec::new(), landed: false })
}

impl LeasePayload for StandIn {
    fn accept(&self, lease: LeaseId) -> Control {
        Control::Accept { lease_id: lease, rdma_tag: Some(self.tag) }
    }

    fn link(&self) -> Option<LinkTag> {
        Some(LinkTag { link: 3, tag: self.tag })
    }

    fn chunk(
        &mut self,
        cx: &LeaseCx<'_>,
        _: ChunkHeader,
        _: Bytes,
        _: Bytes,
    ) -> Result<Option<KvWrite>, KvTransferError> {
        Err(KvTransferError::Protocol { reason: format!("a chunk for {}", cx.id) })
    }

    fn notice(&mut self, _: &LeaseCx<'_>, n: Landed) -> Result<(), KvTransferError> {
        self.notices.push(n);
        Ok(())
    }

    fn complete(&mut self, cx: &LeaseCx<'_>) -> Result<Option<Expect>, KvTransferError> {
        Ok(Some(Expect { at: self.link().unwrap(), chunks: vec![1; cx.layout.num_layers as usize] }))
    }

    fn landed(&mut self, cx: &LeaseCx<'_>, check: LandedCheck<'_>) -> Result<u64, KvTransferError> {
        for n in &self.notices {
            let got = check(&cx.blocks[..], n)?;
            if got != n.crc32 {
                return Err(KvTransferError::ChecksumMismatch {
                    lease: cx.id,
                    layer: n.layer,
                    token_start: n.token_start,
                    token_count: n.token_count,
                    expected: n.crc32,
                    got,
                });
            }
        }
        self.landed = true;
        Ok(100)
    }

    fn ready(&self) -> bool {
        self.landed
    }
}

/// Binds stream 1 to a lease over link 3, with tag 9.
fn bind_linked(r: &mut Receiver, now: Instant, lease: LeaseId, num_tokens: u32) {
    r.stream_opened(1);
    let fx = r.on_frame(now, 1, open_linked(lease, num_tokens, 1));
    assert!(
        matches!(&fx[..], [Effect::Bind { link: 3, stream: 1, num_layers: 3, .. }]),
        "an Open naming a link asks the path to bind it before it is accepted: {fx:?}"
    );
    let fx = r.bound(lease, 1, Ok(stand_in(9)));
    assert!(matches!(&fx[..], [Effect::Send { stream: 1, msg: Control::Accept { rdma_tag: Some(9), .. } }]), "{fx:?}");
}

const AT: LinkTag = LinkTag { link: 3, tag: 9 };

#[test]
fn a_linked_lease_completes_only_once_its_path_says_it_landed() {
    let (mut r, now, lease) = setup(6);
    bind_linked(&mut r, now, lease, 6);
    assert!(r.on_frame(now, 1, notice(lease, 0, 0, 6, 0)).is_empty());
    let fx = r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 5 }));
    assert!(
        matches!(&fx[..], [Effect::Expect { expect: Expect { at: AT, chunks }, .. }] if chunks == &[1, 1, 1]),
        "{fx:?}"
    );
    assert_eq!(r.reserved_blocks(), 2, "still leased until the path reports it landed");
    let fx = r.landed(lease, |blocks, _| {
        assert_eq!(blocks, &[10, 11][..]);
        Ok(0)
    });
    assert!(fx.iter().any(|e| matches!(e, Effect::Completed { first_token: 5, .. })), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Send { msg: Control::Ack { .. }, .. })));
    assert_eq!(r.reserved_blocks(), 0);
    assert_eq!(r.stats().bytes_written, 100, "the bytes the payload verified");
}

#[test]
fn a_linked_lease_names_its_tag_when_released() {
    // The payload's check fails.
    let (mut r, now, lease) = setup(6);
    bind_linked(&mut r, now, lease, 6);
    r.on_frame(now, 1, notice(lease, 1, 0, 6, 0));
    r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 5 }));
    let fx = r.landed(lease, |_, _| Ok(1));
    assert!(matches!(released(&fx), Some(KvTransferError::ChecksumMismatch { layer: 1, .. })), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Released { link: Some(AT), .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Checksum]);
    assert_eq!(r.reserved_blocks(), 0);
    // The payload refuses a frame; cancelled; expired; the stream ends: each names the tag.
    type Case = Box<dyn Fn(&mut Receiver, Instant, LeaseId) -> Vec<Effect>>;
    let cases: Vec<(&str, Case)> = vec![
        (
            "payload violation",
            Box::new(|r: &mut Receiver, now: Instant, l: LeaseId| {
                r.on_frame(now, 1, chunk_frame(&layout(), l, 0, 0, 4))
            }),
        ),
        ("cancel", Box::new(|r: &mut Receiver, _: Instant, l: LeaseId| r.cancel(l))),
        ("expiry", Box::new(|r: &mut Receiver, now: Instant, _: LeaseId| r.poll_expired(now + TTL))),
        ("stream end", Box::new(|r: &mut Receiver, now: Instant, _: LeaseId| r.on_stream_closed(now, 1))),
    ];
    for (what, case) in cases {
        let (mut r, now, lease) = setup(6);
        bind_linked(&mut r, now, lease, 6);
        let fx = case(&mut r, now, lease);
        assert!(fx.iter().any(|e| matches!(e, Effect::Released { link: Some(AT), .. })), "{what}: {fx:?}");
        assert_eq!(r.reserved_blocks(), 0, "{what}");
    }
}

#[test]
fn a_linked_open_is_refused_on_several_streams_or_when_the_path_cannot_bind() {
    // Several streams: the payload needs none, so it is a broken sender.
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    let fx = r.on_frame(now, 1, open_linked(lease, 6, 2));
    assert!(released(&fx).is_some(), "{fx:?}");
    // The path could not take the lease (no such path, no tag free): released, no binding.
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    r.on_frame(now, 1, open_linked(lease, 6, 1));
    let fx = r.bound(lease, 1, Err(KvTransferError::RdmaLink { link: 3, reason: "gone".into() }));
    assert!(fx.iter().any(|e| matches!(e, Effect::Released { link: None, .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Internal]);
    assert_eq!(r.reserved_blocks(), 0);
    // A notice before the binding: a protocol violation.
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    r.on_frame(now, 1, open_linked(lease, 6, 1));
    let fx = r.on_frame(now, 1, notice(lease, 0, 0, 4, 0));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "{fx:?}");
    // A binding nobody asked for.
    let (mut r, _, lease) = setup(6);
    let fx = r.bound(lease, 1, Ok(stand_in(9)));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "{fx:?}");
    // A second Open for a linked lease, on another stream.
    let (mut r, now, lease) = setup(6);
    bind_linked(&mut r, now, lease, 6);
    r.stream_opened(2);
    let fx = r.on_frame(now, 2, open(lease, 6));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "{fx:?}");
    // An Open naming a link for a lease that already streams its payload.
    let (mut r, now, lease) = setup(6);
    bind(&mut r, now, lease, 6);
    r.stream_opened(2);
    let fx = r.on_frame(now, 2, open_linked(lease, 6, 1));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "{fx:?}");
    // A notice on a lease whose payload travels on its streams.
    let (mut r, now, lease) = setup(6);
    bind(&mut r, now, lease, 6);
    let fx = r.on_frame(now, 1, notice(lease, 0, 0, 4, 0));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "{fx:?}");
}

#[test]
fn an_open_naming_an_unknown_link_keeps_the_lease_for_a_new_link() {
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    r.on_frame(now, 1, open_linked(lease, 6, 1));
    let fx = r.bound(lease, 1, Err(KvTransferError::RdmaUnknownLink { link: 3 }));
    assert_eq!(aborts(&fx), vec![AbortCode::UnknownLink]);
    assert!(released(&fx).is_none(), "the lease stays: {fx:?}");
    assert_eq!(r.reserved_blocks(), 2);
    // The sender comes back over another stream (and link) and completes.
    r.stream_opened(2);
    let fx = r.on_frame(now, 2, open_linked(lease, 6, 1));
    assert!(matches!(&fx[..], [Effect::Bind { stream: 2, .. }]), "{fx:?}");
    let fx = r.bound(lease, 2, Ok(stand_in(5)));
    assert!(matches!(&fx[..], [Effect::Send { stream: 2, msg: Control::Accept { rdma_tag: Some(5), .. } }]), "{fx:?}");
    r.on_frame(now, 2, Frame::Control(Control::Complete { lease_id: lease, first_token: 1 }));
    let fx = r.landed(lease, |_, _| Ok(0));
    assert!(fx.iter().any(|e| matches!(e, Effect::Completed { .. })), "{fx:?}");
    // Or over the streams after all.
    let (mut r, now, lease) = setup(6);
    r.stream_opened(1);
    r.on_frame(now, 1, open_linked(lease, 6, 1));
    r.bound(lease, 1, Err(KvTransferError::RdmaUnknownLink { link: 3 }));
    bind(&mut r, now, lease, 6);
}

/// A lease whose first blocks already hold a cached prefix (8 of 10 tokens, blocks of 4):
/// it completes once every layer holds tokens 8..10, a chunk inside the prefix is a duplicate,
/// one straddling its end a gap, and a prefix that is not whole blocks below the token count
/// is refused at reservation.
#[test]
fn a_cached_prefix_travels_not_and_the_lease_completes_on_the_rest() {
    let mut r = Receiver::new(layout(), 100);
    let now = Instant::now();
    let spec = |cached| LeaseSpec {
        request_id: RequestId(7),
        blocks: vec![10, 11, 12],
        num_tokens: 10,
        cached_tokens: cached,
        ttl: TTL,
    };
    for bad in [2, 10, 12] {
        let err = r.open_lease(now, spec(bad)).unwrap_err();
        assert!(matches!(err, KvTransferError::InvalidRequest { .. }), "{bad}: {err}");
    }
    assert_eq!(r.reserved_blocks(), 0);
    let lease = r.open_lease(now, spec(8)).unwrap();
    bind(&mut r, now, lease, 10);
    let fx = r.on_frame(now, 1, chunk_frame(&layout(), lease, 0, 4, 4));
    assert!(matches!(&fx[..], [Effect::Dropped { why: DropReason::Duplicate, .. }]), "{fx:?}");
    let mut last = Vec::new();
    for layer in 0..3 {
        last = r.on_frame(now, 1, chunk_frame(&layout(), lease, layer, 8, 2));
        assert_eq!(writes(&last), 1);
    }
    assert!(last.is_empty() || !last.iter().any(|e| matches!(e, Effect::Completed { .. })));
    let fx = r.on_frame(now, 1, Frame::Control(Control::Complete { lease_id: lease, first_token: 5 }));
    let done = fx.iter().find_map(|e| match e {
        Effect::Completed { blocks, .. } => Some(blocks.clone()),
        _ => None,
    });
    assert_eq!(done, Some(vec![10, 11, 12]));
    assert_eq!(r.reserved_blocks(), 0);

    let lease = r.open_lease(now, spec(8)).unwrap();
    r.stream_opened(2);
    let fx = r.on_frame(now, 2, open(lease, 10));
    assert!(matches!(&fx[..], [Effect::Send { msg: Control::Accept { .. }, .. }]), "{fx:?}");
    let fx = r.on_frame(now, 2, chunk_frame(&layout(), lease, 0, 6, 4));
    assert!(matches!(released(&fx), Some(KvTransferError::ChunkGap { expected: 8, got: 6, .. })), "{fx:?}");
    assert_eq!(r.reserved_blocks(), 0);
}
