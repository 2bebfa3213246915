//! The fault kinds of src/fabric/faults.rs beyond drop, duplicate, error, tear, corrupt and crash: delayed and
//! reordered control messages and completions, a hung queue pair (`timeout`) and a prefill page read after its
//! release (issue 11). Each keeps the guarantee (src/tools/swarm.rs), and both drivers see the same run.

use kvrelay::engine::sim::{run_stepped, SimOptions, SimRun};
use kvrelay::engine::tasks::run;
use kvrelay::fabric::faults::{FaultKind, FaultPlan, FaultRule};
use kvrelay::scenario::Scenario;
use kvrelay::swarm;
use kvrelay::wire::KvPoll;
use rstest::rstest;

fn load(name: &str) -> Scenario {
    let path = format!("scenarios/faults/{name}");
    kvrelay::scenario::load_seeded(std::path::Path::new(&path), None).expect("a valid scenario")
}

fn plan(kind: FaultKind, probability: f64, seed: u64) -> FaultPlan {
    FaultPlan { seed, rules: vec![FaultRule { kind, probability }] }
}

fn ends(run: &SimRun) -> Vec<KvPoll> {
    run.rooms.values().flat_map(|rooms| rooms.values().map(|room| room.poll)).collect()
}

/// Delays and reorders lose nothing: every request of the scenario still ends Success byte-exact, and some of each
/// kind was injected.
#[test]
fn delays_and_reorders_alone_fail_no_request() {
    let scenario = load("delayed-and-reordered.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    assert_eq!((judgement.succeeded, judgement.failed), (6, 0));
    for kind in ["delay_message", "reorder_message", "delay_completion", "reorder_completion"] {
        assert!(run.faults.get(kind).is_some_and(|count| *count > 0), "{kind}: {:?}", run.faults);
    }
}

/// The same holds over many seeds at a high rate of each kind, and the delays show in the run's length.
#[rstest]
#[case::delay_message(FaultKind::DelayMessage)]
#[case::reorder_message(FaultKind::ReorderMessage)]
#[case::delay_completion(FaultKind::DelayCompletion)]
#[case::reorder_completion(FaultKind::ReorderCompletion)]
fn late_or_out_of_order_deliveries_still_end_every_request_success(#[case] kind: FaultKind) {
    let scenario = load("delayed-and-reordered.yaml");
    let (clean, _) = swarm::run_faulted(&scenario, &plan(kind, 0.0, 0)).unwrap();
    for seed in 0..8 {
        let (run, judgement) = swarm::run_faulted(&scenario, &plan(kind, 0.5, seed)).unwrap();
        assert!(judgement.failures.is_empty(), "seed {seed}: {:?}", judgement.failures);
        assert!(ends(&run).iter().all(|poll| *poll == KvPoll::Success), "seed {seed}: {:?}", ends(&run));
        assert!(run.run_ns > clean.run_ns, "seed {seed}: {} ns against {} ns unfaulted", run.run_ns, clean.run_ns);
    }
}

/// The tasks driver and the stepped driver deliver delayed and reordered messages and completions in the same order:
/// the same rooms end the same way at the same simulated times.
#[rstest]
#[case::messages(FaultKind::ReorderMessage, FaultKind::DelayMessage)]
#[case::completions(FaultKind::ReorderCompletion, FaultKind::DelayCompletion)]
fn both_drivers_agree_under_delays_and_reorders(#[case] first: FaultKind, #[case] second: FaultKind) {
    let scenario = load("delayed-and-reordered.yaml");
    for seed in 0..4 {
        let rules = vec![FaultRule { kind: first, probability: 0.4 }, FaultRule { kind: second, probability: 0.2 }];
        let options = SimOptions { faults: FaultPlan { seed, rules }, ..SimOptions::default() };
        let (tasks, stepped) =
            (run(&scenario.problem, &options).unwrap(), run_stepped(&scenario.problem, &options).unwrap());
        assert_eq!(tasks.rooms, stepped.rooms, "seed {seed}");
        assert_eq!(tasks.faults, stepped.faults, "seed {seed}");
    }
}

/// A hung queue pair completes nothing and reports no error: the rooms behind it end Failed through the engines'
/// timeouts, with a reason, within bounded simulated time; the others Success.
#[test]
fn a_hung_queue_pair_ends_its_rooms_by_timeout() {
    let scenario = load("hung-queue-pair.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    assert!(judgement.succeeded > 0 && judgement.failed > 0, "{judgement:?}");
    assert!(run.failures().iter().all(|(.., reason)| reason.contains("timed out")), "{:?}", run.failures());
    assert!(run.run_ns <= 2 * kvrelay::engine::WAITING_TIMEOUT_NS, "bounded: {} ns", run.run_ns);
}

/// A read after release completes successfully over the reused page's bytes: the oracle finds exactly the planted
/// bytes (detected, no harness failure); one more wrong byte would not be excused (src/tools/swarm.rs undoes only them).
#[test]
fn a_read_after_release_is_found_by_the_oracle_alone() {
    let scenario = load("read-after-release.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    assert!(judgement.detected);
    assert!(run.failures().is_empty(), "every status said Success: {:?}", run.failures());
    assert!(run.corruptions.iter().all(|&(.., planted, _)| planted == kvrelay::fabric::faults::RELEASED_FILL));
    let violations = kvrelay::harness::oracle(&scenario, &run, &run.observation);
    assert!(!violations.is_empty());
}

/// `kvrelay run --faults FILE` runs the file's rules in place of the scenario's, drawn from the run's seed; a
/// failing run's reproduce line carries the file.
#[test]
fn run_takes_its_faults_from_a_file() {
    let dir = std::env::temp_dir().join(format!("kvrelay-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("hang.yaml");
    std::fs::write(&file, "faults:\n  - {kind: timeout, probability: 0.002}\n").unwrap();
    let path = file.display().to_string();
    let output =
        crate::support::kvrelay(&["run", "scenarios/faults/torn-write.yaml", "--faults", &path, "--seed", "2"]);
    let stdout = crate::support::text(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", crate::support::text(&output.stderr));
    assert!(stdout.contains("faults injected: 1 timeout"), "{stdout}");
    assert!(!stdout.contains("torn_write"), "the scenario's own rules are replaced: {stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A faults file with an unknown kind, a probability out of range or another shape is an error naming the file,
/// the line and the field, with the fix.
#[rstest]
#[case::unknown_kind(
    "faults:\n  - {kind: teleport, probability: 0.1}\n",
    ":2: faults[0].kind: unknown fault kind `teleport` (fix: one of"
)]
#[case::probability(
    "faults:\n  - {kind: timeout, probability: 0.1}\n  - {kind: corrupt, probability: 2}\n",
    ":3: faults[1].probability: probability 2 is not in 0..=1"
)]
#[case::shape("- {kind: timeout, probability: 0.1}\n", "a mapping with a faults list")]
fn a_bad_faults_file_is_an_error_naming_the_field(#[case] text: &str, #[case] expected: &str) {
    let dir = std::env::temp_dir().join(format!("kvrelay-bad-faults-{}-{}", std::process::id(), expected.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.yaml");
    std::fs::write(&file, text).unwrap();
    let output =
        crate::support::kvrelay(&["run", "scenarios/faults/torn-write.yaml", "--faults", &file.display().to_string()]);
    let stderr = crate::support::text(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains(&format!("{}{expected}", file.display())) || stderr.contains(expected), "{stderr}");
    assert!(stderr.contains("bad.yaml"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A prefill rank that crashes and restarts: its new process writes nothing for the rooms its old one had not
/// finished, fails them with the restart as reason and tells their decode peers, so those rooms end long before the
/// waiting timeout; both drivers agree.
#[test]
fn a_restarted_prefill_rank_fails_what_it_lost_and_writes_nothing_for_it() {
    let scenario = load("crash-mid-transfer.yaml");
    let faults = |seed| plan(FaultKind::CrashRestartPrefill, 0.002, seed);
    let seed = (0..50)
        .find(|&seed| {
            let (run, _) = swarm::run_faulted(&scenario, &faults(seed)).unwrap();
            run.faults.contains_key("crash_restart_prefill")
        })
        .expect("a seed that crashes a rank");
    let (run, judgement) = swarm::run_faulted(&scenario, &faults(seed)).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    let restarted: Vec<_> =
        run.failures().into_iter().filter(|(.., reason)| reason.ends_with("crashed and restarted")).collect();
    assert!(!restarted.is_empty(), "{:?}", run.failures());
    for (rank, id, _) in &restarted {
        let ended = run.rooms[rank][id].ended_ns.unwrap();
        assert!(ended < kvrelay::engine::WAITING_TIMEOUT_NS / 10, "decode {rank} room {id} ended at {ended} ns");
    }
    let options = SimOptions { faults: faults(seed), ..SimOptions::default() };
    let stepped = run_stepped(&scenario.problem, &options).unwrap();
    assert_eq!(stepped.rooms, run.rooms);
    assert_eq!(stepped.prefill_rooms, run.prefill_rooms);
}
