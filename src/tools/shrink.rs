//! Shrinking (`kvrelay shrink`): a failing scenario reduced to a minimal one that fails the same way.
//!
//! What fails is chosen by [`Mode`]: the scenario's own run (its expectation, or the fault guarantee when it has
//! `faults:`), a self-test mutant in the planner's seat (the oracle must catch it), or an external planner in the
//! seat. How it fails is its [`Signature`]: for an oracle violation the region's kind and the violation's class,
//! with every number replaced by `N` (`oracle: layer N kv: wrong bytes, found sentinel (never written)`); otherwise
//! the first failure's text with every number replaced by `N` (`run: request N on decode ...`), or the external
//! planner's protocol failure. Numbers are left out so that the signature survives coordinates moving as the
//! scenario shrinks. A candidate fails the same way when one of its signatures is the original's first one.
//!
//! The reduction is greedy delta debugging on the YAML ([`crate::scenario::reduce`]): candidates in a fixed order
//! (drop requests, drop fault rules, halve PP/TP/DCP, halve the layers, drop state, merge chunks, shrink tokens,
//! drop optional fields); the first one that loads, is smaller ([`Size::key`]) and fails the same way is kept and
//! the candidates are drawn again (under a mutant, only when kvrelay's own plans in the same seat still pass it),
//! until a whole round keeps none (a fixpoint) or the run cap is reached. Everything is in a fixed order, so the same
//! input gives the byte-identical output.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt;
use std::rc::Rc;
use std::time::Duration;

use crate::engine::seat::SharedPlanner;
use crate::engine::sim::SimOptions;
use crate::external::ProcessPlanner;
use crate::harness::{self, Budget, FailureKind, Outcome, RunError};
use crate::scenario::reduce::Draft;
use crate::scenario::{self, Scenario, ScenarioError};
use crate::selftest::{Mutant, MutantPlanner};
use crate::verify::{Content, Violation, ViolationKind};

/// The default cap on candidate runs.
pub const DEFAULT_MAX_RUNS: usize = crate::limits::SHRINK_MAX_RUNS;

/// What makes a run fail.
pub enum Mode {
    /// The scenario's own run (`harness::run_with`): its expectation, or the guarantee under `faults:`.
    Own,
    /// The self-test mutant in every prefill rank's planner seat, caught by the oracle or the rooms.
    Mutant(Mutant),
    /// An external planner (`sh -c CMD`) in the seat, judged as `kvrelay check --planner` judges it.
    Planner(Rc<RefCell<ProcessPlanner>>),
}

impl Mode {
    /// An external planner run as `sh -c command`, each case answered within `timeout`.
    pub fn planner(command: &str, timeout: Duration) -> Mode {
        Mode::Planner(Rc::new(RefCell::new(ProcessPlanner::new(command, timeout))))
    }
}

/// How a run fails: a class (`oracle`, `run`, `protocol`) and its number-free detail.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Signature {
    pub class: &'static str,
    pub detail: String,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.class, self.detail)
    }
}

/// `text` with every run of digits replaced by `N`, clipped to 160 characters.
fn without_numbers(text: &str) -> String {
    let mut res = String::new();
    let mut in_number = false;
    for character in text.chars().take(160) {
        if character.is_ascii_digit() {
            if !in_number {
                res.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            res.push(character);
        }
    }
    res
}

fn content_class(content: &Content) -> &'static str {
    match content {
        Content::Sentinel => "sentinel (never written)",
        Content::From(_) => "source bytes",
        Content::Damaged { .. } => "damaged bytes",
    }
}

/// The signature of one oracle violation: the region's kind and the violation's class, numbers left out.
pub fn violation_signature(violation: &Violation) -> Signature {
    let class = match &violation.kind {
        ViolationKind::Wrong { found, .. } => format!("wrong bytes, found {}", content_class(found)),
        ViolationKind::Overwritten { .. } => "written more than once".to_owned(),
        ViolationKind::Unplaceable { .. } => "no decode page".to_owned(),
        ViolationKind::Geometry { .. } => "rows differ".to_owned(),
        ViolationKind::OutsideRegion { .. } => "past the region".to_owned(),
        ViolationKind::IndexLengths { .. } => "state index lengths differ".to_owned(),
        ViolationKind::Unjudged { .. } => "device memory not judged".to_owned(),
        ViolationKind::StrayWrite { .. } => "a write outside the decode memory".to_owned(),
    };
    Signature { class: "oracle", detail: format!("{}: {class}", without_numbers(&violation.region)) }
}

