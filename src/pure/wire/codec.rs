//! Frame encodings every message shares (domain.md §6.2): ASCII integers and text, UTF-8 text, little-endian
//! integer lists, `pack_int_lists`, and the [`Reader`] that names the frame of every error.
//!
//! Every length or count read from a frame is checked against the bytes present and `src/pure/limits.rs` before
//! anything is allocated for it, so no input can make a decoder allocate more than a few times its own size.

use std::fmt::Display;
use std::ops::RangeInclusive;

use super::error::{MessageKind, WireError, WireReason};
use super::GUARD;
use crate::limits::{
    MAX_FRAME_BYTES, MAX_INT_TEXT_BYTES, MAX_LIST_ITEMS, MAX_PACKED_LISTS, MAX_REASON_BYTES, MAX_TEXT_BYTES,
};

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for i32 {}
    impl Sealed for u64 {}
}

/// An integer type of `pack_int_lists`: Python `struct` format "I" (`u32`), "i" (`i32`) or "Q" (`u64`), always
/// little-endian.
pub trait WireInt: Copy + sealed::Sealed {
    /// The `struct` format character upstream passes to `pack_int_lists`.
    const FORMAT: char;
    /// Bytes per value.
    const WIDTH: usize;
    /// Appends the little-endian bytes of `self`.
    fn put(self, out: &mut Vec<u8>);
    /// Reads one value from exactly [`Self::WIDTH`] bytes (callers slice with `chunks_exact`).
    fn get(chunk: &[u8]) -> Self;
}

macro_rules! wire_int {
    ($type:ty, $format:literal) => {
        impl WireInt for $type {
            const FORMAT: char = $format;
            const WIDTH: usize = std::mem::size_of::<$type>();
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(chunk: &[u8]) -> Self {
                let mut bytes = [0; std::mem::size_of::<$type>()];
                bytes.copy_from_slice(chunk);
                <$type>::from_le_bytes(bytes)
            }
        }
    };
}

wire_int!(u32, 'I');
wire_int!(i32, 'i');
wire_int!(u64, 'Q');

/// One list, little-endian, no header: upstream's `pack_int_list` (and the raw int32 `kv_indices` frame).
pub fn pack_int_list<T: WireInt>(values: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * T::WIDTH);
    for value in values {
        value.put(&mut out);
    }
    out
}

/// The inverse of [`pack_int_list`]: the frame must hold whole values, at most [`MAX_LIST_ITEMS`] of them.
pub fn unpack_int_list<T: WireInt>(bytes: &[u8]) -> Result<Vec<T>, WireReason> {
    unpack_list(bytes, 0)
}

/// `pack_int_lists(lists, fmt)` of domain.md §6.2: `u32le n`, then `n × u32le byte_len`, then each list packed
/// little-endian; no lists at all is the empty frame, as upstream's `pack_list_of_buffers` writes it.
/// Example: `[[17, 23]]` as `u32` ("I") is `01000000 08000000 11000000 17000000`.
pub fn pack_int_lists<T: WireInt>(lists: &[Vec<T>]) -> Vec<u8> {
    let buffers: Vec<Vec<u8>> = lists.iter().map(|list| pack_int_list(list)).collect();
    pack_buffers(&buffers)
}

/// The inverse of [`pack_int_lists`]. Stricter than upstream, which ignores trailing bytes and silently shortens
/// a list whose bytes run past the frame: both are errors here. `00000000` (zero lists) is accepted as `[]`.
pub fn unpack_int_lists<T: WireInt>(bytes: &[u8]) -> Result<Vec<Vec<T>>, WireReason> {
    let buffers = unpack_buffers(bytes)?;
    buffers.into_iter().enumerate().map(|(list, buffer)| unpack_list(buffer, list)).collect()
}

/// Upstream's `pack_list_of_buffers`: the framing of [`pack_int_lists`] around arbitrary byte strings.
pub(crate) fn pack_buffers(buffers: &[Vec<u8>]) -> Vec<u8> {
    if buffers.is_empty() {
        return Vec::new();
    }
    let total: usize = buffers.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(4 + 4 * buffers.len() + total);
    // A count or length past u32 cannot be framed; u32::MAX makes the receiver refuse it (it exceeds every limit).
    length_u32(buffers.len()).put(&mut out);
    for buffer in buffers {
        length_u32(buffer.len()).put(&mut out);
    }
    for buffer in buffers {
        out.extend_from_slice(buffer);
    }
    out
}

fn length_u32(length: usize) -> u32 {
    u32::try_from(length).unwrap_or(u32::MAX)
}

/// The inverse of [`pack_buffers`]: the count is checked against [`MAX_PACKED_LISTS`] and the header against the
/// bytes present before the table of slices is allocated.
pub(crate) fn unpack_buffers(bytes: &[u8]) -> Result<Vec<&[u8]>, WireReason> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut header = Cursor::new(bytes);
    let count = header.u32()?;
    if u64::from(count) > MAX_PACKED_LISTS {
        return Err(WireReason::TooLarge { what: "list count", value: count.into(), limit: MAX_PACKED_LISTS });
    }
    let header_bytes = 4 + 4 * u64::from(count);
    if header_bytes > bytes.len() as u64 {
        return Err(WireReason::Truncated { needed: header_bytes, present: bytes.len() });
    }
    let mut body = Cursor { bytes, at: 4 + 4 * count as usize };
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let length = header.u32()?;
        out.push(body.take(length as usize)?);
    }
    body.finish()?;
    Ok(out)
}

