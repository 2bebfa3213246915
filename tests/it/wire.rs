//! The wire messages (domain.md §6.2, `src/pure/wire/README.md`): golden byte vectors, legacy defaults, the KvPoll
//! rule, one named case per class of malformed input, round trips of arbitrary valid messages, and arbitrary or
//! damaged frame lists that must never panic.

use kvrelay::limits::{MAX_FRAME_BYTES, MAX_LIST_ITEMS, MAX_PACKED_LISTS, MAX_RANKS, MAX_REASON_BYTES, MAX_TP};
use kvrelay::wire::{
    golden, pack_int_list, pack_int_lists, unpack_int_list, unpack_int_lists, DcpFields, EngineDesc, KvPoll,
    MemoryDesc, MessageKind, PrefillInfo, Registration, RequestMeta, Status, WireError, WireReason, GUARD,
};
use proptest::prelude::*;
use rstest::rstest;

type Frames = Vec<Vec<u8>>;

/// Bytes from hex digits, spaces ignored.
fn hex(digits: &str) -> Vec<u8> {
    let digits: Vec<u8> = digits.bytes().filter(|byte| !byte.is_ascii_whitespace()).collect();
    digits.chunks(2).map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap()).collect()
}

/// The spec's rendering of a message: one line per frame, 4-byte groups, 8 groups a line, printable ASCII quoted.
fn hex_dump(frames: &[Vec<u8>]) -> String {
    frames.iter().enumerate().map(|(index, frame)| dump_frame(index, frame)).collect()
}

fn dump_frame(index: usize, frame: &[u8]) -> String {
    let groups: Vec<String> =
        frame.chunks(4).map(|chunk| chunk.iter().map(|byte| format!("{byte:02x}")).collect()).collect();
    let lines: Vec<String> = groups.chunks(8).map(|line| line.join(" ")).collect();
    let mut out = format!("{index:>2}  {}", if lines.is_empty() { "(empty)".to_owned() } else { lines.join("\n    ") });
    if !frame.is_empty() && frame.iter().all(|byte| *byte == b' ' || byte.is_ascii_graphic()) {
        out.push_str(&format!("  \"{}\"", String::from_utf8_lossy(frame)));
    }
    out.push('\n');
    out
}

fn spec() -> &'static str {
    include_str!("../../src/pure/wire/README.md")
}

/// A value of any message type, so one test body covers all four.
#[derive(Debug, Clone, PartialEq)]
enum Message {
    Registration(Box<Registration>),
    RequestMeta(RequestMeta),
    Status(Status),
    PrefillInfo(PrefillInfo),
}

impl Message {
    fn encode(&self) -> Frames {
        match self {
            Self::Registration(value) => value.encode(),
            Self::RequestMeta(value) => value.encode(),
            Self::Status(value) => value.encode(),
            Self::PrefillInfo(value) => value.encode(),
        }
    }

    fn decode(kind: MessageKind, frames: &[Vec<u8>]) -> Result<Self, WireError> {
        Ok(match kind {
            MessageKind::Registration => Self::Registration(Box::new(Registration::decode(frames)?)),
            MessageKind::RequestMeta => Self::RequestMeta(RequestMeta::decode(frames)?),
            MessageKind::Status => Self::Status(Status::decode(frames)?),
            MessageKind::PrefillInfo => Self::PrefillInfo(PrefillInfo::decode(frames)?),
        })
    }

    fn kind(&self) -> MessageKind {
        match self {
            Self::Registration(_) => MessageKind::Registration,
            Self::RequestMeta(_) => MessageKind::RequestMeta,
            Self::Status(_) => MessageKind::Status,
            Self::PrefillInfo(_) => MessageKind::PrefillInfo,
        }
    }
}

const KINDS: [MessageKind; 4] =
    [MessageKind::Registration, MessageKind::RequestMeta, MessageKind::Status, MessageKind::PrefillInfo];

/// Decodes `frames` as every message type: every accepted one must re-encode to frames that decode to itself, and
/// every error must name a frame that exists (or the first missing one).
#[track_caller]
fn decode_all(frames: &[Vec<u8>]) {
    for kind in KINDS {
        match Message::decode(kind, frames) {
            Ok(value) => assert_eq!(Message::decode(kind, &value.encode()), Ok(value), "round trip of {frames:?}"),
            Err(error) => assert!(error.frame <= frames.len(), "{error}: past the end of {frames:?}"),
        }
    }
}

