//! `kvrelay check --planner CMD [--known FILE]`: every scenario with an external planner in the prefill ranks' seat,
//! judged by the oracle and the expectation; one line per scenario. `kvrelay check --connector CMD` is the same
//! table with a connector in the seat: a transport child that sends every room itself through its engine. `--known` lists the cases where the planner is
//! known to differ from kvrelay's rules (a known upstream difference: its reason, the upstream source lines behind
//! it, and a substring of the failure it causes); such a case is reported as known instead of failing the run, and
//! the run fails if a listed case passes (the difference is gone) or fails otherwise than recorded.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use anyhow::Context as _;
use serde::Deserialize;

use super::{scenario_files, Found};
use crate::engine::live::LiveOptions;
use crate::engine::seat::SharedPlanner;
use crate::external::connector::ChildSeat;
use crate::external::ProcessPlanner;
use crate::fabric::child::ChildTransport;
use crate::fabric::transport::Transport as _;
use crate::harness::{self, Budget, Run};
use crate::scenario::{self, Scenario};

/// One known upstream difference, as written in a `--known` file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct KnownDifference {
    /// The scenario file, relative to the working directory (e.g. `scenarios/rejections/x.yaml`).
    scenario: PathBuf,
    /// Why the planner differs from kvrelay's rules, in one or two sentences.
    reason: String,
    /// The upstream source lines behind the difference, `path:line` or `path:first-last`.
    sglang: Vec<String>,
    /// A substring of the failure text the difference causes.
    failure: String,
}

/// Reads and validates a `--known` file: a YAML list of [`KnownDifference`] entries, strictly (unknown fields, empty
/// texts, citations that are not `path:line`, scenario files that do not exist and repeated scenarios are errors
/// naming the file, the entry and the field).
fn load_known(path: &Path) -> anyhow::Result<Vec<KnownDifference>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let entries: Vec<KnownDifference> = serde_yaml_ng::from_str(&text)
        .with_context(|| format!("{}: not a list of known differences", path.display()))?;
    let mut seen = BTreeMap::new();
    for (index, entry) in entries.iter().enumerate() {
        let at = |field: &str, problem: String| {
            anyhow::anyhow!(
                "{}: entry {index} ({}): field `{field}`: {problem}",
                path.display(),
                entry.scenario.display()
            )
        };
        if !entry.scenario.is_file() {
            return Err(at("scenario", "no such scenario file".to_owned()));
        }
        if let Some(first) = seen.insert(canonical(&entry.scenario), index) {
            return Err(at("scenario", format!("the scenario is already listed by entry {first}")));
        }
        for (field, value) in [("reason", &entry.reason), ("failure", &entry.failure)] {
            if value.trim().is_empty() {
                return Err(at(field, "empty".to_owned()));
            }
        }
        if entry.sglang.is_empty() {
            return Err(at("sglang", "cites no source line (want at least one `path:line`)".to_owned()));
        }
        if let Some(bad) = entry.sglang.iter().find(|citation| !is_citation(citation)) {
            return Err(at("sglang", format!("`{bad}` is not `path:line` or `path:first-last`")));
        }
    }
    Ok(entries)
}

/// `path:line` or `path:first-last`, with a non-empty path.
fn is_citation(text: &str) -> bool {
    let Some((file, lines)) = text.rsplit_once(':') else { return false };
    let number = |part: &str| !part.is_empty() && part.bytes().all(|byte| byte.is_ascii_digit());
    let lines_ok = match lines.split_once('-') {
        Some((first, last)) => number(first) && number(last),
        None => number(lines),
    };
    !file.trim().is_empty() && !file.contains(char::is_whitespace) && lines_ok
}

fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// How one case ended against the known differences.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Pass,
    /// Failed as a known difference records: its reason and upstream source lines, each on one line.
    Known {
        reason: String,
        upstream: String,
    },
    /// A failure to report, its lines (the first is the summary).
    Fail(Vec<String>),
}

/// The verdict of a case given its outcome and its known-difference entry, if any.
fn judge(outcome: Result<(), Vec<String>>, known: Option<&KnownDifference>, file: &Path) -> Verdict {
    match (outcome, known) {
        (Ok(()), None) => Verdict::Pass,
        (Err(lines), None) => Verdict::Fail(lines),
        (Ok(()), Some(_)) => Verdict::Fail(vec![format!(
            "listed as a known upstream difference but passes: the difference is gone, remove the entry for {}",
            file.display()
        )]),
        (Err(lines), Some(entry)) if lines.join("\n").contains(&entry.failure) => {
            Verdict::Known { reason: one_line(&entry.reason), upstream: entry.sglang.join(", ") }
        }
        (Err(lines), Some(entry)) => {
            let mut out = vec![format!(
                "fails differently than its known upstream difference records (expected a failure containing `{}`): {}",
                entry.failure, lines[0]
            )];
            out.extend(lines.into_iter().skip(1));
            Verdict::Fail(out)
        }
    }
}

