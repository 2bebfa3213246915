//! kvrelay: byte-exact simulation and conformance harness for prefill → decode KV-cache transfer.
//!
//! The pipeline is scenario → problem → per-rank engines over the wire and the verbs seam → observation → verdict
//! per decode rank.
//! ARCHITECTURE.md has the full map; the modules, in dependency order:
//!
//! - [`model`]: pure vocabulary (ranks, topologies, model geometry, registered regions, requests).
//!   Start at [`model::Problem`].
//! - [`limits`]: every size, count and depth limit, in one place (README.md lists them).
//! - [`seed`]: the seed and its named random streams ([`seed::SimRng`], ChaCha8 from the rand ecosystem, keyed by
//!   the seed, one stream per name, so streams never alias across seeds nor shift each other's draws).
//! - [`faults`]: seeded faults as data (fault kinds, rules, plans), as a scenario's `faults:` list names them; the
//!   fabric injects them ([`fabric::faults`]).
//! - [`scenario`]: YAML scenario files → [`model::Problem`] plus the expected verdict; the only module that knows YAML.
//! - [`plan`]: the pure planner: `link(Local, &Peer)` per connection from a decoded registration, `Link::chunk_groups`
//!   per chunk, and `plan(&Problem)` composing them (domain.md §2–§4, §6.3).
//! - [`verify`]: the independent oracle; the source byte pattern, row decoding and `check`. Never calls `plan`.
//! - [`wire`]: the Mori control messages as bytes (registration, request metadata, status; domain.md §6.2).
//! - [`fabric`]: the verbs-shaped seam [`fabric::verbs::Endpoint`] and its in-memory, simulated-time
//!   [`fabric::world::SimWorld`], and the injection of seeded faults ([`fabric::faults`]); nothing here knows plans, models
//!   or the oracle.
//! - [`engine`]: prefill and decode ranks as sans-IO engines (domain.md §6), the deterministic simulation that
//!   drives them over [`fabric::world::SimWorld`], and the live driver ([`engine::live`]) that drives the same
//!   engines on a real clock over a NIC.
//! - [`external`]: other planners in the prefill ranks' seat over the plan protocol (JSON lines; the reference is
//!   kvrelay's own planner).
//! - [`control`]: the control plane between rank processes: the TCP bootstrap hub, its client and the frame codec.
//! - [`process`]: ranks as processes: `serve` one rank, `launch` them all and gather the decode verdicts.
//! - [`exec`]: the direct execution of a composed plan on one all-ranks [`exec::Transport`] (the benchmark's
//!   baseline).
//! - [`harness`]: one scenario end to end through the engines on a chosen fabric, its pass/fail judgement, the fault
//!   guarantee (every request Success byte-exact or Failed with a reason, no hang) that judges a faulted run, and the
//!   byte-for-byte `diff` of two fabrics.
//! - [`certify`]: transport certification: the versioned case set run through a [`certify::Transport`], JUnit XML,
//!   JSON report and manifest.
//! - [`selftest`]: the oracle's mutation self-test: known layout bugs planted in kvrelay's own plans, in the planner's
//!   seat, each required to be caught by the oracle (`kvrelay selftest`).
//! - [`swarm`]: swarm runs drawing a random subset of seeded faults ([`faults`]) per seed, each judged by the fault
//!   guarantee ([`harness::guarantee()`]).
//! - [`shrink`]: a failing scenario (its own run, a self-test mutant, an external planner) reduced to a minimal one that
//!   fails the same way, by greedy delta debugging over its YAML ([`scenario::reduce`]); `kvrelay shrink`.
//! - [`render`]: stable text for golden files and the CLI.
//! - [`cli`]: the `kvrelay` command line; the only module that prints or exits.

#[macro_use]
mod kinds;

pub mod certify;
pub mod cli;
pub mod control;
pub mod engine;
pub mod exec;
pub mod external;
pub mod fabric;
pub mod faults;
pub mod harness;
pub mod limits;
pub mod model;
pub mod plan;
pub mod process;
pub mod render;
pub mod scenario;
pub mod seed;
pub mod selftest;
pub mod shrink;
pub mod swarm;
pub mod verify;
pub mod wire;
