//! Per-rank engines (domain.md §6): the prefill sender and the decode receiver as sans-IO state machines.
//!
//! An engine owns no socket and reads no clock. Its inputs are messages (frames, decoded by [`crate::wire`]), work
//! events (batch completions) from its own transfer engine and the simulated time of each call; its outputs are
//! messages to other engines (an [`Outbox`]) and batches submitted on its own [`TransferEngine`] (the transfer seam)
//! within the engine's declared limits. [`sim`] drives every rank of a problem in one process over the in-memory `SimWorld`; the same
//! engines are meant to run one per process over real verbs.
//!
//! The flow is §6.1's: decode checks the prefill topology (its gates), resolves the rank mapping (§3.1) and sends
//! one registration per connection; the prefill rank links the peer (§6.3) and acknowledges with its queue pair and
//! the link's verdict ([I] kvrelay's own message: a registration error fails the decode rank's requests before any
//! metadata is sent, so no byte moves); per request decode sends metadata to every target (dummies included);
//! prefill plans every chunk of the request for every peer before the first byte (a planning error fails the room
//! with its text), sends chunk by chunk, then a status per peer once its writes completed; decode counts Success
//! from distinct prefill ranks up to the expected number.

mod decode;
pub mod direct;
mod handshake;
pub mod live;
mod prefill;
mod resident;
pub mod seat;
pub mod sim;
pub mod tasks;
pub mod trace;

pub use decode::{DecodeEngine, RoomState};
pub use prefill::PrefillEngine;

use crate::fabric::seam::{NodeId, TransferEngine};

/// A message to another engine: ZMQ-style frames, guard first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub to: NodeId,
    pub frames: Vec<Vec<u8>>,
}

/// What one call of an engine produced.
#[derive(Debug, Default)]
pub struct Outbox {
    pub messages: Vec<Envelope>,
    /// Human-readable events for `--trace` (each prefixed by the engine's rank by the driver).
    pub notes: Vec<String>,
}

impl Outbox {
    fn send(&mut self, to: NodeId, frames: Vec<Vec<u8>>) {
        self.messages.push(Envelope { to, frames });
    }

    fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }
}

/// The transfer engine a rank engine submits batches on: any [`TransferEngine`].
pub type Nic<'a> = &'a mut dyn TransferEngine;

/// Time without progress after which a decode rank fails its waiting requests (domain.md §6.4, bounded simulated
/// time instead of upstream's 300 s).
pub const WAITING_TIMEOUT_NS: u64 = 2_000_000_000;

/// Time after its first metadata within which a prefill rank must finish a room, or fail it (domain.md §6.4: a
/// bounded prefill-side transfer timeout, like Mori's transfer SLA): a room whose completions were lost or whose
/// peers went away still ends.
pub const TRANSFER_TIMEOUT_NS: u64 = WAITING_TIMEOUT_NS;

/// Simulated compute time of one prefill chunk (chunks become ready one after another).
pub const CHUNK_COMPUTE_NS: u64 = 20_000;
