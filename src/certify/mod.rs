//! Transport certification: a fixed, versioned case set (the seam's conformance cases, every golden scenario
//! through the engines, out-of-bounds and error paths, a throughput run) run through a [`Transport`], with a
//! JUnit XML file, a JSON report and a manifest as its result.
//!
//! A transport plugs in three ways: a Rust crate implementing [`Transport`] and calling [`certify`] (the library
//! entry point), a C ABI plug-in loaded with `--fabric plugin:PATH` (`fabric::plugin`), or kvrelay's own fabrics
//! (`sim`, and `rdma` with the cargo feature).
//!
//! - [`conformance`]: the contract of [`Endpoint`] as library cases over `&mut dyn Transport`, each returning
//!   [`conformance::CaseError`] (failed, or unsupported when the transport grants too little) instead of
//!   panicking, and the registry [`conformance::cases`] (stable ids, `contract` and `error-path` groups, claims,
//!   minimum caps). `tests/it/conformance.rs` runs it on every backend.
//! - `run.rs`: the [`CaseSet`] (conformance cases, every scenario of a corpus through the engines, the throughput
//!   run; versioned and hashed) and [`certify`], which runs it through a transport into a [`Report`].
//! - [`report`]: the [`Report`] as JUnit XML, a JSON report and a manifest.
//! - `throughput.rs`: streamed WRITEs between two endpoints, every byte checked, the figure reported.
//! - [`sim`]: [`SimTransport`], the in-memory fabric (`SimWorld`, simulated time).
//! - `rdma` (cargo feature `rdma`): `RdmaTransport`, the verbs fabric on one device, settling on a quiet period
//!   bounded on the wall clock.
//!
//! Library code here never prints; the caller (the `certify` command, a test) reports.

pub mod conformance;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod report;
pub mod seam;
pub mod sim;

use std::collections::BTreeMap;

use crate::fabric::seam::TransferEngine;
use crate::fabric::verbs::{Caps, Endpoint, NodeId};
use crate::fabric::verbs_engine::VerbsEngine;

#[cfg(feature = "rdma")]
pub use rdma::RdmaTransport;
pub use sim::SimTransport;

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
    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, String> {
        let _ = (node, caps);
        Err("this transport is not verbs-shaped: it meets the transfer-engine seam only".to_owned())
    }
    /// A fresh transfer engine for `node` (`caps`: what a verbs-shaped transport is asked for below the seam). By
    /// default [`Transport::open`]'s endpoint, lowered by [`VerbsEngine`].
    fn engine(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn TransferEngine>, String> {
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

mod run;
mod throughput;

pub use report::{CaseResult, Host, Report, Verdict};
pub use run::{certify, CaseSet, CertifyError, Group, Options, CASE_SET_VERSION, LARGE_SCENARIO_BYTES};
pub use throughput::Throughput;