// ---- golden vectors ----

/// domain.md §6.2's example, read byte by byte: `01000000` is n = 1 list, `08000000` its 8 bytes, then the two u32
/// values 17 = 0x11 (`11000000`) and 23 = 0x17 (`17000000`). Those 16 bytes are the whole encoding: the last
/// group is the 23, not a repeated 17, so the example in §6.2 is complete and correct.
#[test]
fn pack_int_lists_matches_the_spec_example() {
    let bytes = pack_int_lists::<u32>(&[vec![17, 23]]);
    assert_eq!(bytes, hex("01000000 08000000 11000000 17000000"));
    assert_eq!(unpack_int_lists::<u32>(&bytes), Ok(vec![vec![17, 23]]));
}

/// Upstream's `pack_list_of_buffers` writes nothing at all for no lists; an explicit zero count also means none.
#[test]
fn pack_int_lists_of_nothing_is_the_empty_frame() {
    assert_eq!(pack_int_lists::<u32>(&[]), Vec::<u8>::new());
    assert_eq!(unpack_int_lists::<u32>(&[]), Ok(vec![]));
    assert_eq!(unpack_int_lists::<u32>(&hex("00000000")), Ok(vec![]));
    assert_eq!(pack_int_lists::<u32>(&[vec![]]), hex("01000000 00000000"));
}

/// The other two formats: "i" is two's complement, "Q" is 8 bytes per value.
#[test]
fn pack_int_lists_signed_and_wide_formats() {
    assert_eq!(pack_int_lists::<i32>(&[vec![-1], vec![2]]), hex("02000000 04000000 04000000 ffffffff 02000000"));
    assert_eq!(pack_int_lists::<u64>(&[vec![1 << 32]]), hex("01000000 08000000 00000000 01000000"));
    assert_eq!(pack_int_list::<u32>(&[17, 23]), hex("11000000 17000000"));
}

/// The registration's memory desc and engine desc layouts, byte by byte (README.md "Frames 4-7").
#[test]
fn descriptor_layouts_are_pinned() {
    let engine = EngineDesc { key: "k".into(), gpu_id: 3, host: "h".into(), port: 0x1234, address: Vec::new() };
    assert_eq!(engine.pack(), hex("03000000 3412 0100 6b 0100 68"));
    let registration =
        Registration { kv_descs: vec![MemoryDesc { address: 1, length_bytes: 2, rkey: 3 }], ..golden::registration() };
    assert_eq!(registration.encode()[5], hex("01000000 00000000 02000000 00000000 03000000"));
}

fn goldens() -> Vec<(&'static str, Message)> {
    vec![
        ("registration", Message::Registration(Box::new(golden::registration()))),
        ("legacy registration", Message::Registration(Box::new(golden::legacy_registration()))),
        ("request metadata", Message::RequestMeta(golden::request_meta())),
        ("dummy request metadata", Message::RequestMeta(golden::dummy_request_meta())),
        ("success status", Message::Status(golden::success_status())),
        ("failed status", Message::Status(golden::failed_status())),
        ("prefill info", Message::PrefillInfo(golden::prefill_info())),
    ]
}

/// README.md is the spec: each golden message's exact bytes appear there, so changing an encoding without the
/// spec (or the spec without the code) fails here, and decoding those bytes gives the value back.
#[test]
fn golden_vectors_match_the_spec() {
    for (name, message) in goldens() {
        let frames = message.encode();
        let dump = hex_dump(&frames);
        assert!(
            spec().contains(&format!("```text\n{dump}```")),
            "src/pure/wire/README.md lacks the golden vector of the {name}; the encoder writes\n```text\n{dump}```"
        );
        assert_eq!(Message::decode(message.kind(), &frames), Ok(message), "{name}");
    }
}

// ---- registration layouts and defaults ----

/// A 13-field registration (PR #37358's legacy test) decodes with DCP 1, rank 0 and no layer ids.
#[test]
fn legacy_registration_decodes_with_defaults() {
    let frames = golden::legacy_registration().encode();
    assert_eq!(frames.len(), 14);
    let registration = Registration::decode(&frames).unwrap();
    assert!(registration.is_legacy());
    assert_eq!((registration.dcp_size(), registration.dcp_rank()), (1, 0));
    assert_eq!(registration.kv_layer_ids(), None);
    assert!(registration.state_layer_ids().is_empty());
}

