//! The fault guarantee (issue 11): under any seeded faults ([`crate::fabric::faults`]), every request ends Success
//! with a byte-exact decode image or Failed with a reason, within bounded simulated time, and no other request's
//! bytes change. A run that breaks it is a harness failure: Success over wrong bytes (unless a silent corruption was
//! planted, which the oracle must then find: "detected"), a request that never ends, or a failure without a reason,
//! a failed request whose pages were never released, or a write that landed in a failed request's pages after the
//! decode rank released them (the abort and acknowledgement of domain.md §6.4 exist to prevent it: released pages go
//! to the next request).
//!
//! It lives with the harness, which judges a scenario with `faults:` by it ([`super::run_with`]); the swarm runs
//! ([`crate::swarm`]) build on both.

use crate::engine::sim::SimRun;
use crate::faults::FaultKind;
use crate::model::RankId;
use crate::scenario::Scenario;
use crate::verify::{Observation, RegionKey, Violation};
use crate::wire::KvPoll;

/// How one faulted run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judgement {
    /// Requests (per decode rank) that ended Success, byte-exact.
    pub succeeded: u64,
    /// Requests (per decode rank) that ended Failed with a reason.
    pub failed: u64,
    /// A silent fault was planted and the guarantee found it: a corruption the oracle found (and nothing else), or a
    /// Success reported before its bytes landed (`notify_before_data`).
    pub detected: bool,
    /// Broken guarantees, in words (empty: the run kept it).
    pub failures: Vec<String>,
}

/// Judges `run` (its decode memory `observation`, with the oracle's `violations` over its own room verdicts) against
/// the guarantee. Violations under planted silent corruptions count as detected only when undoing exactly the
/// planted flips leaves the oracle nothing to find; anything else is wrong bytes no fault explains.
pub fn guarantee(scenario: &Scenario, run: &SimRun, observation: &Observation, violations: &[Violation]) -> Judgement {
    let (mut succeeded, mut failed, mut failures) = (0, 0, Vec::new());
    for (rank, rooms) in &run.rooms {
        for (id, room) in rooms {
            match (room.poll, room.reason.as_deref(), room.ended_ns) {
                (KvPoll::Success, _, Some(_)) => succeeded += 1,
                (KvPoll::Failed, Some(reason), Some(_)) if !reason.is_empty() => failed += 1,
                (KvPoll::Failed, _, Some(_)) => {
                    failures.push(format!("decode {rank}: request {id} Failed without a reason"))
                }
                (poll, ..) => failures.push(format!(
                    "decode {rank}: request {id} never ended (still {poll:?} when the run stopped at {} ns): a hang",
                    run.run_ns
                )),
            }
        }
    }
    failures.extend(writes_after_release(run));
    // Success reported before all of its bytes landed: expected under `notify_before_data` (detected), a broken
    // engine otherwise.
    let premature = premature_successes(run);
    let notified_early = run.faults.contains_key(FaultKind::NotifyBeforeData.name());
    if let (Some((rank, id)), false) = (premature.first(), notified_early) {
        failures.push(format!(
            "decode {rank}: request {id} reported Success before all of its bytes had landed ({} such requests)",
            premature.len()
        ));
    }
    let corrupted = !violations.is_empty() && !run.corruptions.is_empty();
    let unexplained = match corrupted {
        true => super::oracle(scenario, run, &undo_corruptions(observation, &run.corruptions)),
        false => violations.to_vec(),
    };
    if let Some(first) = unexplained.first() {
        failures.push(format!(
            "{} oracle violations under Success or in another request's bytes (none of them a planted corruption), the first: {first}",
            unexplained.len()
        ));
    }
    let detected = (corrupted && unexplained.is_empty()) || (notified_early && !premature.is_empty());
    Judgement { succeeded, failed, detected, failures }
}

/// A Failed room never released, or written after its release (the last landing of each room against its release).
fn writes_after_release(run: &SimRun) -> Vec<String> {
    let mut failures = Vec::new();
    for (rank, rooms) in &run.rooms {
        for (id, room) in rooms.iter().filter(|(_, room)| room.poll == KvPoll::Failed) {
            let landed = run.last_landings.get(&(*rank, *id));
            match (room.released_ns, landed) {
                (None, _) => failures.push(format!("decode {rank}: request {id} Failed but its pages were never released")),
                (Some(released), Some(&landed)) if landed > released => failures.push(format!(
                    "decode {rank}: request {id}: a write landed at {landed} ns, after its pages were released at {released} ns (write after release)"
                )),
                _ => {}
            }
        }
    }
    failures
}

/// `observation` with every planted byte undone where the planted value is still there (a later write may have
/// overwritten it with the right byte).
fn undo_corruptions(observation: &Observation, corruptions: &[(RegionKey, u64, u8, u8)]) -> Observation {
    let mut restored = observation.clone();
    for &(key, offset, planted, original) in corruptions {
        let byte = match (restored.images.get_mut(&key), restored.sparse.get_mut(&key)) {
            (Some(image), _) => image.get_mut(offset as usize),
            (None, Some(sparse)) => sparse
                .chunks
                .range_mut(..=offset)
                .next_back()
                .and_then(|(start, chunk)| chunk.get_mut((offset - start) as usize)),
            (None, None) => None,
        };
        if let Some(byte) = byte.filter(|byte| **byte == planted) {
            *byte = original;
        }
    }
    restored
}

/// Every (decode rank, request) reported Success before all of its bytes had landed: the world records when the
/// bytes of each write landed ([`SimRun::late_landings`]), the decode rank when the request turned Success.
pub fn premature_successes(run: &SimRun) -> Vec<(RankId, u64)> {
    let mut premature = Vec::new();
    for &(rank, id, landed_ns) in &run.late_landings {
        let room = run.rooms.get(&rank).and_then(|rooms| rooms.get(&id));
        if let Some(ended_ns) = room.filter(|room| room.poll == KvPoll::Success).and_then(|room| room.ended_ns) {
            if ended_ns < landed_ns && !premature.contains(&(rank, id)) {
                premature.push((rank, id));
            }
        }
    }
    premature.sort_unstable();
    premature
}
