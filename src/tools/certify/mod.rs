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
pub mod report;
pub mod seam;

#[cfg(feature = "rdma")]
pub use crate::fabric::rdma_transport::RdmaTransport;
pub use crate::fabric::sim_transport::SimTransport;
pub use crate::fabric::transport::{Identity, Transport, TransportError, TransportErrorKind};

mod run;
mod throughput;

pub use report::{report_schema, CaseResult, Host, Report, Verdict, FORMAT as REPORT_FORMAT};
pub use run::{certify, CaseSet, CertifyError, Group, Options, CASE_SET_VERSION, LARGE_SCENARIO_BYTES};
pub use throughput::Throughput;