/// The four new frames present but empty mean the same defaults; the peer is not legacy, it just sends nothing.
#[test]
fn empty_dcp_frames_decode_with_defaults() {
    let mut frames = golden::legacy_registration().encode();
    frames.extend([Vec::new(), Vec::new(), Vec::new(), Vec::new()]);
    let registration = Registration::decode(&frames).unwrap();
    assert_eq!(registration.dcp, Some(DcpFields::default()));
    assert_eq!((registration.dcp_size(), registration.dcp_rank()), (1, 0));
    assert_eq!(registration.kv_layer_ids(), None);
    assert!(!registration.is_legacy());
}

/// A message that stops after frame 14 or 15 keeps the defaults for the rest (upstream reads each frame only
/// when present).
#[rstest]
#[case::size_only(15, DcpFields { dcp_size: 8, dcp_rank: 0, state_layer_ids: vec![], kv_layer_ids: vec![] })]
#[case::size_and_rank(16, DcpFields { dcp_size: 8, dcp_rank: 3, state_layer_ids: vec![], kv_layer_ids: vec![] })]
#[case::without_kv_layer_ids(17, DcpFields { kv_layer_ids: vec![], ..golden::registration().dcp.unwrap() })]
fn partial_dcp_frames_keep_defaults(#[case] frames: usize, #[case] expected: DcpFields) {
    let mut encoded = golden::registration().encode();
    encoded.truncate(frames);
    assert_eq!(Registration::decode(&encoded).unwrap().dcp, Some(expected));
}

#[test]
fn registration_accessors_read_the_dcp_fields() {
    let registration = golden::registration();
    assert_eq!((registration.dcp_size(), registration.dcp_rank()), (8, 3));
    assert_eq!(registration.kv_layer_ids(), Some(&[17, 23][..]));
    assert_eq!(registration.state_layer_ids(), &[vec![19]]);
}

// ---- request metadata and status semantics ----

#[rstest]
#[case::golden(golden::request_meta(), false)]
#[case::dummy(golden::dummy_request_meta(), true)]
#[case::prefix_only(RequestMeta { decode_prefix_len: 64, ..golden::dummy_request_meta() }, false)]
#[case::aux_only(RequestMeta { aux_index: Some(0), ..golden::dummy_request_meta() }, false)]
fn is_dummy_needs_no_pages_no_aux_and_no_prefix(#[case] meta: RequestMeta, #[case] dummy: bool) {
    assert_eq!(meta.is_dummy(), dummy);
}

/// Upstream writes an absent aux row as -1 in some versions and as an empty frame in others; both mean none.
#[test]
fn aux_index_minus_one_means_none() {
    let mut frames = golden::request_meta().encode();
    frames[6] = b"-1".to_vec();
    assert_eq!(RequestMeta::decode(&frames).unwrap().aux_index, None);
}

/// A HiSparse decode's logical pages ride in frame 10 (SGLang Mooncake's metadata `msg[9]`), sent only when there are
/// some: without them the message keeps its 10 frames, and an empty frame 10 decodes to none.
#[test]
fn device_kv_indices_ride_in_frame_10_only_when_present() {
    assert_eq!(golden::request_meta().encode().len(), 10);
    let hisparse = RequestMeta { device_kv_indices: vec![3, 8, 4, 1], ..golden::request_meta() };
    let frames = hisparse.encode();
    assert_eq!(frames.len(), 11);
    assert_eq!(frames[10], hex("03000000 08000000 04000000 01000000"));
    assert_eq!(RequestMeta::decode(&frames), Ok(hisparse));
    let mut empty = golden::request_meta().encode();
    empty.push(Vec::new());
    assert_eq!(RequestMeta::decode(&empty), Ok(golden::request_meta()));
}

/// The staging ring rides in registration frame 20 (after frames 18 and 19, sent empty when they have nothing) and
/// each chunk's ring offset in metadata frame 11 (after frame 10, likewise): both only when there is a ring.
#[test]
fn staging_ring_and_offsets_ride_in_their_own_frames_only_with_staging() {
    let ring = MemoryDesc { address: 0x7d00_0000_0000, length_bytes: 0x40000, rkey: 0x41 };
    let registration = Registration { staging_descs: vec![ring], ..golden::registration() };
    let frames = registration.encode();
    assert_eq!(frames.len(), 21);
    assert!(frames[18].is_empty() && frames[19].is_empty());
    assert_eq!(Registration::decode(&frames), Ok(registration));
    assert_eq!(golden::registration().encode().len(), 18);
    let meta = RequestMeta { staging_offsets: vec![0, 65536], ..golden::request_meta() };
    let frames = meta.encode();
    assert_eq!(frames.len(), 12);
    assert!(frames[10].is_empty());
    assert_eq!(frames[11], hex("00000000 00000000 00000100 00000000"));
    assert_eq!(RequestMeta::decode(&frames), Ok(meta));
}

