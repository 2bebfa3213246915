//! `WireError`: every reason a frame list is not a message, naming the message, the frame index and the field.

use std::fmt;

/// The message a decoder was reading (domain.md §6.1, §6.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MessageKind {
    /// Decode → prefill, once per connection, room `"None"` ([`super::Registration`]).
    Registration,
    /// Decode → prefill, once per request and target rank ([`super::RequestMeta`]).
    RequestMeta,
    /// Prefill → decode, once per request and decode endpoint ([`super::Status`]).
    Status,
    /// Prefill rank → bootstrap or peer engine ([`super::PrefillInfo`]).
    PrefillInfo,
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Registration => "registration",
            Self::RequestMeta => "request metadata",
            Self::Status => "status",
            Self::PrefillInfo => "prefill info",
        })
    }
}

/// A frame list that is not a valid message: which message, which frame (its index in the multipart message, the
/// guard being frame 0), which field, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} frame {frame} ({field}): {kind}")]
pub struct WireError {
    pub message: MessageKind,
    /// Index in the multipart message; the guard is frame 0, so §6.2's field `idx k` is frame `k + 1`.
    pub frame: usize,
    /// The field's name as `src/wire/README.md` spells it (the Rust field name).
    pub field: &'static str,
    pub kind: WireErrorKind,
}

/// Why one frame (or the frame list) is malformed. Positions (`offset`, `list`, `item`) count from 0 inside the
/// frame; `list` is 0 for a frame that holds a single list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireErrorKind {
    /// The message ends before this frame.
    #[error("missing: the message has only {frames} frames")]
    Missing { frames: usize },
    /// More frames than the message's layout has.
    #[error("{frames} frames, the layout has at most {max}")]
    TooManyFrames { frames: usize, max: usize },
    /// Frame 0 is not `MoriMsgGuard`.
    #[error("the first frame must be the guard \"MoriMsgGuard\"")]
    BadGuard,
    /// A frame with one fixed value holds another (the registration's room is `"None"`).
    #[error("must be {expected:?}")]
    Unexpected { expected: &'static str },
    /// The frame ends before a length or count it declares.
    #[error("truncated: needs {needed} bytes, the frame has {present}")]
    Truncated { needed: u64, present: usize },
    /// Bytes after the last declared item.
    #[error("{extra} bytes after the last item")]
    TrailingBytes { extra: usize },
    /// A list whose byte length is not a whole number of items.
    #[error("list {list} has {bytes} bytes, not a multiple of the {width}-byte item")]
    Misaligned { list: usize, bytes: u64, width: usize },
    /// A length or count above a limit of `src/limits.rs`.
    #[error("{what} {value} is more than the limit of {limit}")]
    TooLarge { what: &'static str, value: u64, limit: u64 },
    /// A text field that must not be empty.
    #[error("empty, a value is required")]
    Empty,
    /// A byte that an ASCII field may not hold (non-ASCII anywhere; space or control in text).
    #[error("byte {byte:#04x} at offset {offset} is not printable ASCII")]
    NotAscii { offset: usize, byte: u8 },
    /// A UTF-8 field that is not UTF-8 from `offset` on.
    #[error("not UTF-8 from offset {offset}")]
    NotUtf8 { offset: usize },
    /// ASCII that is not `-?[0-9]+`.
    #[error("{text:?} is not a decimal integer")]
    NotInteger { text: String },
    /// An integer outside the field's range (a rank at or above its size, a port 0, an unknown status code).
    #[error("{value} is outside {min}..={max}")]
    OutOfRange { value: i128, min: i128, max: i128 },
    /// A page or slot index below 0 in an int32 list.
    #[error("list {list} item {item} is {value}, an index is never negative")]
    NegativeIndex { list: usize, item: usize, value: i32 },
    /// A memory desc whose address plus length passes 2^64.
    #[error("list {list} memory desc {item}: address + length wraps past 2^64")]
    Wraps { list: usize, item: usize },
}
