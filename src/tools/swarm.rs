//! Swarm runs (issue 11): a swarm draws, per seed, a random subset of fault kinds and a probability for each (swarm
//! testing: different runs stress different combinations), runs each scenario through the engines under them
//! ([`crate::fabric::faults`]) and judges every run by the fault guarantee ([`guarantee`], which lives with the
//! harness: [`crate::harness::guarantee()`]; re-exported here).

use std::collections::BTreeMap;

use rand::RngExt as _;

use crate::engine::sim::SimRun;
use crate::fabric::faults::{FaultKind, FaultPlan, FaultRule};
pub use crate::harness::{guarantee, premature_successes, Judgement};
use crate::harness::{Budget, Failure, FailureKind, Run};
use crate::scenario::{Expectation, Scenario};
use crate::seed::Seed;

/// Runs `scenario` with `faults` through the engines on the in-memory fabric and judges it.
pub fn run_faulted(scenario: &Scenario, faults: &FaultPlan) -> Result<(SimRun, Judgement), Failure> {
    // The swarm runs the corpus, whose scenarios `check` already runs within its budget.
    let budget = Budget::unbounded("the swarm runs scenarios the golden gate already ran");
    let fabric = |error: crate::harness::RunError| Failure::new(FailureKind::Fabric, error.to_string());
    let run = Run::new(scenario, &budget).faults(faults.clone()).engines().map_err(fabric)??;
    let violations = crate::harness::oracle(scenario, &run, &run.observation);
    let judgement = guarantee(scenario, &run, &run.observation, &violations);
    Ok((run, judgement))
}

/// Probabilities a swarm draws from, per fault kind chosen.
const PROBABILITIES: [f64; 4] = [0.001, 0.01, 0.05, 0.2];

/// The faults of swarm seed `seed`: each kind in with probability one half (at least one), each at a probability
/// drawn from [`PROBABILITIES`]; the fault streams are seeded with `seed` too.
pub fn swarm_faults(seed: u64) -> FaultPlan {
    let mut rng = Seed(seed).stream("swarm.faults");
    let mut rules = Vec::new();
    for kind in FaultKind::ALL {
        // Both draws are made for every kind, so one kind's choice never shifts another's.
        let (chosen, level) = (rng.random_bool(0.5), rng.random_range(0..PROBABILITIES.len()));
        if chosen {
            rules.push(FaultRule { kind, probability: PROBABILITIES[level] });
        }
    }
    if rules.is_empty() {
        let kind = FaultKind::ALL[rng.random_range(0..FaultKind::ALL.len())];
        rules.push(FaultRule { kind, probability: PROBABILITIES[rng.random_range(0..PROBABILITIES.len())] });
    }
    FaultPlan { seed, rules }
}

/// Whether a scenario takes part in a swarm: it expects a clean transfer (rejections move no byte to fault).
pub fn swarmable(scenario: &Scenario) -> bool {
    scenario.expect == Expectation::Ok
}

/// Totals of a swarm (or of one shard of it: [`Tally::merge`] adds shards up).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Tally {
    pub runs: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub detected: u64,
    /// Faults injected, by kind name.
    pub injected: BTreeMap<String, u64>,
    /// (scenario file, seed, first broken guarantee) per harness failure.
    pub harness_failures: Vec<(String, u64, String)>,
}

impl Tally {
    /// Adds one run's judgement.
    pub fn add(&mut self, file: &str, seed: u64, run: &SimRun, judgement: Judgement) {
        self.runs += 1;
        self.succeeded += judgement.succeeded;
        self.failed += judgement.failed;
        self.detected += u64::from(judgement.detected);
        for (kind, count) in &run.faults {
            *self.injected.entry((*kind).to_owned()).or_default() += count;
        }
        if let Some(first) = judgement.failures.into_iter().next() {
            self.harness_failures.push((file.to_owned(), seed, first));
        }
    }

    /// Adds another shard's totals; harness failures end in the unsharded order, by seed and then by `order`'s
    /// position of their scenario file.
    pub fn merge(&mut self, other: Tally, order: &[String]) {
        self.runs += other.runs;
        self.succeeded += other.succeeded;
        self.failed += other.failed;
        self.detected += other.detected;
        for (kind, count) in other.injected {
            *self.injected.entry(kind).or_default() += count;
        }
        self.harness_failures.extend(other.harness_failures);
        let position = |file: &String| order.iter().position(|known| known == file).unwrap_or(order.len());
        self.harness_failures.sort_by_key(|(file, seed, _)| (*seed, position(file)));
    }
}