/// Every signature of a failed outcome, most telling first: the oracle's violations (when the judgement counts
/// them), then the first failure's text. Empty when the outcome passed.
pub fn signatures(outcome: &Outcome) -> Vec<Signature> {
    if outcome.passed() {
        return Vec::new();
    }
    let mut res = Vec::new();
    let counted = outcome.failed_with(FailureKind::Oracle);
    if counted {
        let mut seen = BTreeSet::new();
        for violation in &outcome.violations {
            let signature = violation_signature(violation);
            if seen.insert(signature.clone()) {
                res.push(signature);
            }
        }
    }
    if let Some(first) = outcome.failures.iter().find(|failure| failure.kind != FailureKind::Oracle) {
        res.push(Signature { class: "run", detail: without_numbers(&first.text) });
    }
    res
}

/// The sizes reported before and after, and the order that decides "smaller".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    pub requests: u64,
    pub tokens: u64,
    pub chunks: u64,
    pub layers: u64,
    /// Ranks on both sides.
    pub ranks: u64,
    /// Simulated memory both sides register.
    pub bytes: u64,
    pub fault_rules: u64,
    /// Bytes of the YAML text.
    pub text_bytes: u64,
}

impl Size {
    pub fn of(scenario: &Scenario, text: &str) -> Size {
        let problem = &scenario.problem;
        let ranks = |side: &crate::model::SideLayout| u64::from(side.topology.tp * side.topology.pp);
        Size {
            requests: problem.requests.len() as u64,
            tokens: problem.requests.iter().map(|request| u64::from(request.tokens)).sum(),
            chunks: problem.requests.iter().map(|request| request.chunks.len() as u64).sum(),
            layers: u64::from(problem.model.layer_count),
            ranks: ranks(&problem.prefill) + ranks(&problem.decode),
            bytes: harness::simulated_bytes(problem).unwrap_or(u64::MAX),
            fault_rules: scenario.faults.rules.len() as u64,
            text_bytes: text.len() as u64,
        }
    }

    /// Smaller means: fewer simulated bytes, then fewer things (requests, tokens, chunks, layers, ranks, fault
    /// rules), then shorter text. Every kept candidate is strictly smaller, so the reduction ends.
    pub fn key(&self) -> (u64, u64, u64) {
        let things = self.requests + self.tokens + self.chunks + self.layers + self.ranks + self.fault_rules;
        (self.bytes, things, self.text_bytes)
    }
}

