//! The control plane's frames on a TCP stream (kvrelay's own; documented in `src/pure/wire/README.md`): a length prefix,
//! a kind, the sending and receiving node, and a list of byte frames (an engine's ZMQ-style message, or bootstrap
//! data). Pure: [`ControlFrame::encode`] and [`decode`] read no socket.
//!
//! `u32le body_len | u8 kind | u32le from | u32le to | u32le count | count × (u32le len | len bytes)`
//!
//! Every length is checked against the bytes present and [`MAX_CONTROL_FRAME_BYTES`] before anything is allocated,
//! so a hostile peer cannot make a process allocate more than the frame it actually sent.

use crate::fabric::verbs::NodeId;

/// Largest body of one control frame (a registration or metadata message is far smaller).
pub const MAX_CONTROL_FRAME_BYTES: u32 = 1 << 26;
/// Most byte frames in one control frame.
pub const MAX_CONTROL_PARTS: u32 = 1 << 12;
const HEADER_BYTES: usize = 13;

/// What a control frame is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FrameKind {
    /// A process announces its node; a prefill rank 0 adds its published topology (`PrefillInfo` frames).
    Hello = 1,
    /// The hub starts the run: every expected node connected (or the connect deadline passed); carries the
    /// published prefill topology, if any prefill rank 0 said hello.
    Start = 2,
    /// An engine's message to another node.
    Message = 3,
    /// A decode process finished (every room ended); carries its verdict line.
    Done = 4,
    /// The hub ends the run: every decode process is done or gone.
    Stop = 5,
}

/// One control frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlFrame {
    pub kind: FrameKind,
    pub from: NodeId,
    pub to: NodeId,
    pub parts: Vec<Vec<u8>>,
}

/// Why bytes are not a control frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("control frame of {0} bytes is larger than the limit of {MAX_CONTROL_FRAME_BYTES} (fix: the peer is not kvrelay, or is broken)")]
    TooLarge(u64),
    #[error("control frame kind {0} is unknown (fix: peers must run the same kvrelay version)")]
    UnknownKind(u8),
    #[error("control frame holds {0} parts, more than the limit of {MAX_CONTROL_PARTS}")]
    TooManyParts(u32),
    #[error("control frame is truncated: part {part} needs {needed} bytes, {left} are left")]
    Truncated { part: u32, needed: u64, left: u64 },
    #[error("control frame has {0} bytes after its last part")]
    Trailing(u64),
}

error_kinds! {
    /// The kind of a [`FrameError`].
    pub enum FrameErrorKind {
        /// A frame over the size limit.
        TooLarge = "too_large",
        /// An unknown frame kind byte.
        UnknownKind = "unknown_kind",
        /// More parts than the limit.
        TooManyParts = "too_many_parts",
        /// A part runs past the frame's end.
        Truncated = "truncated",
        /// Bytes after the last part.
        Trailing = "trailing",
    }
}

impl FrameError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> FrameErrorKind {
        match self {
            FrameError::TooLarge(_) => FrameErrorKind::TooLarge,
            FrameError::UnknownKind(_) => FrameErrorKind::UnknownKind,
            FrameError::TooManyParts(_) => FrameErrorKind::TooManyParts,
            FrameError::Truncated { .. } => FrameErrorKind::Truncated,
            FrameError::Trailing(_) => FrameErrorKind::Trailing,
        }
    }
}

impl ControlFrame {
    pub fn new(kind: FrameKind, from: NodeId, to: NodeId, parts: Vec<Vec<u8>>) -> ControlFrame {
        ControlFrame { kind, from, to, parts }
    }

