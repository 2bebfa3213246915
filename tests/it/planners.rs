//! External planners in the prefill ranks' seat (`kvrelay check --planner CMD`, the plan protocol of
//! src/running/external/README.md): kvrelay's own planner behind the protocol passes the whole corpus; a planner that
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
    // tests/planners/schema_proxy.py checks each line against src/running/external/schema/ and exits on a violation.
    let proxied = format!("python3 tests/planners/schema_proxy.py {} planner", env!("CARGO_BIN_EXE_kvrelay"));
    for dir in ["scenarios/basic", "scenarios/state", "scenarios/draft", "scenarios/engines"] {
        let (passed, output) = check(dir, &proxied, "60");
        assert!(passed, "{output}");
    }
}

/// Writes `yaml` as a known-differences file unique to `name` and returns its path.
fn known_file(name: &str, yaml: &str) -> String {
    let path = std::env::temp_dir().join(format!("kvrelay-known-{}-{name}.yaml", std::process::id()));
    std::fs::write(&path, yaml).unwrap();
    path.display().to_string()
}

fn check_known(target: &str, planner: &str, known: &str) -> (bool, String) {
    let output = kvrelay(&["check", target, "--planner", planner, "--planner-timeout", "30", "--known", known]);
    (output.status.success(), format!("{}{}", text(&output.stdout), text(&output.stderr)))
}

const SILENT: &str = "a={'type':q['type'],'id':q['id']}\n    if q['type']=='plan': a['copies']=[]";

#[test]
fn a_known_difference_for_a_passing_scenario_fails_the_run() {
    let reference = format!("{} planner", env!("CARGO_BIN_EXE_kvrelay"));
    let known = known_file(
        "gone",
        "- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: once differed\n  sglang: [mooncake/conn.py:1188]\n  \
         failure: oracle violations\n",
    );
    let (passed, output) = check_known("scenarios/basic", &reference, &known);
    assert!(!passed, "{output}");
    assert!(
        output.contains(
            "FAIL  mla-tp2-to-tp4.yaml: listed as a known upstream difference but passes: the difference is gone, \
             remove the entry for scenarios/basic/mla-tp2-to-tp4.yaml"
        ),
        "{output}"
    );
    assert_eq!(output.lines().filter(|line| line.starts_with("FAIL  ")).count(), 1, "{output}");
}

#[test]
fn a_listed_failure_passes_as_known_and_an_unlisted_or_different_one_fails_the_run() {
    let planner = python_planner(SILENT);
    let entry = |failure: &str| {
        format!(
            "- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: sends nothing at all\n  sglang:\n    - \
             mooncake/conn.py:1019-1170\n  failure: \"{failure}\"\n"
        )
    };
    // Listed, failing as recorded: reported as known with its reason and source lines, and the run passes.
    let known = known_file("listed", &entry("layer 0 kv, row 16: expected token 48 of request 0"));
    let (passed, output) = check_known("scenarios/basic/mla-tp2-to-tp4.yaml", &planner, &known);
    assert!(passed, "{output}");
    assert!(
        output.contains("known upstream difference  scenarios/basic/mla-tp2-to-tp4.yaml: sends nothing at all"),
        "{output}"
    );
    assert!(output.contains("upstream: mooncake/conn.py:1019-1170"), "{output}");
    assert!(
        output.contains("0 of 1 scenarios pass with test in the planner's seat; 1 known upstream differences"),
        "{output}"
    );
    // Listed, but failing otherwise than recorded.
    let known = known_file("different", &entry("planner protocol error"));
    let (passed, output) = check_known("scenarios/basic/mla-tp2-to-tp4.yaml", &planner, &known);
    assert!(!passed, "{output}");
    assert!(
        output.contains(
            "fails differently than its known upstream difference records (expected a failure containing `planner \
             protocol error`): "
        ),
        "{output}"
    );
    // Not listed: fails the run as without --known, beside a listed one that is known.
    let (passed, output) = check_known("scenarios/basic", &planner, &known_file("other", &entry("expected token")));
    assert!(!passed, "{output}");
    assert!(output.contains("known upstream difference  mla-tp2-to-tp4.yaml"), "{output}");
    assert!(output.contains("FAIL  mla-tp4-to-tp2.yaml: "), "{output}");
}

