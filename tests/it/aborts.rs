//! The abort and its acknowledgement (domain.md §6.4, issue 11): a decode rank whose room fails aborts it on every
//! prefill rank that may still write into it and releases the room's pages only once each acknowledged, after its
//! writes drained, or after the waiting timeout when a rank never answers. No write lands after the release
//! (src/tools/swarm.rs judges it on every run; here the claim is shown on named cases).

use kvrelay::engine::sim::{run_stepped, SimOptions, SimRun};
use kvrelay::engine::tasks::run;
use kvrelay::engine::WAITING_TIMEOUT_NS;
use kvrelay::fabric::faults::{FaultKind, FaultPlan, FaultRule};
use kvrelay::scenario::Scenario;
use kvrelay::swarm;
use kvrelay::wire::KvPoll;
use rstest::rstest;

fn load(name: &str) -> Scenario {
    let path = format!("scenarios/faults/{name}");
    kvrelay::scenario::load_seeded(std::path::Path::new(&path), None).expect("a valid scenario")
}

fn plan(seed: u64, rules: &[(FaultKind, f64)]) -> FaultPlan {
    FaultPlan { seed, rules: rules.iter().map(|&(kind, probability)| FaultRule { kind, probability }).collect() }
}

/// (ended, released, last landing) of every Failed room, per decode rank and request.
fn failed_rooms(run: &SimRun) -> Vec<(u64, Option<u64>, Option<u64>)> {
    let mut rooms = Vec::new();
    for (rank, states) in &run.rooms {
        for (id, room) in states.iter().filter(|(_, room)| room.poll == KvPoll::Failed) {
            let ended = room.ended_ns.expect("a Failed room ended");
            rooms.push((ended, room.released_ns, run.last_landings.get(&(*rank, *id)).copied()));
        }
    }
    rooms
}

/// Seeds of a failing queue pair on the PP2 -> TP2/DCP2 shape where a write into a failed room landed after the
/// decode rank had failed it: without the abort those pages would have been handed to the next request while still
/// being written. Each such room is released only after its last write landed, every abort is acknowledged, and the
/// run keeps the guarantee.
#[rstest]
#[case::remote_access_error(FaultKind::WrError(kvrelay::faults::WrErrorStatus::RemoteAccess))]
#[case::torn_write(FaultKind::TornWrite)]
fn a_failed_room_is_released_only_after_its_last_write_landed(#[case] kind: FaultKind) {
    let scenario = load("flushed-queue-pair.yaml");
    let mut written_after_failure = 0;
    for seed in 0..24 {
        let (run, judgement) = swarm::run_faulted(&scenario, &plan(seed, &[(kind, 0.02)])).unwrap();
        assert!(judgement.failures.is_empty(), "seed {seed}: {:?}", judgement.failures);
        for (ended, released, landed) in failed_rooms(&run) {
            let released = released.unwrap_or_else(|| panic!("seed {seed}: a Failed room was never released"));
            assert!(released >= ended, "seed {seed}: released at {released} before it failed at {ended}");
            if let Some(landed) = landed {
                assert!(landed <= released, "seed {seed}: landed at {landed} after the release at {released}");
                written_after_failure += u32::from(landed > ended);
            }
        }
        let (aborts, acks) = (run.messages.get("abort"), run.messages.get("abort-ack"));
        assert_eq!(aborts, acks, "seed {seed}: every abort to a live rank is acknowledged");
    }
    assert!(written_after_failure > 0, "no seed had a write land in a room after it failed: the case proves nothing");
}

/// A prefill rank that crashed never acknowledges: the decode rank releases the room one waiting timeout after it
/// aborted it, and (the crashed rank's queue pairs flushed) nothing lands after that.
#[test]
fn a_room_aborted_on_a_crashed_rank_is_released_after_the_waiting_timeout() {
    let scenario = load("crash-mid-transfer.yaml");
    let mut timed_out = 0;
    for seed in 0..8 {
        let (run, judgement) = swarm::run_faulted(&scenario, &plan(seed, &[(FaultKind::CrashPrefill, 0.01)])).unwrap();
        assert!(judgement.failures.is_empty(), "seed {seed}: {:?}", judgement.failures);
        for (ended, released, _) in failed_rooms(&run) {
            timed_out += u32::from(released == Some(ended + WAITING_TIMEOUT_NS));
        }
        if run.faults.contains_key("crash_prefill") {
            let (aborts, acks) = (run.messages.get("abort").copied(), run.messages.get("abort-ack").copied());
            assert!(aborts.unwrap_or(0) > acks.unwrap_or(0), "seed {seed}: a crashed rank acknowledged an abort");
        }
    }
    assert!(timed_out > 0, "no room waited out a crashed rank's acknowledgement");
}

/// Aborts and acknowledgements duplicated, dropped or reordered on the control network change nothing the guarantee
/// sees (handling is idempotent, a lost acknowledgement ends in the timeout), and both drivers agree on every room.
#[rstest]
#[case::duplicated(FaultKind::DuplicateMessage)]
#[case::dropped(FaultKind::DropMessage)]
#[case::reordered(FaultKind::ReorderMessage)]
fn aborts_survive_a_faulty_control_network(#[case] kind: FaultKind) {
    let scenario = load("flushed-queue-pair.yaml");
    let error = FaultKind::WrError(kvrelay::faults::WrErrorStatus::RemoteAccess);
    for seed in 0..12 {
        let faults = plan(seed, &[(error, 0.02), (kind, 0.3)]);
        let (run_tasks, judgement) = swarm::run_faulted(&scenario, &faults).unwrap();
        assert!(judgement.failures.is_empty(), "seed {seed}: {:?}", judgement.failures);
        let options = SimOptions { faults, ..SimOptions::default() };
        let stepped = run_stepped(&scenario.problem, &options).unwrap();
        assert_eq!(run_tasks.rooms, stepped.rooms, "seed {seed}");
        assert_eq!(run(&scenario.problem, &options).unwrap().rooms, stepped.rooms, "seed {seed}: tasks rerun");
    }
}
