//! The one integration test binary. Debug a failure with `cargo test --test it -- <name> --nocapture`;
//! golden mismatches are reviewed with `cargo insta review` (or `cargo insta test --accept` after reading them).

/// The abort and its acknowledgement: a failed room's pages are released only after its writes drained.
mod aborts;
/// Named planner and oracle cases (rstest): rejections, sender roles, deliberate corruption.
mod cases;
/// The certification kit: sound transports certified, broken ones not, with the JUnit, JSON and manifest files.
mod certify;
/// The child-process fabric (kvrelay-transport-1): the reference child certified, misbehaving children, Mooncake.
mod child_transport;
/// The `kvrelay` binary end to end.
mod cli;
/// The fabric seam's conformance suite (`certify::conformance`) on every backend, and proof its cases can fail.
mod conformance;
/// The connector seat: a transport child that sends every room itself, judged by the oracle.
mod connector;
/// Determinism and replay: seeded placement, the trace hash, `--check-determinism`, `--trace-out`, `KVRELAY_SEED`.
mod determinism;
/// Decode memory judged where it lives: the oracle's resident path (every machine) and the `cuda` fabric (a GPU).
mod device;
/// Real transfer engines in the seat: NIXL (feature `nixl`), a missing library's error.
mod engines;
/// `kvrelay explain`: the SGLang code paths a scenario's transfers take.
mod explain;
/// Delays, reorders, a hung queue pair and a read after release (the fault kinds after the first ten).
mod fault_kinds;
mod faults;
/// `kvrelay scenario from-config`: real models' config.json imported as their presets; refusals by field.
mod from_config;
/// Every scenarios/**/*.yaml against its golden/ layout via insta (the corpus test).
mod golden;
/// Hostile scenario files: edge values, arbitrary bytes and kept fuzz crashes never panic.
mod hostile;
mod kinds;
/// Work beyond one process and machine: `kvrelay serve` placed by torchrun-style environments and a real `mpirun`
/// with no per-rank arguments; a swarm split with `--shard` and merged back.
mod launchers;
/// The live driver, `diff`, and the bootstrap hub of ranks as processes.
mod live;
/// Scenario loader diagnostics: unknown fields, file/line/field paths.
mod loader;
/// The compatibility matrix: the README's table current, every verdict kind present.
mod matrix;
/// External planners over the plan protocol: the reference passes, broken ones fail with reasons.
mod planners;
/// C ABI transport plug-ins: the sample in C built with `cc`, its contract, its planted bug caught, load errors.
mod plugin;
/// Proptest invariants over random topologies (domain.md §12).
mod props;
/// Real RDMA verbs: engines over the verbs fabric, ranks as processes (feature `rdma`, run in the CI guest).
#[cfg(feature = "rdma")]
mod rdma;
/// `kvrelay report`: HTML pages of a clean and a broken run, rendered in headless Chromium and judged by pixels.
mod report;
/// The JSON Schemas of src/schemas/: current, and every scenario and emitted document valid against them.
mod schemas;
/// The mutation self-test: every planted layout bug caught on a named scenario, no false alarm, `n/a` kept apart.
mod selftest;
/// Shrinking: a failing scenario reduced, still failing the same way; refusals; byte-identical output.
mod shrink;
/// Strided entries through the seam: the plan's descriptors as repeated entries land every byte per-row entries do.
mod strided;
/// Shared `#[track_caller]` helpers: scenario builders and pipeline runners.
mod support;
/// Repository hygiene: module docs, purity of pure modules, scenario headers, golden coverage.
mod tidy;
/// Verdicts: failed requests are judged too, and one decode rank can be judged alone.
mod verdicts;
/// Wire messages (domain.md §6.2): golden bytes, legacy defaults, malformed-input errors, round trips, no panics.
mod wire;