#[rstest::rstest]
#[case::unknown_field(
    "- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: r\n  sglang: [a.py:1]\n  failure: f\n  why: x\n",
    "unknown field `why`"
)]
#[case::missing_field(
    "- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  sglang: [a.py:1]\n  failure: f\n",
    "missing field `reason`"
)]
#[case::no_citation(
    "- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: r\n  sglang: []\n  failure: f\n",
    "field `sglang`: cites no source line"
)]
#[case::bad_citation(
    "- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: r\n  sglang: [mooncake/conn.py]\n  failure: f\n",
    "field `sglang`: `mooncake/conn.py` is not `path:line`"
)]
#[case::no_scenario(
    "- scenario: scenarios/no-such.yaml\n  reason: r\n  sglang: [a.py:1]\n  failure: f\n",
    "field `scenario`: no such scenario file"
)]
#[case::empty_failure(
    "- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: r\n  sglang: [a.py:1]\n  failure: ' '\n",
    "field `failure`: empty"
)]
#[case::twice("- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: r\n  sglang: [a.py:1]\n  failure: f\n- scenario: scenarios/basic/mla-tp2-to-tp4.yaml\n  reason: r\n  sglang: [a.py:1]\n  failure: f\n", "entry 1 (scenarios/basic/mla-tp2-to-tp4.yaml): field `scenario`: the scenario is already listed by entry 0")]
fn a_bad_known_file_is_refused_naming_the_file_and_field(#[case] yaml: &str, #[case] expected: &str) {
    let name = expected.chars().filter(char::is_ascii_alphanumeric).take(12).collect::<String>();
    let known = known_file(&name, yaml);
    let reference = format!("{} planner", env!("CARGO_BIN_EXE_kvrelay"));
    let (passed, output) = check_known("scenarios/basic/baseline-tp1-to-tp1.yaml", &reference, &known);
    assert!(!passed, "{output}");
    assert!(output.contains(&known), "{output}");
    assert!(output.contains(expected), "{output}");
    assert!(!output.contains("panicked"), "{output}");
}

/// The SGLang adapter's known differences (tests/planners/sglang/known-differences.yaml) name existing scenarios,
/// each with a reason, a failure and at least one `file:line` in the SGLang wheel; kvrelay accepts the file.
#[test]
fn sglangs_known_differences_parse_and_cite_existing_scenarios_and_source_lines() {
    let path = "tests/planners/sglang/known-differences.yaml";
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap();
    let entries: Vec<serde_yaml_ng::Value> = serde_yaml_ng::from_str(&text).unwrap();
    assert!(!entries.is_empty());
    for entry in &entries {
        let scenario = entry["scenario"].as_str().unwrap();
        assert!(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(scenario).is_file(), "{scenario}");
        assert!(!entry["reason"].as_str().unwrap().trim().is_empty(), "{scenario}");
        assert!(!entry["failure"].as_str().unwrap().trim().is_empty(), "{scenario}");
        let cites = entry["sglang"].as_sequence().unwrap();
        assert!(!cites.is_empty(), "{scenario}");
        for cite in cites {
            let (file, lines) = cite.as_str().unwrap().rsplit_once(':').unwrap();
            assert!(file.ends_with(".py"), "{scenario}: {file}");
            assert!(lines.split('-').all(|n| n.parse::<u32>().is_ok_and(|n| n > 0)), "{scenario}: {lines}");
        }
    }
    // kvrelay's own strict reading of the file accepts it (a scenario no entry lists passes with the reference).
    let reference = format!("{} planner", env!("CARGO_BIN_EXE_kvrelay"));
    let (passed, output) = check_known("scenarios/basic/baseline-tp1-to-tp1.yaml", &reference, path);
    assert!(passed, "{output}");
    assert!(output.contains(&format!("0 known upstream differences ({path}); 0 fail")), "{output}");
}
