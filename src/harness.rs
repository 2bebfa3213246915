//! One scenario end to end on a transport: plan, stage, execute, observe, verify, judge.

use crate::exec::{self, ExecError};
use crate::fabric::{SimFabric, Transport};
use crate::plan::{self, Plan, PlanError};
use crate::scenario::{Expectation, Scenario};
use crate::verify::{self, Observation, Violation};

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

/// Runs `scenario` on a fresh in-memory fabric.
pub fn run(scenario: &Scenario) -> Outcome {
    run_on(scenario, &mut SimFabric::new())
}

/// Runs `scenario` on `transport`. A rejected plan executes nothing; the oracle then checks that no byte moved.
pub fn run_on(scenario: &Scenario, transport: &mut impl Transport) -> Outcome {
    let problem = &scenario.problem;
    let plan = plan::plan(problem);
    let needed: u64 = [&problem.prefill, &problem.decode]
        .iter()
        .flat_map(|side| side.ranks.iter().flat_map(|rank| rank.regions.iter().map(|region| region.len_bytes())))
        .sum();
    let limit = memory_limit();
    if needed > limit {
        // Refuse before allocating: a scenario too big for this machine must fail, not hang or swap.
        let failure = format!(
            "the scenario registers {needed} bytes of simulated memory, more than the limit of {limit} (fix: smaller requests or pools, or raise KVRELAY_MAX_FABRIC_BYTES)"
        );
        return Outcome {
            plan,
            exec_error: None,
            observation: Observation::default(),
            violations: Vec::new(),
            failures: vec![failure],
        };
    }
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
    let observation = match exec::observe(problem, &mut *transport, writes) {
        Ok(observation) => observation,
        Err(error) => {
            exec_error.get_or_insert(error);
            Observation::default()
        }
    };
    let violations = match (&exec_error, &plan) {
        (Some(_), _) => Vec::new(),
        (None, Ok(_)) => verify::check(problem, &observation),
        (None, Err(_)) => verify::check_untouched(problem, &observation),
    };
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
    Outcome { plan, exec_error, observation, violations, failures }
}

/// Simulated-memory budget of one run: `KVRELAY_MAX_FABRIC_BYTES`, or 16 GiB (the Kimi-K3 scenario needs about 2.6).
fn memory_limit() -> u64 {
    std::env::var("KVRELAY_MAX_FABRIC_BYTES").ok().and_then(|value| value.parse().ok()).unwrap_or(16 << 30)
}
