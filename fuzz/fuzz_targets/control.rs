//! Control-plane messages (`cleave_protocol::control`): the flatbuffers decoder and the
//! length-prefixed framing of the control link.
//!
//! The first byte picks what the rest is: even, one message body for [`control::decode`]; odd, a
//! stream of frames for [`control::read_msg`]. What must hold:
//! - nothing panics, and every failure is a [`WireError`];
//! - a message that decodes is canonical after one trip: encoding it and decoding that gives a
//!   message that encodes to the same bytes (compared as bytes so that NaN log-probabilities,
//!   which the wire may carry, do not make equal messages unequal);
//! - the framing agrees with the decoder: each frame `read_msg` returns is what `decode` makes
//!   of that frame's body, and a frame longer than `MAX_FRAME_BYTES` is refused.
#![no_main]

use cleave_fuzz::ready;
use cleave_protocol::control::{self, ControlMsg, WireError, MAX_FRAME_BYTES};
use libfuzzer_sys::fuzz_target;

fn check_canonical(msg: &ControlMsg) {
    let canon = control::encode(msg);
    let again = control::decode(&canon).unwrap_or_else(|e| panic!("{msg:?} encodes to bytes that do not decode: {e}"));
    assert_eq!(control::encode(&again), canon, "{msg:?} is not canonical after one trip");
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode % 2 == 0 {
        if let Ok(msg) = control::decode(rest) {
            check_canonical(&msg);
        }
        return;
    }
    let mut stream = rest;
    loop {
        let before = stream;
        match ready(control::read_msg(&mut stream)) {
            Ok(Some(msg)) => {
                let len = u32::from_le_bytes(before[..4].try_into().unwrap()) as usize;
                assert!(len <= MAX_FRAME_BYTES);
                assert_eq!(before.len() - stream.len(), 4 + len, "read_msg consumed more or less than one frame");
                let direct = control::decode(&before[4..4 + len]).expect("read_msg accepted a body decode refuses");
                assert_eq!(control::encode(&direct), control::encode(&msg));
                check_canonical(&msg);
            }
            Ok(None) => {
                assert!(before.is_empty(), "clean end of stream reported with {} bytes left", before.len());
                break;
            }
            Err(WireError::TooLarge { len, max }) => {
                assert!(len > max && max == MAX_FRAME_BYTES);
                break;
            }
            Err(WireError::Io(e)) => panic!("a slice reader cannot fail with i/o: {e}"),
            Err(_) => break,
        }
    }
});