/// Checks that `bytes` holds whole `width`-byte items, at most [`MAX_LIST_ITEMS`]; returns the item count.
pub(crate) fn item_count(bytes: &[u8], width: usize, list: usize) -> Result<usize, WireReason> {
    if bytes.len() % width != 0 {
        return Err(WireReason::Misaligned { list, bytes: bytes.len() as u64, width });
    }
    let count = bytes.len() / width;
    if count as u64 > MAX_LIST_ITEMS {
        return Err(WireReason::TooLarge { what: "items in one list", value: count as u64, limit: MAX_LIST_ITEMS });
    }
    Ok(count)
}

fn unpack_list<T: WireInt>(bytes: &[u8], list: usize) -> Result<Vec<T>, WireReason> {
    item_count(bytes, T::WIDTH, list)?;
    Ok(bytes.chunks_exact(T::WIDTH).map(T::get).collect())
}

/// int32 page or slot indices ("i") as `u32`s: every value must be at least 0.
pub(crate) fn indices(lists: Vec<Vec<i32>>) -> Result<Vec<Vec<u32>>, WireReason> {
    lists.into_iter().enumerate().map(|(list, values)| index_list(&values, list)).collect()
}

pub(crate) fn index_list(values: &[i32], list: usize) -> Result<Vec<u32>, WireReason> {
    values
        .iter()
        .enumerate()
        .map(|(item, value)| u32::try_from(*value).map_err(|_| WireReason::NegativeIndex { list, item, value: *value }))
        .collect()
}

/// A little-endian reader over one frame that reports truncation and trailing bytes.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    /// The next `length` bytes, or `Truncated` when the frame ends first.
    pub(crate) fn take(&mut self, length: usize) -> Result<&'a [u8], WireReason> {
        let end = self.at as u64 + length as u64;
        if end > self.bytes.len() as u64 {
            return Err(WireReason::Truncated { needed: end, present: self.bytes.len() });
        }
        let out = &self.bytes[self.at..self.at + length];
        self.at += length;
        Ok(out)
    }

    pub(crate) fn u16(&mut self) -> Result<u16, WireReason> {
        let bytes = self.take(2)?;
        Ok(u16::from_le_bytes([bytes[0], bytes[1]]))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, WireReason> {
        self.take(4).map(u32::get)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, WireReason> {
        self.take(8).map(u64::get)
    }

    /// Whether every byte was read.
    pub(crate) fn at_end(&self) -> bool {
        self.at >= self.bytes.len()
    }

    /// Ends the frame: every byte must have been read.
    pub(crate) fn finish(self) -> Result<(), WireReason> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            extra => Err(WireReason::TrailingBytes { extra }),
        }
    }
}

/// A value as upstream writes an ASCII field: `str(value).encode("ascii")`.
pub(crate) fn ascii(value: impl Display) -> Vec<u8> {
    value.to_string().into_bytes()
}

/// An ASCII decimal integer (`-?[0-9]+`, leading zeros allowed, at most [`MAX_INT_TEXT_BYTES`] bytes) in `range`.
pub(crate) fn ascii_int(bytes: &[u8], range: &RangeInclusive<i128>) -> Result<i128, WireReason> {
    if bytes.len() > MAX_INT_TEXT_BYTES {
        let value = bytes.len() as u64;
        return Err(WireReason::TooLarge { what: "integer text bytes", value, limit: MAX_INT_TEXT_BYTES as u64 });
    }
    if let Some(offset) = bytes.iter().position(|byte| !byte.is_ascii()) {
        return Err(WireReason::NotAscii { offset, byte: bytes[offset] });
    }
    let (negative, digits) = match bytes.strip_prefix(b"-") {
        Some(digits) => (true, digits),
        None => (false, bytes),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(WireReason::NotInteger { text: bytes.iter().map(|byte| char::from(*byte)).collect() });
    }
    // At most 32 digits: far below i128::MAX (39 digits), so this cannot overflow.
    let magnitude = digits.iter().fold(0_i128, |value, digit| value * 10 + i128::from(digit - b'0'));
    let value = if negative { -magnitude } else { magnitude };
    if !range.contains(&value) {
        return Err(WireReason::OutOfRange { value, min: *range.start(), max: *range.end() });
    }
    Ok(value)
}

/// A text field: 1 to [`MAX_TEXT_BYTES`] bytes of printable ASCII without spaces (an ip, a key, a dtype).
pub(crate) fn text(bytes: &[u8]) -> Result<String, WireReason> {
    if bytes.is_empty() {
        return Err(WireReason::Empty);
    }
    if bytes.len() > MAX_TEXT_BYTES {
        let value = bytes.len() as u64;
        return Err(WireReason::TooLarge { what: "text bytes", value, limit: MAX_TEXT_BYTES as u64 });
    }
    if let Some(offset) = bytes.iter().position(|byte| !byte.is_ascii_graphic()) {
        return Err(WireReason::NotAscii { offset, byte: bytes[offset] });
    }
    Ok(bytes.iter().map(|byte| char::from(*byte)).collect())
}

