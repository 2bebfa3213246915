//! The fabric seam, shaped like RDMA verbs ([`verbs`]), and the in-memory fabric behind it ([`world`]).
//!
//! Nothing here knows plans, models or the oracle: a fabric moves bytes between addresses it was given keys for.
//! The RDMA fabric (feature `rdma`) implements the same [`verbs::Endpoint`] and passes the same conformance suite.

pub mod verbs;
pub mod world;
