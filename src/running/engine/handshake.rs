//! kvrelay's own control messages beside Mori's (documented in `src/pure/wire/README.md` terms): the prefill rank's
//! answer to a registration, carrying its transfer engine's peer address for this connection (a verbs connection
//! needs both ends) and the link's verdict.
//!
//! `[guard, "kvrelay-link", address, error]`: the peer address's bytes (opaque, at most
//! [`crate::limits::MAX_PEER_ADDRESS_BYTES`]), and the error text (UTF-8, empty = linked).
//!
//! The abort of domain.md §6.4 ([I] kvrelay's wire for it): `[guard, "kvrelay-abort", room]` from a decode rank whose
//! room failed, to each prefill rank that may still write into it; `[guard, "kvrelay-abort-ack", room]` back once
//! that rank's writes of the room to this peer drained (the room ascii decimal in both). Only then does the decode
//! rank release the room's pages.

use crate::wire::GUARD;

/// The tag in frame 1.
pub(super) const LINK_TAG: &[u8] = b"kvrelay-link";

/// A prefill rank's answer to one registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LinkAck {
    pub(super) address: Vec<u8>,
    /// Why the peer cannot be served (domain.md §6.4), or `None`.
    pub(super) error: Option<String>,
}

impl LinkAck {
    pub(super) fn encode(&self) -> Vec<Vec<u8>> {
        vec![
            GUARD.to_vec(),
            LINK_TAG.to_vec(),
            self.address.clone(),
            self.error.clone().unwrap_or_default().into_bytes(),
        ]
    }

    /// `None` for anything that is not a well-formed link answer.
    pub(super) fn decode(frames: &[Vec<u8>]) -> Option<LinkAck> {
        let [guard, tag, address, error] = frames else { return None };
        if guard.as_slice() != GUARD || tag.as_slice() != LINK_TAG {
            return None;
        }
        if address.len() > crate::limits::MAX_PEER_ADDRESS_BYTES {
            return None;
        }
        let error = String::from_utf8(error.clone()).ok()?;
        Some(LinkAck { address: address.clone(), error: (!error.is_empty()).then_some(error) })
    }
}

/// The tag of an abort (frame 1).
pub(super) const ABORT_TAG: &[u8] = b"kvrelay-abort";
/// The tag of an abort's acknowledgement (frame 1).
pub(super) const ABORT_ACK_TAG: &[u8] = b"kvrelay-abort-ack";

/// An abort of `room` (decode to prefill) or its acknowledgement (prefill to decode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Abort {
    pub(super) room: u64,
    pub(super) ack: bool,
}

impl Abort {
    pub(super) fn encode(&self) -> Vec<Vec<u8>> {
        let tag = if self.ack { ABORT_ACK_TAG } else { ABORT_TAG };
        vec![GUARD.to_vec(), tag.to_vec(), self.room.to_string().into_bytes()]
    }

    /// `None` for anything that is not a well-formed abort or acknowledgement.
    pub(super) fn decode(frames: &[Vec<u8>]) -> Option<Abort> {
        let [guard, tag, room] = frames else { return None };
        if guard.as_slice() != GUARD {
            return None;
        }
        let ack = match tag.as_slice() {
            ABORT_TAG => false,
            ABORT_ACK_TAG => true,
            _ => return None,
        };
        let text = std::str::from_utf8(room).ok()?;
        // Canonical decimal only: no sign, no leading zeros, no spaces.
        let room: u64 = text.parse().ok().filter(|room: &u64| room.to_string() == text)?;
        Some(Abort { room, ack })
    }
}

/// Which message a frame list is, by its shape (the Mori wire has no type field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Registration,
    Link,
    RequestMeta,
    Status,
    Abort,
    AbortAck,
    Unknown,
}

pub(super) fn classify(frames: &[Vec<u8>]) -> Kind {
    match (frames.get(1).map(Vec::as_slice), frames.len()) {
        (Some(b"None"), _) => Kind::Registration,
        (Some(LINK_TAG), _) => Kind::Link,
        (Some(ABORT_TAG), _) => Kind::Abort,
        (Some(ABORT_ACK_TAG), _) => Kind::AbortAck,
        (
            _,
            crate::wire::REQUEST_META_FRAMES
            | crate::wire::REQUEST_META_FRAMES_WITH_DEVICE_INDICES
            | crate::wire::REQUEST_META_FRAMES_WITH_STAGING,
        ) => Kind::RequestMeta,
        (_, crate::wire::STATUS_FRAMES) => Kind::Status,
        _ => Kind::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy as _;

    #[test]
    fn link_ack_round_trips_and_rejects_garbage() {
        let ack = LinkAck { address: b"node3-qp17".to_vec(), error: Some("no".to_owned()) };
        assert_eq!(LinkAck::decode(&ack.encode()), Some(ack));
        assert_eq!(LinkAck::decode(&[GUARD.to_vec(), LINK_TAG.to_vec(), b"x".to_vec()]), None);
    }

    #[test]
    fn aborts_round_trip_are_told_apart_and_reject_non_canonical_rooms() {
        for abort in [Abort { room: 7, ack: false }, Abort { room: u64::MAX, ack: true }] {
            let frames = abort.encode();
            assert_eq!(Abort::decode(&frames), Some(abort));
            let kind = if abort.ack { Kind::AbortAck } else { Kind::Abort };
            assert_eq!(classify(&frames), kind);
        }
        for room in [&b"07"[..], b"+7", b" 7", b"", b"18446744073709551616", b"\xff"] {
            assert_eq!(Abort::decode(&[GUARD.to_vec(), ABORT_TAG.to_vec(), room.to_vec()]), None, "{room:?}");
        }
        assert_eq!(Abort::decode(&[b"x".to_vec(), ABORT_TAG.to_vec(), b"7".to_vec()]), None);
    }

    proptest::proptest! {
        /// Untrusted frames (any peer may send anything): the decoders never panic, and whatever they accept encodes
        /// back to the same frames.
        #[test]
        fn control_answers_decode_arbitrary_frames_without_panicking(
            tag in proptest::sample::select(vec![ABORT_TAG.to_vec(), ABORT_ACK_TAG.to_vec(), LINK_TAG.to_vec(), b"x".to_vec()]),
            rest in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::num::u64::ANY.prop_map(|room| room.to_string().into_bytes()),
                    proptest::collection::vec(proptest::num::u8::ANY, 0..24),
                ],
                0..4,
            ),
        ) {
            let mut frames = vec![GUARD.to_vec(), tag];
            frames.extend(rest);
            if let Some(abort) = Abort::decode(&frames) {
                proptest::prop_assert_eq!(abort.encode(), frames.clone());
            }
            if let Some(ack) = LinkAck::decode(&frames) {
                proptest::prop_assert_eq!(ack.encode(), frames);
            }
        }
    }
}