/// Upstream reads the reason only when the frame is there.
#[test]
fn status_without_reason_frame_decodes() {
    let mut frames = golden::success_status().encode();
    frames.pop();
    assert_eq!(Status::decode(&frames), Ok(golden::success_status()));
}

/// domain.md §6.1: max-monotone, except that Failed wins in both directions.
#[test]
fn kvpoll_update_is_max_monotone_and_failed_is_sticky() {
    for current in KvPoll::ALL {
        for new in KvPoll::ALL {
            let expected =
                if current == KvPoll::Failed || new == KvPoll::Failed { KvPoll::Failed } else { current.max(new) };
            assert_eq!(current.update(new), expected, "{current:?} then {new:?}");
        }
    }
    // The case upstream's mainline gets differently: a late Success does not revive a failed room.
    assert_eq!(KvPoll::Failed.update(KvPoll::Success), KvPoll::Failed);
    assert_eq!(KvPoll::Transferring.update(KvPoll::WaitingForInput), KvPoll::Transferring);
}

#[test]
fn kvpoll_codes_are_upstreams() {
    let codes: Vec<u8> = KvPoll::ALL.iter().map(|state| state.code()).collect();
    assert_eq!(codes, [0, 1, 2, 3, 4]);
    assert_eq!(KvPoll::from_code(5), None);
    assert!(KvPoll::ALL.iter().all(|state| KvPoll::from_code(state.code()) == Some(*state)));
}

// ---- malformed input: every class gives a typed error naming the frame ----

fn with(mut frames: Frames, index: usize, bytes: &[u8]) -> Frames {
    frames[index] = bytes.to_vec();
    frames
}

fn cut(mut frames: Frames, count: usize) -> Frames {
    frames.truncate(count);
    frames
}

fn plus(mut frames: Frames, extra: &[u8]) -> Frames {
    frames.push(extra.to_vec());
    frames
}

fn reg() -> Frames {
    golden::registration().encode()
}

fn meta() -> Frames {
    golden::request_meta().encode()
}

fn stat() -> Frames {
    golden::failed_status().encode()
}

fn info() -> Frames {
    golden::prefill_info().encode()
}

fn engine_bytes() -> Vec<u8> {
    golden::registration().engine.pack()
}

use MessageKind::{PrefillInfo as Info, Registration as Reg, RequestMeta as Meta, Status as Stat};
use WireReason::*;

