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

/// One table row: a mutant's cases over every scenario.
struct Row {
    mutant: Mutant,
    cases: Vec<Case>,
}

impl Row {
    fn count(&self, pick: impl Fn(&Verdict) -> bool) -> usize {
        self.cases.iter().filter(|case| pick(&case.verdict)).count()
    }

    fn kinds(&self) -> String {
        let kinds: BTreeSet<&str> = self.cases.iter().flat_map(|case| case.kinds.iter().copied()).collect();
        if kinds.is_empty() {
            return "-".to_owned();
        }
        kinds.into_iter().collect::<Vec<_>>().join(",")
    }
}

pub(super) fn selftest(args: &SelftestArgs) -> anyhow::Result<ExitCode> {
    let budget = Budget::from_env()?;
    let fabric = harness::Fabric::parse(&args.fabric, None).map_err(anyhow::Error::msg)?;
    // A planner in the seat runs without the scenario's faults on every fabric (`harness::Run::fault_plan`).
    let (scenarios, left_out) = select(&args.dir, args.max_bytes)?;
    outln!(
        "selftest: {} scenarios under {} (expected rejections skipped), on the {} fabric",
        scenarios.len(),
        args.dir.display(),
        fabric.name()
    );
    for (file, why) in &left_out {
        outln!("skipped {file}: {why}");
    }
    if scenarios.is_empty() {
        anyhow::bail!("no scenarios to plant mutants in under {}", args.dir.display());
    }
    let mut false_alarms = 0;
    for scenario in &scenarios {
        let case = selftest::run_case_on(scenario, &budget, None, &fabric)?;
        if !matches!(case.verdict, Verdict::Survived { changed: false }) {
            false_alarms += 1;
            outln!("FALSE ALARM {}: kvrelay's own plans fail in the seat: {:?}", case.scenario, case.verdict);
        }
    }
    outln!("baseline: kvrelay's own plans pass {} of {} scenarios", scenarios.len() - false_alarms, scenarios.len());
    let mutants = if args.mutant.is_empty() { selftest::ALL.to_vec() } else { args.mutant.clone() };
    let bar = super::progress((mutants.len() * scenarios.len()) as u64, "selftest cases");
    let mut rows = Vec::new();
    for mutant in mutants {
        let cases = scenarios.iter().map(|scenario| {
            bar.inc(1);
            selftest::run_case_on(scenario, &budget, Some(mutant), &fabric)
        });
        rows.push(Row { mutant, cases: cases.collect::<Result<_, _>>()? });
    }
    bar.finish_and_clear();
    let survivors = print_table(&rows)?;
    print_matrix(&rows, &scenarios)?;
    let by_rooms: usize =
        rows.iter().map(|row| row.count(|it| matches!(it, Verdict::Caught { by_oracle: false, .. }))).sum();
    let (applied, caught): (usize, usize) = rows.iter().fold((0, 0), |(applied, caught), row| {
        let row_applied = row.count(|verdict| !matches!(verdict, Verdict::NotApplicable(_)));
        (applied + row_applied, caught + row.count(|verdict| matches!(verdict, Verdict::Caught { .. })))
    });
    let uncaught = rows.iter().filter(|row| row.count(|verdict| matches!(verdict, Verdict::Caught { .. })) == 0);
    let never_caught: Vec<&str> = uncaught.map(|row| row.mutant.name()).collect();
    let pass = survivors == 0 && false_alarms == 0 && never_caught.is_empty();
    outln!(
        "selftest {}: {} mutants, {applied} applicable cases, {caught} caught ({by_rooms} by room outcomes alone), \
         {survivors} survived, {} never caught{}, \
         {false_alarms} false alarms, over {} scenarios ({} skipped)",
        if pass { "passed" } else { "FAILED" },
        rows.len(),
        never_caught.len(),
        if never_caught.is_empty() { String::new() } else { format!(" ({})", never_caught.join(", ")) },
        scenarios.len(),
        left_out.len()
    );
    Ok(if pass { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Prints the table and every survivor; returns the number of survived cases.
fn print_table(rows: &[Row]) -> anyhow::Result<usize> {
    let kinds: Vec<String> = rows.iter().map(Row::kinds).collect();
    let width = kinds.iter().map(String::len).max().unwrap_or(0).max("kinds changed".len());
    let names = rows.iter().map(|row| row.mutant.name().len()).max().unwrap_or(0).max(28);
    outln!(
        "{:<names$} {:<5} {:<width$} {:>7} {:>6} {:>8} {:>4}",
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
        let not_applicable = row.count(|verdict| matches!(verdict, Verdict::NotApplicable(_)));
        let caught = row.count(|verdict| matches!(verdict, Verdict::Caught { .. }));
        let survived = row.count(|verdict| matches!(verdict, Verdict::Survived { .. }));
        survivors += survived;
        outln!(
            "{:<names$} {:<5} {:<width$} {:>7} {:>6} {:>8} {:>4}",
            row.mutant.name(),
            row.mutant.section(),
            kinds,
            row.cases.len() - not_applicable,
            caught,
            survived,
            not_applicable
        );
        if let Some((case, example)) = row.cases.iter().find_map(|case| match &case.verdict {
            Verdict::Caught { example, .. } => Some((case, example)),
            _ => None,
        }) {
            outln!("    e.g. {}: {}", case.scenario, example);
        }
        for case in &row.cases {
            if let Verdict::Survived { changed } = case.verdict {
                let how = if changed { "bytes moved elsewhere, the oracle saw nothing" } else { "no byte changed" };
                outln!("    SURVIVED {}: {how}", case.scenario);
            }
        }
    }
    Ok(survivors)
}

/// Prints one line per scenario, one column per mutant (numbered in table order): `C` caught by the oracle, `R`
/// caught by room outcomes alone, `S` survived, `.` not applicable.
fn print_matrix(rows: &[Row], scenarios: &[Scenario]) -> anyhow::Result<()> {
    let numbers: Vec<String> = (1..=rows.len()).map(|number| format!("{number:>2}")).collect();
    let width = scenarios.iter().map(|scenario| scenario.file.len()).max().unwrap_or(0);
    outln!("matrix (C caught by the oracle, R by room outcomes alone, S survived, . n/a); columns in table order:");
    outln!("{:<width$} {}", "scenario", numbers.join(" "));
    for (index, scenario) in scenarios.iter().enumerate() {
        let marks: Vec<&str> = rows
            .iter()
            .map(|row| match row.cases.get(index).map(|case| &case.verdict) {
                Some(Verdict::Caught { by_oracle: true, .. }) => " C",
                Some(Verdict::Caught { by_oracle: false, .. }) => " R",
                Some(Verdict::Survived { .. }) => " S",
                _ => " .",
            })
            .collect();
        outln!("{:<width$} {}", scenario.file, marks.join(" "));
    }
    Ok(())
}
