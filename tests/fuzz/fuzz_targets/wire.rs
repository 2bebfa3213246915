//! Fuzz target: any bytes as a multipart frame list, decoded as every wire message (domain.md §6.2,
//! `src/pure/wire/README.md`). Panics, aborts, hangs and out-of-memory are the findings; so is a decoded message that
//! does not survive `decode(encode(x)) == x`, or an error that names a frame past the end. Every crash found is
//! kept, as its frame list, in `tests/it/wire.rs::FUZZ_CRASHES`.
//!
//! The first byte picks the mode:
//! - bit 7 set: structure-aware. The rest of the byte picks a golden message (`kvrelay::wire::golden`) and every
//!   following 4 bytes `[op, frame, position, value]` edit its frames (truncate, flip, set, insert, drop,
//!   duplicate, cut the list), so the fuzzer starts past the guard and the frame counts.
//! - otherwise: raw. Bit 0 set prepends the guard; the rest is frames, each a length byte (255: a u16le length
//!   follows) and that many bytes (the last frame takes what is left).

#![no_main]

use kvrelay::wire::{self, golden, PrefillInfo, Registration, RequestMeta, Status, WireError};
use libfuzzer_sys::fuzz_target;

fn goldens() -> Vec<Vec<Vec<u8>>> {
    vec![
        golden::registration().encode(),
        golden::legacy_registration().encode(),
        golden::request_meta().encode(),
        golden::dummy_request_meta().encode(),
        golden::success_status().encode(),
        golden::failed_status().encode(),
        golden::prefill_info().encode(),
    ]
}

/// Applies one `[op, frame, position, value]` edit.
fn edit(frames: &mut Vec<Vec<u8>>, op: &[u8]) {
    let [op, frame, position, value] = [op[0], op[1], op[2], op[3]];
    if frames.is_empty() {
        frames.push(Vec::new());
    }
    let index = usize::from(frame) % frames.len();
    let bytes = &mut frames[index];
    let at = if bytes.is_empty() { 0 } else { usize::from(position) % bytes.len() };
    match op % 8 {
        0 => bytes.truncate(usize::from(position)),
        1 if !bytes.is_empty() => bytes[at] ^= 1 << (value % 8),
        2 if !bytes.is_empty() => bytes[at] = value,
        3 => bytes.insert(at, value),
        4 => {
            frames.remove(index);
        }
        5 => {
            let copy = frames[index].clone();
            frames.insert(index, copy);
        }
        6 => frames.truncate(usize::from(frame) % 20),
        _ => bytes.extend(std::iter::repeat_n(value, usize::from(position))),
    }
}

fn structured(pick: u8, program: &[u8]) -> Vec<Vec<u8>> {
    let all = goldens();
    let mut frames = all[usize::from(pick) % all.len()].clone();
    for op in program.chunks_exact(4) {
        edit(&mut frames, op);
    }
    frames
}

fn raw(guard: bool, mut data: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    if guard {
        frames.push(wire::GUARD.to_vec());
    }
    while let Some((&first, rest)) = data.split_first() {
        let (length, rest) = match (first, rest) {
            (255, [low, high, rest @ ..]) => (usize::from(u16::from_le_bytes([*low, *high])), rest),
            (255, rest) => (rest.len(), rest),
            (length, rest) => (usize::from(length), rest),
        };
        let length = length.min(rest.len());
        frames.push(rest[..length].to_vec());
        data = &rest[length..];
    }
    frames
}

/// Decodes as `T`. An accepted message must encode to frames that decode to itself; an error must name a frame
/// that exists (or the first missing one) and start with the message's name.
fn check<T: PartialEq + std::fmt::Debug>(
    frames: &[Vec<u8>],
    decode: fn(&[Vec<u8>]) -> Result<T, WireError>,
    encode: fn(&T) -> Vec<Vec<u8>>,
) {
    match decode(frames) {
        Ok(value) => assert_eq!(decode(&encode(&value)).as_ref(), Ok(&value), "round trip of {frames:?}"),
        Err(error) => {
            assert!(error.frame <= frames.len(), "{error} names a frame past the first missing one");
            assert!(error.to_string().starts_with(&error.message.to_string()), "{error} does not name its message");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let frames = match data.split_first() {
        Some((&mode, program)) if mode & 0x80 != 0 => structured(mode & 0x7f, program),
        Some((&mode, rest)) => raw(mode & 1 == 1, rest),
        None => Vec::new(),
    };
    check(&frames, Registration::decode, Registration::encode);
    check(&frames, RequestMeta::decode, RequestMeta::encode);
    check(&frames, Status::decode, Status::encode);
    check(&frames, PrefillInfo::decode, PrefillInfo::encode);
});