/// Runs every scenario under `dir` with `command` as the planner; the verdict per scenario. With `known`, the cases
/// it lists are judged against their recorded failure.
pub(super) fn check(dir: &Path, seat: &mut Seat, known: Option<&Path>) -> anyhow::Result<ExitCode> {
    let differences = known.map(load_known).transpose()?.unwrap_or_default();
    let by_file: BTreeMap<PathBuf, &KnownDifference> =
        differences.iter().map(|entry| (canonical(&entry.scenario), entry)).collect();
    let Found { files, skipped } = scenario_files(dir)?;
    for (path, why) in &skipped {
        eprintln!("skipped {}: {why}", path.display());
    }
    if files.is_empty() {
        anyhow::bail!("no *.yaml or *.yml scenarios under {}", dir.display());
    }
    let budget = Budget::from_env()?;
    let (mut failed, mut known_cases) = (0, 0);
    for file in &files {
        let entry = by_file.get(&canonical(file)).copied();
        let verdict = judge(seat.case(file, &budget), entry, file);
        let name = match file.strip_prefix(dir) {
            Ok(relative) if !relative.as_os_str().is_empty() => relative.display().to_string(),
            _ => file.display().to_string(),
        };
        match verdict {
            Verdict::Pass => outln!("pass  {name}"),
            Verdict::Known { reason, upstream } => {
                known_cases += 1;
                outln!("known upstream difference  {name}: {reason}");
                outln!("        upstream: {upstream}");
            }
            Verdict::Fail(lines) => {
                failed += 1;
                outln!("FAIL  {name}: {}", lines[0]);
                for line in &lines[1..] {
                    outln!("        {line}");
                }
                outln!("        reproduce: {}", seat.reproduce(file));
            }
        }
    }
    let (name, place) = seat.name();
    let passed = files.len() - failed - known_cases;
    match known {
        Some(path) => outln!(
            "{passed} of {} scenarios pass with {name} in the {place}; {known_cases} known upstream differences ({}); \
             {failed} fail",
            files.len(),
            path.display()
        ),
        None => outln!("{passed} of {} scenarios pass with {name} in the {place}", files.len()),
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Who sits in the prefill ranks' seat for a `check` run.
pub(super) enum Seat {
    /// An external planner (`--planner CMD`, the plan protocol): kvrelay's engines post its copies on the
    /// in-memory fabric.
    Planner { command: String, planner: Rc<RefCell<ProcessPlanner>> },
    /// A connector (`--connector CMD`): a transport child that is also in the seat and sends every room itself
    /// through its engine (`crate::external::connector`).
    Connector { command: String, child: ChildTransport, live: LiveOptions, send_timeout: Duration },
}

impl Seat {
    /// `sh -c command` as the planner, each case answered within `case_timeout` in all.
    pub(super) fn planner(command: &str, case_timeout: Duration) -> Seat {
        let planner = Rc::new(RefCell::new(ProcessPlanner::new(command, case_timeout)));
        Seat::Planner { command: command.to_owned(), planner }
    }

    /// `command` (split on whitespace) as the transport child and the seat; a room's send may take `send_timeout`.
    pub(super) fn connector(command: &str, send_timeout: Duration) -> anyhow::Result<Seat> {
        let child = ChildTransport::start(ChildTransport::argv(command))
            .with_context(|| format!("starting the connector `{command}`"))?;
        // A connector sends a whole room while the engines wait: the rooms' deadlines cover the longest send.
        let wait = send_timeout.saturating_mul(2);
        let live = LiveOptions {
            waiting_timeout_ns: u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX),
            time_limit: wait.saturating_mul(2),
            planner: None,
            trace: false,
        };
        Ok(Seat::Connector { command: command.to_owned(), child, live, send_timeout })
    }

    /// What sits in the seat and where, for the summary line.
    fn name(&self) -> (String, &'static str) {
        match self {
            Seat::Planner { planner, .. } => {
                let name = planner.borrow().name.clone();
                (name.unwrap_or_else(|| "a planner that never said hello".to_owned()), "planner's seat")
            }
            Seat::Connector { child, .. } => {
                let identity = child.identity();
                (format!("{} {}", identity.name, identity.version), "connector seat")
            }
        }
    }

    /// The one-line command that runs `file` alone with this seat.
    fn reproduce(&self, file: &Path) -> String {
        match self {
            Seat::Planner { command, .. } => {
                format!("cargo run --release -- check {} --planner '{command}'", file.display())
            }
            Seat::Connector { command, .. } => {
                format!("cargo run --release -- check {} --connector '{command}'", file.display())
            }
        }
    }

    /// One scenario with this seat: `Err` holds the verdict's lines (the first is the summary).
    fn case(&mut self, file: &Path, budget: &Budget) -> Result<(), Vec<String>> {
        let scenario = scenario::load(file).map_err(|error| vec![error.to_string()])?;
        self.case_of(&scenario, &file.display().to_string(), budget)
    }

    /// [`Seat::case`] of a scenario already loaded, named `case` to the seat.
    pub(super) fn case_of(&mut self, scenario: &Scenario, case: &str, budget: &Budget) -> Result<(), Vec<String>> {
        let outcome = match self {
            Seat::Planner { planner, .. } => {
                planner.borrow_mut().start_case(case);
                let seat = SharedPlanner(planner.clone());
                let outcome =
                    harness::run_with_planner(scenario, budget, seat).map_err(|error| vec![error.to_string()])?;
                if let Some(reason) = planner.borrow().failure() {
                    return Err(vec![reason.reason()]);
                }
                outcome
            }
            Seat::Connector { child, live, send_timeout, .. } => {
                child.reset();
                let seat = ChildSeat::new(child.handle(), &scenario.problem, case, *send_timeout);
                let seat = SharedPlanner(Rc::new(RefCell::new(seat)));
                let run = Run::new(scenario, budget).on_transport(child).planner(Some(seat)).live_options(live);
                let outcome = run.execute().map_err(|error| vec![error.to_string()])?;
                if let Some(reason) = child.broken() {
                    return Err(vec![reason]);
                }
                outcome
            }
        };
        if outcome.passed() {
            return Ok(());
        }
        let mut lines = vec![outcome.failure_text("; ")];
        lines.extend(outcome.violations.iter().take(5).map(ToString::to_string));
        if outcome.violations.len() > 5 {
            lines.push(format!("... {} more violations", outcome.violations.len() - 5));
        }
        Err(lines)
    }
}
