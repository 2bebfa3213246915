//! kvrelay's own control messages beside Mori's (documented in `src/wire/README.md` terms): the prefill rank's
//! answer to a registration, carrying its queue pair (an RC connection needs both ends) and the link's verdict.
//!
//! `[guard, "kvrelay-link", qp, error]`: the queue pair as [`QpInfo::to_text`] (ASCII), and the error text (UTF-8,
//! empty = linked).

use crate::fabric::verbs::QpInfo;
use crate::wire::GUARD;

/// The tag in frame 1.
pub(super) const LINK_TAG: &[u8] = b"kvrelay-link";

/// A prefill rank's answer to one registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LinkAck {
    pub(super) qp: QpInfo,
    /// Why the peer cannot be served (domain.md §6.4), or `None`.
    pub(super) error: Option<String>,
}

impl LinkAck {
    pub(super) fn encode(&self) -> Vec<Vec<u8>> {
        vec![
            GUARD.to_vec(),
            LINK_TAG.to_vec(),
            self.qp.to_text().into_bytes(),
            self.error.clone().unwrap_or_default().into_bytes(),
        ]
    }

    /// `None` for anything that is not a well-formed link answer.
    pub(super) fn decode(frames: &[Vec<u8>]) -> Option<LinkAck> {
        let [guard, tag, qp, error] = frames else { return None };
        if guard.as_slice() != GUARD || tag.as_slice() != LINK_TAG {
            return None;
        }
        let text = std::str::from_utf8(qp).ok()?;
        // The whole frame is the queue pair, in its canonical form.
        let qp = QpInfo::from_text_suffix(text).filter(|qp| qp.to_text() == text)?;
        let error = String::from_utf8(error.clone()).ok()?;
        Some(LinkAck { qp, error: (!error.is_empty()).then_some(error) })
    }
}

/// Which message a frame list is, by its shape (the Mori wire has no type field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Registration,
    Link,
    RequestMeta,
    Status,
    Unknown,
}

pub(super) fn classify(frames: &[Vec<u8>]) -> Kind {
    match (frames.get(1).map(Vec::as_slice), frames.len()) {
        (Some(b"None"), _) => Kind::Registration,
        (Some(LINK_TAG), _) => Kind::Link,
        (_, crate::wire::REQUEST_META_FRAMES) => Kind::RequestMeta,
        (_, crate::wire::STATUS_FRAMES) => Kind::Status,
        _ => Kind::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_ack_round_trips_and_rejects_garbage() {
        let mut gid = [0u8; 16];
        gid[10..].copy_from_slice(&[0xff, 0xff, 10, 199, 0, 1]);
        let qp = QpInfo { node: crate::fabric::verbs::NodeId(3), qpn: crate::fabric::verbs::QpNum(17), lid: 9, gid };
        let ack = LinkAck { qp, error: Some("no".to_owned()) };
        assert_eq!(LinkAck::decode(&ack.encode()), Some(ack));
        assert_eq!(LinkAck::decode(&[GUARD.to_vec(), LINK_TAG.to_vec(), b"x".to_vec()]), None);
    }
}
