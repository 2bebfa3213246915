//! `kvrelay sim`: swarm runs under seeded faults ([`crate::swarm`]): per seed a random subset of fault kinds, every
//! scenario through the engines on the in-memory fabric, every run judged by the guarantee.

#![allow(clippy::disallowed_methods, reason = "the swarm's progress line reads the wall clock at the CLI edge")]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use crate::harness::{self, Budget};
use crate::shard::Shard;
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
    /// Run only shard K of N of the (seed, scenario) cases (`K/N`, counted from 1), or `slurm`: the shard of this
    /// Slurm array task. `kvrelay merge` combines the shards' `--json` files.
    #[arg(long)]
    pub shard: Option<String>,
    /// Also write the totals as JSON to this file (what `kvrelay merge` reads).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A swarm's (or one shard's) totals as `--json` writes them and `kvrelay merge` reads them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub(super) struct SimResult {
    /// `kvrelay-sim-1`.
    format: String,
    seeds: u64,
    first_seed: u64,
    /// The scenario files the cases ran over, in their order.
    scenarios: Vec<String>,
    shard: Shard,
    tally: Tally,
    seconds: f64,
}

pub(super) const FORMAT: &str = "kvrelay-sim-1";

/// `--shard`'s value: `K/N`, `slurm`, or the whole.
pub(super) fn shard(text: Option<&str>) -> anyhow::Result<Shard> {
    match text {
        None => Ok(Shard::ALL),
        Some("slurm") => Shard::from_slurm(&|name| std::env::var(name).ok()).map_err(anyhow::Error::msg),
        Some(text) => text.parse().map_err(anyhow::Error::msg),
    }
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
    let shard = shard(args.shard.as_deref())?;
    if shard != Shard::ALL {
        outln!("shard {shard}: every {}th (seed, scenario) case from case {}", shard.count, shard.index - 1);
    }
    let (start, mut tally) = (Instant::now(), Tally::default());
    let bar = super::progress(args.seeds, "sim seeds");
    let seeds = args.first_seed..args.first_seed.saturating_add(args.seeds);
    let mut case = 0u64;
    for seed in seeds {
        let faults = swarm::swarm_faults(seed);
        for (file, scenario) in &scenarios {
            case += 1;
            if !shard.takes(case - 1) {
                continue;
            }
            let (run, judgement) = swarm::run_faulted(scenario, &faults).map_err(anyhow::Error::msg)?;
            tally.add(file, seed, &run, judgement);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    report(&tally, seconds, args.seeds)?;
    if let Some(path) = &args.json {
        let scenarios = scenarios.into_iter().map(|(file, _)| file).collect();
        let result = SimResult {
            format: FORMAT.to_owned(),
            seeds: args.seeds,
            first_seed: args.first_seed,
            scenarios,
            shard,
            tally: tally.clone(),
            seconds,
        };
        super::write_json(path, &result)?;
    }
    Ok(if tally.harness_failures.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `kvrelay merge`: the shards of one sharded swarm (their `--json` files) combined into the unsharded report,
/// written as JSON too with `--json`.
pub(super) fn merge(results: Vec<(PathBuf, SimResult)>, json: Option<&std::path::Path>) -> anyhow::Result<ExitCode> {
    let shards = super::one_run(
        &results,
        |result| (result.seeds, result.first_seed, result.scenarios.clone()),
        |result| result.shard,
        "seeds, first seed or scenarios",
    )?;
    let first = &results[0].1;
    let mut merged = SimResult { shard: Shard::ALL, tally: Tally::default(), seconds: 0.0, ..first.clone() };
    for (_, result) in results {
        merged.tally.merge(result.tally, &merged.scenarios);
        merged.seconds = merged.seconds.max(result.seconds);
    }
    outln!(
        "merge: {} shards of {} scenarios x {} seeds (from {}); the slowest shard's time",
        shards.len(),
        merged.scenarios.len(),
        merged.seeds,
        merged.first_seed
    );
    report(&merged.tally, merged.seconds, merged.seeds)?;
    if let Some(path) = json {
        super::write_json(path, &merged)?;
    }
    Ok(if merged.tally.harness_failures.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
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