#[rstest]
// The frame list.
#[case::empty_message(Reg, vec![], 0, "guard", Missing { frames: 0 })]
#[case::bad_guard(Reg, with(reg(), 0, b"MoriMsgGuarD"), 0, "guard", BadGuard)]
#[case::missing_frame(Reg, cut(reg(), 10), 10, "tp_rank", Missing { frames: 10 })]
#[case::missing_prefix_frame(Meta, cut(meta(), 9), 9, "decode_prefix_len", Missing { frames: 9 })]
#[case::too_many_registration_frames(Reg, plus(plus(plus(plus(reg(), b""), b""), b""), b""), 21, "after the last field", TooManyFrames { frames: 22, max: 21 })]
#[case::too_many_status_frames(Stat, plus(stat(), b"x"), 5, "after the last field", TooManyFrames { frames: 6, max: 5 })]
#[case::registration_room_not_none(Reg, with(reg(), 1, b"42"), 1, "room", Unexpected { expected: "None" })]
#[case::request_room_none(Meta, with(meta(), 1, b"None"), 1, "room", NotInteger { text: "None".into() })]
#[case::wrong_prefill_info_tag(Info, with(info(), 1, b"None"), 1, "tag", Unexpected { expected: "PrefillInfo" })]
#[case::frame_over_limit(Reg, with(reg(), 5, &vec![0; MAX_FRAME_BYTES as usize + 1]), 5, "kv_descs", TooLarge { what: "frame bytes", value: MAX_FRAME_BYTES + 1, limit: MAX_FRAME_BYTES })]
// Text.
#[case::ip_not_ascii(Reg, with(reg(), 2, "10.0.0.ü".as_bytes()), 2, "ip", NotAscii { offset: 7, byte: 0xc3 })]
#[case::ip_with_space(Meta, with(meta(), 2, b"10.0.0.2 "), 2, "ip", NotAscii { offset: 8, byte: b' ' })]
#[case::ip_empty(Reg, with(reg(), 2, b""), 2, "ip", Empty)]
#[case::engine_key_too_long(Meta, with(meta(), 4, &[b'k'; 256]), 4, "engine_key", TooLarge { what: "text bytes", value: 256, limit: 255 })]
#[case::reason_not_utf8(Stat, with(stat(), 4, b"f\xff"), 4, "reason", NotUtf8 { offset: 1 })]
#[case::reason_too_long(Stat, with(stat(), 4, &vec![b'a'; MAX_REASON_BYTES + 1]), 4, "reason", TooLarge { what: "reason bytes", value: MAX_REASON_BYTES as u64 + 1, limit: MAX_REASON_BYTES as u64 })]
// ASCII integers.
#[case::port_not_integer(Reg, with(reg(), 3, b"17o00"), 3, "port", NotInteger { text: "17o00".into() })]
#[case::port_plus_sign(Meta, with(meta(), 3, b"+5000"), 3, "port", NotInteger { text: "+5000".into() })]
#[case::port_out_of_range(Reg, with(reg(), 3, b"70000"), 3, "port", OutOfRange { value: 70000, min: 1, max: 65535 })]
#[case::port_zero(Info, with(info(), 3, b"0"), 3, "port", OutOfRange { value: 0, min: 1, max: 65535 })]
#[case::integer_not_ascii(Reg, with(reg(), 8, "٣".as_bytes()), 8, "gpu_id", NotAscii { offset: 0, byte: 0xd9 })]
#[case::integer_text_too_long(Reg, with(reg(), 8, &[b'0'; 33]), 8, "gpu_id", TooLarge { what: "integer text bytes", value: 33, limit: 32 })]
#[case::negative_tp_size(Reg, with(reg(), 9, b"-1"), 9, "attn_tp_size", OutOfRange { value: -1, min: 1, max: MAX_TP.into() })]
#[case::dcp_rank_at_size(Reg, with(reg(), 15, b"8"), 15, "dcp_rank", OutOfRange { value: 8, min: 0, max: 7 })]
#[case::pp_rank_at_size(Info, with(info(), 9, b"8"), 9, "pp_rank", OutOfRange { value: 8, min: 0, max: 7 })]
#[case::required_dst_info_num_zero(Meta, with(meta(), 8, b"0"), 8, "required_dst_info_num", OutOfRange { value: 0, min: 1, max: MAX_RANKS.into() })]
#[case::aux_index_below_minus_one(Meta, with(meta(), 6, b"-2"), 6, "aux_index", OutOfRange { value: -2, min: -1, max: i32::MAX.into() })]
#[case::room_past_u64(Stat, with(stat(), 1, b"18446744073709551616"), 1, "room", OutOfRange { value: 1 << 64, min: 0, max: u64::MAX.into() })]
#[case::unknown_status_code(Stat, with(stat(), 2, b"5"), 2, "status", OutOfRange { value: 5, min: 0, max: 4 })]
// pack_int_lists.
#[case::int_lists_truncated(Reg, with(reg(), 12, &hex("01000000 08000000 11000000")), 12, "state_item_lens", Truncated { needed: 16, present: 12 })]
#[case::int_lists_count_over_limit(Reg, with(reg(), 12, &hex("ffffffff 00000000 00000000 00000000")), 12, "state_item_lens", TooLarge { what: "list count", value: u32::MAX.into(), limit: MAX_PACKED_LISTS })]
#[case::int_lists_header_past_frame(Reg, with(reg(), 13, &hex("10000000 00000000")), 13, "state_dims", Truncated { needed: 68, present: 8 })]
#[case::int_lists_length_past_frame(Reg, with(reg(), 16, &hex("01000000 fcffffff 00000000")), 16, "state_layer_ids", Truncated { needed: 8 + 0xffff_fffc, present: 12 })]
#[case::int_lists_misaligned(Reg, with(reg(), 12, &hex("01000000 03000000 aabbcc")), 12, "state_item_lens", Misaligned { list: 0, bytes: 3, width: 4 })]
#[case::int_lists_trailing_bytes(Reg, with(reg(), 12, &hex("01000000 04000000 11000000 ff")), 12, "state_item_lens", TrailingBytes { extra: 1 })]
#[case::int_lists_header_cut(Meta, with(meta(), 7, &hex("0100")), 7, "state_indices", Truncated { needed: 4, present: 2 })]
// Raw lists and indices.
#[case::kv_layer_ids_misaligned(Reg, with(reg(), 17, &[0; 7]), 17, "kv_layer_ids", Misaligned { list: 0, bytes: 7, width: 4 })]
#[case::negative_kv_index(Meta, with(meta(), 5, &pack_int_list::<i32>(&[5, -3])), 5, "kv_indices", NegativeIndex { list: 0, item: 1, value: -3 })]
#[case::negative_state_index(Meta, with(meta(), 7, &pack_int_lists::<i32>(&[vec![1], vec![2, -1]])), 7, "state_indices", NegativeIndex { list: 1, item: 1, value: -1 })]
// Descriptors.
#[case::memory_descs_misaligned(Reg, with(reg(), 5, &[0; 19]), 5, "kv_descs", Misaligned { list: 0, bytes: 19, width: 20 })]
#[case::memory_desc_wraps(Reg, with(reg(), 6, &hex("ffffffff ffffffff 01000000 00000000 00000000")), 6, "aux_descs", Wraps { list: 0, item: 0 })]
#[case::state_component_misaligned(Reg, with(reg(), 7, &[hex("02000000 14000000 15000000"), vec![0; 41]].concat()), 7, "state_descs", Misaligned { list: 1, bytes: 21, width: 20 })]
#[case::engine_desc_truncated(Reg, with(reg(), 4, &engine_bytes()[..7]), 4, "engine", Truncated { needed: 8, present: 7 })]
#[case::engine_desc_trailing_bytes(Reg, with(reg(), 4, &[engine_bytes(), hex("01000000 61 00")].concat()), 4, "engine", TrailingBytes { extra: 1 })]
#[case::engine_desc_address_truncated(Reg, with(reg(), 4, &[engine_bytes(), hex("05000000 61")].concat()), 4, "engine", Truncated { needed: engine_bytes().len() as u64 + 9, present: engine_bytes().len() + 5 })]
#[case::engine_desc_address_empty(Reg, with(reg(), 4, &[engine_bytes(), hex("00000000")].concat()), 4, "engine", OutOfRange { value: 0, min: 1, max: 1 << 20 })]
#[case::engine_gpu_out_of_range(Reg, with(reg(), 4, &[hex("88130000"), engine_bytes()[4..].to_vec()].concat()), 4, "engine", OutOfRange { value: 5000, min: 0, max: 1023 })]
#[case::engine_key_not_ascii(Reg, with(reg(), 4, &hex("03000000 0100 0100 00 0100 68")), 4, "engine", NotAscii { offset: 0, byte: 0 })]
fn malformed_input_names_the_frame(
    #[case] message: MessageKind,
    #[case] frames: Frames,
    #[case] frame: usize,
    #[case] field: &'static str,
    #[case] kind: WireReason,
) {
    let expected = WireError { message, frame, field, reason: kind };
    assert_eq!(expected.kind(), expected.reason.kind());
    assert_eq!(Message::decode(message, &frames).unwrap_err(), expected);
}

