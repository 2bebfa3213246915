//! The fabric seam, shaped like RDMA verbs ([`verbs`]), the in-memory fabric behind it ([`world`]), C ABI transport
//! plug-ins loaded as shared objects ([`plugin`], header `kvrelay_transport.h`) and, with the cargo feature `rdma`,
//! the RDMA verbs fabric (`rdma`); with `nixl`, NIXL; with `cuda`, GPU memory (`cuda`). `plugin`, `rdma`, `nixl` and
//! `cuda` are the crate's only `unsafe` code.
//! `shell` is the QP bookkeeping the two real fabrics share, in safe code. [`child`] puts a transfer engine in
//! another process (spec `child/README.md`): an engine with no C API meets the seam over JSON lines and shared files.
//!
//! Nothing here knows plans, models or the oracle: a fabric moves bytes between addresses it was given keys for.
//! The RDMA fabric (feature `rdma`) implements the same [`verbs::Endpoint`] and passes the same conformance suite.

pub mod child;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod faults;
mod gather;
mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod plugin;
#[cfg(feature = "rdma")]
pub mod rdma;
#[cfg(feature = "rdma")]
pub mod rdma_transport;
pub mod registry;
pub mod seam;
mod shell;
pub mod sim_transport;
pub mod transport;
pub mod verbs;
pub mod verbs_engine;
pub mod world;
