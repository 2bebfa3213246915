//! `kvrelay check --planner CMD`: every scenario with an external planner in the prefill ranks' seat, judged by
//! the oracle and the expectation; one line per scenario.

use std::cell::RefCell;
use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use super::{scenario_files, Found};
use crate::engine::seat::SharedPlanner;
use crate::external::{ProcessPlanner, PROTOCOL_ERROR};
use crate::harness::{self, Budget};
use crate::scenario;

/// Runs every scenario under `dir` with `command` as the planner; the verdict per scenario.
pub(super) fn check(dir: &Path, command: &str, case_timeout: Duration) -> anyhow::Result<ExitCode> {
    let Found { files, skipped } = scenario_files(dir)?;
    for (path, why) in &skipped {
        eprintln!("skipped {}: {why}", path.display());
    }
    if files.is_empty() {
        anyhow::bail!("no *.yaml or *.yml scenarios under {}", dir.display());
    }
    let budget = Budget::from_env()?;
    let planner = Rc::new(RefCell::new(ProcessPlanner::new(command, case_timeout)));
    let mut failed = 0;
    for file in &files {
        let verdict = case(file, &planner, &budget);
        let name = match file.strip_prefix(dir) {
            Ok(relative) if !relative.as_os_str().is_empty() => relative.display().to_string(),
            _ => file.display().to_string(),
        };
        match verdict {
            Ok(()) => outln!("pass  {name}"),
            Err(lines) => {
                failed += 1;
                outln!("FAIL  {name}: {}", lines[0]);
                for line in &lines[1..] {
                    outln!("        {line}");
                }
                outln!("        reproduce: cargo run --release -- check {} --planner '{command}'", file.display());
            }
        }
    }
    let name = planner.borrow().name.clone().unwrap_or_else(|| "a planner that never said hello".to_owned());
    outln!("{} of {} scenarios pass with {name} in the planner's seat", files.len() - failed, files.len());
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// One scenario with the planner in the seat: `Err` holds the verdict's lines (the first is the summary).
fn case(file: &Path, planner: &Rc<RefCell<ProcessPlanner>>, budget: &Budget) -> Result<(), Vec<String>> {
    let scenario = scenario::load(file).map_err(|error| vec![error.to_string()])?;
    planner.borrow_mut().start_case(&file.display().to_string());
    let seat = SharedPlanner(planner.clone());
    let outcome = harness::run_with_planner(&scenario, budget, seat).map_err(|error| vec![error.to_string()])?;
    if let Some(reason) = planner.borrow().failure() {
        return Err(vec![format!("{PROTOCOL_ERROR}: {reason}")]);
    }
    if outcome.passed() {
        return Ok(());
    }
    let mut lines = vec![outcome.failures.join("; ")];
    lines.extend(outcome.violations.iter().take(5).map(ToString::to_string));
    if outcome.violations.len() > 5 {
        lines.push(format!("... {} more violations", outcome.violations.len() - 5));
    }
    Err(lines)
}
