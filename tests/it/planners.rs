//! External planners in the prefill ranks' seat (`kvrelay check --planner CMD`, the plan protocol of
//! src/external/README.md): kvrelay's own planner behind the protocol passes the whole corpus; a planner that
//! misplaces bytes is caught by the oracle in coordinates; one that crashes, hangs, answers garbage or speaks
//! another version fails its cases with the reason and never stalls the run.

use crate::support::{kvrelay, text};

/// A planner in Python: `body` handles each parsed query `q` and returns the answer object (a hello is answered
/// before it is called).
fn python_planner(body: &str) -> String {
    let script = format!(
        "import json,sys\n\
         for line in sys.stdin:\n    q=json.loads(line)\n    \
         if q['type']=='hello':\n        print(json.dumps({{'type':'hello','protocol':'kvrelay-plan','version':1,'planner':'test'}}),flush=True)\n        continue\n    \
         {body}\n    print(json.dumps(a),flush=True)\n"
    );
    format!("python3 -c \"{}\"", script.replace('"', "\\\""))
}

fn check(target: &str, planner: &str, timeout: &str) -> (bool, String) {
    let output = kvrelay(&["check", target, "--planner", planner, "--planner-timeout", timeout]);
    (output.status.success(), format!("{}{}", text(&output.stdout), text(&output.stderr)))
}

#[test]
fn kvrelays_own_planner_behind_the_protocol_passes_the_corpus() {
    let reference = format!("{} planner", env!("CARGO_BIN_EXE_kvrelay"));
    let (passed, output) = check("scenarios", &reference, "60");
    assert!(passed, "{output}");
    assert!(output.contains("scenarios pass with kvrelay reference planner"), "{output}");
    assert!(!output.contains("FAIL"), "{output}");
}

#[test]
fn a_planner_that_sends_nothing_is_caught_by_the_oracle_in_coordinates() {
    let planner = python_planner("a={'type':q['type'],'id':q['id']}\n    if q['type']=='plan': a['copies']=[]");
    let (passed, output) = check("scenarios/basic/mla-tp2-to-tp4.yaml", &planner, "30");
    assert!(!passed, "{output}");
    assert!(output.contains("FAIL  scenarios/basic/mla-tp2-to-tp4.yaml: "), "{output}");
    assert!(output.contains("oracle violations"), "{output}");
    assert!(output.contains("decode pp0/tp0, layer 0 kv, row "), "{output}");
    assert!(output.contains(": expected token "), "{output}");
    assert!(
        output.contains("reproduce: cargo run --release -- check scenarios/basic/mla-tp2-to-tp4.yaml --planner"),
        "{output}"
    );
}

#[test]
fn a_planner_that_accepts_what_must_be_rejected_is_reported_as_a_missing_rejection() {
    let reference = format!("{} planner", env!("CARGO_BIN_EXE_kvrelay"));
    // Links everything, then plans as kvrelay would: the registration-time rejection is missing.
    let planner = python_planner("a={'type':q['type'],'id':q['id']}\n    if q['type']=='plan': a['copies']=[]");
    let (passed, output) = check("scenarios/rejections/dcp-2-to-8.yaml", &planner, "30");
    assert!(!passed, "{output}");
    assert!(output.contains("request 0 on decode pp0/tp0 succeeded"), "{output}");
    let (passed, output) = check("scenarios/rejections/dcp-2-to-8.yaml", &reference, "30");
    assert!(passed, "{output}");
}

#[rstest::rstest]
#[case::crash("python3 -c \"import sys; sys.stdin.readline(); print('{\\\"type\\\":\\\"hello\\\",\\\"protocol\\\":\\\"kvrelay-plan\\\",\\\"version\\\":1}', flush=True); sys.exit(3)\"", "the planner exited")]
#[case::garbage("python3 -c \"import sys\nfor line in sys.stdin: print('{\\\"type\\\":\\\"hello\\\",\\\"protocol\\\":\\\"kvrelay-plan\\\",\\\"version\\\":1}' if 'hello' in line else 'garbage', flush=True)\"", "the answer is not JSON")]
#[case::version("python3 -c \"import sys; sys.stdin.readline(); print('{\\\"type\\\":\\\"hello\\\",\\\"protocol\\\":\\\"kvrelay-plan\\\",\\\"version\\\":9}', flush=True); sys.stdin.read()\"", "the planner speaks version 9, kvrelay speaks 1")]
#[case::missing("no-such-planner-command-here", "the planner exited")]
fn a_broken_planner_fails_each_case_with_the_reason(#[case] planner: &str, #[case] reason: &str) {
    let (passed, output) = check("scenarios/engines", planner, "10");
    assert!(!passed, "{output}");
    let fails = output.lines().filter(|line| line.starts_with("FAIL  ")).count();
    assert_eq!(fails, 4, "{output}");
    for line in output.lines().filter(|line| line.starts_with("FAIL  ")) {
        assert!(line.contains(&format!("planner protocol error: {reason}")), "{line}\n{output}");
    }
}

#[test]
fn a_hanging_planner_fails_each_case_at_its_deadline_and_the_run_goes_on() {
    let planner = python_planner("import time; time.sleep(600); a={}");
    let (passed, output) = check("scenarios/engines", &planner, "1");
    assert!(!passed, "{output}");
    let fails: Vec<&str> = output.lines().filter(|line| line.starts_with("FAIL  ")).collect();
    assert_eq!(fails.len(), 4, "{output}");
    for line in fails {
        assert!(line.contains("planner protocol error: no answer within"), "{line}");
    }
}

#[test]
fn every_query_and_answer_keeps_the_json_schemas() {
    // tests/planners/schema_proxy.py checks each line against src/external/schema/ and exits on a violation.
    let proxied = format!("python3 tests/planners/schema_proxy.py {} planner", env!("CARGO_BIN_EXE_kvrelay"));
    for dir in ["scenarios/basic", "scenarios/state", "scenarios/draft", "scenarios/engines"] {
        let (passed, output) = check(dir, &proxied, "60");
        assert!(passed, "{output}");
    }
}
