//! `kvrelay shrink <scenario> [--seed N] [--mutant NAME | --planner CMD] [--out FILE]`: a failing scenario reduced
//! to a minimal one that fails the same way (`crate::shrink`), written as a scenario file with a comment header;
//! prints the failure signature, the sizes before and after, and the one-line reproduce command.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

use super::run::shell_word;
use crate::harness::Budget;
use crate::limits::MAX_SCENARIO_BYTES;
use crate::selftest::Mutant;
use crate::shrink::{self, Mode, Shrunk, Size};

/// Arguments of `kvrelay shrink`.
#[derive(Debug, Clone, clap::Args)]
pub struct ShrinkArgs {
    /// The failing scenario file.
    pub scenario: PathBuf,
    /// Shrink while the oracle catches this self-test mutant in the planner's seat (`kvrelay selftest`).
    #[arg(long, value_parser = super::selftest::parse_mutant, conflicts_with = "planner")]
    pub mutant: Option<Mutant>,
    /// Shrink while this external planner (`sh -c CMD`, the plan protocol) fails the scenario.
    #[arg(long)]
    pub planner: Option<String>,
    /// Seconds the planner may spend on one candidate in all.
    #[arg(long, default_value_t = 60, requires = "planner")]
    pub planner_timeout: u64,
    /// Where to write the shrunk scenario (default: `<stem>.shrunk.yaml` in the current directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run at most this many candidates (the result is then smaller but maybe not minimal, and says so).
    #[arg(long, default_value_t = shrink::DEFAULT_MAX_RUNS)]
    pub max_runs: usize,
}

fn size_row(label: &str, size: &Size) -> String {
    format!(
        "{label:<7} {:>8} {:>8} {:>6} {:>6} {:>6} {:>6} {:>12}",
        size.requests, size.tokens, size.chunks, size.layers, size.ranks, size.fault_rules, size.bytes
    )
}

pub(super) fn shrink(args: &ShrinkArgs, seed: Option<u64>) -> anyhow::Result<ExitCode> {
    let file = args.scenario.display().to_string();
    let bytes = std::fs::read(&args.scenario).with_context(|| format!("reading {file}"))?;
    if bytes.len() as u64 > MAX_SCENARIO_BYTES {
        anyhow::bail!("{file} is over {MAX_SCENARIO_BYTES} bytes, the scenario size limit");
    }
    let text = String::from_utf8(bytes).with_context(|| format!("{file} is not UTF-8"))?;
    let (mode, mode_words) = match (&args.mutant, &args.planner) {
        (Some(mutant), _) => (Mode::Mutant(*mutant), format!("the oracle catching the mutant {}", mutant.name())),
        (None, Some(command)) => (
            Mode::planner(command, Duration::from_secs(args.planner_timeout)),
            format!("the planner `{command}` failing it"),
        ),
        (None, None) => (Mode::Own, "its own run failing".to_owned()),
    };
    let budget = Budget::from_env()?;
    let shrunk = shrink::shrink(&text, &file, seed, &mode, &budget, args.max_runs)?;
    let out = args.out.clone().unwrap_or_else(|| {
        let stem = args.scenario.file_stem().map(|it| it.to_string_lossy().into_owned()).unwrap_or_default();
        PathBuf::from(format!("{stem}.shrunk.yaml"))
    });
    let out_word = shell_word(&out.display().to_string());
    let reproduce = match (&args.mutant, &args.planner) {
        (Some(mutant), _) => format!("cargo run --release -- selftest {out_word} --mutant {}", mutant.name()),
        (None, Some(command)) => {
            format!("cargo run --release -- check {out_word} --planner {}", shell_word(command))
        }
        (None, None) => format!("cargo run --release -- run {out_word}"),
    };
    let seed_words = seed.map_or(String::new(), |seed| format!(", seed {seed}"));
    let source = format!("{file}{seed_words}");
    let written = shrink::header(&source, &mode_words, &shrunk, &reproduce) + &shrunk.yaml;
    std::fs::write(&out, &written).with_context(|| format!("writing {}", out.display()))?;
    report(&shrunk, &file, &mode_words, &out_word, &reproduce)?;
    Ok(ExitCode::SUCCESS)
}

fn report(shrunk: &Shrunk, file: &str, mode_words: &str, out: &str, reproduce: &str) -> anyhow::Result<()> {
    outln!("shrink {file} ({mode_words})");
    outln!("fails as: {}", shrunk.signature);
    for step in &shrunk.steps {
        outln!("  kept: {step}");
    }
    let end = if shrunk.capped {
        format!("stopped at the cap of {} runs: smaller, maybe not minimal", shrunk.runs)
    } else {
        "a fixpoint: no candidate is smaller and fails the same way".to_owned()
    };
    outln!(
        "{} reductions kept, {} candidates run, {} did not load; {end}",
        shrunk.steps.len(),
        shrunk.runs,
        shrunk.unloadable
    );
    outln!(
        "{:<7} {:>8} {:>8} {:>6} {:>6} {:>6} {:>6} {:>12}",
        "",
        "requests",
        "tokens",
        "chunks",
        "layers",
        "ranks",
        "faults",
        "bytes"
    );
    outln!("{}", size_row("before", &shrunk.before));
    outln!("{}", size_row("after", &shrunk.after));
    outln!("wrote {out}");
    outln!("reproduce: {reproduce}");
    Ok(())
}