/// The error text says the message, the frame and the field first, then why.
#[test]
fn wire_error_text_names_message_frame_and_field() {
    let error = Registration::decode(&with(reg(), 15, b"8")).unwrap_err();
    assert_eq!(error.to_string(), "registration frame 15 (dcp_rank): 8 is outside 0..=7");
}

/// "n lists claiming 2^32 entries in a 16-byte frame" is refused from the header alone, and so is a single list
/// over the item limit, before anything is allocated for it.
#[test]
fn declared_sizes_are_checked_before_allocation() {
    let claim = hex("ffffffff ffffffff ffffffff ffffffff");
    assert!(matches!(unpack_int_lists::<u64>(&claim), Err(TooLarge { what: "list count", .. })));
    let one_too_many = vec![0; (MAX_LIST_ITEMS as usize + 1) * 4];
    let expected = TooLarge { what: "items in one list", value: MAX_LIST_ITEMS + 1, limit: MAX_LIST_ITEMS };
    assert_eq!(unpack_int_list::<u32>(&one_too_many), Err(expected));
}

// ---- fuzz regressions ----

/// Every input the `wire` fuzz target (tests/fuzz/fuzz_targets/wire.rs) has failed on, as the frame list it
/// decoded (one hex string per frame; the target's header explains how its input bytes become frames).
/// Empty so far: two 300-second campaigns and a `ci/fuzz.sh` run (8.5 million executions in all) found no crash.
const FUZZ_CRASHES: &[&[&str]] = &[];

