//! Real RDMA verbs (cargo feature `rdma`): the engines over the verbs fabric land every byte the in-memory fabric
//! lands, and ranks as processes gather their verdicts, or fail the requests of a rank that never connects within
//! the deadlines. Runs on a device (Soft-RoCE in the CI guest: ci/rdma.sh); `KVRELAY_RDMA_DEVICE` names it
//! (default: the first device with an active port). The transport conformance suite runs here too
//! (`conformance.rs`, backend `Rdma`).

use kvrelay::harness::{self, Budget, Fabric};

fn device() -> Option<String> {
    std::env::var("KVRELAY_RDMA_DEVICE").ok()
}

use crate::support::{kvrelay, text};

#[test]
fn rdma_engines_land_the_same_bytes_as_the_simulation() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/engines/dcp-relayout-two-stages.yaml");
    let scenario = kvrelay::scenario::load(&path).unwrap();
    let report = harness::diff(&scenario, &Budget::bytes(1 << 30), &Fabric::Rdma { device: device() }).unwrap();
    assert!(report.other.passed(), "rdma: {:?}", report.other.failures);
    assert!(report.differences.is_empty(), "{}", report.differences[0]);
    // Token-granular DCP relayout: 944 token-row copies, gathered (fabric/gather.rs, up to 30 entries a write on
    // both fabrics) into the same 80 writes, every one confirmed by a completion.
    assert_eq!(report.other.observation.writes.len(), report.reference.observation.writes.len());
    let operations = |outcome: &kvrelay::harness::Outcome| outcome.engine.as_ref().map(|run| run.operations);
    assert_eq!((operations(&report.other), operations(&report.reference)), (Some(80), Some(80)));
}

#[test]
fn rdma_launch_runs_each_rank_as_a_process_and_gathers_their_verdicts() {
    let mut args = vec!["launch", "scenarios/engines/dcp-relayout-two-stages.yaml", "--fabric", "rdma"];
    let device = device();
    if let Some(device) = &device {
        args.extend(["--device", device]);
    }
    let output = kvrelay(&args);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", text(&output.stderr));
    for rank in ["decode 0 (pp0/tp0)", "decode 1 (pp0/tp1)"] {
        assert!(stdout.contains(&format!("{rank}: 2 of 2 requests succeeded, 0 violations")), "{stdout}");
    }
    assert!(stdout.contains("pass dcp-relayout-two-stages (4 processes"), "{stdout}");
}

#[test]
fn rdma_launch_fails_the_requests_of_a_rank_that_never_connects_within_the_deadline() {
    let mut args = vec![
        "launch",
        "scenarios/engines/dcp-relayout-two-stages.yaml",
        "--fabric",
        "rdma",
        "--omit",
        "prefill:1",
        "--connect-timeout",
        "3",
        "--timeout",
        "6",
    ];
    let device = device();
    if let Some(device) = &device {
        args.extend(["--device", device]);
    }
    let output = kvrelay(&args);
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(!output.status.success(), "{stdout}");
    assert!(stdout.contains("hub: prefill pp1/tp0 never connected"), "{stdout}");
    // Every decode rank needs stage 1: its requests time out and fail; nothing hangs, no byte lands wrong.
    for rank in ["decode 0 (pp0/tp0)", "decode 1 (pp0/tp1)"] {
        assert!(stdout.contains(&format!("{rank}: 0 of 2 requests succeeded, 0 violations")), "{stdout}");
    }
    assert!(stderr.contains("failed: timed out after 6000000000 ns waiting for the prefill side"), "{stderr}");
}
