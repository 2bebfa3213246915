//! Determinism and replay: the same scenario and seed give the same placement and the same event trace (hash);
//! another seed moves pages; `--check-determinism`, `--trace-out` and `KVRELAY_SEED` on `kvrelay run`; a failure's
//! reproduce line names the seed in effect.

use std::path::{Path, PathBuf};

use kvrelay::engine::sim::SimOptions;
use kvrelay::engine::trace;
use kvrelay::harness::{self, Budget};
use kvrelay::scenario;
use sha2::{Digest as _, Sha256};

use crate::support::{kvrelay, kvrelay_with_env, text};

/// Allocator-placed pages on both sides (no page lists in the file), four decode ranks, two chunks.
const SCENARIO: &str = "scenarios/basic/mla-tp2-to-tp4.yaml";

fn path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// The event trace of one simulated run of `SCENARIO` under `seed`.
fn traced(seed: u64) -> Vec<trace::TraceEvent> {
    let scenario = scenario::load_seeded(&path(SCENARIO), Some(seed)).unwrap();
    let options = SimOptions { trace: true, ..SimOptions::default() };
    let outcome = harness::run_with(&scenario, &Budget::bytes(1 << 30), &options).unwrap();
    assert!(outcome.passed(), "seed {seed}: {}", outcome.failure_text("; "));
    outcome.engine.unwrap().trace
}

/// The `trace hash: <hex> (<n> events)` line of `kvrelay run`: the hash and the count.
fn trace_hash_line(stdout: &str) -> (String, usize) {
    let line = stdout.lines().find_map(|line| line.strip_prefix("trace hash: ")).unwrap_or_else(|| panic!("{stdout}"));
    let (hash, rest) = line.split_once(' ').unwrap();
    let count = rest.trim_start_matches('(').trim_end_matches(" events)").parse().unwrap();
    assert_eq!(hash.len(), 64, "{line}");
    (hash.to_owned(), count)
}

#[test]
fn same_seed_gives_the_same_trace_and_hash() {
    let (first, second) = (traced(5), traced(5));
    assert!(!first.is_empty());
    assert_eq!(first, second);
    assert_eq!(trace::hash(&first), trace::hash(&second));
    // Through the binary: the printed hash is the library's, and stable across processes.
    let run = |seed: &str| kvrelay(&["run", SCENARIO, "--seed", seed]);
    let (a, b) = (run("5"), run("5"));
    assert!(a.status.success(), "{}", text(&a.stderr));
    let (hash, count) = trace_hash_line(&text(&a.stdout));
    assert_eq!(trace_hash_line(&text(&b.stdout)), (hash.clone(), count));
    assert_eq!((hash, count), (trace::hash(&first), first.len()));
}

/// Another seed hands out other pages (the allocator's streams are keyed by the seed), which the metadata in the
/// trace carries, so the trace hash moves with them; the oracle passes both.
#[test]
fn different_seeds_differ_in_placement_and_trace() {
    let load = |seed| scenario::load_seeded(&path(SCENARIO), Some(seed)).unwrap().problem;
    let (one, two) = (load(1), load(2));
    let pages = |problem: &kvrelay::model::Problem| -> Vec<Vec<u32>> {
        problem
            .requests
            .iter()
            .flat_map(|request| [request.prefill_pages.clone(), request.decode_pages.clone()])
            .collect()
    };
    assert_ne!(pages(&one), pages(&two), "seeds 1 and 2 placed every page alike");
    assert_eq!(pages(&one), pages(&load(1)));
    for problem in [&one, &two] {
        for list in pages(problem) {
            assert!(!list.contains(&0), "page 0 is the padding page: {list:?}");
        }
    }
    let (first, second) = (traced(1), traced(2));
    assert_eq!(first.len(), second.len(), "the same flow, other pages");
    assert_ne!(trace::hash(&first), trace::hash(&second));
}

