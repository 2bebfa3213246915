//! One scenario end to end: budget, composed plan, the per-rank engines on the in-memory fabric, the oracle per
//! decode rank, and the judgement against the scenario's expectation.

use crate::engine::sim::{self, SimOptions, SimRun};
use crate::exec::{self, SimFabric};
use crate::limits::{DEFAULT_MEMORY_SHARE, FALLBACK_MEMORY_BUDGET, MEMORY_BUDGET_ENV};
use crate::model::Problem;
use crate::plan::{self, Plan, PlanError};
use crate::scenario::{Expectation, Scenario};
use crate::verify::{self, Observation, Verdicts, Violation};
use crate::wire::KvPoll;

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
    pub failures: Vec<String>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
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

    /// `KVRELAY_MAX_FABRIC_BYTES` when set; otherwise half of the machine's available memory (`MemAvailable` of
    /// /proc/meminfo), or 4 GiB where that cannot be read.
    pub fn from_env() -> Result<Budget, RunError> {
        if let Ok(value) = std::env::var(MEMORY_BUDGET_ENV) {
            return match value.trim().parse() {
                Ok(bytes) => Ok(Budget { bytes, source: format!("from {MEMORY_BUDGET_ENV}") }),
                Err(_) => Err(RunError::BadBudget { value }),
            };
        }
        let (numerator, denominator) = DEFAULT_MEMORY_SHARE;
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
    let mut total = 0u64;
    for side in [&problem.prefill, &problem.decode] {
        for region in side.ranks.iter().flat_map(|rank| &rank.regions) {
            let bytes = region.item_len.checked_mul(u64::from(region.item_count))?;
            total = total.checked_add(bytes)?;
        }
    }
    Some(total)
}

/// Runs `scenario` through the engines within the default budget ([`Budget::from_env`]).
pub fn run(scenario: &Scenario) -> Result<Outcome, RunError> {
    run_with(scenario, &Budget::from_env()?, &SimOptions::default())
}

/// Refuses a problem whose simulated memory does not fit `budget`, before anything is planned or allocated.
fn check_budget(problem: &Problem, budget: &Budget) -> Result<(), RunError> {
    let needed = simulated_bytes(problem);
    if needed.is_none_or(|needed| needed > budget.bytes) {
        return Err(RunError::OverBudget { needed, budget: budget.clone() });
    }
    Ok(())
}

/// Runs `scenario` through the per-rank engines on the in-memory fabric (the one path of `run` and `check`):
/// the composed plan gives the decisions and the expected verdict, the engines move the bytes, and the oracle
/// judges every decode rank with the rooms it saw fail.
pub fn run_with(scenario: &Scenario, budget: &Budget, options: &SimOptions) -> Result<Outcome, RunError> {
    let problem = &scenario.problem;
    check_budget(problem, budget)?;
    let plan = plan::plan(problem);
    let (observation, engine, run_error) = match sim::run(problem, options) {
        Ok(mut run) => (std::mem::take(&mut run.observation), Some(run), None),
        Err(error) => (Observation::default(), None, Some(error.to_string())),
    };
    let mut violations = Vec::new();
    if let Some(run) = &engine {
        for layout in &problem.decode.ranks {
            // A rejected scenario promises more than failed rooms: no byte may have moved at all.
            let verdicts = match scenario.expect {
                Expectation::Error(_) => Verdicts::rejected(),
                _ => run.verdicts(layout.rank),
            };
            violations.extend(verify::check_rank(problem, layout.rank, &observation, &verdicts));
        }
    }
    let mut failures = expectation_failures(&scenario.expect, &plan, engine.as_ref());
    if let Some(error) = &run_error {
        failures.push(format!("the simulated fabric failed: {error}"));
    }
    if !violations.is_empty() {
        failures.push(format!("{} oracle violations", violations.len()));
    }
    Ok(Outcome { plan, engine, observation, violations, failures })
}

/// How the plan and the engines' room states depart from the scenario's expectation.
fn expectation_failures(expect: &Expectation, plan: &Result<Plan, PlanError>, engine: Option<&SimRun>) -> Vec<String> {
    let mut failures = Vec::new();
    match (expect.error(), plan) {
        (None, Err(error)) => failures.push(format!("expected a clean transfer, planner rejected: {error}")),
        (Some(message), Ok(_)) => failures.push(format!("expected rejection `{message}`, planner accepted")),
        (Some(message), Err(error)) if error.to_string() != message => {
            failures.push(format!("expected rejection `{message}`, got `{error}`"));
        }
        _ => {}
    }
    if let Some(engine) = engine {
        failures.extend(room_failures(expect, engine));
    }
    failures
}

/// Rooms that ended otherwise than the expectation says: every room succeeds (`ok`), every room fails with the
/// message among the reasons (`error`: each decode rank words it for itself, e.g. its DCP rank), or only the
/// listed rooms fail, each with exactly the message (`error` with `ranks` or `requests`).
fn room_failures(expect: &Expectation, engine: &SimRun) -> Vec<String> {
    let mut failures = Vec::new();
    for (index, (rank, rooms)) in engine.rooms.iter().enumerate() {
        for (room, state) in rooms {
            let should_fail = match expect {
                Expectation::Ok => false,
                Expectation::Error(_) => true,
                Expectation::Partial { ranks, requests, .. } => {
                    ranks.as_ref().is_none_or(|ranks| ranks.contains(&(index as u32)))
                        && requests.as_ref().is_none_or(|requests| requests.contains(&(*room as u32)))
                }
            };
            let failed = state.poll != KvPoll::Success;
            let reason = state.reason.clone().unwrap_or_else(|| format!("{:?}", state.poll));
            let wrong_reason = matches!(expect, Expectation::Partial { error, .. } if failed && reason != *error);
            if failed != should_fail || wrong_reason {
                let ended = if failed { format!("failed: {reason}") } else { "succeeded".to_owned() };
                failures.push(format!("request {room} on decode {rank} {ended}"));
            }
        }
    }
    if let Expectation::Error(message) = expect {
        let mut reasons =
            engine.rooms.values().flat_map(|rooms| rooms.values()).filter_map(|room| room.reason.as_ref());
        if failures.is_empty() && !engine.rooms.is_empty() && !reasons.any(|reason| reason == message) {
            failures.push(format!("no decode rank failed with `{message}`"));
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
    Ok(direct.ok().map(|observation| verify::check(problem, &observation)))
}
