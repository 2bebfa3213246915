//! The fabric seam, shaped like RDMA verbs ([`verbs`]), the in-memory fabric behind it ([`world`]) and, with the
//! cargo feature `rdma`, the RDMA verbs fabric (`rdma`, the crate's only `unsafe` code).
//!
//! Nothing here knows plans, models or the oracle: a fabric moves bytes between addresses it was given keys for.
//! The RDMA fabric (feature `rdma`) implements the same [`verbs::Endpoint`] and passes the same conformance suite.

#[cfg(feature = "rdma")]
pub mod rdma;
pub mod verbs;
pub mod world;