    /// The frame with its length prefix. Parts beyond the limits make a frame the receiver refuses, never a
    /// wrapped length.
    pub fn encode(&self) -> Vec<u8> {
        let body: usize = HEADER_BYTES + self.parts.iter().map(|part| 4 + part.len()).sum::<usize>();
        let mut out = Vec::with_capacity(4 + body);
        out.extend_from_slice(&u32::try_from(body).unwrap_or(u32::MAX).to_le_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&self.from.0.to_le_bytes());
        out.extend_from_slice(&self.to.0.to_le_bytes());
        out.extend_from_slice(&u32::try_from(self.parts.len()).unwrap_or(u32::MAX).to_le_bytes());
        for part in &self.parts {
            out.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_le_bytes());
            out.extend_from_slice(part);
        }
        out
    }
}

/// The body length a 4-byte prefix announces, checked against the limit before the body is read.
pub fn body_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix);
    if len > MAX_CONTROL_FRAME_BYTES {
        return Err(FrameError::TooLarge(len.into()));
    }
    Ok(len as usize)
}

/// Decodes one frame body (the bytes after the length prefix); every byte must be used.
pub fn decode(body: &[u8]) -> Result<ControlFrame, FrameError> {
    if body.len() as u64 > u64::from(MAX_CONTROL_FRAME_BYTES) {
        return Err(FrameError::TooLarge(body.len() as u64));
    }
    let mut cursor = body;
    let header = take(&mut cursor, HEADER_BYTES, 0)?;
    let kind = match header[0] {
        1 => FrameKind::Hello,
        2 => FrameKind::Start,
        3 => FrameKind::Message,
        4 => FrameKind::Done,
        5 => FrameKind::Stop,
        other => return Err(FrameError::UnknownKind(other)),
    };
    let word = |at: usize| u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
    let count = word(9);
    if count > MAX_CONTROL_PARTS {
        return Err(FrameError::TooManyParts(count));
    }
    // Each part needs at least its 4-byte length: a count the bytes cannot hold is refused before allocating.
    if u64::from(count) * 4 > cursor.len() as u64 {
        return Err(FrameError::Truncated { part: 0, needed: u64::from(count) * 4, left: cursor.len() as u64 });
    }
    let mut parts = Vec::with_capacity(count as usize);
    for part in 0..count {
        let len = take(&mut cursor, 4, part)?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        parts.push(take(&mut cursor, len, part)?.to_vec());
    }
    if !cursor.is_empty() {
        return Err(FrameError::Trailing(cursor.len() as u64));
    }
    Ok(ControlFrame { kind, from: NodeId(word(1)), to: NodeId(word(5)), parts })
}

fn take<'a>(cursor: &mut &'a [u8], len: usize, part: u32) -> Result<&'a [u8], FrameError> {
    if cursor.len() < len {
        return Err(FrameError::Truncated { part, needed: len as u64, left: cursor.len() as u64 });
    }
    let (head, tail) = cursor.split_at(len);
    *cursor = tail;
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_garbage_is_refused() {
        let frame = ControlFrame::new(FrameKind::Message, NodeId(2), NodeId(7), vec![b"abc".to_vec(), Vec::new()]);
        let bytes = frame.encode();
        let len = body_len([bytes[0], bytes[1], bytes[2], bytes[3]]).unwrap();
        assert_eq!(len, bytes.len() - 4);
        assert_eq!(decode(&bytes[4..]), Ok(frame));
        assert_eq!(decode(&bytes[4..bytes.len() - 1]), Err(FrameError::Truncated { part: 1, needed: 4, left: 3 }));
        let mut trailing = bytes[4..].to_vec();
        trailing.push(0);
        assert_eq!(decode(&trailing), Err(FrameError::Trailing(1)));
        assert!(matches!(decode(&[9; 13]), Err(FrameError::UnknownKind(9))));
        assert!(matches!(body_len(u32::MAX.to_le_bytes()), Err(FrameError::TooLarge(_))));
        let mut many = vec![3u8, 0, 0, 0, 0, 0, 0, 0, 0];
        many.extend_from_slice(&1000u32.to_le_bytes());
        assert!(matches!(decode(&many), Err(FrameError::Truncated { .. })));
    }
}