#[test]
fn fuzz_crashes_stay_fixed() {
    for frames in FUZZ_CRASHES {
        decode_all(&frames.iter().map(|frame| hex(frame)).collect::<Frames>());
    }
}

// ---- properties ----

fn text() -> impl Strategy<Value = String> {
    "[!-~]{1,24}"
}

fn port() -> impl Strategy<Value = u16> {
    1..=u16::MAX
}

fn index() -> impl Strategy<Value = u32> {
    0..=i32::MAX as u32
}

fn lists<T: Strategy>(item: T) -> impl Strategy<Value = Vec<Vec<T::Value>>> {
    prop::collection::vec(prop::collection::vec(item, 0..4), 0..4)
}

fn memory_desc() -> impl Strategy<Value = MemoryDesc> {
    // Halves of two u64s never sum past 2^64.
    (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(address, length, rkey)| MemoryDesc {
        address: address / 2,
        length_bytes: length / 2,
        rkey,
    })
}

fn engine() -> impl Strategy<Value = EngineDesc> {
    (text(), 0..=1023_u32, text(), port()).prop_map(|(key, gpu_id, host, port)| EngineDesc {
        key,
        gpu_id,
        host,
        port,
        address: Vec::new(),
    })
}

fn dcp_fields() -> impl Strategy<Value = DcpFields> {
    (1..=MAX_TP).prop_flat_map(|dcp_size| {
        (0..dcp_size, lists(any::<u32>()), prop::collection::vec(any::<u32>(), 0..6)).prop_map(
            move |(dcp_rank, state_layer_ids, kv_layer_ids)| DcpFields {
                dcp_size,
                dcp_rank,
                state_layer_ids,
                kv_layer_ids,
            },
        )
    })
}

fn registration() -> impl Strategy<Value = Registration> {
    let descs = (
        engine(),
        prop::collection::vec(memory_desc(), 0..4),
        prop::collection::vec(memory_desc(), 0..3),
        lists(memory_desc()),
        prop::collection::vec(memory_desc(), 0..2),
    );
    let numbers = (0..=1023_u32, 1..=MAX_TP, 0..MAX_RANKS, 0..=1_u64 << 32);
    let item_lens = prop::collection::vec(0..=1_u64 << 32, 0..4);
    let tail =
        (lists(any::<u32>()), lists(any::<u32>()), prop::option::of(dcp_fields()), item_lens, lists(any::<u32>()));
    (text(), port(), descs, numbers, tail).prop_map(
        |(ip, port, descs, numbers, (state_item_lens, state_dims, dcp, item_lens, outers))| Registration {
            ip,
            port,
            engine: descs.0,
            kv_descs: descs.1,
            aux_descs: descs.2,
            state_descs: descs.3,
            gpu_id: numbers.0,
            attn_tp_size: numbers.1,
            tp_rank: numbers.2,
            kv_item_len: numbers.3,
            state_item_lens,
            state_dims,
            // kvrelay's per-entry lengths ride after PR #37358's frames, so only with them.
            kv_item_lens: if dcp.is_some() { item_lens } else { Vec::new() },
            state_outer_counts: if dcp.is_some() { outers } else { Vec::new() },
            staging_descs: if dcp.is_some() { descs.4 } else { Vec::new() },
            dcp,
        },
    )
}

fn request_meta() -> impl Strategy<Value = RequestMeta> {
    let indices = (
        prop::collection::vec(index(), 0..8),
        prop::option::of(index()),
        lists(index()),
        prop::collection::vec(index(), 0..4),
        prop::collection::vec(any::<u64>(), 0..3),
    );
    (any::<u64>(), text(), port(), text(), indices, 1..=MAX_RANKS, any::<u32>()).prop_map(
        |(room, ip, port, engine_key, indices, required_dst_info_num, decode_prefix_len)| RequestMeta {
            room,
            ip,
            port,
            engine_key,
            kv_indices: indices.0,
            aux_index: indices.1,
            state_indices: indices.2,
            required_dst_info_num,
            decode_prefix_len,
            device_kv_indices: indices.3,
            staging_offsets: indices.4,
        },
    )
}

