//! Shrinking (`kvrelay shrink`): a failing scenario reduced to a strictly smaller one that still fails the same way,
//! written as a scenario file that loads and fails again; passing scenarios and unknown mutants refused; the same
//! input gives the byte-identical file.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use kvrelay::engine::seat::SharedPlanner;
use kvrelay::harness::{self, Budget};
use kvrelay::scenario::{self, reduce::Draft};
use kvrelay::selftest::{Mutant, MutantPlanner};
use kvrelay::shrink::{self, Mode};

use crate::support::{kvrelay, text};

const MULTI_REQUEST: &str = "scenarios/basic/mla-tp2-to-tp4.yaml";

fn corpus_text(file: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(file)).unwrap()
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvrelay-shrink-{name}-{}.yaml", std::process::id()))
}

#[test]
fn shrinking_a_caught_mutant_gives_a_smaller_scenario_that_fails_the_same_way() {
    let budget = Budget::bytes(1 << 30);
    let mode = Mode::Mutant(Mutant::FinalPageOffByOne);
    let shrunk = shrink::shrink(&corpus_text(MULTI_REQUEST), MULTI_REQUEST, None, &mode, &budget, 500).unwrap();
    // Strictly smaller by the shrinker's own order, and in the reported dimensions: the two requests became one and
    // the bytes went down, so the candidates were really applied, not just re-serialised.
    assert!(shrunk.after.key() < shrunk.before.key(), "{:?} is not below {:?}", shrunk.after, shrunk.before);
    assert!(shrunk.after.requests < shrunk.before.requests, "{:?}", shrunk.after);
    assert!(shrunk.after.bytes < shrunk.before.bytes, "{:?}", shrunk.after);
    assert!(!shrunk.capped);
    assert_eq!(shrunk.signature.class, "oracle", "{}", shrunk.signature);
    // Re-run the result independently: the mutant in the seat still breaks the oracle with the original signature,
    // and kvrelay's own planner in the same seat passes it (the failure is the mutant's, not the scenario's).
    let loaded = scenario::parse(&shrunk.yaml, "shrunk.yaml", "shrunk").unwrap();
    let planted = Rc::new(RefCell::new(MutantPlanner::new(Some(Mutant::FinalPageOffByOne))));
    let outcome = harness::run_with_planner(&loaded, &budget, SharedPlanner(planted)).unwrap();
    assert!(shrink::signatures(&outcome).contains(&shrunk.signature), "{:?}", outcome.failures);
    let own = Rc::new(RefCell::new(MutantPlanner::new(None)));
    assert!(harness::run_with_planner(&loaded, &budget, SharedPlanner(own)).unwrap().passed());
}

#[test]
fn the_written_file_loads_fails_again_and_is_byte_identical_run_to_run() {
    // The same --out both times: the reproduce line in the header names the file.
    let first = temp("mutant");
    let mut files = Vec::new();
    for out in [&first, &first] {
        let output =
            kvrelay(&["shrink", MULTI_REQUEST, "--mutant", "final-page-off-by-one", "--out", out.to_str().unwrap()]);
        let stdout = text(&output.stdout);
        assert!(output.status.success(), "{stdout}{}", text(&output.stderr));
        assert!(stdout.contains("before ") && stdout.contains("after ") && stdout.contains("reproduce: "), "{stdout}");
        files.push(std::fs::read(out).unwrap());
    }
    assert_eq!(files[0], files[1], "the same input gave two different files");
    let written = text(&files[0]);
    assert!(written.starts_with("# Shrunk by `kvrelay shrink` from "), "{written}");
    assert!(written.contains("# Reproduces: oracle: "), "{written}");
    // The file loads as a scenario and the self-test catches the mutant on it (`C`: by the oracle's byte checks).
    scenario::load(&first).unwrap();
    let output = kvrelay(&["selftest", first.to_str().unwrap(), "--mutant", "final-page-off-by-one"]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.lines().last().unwrap().contains("1 caught"), "{stdout}");
    std::fs::remove_file(&first).unwrap();
}

#[test]
fn a_scenario_failing_its_own_run_shrinks_to_a_file_whose_run_fails() {
    let input = temp("own-input");
    // A wrong expectation: the transfer is clean but the file promises a rejection, so the run fails.
    let failing = corpus_text(MULTI_REQUEST).replace("expect: ok", "expect: {error: missing_layer}");
    std::fs::write(&input, failing).unwrap();
    let out = temp("own-output");
    let output = kvrelay(&["shrink", input.to_str().unwrap(), "--seed", "5", "--out", out.to_str().unwrap()]);
    assert!(output.status.success(), "{}{}", text(&output.stdout), text(&output.stderr));
    let written = std::fs::read_to_string(&out).unwrap();
    // The seed in effect is written into the file, so the reproduce line needs no flag.
    assert!(written.contains("\nseed: 5\n"), "{written}");
    let rerun = kvrelay(&["run", out.to_str().unwrap()]);
    assert!(!rerun.status.success(), "the shrunk scenario passes: {}", text(&rerun.stdout));
    let loaded = scenario::load(&out).unwrap();
    assert_eq!(loaded.problem.requests.len(), 1);
    for path in [&input, &out] {
        std::fs::remove_file(path).unwrap();
    }
}

