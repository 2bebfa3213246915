//! Scenario files: YAML in, a [`Problem`] plus its expected verdict out, or every diagnostic at once.
//!
//! `raw.rs` holds the serde DTOs and documents the schema; `lower.rs` validates and converts them, running the
//! seeded page allocator. Only this module knows YAML.

mod lower;
pub mod raw;
pub mod reduce;
pub mod schema;
mod text;
mod yaml;

use crate::faults::{FaultKind, FaultPlan, FaultRule};
use std::fmt;
use std::io::Read as _;
use std::path::Path;

#[cfg(doc)]
use crate::limits::MAX_DIAGNOSTICS;
use crate::limits::MAX_SCENARIO_BYTES;
use crate::model::Problem;
use crate::plan::{Plan, PlanError, PlanErrorKind};

/// What the scenario promises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expectation {
    /// The plan succeeds and the oracle finds no violation.
    Ok,
    /// The planner rejects the problem with this error, and no byte is written.
    Error(ExpectedError),
    /// The composed plan rejects with `error`; on the decode ranks the engines fail only the listed rooms (decode
    /// rank indices, stage-major; request ids; `None` = all) and every other room succeeds byte-exact.
    Partial { error: ExpectedError, ranks: Option<Vec<u32>>, requests: Option<Vec<u32>> },
}

impl Expectation {
    /// The rejection the composed plan must give, if any.
    pub fn error(&self) -> Option<&ExpectedError> {
        match self {
            Expectation::Ok => None,
            Expectation::Error(error) | Expectation::Partial { error, .. } => Some(error),
        }
    }

    /// This expectation with its text pinned to `plan`'s rejection when it names the expected kind and the
    /// scenario gave no text: the rooms must then fail in the planner's own words.
    pub fn pinned(&self, plan: &Result<Plan, PlanError>) -> Expectation {
        let mut pinned = self.clone();
        if let (Expectation::Error(expected) | Expectation::Partial { error: expected, .. }, Err(error)) =
            (&mut pinned, plan)
        {
            if expected.text.is_none() && expected.kind == error.kind() {
                expected.text = Some(error.to_string());
            }
        }
        pinned
    }
}

/// A rejection a scenario expects: its kind, and optionally its exact text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedError {
    pub kind: PlanErrorKind,
    /// When present, the rejection's message must equal it (domain.md's wording where it documents one).
    pub text: Option<String>,
}

impl ExpectedError {
    /// Whether the planner's `error` is this one: its kind, and its text when one is expected.
    pub fn matches(&self, error: &PlanError) -> bool {
        error.kind() == self.kind && self.text.as_ref().is_none_or(|text| *text == error.to_string())
    }

    /// Whether a room's failure `reason` (the planner's text, as the engines report it) fits: any reason when no
    /// text is expected.
    pub fn matches_reason(&self, reason: &str) -> bool {
        self.text.as_ref().is_none_or(|text| text == reason)
    }
}

impl fmt::Display for ExpectedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.text {
            Some(text) => write!(f, "{}: {text}", self.kind),
            None => write!(f, "{}", self.kind),
        }
    }
}

/// A loaded scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    /// The file it came from, as given.
    pub file: String,
    /// The allocator seed in effect (the file's, or an override).
    pub seed: u64,
    pub problem: Problem,
    pub expect: Expectation,
    /// Golden files record the engines' event summary too.
    pub events: bool,
    /// Seeded faults (the `faults:` section, drawn from `seed`); empty: a clean run.
    pub faults: FaultPlan,
}

/// One problem found in a scenario file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// Field path such as `requests[1].chunks`.
    pub path: String,
    pub message: String,
    /// What kind of problem it is.
    pub kind: ScenarioErrorKind,
}