fn any_status() -> impl Strategy<Value = Status> {
    (any::<u64>(), prop::sample::select(KvPoll::ALL.to_vec()), any::<u32>(), ".{0,24}")
        .prop_map(|(room, status, prefill_unique_rank, reason)| Status { room, status, prefill_unique_rank, reason })
}

fn size_and_rank(max: u32) -> impl Strategy<Value = (u32, u32)> {
    (1..=max).prop_flat_map(|size| (Just(size), 0..size))
}

fn prefill_info() -> impl Strategy<Value = PrefillInfo> {
    let sizes = (
        size_and_rank(MAX_TP),
        size_and_rank(MAX_TP),
        size_and_rank(256),
        size_and_rank(MAX_TP),
        size_and_rank(MAX_TP),
    );
    (text(), port(), sizes, 1..=65536_u32, text()).prop_map(|(ip, port, sizes, page_size, kv_cache_dtype)| {
        PrefillInfo {
            ip,
            port,
            attn_tp_size: sizes.0 .0,
            attn_tp_rank: sizes.0 .1,
            dcp_size: sizes.1 .0,
            dcp_rank: sizes.1 .1,
            pp_size: sizes.2 .0,
            pp_rank: sizes.2 .1,
            page_size,
            kv_cache_dtype,
            attn_dp_size: sizes.3 .0,
            attn_dp_rank: sizes.3 .1,
            attn_cp_size: sizes.4 .0,
            attn_cp_rank: sizes.4 .1,
        }
    })
}

fn any_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        registration().prop_map(|it| Message::Registration(Box::new(it))),
        request_meta().prop_map(Message::RequestMeta),
        any_status().prop_map(Message::Status),
        prefill_info().prop_map(Message::PrefillInfo),
    ]
}

/// One damage to a valid frame list: cut the list, cut a frame, flip a bit, insert a byte or drop a frame.
fn damage(frames: &mut Frames, (op, frame, position, bit): (u8, usize, usize, u8)) {
    if frames.is_empty() {
        return;
    }
    let index = frame % frames.len();
    let bytes = &mut frames[index];
    let at = if bytes.is_empty() { 0 } else { position % bytes.len() };
    match op % 5 {
        0 => frames.truncate(frame % (frames.len() + 1)),
        1 => bytes.truncate(at),
        2 if !bytes.is_empty() => bytes[at] ^= 1 << (bit % 8),
        3 => bytes.insert(at, bit),
        _ => {
            frames.remove(index);
        }
    }
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|it| it.parse().ok()).unwrap_or(256);
    ProptestConfig { cases, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// Every valid message survives encode then decode unchanged.
    #[test]
    fn every_valid_message_round_trips(message in any_message()) {
        prop_assert_eq!(Message::decode(message.kind(), &message.encode()), Ok(message));
    }

    /// Encodings are canonical: re-encoding a decoded message gives the same frames.
    #[test]
    fn encodings_are_canonical(message in any_message()) {
        let frames = message.encode();
        prop_assert_eq!(Message::decode(message.kind(), &frames).unwrap().encode(), frames);
    }

    /// Arbitrary frame lists, with or without the guard, never panic and never decode to a message that does not
    /// round-trip.
    #[test]
    fn arbitrary_frames_never_panic(
        guard in any::<bool>(),
        frames in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..48), 0..22),
    ) {
        let frames: Frames = if guard { std::iter::once(GUARD.to_vec()).chain(frames).collect() } else { frames };
        decode_all(&frames);
    }

    /// Truncations, bit flips, inserted bytes and dropped frames of valid messages never panic either.
    #[test]
    fn damaged_messages_never_panic(
        message in any_message(),
        damages in prop::collection::vec((any::<u8>(), any::<usize>(), any::<usize>(), any::<u8>()), 1..4),
    ) {
        let mut frames = message.encode();
        for one in damages {
            damage(&mut frames, one);
        }
        decode_all(&frames);
    }

    /// `pack_int_lists` round-trips in all three formats.
    #[test]
    fn int_lists_round_trip(
        unsigned in lists(any::<u32>()),
        signed in lists(any::<i32>()),
        wide in lists(any::<u64>()),
    ) {
        prop_assert_eq!(unpack_int_lists::<u32>(&pack_int_lists(&unsigned)), Ok(unsigned));
        prop_assert_eq!(unpack_int_lists::<i32>(&pack_int_lists(&signed)), Ok(signed));
        prop_assert_eq!(unpack_int_lists::<u64>(&pack_int_lists(&wide)), Ok(wide));
    }
}