#[test]
fn a_passing_scenario_is_refused_with_a_clear_message() {
    let out = temp("passing");
    let output = kvrelay(&["shrink", MULTI_REQUEST, "--out", out.to_str().unwrap()]);
    let stderr = text(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("does not fail (its run passes)"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.exists(), "a refused shrink wrote {}", out.display());
}

#[test]
fn an_unknown_mutant_and_a_mutant_that_cannot_apply_are_refused() {
    let output = kvrelay(&["shrink", MULTI_REQUEST, "--mutant", "no-such-mutant"]);
    assert!(!output.status.success());
    assert!(text(&output.stderr).contains("no mutant `no-such-mutant`"), "{}", text(&output.stderr));
    // GQA replication needs MHA heads; the MLA scenario cannot show it.
    let output = kvrelay(&["shrink", MULTI_REQUEST, "--mutant", "gqa-replication-formula"]);
    let stderr = text(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("cannot change a byte"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn fault_rules_are_proposed_for_dropping_and_lowering_in_a_fixed_order() {
    // No faulted corpus scenario breaks the guarantee (that is the point of it), so the fault reductions are checked
    // at the YAML level: they are proposed, in a fixed order, and the dropped rule is really gone.
    let text = corpus_text("scenarios/faults/torn-write.yaml");
    let draft = Draft::parse(&text).unwrap();
    let candidates = draft.candidates(8, &[0, 1, 2, 3, 4, 5, 6, 7]);
    let names: Vec<&str> = candidates.iter().map(|candidate| candidate.what.as_str()).collect();
    assert!(names.contains(&"drop fault rule 0"), "{names:?}");
    assert!(names.contains(&"halve fault rule 0's probability to 0.01"), "{names:?}");
    assert!(names.contains(&"drop request 1"), "{names:?}");
    let again: Vec<String> =
        draft.candidates(8, &[0, 1, 2, 3, 4, 5, 6, 7]).into_iter().map(|candidate| candidate.draft.to_yaml()).collect();
    let first: Vec<String> = candidates.iter().map(|candidate| candidate.draft.to_yaml()).collect();
    assert_eq!(first, again, "the candidates differ between two calls");
    let dropped = &candidates[names.iter().position(|name| *name == "drop fault rule 0").unwrap()];
    let loaded = scenario::parse(&dropped.draft.to_yaml(), "dropped.yaml", "dropped").unwrap();
    assert!(loaded.faults.rules.is_empty(), "{:?}", loaded.faults);
}

#[test]
fn the_run_cap_stops_the_reduction_and_says_so() {
    let mode = Mode::Mutant(Mutant::FinalPageOffByOne);
    let budget = Budget::bytes(1 << 30);
    let shrunk = shrink::shrink(&corpus_text(MULTI_REQUEST), MULTI_REQUEST, None, &mode, &budget, 2).unwrap();
    // Unbounded, this shrink keeps 13 reductions; two runs can keep at most two, and the result says it is capped.
    assert!(shrunk.capped);
    assert_eq!(shrunk.runs, 2);
    assert!(shrunk.steps.len() <= 2, "{:?}", shrunk.steps);
    let header = shrink::header(MULTI_REQUEST, "a test", &shrunk, "kvrelay run x");
    assert!(header.contains("The run cap stopped the reduction after 2 runs"), "{header}");
}

#[test]
fn an_external_planner_that_sends_nothing_shrinks_to_a_file_it_still_fails() {
    // A planner in Python that answers every plan query with no copies: the oracle finds the decode pages untouched.
    let script = temp("planner").with_extension("py");
    std::fs::write(
        &script,
        "import json,sys\n\
         for line in sys.stdin:\n    q=json.loads(line)\n    \
         if q['type']=='hello':\n        \
         print(json.dumps({'type':'hello','protocol':'kvrelay-plan','version':1,'planner':'empty'}),flush=True)\n        \
         continue\n    a={'type':q['type'],'id':q['id']}\n    \
         if q['type']=='plan': a['copies']=[]\n    print(json.dumps(a),flush=True)\n",
    )
    .unwrap();
    let planner = format!("python3 {}", script.display());
    let out = temp("planner-out");
    let output = kvrelay(&["shrink", MULTI_REQUEST, "--planner", &planner, "--out", out.to_str().unwrap()]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", text(&output.stderr));
    assert!(stdout.contains("fails as: oracle: layer N kv: wrong bytes, found sentinel"), "{stdout}");
    assert!(stdout.contains("reproduce: cargo run --release -- check "), "{stdout}");
    // The reproduce command's own check fails the shrunk file with the same planner.
    let check = kvrelay(&["check", out.to_str().unwrap(), "--planner", &planner]);
    assert!(!check.status.success(), "{}", text(&check.stdout));
    assert_eq!(scenario::load(&out).unwrap().problem.requests.len(), 1);
    for path in [&script, &out] {
        std::fs::remove_file(path).unwrap();
    }
}
