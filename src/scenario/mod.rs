//! Scenario files: YAML in, a [`Problem`] plus its expected verdict out, or every diagnostic at once.
//!
//! `raw.rs` holds the serde DTOs and documents the schema; `lower.rs` validates and converts them, running the
//! seeded page allocator. Only this module knows YAML.

mod lower;
pub mod raw;

use std::fmt;
use std::path::Path;

use crate::model::Problem;

/// What the scenario promises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expectation {
    /// The plan succeeds and the oracle finds no violation.
    Ok,
    /// The planner rejects the problem with exactly this message, and no byte is written.
    Error(String),
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
}

/// One problem found in a scenario file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub line: Option<usize>,
    /// Field path such as `requests[1].chunks`.
    pub path: String,
    pub message: String,
}

/// Every diagnostic of one file, or why it could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioError {
    pub file: String,
    pub diagnostics: Vec<Diagnostic>,
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, diagnostic) in self.diagnostics.iter().enumerate() {
            if index > 0 {
                writeln!(f)?;
            }
            match diagnostic.line {
                Some(line) => write!(f, "{}:{line}: ", self.file)?,
                None => write!(f, "{}: ", self.file)?,
            }
            if !diagnostic.path.is_empty() {
                write!(f, "{}: ", diagnostic.path)?;
            }
            f.write_str(&diagnostic.message)?;
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
pub fn load_seeded(path: &Path, seed: Option<u64>) -> Result<Scenario, ScenarioError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|error| ScenarioError {
        file: file.clone(),
        diagnostics: vec![Diagnostic { line: None, path: String::new(), message: format!("cannot read: {error}") }],
    })?;
    let stem = path.file_stem().map(|stem| stem.to_string_lossy().into_owned()).unwrap_or_default();
    parse_seeded(&text, &file, &stem, seed)
}

/// Parses scenario `text`; `file` names it in diagnostics and `default_name` is used when it has no `name`.
pub fn parse(text: &str, file: &str, default_name: &str) -> Result<Scenario, ScenarioError> {
    parse_seeded(text, file, default_name, None)
}

/// [`parse`], with `seed` (when given) replacing the text's `seed`.
pub fn parse_seeded(text: &str, file: &str, default_name: &str, seed: Option<u64>) -> Result<Scenario, ScenarioError> {
    let error = |diagnostics| ScenarioError { file: file.to_owned(), diagnostics };
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    let mut raw: raw::RawScenario = serde_path_to_error::deserialize(deserializer).map_err(|failure| {
        let path = failure.path().to_string();
        let inner = failure.into_inner();
        let line = inner.location().map(|location| location.line()).or_else(|| lower::locate(text, &path));
        let path = if path == "." { String::new() } else { path };
        // serde_yaml_ng repeats the location and a path prefix in its message; the diagnostic already has both.
        let mut message = inner.to_string();
        if let Some(at) = message.rfind(" at line ") {
            message.truncate(at);
        }
        if let Some((head, rest)) = message.split_once(": ") {
            if !head.contains(' ') && path.starts_with(head) {
                message = rest.to_owned();
            }
        }
        error(vec![Diagnostic { line, path, message }])
    })?;
    raw.seed = seed.or(raw.seed);
    let seed = raw.seed.unwrap_or(1);
    let (problem, expect) = lower::lower(raw, default_name).map_err(|mut diagnostics| {
        for diagnostic in &mut diagnostics {
            diagnostic.line = lower::locate(text, &diagnostic.path);
        }
        error(diagnostics)
    })?;
    Ok(Scenario { name: problem.name.clone(), file: file.to_owned(), seed, problem, expect })
}
