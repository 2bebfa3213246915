//! The Mori control-plane messages as bytes (domain.md §6): registration, per-request metadata, status and
//! prefill info, each a ZMQ-style multipart message (`Vec<Vec<u8>>`) whose frame 0 is the guard `MoriMsgGuard`.
//!
//! `src/pure/wire/README.md` is the spec: every frame, its encoding, defaults, limits and golden byte vectors.
//! Every message has `encode(&self) -> Vec<Vec<u8>>` and `decode(&[Vec<u8>]) -> Result<Self, WireError>`.
//! Decoding never panics and allocates nothing a frame's own bytes and `src/pure/limits.rs` do not bound; every
//! [`WireError`] names the message, the frame index and the field. For every value inside the documented domain
//! (text fields printable ASCII, numbers in range, lists within the limits) `decode(&x.encode()) == Ok(x)`;
//! `encode` never panics outside it either, it writes frames that `decode` refuses.
//!
//! Pure: no IO, clock or randomness, and nothing from the planner or the oracle.

mod codec;
mod desc;
mod error;
pub mod golden;
mod prefill;
mod registration;
mod request;
mod status;

pub use codec::{pack_int_list, pack_int_lists, unpack_int_list, unpack_int_lists, WireInt};
pub use desc::{EngineDesc, MemoryDesc, MEMORY_DESC_BYTES};
pub use error::{MessageKind, WireError, WireErrorKind, WireReason};
pub use prefill::{PrefillInfo, PREFILL_INFO_FRAMES, PREFILL_INFO_TAG};
pub use registration::{
    DcpFields, Registration, LEGACY_REGISTRATION_FRAMES, REGISTRATION_FRAMES, REGISTRATION_FRAMES_WITH_ITEM_LENS,
    REGISTRATION_FRAMES_WITH_OUTER_COUNTS, REGISTRATION_FRAMES_WITH_STAGING, REGISTRATION_ROOM,
};
pub use request::{
    RequestMeta, REQUEST_META_FRAMES, REQUEST_META_FRAMES_WITH_DEVICE_INDICES, REQUEST_META_FRAMES_WITH_STAGING,
};
pub use status::{KvPoll, Status, STATUS_FRAMES};

/// Frame 0 of every message (upstream's `MORI_GUARD`); a message without it is dropped.
pub const GUARD: &[u8] = b"MoriMsgGuard";