#[test]
fn check_determinism_reports_identical_runs() {
    let output = kvrelay(&["run", SCENARIO, "--seed", "3", "--check-determinism"]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", text(&output.stderr));
    let (hash, count) = trace_hash_line(&stdout);
    assert!(stdout.contains(&format!("determinism: identical ({count} events, trace hash {hash})")), "{stdout}");
    assert!(stdout.contains("pass mla-tp2-to-tp4"), "{stdout}");
}

#[test]
fn check_determinism_needs_the_simulated_fabric() {
    let output = kvrelay(&["run", SCENARIO, "--fabric", "live-sim", "--check-determinism"]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("--check-determinism needs the in-memory fabric (--fabric sim)"), "{stderr}");
}

/// `--trace-out` writes one JSON object per event, as many as the trace hash line counts, and its bytes are what
/// the hash is of.
#[test]
fn trace_out_writes_json_lines() {
    let file = std::env::temp_dir().join(format!("kvrelay-trace-{}.jsonl", std::process::id()));
    let output = kvrelay(&["run", SCENARIO, "--seed", "4", "--trace-out", file.to_str().unwrap()]);
    let written = std::fs::read(&file);
    let _ = std::fs::remove_file(&file);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let written = written.unwrap();
    let (hash, count) = trace_hash_line(&text(&output.stdout));
    let lines: Vec<&str> = std::str::from_utf8(&written).unwrap().lines().collect();
    assert_eq!(lines.len(), count);
    assert_eq!(lines.len(), traced(4).len());
    let mut kinds = std::collections::BTreeSet::new();
    let mut last = 0;
    for line in &lines {
        let event: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|error| panic!("{error}: {line}"));
        let time = event["time_ns"].as_u64().unwrap_or_else(|| panic!("no time_ns: {line}"));
        assert!(time >= last, "time goes back at {line}");
        last = time;
        let kind = event["kind"].as_str().unwrap();
        assert!(event["from"].as_str().is_some_and(|from| from.starts_with("prefill ") || from.starts_with("decode ")));
        assert!(event["text"].is_string(), "{line}");
        assert_eq!(event["to"].is_null(), kind == "note", "{line}");
        kinds.insert(kind.to_owned());
    }
    for kind in ["registration", "link", "metadata", "status", "note"] {
        assert!(kinds.contains(kind), "no {kind} event in {kinds:?}");
    }
    let digest: String = Sha256::digest(&written).iter().map(|byte| format!("{byte:02x}")).collect();
    assert_eq!(digest, hash, "the trace hash is SHA-256 of the --trace-out file");
}

#[test]
fn trace_out_to_an_unwritable_place_is_an_error_with_a_reproduce_line() {
    let output = kvrelay(&["run", SCENARIO, "--trace-out", "no-such-dir/trace.jsonl"]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("error: --trace-out no-such-dir/trace.jsonl: cannot write the trace"), "{stderr}");
    assert!(stderr.contains(&format!("reproduce: cargo run --release -- run {SCENARIO} --seed 1")), "{stderr}");
}

/// `KVRELAY_SEED` stands in for `--seed`: the same output as the flag; the flag wins over it.
#[test]
fn kvrelay_seed_is_honoured_and_the_flag_wins() {
    let from_env = kvrelay_with_env(&["run", SCENARIO], &[("KVRELAY_SEED", "7")]);
    let from_flag = kvrelay(&["run", SCENARIO, "--seed", "7"]);
    assert!(from_env.status.success(), "{}", text(&from_env.stderr));
    assert!(text(&from_env.stdout).starts_with("seed: 7\n"), "{}", text(&from_env.stdout));
    assert_eq!(from_env.stdout, from_flag.stdout);
    let default = kvrelay(&["run", SCENARIO]);
    assert!(text(&default.stdout).starts_with("seed: 1\n"));
    assert_ne!(trace_hash_line(&text(&default.stdout)), trace_hash_line(&text(&from_env.stdout)));
    let both = kvrelay_with_env(&["run", SCENARIO, "--seed", "9"], &[("KVRELAY_SEED", "7")]);
    assert!(text(&both.stdout).starts_with("seed: 9\n"), "{}", text(&both.stdout));
    // `layout` and `plan` take it too.
    let plan = |output: std::process::Output| text(&output.stdout);
    assert_eq!(
        plan(kvrelay_with_env(&["plan", SCENARIO, "--json"], &[("KVRELAY_SEED", "7")])),
        plan(kvrelay(&["plan", SCENARIO, "--json", "--seed", "7"]))
    );
}

