//! The connector seat (`kvrelay check --connector CMD`): a transport child that also sits in every prefill rank's
//! seat and sends each room itself. The reference connector (`tests/transports/memcpy_connector.py`, kvrelay's own
//! planner behind it) passes the corpus it is given byte for byte; its planted lost copy is caught by the oracle
//! with coordinates; a rejection is judged against the scenario's expectation; a connector that breaks the protocol
//! is named with the op and the field.

use crate::support::{kvrelay, text};

/// The reference connector's command line, with kvrelay's own planner (this build) behind it.
fn connector(flags: &str) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    format!("python3 {root}/tests/transports/memcpy_connector.py --kvrelay {} {flags}", env!("CARGO_BIN_EXE_kvrelay"))
}

fn check(target: &str, command: &str) -> (bool, String) {
    let output = kvrelay(&["check", target, "--connector", command]);
    (output.status.success(), text(&output.stdout) + &text(&output.stderr))
}

#[test]
fn the_reference_connector_passes_every_engine_scenario_byte_for_byte() {
    let (passed, out) = check("scenarios/engines", &connector(""));
    assert!(passed, "{out}");
    assert!(out.contains("4 of 4 scenarios pass with child:memcpy-connector 1 in the connector seat"), "{out}");
}

#[test]
fn a_connector_that_loses_a_copy_is_caught_with_coordinates() {
    let (passed, out) = check("scenarios/basic/mla-tp2-to-tp4.yaml", &connector("--plant-lost-copy"));
    assert!(!passed, "{out}");
    assert!(out.contains("FAIL") && out.contains("oracle violations"), "{out}");
    assert!(out.contains("found sentinel (never written)") && out.contains("decode pp0/tp"), "{out}");
    assert!(
        out.contains("reproduce: cargo run --release -- check scenarios/basic/mla-tp2-to-tp4.yaml --connector"),
        "{out}"
    );
}

#[test]
fn a_connector_rejection_is_judged_against_the_expectation() {
    // kvrelay's planner (behind the reference connector) rejects what the scenario expects rejected.
    let (passed, out) = check("scenarios/rejections/dcp-2-to-8.yaml", &connector(""));
    assert!(passed, "{out}");
}

#[test]
fn a_connector_answering_a_malformed_verdict_is_named_with_the_field() {
    let (passed, out) = check("scenarios/basic/mla-tp2-to-tp4.yaml", &connector("--plant-malformed-verdict"));
    assert!(!passed, "{out}");
    assert!(out.contains("op `seat_send`: field `rejected`: expected a text"), "{out}");
}