error_kinds! {
    /// The kind of a scenario [`Diagnostic`] (and of a [`ScenarioError`]: its first diagnostic's).
    pub enum ScenarioErrorKind {
        /// The file cannot be opened or read.
        Unreadable = "unreadable",
        /// The bytes are not UTF-8 text, or hold control characters.
        NotText = "not_text",
        /// A size, nesting depth, alias expansion or count past a limit of `src/pure/limits.rs`.
        TooLarge = "too_large",
        /// Not YAML: a syntax error or a key given twice.
        Syntax = "syntax",
        /// YAML that does not fit the schema: an unknown or missing field, a value of the wrong type.
        Schema = "schema",
        /// A value the loader refuses: out of range, or contradicting another.
        InvalidValue = "invalid_value",
        /// `expect.error` names no planner error kind.
        UnknownErrorKind = "unknown_error_kind",
    }
}

/// The first [`MAX_DIAGNOSTICS`] diagnostics of one file, or why it could not be read, and how many more there were.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioError {
    pub file: String,
    pub diagnostics: Vec<Diagnostic>,
    /// Diagnostics found beyond the ones kept.
    pub omitted: usize,
}

impl ScenarioError {
    /// The kind of the first diagnostic (what stopped the file first).
    pub fn kind(&self) -> ScenarioErrorKind {
        self.diagnostics.first().map_or(ScenarioErrorKind::InvalidValue, |diagnostic| diagnostic.kind)
    }

    fn one(file: &str, diagnostic: Diagnostic) -> ScenarioError {
        ScenarioError { file: file.to_owned(), diagnostics: vec![diagnostic], omitted: 0 }
    }
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, diagnostic) in self.diagnostics.iter().enumerate() {
            if index > 0 {
                writeln!(f)?;
            }
            f.write_str(&self.file)?;
            if let Some(line) = diagnostic.line {
                write!(f, ":{line}")?;
                if let Some(column) = diagnostic.column {
                    write!(f, ":{column}")?;
                }
            }
            f.write_str(": ")?;
            if !diagnostic.path.is_empty() {
                write!(f, "{}: ", diagnostic.path)?;
            }
            f.write_str(&diagnostic.message)?;
        }
        if self.omitted > 0 {
            write!(f, "\n{}: ... and {} more diagnostics (fix the ones above first)", self.file, self.omitted)?;
        }
        Ok(())
    }
}

impl std::error::Error for ScenarioError {}

/// Reads and lowers the scenario at `path`.
pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
    load_seeded(path, None)
}

/// [`load`], with `seed` (when given) replacing the file's `seed` for the allocators.
///
/// A file over [`MAX_SCENARIO_BYTES`] is refused from its metadata, and at most one byte past the limit is read.
pub fn load_seeded(path: &Path, seed: Option<u64>) -> Result<Scenario, ScenarioError> {
    let bytes = read_capped(path)?;
    let stem = path.file_stem().map(|stem| stem.to_string_lossy().into_owned()).unwrap_or_default();
    parse_bytes(&bytes, &path.display().to_string(), &stem, seed)
}

/// A `--faults FILE` (a mapping with a `faults:` list, the scenario section's syntax) as a plan drawn from `seed`;
/// errors name the file, the line and the field.
pub fn load_faults(path: &Path, seed: u64) -> Result<FaultPlan, ScenarioError> {
    let file = path.display().to_string();
    let bytes = read_capped(path)?;
    let text = text::checked_text(&bytes).map_err(|diagnostic| ScenarioError::one(&file, diagnostic))?;
    let raw: raw::RawFaultFile = yaml::parse(text).map_err(|diagnostic| ScenarioError::one(&file, diagnostic))?;
    faults(&raw.faults, seed).map_err(|mut diagnostic| {
        diagnostic.line = lower::locate(text, &diagnostic.path);
        ScenarioError::one(&file, diagnostic)
    })
}

