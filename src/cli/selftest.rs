//! `kvrelay selftest`: every mutant of `selftest::mutants` over the scenarios under a directory (the expected
//! rejections under `rejections/` and scenarios over a byte budget left out, and said so), after a baseline run
//! of kvrelay's own plans through the same seat; prints one table row per mutant and fails on any survivor or
//! false alarm.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::{scenario_files, Found};
use crate::harness::{self, Budget};
use crate::scenario::{self, Expectation, Scenario};
use crate::selftest::{self, Case, Mutant, Verdict};
use crate::shard::Shard;

/// Arguments of `kvrelay selftest`.
#[derive(Debug, Clone, clap::Args)]
pub struct SelftestArgs {
    /// A directory of scenarios, or one scenario file.
    #[arg(default_value = "scenarios")]
    pub dir: PathBuf,
    /// Leave out scenarios registering more simulated memory than this many bytes (both sides, every region).
    #[arg(long, default_value_t = 256 << 20)]
    pub max_bytes: u64,
    /// Plant only this mutant (repeatable; default: every mutant).
    #[arg(long, value_parser = parse_mutant)]
    pub mutant: Vec<Mutant>,
    /// Run the mutants on this fabric (default `sim`; e.g. `cuda`: the bytes moved and judged on the GPU).
    #[arg(long, default_value = "sim")]
    pub fabric: String,
    /// Run only shard K of N of the cases (`K/N`, counted from 1; `slurm`: this Slurm array task's); `kvrelay
    /// merge` combines the shards' `--json` files into the whole table and verdict.
    #[arg(long)]
    pub shard: Option<String>,
    /// Also write every case's result as JSON to this file (format kvrelay-selftest-1).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

pub(super) fn parse_mutant(name: &str) -> Result<Mutant, super::CliError> {
    Mutant::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = selftest::ALL.iter().map(|mutant| mutant.name()).collect();
        super::CliError::UnknownMutant { name: name.to_owned(), names: names.join(", ") }
    })
}

/// Scenario files left out of the self-test, each with the reason.
type LeftOut = Vec<(String, String)>;

/// The scenarios the self-test runs, and the ones it leaves out with the reason.
fn select(dir: &Path, max_bytes: u64) -> anyhow::Result<(Vec<Scenario>, LeftOut)> {
    let Found { files, .. } = scenario_files(dir)?;
    let (mut chosen, mut left_out) = (Vec::new(), Vec::new());
    for file in files {
        if file.components().any(|part| part.as_os_str() == "rejections") {
            continue;
        }
        let scenario = scenario::load(&file)?;
        if let Expectation::Error(_) = scenario.expect {
            left_out.push((scenario.file.clone(), "expects a rejection (no byte moves)".to_owned()));
            continue;
        }
        match harness::simulated_bytes(&scenario.problem) {
            Some(bytes) if bytes <= max_bytes => chosen.push(scenario),
            bytes => left_out.push((
                scenario.file.clone(),
                format!(
                    "{} bytes of simulated memory, over --max-bytes {max_bytes}",
                    bytes.map_or("over 2^64".to_owned(), |it| it.to_string())
                ),
            )),
        }
    }
    Ok((chosen, left_out))
}

/// How one case ended, as `--json` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Mark {
    /// Caught by the oracle's byte checks.
    Caught,
    /// Caught by room outcomes alone.
    CaughtByRooms,
    /// Survived although copies changed.
    Survived,
    /// Survived and no copy changed (the baseline's expected mark).
    Unchanged,
    NotApplicable,
}

/// One case (a mutant, or none for the baseline, on one scenario).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct CaseRecord {
    /// The mutant's name; empty for the baseline (kvrelay's own plans in the seat).
    mutant: String,
    scenario: String,
    mark: Mark,
    /// A catch's first violation or room failure; a not-applicable case's reason.
    detail: String,
    kinds: Vec<String>,
}

impl CaseRecord {
    fn new(mutant: Option<Mutant>, case: Case) -> CaseRecord {
        let (mark, detail) = match case.verdict {
            Verdict::Caught { example, by_oracle: true } => (Mark::Caught, example),
            Verdict::Caught { example, by_oracle: false } => (Mark::CaughtByRooms, example),
            Verdict::Survived { changed: true } => (Mark::Survived, String::new()),
            Verdict::Survived { changed: false } => (Mark::Unchanged, String::new()),
            Verdict::NotApplicable(why) => (Mark::NotApplicable, why.to_owned()),
        };
        let mutant = mutant.map_or(String::new(), |mutant| mutant.name().to_owned());
        let kinds = case.kinds.iter().map(|kind| (*kind).to_owned()).collect();
        CaseRecord { mutant, scenario: case.scenario, mark, detail, kinds }
    }

    fn caught(&self) -> bool {
        matches!(self.mark, Mark::Caught | Mark::CaughtByRooms)
    }

    fn survived(&self) -> bool {
        matches!(self.mark, Mark::Survived | Mark::Unchanged)
    }
}

/// `selftest --json`'s format.
pub(super) const FORMAT: &str = "kvrelay-selftest-1";

