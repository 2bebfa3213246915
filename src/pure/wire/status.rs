//! `Status` and `KvPoll`: the completion message a prefill rank sends to each decode endpoint of a request, and
//! the per-room state it carries (domain.md §6.1 steps 5-6, §6.2 "Mori status", §6.4).

use super::codec::{ascii, field, utf8, Field, Reader};
use super::error::{MessageKind, WireError};
use super::GUARD;

const ROOM: Field = field(1, "room");
const STATUS: Field = field(2, "status");
const PREFILL_UNIQUE_RANK: Field = field(3, "prefill_unique_rank");
const REASON: Field = field(4, "reason");

/// Frames of a status message, the guard included; the reason frame may be left off (upstream reads it only
/// when present).
pub const STATUS_FRAMES: usize = 5;

/// A room's transfer state, with upstream's integer values (domain.md §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KvPoll {
    Failed = 0,
    Bootstrapping = 1,
    WaitingForInput = 2,
    Transferring = 3,
    Success = 4,
}

impl KvPoll {
    /// Every state, in code order.
    pub const ALL: [KvPoll; 5] =
        [Self::Failed, Self::Bootstrapping, Self::WaitingForInput, Self::Transferring, Self::Success];

    /// The integer upstream sends.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The state with this integer, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// The room's state after `new` arrives (domain.md §6.1): the larger of the two, except that `Failed` always
    /// wins, whichever of the two it is. So a late `Success` never revives a failed room.
    ///
    /// Upstream's mainline `update_status` only lets an *incoming* `Failed` win; a `Failed` room that then gets
    /// `Success` becomes `max(0, 4) = Success`. kvrelay follows domain.md, which makes `Failed` sticky.
    ///
    /// The other half of the rule is the caller's concern: once a room is cleared from the status table it is
    /// not there to update, and a late `Failed` must not insert it again.
    pub fn update(self, new: KvPoll) -> KvPoll {
        if self == Self::Failed || new == Self::Failed {
            Self::Failed
        } else {
            self.max(new)
        }
    }
}

/// A prefill rank's report on one room to one decode endpoint (domain.md §6.2 "Mori status").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Frame 1: the bootstrap room (ASCII integer).
    pub room: u64,
    /// Frame 2: the state, as its ASCII code 0..=4.
    pub status: KvPoll,
    /// Frame 3: `attn_tp_rank * (pp * cp) + pp_rank * cp + cp_rank` of the sender (domain.md §6.1 step 6); decode
    /// counts distinct values until the expected number of successes.
    pub prefill_unique_rank: u32,
    /// Frame 4: the failure reason, UTF-8, at most `MAX_REASON_BYTES`; empty (or an absent frame) = none.
    pub reason: String,
}

impl Status {
    /// The 5 frames, guard first (an empty reason is an empty frame, as upstream sends it).
    pub fn encode(&self) -> Vec<Vec<u8>> {
        vec![
            GUARD.to_vec(),
            ascii(self.room),
            ascii(self.status.code()),
            ascii(self.prefill_unique_rank),
            self.reason.as_bytes().to_vec(),
        ]
    }

    /// Parses 4 or 5 frames; fields are checked in frame order and the first error is returned.
    pub fn decode(frames: &[Vec<u8>]) -> Result<Self, WireError> {
        let reader = Reader::new(MessageKind::Status, frames, STATUS_FRAMES)?;
        let room = reader.int(ROOM, 0..=u64::MAX.into())?;
        let code: u8 = reader.int(STATUS, 0..=i128::from(KvPoll::Success.code()))?;
        Ok(Self {
            room,
            // The range above admits only codes that exist.
            status: KvPoll::from_code(code).unwrap_or(KvPoll::Failed),
            prefill_unique_rank: reader.int(PREFILL_UNIQUE_RANK, 0..=u32::MAX.into())?,
            reason: reader.read_or(REASON, String::new(), utf8)?,
        })
    }
}
