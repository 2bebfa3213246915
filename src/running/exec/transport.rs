//! The older all-ranks transport of the direct execution: one object holds every rank's memory keyed by
//! [`RegionKey`], writes execute at post time. Kept for `kvrelay bench`'s baseline and planted-fault cases; the
//! engines use the verbs seam (`fabric::verbs`) instead.

use crate::verify::RegionKey;

/// A one-sided write: `length` bytes from a source region to a target region (RDMA WRITE semantics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteRequest {
    /// Returned in the completion; the caller's correlation id (`wr_id`).
    pub id: u64,
    pub source: RegionKey,
    pub source_offset: u64,
    pub target: RegionKey,
    pub target_offset: u64,
    pub length: u64,
}

/// Outcome of one write, named after `ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionStatus {
    /// `IBV_WC_SUCCESS`: every byte landed.
    Success,
    /// `IBV_WC_LOC_PROT_ERR`: the source range is not inside a registered region; nothing was written.
    LocalProtection,
    /// `IBV_WC_REM_ACCESS_ERR`: the target range is not inside a registered region; nothing was written.
    RemoteAccess,
}

/// One completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub id: u64,
    pub status: CompletionStatus,
}

/// Why a transport call itself failed (as opposed to a write completing in error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("region {0:?} is already registered")]
    AlreadyRegistered(RegionKey),
    #[error("region {0:?} is not registered")]
    NotRegistered(RegionKey),
}

/// A fabric that executes one-sided writes between registered regions.
///
/// Semantics every implementation keeps: each posted write yields exactly one completion; a write whose
/// source or target range leaves its registered region completes in error and writes nothing; writes posted
/// to one target complete in post order.
pub trait Transport {
    /// Registers `bytes` as region `key` (an MR on the owning rank).
    fn register(&mut self, key: RegionKey, bytes: Vec<u8>) -> Result<(), TransportError>;
    /// Posts a batch of writes (one doorbell).
    fn post_writes(&mut self, writes: &[WriteRequest]) -> Result<(), TransportError>;
    /// Moves every available completion into `completions`.
    fn poll(&mut self, completions: &mut Vec<Completion>);
    /// A copy of a registered region's current bytes.
    fn read(&self, key: RegionKey) -> Result<Vec<u8>, TransportError>;
    /// Deregisters a region and hands back its bytes (what `read` returns, without keeping a second copy).
    fn release(&mut self, key: RegionKey) -> Result<Vec<u8>, TransportError>;
}