/// A UTF-8 field of at most [`MAX_REASON_BYTES`] bytes; may be empty.
pub(crate) fn utf8(bytes: &[u8]) -> Result<String, WireReason> {
    if bytes.len() > MAX_REASON_BYTES {
        let value = bytes.len() as u64;
        return Err(WireReason::TooLarge { what: "reason bytes", value, limit: MAX_REASON_BYTES as u64 });
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(text.to_owned()),
        Err(error) => Err(WireReason::NotUtf8 { offset: error.valid_up_to() }),
    }
}

/// A frame that must hold exactly `expected`.
pub(crate) fn literal(bytes: &[u8], expected: &'static str) -> Result<(), WireReason> {
    if bytes == expected.as_bytes() {
        Ok(())
    } else {
        Err(WireReason::Unexpected { expected })
    }
}

/// A frame's position in the multipart message and its field name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field {
    pub(crate) frame: usize,
    pub(crate) name: &'static str,
}

pub(crate) const fn field(frame: usize, name: &'static str) -> Field {
    Field { frame, name }
}

/// Frame 0 of every message.
const GUARD_FIELD: Field = field(0, "guard");

/// Reads one message's frames and attaches the message, frame and field to every error.
pub(crate) struct Reader<'a> {
    message: MessageKind,
    frames: &'a [Vec<u8>],
}

impl<'a> Reader<'a> {
    /// Checks the guard, then that there are at most `max_frames` frames (the guard included).
    pub(crate) fn new(message: MessageKind, frames: &'a [Vec<u8>], max_frames: usize) -> Result<Self, WireError> {
        let reader = Self { message, frames };
        reader.read(GUARD_FIELD, |bytes| if bytes == GUARD { Ok(()) } else { Err(WireReason::BadGuard) })?;
        if frames.len() > max_frames {
            let kind = WireReason::TooManyFrames { frames: frames.len(), max: max_frames };
            return Err(reader.error(field(max_frames, "after the last field"), kind));
        }
        Ok(reader)
    }

    /// Frames in the message, the guard included.
    pub(crate) fn frame_count(&self) -> usize {
        self.frames.len()
    }

    pub(crate) fn error(&self, field: Field, kind: WireReason) -> WireError {
        WireError { message: self.message, frame: field.frame, field: field.name, reason: kind }
    }

    /// The frame's bytes, or `Missing`; a frame over [`MAX_FRAME_BYTES`] is refused unread.
    fn frame(&self, field: Field) -> Result<&'a [u8], WireError> {
        let Some(bytes) = self.frames.get(field.frame) else {
            return Err(self.error(field, WireReason::Missing { frames: self.frames.len() }));
        };
        if bytes.len() as u64 > MAX_FRAME_BYTES {
            let kind = WireReason::TooLarge { what: "frame bytes", value: bytes.len() as u64, limit: MAX_FRAME_BYTES };
            return Err(self.error(field, kind));
        }
        Ok(bytes)
    }

    /// Checks that a frame which may be empty is present.
    pub(crate) fn require(&self, field: Field) -> Result<(), WireError> {
        self.frame(field).map(|_| ())
    }

    /// Parses a required frame.
    pub(crate) fn read<T>(
        &self,
        field: Field,
        parse: impl FnOnce(&'a [u8]) -> Result<T, WireReason>,
    ) -> Result<T, WireError> {
        parse(self.frame(field)?).map_err(|kind| self.error(field, kind))
    }

    /// Parses a frame that may be absent or empty, which both mean `default`.
    pub(crate) fn read_or<T>(
        &self,
        field: Field,
        default: T,
        parse: impl FnOnce(&'a [u8]) -> Result<T, WireReason>,
    ) -> Result<T, WireError> {
        match self.frames.get(field.frame) {
            None => Ok(default),
            Some(bytes) if bytes.is_empty() => Ok(default),
            Some(_) => self.read(field, parse),
        }
    }

    /// A required ASCII integer in `range` (which must fit `T`).
    pub(crate) fn int<T: TryFrom<i128>>(&self, field: Field, range: RangeInclusive<i128>) -> Result<T, WireError> {
        self.read(field, |bytes| to_int(ascii_int(bytes, &range)?, &range))
    }

    /// An ASCII integer in `range`, `default` when the frame is absent or empty.
    pub(crate) fn int_or<T: TryFrom<i128>>(
        &self,
        field: Field,
        default: T,
        range: RangeInclusive<i128>,
    ) -> Result<T, WireError> {
        self.read_or(field, default, |bytes| to_int(ascii_int(bytes, &range)?, &range))
    }
}

fn to_int<T: TryFrom<i128>>(value: i128, range: &RangeInclusive<i128>) -> Result<T, WireReason> {
    T::try_from(value).map_err(|_| WireReason::OutOfRange { value, min: *range.start(), max: *range.end() })
}
