//! Fuzz target of the frame decoder, as proptests so it runs in `cargo test`: arbitrary bytes
//! and mutations of valid frames must never panic, never allocate past the limits, and end in
//! either a frame, "need more bytes", or a clear error.

mod common;

use bytes::BytesMut;
use cleave_kv_transfer::frame::{
    decode_frame, encode_chunk, encode_control, read_frame, AbortCode, ChunkHeader, Control, Frame, Landed, Limits,
    Open,
};
use cleave_kv_transfer::KvTransferError;
use cleave_protocol::{LeaseId, RequestId};
use common::{chunk_frame, layout};
use proptest::prelude::*;

fn limits() -> Limits {
    Limits { max_payload: 1 << 16, layout: Some(layout()) }
}

fn valid_frames() -> Vec<Vec<u8>> {
    let l = layout();
    let mut out: Vec<Vec<u8>> = [
        Control::Open(Open {
            request_id: RequestId(1),
            lease_id: LeaseId(2),
            layout: l.clone(),
            num_tokens: 9,
            stream_index: 0,
            stream_count: 2,
            rdma_link: None,
        }),
        Control::Accept { lease_id: LeaseId(2), rdma_tag: None },
        Control::Complete { lease_id: LeaseId(2), first_token: 17 },
        Control::Ack { lease_id: LeaseId(2) },
        Control::Abort { lease_id: LeaseId(2), code: AbortCode::Checksum, reason: "bad crc".into() },
        Control::Accept { lease_id: LeaseId(2), rdma_tag: Some(7) },
        Control::Landed(Landed { lease_id: LeaseId(2), layer: 1, token_start: 4, token_count: 3, chunk: 1, crc32: 9 }),
        Control::LinkOffer { metadata: vec![0x11; 96] },
        Control::LinkAnswer { link_id: 3, metadata: vec![0x22; 120] },
        Control::Drained { lease_id: LeaseId(2), tag: 7 },
    ]
    .iter()
    .map(|c| encode_control(c).to_vec())
    .collect();
    for (layer, start, count) in [(0, 0, 1), (2, 4, 3)] {
        let Frame::Chunk { header, k, v } = chunk_frame(&l, LeaseId(2), layer, start, count) else { unreachable!() };
        out.push(encode_chunk(&header, &k, &v).to_vec());
    }
    out
}

/// Decodes everything in `bytes`; checks every outcome is sane.
fn decode_all(bytes: &[u8]) {
    let lim = limits();
    let mut buf = BytesMut::from(bytes);
    loop {
        match decode_frame(&mut buf, &lim) {
            Ok(Some(Frame::Chunk { header, k, v })) => check_chunk(&header, k.len(), v.len()),
            Ok(Some(Frame::Control(_))) => {}
            Ok(None) => return,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                assert!(
                    matches!(
                        e,
                        KvTransferError::MalformedFrame { .. }
                            | KvTransferError::FrameTooLarge { .. }
                            | KvTransferError::VersionUnsupported { .. }
                    ),
                    "unexpected error kind: {e}"
                );
                return;
            }
        }
    }
}

