//! kvrelay: byte-exact simulation and conformance harness for prefill → decode KV-cache transfer.
//!
//! The pipeline is scenario → problem → per-rank engines over the wire and the transfer-engine seam → observation →
//! verdict per decode rank. ARCHITECTURE.md has the full map. The crate is built in layers, each a folder, each
//! importing only from the layers before it (`tests/it/tidy.rs` enforces it):
//!
//! 1. [`pure`] (`src/pure/`): the pure core: no IO, no clock, no randomness, no threads.
//!    - [`model`]: vocabulary (ranks, topologies, model geometry, registered regions, requests); start at
//!      [`model::Problem`].
//!    - [`limits`]: every size, count and depth limit. [`seed`]: the seed and its named random streams.
//!    - [`faults`]: seeded faults as data, as a scenario's `faults:` list names them.
//!    - [`scenario`]: YAML scenario files → [`model::Problem`] plus the expected verdict; the only module that knows
//!      YAML.
//!    - [`plan`]: the planner (domain.md §2–§4, §6.3). [`verify`]: the independent oracle, never calling `plan`.
//!    - [`wire`]: the Mori control messages as bytes (domain.md §6.2).
//! 2. [`fabric`] (`src/fabric/`): the transfer-engine seam ([`fabric::seam::TransferEngine`]), the verbs seam below
//!    it and its lowering ([`fabric::verbs_engine`]), every backend in its own file (the in-memory
//!    [`fabric::world::SimWorld`], RDMA verbs, C plug-ins), the transports certification and runs open, and the one
//!    fabric registry ([`fabric::registry`]). Nothing here knows plans, models or the oracle.
//! 3. [`running`] (`src/running/`): running a scenario.
//!    - [`engine`]: prefill and decode ranks as sans-IO engines over the seam, the simulation drivers and the live
//!      driver.
//!    - [`control`]: the control plane between rank processes. [`process`]: ranks as processes.
//!    - [`external`]: other planners in the prefill ranks' seat over the plan protocol.
//!    - [`exec`]: the direct execution of a composed plan (the benchmark's baseline).
//!    - [`harness`]: the one run pipeline ([`harness::Run`]), the judgement and the fault guarantee, `diff`.
//! 4. [`tools`] (`src/tools/`): what is built on running: [`certify`] (transport certification), [`selftest`] (the
//!    oracle's mutation self-test), [`swarm`] (fault swarms), [`shrink`] (minimal failing scenarios), [`render`]
//!    (stable text for golden files and the CLI).
//! 5. [`cli`]: the `kvrelay` command line (with `bench` and `replay`); the only module that prints or exits.
//!
//! The modules of each layer are re-exported at the crate root (`kvrelay::plan`, `kvrelay::engine`, ...).

#[macro_use]
pub mod pure;
pub use pure::{faults, limits, model, plan, scenario, seed, verify, wire};

pub mod fabric;

pub mod running;
pub use running::{control, engine, exec, external, harness, parallel, process};

pub mod tools;
pub use tools::{certify, explain, from_config, matrix, render, report, selftest, shard, shrink, swarm};

pub mod cli;
