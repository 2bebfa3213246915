//! `kvrelay run`: one scenario through the engines, its verdict, and determinism and replay: the seed in effect
//! (`--seed`, else `KVRELAY_SEED`, else the file's), the trace hash, `--check-determinism` (a second run compared
//! event by event) and `--trace-out` (the trace as JSON lines). Every failure ends with a one-line reproduce command
//! that names the seed.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;

use super::{load, FabricArgs};
use crate::engine::sim::SimOptions;
use crate::engine::trace::{self, TraceEvent};
use crate::harness::{self, Budget, Fabric, Outcome};
use crate::render;
use crate::scenario::Scenario;

/// The environment variable that supplies a seed when `--seed` is not given.
pub(super) const SEED_ENV: &str = "KVRELAY_SEED";

/// Where the seed override came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SeedSource {
    Flag,
    Env,
}

/// The seed that replaces every scenario's own: `--seed` when given (it wins), else `KVRELAY_SEED` when set and not
/// empty; a value that is not a `u64` is an error naming the variable.
pub(super) fn seed_override(flag: Option<u64>) -> anyhow::Result<Option<(u64, SeedSource)>> {
    seed_from(flag, std::env::var_os(SEED_ENV))
}

fn seed_from(flag: Option<u64>, env: Option<std::ffi::OsString>) -> anyhow::Result<Option<(u64, SeedSource)>> {
    if let Some(seed) = flag {
        return Ok(Some((seed, SeedSource::Flag)));
    }
    let Some(value) = env else { return Ok(None) };
    let Some(text) = value.to_str() else {
        anyhow::bail!("{SEED_ENV} is not valid UTF-8 (fix: a whole number from 0 to {}, or unset it)", u64::MAX);
    };
    if text.trim().is_empty() {
        return Ok(None);
    }
    match text.trim().parse() {
        Ok(seed) => Ok(Some((seed, SeedSource::Env))),
        Err(_) => anyhow::bail!(
            "{SEED_ENV}={text:?} is not a seed (fix: a whole number from 0 to {}, or unset {SEED_ENV})",
            u64::MAX
        ),
    }
}

/// What `kvrelay run` was asked for besides the scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    pub scenario: PathBuf,
    /// Print the message and engine event sequence (time, sender -> receiver: message).
    #[arg(long)]
    pub trace: bool,
    /// Write the event trace to FILE as JSON lines (`time_ns`, `kind`, `from`, `to`, `text`); its SHA-256 is the
    /// trace hash.
    #[arg(long, value_name = "FILE")]
    pub trace_out: Option<PathBuf>,
    /// Run the scenario twice with the same seed and compare the traces: identical, or the first divergent event.
    #[arg(long)]
    pub check_determinism: bool,
    /// Seeded faults from FILE (a YAML mapping `faults: [{kind: timeout, probability: 0.01}, ...]`, the scenario
    /// section's syntax) in place of the scenario's own, drawn from the run's seed (in-memory fabric only).
    #[arg(long, value_name = "FILE")]
    pub faults: Option<PathBuf>,
    #[command(flatten)]
    pub fabric: FabricArgs,
}

/// The one-line reproduce command of a run: the file, the seed in effect (explicit, so it wins over a
/// `KVRELAY_SEED` in the reader's shell), a non-default fabric and the determinism check when asked.
fn reproduce(scenario: &Scenario, args: &RunArgs, fabric: &Fabric) -> String {
    let mut words = vec![shell_word(&scenario.file), "--seed".to_owned(), scenario.seed.to_string()];
    if let Some(file) = &args.faults {
        words.extend(["--faults".to_owned(), shell_word(&file.display().to_string())]);
    }
    let check_determinism = args.check_determinism;
    if *fabric != Fabric::Sim {
        words.extend(fabric.flags().iter().map(|flag| shell_word(flag)));
    }
    if check_determinism {
        words.push("--check-determinism".to_owned());
    }
    format!("reproduce: {} run {}", fabric.cargo_run(), words.join(" "))
}