fn check_chunk(h: &ChunkHeader, k: usize, v: usize) {
    let l = layout();
    assert_eq!(h.k_len as usize, k);
    assert_eq!(h.v_len as usize, v);
    assert!(h.layer < l.num_layers);
    assert!(k <= limits().max_payload);
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, mask: u8 },
    Set { at: usize, value: u8 },
    Truncate { at: usize },
    Insert { at: usize, value: u8 },
    Remove { at: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Set { at, value }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Insert { at, value }),
        any::<usize>().prop_map(|at| Mutation::Remove { at }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    match *m {
        Mutation::Flip { at, mask } => {
            let i = at % bytes.len();
            bytes[i] ^= mask;
        }
        Mutation::Set { at, value } => {
            let i = at % bytes.len();
            bytes[i] = value;
        }
        Mutation::Truncate { at } => bytes.truncate(at % bytes.len()),
        Mutation::Insert { at, value } => {
            let i = at % (bytes.len() + 1);
            bytes.insert(i, value);
        }
        Mutation::Remove { at } => {
            let i = at % bytes.len();
            bytes.remove(i);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn arbitrary_bytes_after_a_plausible_prefix_never_panic(
        header_len in 0u32..1100,
        payload_len in 0u32..70_000,
        rest in proptest::collection::vec(any::<u8>(), 0..1200),
    ) {
        let mut bytes = header_len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&payload_len.to_le_bytes());
        bytes.extend_from_slice(&rest);
        decode_all(&bytes);
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        which in 0usize..7,
        muts in proptest::collection::vec(mutation(), 1..6),
    ) {
        let mut bytes = valid_frames().swap_remove(which);
        for m in &muts {
            apply(&mut bytes, m);
        }
        decode_all(&bytes);
    }

    #[test]
    fn concatenated_valid_frames_decode_in_order(order in proptest::collection::vec(0usize..7, 1..10)) {
        let frames = valid_frames();
        let mut bytes = Vec::new();
        for &i in &order {
            bytes.extend_from_slice(&frames[i]);
        }
        let mut buf = BytesMut::from(&bytes[..]);
        let lim = limits();
        let mut n = 0;
        while let Some(f) = decode_frame(&mut buf, &lim).unwrap() {
            let _ = f;
            n += 1;
        }
        prop_assert_eq!(n, order.len());
        prop_assert!(buf.is_empty());
    }

    /// The streaming reader agrees: a cut frame is `Truncated`, never a hang or a panic.
    #[test]
    fn stream_reader_reports_truncation(which in 0usize..7, cut in any::<usize>()) {
        let bytes = valid_frames().swap_remove(which);
        let cut = cut % bytes.len();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let r = rt.block_on(async {
            let mut src: &[u8] = &bytes[..cut];
            read_frame(&mut src, &limits()).await
        });
        if cut == 0 {
            prop_assert!(matches!(r, Ok(None)));
        } else {
            prop_assert!(matches!(r, Err(KvTransferError::Truncated { .. })), "{:?}", r);
        }
    }

    /// Mutated frames through the streaming reader: an error or a frame, never a panic.
    #[test]
    fn stream_reader_survives_mutations(which in 0usize..7, muts in proptest::collection::vec(mutation(), 1..4)) {
        let mut bytes = valid_frames().swap_remove(which);
        for m in &muts {
            apply(&mut bytes, m);
        }
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let mut src: &[u8] = &bytes[..];
            while let Ok(Some(_)) = read_frame(&mut src, &limits()).await {}
        });
    }
}

#[test]
fn oversized_lengths_are_refused_before_allocating() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&64u32.to_le_bytes());
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    let err = decode_frame(&mut BytesMut::from(&bytes[..]), &limits()).unwrap_err();
    assert!(matches!(err, KvTransferError::FrameTooLarge { what: "payload", .. }), "{err}");
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    let err = decode_frame(&mut BytesMut::from(&bytes[..]), &limits()).unwrap_err();
    assert!(matches!(err, KvTransferError::FrameTooLarge { what: "header", .. }), "{err}");
}

/// Writes the seed corpus of the `handoff_frame` fuzz target (`fuzz/`): every valid frame,
/// alone and all in one stream, under each mode byte the target reads (bit 0: the receiver
/// knows the layout). Run by `scripts/fuzz --seeds`.
#[test]
#[ignore = "writes fuzz/corpus/handoff_frame; run by scripts/fuzz --seeds"]
fn write_fuzz_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/handoff_frame");
    std::fs::create_dir_all(&dir).unwrap();
    let frames = valid_frames();
    for mode in [0u8, 1] {
        for (i, f) in frames.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{mode}-{i}")), [&[mode][..], f].concat()).unwrap();
        }
        std::fs::write(dir.join(format!("seed-{mode}-stream")), [vec![mode], frames.concat()].concat()).unwrap();
    }
}
