//! Seeded faults and the guarantee (issue 11; src/fabric/faults.rs, src/tools/swarm.rs): every request ends Success
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
    let run = |seed| kvrelay::engine::tasks::run(&scenario.problem, &options(seed)).unwrap();
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
    assert!(stdout.contains("runs: 200 "), "{stdout}");
}

/// A `faults:` entry of an unknown kind or probability is an error naming the field.
#[test]
fn bad_fault_entries_are_errors_naming_the_field() {
    let text = std::fs::read_to_string(format!("{DIR}/torn-write.yaml")).unwrap();
    for (bad, field) in [("kind: torn_write", "kind: teleport"), ("probability: 0.02", "probability: 2")] {
        let error = kvrelay::scenario::parse(&text.replace(bad, field), "f.yaml", "f").unwrap_err();
        assert_eq!(error.kind(), kvrelay::scenario::ScenarioErrorKind::InvalidValue, "{error}");
        let error = error.to_string();
        assert!(error.contains("faults[0]"), "{error}");
    }
}

/// Every request that reached a prefill rank ended there (Success or Failed), none left Transferring.
fn every_prefill_room_ended(run: &SimRun) -> bool {
    run.prefill_rooms.values().flatten().all(|(_, (poll, _))| matches!(poll, Some(KvPoll::Success | KvPoll::Failed)))
}

/// A prefill rank crashing mid-transfer (no restart): the decode ranks end the requests it had not reported Failed
/// at their waiting timeout, the crashed rank's rooms are reported Failed with the crash, the surviving stages'
/// rooms end too, and nothing succeeds over missing bytes. Both drivers agree.
#[test]
fn a_prefill_crash_mid_transfer_fails_the_requests_it_served() {
    let scenario = load("crash-mid-transfer.yaml");
    let (run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    assert!(run.faults.get("crash_prefill").is_some_and(|count| *count > 0), "{:?}", run.faults);
    let reasons: Vec<String> = run.failures().into_iter().map(|(.., reason)| reason).collect();
    assert!(!reasons.is_empty() && reasons.iter().all(|reason| reason.contains("timed out")), "{reasons:?}");
    let crashed = run
        .prefill_rooms
        .values()
        .flatten()
        .filter(|(_, (_, reason))| reason.as_deref().is_some_and(|reason| reason.ends_with("crashed")));
    assert!(crashed.count() > 0);
    assert!(every_prefill_room_ended(&run), "{:?}", run.prefill_rooms);
    assert!(run.run_ns <= 2 * kvrelay::engine::WAITING_TIMEOUT_NS, "bounded: {} ns", run.run_ns);
    // Some write had been confirmed before the crash: it did happen mid-transfer.
    assert!(!run.observation.writes.is_empty());
    let options = kvrelay::engine::sim::SimOptions { faults: scenario.faults.clone(), ..Default::default() };
    let stepped = kvrelay::engine::sim::run_stepped(&scenario.problem, &options).unwrap();
    assert_eq!(stepped.rooms, run.rooms);
    assert_eq!(stepped.prefill_rooms, run.prefill_rooms);
}

/// A crashed rank sends nothing after its crash: no status of a request it had not finished ever leaves it.
#[test]
fn a_crashed_prefill_rank_sends_nothing_more() {
    let scenario = load("crash-mid-transfer.yaml");
    let options =
        kvrelay::engine::sim::SimOptions { trace: true, faults: scenario.faults.clone(), ..Default::default() };
    let run = kvrelay::engine::tasks::run(&scenario.problem, &options).unwrap();
    let mut checked = 0;
    for (rank, rooms) in &run.prefill_rooms {
        let name = format!("prefill {rank}");
        for (id, (_, reason)) in rooms {
            if !reason.as_deref().is_some_and(|reason| reason.ends_with("crashed")) {
                continue;
            }
            checked += 1;
            let status = format!("status room {id} ");
            let sent = run.trace.iter().filter(|event| event.from == name && event.text.starts_with(&status));
            assert_eq!(sent.count(), 0, "{name} reported room {id} after crashing");
        }
    }
    assert!(checked > 0);
}

/// Notification before its data: a write completes before its bytes land, the Success status overtakes them, and
/// the guarantee finds the request reported Success too early ("detected", no harness failure). Without the fault
/// in the run's record, the same run is what an engine reporting Success too early looks like: a harness failure.
#[test]
fn success_before_the_bytes_landed_is_found_by_the_guarantee() {
    let scenario = load("notify-before-data.yaml");
    let (mut run, judgement) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(judgement.failures.is_empty(), "{:?}", judgement.failures);
    assert!(judgement.detected);
    assert!(!run.late_landings.is_empty());
    assert!(!swarm::premature_successes(&run).is_empty());
    run.faults.remove("notify_before_data");
    let broken = guarantee(&scenario, &run, &run.observation, &[]);
    assert!(broken.failures[0].contains("before all of its bytes had landed"), "{:?}", broken.failures);
    // A clean run records no late landing and nothing premature.
    let (clean, judgement) = swarm::run_faulted(&scenario, &plan(FaultKind::NotifyBeforeData, 0.0, 3)).unwrap();
    assert!(clean.late_landings.is_empty() && !judgement.detected && judgement.failures.is_empty());
}

/// The engines report Success only after every completion, which RC gives only once the bytes landed: with the
/// bytes landing late but before the status could arrive, nothing is premature.
#[test]
fn a_success_after_its_late_bytes_is_not_flagged() {
    let (_, mut run) = clean_faulted_run();
    let (rank, rooms) = run.rooms.iter().next().map(|(rank, rooms)| (*rank, rooms.clone())).unwrap();
    let (id, room) = rooms.iter().next().unwrap();
    run.late_landings.push((rank, *id, room.ended_ns.unwrap()));
    assert!(swarm::premature_successes(&run).is_empty());
    run.late_landings.push((rank, *id, room.ended_ns.unwrap() + 1));
    assert_eq!(swarm::premature_successes(&run), vec![(rank, *id)]);
}

/// Prefill rooms end too when their decode peers failed (the stage that kept sending finishes) or when their
/// completions or metadata were lost (the prefill-side transfer timeout): none is left Transferring.
#[test]
fn prefill_rooms_end_when_their_peers_fail_or_their_completions_are_lost() {
    let scenario = load("flushed-queue-pair.yaml");
    let (run, _) = swarm::run_faulted(&scenario, &scenario.faults).unwrap();
    assert!(every_prefill_room_ended(&run), "{:?}", run.prefill_rooms);
    let mut timed_out = 0;
    for seed in 0..6 {
        for kind in [FaultKind::DropCompletion, FaultKind::DropMessage] {
            let (run, judgement) = swarm::run_faulted(&scenario, &plan(kind, 0.05, seed)).unwrap();
            assert!(judgement.failures.is_empty(), "{kind:?} seed {seed}: {:?}", judgement.failures);
            assert!(every_prefill_room_ended(&run), "{kind:?} seed {seed}: {:?}", run.prefill_rooms);
            timed_out += run
                .prefill_rooms
                .values()
                .flatten()
                .filter(|(_, (_, reason))| reason.as_deref().is_some_and(|reason| reason.contains("timed out")))
                .count();
        }
    }
    assert!(timed_out > 0, "some prefill room ended by its timeout");
}
