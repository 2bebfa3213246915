//! One scenario end to end on a transport: plan, stage, execute, observe, verify, judge.

use crate::exec::{self, ExecError};
use crate::fabric::{SimFabric, Transport};
use crate::limits::{DEFAULT_MEMORY_SHARE, FALLBACK_MEMORY_BUDGET, MEMORY_BUDGET_ENV};
use crate::model::Problem;
use crate::plan::{self, Plan, PlanError};
use crate::scenario::{Expectation, Scenario};
use crate::verify::{self, Observation, Verdicts, Violation};

/// Everything a run produced, for rendering and judging.
#[derive(Debug)]
pub struct Outcome {
    pub plan: Result<Plan, PlanError>,
    pub exec_error: Option<ExecError>,
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

/// Runs `scenario` on a fresh in-memory fabric within the default budget ([`Budget::from_env`]).
pub fn run(scenario: &Scenario) -> Result<Outcome, RunError> {
    run_with(scenario, &Budget::from_env()?)
}

/// Runs `scenario` on a fresh in-memory fabric within `budget`.
pub fn run_with(scenario: &Scenario, budget: &Budget) -> Result<Outcome, RunError> {
    run_on(scenario, &mut SimFabric::new(), budget)
}

/// Runs `scenario` on `transport`. A rejected plan executes nothing; the oracle then checks that no byte moved.
///
/// The memory check comes first: a scenario over `budget` is refused before planning or allocating anything.
pub fn run_on(scenario: &Scenario, transport: &mut impl Transport, budget: &Budget) -> Result<Outcome, RunError> {
    let problem = &scenario.problem;
    let needed = simulated_bytes(problem);
    if needed.is_none_or(|needed| needed > budget.bytes) {
        return Err(RunError::OverBudget { needed, budget: budget.clone() });
    }
    let plan = plan::plan(problem);
    let mut exec_error = None;
    let mut writes = Vec::new();
    if let Err(error) = exec::stage(problem, transport) {
        exec_error = Some(error);
    } else if let Ok(plan) = &plan {
        match exec::execute(plan, transport) {
            Ok(records) => writes = records,
            Err(error) => exec_error = Some(error),
        }
    }
    let (observation, observed) = match exec::observe(problem, &mut *transport, writes) {
        Ok(observation) => (observation, true),
        Err(error) => {
            exec_error.get_or_insert(error);
            (Observation::default(), false)
        }
    };
    // Every run is judged, a failed one included: an execution error fails every request, which may then leave
    // bytes only inside its own destination items.
    let verdicts = match (&exec_error, &plan) {
        (_, Err(_)) => Verdicts::rejected(),
        (Some(_), Ok(_)) => {
            Verdicts { failed: problem.requests.iter().map(|request| request.id).collect(), nothing_sent: false }
        }
        (None, Ok(_)) => Verdicts::all_succeeded(),
    };
    let violations = if observed { verify::check_outcome(problem, &observation, &verdicts) } else { Vec::new() };
    let mut failures = Vec::new();
    match (&scenario.expect, &plan) {
        (Expectation::Ok, Err(error)) => failures.push(format!("expected a clean transfer, planner rejected: {error}")),
        (Expectation::Error(message), Ok(_)) => {
            failures.push(format!("expected rejection `{message}`, planner accepted"))
        }
        (Expectation::Error(message), Err(error)) if error.to_string() != *message => {
            failures.push(format!("expected rejection `{message}`, got `{error}`"));
        }
        _ => {}
    }
    if let Some(error) = &exec_error {
        failures.push(format!("execution failed: {error}"));
    }
    if !violations.is_empty() {
        failures.push(format!("{} oracle violations", violations.len()));
    }
    Ok(Outcome { plan, exec_error, observation, violations, failures })
}