/// The bytes of `path`, refused past [`MAX_SCENARIO_BYTES`] before they are read.
fn read_capped(path: &Path) -> Result<Vec<u8>, ScenarioError> {
    let file = path.display().to_string();
    let unreadable = |error: std::io::Error| {
        let message = format!("cannot read: {error}");
        let kind = ScenarioErrorKind::Unreadable;
        ScenarioError::one(&file, Diagnostic { line: None, column: None, path: String::new(), message, kind })
    };
    let handle = std::fs::File::open(path).map_err(unreadable)?;
    let len = handle.metadata().map_err(unreadable)?.len();
    if len > MAX_SCENARIO_BYTES {
        return Err(ScenarioError::one(&file, text::too_large(len)));
    }
    let mut bytes = Vec::new();
    handle.take(MAX_SCENARIO_BYTES + 1).read_to_end(&mut bytes).map_err(unreadable)?;
    Ok(bytes)
}

/// Parses scenario `text`; `file` names it in diagnostics and `default_name` is used when it has no `name`.
pub fn parse(text: &str, file: &str, default_name: &str) -> Result<Scenario, ScenarioError> {
    parse_bytes(text.as_bytes(), file, default_name, None)
}

/// [`parse`], with `seed` (when given) replacing the text's `seed`.
pub fn parse_seeded(text: &str, file: &str, default_name: &str, seed: Option<u64>) -> Result<Scenario, ScenarioError> {
    parse_bytes(text.as_bytes(), file, default_name, seed)
}

/// Parses the raw bytes of a scenario file: bounded in size, depth and alias expansion, never panicking.
pub fn parse_bytes(bytes: &[u8], file: &str, default_name: &str, seed: Option<u64>) -> Result<Scenario, ScenarioError> {
    let text = text::checked_text(bytes).map_err(|diagnostic| ScenarioError::one(file, diagnostic))?;
    let mut raw: raw::RawScenario = yaml::parse(text).map_err(|diagnostic| ScenarioError::one(file, diagnostic))?;
    raw.seed = seed.or(raw.seed);
    let seed = raw.seed.unwrap_or(1);
    let events = raw.events;
    let faults = faults(&raw.faults, seed).map_err(|diagnostic| ScenarioError::one(file, diagnostic))?;
    let (problem, expect) = lower::lower(raw, default_name).map_err(|(mut diagnostics, omitted)| {
        for diagnostic in &mut diagnostics {
            diagnostic.line = lower::locate(text, &diagnostic.path);
            diagnostic.message = yaml::clip(&diagnostic.message);
        }
        ScenarioError { file: file.to_owned(), diagnostics, omitted }
    })?;
    Ok(Scenario { name: problem.name.clone(), file: file.to_owned(), seed, problem, expect, events, faults })
}

/// The `faults:` section as a plan seeded with the scenario's seed.
pub fn faults(raw: &[raw::RawFault], seed: u64) -> Result<FaultPlan, Diagnostic> {
    let mut rules = Vec::new();
    for (index, fault) in raw.iter().enumerate() {
        let path = format!("faults[{index}]");
        let Some(kind) = FaultKind::parse(&fault.kind) else {
            let kinds: Vec<&str> = FaultKind::ALL.iter().map(|kind| kind.name()).collect();
            let message = format!("unknown fault kind `{}` (fix: one of {})", fault.kind, kinds.join(", "));
            let (path, kind) = (format!("{path}.kind"), ScenarioErrorKind::InvalidValue);
            return Err(Diagnostic { line: None, column: None, path, message, kind });
        };
        if !(0.0..=1.0).contains(&fault.probability) {
            let message = format!("probability {} is not in 0..=1 (fix: e.g. 0.01)", fault.probability);
            let (path, kind) = (format!("{path}.probability"), ScenarioErrorKind::InvalidValue);
            return Err(Diagnostic { line: None, column: None, path, message, kind });
        }
        rules.push(FaultRule { kind, probability: fault.probability });
    }
    Ok(FaultPlan { seed, rules })
}
