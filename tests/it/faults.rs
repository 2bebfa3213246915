//! Seeded faults and the guarantee (issue 11; src/fabric/faults.rs, src/swarm.rs): every request ends Success
//! byte-exact or Failed with a reason, and a run that breaks that is a harness failure.

use kvrelay::engine::sim::SimRun;
use kvrelay::fabric::faults::{FaultKind, FaultPlan, FaultRule};
use kvrelay::swarm::{self, guarantee};
use kvrelay::wire::KvPoll;

use crate::support::kvrelay;

const DIR: &str = "scenarios/faults";

fn load(name: &str) -> kvrelay::scenario::Scenario {
    kvrelay::scenario::load_seeded(std::path::Path::new(&format!("{DIR}/{name}")), None).expect("a valid scenario")
}

fn plan(kind: FaultKind, probability: f64, seed: u64) -> FaultPlan {
    FaultPlan { seed, rules: vec![FaultRule { kind, probability }] }
}

/// A faulted run whose requests all succeeded (duplicated completions are settled once).
fn clean_faulted_run() -> (kvrelay::scenario::Scenario, SimRun) {
    let scenario = load("duplicate-completion.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    assert_eq!((judgement.succeeded, judgement.failed), (6, 0));
    (scenario, run)
}

/// Success over wrong bytes, with no silent corruption planted, is a harness failure naming the coordinates.
#[test]
fn success_over_wrong_bytes_breaks_the_guarantee() {
    let (scenario, mut run) = clean_faulted_run();
    let write = run.observation.writes[0];
    let image = run.observation.images.get_mut(&write.target).expect("a dense image");
    image[write.offset as usize] ^= 0x01;
    let violations = kvrelay::harness::oracle(&scenario, &run, &run.observation);
    let judgement = guarantee(&scenario, &run, &run.observation, &violations);
    assert!(!judgement.detected);
    assert!(judgement.failures[0].contains("oracle violations under Success"), "{:?}", judgement.failures);
}

/// A request that never ended (still waiting when the run stopped) is a hang.
#[test]
fn a_request_that_never_ends_breaks_the_guarantee() {
    let (scenario, mut run) = clean_faulted_run();
    let room = run.rooms.values_mut().next().unwrap().values_mut().next().unwrap();
    room.poll = KvPoll::Transferring;
    room.ended_ns = None;
    let judgement = guarantee(&scenario, &run, &run.observation, &[]);
    assert!(judgement.failures[0].contains("never ended"), "{:?}", judgement.failures);
}

/// A work-request error fails the rooms it reaches with the error in the reason, and its queue pair flushes the
/// rest; nothing succeeds over missing bytes.
#[test]
fn a_failed_work_request_fails_its_rooms_with_a_reason_and_flushes_its_queue_pair() {
    let scenario = load("flushed-queue-pair.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    let reasons: Vec<String> = run.failures().into_iter().map(|(.., reason)| reason).collect();
    assert!(reasons.iter().any(|reason| reason.contains("RemoteAccess")), "{reasons:?}");
    assert!(reasons.iter().any(|reason| reason.contains("Flushed")), "{reasons:?}");
}

/// A silent corruption completes Success everywhere; only the oracle sees it, and the run counts as detected.
#[test]
fn a_silent_corruption_is_found_by_the_oracle() {
    let scenario = load("silent-corruption.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(run.failures().is_empty());
    assert!(judgement.detected && judgement.failures.is_empty());
    let (_, clean) = swarm::run_faulted(&scenario, &plan(FaultKind::Corrupt, 0.0, 3)).unwrap();
    assert!(!clean.detected);
}

/// A planted corruption does not cover for other wrong bytes: the planted flips are undone and the oracle must then
/// find nothing, so one more wrong byte beside them is a harness failure.
#[test]
fn a_planted_corruption_does_not_excuse_other_wrong_bytes() {
    let scenario = load("silent-corruption.yaml");
    let (mut run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.detected && !run.corruptions.is_empty());
    let (planted, ..) = run.corruptions[0];
    let write = run.observation.writes.iter().rev().find(|write| write.target != planted).copied().unwrap();
    run.observation.images.get_mut(&write.target).unwrap()[write.offset as usize] ^= 0x01;
    let violations = kvrelay::harness::oracle(&scenario, &run, &run.observation);
    let judgement = guarantee(&scenario, &run, &run.observation, &violations);
    assert!(!judgement.detected);
    assert!(judgement.failures[0].contains("none of them a planted corruption"), "{:?}", judgement.failures);
}

/// A torn write lands half its bytes and fails: the rooms it hits end Failed, and the oracle (judging failed rooms
/// loosely, others exactly) finds nothing wrong elsewhere.
#[test]
fn a_torn_write_fails_its_rooms() {
    let scenario = load("torn-write.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    assert!(run.faults.get("torn_write").is_some_and(|count| *count > 0));
    assert!(run.failures().iter().any(|(.., reason)| reason.contains("RetryExceeded")));
}

/// The same seed gives the same faults and the same trace; another seed other faults.
#[test]
fn faults_are_reproducible_from_the_seed() {
    let scenario = load("torn-write.yaml");
    let options = |seed| kvrelay::engine::sim::SimOptions {
        trace: true,
        faults: plan(FaultKind::TornWrite, 0.02, seed),
        ..Default::default()
    };
    let run = |seed| kvrelay::engine::sim::run(&scenario.problem, &options(seed)).unwrap();
    let (first, again) = (run(3), run(3));
    assert_eq!(first.trace, again.trace);
    assert_eq!(first.faults, again.faults);
    assert_ne!((0..20).map(|seed| run(seed).faults).collect::<std::collections::BTreeSet<_>>().len(), 1);
}

/// A swarm draws a subset of kinds per seed (not always the same), reproducibly.
#[test]
fn swarm_seeds_draw_varied_subsets_reproducibly() {
    assert_eq!(swarm::swarm_faults(7), swarm::swarm_faults(7));
    let subsets: std::collections::BTreeSet<Vec<FaultKind>> =
        (0..50).map(|seed| swarm::swarm_faults(seed).rules.iter().map(|rule| rule.kind).collect()).collect();
    assert!(subsets.len() > 10, "{} distinct subsets", subsets.len());
    assert!((0..50).all(|seed| !swarm::swarm_faults(seed).rules.is_empty()));
}

/// `kvrelay sim` over the fault scenarios: every run keeps the guarantee.
#[test]
fn a_short_swarm_over_the_fault_scenarios_has_no_harness_failure() {
    let output = kvrelay(&["sim", DIR, "--seeds", "20"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("harness failures: 0"), "{stdout}");
    assert!(stdout.contains("runs: 100 "), "{stdout}");
}

/// A `faults:` entry of an unknown kind or probability is an error naming the field.
#[test]
fn bad_fault_entries_are_errors_naming_the_field() {
    let text = std::fs::read_to_string(format!("{DIR}/torn-write.yaml")).unwrap();
    for (bad, field) in [("kind: torn_write", "kind: teleport"), ("probability: 0.02", "probability: 2")] {
        let error = kvrelay::scenario::parse(&text.replace(bad, field), "f.yaml", "f").unwrap_err().to_string();
        assert!(error.contains("faults[0]"), "{error}");
    }
}
