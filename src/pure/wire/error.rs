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
#[error("{message} frame {frame} ({field}): {reason}")]
pub struct WireError {
    pub message: MessageKind,
    /// Index in the multipart message; the guard is frame 0, so §6.2's field `idx k` is frame `k + 1`.
    pub frame: usize,
    /// The field's name as `src/pure/wire/README.md` spells it (the Rust field name).
    pub field: &'static str,
    pub reason: WireReason,
}

impl WireError {
    /// The reason's kind (stable across rewording).
    pub fn kind(&self) -> WireErrorKind {
        self.reason.kind()
    }
}

error_kinds! {
    /// The kind of a [`WireError`]: one per [`WireReason`] variant.
    pub enum WireErrorKind {
        /// The message ends before a frame it needs.
        Missing = "missing",
        /// More frames than the message's layout has.
        TooManyFrames = "too_many_frames",
        /// Frame 0 is not the guard.
        BadGuard = "bad_guard",
        /// A fixed-value frame holds another value.
        Unexpected = "unexpected",
        /// A frame ends before a length or count it declares.
        Truncated = "truncated",
        /// Bytes after the last declared item.
        TrailingBytes = "trailing_bytes",
        /// A list that is not a whole number of items.
        Misaligned = "misaligned",
        /// A length or count above a limit.
        TooLarge = "too_large",
        /// An empty text field that needs a value.
        Empty = "empty",
        /// A byte an ASCII field may not hold.
        NotAscii = "not_ascii",
        /// A UTF-8 field that is not UTF-8.
        NotUtf8 = "not_utf8",
        /// ASCII that is not a decimal integer.
        NotInteger = "not_integer",
        /// An integer outside the field's range.
        OutOfRange = "out_of_range",
        /// A negative page or slot index.
        NegativeIndex = "negative_index",
        /// A memory desc whose end wraps past 2^64.
        Wraps = "wraps",
    }
}

/// Why one frame (or the frame list) is malformed. Positions (`offset`, `list`, `item`) count from 0 inside the
/// frame; `list` is 0 for a frame that holds a single list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireReason {
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
    /// A length or count above a limit of `src/pure/limits.rs`.
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

impl WireReason {
    /// This reason's [`WireErrorKind`].
    pub fn kind(&self) -> WireErrorKind {
        use WireErrorKind as K;
        match self {
            WireReason::Missing { .. } => K::Missing,
            WireReason::TooManyFrames { .. } => K::TooManyFrames,
            WireReason::BadGuard => K::BadGuard,
            WireReason::Unexpected { .. } => K::Unexpected,
            WireReason::Truncated { .. } => K::Truncated,
            WireReason::TrailingBytes { .. } => K::TrailingBytes,
            WireReason::Misaligned { .. } => K::Misaligned,
            WireReason::TooLarge { .. } => K::TooLarge,
            WireReason::Empty => K::Empty,
            WireReason::NotAscii { .. } => K::NotAscii,
            WireReason::NotUtf8 { .. } => K::NotUtf8,
            WireReason::NotInteger { .. } => K::NotInteger,
            WireReason::OutOfRange { .. } => K::OutOfRange,
            WireReason::NegativeIndex { .. } => K::NegativeIndex,
            WireReason::Wraps { .. } => K::Wraps,
        }
    }
}
