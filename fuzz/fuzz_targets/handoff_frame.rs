//! Handoff frames (`cleave_kv_transfer::frame`): the sans-IO decoder [`decode_frame`] (which
//! runs [`parse_prefix`] and [`parse_header`]) against the stream reader [`read_frame`].
//!
//! The first byte picks the limits (with or without the receiver's layout, and the payload
//! bound); the rest is a stream of frames. What must hold:
//! - nothing panics and nothing is allocated past the limits (the fuzz crate's allocator
//!   aborts on a buffer sized by an unchecked length);
//! - every frame decoded satisfies the module's invariants: lengths within the limits, a chunk's
//!   `k`/`v` of `k_len` bytes each, control frames without payload;
//! - a control frame is canonical after one trip through `encode_control`, and a chunk
//!   re-encodes (`encode_chunk`) to a frame that decodes to the same header, K and V;
//! - the two decoders agree frame by frame, and on how the stream ends: cleanly at a frame
//!   boundary, truncated inside a frame, or with the same error.
#![no_main]

use bytes::BytesMut;
use cleave_fuzz::ready;
use cleave_kv_transfer::frame::{
    decode_frame, encode_chunk, encode_control, read_frame, Frame, Limits, MAX_HEADER_BYTES, PREFIX_BYTES,
};
use cleave_kv_transfer::KvTransferError;
use cleave_protocol::{KvDtype, KvLayout};
use libfuzzer_sys::fuzz_target;

/// How a stream of frames ended.
#[derive(Debug, PartialEq)]
enum End {
    Clean,
    Truncated,
    Error(String),
}

/// The layout of `kv-transfer/tests/common` (so the seeds written there decode here).
fn limits(mode: u8) -> Limits {
    let layout = KvLayout {
        model_fingerprint: 0xC1EA_7E00,
        dtype: KvDtype::F32,
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 4,
        block_size: 4,
    };
    Limits { max_payload: if mode & 2 == 0 { 1 << 16 } else { 64 }, layout: (mode & 1 == 1).then_some(layout) }
}

fn decode_one(bytes: &[u8], limits: &Limits) -> Frame {
    let mut buf = BytesMut::from(bytes);
    let frame = decode_frame(&mut buf, limits).expect("an encoded frame decodes").expect("an encoded frame is whole");
    assert!(buf.is_empty(), "decoding one encoded frame left {} bytes", buf.len());
    frame
}

fn check_frame(frame: &Frame, consumed: usize, limits: &Limits) {
    assert!(consumed > PREFIX_BYTES && consumed <= PREFIX_BYTES + MAX_HEADER_BYTES + limits.max_payload);
    match frame {
        Frame::Control(c) => {
            let canon = encode_control(c);
            let Frame::Control(again) = decode_one(&canon, limits) else { panic!("{c:?} re-decodes as a chunk") };
            assert_eq!(encode_control(&again), canon, "{c:?} is not canonical after one trip");
        }
        Frame::Chunk { header, k, v } => {
            assert_eq!(k.len(), header.k_len as usize);
            assert_eq!(v.len(), header.v_len as usize);
            assert_eq!(k.len(), v.len());
            assert!(k.len() + v.len() <= limits.max_payload);
            let again = decode_one(&encode_chunk(header, k, v), limits);
            assert_eq!(&again, frame);
        }
    }
}

/// Every frame `decode_frame` takes off the front of `bytes`, and how the stream ended.
fn sans_io(bytes: &[u8], limits: &Limits) -> (Vec<Frame>, End) {
    let mut buf = BytesMut::from(bytes);
    let mut frames = Vec::new();
    loop {
        let before = buf.len();
        match decode_frame(&mut buf, limits) {
            Ok(Some(f)) => {
                check_frame(&f, before - buf.len(), limits);
                frames.push(f);
            }
            Ok(None) => {
                assert_eq!(buf.len(), before, "decode_frame consumed bytes without returning a frame");
                return (frames, if buf.is_empty() { End::Clean } else { End::Truncated });
            }
            Err(e @ KvTransferError::Truncated { .. }) => panic!("decode_frame never reports truncation: {e}"),
            Err(e) => return (frames, End::Error(e.to_string())),
        }
    }
}

/// The same through the stream reader.
fn streamed(mut bytes: &[u8], limits: &Limits) -> (Vec<Frame>, End) {
    let mut frames = Vec::new();
    loop {
        match ready(read_frame(&mut bytes, limits)) {
            Ok(Some(f)) => frames.push(f),
            Ok(None) => return (frames, End::Clean),
            Err(KvTransferError::Truncated { .. }) => return (frames, End::Truncated),
            Err(e) => return (frames, End::Error(e.to_string())),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let limits = limits(mode);
    let a = sans_io(rest, &limits);
    let b = streamed(rest, &limits);
    assert_eq!(a, b, "decode_frame and read_frame disagree");
});
