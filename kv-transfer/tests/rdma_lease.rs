//! The RDMA payload of a lease ([`RdmaLease`]) inside the sans-IO receiver, notice by notice:
//! the payload lands by itself, the stream carries `Landed` notices, checked against the pool
//! once the link says every group landed. Explicit instants, no link: the tests play the
//! driver's part (`Effect::Bind` answered with an `RdmaLease` on tag 9 of link 3, `Expect`
//! answered with `Receiver::landed`).
#![cfg(feature = "rdma")]

mod common;

use std::time::{Duration, Instant};

use cleave_kv_transfer::frame::{AbortCode, Control, Frame, Landed, Open};
use cleave_kv_transfer::payload::{Expect, LinkTag};
use cleave_kv_transfer::rdma::RdmaLease;
use cleave_kv_transfer::receiver::{Effect, LeaseSpec, Receiver};
use cleave_kv_transfer::KvTransferError;
use cleave_protocol::{LeaseId, RequestId};
use common::{chunk_frame, layout};

const TTL: Duration = Duration::from_secs(5);
const AT: LinkTag = LinkTag { link: 3, tag: 9 };

fn setup(num_tokens: u32) -> (Receiver, Instant, LeaseId) {
    let mut r = Receiver::new(layout(), 100);
    let now = Instant::now();
    let blocks = (0..num_tokens.div_ceil(4)).map(|b| 10 + b).collect();
    let lease = r
        .open_lease(now, LeaseSpec { request_id: RequestId(7), blocks, num_tokens, cached_tokens: 0, ttl: TTL })
        .unwrap();
    (r, now, lease)
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

fn complete(lease: LeaseId) -> Frame {
    Frame::Control(Control::Complete { lease_id: lease, first_token: 5 })
}

/// Binds stream 1 to an RDMA lease with tag 9 on link 3.
fn bind_rdma(r: &mut Receiver, now: Instant, lease: LeaseId, num_tokens: u32) {
    r.stream_opened(1);
    let open = Open {
        request_id: RequestId(7),
        lease_id: lease,
        layout: layout(),
        num_tokens,
        stream_index: 0,
        stream_count: 1,
        rdma_link: Some(3),
    };
    let fx = r.on_frame(now, 1, Frame::Control(Control::Open(open)));
    let [Effect::Bind { link: 3, stream: 1, num_layers, .. }] = &fx[..] else { panic!("{fx:?}") };
    let fx = r.bound(lease, 1, Ok(Box::new(RdmaLease::new(AT, *num_layers))));
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

/// What the pool holds, as the driver's `landed` check sees it: the notice's own CRC unless
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
    let fx = r.on_frame(now, 1, complete(lease));
    assert!(
        matches!(&fx[..], [Effect::Expect { expect: Expect { at: AT, chunks }, .. }] if chunks == &[2, 2, 2]),
        "{fx:?}"
    );
    assert_eq!(r.reserved_blocks(), 2, "still leased until the link reports every group landed");
    let fx = r.landed(lease, pool_crc(None));
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
    r.on_frame(now, 1, complete(lease));
    let fx = r.landed(lease, pool_crc(Some((1, 4))));
    assert!(
        matches!(released(&fx), Some(KvTransferError::ChecksumMismatch { layer: 1, token_start: 4, .. })),
        "{fx:?}"
    );
    assert!(fx.iter().any(|e| matches!(e, Effect::Released { link: Some(AT), .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Checksum]);
    assert_eq!(r.reserved_blocks(), 0);
}

#[test]
fn rdma_notice_violations_release_the_lease() {
    // setup() opens the first lease of a receiver seeded at 100.
    let l = LeaseId(100);
    let cases: Vec<(&str, Vec<Frame>)> = vec![
        ("gap", vec![notice(l, 0, 0, 4, 0), notice(l, 0, 5, 1, 1)]),
        ("duplicate notice", vec![notice(l, 0, 0, 4, 0), notice(l, 0, 0, 4, 0)]),
        ("out of bounds", vec![notice(l, 1, 4, 3, 0)]),
        ("no such layer", vec![notice(l, 3, 0, 4, 0)]),
        ("chunk index skipped", vec![notice(l, 0, 0, 4, 1)]),
        ("payload chunk on an RDMA lease", vec![chunk_frame(&layout(), l, 0, 0, 4)]),
        ("complete with a layer short", {
            vec![notice(l, 0, 0, 6, 0), notice(l, 1, 0, 4, 0), notice(l, 2, 0, 6, 0), complete(l)]
        }),
        ("second complete", {
            let mut v = all_notices(l);
            v.extend([complete(l), complete(l)]);
            v
        }),
    ];
    for (what, frames) in cases {
        let (mut r, now, lease) = setup(6);
        assert_eq!(lease, l);
        bind_rdma(&mut r, now, lease, 6);
        let mut fx = Vec::new();
        for f in frames {
            fx.extend(r.on_frame(now, 1, f));
        }
        let e = released(&fx).unwrap_or_else(|| panic!("{what}: not released: {fx:?}"));
        println!("{what}: {e}");
        assert!(fx.iter().any(|e| matches!(e, Effect::Released { link: Some(AT), .. })), "{what}");
        assert_eq!(r.reserved_blocks(), 0, "{what}");
    }
}

#[test]
fn rdma_gaps_are_gaps_and_bounds_are_bounds() {
    let (mut r, now, lease) = setup(6);
    bind_rdma(&mut r, now, lease, 6);
    r.on_frame(now, 1, notice(lease, 0, 0, 4, 0));
    let fx = r.on_frame(now, 1, notice(lease, 0, 0, 4, 1));
    assert!(matches!(released(&fx), Some(KvTransferError::ChunkGap { layer: 0, expected: 4, got: 0, .. })), "{fx:?}");
    assert_eq!(aborts(&fx), vec![AbortCode::Gap]);
    let (mut r, now, lease) = setup(6);
    bind_rdma(&mut r, now, lease, 6);
    let fx = r.on_frame(now, 1, notice(lease, 2, 0, 7, 0));
    assert!(matches!(released(&fx), Some(KvTransferError::ChunkOutOfBounds { .. })), "{fx:?}");
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
    let fx = r.on_frame(now, 1, complete(lease));
    assert!(
        matches!(&fx[..], [Effect::Expect { expect: Expect { chunks, .. }, .. }] if chunks == &[1, 2, 1]),
        "{fx:?}"
    );
    let fx = r.on_frame(now, 1, notice(lease, 0, 6, 0, 1));
    assert!(matches!(released(&fx), Some(KvTransferError::Protocol { .. })), "no notice after Complete: {fx:?}");
}
