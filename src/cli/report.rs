//! `kvrelay report`: runs scenarios (files or directories) and writes one self-contained HTML page per run and an
//! `index.html` over them into `--html DIR` (`tools::report` draws them).

use std::cell::RefCell;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::Context as _;

use super::run::shell_word;
use super::selftest::parse_mutant;
use super::{load, progress, scenario_files, FabricArgs, Found};
use crate::engine::seat::SharedPlanner;
use crate::harness::{self, Budget};
use crate::report::{self, IndexEntry, PageContext};
use crate::selftest::{Mutant, MutantPlanner};

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// Scenario files or directories of them.
    #[arg(default_value = "scenarios")]
    pub scenarios: Vec<PathBuf>,
    /// Write the pages and index.html here (created when missing).
    #[arg(long, value_name = "DIR")]
    pub html: PathBuf,
    /// Plant this selftest mutant in kvrelay's plans: a picture of what a known layout bug does to the bytes.
    #[arg(long, value_parser = parse_mutant)]
    pub mutant: Option<Mutant>,
    #[command(flatten)]
    pub fabric: FabricArgs,
}

/// `kvrelay report`: the pages, one line per page and the index; FAILURE when a scenario could not be run at all
/// (said on stderr; the other pages are written).
pub(super) fn report(args: &ReportArgs, seed: Option<u64>) -> anyhow::Result<ExitCode> {
    let fabric = args.fabric.fabric("sim")?;
    let mut files = Vec::new();
    for path in &args.scenarios {
        let Found { files: found, skipped } = scenario_files(path)?;
        for (path, why) in skipped {
            eprintln!("skipped {}: {why}", path.display());
        }
        files.extend(found);
    }
    if files.is_empty() {
        anyhow::bail!("no *.yaml or *.yml scenarios under {}", args.scenarios[0].display());
    }
    std::fs::create_dir_all(&args.html).with_context(|| format!("creating {}", args.html.display()))?;
    let mutant_name = args.mutant.map(Mutant::name);
    let mut entries = Vec::new();
    let budget = Budget::from_env()?;
    let mut not_run = 0;
    let bar = progress(files.len() as u64, "report");
    for file in &files {
        bar.inc(1);
        let scenario = load(file, seed)?;
        let planner = args.mutant.map(|mutant| SharedPlanner(Rc::new(RefCell::new(MutantPlanner::new(Some(mutant))))));
        let run = harness::Run::new(&scenario, &budget).on(&fabric).planner(planner).trace(true).execute();
        let mut outcome = match run {
            Ok(outcome) => outcome,
            Err(error) => {
                // One scenario that cannot run (over the memory budget, a fabric that fails) leaves the others' pages.
                not_run += 1;
                bar.suspend(|| eprintln!("not run {}: {error}", file.display()));
                continue;
            }
        };
        if let Err(error) = outcome.observation.materialise() {
            eprintln!("{}: device memory not read back for the picture: {error}", file.display());
        }
        let reproduce = reproduce(file, &scenario, args, &fabric);
        let context = PageContext { reproduce: &reproduce, mutant: mutant_name, fabric: &fabric.name() };
        // Two files of one name under different `scenarios` folders get a page each.
        let mut name = page_name(file);
        if name == "index.html" || entries.iter().any(|entry: &IndexEntry| entry.href == name) {
            name = format!("{}-{}.html", name.trim_end_matches(".html"), entries.len() + 1);
        }
        let path = args.html.join(&name);
        std::fs::write(&path, report::page(&scenario, &outcome, &context))
            .with_context(|| format!("writing {}", path.display()))?;
        let verdict = if outcome.passed() { "pass" } else { "FAIL" };
        bar.suspend(|| -> std::io::Result<()> {
            outln!("{verdict} {}: {}", file.display(), path.display());
            Ok(())
        })?;
        entries.push(IndexEntry {
            scenario: file.display().to_string(),
            href: name,
            passed: outcome.passed(),
            violations: Some(outcome.violations.len()),
            failure: outcome.failure_text("; "),
        });
    }
    bar.finish_and_clear();
    let title = match mutant_name {
        Some(mutant) => format!("kvrelay report, mutant {mutant} planted"),
        None => "kvrelay report".to_owned(),
    };
    let index = args.html.join("index.html");
    std::fs::write(&index, report::index(&title, &entries)).with_context(|| format!("writing {}", index.display()))?;
    outln!("index: {}", index.display());
    Ok(if not_run == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `basic__mla-tp2-to-tp4.html` for `scenarios/basic/mla-tp2-to-tp4.yaml`: the path's parts below the last
/// directory named `scenarios` (or all of them), joined.
fn page_name(file: &Path) -> String {
    let parts: Vec<String> = file.with_extension("").iter().map(|part| part.to_string_lossy().into_owned()).collect();
    let below = parts.iter().rposition(|part| part == "scenarios").map_or(&parts[..], |at| &parts[at + 1..]);
    let safe: Vec<String> = below
        .iter()
        .filter(|part| !matches!(part.as_str(), "/" | "." | ".."))
        .map(|part| crate::report::file_stem(part))
        .collect();
    format!("{}.html", safe.join("__"))
}

fn reproduce(file: &Path, scenario: &crate::scenario::Scenario, args: &ReportArgs, fabric: &harness::Fabric) -> String {
    let mut words = vec![shell_word(&file.display().to_string()), "--seed".to_owned(), scenario.seed.to_string()];
    if let Some(mutant) = args.mutant {
        words.extend(["--mutant".to_owned(), mutant.name().to_owned()]);
    }
    if *fabric != harness::Fabric::Sim {
        words.extend(fabric.flags().iter().map(|flag| shell_word(flag)));
    }
    words.extend(["--html".to_owned(), shell_word(&args.html.display().to_string())]);
    format!("{} report {}", fabric.cargo_run(), words.join(" "))
}
