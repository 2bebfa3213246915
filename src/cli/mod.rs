//! The `kvrelay` command line (clap): `run`, `layout`, `plan --json`, `check`, `bench`.
//!
//! The only module that prints, reads the clock or exits. Errors go to stderr with a non-zero exit.

#![allow(clippy::print_stderr, reason = "the CLI is the printing edge")]

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};

use crate::harness;
use crate::plan;
use crate::render;
use crate::scenario::{self, Scenario};

/// `println!` that returns write errors instead of panicking, so `kvrelay ... | head` ends quietly.
macro_rules! outln {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*)?
    };
}

/// `print!` counterpart of [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => {
        write!(std::io::stdout().lock(), $($arg)*)?
    };
}

mod bench;
#[cfg(feature = "cuda")]
mod bench_cuda;
mod bench_lists;
mod certify;
mod load;
mod matrix;
mod merge;
mod planners;
mod ranks;
mod replay;
mod replay_live;
mod report;
mod run;
pub mod schema;
mod selftest;
mod shapes;
mod shrink;
mod sim;

#[derive(Debug, Parser)]
#[command(name = "kvrelay", version, about = "Byte-exact conformance harness for prefill -> decode KV-cache transfer")]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
    /// Replace the scenario's allocator seed (run, layout, plan, diff, shrink, report and the rank commands; golden
    /// checks keep each file's own seed). Without it, `KVRELAY_SEED` when set.
    #[arg(long, global = true)]
    pub seed: Option<u64>,
}

