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
pub mod sim;

use std::collections::BTreeMap;

use crate::fabric::verbs::{Caps, Endpoint, NodeId};

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

/// A transport under certification: the endpoints it provides, and how to let time pass on it.
///
/// The endpoints obey the contract of [`Endpoint`]; [`Transport::open`] is called once per node, nodes numbered
/// from 0 in every case. Endpoints of one transport reach each other through [`Endpoint::connect_qp`].
pub trait Transport {
    fn identity(&self) -> Identity;
    /// A fresh endpoint for `node`, asking for `caps`; the transport may grant less (the endpoint's
    /// [`Endpoint::caps`] says what it granted; a case needing more reports the capability as unsupported).
    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, String>;
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