/// `text` as one shell word: as is when it is made of safe characters, else single-quoted.
pub(super) fn shell_word(text: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "/._-:=+@%,".contains(c);
    if !text.is_empty() && text.chars().all(safe) {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// `kvrelay run`.
pub(super) fn run(args: &RunArgs, seed: Option<u64>) -> anyhow::Result<ExitCode> {
    let mut scenario = load(&args.scenario, seed)?;
    if let Some(file) = &args.faults {
        scenario.faults = crate::scenario::load_faults(file, scenario.seed)?;
    }
    let fabric = args.fabric.fabric("sim")?;
    let simulated = fabric == Fabric::Sim;
    if args.check_determinism && !simulated {
        anyhow::bail!(
            "--check-determinism needs the in-memory fabric (--fabric sim): {} runs on a real clock",
            fabric.name()
        );
    }
    let reproduce = reproduce(&scenario, args, &fabric);
    match run_checked(args, &scenario, &fabric) {
        Ok(true) => Ok(ExitCode::SUCCESS),
        Ok(false) => {
            eprintln!("{reproduce}");
            Ok(ExitCode::FAILURE)
        }
        // A closed stdout (`kvrelay run ... | head`) is the reader's choice: `main` ends quietly.
        Err(error)
            if error.downcast_ref::<std::io::Error>().is_some_and(|it| it.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Err(error)
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            eprintln!("{reproduce}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// One run (two with `--check-determinism`) and its report on stdout; `Ok(false)` for a failed verdict or a
/// divergence (already reported on stderr).
fn run_checked(args: &RunArgs, scenario: &Scenario, fabric: &Fabric) -> anyhow::Result<bool> {
    let simulated = *fabric == Fabric::Sim;
    // The simulated run always records its trace: the hash is printed whether or not the lines are.
    let record = simulated || args.trace || args.trace_out.is_some();
    let budget = Budget::from_env()?;
    let once = || -> anyhow::Result<Outcome> {
        Ok(match fabric {
            Fabric::Sim => {
                let options = SimOptions { trace: record, ..SimOptions::default() };
                harness::run_with(scenario, &budget, &options)?
            }
            other => harness::run_on(scenario, &budget, other, record)?,
        })
    };
    if !simulated {
        outln!("fabric: {}", fabric.name());
    }
    let outcome = once()?;
    let events: &[TraceEvent] = outcome.engine.as_ref().map_or(&[], |run| &run.trace);
    if args.trace {
        for event in events {
            outln!("{event}");
        }
    }
    if let Some(path) = &args.trace_out {
        write_trace(path, events)?;
    }
    outln!("seed: {}", scenario.seed);
    if simulated {
        outln!("trace hash: {} ({} events)", trace::hash(events), events.len());
    }
    let mut deterministic = true;
    if args.check_determinism {
        let again = once()?;
        let repeated: &[TraceEvent] = again.engine.as_ref().map_or(&[], |run| &run.trace);
        deterministic = report_determinism(events, repeated)?;
    }
    out!("{}", render::golden_header(scenario, &outcome));
    if !scenario.faults.is_empty() {
        // A faulted run: what was injected and how each request ended is the story (judged by the guarantee).
        out!("{}", render::events(&outcome));
        out!("{}", render::violations(&outcome.violations));
    }
    if outcome.passed() && deterministic {
        outln!("pass {}", scenario.name);
        return Ok(true);
    }
    if !outcome.passed() {
        eprintln!("FAIL {}: {}", scenario.name, outcome.failure_text("; "));
    } else {
        eprintln!("FAIL {}: two runs with seed {} gave different traces", scenario.name, scenario.seed);
    }
    Ok(false)
}

/// Prints the determinism check's result: identical, or where the second run's trace first differs.
fn report_determinism(first: &[TraceEvent], second: &[TraceEvent]) -> anyhow::Result<bool> {
    let Some(divergence) = trace::first_divergence(first, second) else {
        outln!("determinism: identical ({} events, trace hash {})", first.len(), trace::hash(first));
        return Ok(true);
    };
    let show = |event: Option<&TraceEvent>| event.map_or_else(|| "(trace ended)".to_owned(), ToString::to_string);
    outln!(
        "determinism: DIVERGED at event {} of {} and {} (trace hashes {} and {})",
        divergence.index,
        first.len(),
        second.len(),
        trace::hash(first),
        trace::hash(second)
    );
    outln!("  run 1: {}", show(divergence.first));
    outln!("  run 2: {}", show(divergence.second));
    Ok(false)
}

/// Writes `events` to `path` as JSON lines.
fn write_trace(path: &Path, events: &[TraceEvent]) -> anyhow::Result<()> {
    let write = || -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        for event in events {
            out.write_all(event.json_line().as_bytes())?;
            out.write_all(b"\n")?;
        }
        out.flush()
    };
    write().with_context(|| format!("--trace-out {}: cannot write the trace", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_over_the_environment() {
        assert_eq!(seed_from(Some(3), Some("9".into())).unwrap(), Some((3, SeedSource::Flag)));
        assert_eq!(seed_from(None, Some(" 9 ".into())).unwrap(), Some((9, SeedSource::Env)));
        assert_eq!(seed_from(None, Some("".into())).unwrap(), None);
        assert_eq!(seed_from(None, None).unwrap(), None);
    }

    #[test]
    fn a_bad_environment_seed_names_the_variable() {
        for bad in ["abc", "-1", "18446744073709551616", "1.5"] {
            let error = seed_from(None, Some(bad.into())).unwrap_err().to_string();
            assert!(error.starts_with(&format!("KVRELAY_SEED={bad:?} is not a seed")), "{error}");
        }
        // The flag wins even over a bad variable.
        assert_eq!(seed_from(Some(1), Some("abc".into())).unwrap(), Some((1, SeedSource::Flag)));
    }

    #[test]
    fn shell_words_are_quoted_only_when_needed() {
        assert_eq!(shell_word("scenarios/basic/a-b.yaml"), "scenarios/basic/a-b.yaml");
        assert_eq!(shell_word("my file.yaml"), "'my file.yaml'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
    }
}