/// Why a scenario could not be shrunk.
#[derive(Debug, thiserror::Error)]
pub enum ShrinkError {
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Draft(#[from] crate::scenario::reduce::DraftError),
}

/// A shrunk scenario.
#[derive(Debug, Clone)]
pub struct Shrunk {
    /// The reduced scenario's YAML (without the comment header).
    pub yaml: String,
    /// How the original and the result fail.
    pub signature: Signature,
    pub before: Size,
    pub after: Size,
    /// The reductions kept, in order.
    pub steps: Vec<String>,
    /// Candidates run (each loaded and run once).
    pub runs: usize,
    /// Candidates that did not load.
    pub unloadable: usize,
    /// The run cap stopped the reduction before a fixpoint.
    pub capped: bool,
}

/// Runs `scenario` under `mode`; its signatures (empty: it passed).
fn attempt(scenario: &Scenario, mode: &Mode, budget: &Budget) -> Result<Vec<Signature>, RunError> {
    match mode {
        Mode::Own => Ok(signatures(&harness::run_with(scenario, budget, &SimOptions::default())?)),
        Mode::Mutant(mutant) => {
            if mutant.applies(&scenario.problem).is_err() {
                return Ok(Vec::new());
            }
            let planner = Rc::new(RefCell::new(MutantPlanner::new(Some(*mutant))));
            Ok(signatures(&harness::run_with_planner(scenario, budget, SharedPlanner(planner))?))
        }
        Mode::Planner(planner) => {
            planner.borrow_mut().start_case(&scenario.file);
            let outcome = harness::run_with_planner(scenario, budget, SharedPlanner(planner.clone()))?;
            if let Some(reason) = planner.borrow().failure() {
                let detail = without_numbers(&reason.reason());
                return Ok(vec![Signature { class: "protocol", detail }]);
            }
            Ok(signatures(&outcome))
        }
    }
}

/// Under a mutant, whether kvrelay's own plans in the same seat pass `scenario`: the failure kept must be the
/// mutant's, not one the reduction made of the scenario itself. Always true in the other modes.
fn baseline_passes(scenario: &Scenario, mode: &Mode, budget: &Budget) -> bool {
    if !matches!(mode, Mode::Mutant(_)) {
        return true;
    }
    let own = Rc::new(RefCell::new(MutantPlanner::new(None)));
    harness::run_with_planner(scenario, budget, SharedPlanner(own)).is_ok_and(|outcome| outcome.passed())
}

/// Shrinks the scenario `text` (from `file`, with `seed` replacing its own when given) under `mode`, running at most
/// `max_runs` candidates.
pub fn shrink(
    text: &str,
    file: &str,
    seed: Option<u64>,
    mode: &Mode,
    budget: &Budget,
    max_runs: usize,
) -> Result<Shrunk, ShrinkError> {
    let stem = std::path::Path::new(file).file_stem().map(|it| it.to_string_lossy().into_owned()).unwrap_or_default();
    let original = scenario::parse_seeded(text, file, &stem, seed)?;
    if let Mode::Mutant(mutant) = mode {
        if let Err(reason) = mutant.applies(&original.problem) {
            return Err(ShrinkError::Refused(format!(
                "the mutant {} cannot change a byte of {file}: {reason} (fix: a scenario it applies to)",
                mutant.name()
            )));
        }
        let baseline = Rc::new(RefCell::new(MutantPlanner::new(None)));
        let outcome = harness::run_with_planner(&original, budget, SharedPlanner(baseline))?;
        if !outcome.passed() {
            return Err(ShrinkError::Refused(format!(
                "{file} fails without the mutant ({}); shrink it without --mutant",
                outcome.failure_text("; ")
            )));
        }
    }
    let Some(signature) = attempt(&original, mode, budget)?.into_iter().next() else {
        let (how, fix) = match mode {
            Mode::Own => ("its run passes".to_owned(), "a failing scenario, or --mutant NAME or --planner CMD"),
            Mode::Mutant(mutant) => (
                format!("the oracle does not catch the mutant {}", mutant.name()),
                "a scenario where selftest catches it",
            ),
            Mode::Planner(_) => ("the planner passes it".to_owned(), "a scenario the planner fails"),
        };
        return Err(ShrinkError::Refused(format!(
            "{file} does not fail ({how}); there is nothing to shrink (fix: {fix})"
        )));
    };
    let mut draft = Draft::parse(text)?;
    draft.set_seed(original.seed);
    draft.set_name(&format!("{}-shrunk", original.name));
    let mut current = (draft.to_yaml(), original.clone());
    let before = Size::of(&original, &current.0);
    let mut size = before;
    let (mut steps, mut runs, mut unloadable, mut capped) = (Vec::new(), 0, 0, false);
    'rounds: loop {
        let model = &current.1.problem.model;
        let candidates = draft.candidates(model.layer_count, &model.kv_layers);
        let mut kept = false;
        for candidate in candidates {
            let yaml = candidate.draft.to_yaml();
            let Ok(loaded) = scenario::parse(&yaml, file, &stem) else {
                unloadable += 1;
                continue;
            };
            let candidate_size = Size::of(&loaded, &yaml);
            if candidate_size.key() >= size.key() {
                continue;
            }
            if runs >= max_runs {
                capped = true;
                break 'rounds;
            }
            runs += 1;
            // A candidate over the budget is not smaller in any way that matters; it is passed over.
            let Ok(found) = attempt(&loaded, mode, budget) else { continue };
            if found.contains(&signature) && baseline_passes(&loaded, mode, budget) {
                steps.push(candidate.what);
                draft = candidate.draft;
                size = candidate_size;
                current = (yaml, loaded);
                kept = true;
                break;
            }
        }
        if !kept {
            break;
        }
    }
    Ok(Shrunk { yaml: current.0, signature, before, after: size, steps, runs, unloadable, capped })
}

/// The comment header of a shrunk scenario file: what it reproduces, from what, and how.
pub fn header(source: &str, mode_words: &str, shrunk: &Shrunk, reproduce: &str) -> String {
    let (before, after) = (&shrunk.before, &shrunk.after);
    let mut lines = vec![
        format!("Shrunk by `kvrelay shrink` from {source} ({mode_words})."),
        format!("Reproduces: {}", shrunk.signature),
        format!(
            "Before: {} requests, {} tokens, {} layers, {} ranks, {} bytes; after: {} requests, {} tokens, {} layers, \
             {} ranks, {} bytes.",
            before.requests,
            before.tokens,
            before.layers,
            before.ranks,
            before.bytes,
            after.requests,
            after.tokens,
            after.layers,
            after.ranks,
            after.bytes
        ),
        format!("Reproduce: {reproduce}"),
    ];
    if shrunk.capped {
        lines
            .push(format!("The run cap stopped the reduction after {} runs: smaller, maybe not minimal.", shrunk.runs));
    }
    lines.iter().map(|line| format!("# {line}\n")).collect()
}
