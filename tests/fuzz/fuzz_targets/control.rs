//! Fuzz target: any bytes as one control-plane frame body (`src/running/control/frame.rs`), as a hub or a rank process
//! reads it from a TCP peer. Panics, aborts and out-of-memory are the findings; so is a decoded frame that does
//! not survive `decode(encode(x)) == x`, or an encoding whose length prefix does not match its body.

#![no_main]

use kvrelay::control::frame::{body_len, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= 4 {
        let _ = body_len([data[0], data[1], data[2], data[3]]);
    }
    if let Ok(frame) = decode(data) {
        let bytes = frame.encode();
        let len = body_len([bytes[0], bytes[1], bytes[2], bytes[3]]).expect("an encoded frame is within the limit");
        assert_eq!(len, bytes.len() - 4, "length prefix");
        assert_eq!(decode(&bytes[4..]).as_ref(), Ok(&frame), "round trip");
    }
});
