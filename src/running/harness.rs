//! One scenario end to end: budget, composed plan, the per-rank engines on the in-memory fabric, the oracle per
//! decode rank, and the judgement against the scenario's expectation, or against the fault guarantee
//! ([`guarantee()`]) for a faulted run.

use crate::engine::seat::SharedPlanner;
use crate::engine::sim::{SimOptions, SimRun};
use crate::exec::{self, SimFabric};
use crate::limits::{DEFAULT_MEMORY_SHARE, FALLBACK_MEMORY_BUDGET, MEMORY_BUDGET_ENV};
use std::collections::{BTreeMap, BTreeSet};

use crate::model::{Problem, RankId, RankLayout};
use crate::plan::{self, Plan, PlanError};
use crate::scenario::{Expectation, Scenario};
use crate::verify::{self, Observation, Verdicts, Violation};
use crate::wire::KvPoll;

mod guarantee;
mod pipeline;
pub use crate::fabric::registry::{Fabric, RDMA_CAPS, RDMA_MISSING};
pub use guarantee::{guarantee, premature_successes, Judgement};
pub use pipeline::Run;

/// Everything a run produced, for rendering and judging.
#[derive(Debug)]
pub struct Outcome {
    /// The composed plan (every connection, every chunk): decisions, statistics, the expected rejection.
    pub plan: Result<Plan, PlanError>,
    /// What the engines did: room states per decode rank, the trace.
    pub engine: Option<SimRun>,
    pub observation: Observation,
    pub violations: Vec<Violation>,
    /// Why the run does not meet the scenario's expectation; empty means pass.
    pub failures: Vec<Failure>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// Every failure's text, joined with `separator`.
    pub fn failure_text(&self, separator: &str) -> String {
        self.failures.iter().map(|failure| failure.text.as_str()).collect::<Vec<_>>().join(separator)
    }

    /// Whether a failure of `kind` is among the run's.
    pub fn failed_with(&self, kind: FailureKind) -> bool {
        self.failures.iter().any(|failure| failure.kind == kind)
    }
}

error_kinds! {
    /// Why a run does not meet its scenario: the kind of a [`Failure`].
    pub enum FailureKind {
        /// The composed plan accepted what the scenario expects rejected, rejected what it expects clean, or rejected
        /// with another kind or text.
        Expectation = "expectation",
        /// A request ended on a decode rank otherwise than the scenario says (or with another reason).
        Rooms = "rooms",
        /// The oracle found decode bytes where they must not be.
        Oracle = "oracle",
        /// The fabric or the engines could not run the scenario.
        Fabric = "fabric",
        /// A faulted run broke the fault guarantee.
        Guarantee = "guarantee",
    }
}

/// One reason a run does not meet its scenario, with its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub text: String,
}

impl Failure {
    pub fn new(kind: FailureKind, text: impl Into<String>) -> Failure {
        Failure { kind, text: text.into() }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// Why a scenario was not run at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// The scenario's regions do not fit the simulated-memory budget; nothing was allocated.
    #[error("the scenario registers {} of simulated memory, more than the budget of {budget} (fix: smaller requests, pools or models, or set {MEMORY_BUDGET_ENV} to a byte count)", needed.map_or_else(|| "more than 2^64 bytes".to_owned(), |bytes| format!("{bytes} bytes")))]
    OverBudget { needed: Option<u64>, budget: Budget },
    /// The budget override is not a byte count.
    #[error("{MEMORY_BUDGET_ENV}={value:?} is not a byte count (fix: a whole number of bytes, e.g. 8589934592)")]
    BadBudget { value: String },
}

/// How much simulated memory one run may register, and where that number came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    pub source: String,
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes ({})", self.bytes, self.source)
    }
}

impl Budget {
    /// A fixed budget (tests, fuzzing).
    pub fn bytes(bytes: u64) -> Budget {
        Budget { bytes, source: "set by the caller".to_owned() }
    }

    /// No budget: for callers that bound memory their own way (`why`), e.g. by what runs actually materialise.
    pub fn unbounded(why: &str) -> Budget {
        Budget { bytes: u64::MAX, source: why.to_owned() }
    }

    /// `KVRELAY_MAX_FABRIC_BYTES` when set; otherwise half of the machine's available memory (`MemAvailable` of
    /// /proc/meminfo), or 4 GiB where that cannot be read.
    pub fn from_env() -> Result<Budget, RunError> {
        Budget::from_env_share(DEFAULT_MEMORY_SHARE)
    }