#[test]
fn a_bad_kvrelay_seed_is_an_error_naming_it() {
    for bad in ["seven", "-1", "18446744073709551616"] {
        let output = kvrelay_with_env(&["run", SCENARIO], &[("KVRELAY_SEED", bad)]);
        assert!(!output.status.success());
        let stderr = text(&output.stderr);
        assert!(stderr.contains(&format!("error: KVRELAY_SEED=\"{bad}\" is not a seed (fix: ")), "{stderr}");
        assert!(output.stdout.is_empty(), "{}", text(&output.stdout));
    }
}

/// Golden checks keep each file's seed: `check` notes a `KVRELAY_SEED` and ignores it (the golden files match).
#[test]
fn check_ignores_kvrelay_seed_with_a_note() {
    // A corpus of one scenario and its golden file (golden names are relative to the corpus directory).
    let temp = std::env::temp_dir().join(format!("kvrelay-check-seed-{}", std::process::id()));
    let (scenarios, golden) = (temp.join("scenarios"), temp.join("golden"));
    std::fs::create_dir_all(&scenarios).unwrap();
    std::fs::create_dir_all(&golden).unwrap();
    std::fs::copy(path(SCENARIO), scenarios.join("mla-tp2-to-tp4.yaml")).unwrap();
    std::fs::copy(
        path("golden/golden@basic__mla-tp2-to-tp4.yaml.snap"),
        golden.join("golden@mla-tp2-to-tp4.yaml.snap"),
    )
    .unwrap();
    let args = ["check", scenarios.to_str().unwrap(), "--golden", golden.to_str().unwrap()];
    let output = kvrelay_with_env(&args, &[("KVRELAY_SEED", "7")]);
    std::fs::remove_dir_all(&temp).unwrap();
    let stderr = text(&output.stderr);
    assert!(stderr.contains("note: KVRELAY_SEED=7 ignored"), "{stderr}");
    assert!(output.status.success(), "{stderr}");
    assert!(text(&output.stdout).contains("1 scenarios, 1 passed, 0 failed"), "{}{stderr}", text(&output.stdout));
}

/// A failing run's reproduce line carries the seed in effect, here one from `KVRELAY_SEED` (not the file's), so the
/// line reproduces the failure in any shell.
#[test]
fn a_failure_prints_a_reproduce_line_with_the_seed() {
    let dir = std::env::temp_dir().join(format!("kvrelay-repro-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("wrong-expectation.yaml");
    // MLA TP2 -> TP4 is accepted; expecting a rejection makes every run fail its expectation.
    let yaml =
        std::fs::read_to_string(path(SCENARIO)).unwrap().replace("expect: ok", "expect: {error: dcp_unsupported}");
    std::fs::write(&file, yaml).unwrap();
    let output = kvrelay_with_env(&["run", file.to_str().unwrap()], &[("KVRELAY_SEED", "42")]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("FAIL wrong-expectation"), "{stderr}");
    let line = stderr.lines().find(|line| line.starts_with("reproduce: ")).unwrap_or_else(|| panic!("{stderr}"));
    assert_eq!(line, format!("reproduce: cargo run --release -- run {} --seed 42", file.display()));
}

/// An explicit `--seed` where each file's own seed is the point (golden checks, certification) is an error, not
/// silently ignored.
#[test]
fn check_and_certify_refuse_a_seed_flag() {
    for args in [&["check", "scenarios", "--seed", "3"][..], &["certify", "--fabric", "sim", "--seed", "3"][..]] {
        let output = kvrelay(args);
        assert!(!output.status.success(), "{args:?}");
        let stderr = text(&output.stderr);
        assert!(
            stderr.contains("error: --seed applies to run, layout, plan, diff, shrink and the rank commands"),
            "{stderr}"
        );
    }
}
