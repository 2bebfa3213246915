//! Faults a real process suffers, injected into ranks as processes on a real engine (`kvrelay launch --chaos KIND`):
//! a rank's process killed or stalled mid-transfer, or control messages cut short by the hub. Each is seeded (the
//! victim, the moment, the messages hit: named streams `chaos.victim`, `chaos.delay`, `chaos.messages` of the run's
//! seed) and reproducible as far as the engine and the operating system allow (the moment a signal lands in the
//! transfer is wall time).
//!
//! Such a run is judged by the fault guarantee (`crate::harness::guarantee` for the in-memory fabric's faults):
//! every request on every surviving decode rank ends Success with byte-exact memory (the rank's own oracle) or Failed
//! with a reason, within the run's deadlines; a killed decode rank's requests die with it.

use std::process::{Child, Command};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::RngExt as _;

use super::{poll, Role};
use crate::control::{HubPlan, HubReport, MessageFaults};
use crate::harness::{Failure, FailureKind};
use crate::process::{ProcessError, RankVerdict};
use crate::seed::Seed;
use crate::wire::KvPoll;

/// Longest seeded delay between the start of the run and a process fault.
pub const MAX_DELAY: Duration = Duration::from_millis(1500);
/// Share of routed messages `truncate-messages` cuts short, per mille.
pub const TRUNCATED_PER_MILLE: u32 = 100;

/// A fault of `kvrelay launch --chaos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Chaos {
    /// SIGKILL one prefill rank's process a seeded moment after the run started.
    KillPrefill,
    /// SIGKILL one decode rank's process a seeded moment after the run started (its requests die with it).
    KillDecode,
    /// SIGSTOP one prefill rank's process a seeded moment after the start; it never runs again (killed once the
    /// decode ranks gave their verdicts): a stalled peer.
    StallPrefill,
    /// The hub cuts one in ten of the messages it routes short (seeded): truncated control messages.
    TruncateMessages,
}

impl Chaos {
    /// The process it hits, if it hits one: its side.
    fn victim_role(self) -> Option<Role> {
        match self {
            Chaos::KillPrefill | Chaos::StallPrefill => Some(Role::Prefill),
            Chaos::KillDecode => Some(Role::Decode),
            Chaos::TruncateMessages => None,
        }
    }

    fn signal(self) -> &'static str {
        match self {
            Chaos::StallPrefill => "STOP",
            _ => "KILL",
        }
    }
}

/// What one chaos run injects: the fault, its seed, its victim (side, index) and the delay after the start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChaosPlan {
    pub chaos: Chaos,
    pub seed: Seed,
    pub victim: Option<(Role, u32)>,
    pub delay: Duration,
}

impl ChaosPlan {
    /// Draws the victim among `counts` (prefill, decode) ranks, skipping `omitted`, and the delay.
    pub fn draw(chaos: Chaos, seed: Seed, counts: (u32, u32), omitted: &[(Role, u32)]) -> ChaosPlan {
        let victim = chaos.victim_role().and_then(|role| {
            let count = if role == Role::Prefill { counts.0 } else { counts.1 };
            let candidates: Vec<u32> = (0..count).filter(|index| !omitted.contains(&(role, *index))).collect();
            let mut rng = seed.stream("chaos.victim");
            (!candidates.is_empty()).then(|| (role, candidates[rng.random_range(0..candidates.len())]))
        });
        let millis = seed.stream("chaos.delay").random_range(0..=MAX_DELAY.as_millis() as u64);
        ChaosPlan { chaos, seed, victim, delay: Duration::from_millis(millis) }
    }

    /// Puts the message faults into the hub's plan, and a start signal when a process is to be hit.
    pub fn arm(&self, plan: &mut HubPlan) -> Option<Receiver<()>> {
        if self.chaos == Chaos::TruncateMessages {
            plan.faults = Some(MessageFaults { seed: self.seed, per_mille: TRUNCATED_PER_MILLE });
        }
        self.victim?;
        let (sender, receiver) = mpsc::channel();
        plan.started = Some(sender);
        Some(receiver)
    }

    /// The one-line description of the plan.
    pub fn describe(&self) -> String {
        match self.victim {
            Some((role, index)) => format!(
                "{}: SIG{} to {} {index}, {} ms after the start (seed {})",
                name(self.chaos),
                self.chaos.signal(),
                super::role_name(role),
                self.delay.as_millis(),
                self.seed.0
            ),
            None => format!(
                "{}: {} per mille of routed messages cut short (seed {})",
                name(self.chaos),
                TRUNCATED_PER_MILLE,
                self.seed.0
            ),
        }
    }
}

/// `kill-prefill`, ...: the flag's value.
pub fn name(chaos: Chaos) -> &'static str {
    match chaos {
        Chaos::KillPrefill => "kill-prefill",
        Chaos::KillDecode => "kill-decode",
        Chaos::StallPrefill => "stall-prefill",
        Chaos::TruncateMessages => "truncate-messages",
    }
}