    /// [`Budget::from_env`] with another share `(numerator, denominator)` of the available memory.
    pub fn from_env_share(share: (u64, u64)) -> Result<Budget, RunError> {
        if let Ok(value) = std::env::var(MEMORY_BUDGET_ENV) {
            return match value.trim().parse() {
                Ok(bytes) => Ok(Budget { bytes, source: format!("from {MEMORY_BUDGET_ENV}") }),
                Err(_) => Err(RunError::BadBudget { value }),
            };
        }
        let (numerator, denominator) = share;
        Ok(match available_memory() {
            Some(available) => Budget {
                bytes: available / denominator * numerator,
                source: format!("{numerator}/{denominator} of the {available} bytes this machine has available"),
            },
            None => {
                Budget { bytes: FALLBACK_MEMORY_BUDGET, source: "available memory unknown; the fallback".to_owned() }
            }
        })
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes every region of both sides registers; `None` past `u64` (checked, never wrapping).
pub fn simulated_bytes(problem: &Problem) -> Option<u64> {
    side_bytes(&problem.prefill)?.checked_add(side_bytes(&problem.decode)?)
}

/// The bytes of one side's regions, every rank's (`None`: past 2^64).
pub fn side_bytes(side: &crate::model::SideLayout) -> Option<u64> {
    let mut total = 0u64;
    for region in side.ranks.iter().flat_map(|rank| &rank.regions) {
        total = total.checked_add(region.item_len.checked_mul(u64::from(region.item_count))?)?;
    }
    Some(total)
}

/// Runs `scenario` through the engines within the default budget ([`Budget::from_env`]).
pub fn run(scenario: &Scenario) -> Result<Outcome, RunError> {
    Run::new(scenario, &Budget::from_env()?).execute()
}

/// Refuses a problem whose simulated memory does not fit `budget`, before anything is planned or allocated.
pub fn check_budget(problem: &Problem, budget: &Budget) -> Result<(), RunError> {
    let needed = simulated_bytes(problem);
    if needed.is_none_or(|needed| needed > budget.bytes) {
        return Err(RunError::OverBudget { needed, budget: budget.clone() });
    }
    Ok(())
}

/// Runs `scenario` through the per-rank engines on the in-memory fabric (the one path of `run` and `check`):
/// the composed plan gives the decisions and the expected verdict, the engines move the bytes, and the oracle
/// judges every decode rank with the rooms it saw fail.
///
/// A scenario with `faults:` runs them (unless `options` brings faults of its own) and is judged by the fault
/// guarantee instead of its expectation ([`guarantee()`]).
pub fn run_with(scenario: &Scenario, budget: &Budget, options: &SimOptions) -> Result<Outcome, RunError> {
    Run::new(scenario, budget).sim_options(options).execute()
}

/// [`run_with`] on any [`Fabric`]: the same engines, plan and oracle.
pub fn run_on(scenario: &Scenario, budget: &Budget, fabric: &Fabric, trace: bool) -> Result<Outcome, RunError> {
    Run::new(scenario, budget).on(fabric).trace(trace).execute()
}

/// Runs `scenario` through the engines on the in-memory fabric with `planner` in every prefill rank's seat, and
/// judges the planner's work: the oracle per decode rank, and the rooms against the expectation (a rejection is
/// the planner's own, in its words; kvrelay's plan is not consulted).
pub fn run_with_planner(scenario: &Scenario, budget: &Budget, planner: SharedPlanner) -> Result<Outcome, RunError> {
    Run::new(scenario, budget).planner(Some(planner)).execute()
}

/// Whose plan the expectation is held against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Judge {
    /// kvrelay's composed plan and the rooms.
    OwnPlan,
    /// Only the rooms (another planner sat in the seat).
    SeatOnly,
    /// The fault guarantee (the run had seeded faults).
    Guarantee,
}

/// Judges one engine run of `scenario`: the composed plan's verdict, the oracle per decode rank, the rooms.
pub(crate) fn judge(scenario: &Scenario, engine: Result<SimRun, Failure>, whose: Judge) -> Outcome {
    let problem = &scenario.problem;
    let plan = plan::plan(problem);
    let (observation, engine, run_error) = match engine {
        Ok(mut run) => (std::mem::take(&mut run.observation), Some(run), None),
        Err(error) => (Observation::default(), None, Some(error)),
    };
    let violations = engine.as_ref().map(|run| oracle(scenario, run, &observation)).unwrap_or_default();
    let ends = engine.as_ref().map(room_ends);
    let rooms = |texts: Vec<String>| texts.into_iter().map(|text| Failure::new(FailureKind::Rooms, text)).collect();
    let mut failures: Vec<Failure> = match whose {
        Judge::OwnPlan => expectation_failures(&scenario.expect, &plan, ends.as_ref()),
        Judge::SeatOnly => ends.as_ref().map(|ends| rooms(room_failures(&scenario.expect, ends))).unwrap_or_default(),
        Judge::Guarantee => engine
            .as_ref()
            .map(|run| guarantee(scenario, run, &observation, &violations).failures)
            .unwrap_or_default()
            .into_iter()
            .map(|text| Failure::new(FailureKind::Guarantee, text))
            .collect(),
    };
    failures.extend(run_error);
    failures.extend(cross_check(scenario, engine.as_ref(), &observation));
    if !violations.is_empty() && whose != Judge::Guarantee {
        failures.push(Failure::new(FailureKind::Oracle, format!("{} oracle violations", violations.len())));
    }
    Outcome { plan, engine, observation, violations, failures }
}

/// The oracle over every decode rank of `run` (in parallel, results in rank order), each judged with its
/// [`verdicts`]; `observation` is the run's (taken out of it by the caller, or still in it).
pub fn oracle(scenario: &Scenario, run: &SimRun, observation: &Observation) -> Vec<Violation> {
    let problem = &scenario.problem;
    let ranks: Vec<_> =
        problem.decode.ranks.iter().map(|layout| (layout.rank, verdicts(&scenario.expect, run, layout.rank))).collect();
    check_ranks(problem, observation, &ranks)
}

/// Regions read back whole per decode rank to cross-check the oracle on device memory, at most this large.
const CROSS_CHECK_BYTES: u64 = 256 << 20;

/// Where decode memory was judged where it lives (device memory), the host read-back path over one region per
/// decode rank (its first, or its smallest when the first is over [`CROSS_CHECK_BYTES`]): both verdicts must be
/// identical, violation for violation. Nothing for a run whose memory came back to the host.
pub fn cross_check(scenario: &Scenario, run: Option<&SimRun>, observation: &Observation) -> Vec<Failure> {
    let Some(run) = run else { return Vec::new() };
    let ranks: Vec<_> = scenario
        .problem
        .decode
        .ranks
        .iter()
        .map(|layout| (layout.rank, verdicts(&scenario.expect, run, layout.rank)))
        .collect();
    cross_check_ranks(&scenario.problem, observation, &ranks)
}

/// [`cross_check`] with each decode rank's verdicts given (a run without rooms: `engine::direct`).
pub fn cross_check_ranks(problem: &Problem, observation: &Observation, ranks: &[(RankId, Verdicts)]) -> Vec<Failure> {
    cross_check_ranks_within(problem, observation, ranks, CROSS_CHECK_BYTES)
}

/// [`cross_check_ranks`] reading back at most about `max_bytes` a rank: its first region when that fits, else its
/// largest region that fits, else its smallest (a replay's waves keep the read-back off the transfer's scale).
pub fn cross_check_ranks_within(
    problem: &Problem,
    observation: &Observation,
    ranks: &[(RankId, Verdicts)],
    max_bytes: u64,
) -> Vec<Failure> {
    if observation.resident.is_empty() {
        return Vec::new();
    }
    let per_rank = each_rank_in_parallel(ranks, |rank, verdicts| {
        let keys = observation.resident.iter().filter(|(key, _)| key.rank == rank);
        let first = keys.clone().next().filter(|(_, region)| region.len <= max_bytes);
        let fitting =
            || keys.clone().filter(|(_, region)| region.len <= max_bytes).max_by_key(|(_, region)| region.len);
        let (key, _) = first.or_else(fitting).or_else(|| keys.min_by_key(|(_, region)| region.len))?;
        verify::cross_check_region(problem, observation, *key, verdicts)
            .map(|text| Failure::new(FailureKind::Oracle, text))
    });
    per_rank.into_iter().flatten().collect()
}

/// [`verify::check_rank`] for each `(rank, verdicts)`, the ranks judged in parallel across the machine's cores
/// (each rank's writes a task of their own, and where there are more cores than ranks, its regions cut into parts,
/// [`verify::Share`]); the violations in the order given (the same list [`verify::check_ranks`], a sequential loop,
/// returns).
pub fn check_ranks(problem: &Problem, observation: &Observation, ranks: &[(RankId, Verdicts)]) -> Vec<Violation> {
    check_ranks_in_parts(problem, observation, ranks, rank_parts(ranks.len()))
}

/// The parts [`check_ranks`] cuts each of `ranks` ranks into: the cores shared out, at most [`MAX_RANK_PARTS`].
pub fn rank_parts(ranks: usize) -> u32 {
    (crate::parallel::cores() / ranks.max(1)).clamp(1, MAX_RANK_PARTS) as u32
}

/// [`check_ranks`] with every rank's regions cut into `parts` parts (at least one), the shares spread over the
/// cores; the source index ([`verify::Sources`]) built once for all of them.
///
/// Every rank's region shares are queued before any rank's writes: a region share may wait for its judge (resident
/// memory: one compare call on the device), a writes share only computes, so the threads start every wait first and
/// the short writes shares fill in behind them. The violations are put back in [`verify::Share::all`]'s order.
pub fn check_ranks_in_parts(
    problem: &Problem,
    observation: &Observation,
    ranks: &[(RankId, Verdicts)],
    parts: u32,
) -> Vec<Violation> {
    check_ranks_on(problem, observation, ranks, parts, crate::parallel::cores())
}

/// [`check_ranks_in_parts`] on at most `threads` threads (the caller's among them): how the GPU benchmark compares
/// ways of spreading the oracle.
pub fn check_ranks_on(
    problem: &Problem,
    observation: &Observation,
    ranks: &[(RankId, Verdicts)],
    parts: u32,
    threads: usize,
) -> Vec<Violation> {
    let sources = verify::Sources::new(problem);
    let shares: Vec<verify::Share> = verify::Share::all(parts).collect();
    // (rank's index, share's index in `Share::all`), region shares first.
    let mut tasks: Vec<(usize, usize)> =
        (0..ranks.len()).flat_map(|rank| (0..shares.len()).map(move |share| (rank, share))).collect();
    tasks.sort_by_key(|(rank, share)| (shares[*share] == verify::Share::Writes, *rank, *share));
    let judged = crate::parallel::spread(&tasks, threads, |(rank, share)| {
        let (rank, verdicts) = &ranks[*rank];
        verify::check_rank_share(&sources, *rank, observation, verdicts, shares[*share])
    });
    let mut in_order: Vec<_> = tasks.into_iter().zip(judged).collect();
    in_order.sort_by_key(|(task, _)| *task);
    in_order.into_iter().flat_map(|(_, violations)| violations).collect()
}

/// A rank is cut into at most this many parts for the oracle's threads: each part is one call to the judge.
const MAX_RANK_PARTS: usize = 4;

/// `judge` of each `(rank, verdicts)`, the ranks spread over the machine's cores; the answers in the order given.
fn each_rank_in_parallel<T: Send>(
    ranks: &[(RankId, Verdicts)],
    judge: impl Fn(RankId, &Verdicts) -> T + Sync,
) -> Vec<T> {
    crate::parallel::spread(ranks, crate::parallel::cores(), |(rank, verdicts)| judge(*rank, verdicts))
}

/// The oracle's verdicts for `rank`: a rejected scenario promises more than failed rooms (no byte may have moved
/// at all); otherwise the rooms the rank saw fail.
pub fn verdicts(expect: &Expectation, run: &SimRun, rank: RankId) -> Verdicts {
    match expect {
        Expectation::Error(_) => Verdicts::rejected(),
        _ => run.verdicts(rank),
    }
}

/// Two fabrics' runs of one scenario, compared byte for byte.
#[derive(Debug)]
pub struct DiffReport {
    /// What the reference (in-memory, simulated-time) run judged.
    pub reference: Outcome,
    /// What the other fabric's run judged.
    pub other: Outcome,
    /// Every decode row whose final bytes differ.
    pub differences: Vec<verify::Difference>,
    /// Decode bytes compared.
    pub bytes: u64,
}

/// Runs `scenario` on the in-memory fabric and on `fabric`, and compares every decode rank's final image.
pub fn diff(scenario: &Scenario, budget: &Budget, fabric: &Fabric) -> Result<DiffReport, RunError> {
    let reference = run_on(scenario, budget, &Fabric::Sim, false)?;
    let mut other = run_on(scenario, budget, fabric, false)?;
    // Device memory is compared on the host: read back whole.
    if let Err(error) = other.observation.materialise() {
        other.failures.push(Failure::new(FailureKind::Fabric, format!("reading device memory back: {error}")));
    }
    let differences = verify::compare_images(&scenario.problem, &reference.observation, &other.observation);
    let bytes = reference.observation.images.values().map(|image| image.len() as u64).sum();
    Ok(DiffReport { reference, other, differences, bytes })
}

/// How the plan and the engines' room states depart from the scenario's expectation.
pub fn expectation_failures(
    expect: &Expectation,
    plan: &Result<Plan, PlanError>,
    rooms: Option<&RoomEnds>,
) -> Vec<Failure> {
    let mut failures = Vec::new();
    let text = match (expect.error(), plan) {
        (None, Err(error)) => Some(format!("expected a clean transfer, planner rejected: {error}")),
        (Some(expected), Ok(_)) => Some(format!("expected rejection `{expected}`, planner accepted")),
        (Some(expected), Err(error)) if !expected.matches(error) => {
            Some(format!("expected rejection `{expected}`, got `{}: {error}`", error.kind()))
        }
        _ => None,
    };
    failures.extend(text.map(|text| Failure::new(FailureKind::Expectation, text)));
    if let Some(rooms) = rooms {
        let texts = room_failures(&expect.pinned(plan), rooms);
        failures.extend(texts.into_iter().map(|text| Failure::new(FailureKind::Rooms, text)));
    }
    failures
}

/// How each request ended on each decode rank, and why it failed.
pub type RoomEnds = BTreeMap<RankId, BTreeMap<u64, (KvPoll, Option<String>)>>;

/// The room ends of an engine run.
pub fn room_ends(run: &SimRun) -> RoomEnds {
    let ends = |rooms: &BTreeMap<u64, crate::engine::RoomState>| {
        rooms.iter().map(|(id, room)| (*id, (room.poll, room.reason.clone()))).collect()
    };
    run.rooms.iter().map(|(rank, rooms)| (*rank, ends(rooms))).collect()
}

/// Rooms that ended otherwise than the expectation says: every room succeeds (`ok`), every room fails with the
/// message among the reasons (`error`: each decode rank words it for itself, e.g. its DCP rank), or only the
/// listed rooms fail, each with exactly the message (`error` with `ranks` or `requests`).
fn room_failures(expect: &Expectation, ends: &RoomEnds) -> Vec<String> {
    let mut failures = Vec::new();
    for (index, (rank, rooms)) in ends.iter().enumerate() {
        for (room, (poll, reason)) in rooms {
            let should_fail = match expect {
                Expectation::Ok => false,
                Expectation::Error(_) => true,
                Expectation::Partial { ranks, requests, .. } => {
                    ranks.as_ref().is_none_or(|ranks| ranks.contains(&(index as u32)))
                        && requests.as_ref().is_none_or(|requests| requests.contains(&(*room as u32)))
                }
            };
            let failed = *poll != KvPoll::Success;
            let reason = reason.clone().unwrap_or_else(|| format!("{poll:?}"));
            let wrong_reason =
                matches!(expect, Expectation::Partial { error, .. } if failed && !error.matches_reason(&reason));
            if failed != should_fail || wrong_reason {
                let ended = if failed { format!("failed: {reason}") } else { "succeeded".to_owned() };
                failures.push(format!("request {room} on decode {rank} {ended}"));
            }
        }
    }
    if let Expectation::Error(crate::scenario::ExpectedError { text: Some(message), .. }) = expect {
        let reasons: BTreeSet<&String> =
            ends.values().flat_map(|rooms| rooms.values()).filter_map(|(_, reason)| reason.as_ref()).collect();
        if failures.is_empty() && !ends.is_empty() && !reasons.contains(message) {
            // Name what they failed with instead, so a differently worded rejection can be told from a missing one.
            let got: Vec<String> = reasons.iter().take(3).map(|reason| format!("`{reason}`")).collect();
            failures.push(format!("no decode rank failed with `{message}` (they failed with {})", got.join(", ")));
        }
    }
    if failures.len() > 3 {
        let more = failures.len() - 3;
        failures.truncate(3);
        failures.push(format!("{more} more rooms"));
    }
    failures
}

/// Today's direct execution, kept as the benchmark's baseline: the composed plan's copies posted on one
/// transport holding every rank's memory, without engines or messages. The oracle's violations, or `None` when
/// the plan was rejected or the execution failed (nothing to judge as a clean transfer).
pub fn run_direct(problem: &Problem, budget: &Budget) -> Result<Option<Vec<Violation>>, RunError> {
    check_budget(problem, budget)?;
    let Ok(plan) = plan::plan(problem) else { return Ok(None) };
    let mut transport = SimFabric::new();
    let direct = exec::stage(problem, &mut transport)
        .and_then(|()| exec::execute(&plan, &mut transport))
        .and_then(|writes| exec::observe(problem, &mut transport, writes));
    let all_succeeded = |layout: &RankLayout| (layout.rank, Verdicts::all_succeeded());
    let ranks: Vec<_> = problem.decode.ranks.iter().map(all_succeeded).collect();
    // `verify::check`, with the ranks judged in parallel.
    Ok(direct.ok().map(|observation| check_ranks(problem, &observation, &ranks)))
}