/// What `kvrelay scenario` writes.
#[derive(Debug, Subcommand)]
pub enum ScenarioAction {
    /// A scenario from a Hugging Face config.json (its geometry fields) and each side's SGLang server flags, as a
    /// commented scenario file (stdout, or --out).
    FromConfig {
        config: PathBuf,
        /// The prefill server's flags that shape KV (`--tp`, `--pp-size`, `--dcp-size`, `--page-size`,
        /// `--kv-cache-dtype`), as one string.
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        prefill: String,
        /// The decode server's flags, as one string.
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        decode: String,
        /// Prompt length of the scenario's one request.
        #[arg(long, default_value_t = 4096)]
        tokens: u32,
        /// Write the scenario here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan a scenario, run it through the per-rank engines on the in-memory fabric, verify every decode byte; print
    /// the seed and the trace hash.
    Run(run::RunArgs),
    /// Run scenarios on the in-memory fabric and on another (default: RDMA verbs) and compare every decode rank's
    /// final image byte for byte; differences are decoded into coordinates.
    Diff {
        #[arg(required = true)]
        scenarios: Vec<PathBuf>,
        #[command(flatten)]
        fabric: FabricArgs,
    },
    /// Run one rank of a scenario in this process over a real fabric; the others connect through the bootstrap
    /// hub (`kvrelay hub`, or the one `kvrelay launch` starts). A decode rank prints its verdict. Without --role
    /// and --rank, the rank comes from the launcher that started the process (torchrun: RANK, WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT; mpirun: OMPI_COMM_WORLD_RANK/SIZE; srun: SLURM_PROCID, SLURM_NTASKS): global ranks
    /// are the prefill ranks then the decode ranks, and global rank 0 also runs the hub.
    Serve {
        scenario: PathBuf,
        #[arg(long, value_enum, requires = "rank")]
        role: Option<crate::process::Role>,
        /// Index of the rank on its side, in stage-major order (as `kvrelay layout --rank`).
        #[arg(long, requires = "role")]
        rank: Option<u32>,
        /// HOST:PORT of the bootstrap hub (under a launcher: else $KVRELAY_HUB, else $MASTER_ADDR:$MASTER_PORT).
        #[arg(long)]
        bootstrap: Option<String>,
        /// Under a launcher, global rank 0 does not run the hub (one runs elsewhere: `kvrelay hub`).
        #[arg(long)]
        no_hub: bool,
        #[command(flatten)]
        fabric: FabricArgs,
        #[command(flatten)]
        deadlines: Deadlines,
    },
    /// Run the bootstrap hub of a scenario on HOST:PORT until its run ends (for ranks on several hosts).
    Hub {
        scenario: PathBuf,
        #[arg(long)]
        bootstrap: String,
        #[command(flatten)]
        deadlines: Deadlines,
    },
    /// Start every rank of a scenario as its own `kvrelay serve` process on this host, with a hub, and gather the
    /// decode ranks' verdicts.
    Launch {
        scenario: PathBuf,
        #[command(flatten)]
        fabric: FabricArgs,
        #[command(flatten)]
        deadlines: Deadlines,
        /// Do not start this rank (`prefill:N` or `decode:N`): a rank that never connects, to see the others fail
        /// its requests within the deadlines instead of hanging. Repeatable.
        #[arg(long, value_parser = parse_rank_spec)]
        omit: Vec<(crate::process::Role, u32)>,
        /// Inject a fault a real process suffers, seeded by the scenario's seed (`--seed`), and judge the run by the
        /// fault guarantee: every request Success byte-exact or Failed with a reason, within the deadlines.
        #[arg(long, value_enum)]
        chaos: Option<crate::process::chaos::Chaos>,
    },
    /// Show what landed where on each decode rank (run-length encoded).
    Layout {
        scenario: PathBuf,
        /// Only this decode rank (index in stage-major order, i.e. the TP rank when decode PP is 1).
        #[arg(long)]
        rank: Option<u32>,
    },
    /// Which of SGLang 0.5.23's transfer code paths each scenario's transfers take (page copy, DCP relayout, head
    /// slice, state slice, replicated state, paged state, aux), with the wheel's file:line for each.
    Explain {
        #[arg(required = true)]
        scenarios: Vec<PathBuf>,
    },
    /// Run scenarios (files or directories) and write one self-contained HTML page per run into --html DIR: the
    /// verdict, violations in coordinates, a picture per decode rank of which request, source rank and layer landed
    /// in every row, the planner's decisions, the SGLang code paths and the event timeline; index.html over them.
    Report(report::ReportArgs),
    /// The compatibility matrix: scenarios generated over model family x TP change x prefill PP x decode DCP x
    /// peer version, each supported (bytes verified), rejected with a reason or no deployment; with --planner, where
    /// that planner (SGLang's helpers) differs. Prints the markdown table (the README's, --update README.md).
    Matrix(matrix::MatrixArgs),
    /// Print the JSON Schema of scenario files, the plan JSON, certify's report.json, or check's and sim's --json
    /// (copies in src/schemas/; a YAML editor validates scenarios with `# yaml-language-server: $schema=...`).
    Schema {
        #[arg(value_enum)]
        name: schema::SchemaName,
    },
    /// Export every copy of the plan.
    Plan {
        scenario: PathBuf,
        /// Machine-readable JSON: strided descriptors, schema `kvrelay-plan-2` (README.md).
        #[arg(long)]
        json: bool,
        /// With --json: every per-row copy instead, schema `kvrelay-plan-1`.
        #[arg(long, requires = "json", conflicts_with = "paged")]
        expand: bool,
        /// With --json: descriptors addressed through each request's page tables, schema `kvrelay-plan-3`.
        #[arg(long, requires = "json")]
        paged: bool,
    },
    /// Run every scenario under DIR against its golden layout and expectation; the CI gate.
    Check {
        /// A directory of scenarios, or one scenario file.
        #[arg(default_value = "scenarios")]
        dir: PathBuf,
        /// Directory of golden files.
        #[arg(long, default_value = "golden")]
        golden: PathBuf,
        /// Put this command in every prefill rank's planner seat (`sh -c CMD`, speaking the plan protocol of
        /// src/running/external/README.md on stdin/stdout) and judge its plans with the oracle instead of the golden files.
        #[arg(long, conflicts_with = "fabric")]
        planner: Option<String>,
        /// Seconds the planner may spend on one scenario in all.
        #[arg(long, default_value_t = 60)]
        planner_timeout: u64,
        /// Put this transport child (split on whitespace, speaking src/fabric/child/README.md with the connector
        /// seat's ops) under every rank and in every prefill rank's seat: it sends every room itself through its
        /// engine (a connector's own send path, e.g. tests/connectors/sglang/), judged by the oracle and the rooms.
        #[arg(long, conflicts_with_all = ["fabric", "planner"])]
        connector: Option<String>,
        /// Seconds a connector may take to send one room to one peer.
        #[arg(long, default_value_t = 600, requires = "connector")]
        send_timeout: u64,
        /// With --planner or --connector: a YAML list of known upstream differences (`scenario`, `reason`, `sglang`
        /// source lines, `failure` substring). A listed case that fails as recorded is reported as known; one that
        /// passes or fails otherwise fails the run.
        #[arg(long)]
        known: Option<PathBuf>,
        #[command(flatten)]
        fabric: FabricArgs,
        /// Check only shard K of N of the scenarios (`K/N`, counted from 1; `slurm`: this Slurm array task's);
        /// `kvrelay merge` combines the shards' `--json` files.
        #[arg(long, conflicts_with_all = ["planner", "connector"])]
        shard: Option<String>,
        /// Also write every scenario's result as JSON to this file.
        #[arg(long, conflicts_with_all = ["planner", "connector"])]
        json: Option<PathBuf>,
    },
    /// Certify a transport: run the fixed, versioned case set (the seam's contract and error paths, every scenario,
    /// a throughput run) through it and write junit.xml, report.json and manifest.txt.
    Certify(certify::CertifyArgs),
    /// kvrelay's own planner behind the plan protocol, on stdin/stdout (the reference for `check --planner`).
    Planner,
    /// Print a completion script for SHELL, generated from these definitions (bash: `kvrelay completions bash >
    /// /etc/bash_completion.d/kvrelay`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), generated from these definitions: `kvrelay man > kvrelay.1; man ./kvrelay.1`.
    Man,
    /// Write scenarios: `kvrelay scenario from-config config.json --prefill '--tp 1 --pp-size 8' --decode '--tp 8
    /// --dcp-size 8' --out my.yaml`.
    Scenario {
        #[command(subcommand)]
        action: ScenarioAction,
    },
    /// Replay a load shape through the engines on the in-memory fabric (default: 128 requests of 32,768 input
    /// tokens at concurrency 16 on Kimi-K3 PP8/TP1 -> TP8/DCP8 with KDA state), every decode byte verified; reports
    /// input tokens/s, bytes/s, peak memory and per-request latency percentiles.
    Replay(load::ReplayArgs),
    /// Plant known layout bugs (mutants) in kvrelay's own plans, run each through the engines on the in-memory
    /// fabric, and require the oracle to catch every one; prints the table of mutants caught.
    Selftest(selftest::SelftestArgs),
    /// Swarm runs under seeded faults: per seed a random subset of fault kinds (work-request errors, torn writes,
    /// corruption, lost or duplicated completions and messages), every scenario through the engines, each run
    /// judged by the guarantee (Success byte-exact or Failed with a reason, no hang); non-zero exit on any
    /// harness failure, with its reproduce line.
    Sim(sim::SimArgs),
    /// Combine the `--json` files of one sharded `kvrelay check` or `kvrelay sim` (`--shard K/N`, every shard once)
    /// into the report the unsharded command prints; non-zero exit on any failure.
    Merge {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Also write the merged totals as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Reduce a failing scenario (its own run, a self-test mutant caught, or an external planner failing it) to a
    /// minimal one that fails the same way, written as a scenario file; prints the sizes before and after and the
    /// reproduce command.
    Shrink(shrink::ShrinkArgs),
    /// Time the planner on the Kimi-K3 PP8/TP1 -> TP8/DCP8 shape.
    Bench {
        /// Prompt length of the benchmarked request.
        #[arg(long, default_value_t = 32768)]
        tokens: u32,
        /// Timed repetitions (the median is reported).
        #[arg(long, default_value_t = 21)]
        iterations: u32,
        /// Runs of the whole Kimi-K3 scenario, through the engines and directly (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: u32,
        /// Benchmark this fabric instead: write bandwidth per message size (RDMA: loopback on the device, to set
        /// beside its `ib_write_bw`) and the posted-work-request rate of a token-granular DCP scenario.
        #[command(flatten)]
        fabric: FabricArgs,
        /// Message sizes of the fabric's write-bandwidth run, in bytes.
        #[arg(long, value_delimiter = ',', default_values_t = [65536u64])]
        message_bytes: Vec<u64>,
        /// The scenario of the work-request rate run.
        #[arg(long, default_value = "scenarios/engines/dcp-relayout-two-stages.yaml")]
        wr_scenario: PathBuf,
        /// Planning only (no fabric, no byte moves): a markdown table of plan time, descriptors, work requests and
        /// memory over token counts (4K to 1M), DCP sizes (1 to 64) and TP sizes (up to 64).
        #[arg(long, conflicts_with = "fabric")]
        scaling: bool,
        /// With --scaling: leave out shapes of more tokens than this.
        #[arg(long, default_value_t = 1 << 20, requires = "scaling")]
        max_tokens: u32,
        /// With --fabric: the descriptor lists' target engine in another process (as ranks run; NIXL on VRAM in
        /// one process goes through UCX's loopback instead of cuda_ipc).
        #[arg(long, requires = "fabric")]
        across_processes: bool,
        /// With --fabric: only the descriptor-list benchmark, and only these of its lists (seam, packed,
        /// per-token, per-page, contiguous).
        #[arg(long, value_delimiter = ',', requires = "fabric")]
        lists: Vec<String>,
    },
    /// The target engine of `bench --across-processes` (started by it).
    #[command(hide = true)]
    BenchTarget {
        #[command(flatten)]
        fabric: FabricArgs,
        /// Bytes of target memory.
        #[arg(long)]
        bytes: u64,
    },
}

/// Which fabric moves the bytes.
#[derive(Debug, Clone, clap::Args)]
pub struct FabricArgs {
    /// `sim` (in-memory, simulated time), `live-sim` (in-memory, real clock), `rdma` (verbs; needs the `rdma`
    /// feature), `nixl` (NIXL over UCX on host memory; needs the `nixl` feature and `bash ci/engines.sh`),
    /// `mooncake` (Mooncake's Transfer Engine behind the child protocol; `bash ci/engines.sh`), `cuda` (GPU memory:
    /// every rank's regions on GPU `$KVRELAY_CUDA_DEVICE`, judged there; needs the `cuda` feature), `child:COMMAND` (a
    /// program speaking kvrelay-transport-1, src/fabric/child/README.md) or `plugin:PATH` (a C ABI transport
    /// plug-in, src/fabric/kvrelay_transport.h). `diff`, `serve` and `launch` default to `rdma`, `run` and `check`
    /// to `sim`.
    #[arg(long)]
    pub fabric: Option<String>,
    /// RDMA device (default: the first device with an active port).
    #[arg(long)]
    pub device: Option<String>,
}

impl FabricArgs {
    fn fabric(&self, default: &str) -> anyhow::Result<harness::Fabric> {
        let name = self.fabric.as_deref().unwrap_or(default);
        harness::Fabric::parse(name, self.device.clone()).map_err(anyhow::Error::msg)
    }
}

/// Deadlines of a run across processes.
#[derive(Debug, Clone, clap::Args)]
pub struct Deadlines {
    /// Seconds to wait for every rank to connect to the hub.
    #[arg(long, default_value_t = 60)]
    pub connect_timeout: u64,
    /// Seconds a decode request may wait for the prefill side before it fails (domain.md §6.4).
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
}

impl Deadlines {
    fn live(&self) -> crate::engine::live::LiveOptions {
        crate::engine::live::LiveOptions {
            waiting_timeout_ns: self.timeout.saturating_mul(1_000_000_000),
            time_limit: Duration::from_secs(self.timeout.saturating_mul(2)),
            trace: false,
            planner: None,
        }
    }
}

/// Why a command-line value or a CLI step below `anyhow`'s top level failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("`{text}` names no rank (fix: prefill:N or decode:N)")]
    NoRank { text: String },
    #[error("`{side}` is not a side (fix: prefill:N or decode:N)")]
    NotSide { side: String },
    #[error("`{index}` is not a rank index (fix: prefill:N or decode:N)")]
    NotIndex { index: String },
    #[error("no mutant `{name}` (fix: one of {names})")]
    UnknownMutant { name: String, names: String },
    #[error(transparent)]
    Scenario(#[from] scenario::ScenarioError),
    #[error("plan rejected: {0}")]
    Plan(#[from] plan::PlanError),
}

error_kinds! {
    /// The kind of a [`CliError`].
    pub enum CliErrorKind {
        /// A `--omit`-style rank spec that is not `prefill:N` or `decode:N`.
        BadRankSpec = "bad_rank_spec",
        /// A `--mutant` that names no mutant.
        UnknownMutant = "unknown_mutant",
        /// A scenario that does not load.
        Scenario = "scenario",
        /// A plan the planner rejects.
        PlanRejected = "plan_rejected",
    }
}

impl CliError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> CliErrorKind {
        match self {
            CliError::NoRank { .. } | CliError::NotSide { .. } | CliError::NotIndex { .. } => CliErrorKind::BadRankSpec,
            CliError::UnknownMutant { .. } => CliErrorKind::UnknownMutant,
            CliError::Scenario(_) => CliErrorKind::Scenario,
            CliError::Plan(_) => CliErrorKind::PlanRejected,
        }
    }
}

/// `prefill:N` or `decode:N`.
fn parse_rank_spec(text: &str) -> Result<(crate::process::Role, u32), CliError> {
    let (role, index) = text.split_once(':').ok_or_else(|| CliError::NoRank { text: text.to_owned() })?;
    let role = match role {
        "prefill" => crate::process::Role::Prefill,
        "decode" => crate::process::Role::Decode,
        other => return Err(CliError::NotSide { side: other.to_owned() }),
    };
    let index = index.parse().map_err(|_| CliError::NotIndex { index: index.to_owned() })?;
    Ok((role, index))
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(code) => code,
        // A closed stdout (`kvrelay plan --json | head`) is the reader's choice, not an error.
        Err(error)
            if error.downcast_ref::<std::io::Error>().is_some_and(|it| it.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn load(path: &Path, seed: Option<u64>) -> anyhow::Result<Scenario> {
    Ok(scenario::load_seeded(path, seed)?)
}

/// Runs one command; `Ok(FAILURE)` for a completed command whose verdict is negative.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let seed = command_seed(&args)?;
    match args.command {
        Command::Run(args) => run::run(&args, seed),
        Command::Report(args) => report::report(&args, seed),
        Command::Matrix(args) => matrix::matrix(&args),
        Command::Schema { name } => {
            out!("{}", schema::schema_text(name));
            Ok(ExitCode::SUCCESS)
        }
        Command::Layout { scenario, rank } => layout(&load(&scenario, seed)?, rank),
        Command::Explain { scenarios } => {
            for file in &scenarios {
                let scenario = load(file, seed)?;
                out!("{}", crate::explain::render(&scenario.name, &crate::explain::explain(&scenario.problem)));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan { scenario, json, expand, paged } => print_plan(&load(&scenario, seed)?, json, expand, paged),
        Command::Diff { scenarios, fabric } => ranks::diff(&scenarios, &fabric.fabric("rdma")?, seed),
        Command::Serve { scenario, role, rank, bootstrap, no_hub, fabric, deadlines } => {
            let loaded = load(&scenario, seed)?;
            let Some((role, rank)) = role.zip(rank) else {
                let (prefill, decode) = (loaded.problem.prefill.ranks.len(), loaded.problem.decode.ranks.len());
                let environment = |name: &str| std::env::var(name).ok();
                let placed =
                    crate::process::launcher::place(&environment, prefill as u32, decode as u32, bootstrap.as_deref())
                        .map_err(anyhow::Error::msg)?;
                let options = serve_options(placed.role, placed.rank, placed.bootstrap.clone(), &fabric, &deadlines)?;
                return ranks::serve_placed(&loaded, &placed, &options, !no_hub, &deadlines);
            };
            let bootstrap = bootstrap.ok_or_else(|| anyhow::anyhow!("--role and --rank need --bootstrap HOST:PORT"))?;
            ranks::serve(&loaded, &serve_options(role, rank, bootstrap, &fabric, &deadlines)?)
        }
        Command::Hub { scenario, bootstrap, deadlines } => {
            let scenario = load(&scenario, seed)?;
            ranks::hub(&scenario, &bootstrap, &deadlines)
        }
        Command::Launch { scenario, fabric, deadlines, omit, chaos } => {
            let loaded = load(&scenario, seed)?;
            ranks::launch(&scenario, &loaded, &launch_options(&fabric, &deadlines, omit, chaos, seed)?)
        }
        Command::Check { .. }
        | Command::Bench { .. }
        | Command::Replay(_)
        | Command::Certify(_)
        | Command::Selftest(_)
        | Command::Sim(_)
            if seed.is_some() =>
        {
            bail!(
                "--seed applies to run, layout, plan, diff, shrink and the rank commands; checks, certification, the \
                 self-test and benchmarks keep each scenario's own seed"
            )
        }
        Command::Check { dir, planner: Some(command), planner_timeout, known, .. } => {
            let mut seat = planners::Seat::planner(&command, Duration::from_secs(planner_timeout));
            planners::check(&dir, &mut seat, known.as_deref())
        }
        Command::Check { dir, connector: Some(command), send_timeout, known, .. } => {
            let mut seat = planners::Seat::connector(&command, Duration::from_secs(send_timeout))?;
            planners::check(&dir, &mut seat, known.as_deref())
        }
        Command::Check { known: Some(_), .. } => bail!("--known lists differences of a --planner or a --connector"),
        Command::Check { dir, golden, fabric, shard, json, .. } => {
            let shard = sim::shard(shard.as_deref())?;
            check(&dir, &golden, &fabric.fabric("sim")?, shard, json.as_deref())
        }
        Command::Certify(args) => certify::certify(&args),
        Command::Replay(args) => replay::replay(&args),
        Command::Selftest(args) => selftest::selftest(&args),
        Command::Sim(args) => sim::sim(&args),
        Command::Merge { files, json } => merge::merge(&files, json.as_deref()),
        Command::Shrink(args) => shrink::shrink(&args, seed),
        Command::Planner => reference_planner(),
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut <Args as clap::CommandFactory>::command(), "kvrelay", &mut out);
            std::io::stdout().write_all(&out)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Scenario { action: ScenarioAction::FromConfig { config, prefill, decode, tokens, out } } => {
            from_config(&config, &prefill, &decode, tokens, out.as_deref())
        }
        Command::Man => {
            let mut out = Vec::new();
            clap_mangen::Man::new(<Args as clap::CommandFactory>::command()).render(&mut out)?;
            std::io::stdout().write_all(&out)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            fabric: FabricArgs { fabric: Some(name), device },
            message_bytes,
            wr_scenario,
            iterations,
            across_processes,
            lists,
            ..
        } => {
            let fabric = harness::Fabric::parse(&name, device).map_err(anyhow::Error::msg)?;
            if !lists.is_empty() {
                bench_lists::bench_engine_lists(&fabric, iterations, across_processes, &lists)?;
                return Ok(ExitCode::SUCCESS);
            }
            bench::bench_fabric(&fabric, &message_bytes, iterations, &wr_scenario, across_processes)
        }
        Command::BenchTarget { fabric, bytes } => {
            bench_lists::bench_target(&fabric.fabric("sim")?, bytes)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { scaling: true, max_tokens, iterations, .. } => bench::bench_scaling(max_tokens, iterations),
        Command::Bench { tokens, iterations, runs, .. } => {
            bench::bench_memory_fabric(runs)?;
            bench::bench(tokens, iterations)?;
            bench::bench_engines(runs)
        }
    }
}

/// The seed override (`--seed` or `KVRELAY_SEED`) `args.command` loads its scenarios under, if any.
fn command_seed(args: &Args) -> anyhow::Result<Option<u64>> {
    Ok(match run::seed_override(args.seed)? {
        // The variable is for the commands that take a seed; the others say they leave it alone (the planner
        // quietly: `check --planner` starts it once per scenario).
        Some((_, run::SeedSource::Env)) if matches!(args.command, Command::Planner) => None,
        Some((seed, run::SeedSource::Env)) if !takes_seed(&args.command) => {
            eprintln!("note: {}={seed} ignored: checks and benchmarks keep each scenario's own seed", run::SEED_ENV);
            None
        }
        other => other.map(|(seed, _)| seed),
    })
}

/// `kvrelay layout`: the decode memory after a run of `scenario`, of every decode rank or of the `rank`th.
fn layout(scenario: &Scenario, rank: Option<u32>) -> anyhow::Result<ExitCode> {
    let only = match rank {
        None => None,
        Some(index) => {
            let decode = &scenario.problem.decode.topology;
            let Some(rank) = decode.ranks().nth(index as usize) else {
                bail!("--rank {index} is out of range: decode has {} ranks", decode.tp * decode.pp);
            };
            Some(rank)
        }
    };
    let outcome = harness::run(scenario)?;
    if let Err(error) = &outcome.plan {
        eprintln!("note: plan rejected ({error}); showing the untouched decode memory");
    }
    out!("{}", render::layout(&scenario.problem, &outcome.observation, only));
    Ok(ExitCode::SUCCESS)
}

/// `kvrelay plan`: the composed plan of `scenario`, as a summary or as JSON (descriptors, paged or expanded copies).
fn print_plan(scenario: &Scenario, json: bool, expand: bool, paged: bool) -> anyhow::Result<ExitCode> {
    let plan = plan::plan(&scenario.problem).map_err(|error| anyhow::anyhow!("plan rejected: {error}"))?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    if json {
        let form = match (expand, paged) {
            (true, _) => render::PlanForm::Copies,
            (false, true) => render::PlanForm::Paged,
            (false, false) => render::PlanForm::Descriptors,
        };
        render::plan_json(&scenario.problem, &plan, form, &mut out)?;
    } else {
        out.write_all(render::plan_summary(&plan).as_bytes())?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// `kvrelay planner`: kvrelay's own planner over the plan protocol on stdin and stdout.
fn reference_planner() -> anyhow::Result<ExitCode> {
    crate::external::reference::serve(std::io::stdin().lock(), std::io::stdout().lock())?;
    Ok(ExitCode::SUCCESS)
}

/// `kvrelay serve`'s options from its flags.
fn serve_options(
    role: crate::process::Role,
    rank: u32,
    bootstrap: String,
    fabric: &FabricArgs,
    deadlines: &Deadlines,
) -> anyhow::Result<crate::process::ServeOptions> {
    Ok(crate::process::ServeOptions {
        role,
        rank,
        bootstrap,
        fabric: fabric.fabric("rdma")?,
        connect_timeout: Duration::from_secs(deadlines.connect_timeout),
        live: deadlines.live(),
    })
}

/// `kvrelay launch`'s options from its flags; the children get the seed override as `--seed`.
fn launch_options(
    fabric: &FabricArgs,
    deadlines: &Deadlines,
    omit: Vec<(crate::process::Role, u32)>,
    chaos: Option<crate::process::chaos::Chaos>,
    seed: Option<u64>,
) -> anyhow::Result<crate::process::LaunchOptions> {
    Ok(crate::process::LaunchOptions {
        fabric: fabric.fabric("rdma")?,
        child_args: seed.map(|seed| vec!["--seed".to_owned(), seed.to_string()]).unwrap_or_default(),
        connect_timeout: Duration::from_secs(deadlines.connect_timeout),
        live: deadlines.live(),
        omit,
        chaos,
    })
}

/// Whether `command` loads scenarios under a seed override (`--seed` or `KVRELAY_SEED`).
fn takes_seed(command: &Command) -> bool {
    !matches!(
        command,
        Command::Check { .. }
            | Command::Bench { .. }
            | Command::BenchTarget { .. }
            | Command::Replay(_)
            | Command::Certify(_)
            | Command::Planner
            | Command::Selftest(_)
            | Command::Sim(_)
            | Command::Matrix(_)
    )
}

/// The scenario files under a directory and what was passed over, with the reason.
#[derive(Debug, Default)]
pub(super) struct Found {
    pub(super) files: Vec<PathBuf>,
    pub(super) skipped: Vec<(PathBuf, &'static str)>,
}

/// Every `*.yaml` and `*.yml` under `dir`, sorted. Symbolic links are never followed (a link to `.` would walk
/// forever, a link elsewhere would check files twice or outside the corpus); they and other non-scenario files are
/// reported as skipped.
pub(super) fn scenario_files(dir: &Path) -> anyhow::Result<Found> {
    fn walk(dir: &Path, found: &mut Found) -> anyhow::Result<()> {
        let mut entries = Vec::new();
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
            entries.push((entry.path(), entry.file_type().with_context(|| format!("reading {}", dir.display()))?));
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        for (path, kind) in entries {
            let scenario = path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml");
            if kind.is_symlink() {
                found.skipped.push((path, "a symbolic link (not followed)"));
            } else if kind.is_dir() {
                walk(&path, found)?;
            } else if scenario && kind.is_file() {
                found.files.push(path);
            } else if path.file_name().is_some_and(|name| !name.to_string_lossy().starts_with('.')) {
                found.skipped.push((path, "not a .yaml or .yml file"));
            }
        }
        Ok(())
    }
    let mut found = Found::default();
    if dir.is_file() {
        found.files.push(dir.to_path_buf());
        return Ok(found);
    }
    walk(dir, &mut found)?;
    found.files.sort();
    Ok(found)
}

fn check(
    dir: &Path,
    golden_dir: &Path,
    fabric: &harness::Fabric,
    shard: crate::shard::Shard,
    json: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let Found { files, skipped } = scenario_files(dir)?;
    for (path, why) in &skipped {
        eprintln!("skipped {}: {why}", path.display());
    }
    if files.is_empty() {
        bail!("no *.yaml or *.yml scenarios under {}", dir.display());
    }
    if shard != crate::shard::Shard::ALL {
        outln!("shard {shard}: every {}th scenario from scenario {}", shard.count, shard.index - 1);
    }
    let relative_name = |file: &PathBuf| {
        let relative = file.strip_prefix(dir).ok().filter(|relative| !relative.as_os_str().is_empty());
        relative.unwrap_or(file).display().to_string()
    };
    let mut cases = Vec::new();
    let mine: Vec<&PathBuf> = shard.pick(&files).collect();
    let bar = progress(mine.len() as u64, "check");
    for file in mine {
        let mut said = Vec::new();
        let case = check_one(dir, golden_dir, fabric, file, &mut said);
        bar.suspend(|| print_said(&said))?;
        bar.inc(1);
        cases.push(merge::CheckCase { scenario: relative_name(file), ..case });
    }
    bar.finish_and_clear();
    let scenarios: Vec<String> = files.iter().map(relative_name).collect();
    let result = merge::CheckResult::new(dir, fabric, shard, scenarios, cases);
    result.summary()?;
    if let Some(path) = json {
        write_json(path, &result)?;
    }
    Ok(if result.failed() == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `kvrelay scenario from-config`: the scenario written, loaded back through the scenario loader before it is
/// handed over (an import the loader refuses is an error here, never a file that fails later).
fn from_config(
    config: &Path,
    prefill: &str,
    decode: &str,
    tokens: u32,
    out: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    use crate::from_config::{import, parse_flags};
    let text = std::fs::read_to_string(config).map_err(|error| anyhow::anyhow!("{}: {error}", config.display()))?;
    let (prefill_side, decode_side) = (parse_flags("prefill", prefill)?, parse_flags("decode", decode)?);
    let command = format!(
        "kvrelay scenario from-config {} --prefill '{prefill}' --decode '{decode}' --tokens {tokens}",
        config.file_name().map_or_else(|| config.display().to_string(), |name| name.to_string_lossy().into_owned())
    );
    let scenario = import(&config.display().to_string(), &text, &prefill_side, &decode_side, tokens, &command)
        .map_err(|error| anyhow::anyhow!("{}: {error}", config.display()))?;
    scenario::parse(&scenario, "<imported>", "imported")
        .map_err(|error| anyhow::anyhow!("the imported scenario does not load: {error}"))?;
    match out {
        Some(path) => {
            std::fs::write(path, &scenario).map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
            outln!("wrote {} (run it: kvrelay run {})", path.display(), path.display());
        }
        None => out!("{scenario}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `value` as pretty JSON in `path` (the `--json` files).
fn write_json(path: &Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))
}

/// That `results` are the shards of one run (`key` the same for all: what the run was; `what` names it for the
/// error) and every shard is there once (`shard` of each).
fn one_run<T, K: PartialEq>(
    results: &[(PathBuf, T)],
    key: impl Fn(&T) -> K,
    shard: impl Fn(&T) -> crate::shard::Shard,
    what: &str,
) -> anyhow::Result<Vec<crate::shard::Shard>> {
    let (first_file, first) = &results[0];
    for (file, result) in &results[1..] {
        anyhow::ensure!(
            key(result) == key(first),
            "{} and {} are shards of different runs ({what} differ) (fix: merge one run's shards)",
            first_file.display(),
            file.display()
        );
    }
    let shards: Vec<crate::shard::Shard> = results.iter().map(|(_, result)| shard(result)).collect();
    crate::shard::complete(&shards).map_err(anyhow::Error::msg)?;
    Ok(shards)
}

/// Lines a step said, in order, each to stdout or (`true`) stderr.
fn print_said(said: &[(bool, String)]) -> anyhow::Result<()> {
    for (stderr, text) in said {
        if *stderr {
            std::io::stderr().write_all(text.as_bytes())?;
        } else {
            out!("{text}");
        }
    }
    Ok(())
}

/// A progress bar of `len` steps of `what` on stderr, drawn only where stderr is a terminal (a CI log or a pipe
/// gets none); print under it with `suspend`.
pub(crate) fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(Some(len), indicatif::ProgressDrawTarget::stderr());
    let style = indicatif::ProgressStyle::with_template("{msg} [{bar:32}] {pos}/{len} {elapsed}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style.progress_chars("=> "));
    bar.set_message(what.to_owned());
    bar
}

/// One scenario of `check`, what it says collected in `say` (`scenario` left for the caller to name).
fn check_one(
    dir: &Path,
    golden_dir: &Path,
    fabric: &harness::Fabric,
    file: &Path,
    say: &mut Vec<(bool, String)>,
) -> merge::CheckCase {
    let relative = file.strip_prefix(dir).ok().filter(|relative| !relative.as_os_str().is_empty()).unwrap_or(file);
    let fail = |problem: String, reproduce: Option<String>, say: &mut Vec<(bool, String)>| {
        say.push((true, format!("FAIL {}: {problem}\n", relative.display())));
        if let Some(line) = &reproduce {
            say.push((true, format!("{line}\n")));
        }
        merge::CheckCase::new(merge::CaseResult::Fail, vec![problem], reproduce)
    };
    let scenario = match scenario::load(file) {
        Ok(scenario) => scenario,
        Err(error) => return fail(error.to_string(), None, say),
    };
    if !fabric.simulated() && !scenario.faults.is_empty() {
        let why = "its faults are injected by the in-memory fabric only (run it without --fabric)".to_owned();
        say.push((false, format!("skip {}: {why}\n", relative.display())));
        return merge::CheckCase::new(merge::CaseResult::Skip, vec![why], None);
    }
    let outcome = match run_checked(&scenario, fabric) {
        // Judged where it lives; the golden's layout picture is drawn from the bytes read back.
        Ok(mut outcome) => match outcome.observation.materialise() {
            Ok(()) => outcome,
            Err(error) => return fail(format!("reading device memory back: {error}"), None, say),
        },
        Err(error) => return fail(error.to_string(), Some(check_reproduce(file, scenario.seed)), say),
    };
    let mut actual = render::golden(&scenario, &outcome);
    let golden_path = golden_dir.join(render::golden_file_name(&corpus_relative(file, relative)));
    let mut expected = std::fs::read_to_string(&golden_path).ok().map(|text| render::snapshot_body(&text));
    if !fabric.simulated() {
        // A real fabric's clock is not the simulation's: the golden's event times are not compared.
        actual = untimed(&actual);
        expected = expected.as_deref().map(untimed);
    }
    let mut problems: Vec<String> = outcome.failures.iter().map(ToString::to_string).collect();
    let golden_diff = match expected {
        None => {
            problems.push(format!(
                "no golden layout at {} (fix: run `cargo test`, review the .snap.new, accept it)",
                golden_path.display()
            ));
            String::new()
        }
        Some(expected) if expected.trim_end() != actual.trim_end() => {
            problems.push(format!("layout differs from {}", golden_path.display()));
            render::diff(&expected, &actual)
        }
        Some(_) => String::new(),
    };
    if problems.is_empty() {
        say.push((false, format!("pass {}\n", relative.display())));
        return merge::CheckCase::new(merge::CaseResult::Pass, Vec::new(), None);
    }
    say.push((true, format!("FAIL {}: {}\n", relative.display(), problems.join("; "))));
    say.push((true, render::violations(&outcome.violations)));
    if !golden_diff.is_empty() {
        say.push((true, format!("golden diff:\n{golden_diff}")));
    }
    let reproduce = check_reproduce(file, scenario.seed);
    say.push((true, format!("{reproduce}\n")));
    merge::CheckCase::new(merge::CaseResult::Fail, problems, Some(reproduce))
}

/// `text` with every simulated event time (`at 130.856 us`) replaced by `at (time) us`.
fn untimed(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(" at ") {
        let (before, after) = rest.split_at(at + 4);
        out.push_str(before);
        let number = after.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(after.len());
        match number > 0 && after[number..].starts_with(" us") {
            true => {
                out.push_str("(time)");
                rest = &after[number..];
            }
            false => rest = after,
        }
    }
    out.push_str(rest);
    out
}

/// One scenario of `check` on `fabric` (the simulation on `sim`, the live driver on any other).
fn run_checked(scenario: &scenario::Scenario, fabric: &harness::Fabric) -> Result<harness::Outcome, harness::RunError> {
    match fabric.simulated() {
        true => harness::run(scenario),
        false => harness::run_on(scenario, &harness::Budget::from_env()?, fabric, false),
    }
}

/// The scenario's path as its golden file is named: relative to the nearest enclosing `scenarios` directory (so
/// `check scenarios/basic` and `check scenarios/basic/x.yaml` find the goldens `check scenarios` finds), else
/// `relative` (to the directory checked), else, for a lone file, its name.
fn corpus_relative(file: &Path, relative: &Path) -> PathBuf {
    if let Ok(canonical) = file.canonicalize() {
        let root = canonical.ancestors().skip(1).find(|ancestor| ancestor.file_name() == Some("scenarios".as_ref()));
        if let Some(inside) = root.and_then(|root| canonical.strip_prefix(root).ok()) {
            return inside.to_path_buf();
        }
    }
    match relative == file {
        true => file.file_name().map_or_else(|| file.to_path_buf(), PathBuf::from),
        false => relative.to_path_buf(),
    }
}

/// The reproduce line of a scenario that failed `check`: the file's own seed, explicit so that a `KVRELAY_SEED` in
/// the reader's shell does not replace it.
fn check_reproduce(file: &Path, seed: u64) -> String {
    format!("reproduce: cargo run --release -- run {} --seed {seed}", run::shell_word(&file.display().to_string()))
}

#[cfg(test)]
mod untimed_tests {
    use super::untimed;

    #[test]
    fn untimed_masks_event_times_and_nothing_else() {
        let text = "decode pp0/tp0: request 0 Success at 130.856 us\nlooked at 3 pages\nat 5 us\n";
        assert_eq!(untimed(text), "decode pp0/tp0: request 0 Success at (time) us\nlooked at 3 pages\nat 5 us\n");
        assert_eq!(untimed("Failed at 1 us, at 22.5 us"), "Failed at (time) us, at (time) us");
    }
}