/// The thread that hits the victim: it waits for the start (`started`), then `delay` unless told to stand down
/// first (`stand_down`), then signals `pid`. Its result says what it did.
pub struct Striker {
    stand_down: Sender<()>,
    thread: JoinHandle<String>,
}

impl Striker {
    /// Arms the striker of `plan` against process `pid`; `limit` bounds the wait for the start.
    pub fn arm(plan: &ChaosPlan, pid: u32, started: Receiver<()>, limit: Duration) -> Striker {
        let (stand_down, told) = mpsc::channel::<()>();
        let (signal, delay) = (plan.chaos.signal(), plan.delay);
        let thread = std::thread::spawn(move || {
            if started.recv_timeout(limit).is_err() {
                return "the run never started: nothing signalled".to_owned();
            }
            let begun = Instant::now();
            match told.recv_timeout(delay) {
                Err(RecvTimeoutError::Timeout) => {}
                _ => {
                    return format!(
                        "the run ended {} ms after the start, before the fault",
                        begun.elapsed().as_millis()
                    )
                }
            }
            match Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status() {
                Ok(status) if status.success() => format!("SIG{signal} sent to process {pid}"),
                Ok(status) => format!("kill -{signal} {pid} failed ({status}): the process had already ended"),
                Err(error) => format!("cannot run kill: {error}"),
            }
        });
        Striker { stand_down, thread }
    }

    /// Stands the striker down if it has not struck, and says what it did.
    pub fn finish(self) -> String {
        let _ = self.stand_down.send(());
        self.thread.join().unwrap_or_else(|_| "the striker panicked".to_owned())
    }
}

/// Kills a stalled victim (SIGSTOPped processes never exit by themselves).
pub fn release_victim(child: &mut Child) {
    let _ = child.kill();
}

/// How a chaos run departs from the fault guarantee: a surviving decode rank without a verdict, oracle violations
/// (Success over wrong bytes), a request that never ended or Failed without a reason, the hub's time limit. The
/// counts of (succeeded, failed) requests are returned beside.
pub fn guarantee_failures(
    plan: &ChaosPlan,
    ranks: &[String],
    verdicts: &std::collections::BTreeMap<u32, Result<RankVerdict, ProcessError>>,
    report: &HubReport,
) -> (u64, u64, Vec<Failure>) {
    let (mut succeeded, mut failed, mut failures) = (0, 0, Vec::new());
    for (index, verdict) in verdicts {
        let rank = ranks.get(*index as usize).cloned().unwrap_or_else(|| index.to_string());
        let verdict = match verdict {
            Ok(verdict) => verdict,
            Err(_) if plan.victim == Some((Role::Decode, *index)) => continue,
            Err(why) => {
                failures.push(Failure::new(FailureKind::Fabric, format!("decode {rank}: no verdict: {why}")));
                continue;
            }
        };
        if verdict.violation_count > 0 {
            failures.push(Failure::new(
                FailureKind::Oracle,
                format!("decode {rank}: {} oracle violations (wrong bytes under Success)", verdict.violation_count),
            ));
        }
        for room in &verdict.rooms {
            match (poll(room.poll), room.reason.as_deref()) {
                (KvPoll::Success, _) => succeeded += 1,
                (KvPoll::Failed, Some(reason)) if !reason.is_empty() => failed += 1,
                (KvPoll::Failed, _) => failures.push(Failure::new(
                    FailureKind::Rooms,
                    format!("decode {rank}: request {} Failed without a reason", room.request),
                )),
                (other, _) => failures.push(Failure::new(
                    FailureKind::Rooms,
                    format!("decode {rank}: request {} never ended (still {other:?})", room.request),
                )),
            }
        }
    }
    if report.timed_out {
        failures.push(Failure::new(FailureKind::Fabric, "the hub's time limit passed: the run was not bounded"));
    }
    (succeeded, failed, failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chaos_plan_is_drawn_from_the_seed_alone() {
        let draw = |seed| ChaosPlan::draw(Chaos::KillPrefill, Seed(seed), (8, 8), &[]);
        assert_eq!(draw(3), draw(3));
        let plans: Vec<ChaosPlan> = (0..32).map(draw).collect();
        assert!(plans.iter().all(|plan| plan.delay <= MAX_DELAY
            && plan.victim.is_some_and(|(role, index)| role == Role::Prefill && index < 8)));
        let victims: std::collections::BTreeSet<u32> =
            plans.iter().filter_map(|plan| plan.victim.map(|(_, index)| index)).collect();
        assert!(victims.len() > 1, "32 seeds chose one victim");
    }

    #[test]
    fn an_omitted_rank_is_never_the_victim_and_messages_have_none() {
        for seed in 0..32 {
            let plan = ChaosPlan::draw(Chaos::KillDecode, Seed(seed), (2, 2), &[(Role::Decode, 0)]);
            assert_eq!(plan.victim, Some((Role::Decode, 1)));
        }
        assert_eq!(ChaosPlan::draw(Chaos::TruncateMessages, Seed(1), (2, 2), &[]).victim, None);
    }
}
