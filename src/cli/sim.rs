//! `kvrelay sim`: swarm runs under seeded faults ([`crate::swarm`]): per seed a random subset of fault kinds, every
//! scenario through the engines on the in-memory fabric, every run judged by the guarantee.

#![allow(clippy::disallowed_methods, reason = "the swarm's progress line reads the wall clock at the CLI edge")]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use crate::harness::{self, Budget};
use crate::swarm::{self, Tally};

/// What `kvrelay sim` runs.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// A scenario file or a directory of them (scenarios that expect a rejection, or register more than
    /// `--max-bytes`, are passed over).
    pub path: PathBuf,
    /// Seeds per scenario.
    #[arg(long, default_value_t = 100)]
    pub seeds: u64,
    /// The first seed (seeds run from it upwards).
    #[arg(long, default_value_t = 1)]
    pub first_seed: u64,
    /// Leave out scenarios registering more simulated memory than this, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_bytes: u64,
}

pub(super) fn sim(args: &SimArgs) -> anyhow::Result<ExitCode> {
    let budget = Budget::from_env()?;
    let mut scenarios = Vec::new();
    for file in super::scenario_files(&args.path)?.files {
        let scenario = super::load(&file, None)?;
        let bytes = harness::simulated_bytes(&scenario.problem).unwrap_or(u64::MAX);
        if !swarm::swarmable(&scenario) || bytes > args.max_bytes.min(budget.bytes) {
            continue;
        }
        scenarios.push((file.display().to_string(), scenario));
    }
    if scenarios.is_empty() {
        anyhow::bail!("{}: no scenario that expects a clean transfer within --max-bytes", args.path.display());
    }
    outln!(
        "sim: {} scenarios x {} seeds (from {}), a random subset of fault kinds per seed",
        scenarios.len(),
        args.seeds,
        args.first_seed
    );
    let (start, mut tally, mut stderr) = (Instant::now(), Tally::default(), std::io::stderr());
    let mut shown = 0.0;
    let seeds = args.first_seed..args.first_seed.saturating_add(args.seeds);
    for (done, seed) in seeds.enumerate() {
        let faults = swarm::swarm_faults(seed);
        for (file, scenario) in &scenarios {
            let (run, judgement) = swarm::run_faulted(scenario, &faults).map_err(anyhow::Error::msg)?;
            tally.add(file, seed, &run, judgement);
        }
        // The progress line at most twice a second (and for the last seed), so CI logs stay short.
        let seconds = start.elapsed().as_secs_f64();
        if seconds - shown >= 0.5 || done as u64 + 1 == args.seeds {
            shown = seconds;
            let _ = write!(stderr, "\rsim: {}/{} seeds, {} runs, {seconds:.1} s", done + 1, args.seeds, tally.runs);
            let _ = stderr.flush();
        }
    }
    let _ = writeln!(stderr);
    report(&tally, start.elapsed().as_secs_f64(), args.seeds)?;
    Ok(if tally.harness_failures.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn report(tally: &Tally, seconds: f64, seeds: u64) -> anyhow::Result<()> {
    outln!("runs: {} in {seconds:.1} s ({:.1} seeds/s)", tally.runs, seeds as f64 / seconds.max(1e-9));
    outln!("requests ended Success byte-exact: {}", tally.succeeded);
    outln!("requests ended Failed with a reason: {}", tally.failed);
    outln!(
        "runs with a planted silent fault (corruption, notification before data, read after release) the guarantee found: {}",
        tally.detected
    );
    let injected: Vec<String> = tally.injected.iter().map(|(kind, count)| format!("{kind} {count}")).collect();
    outln!("faults injected: {}", if injected.is_empty() { "none".to_owned() } else { injected.join(", ") });
    outln!("harness failures: {}", tally.harness_failures.len());
    for (file, seed, failure) in &tally.harness_failures {
        outln!("FAIL {file} seed {seed}: {failure}");
        outln!("reproduce: cargo run --release -- sim {file} --first-seed {seed} --seeds 1");
    }
    Ok(())
}