/// A self-test (or one shard of it) as `--json` writes it and `kvrelay merge` reads it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct SelftestResult {
    format: String,
    dir: String,
    fabric: String,
    /// Every mutant of the run and every scenario, in table order.
    mutants: Vec<String>,
    scenarios: Vec<String>,
    left_out: LeftOut,
    shard: Shard,
    /// The cases this shard ran: baseline cases (empty `mutant`) and mutant cases.
    cases: Vec<CaseRecord>,
}

pub(super) fn selftest(args: &SelftestArgs) -> anyhow::Result<ExitCode> {
    let budget = Budget::from_env()?;
    let fabric = harness::Fabric::parse(&args.fabric, None).map_err(anyhow::Error::msg)?;
    let shard = super::sim::shard(args.shard.as_deref())?;
    // A planner in the seat runs without the scenario's faults on every fabric (`harness::Run::fault_plan`).
    let (scenarios, left_out) = select(&args.dir, args.max_bytes)?;
    outln!(
        "selftest: {} scenarios under {} (expected rejections skipped), on the {} fabric",
        scenarios.len(),
        args.dir.display(),
        fabric.name()
    );
    if shard != Shard::ALL {
        outln!("shard {shard}: every {}th case from case {}", shard.count, shard.index - 1);
    }
    if scenarios.is_empty() {
        anyhow::bail!("no scenarios to plant mutants in under {}", args.dir.display());
    }
    let mutants = if args.mutant.is_empty() { selftest::ALL.to_vec() } else { args.mutant.clone() };
    // Every case in one order: the baseline on each scenario, then each mutant on each scenario.
    let plan: Vec<(Option<Mutant>, &Scenario)> = scenarios
        .iter()
        .map(|scenario| (None, scenario))
        .chain(mutants.iter().flat_map(|mutant| scenarios.iter().map(move |scenario| (Some(*mutant), scenario))))
        .collect();
    let mine: Vec<&(Option<Mutant>, &Scenario)> = shard.pick(&plan).collect();
    let bar = super::progress(mine.len() as u64, "selftest cases");
    let mut cases = Vec::new();
    for (mutant, scenario) in mine {
        cases.push(CaseRecord::new(*mutant, selftest::run_case_on(scenario, &budget, *mutant, &fabric)?));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let result = SelftestResult {
        format: FORMAT.to_owned(),
        dir: args.dir.display().to_string(),
        fabric: fabric.name(),
        mutants: mutants.iter().map(|mutant| mutant.name().to_owned()).collect(),
        scenarios: scenarios.iter().map(|scenario| scenario.file.clone()).collect(),
        left_out,
        shard,
        cases,
    };
    if let Some(path) = &args.json {
        super::write_json(path, &result)?;
    }
    print_result(&result)
}

/// `kvrelay merge` of a self-test's shards: the unsharded run's table, matrix and verdict.
pub(super) fn merge(results: Vec<(PathBuf, SelftestResult)>, json: Option<&Path>) -> anyhow::Result<ExitCode> {
    super::one_run(
        &results,
        |result| (result.dir.clone(), result.fabric.clone(), result.mutants.clone(), result.scenarios.clone()),
        |result| result.shard,
        "directory, fabric, mutants or scenarios",
    )?;
    let first = results[0].1.clone();
    let mut cases: Vec<CaseRecord> = results.into_iter().flat_map(|(_, result)| result.cases).collect();
    let order = |case: &CaseRecord| {
        let mutant = first.mutants.iter().position(|name| *name == case.mutant).map_or(0, |index| index + 1);
        (mutant, first.scenarios.iter().position(|name| *name == case.scenario))
    };
    cases.sort_by_key(order);
    let merged = SelftestResult { shard: Shard::ALL, cases, ..first };
    if let Some(path) = json {
        super::write_json(path, &merged)?;
    }
    print_result(&merged)
}

/// The table, the matrix and the verdict of `result`'s cases; FAILURE on a survivor, a false alarm or a mutant
/// never caught.
fn print_result(result: &SelftestResult) -> anyhow::Result<ExitCode> {
    for (file, why) in &result.left_out {
        outln!("skipped {file}: {why}");
    }
    let baseline: Vec<&CaseRecord> = result.cases.iter().filter(|case| case.mutant.is_empty()).collect();
    let mut false_alarms = 0;
    for case in &baseline {
        if case.mark != Mark::Unchanged {
            false_alarms += 1;
            outln!(
                "FALSE ALARM {}: kvrelay's own plans fail in the seat: {:?} {}",
                case.scenario,
                case.mark,
                case.detail
            );
        }
    }
    outln!("baseline: kvrelay's own plans pass {} of {} scenarios", baseline.len() - false_alarms, baseline.len());
    let rows: Vec<Row<'_>> = result
        .mutants
        .iter()
        .map(|name| Row { mutant: name, cases: result.cases.iter().filter(|case| case.mutant == *name).collect() })
        .collect();
    let survivors = print_table(&rows)?;
    print_matrix(&rows, &result.scenarios)?;
    let by_rooms: usize = rows.iter().map(|row| row.count(|case| case.mark == Mark::CaughtByRooms)).sum();
    let (applied, caught): (usize, usize) = rows.iter().fold((0, 0), |(applied, caught), row| {
        let row_applied = row.count(|case| case.mark != Mark::NotApplicable);
        (applied + row_applied, caught + row.count(CaseRecord::caught))
    });
    // A shard may hold none of a mutant's catches: only the whole run (or the merge) can say it was never caught.
    let whole = result.shard == Shard::ALL;
    let never_caught: Vec<&str> =
        rows.iter().filter(|row| whole && row.count(CaseRecord::caught) == 0).map(|row| row.mutant).collect();
    let pass = survivors == 0 && false_alarms == 0 && never_caught.is_empty();
    outln!(
        "selftest {}: {} mutants, {applied} applicable cases, {caught} caught ({by_rooms} by room outcomes alone), \
         {survivors} survived, {} never caught{}, \
         {false_alarms} false alarms, over {} scenarios ({} skipped){}",
        if pass { "passed" } else { "FAILED" },
        rows.len(),
        never_caught.len(),
        if never_caught.is_empty() { String::new() } else { format!(" ({})", never_caught.join(", ")) },
        result.scenarios.len(),
        result.left_out.len(),
        if result.shard == Shard::ALL { String::new() } else { format!(" (shard {})", result.shard) }
    );
    Ok(if pass { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// One table row: a mutant's cases over every scenario (of this shard).
struct Row<'a> {
    mutant: &'a str,
    cases: Vec<&'a CaseRecord>,
}

impl Row<'_> {
    fn count(&self, pick: impl Fn(&CaseRecord) -> bool) -> usize {
        self.cases.iter().filter(|case| pick(case)).count()
    }

    fn kinds(&self) -> String {
        let kinds: BTreeSet<&str> = self.cases.iter().flat_map(|case| case.kinds.iter().map(String::as_str)).collect();
        if kinds.is_empty() {
            return "-".to_owned();
        }
        kinds.into_iter().collect::<Vec<_>>().join(",")
    }
}

/// Prints the table and every survivor; returns the number of survived cases.
fn print_table(rows: &[Row<'_>]) -> anyhow::Result<usize> {
    let kinds: Vec<String> = rows.iter().map(Row::kinds).collect();
    let width = kinds.iter().map(String::len).max().unwrap_or(0).max("kinds changed".len());
    let names = rows.iter().map(|row| row.mutant.len()).max().unwrap_or(0).max(28);
    let section = |row: &Row<'_>| Mutant::from_name(row.mutant).map_or("?", Mutant::section);
    let rules = rows.iter().map(|row| section(row).chars().count()).max().unwrap_or(0).max(5);
    outln!(
        "{:<names$} {:<rules$} {:<width$} {:>7} {:>6} {:>8} {:>4}",
        "mutant",
        "rule",
        "kinds changed",
        "applied",
        "caught",
        "survived",
        "n/a"
    );
    let mut survivors = 0;
    for (row, kinds) in rows.iter().zip(&kinds) {
        let not_applicable = row.count(|case| case.mark == Mark::NotApplicable);
        let caught = row.count(CaseRecord::caught);
        let survived = row.count(CaseRecord::survived);
        survivors += survived;
        outln!(
            "{:<names$} {:<rules$} {:<width$} {:>7} {:>6} {:>8} {:>4}",
            row.mutant,
            section(row),
            kinds,
            row.cases.len() - not_applicable,
            caught,
            survived,
            not_applicable
        );
        if let Some(case) = row.cases.iter().find(|case| case.caught()) {
            outln!("    e.g. {}: {}", case.scenario, case.detail);
        }
        for case in row.cases.iter().filter(|case| case.survived()) {
            let how = if case.mark == Mark::Survived {
                "bytes moved elsewhere, the oracle saw nothing"
            } else {
                "no byte changed"
            };
            outln!("    SURVIVED {}: {how}", case.scenario);
        }
    }
    Ok(survivors)
}

/// Prints one line per scenario, one column per mutant (numbered in table order): `C` caught by the oracle, `R`
/// caught by room outcomes alone, `S` survived, `.` not applicable or not run in this shard.
fn print_matrix(rows: &[Row<'_>], scenarios: &[String]) -> anyhow::Result<()> {
    let numbers: Vec<String> = (1..=rows.len()).map(|number| format!("{number:>2}")).collect();
    let width = scenarios.iter().map(String::len).max().unwrap_or(0);
    outln!("matrix (C caught by the oracle, R by room outcomes alone, S survived, . n/a); columns in table order:");
    outln!("{:<width$} {}", "scenario", numbers.join(" "));
    for scenario in scenarios {
        let marks: Vec<&str> = rows
            .iter()
            .map(|row| match row.cases.iter().find(|case| case.scenario == *scenario).map(|case| case.mark) {
                Some(Mark::Caught) => " C",
                Some(Mark::CaughtByRooms) => " R",
                Some(Mark::Survived | Mark::Unchanged) => " S",
                _ => " .",
            })
            .collect();
        outln!("{:<width$} {}", scenario, marks.join(" "));
    }
    Ok(())
}
