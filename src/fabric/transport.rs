//! A transport: the per-node engines a fabric provides and how to let time pass on it. What the certification kit
//! (`crate::certify`) runs its cases through and what a run opens its ranks' engines from
//! ([`super::registry`]); every backend implements it in its own file (`sim_transport.rs`, `rdma_transport.rs`,
//! `plugin.rs`), and a vendor's Rust crate implements it in theirs (`tests/transports/`).

use std::collections::BTreeMap;

use super::seam::TransferEngine;
use super::verbs::{Caps, Endpoint, NodeId};
use super::verbs_engine::VerbsEngine;

error_kinds! {
    /// The kind of a [`TransportError`].
    pub enum TransportErrorKind {
        /// A verbs endpoint was asked of a transport that meets only the transfer-engine seam.
        NotVerbs = "not_verbs",
        /// `--fabric` names no fabric.
        UnknownFabric = "unknown_fabric",
        /// The fabric is not there: built without its feature, no such device, a plug-in that does not load.
        Unavailable = "unavailable",
        /// The transport refused to open a node's endpoint or engine.
        Open = "open",
    }
}

/// Why a transport, or the registry, could not give what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("this transport is not verbs-shaped: it meets the transfer-engine seam only")]
    NotVerbs,
    #[error("unknown fabric `{name}` (fix: sim, live-sim, rdma, nixl, cuda, plugin:PATH, child:COMMAND or mooncake)")]
    UnknownFabric { name: String },
    /// Its own words, naming the fix.
    #[error("{0}")]
    Unavailable(String),
    /// The transport's own words.
    #[error("{0}")]
    Open(String),
}

impl TransportError {
    pub fn kind(&self) -> TransportErrorKind {
        match self {
            TransportError::NotVerbs => TransportErrorKind::NotVerbs,
            TransportError::UnknownFabric { .. } => TransportErrorKind::UnknownFabric,
            TransportError::Unavailable(_) => TransportErrorKind::Unavailable,
            TransportError::Open(_) => TransportErrorKind::Open,
        }
    }
}

/// Who the transport is, for the report and the manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Short name, e.g. `sim`, `rdma`, `plugin:memcpy-sample`.
    pub name: String,
    /// The transport's own version text (a plug-in's, or rdma-core's).
    pub version: String,
    /// Device and driver facts, by name (device, port, GID index, driver, firmware, ...), sorted.
    pub facts: BTreeMap<String, String>,
}

/// A transport under certification: the transfer engines it provides, and how to let time pass on it.
///
/// Every transport provides [`TransferEngine`]s ([`Transport::engine`]): the seam the rank engines run on, which the
/// scenario cases and the seam's conformance cases use. A verbs-shaped transport provides [`Endpoint`]s
/// ([`Transport::open`]) instead or as well, and is then also held to the verbs contract (the `contract` and
/// `error-path` cases, the throughput run); its engine is, by default, the endpoint met at the seam
/// ([`VerbsEngine`]). Either is called once per node, nodes numbered from 0 in every case.
pub trait Transport {
    fn identity(&self) -> Identity;
    /// Whether this transport is verbs-shaped ([`Transport::open`] gives endpoints). A transport that meets only the
    /// transfer-engine seam (shaped like NIXL or Mooncake) says `false`, and the verbs cases do not apply to it.
    fn verbs(&self) -> bool {
        true
    }
    /// A fresh endpoint for `node`, asking for `caps`; the transport may grant less (the endpoint's
    /// [`Endpoint::caps`] says what it granted; a case needing more reports the capability as unsupported).
    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, TransportError> {
        let _ = (node, caps);
        Err(TransportError::NotVerbs)
    }
    /// A fresh transfer engine for `node` (`caps`: what a verbs-shaped transport is asked for below the seam). By
    /// default [`Transport::open`]'s endpoint, lowered by [`VerbsEngine`].
    fn engine(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn TransferEngine>, TransportError> {
        Ok(Box::new(VerbsEngine::new(self.open(node, caps)?)))
    }
    /// Lets a little time pass (a simulated world executes its next delivery; hardware waits about a millisecond).
    fn step(&mut self);
    /// Lets every work request posted so far on this transport's endpoints execute and its completions become
    /// pollable (bounded in time: a transport that never delivers fails the case instead of hanging it).
    fn settle(&mut self);
    /// Forgets every endpoint opened so far (the next case starts from nothing).
    fn reset(&mut self);
}
