//! `kvrelay matrix`: runs every cell of `tools::matrix` (kvrelay's plan, the engines and the oracle on the in-memory
//! fabric; with --planner, the same cell with that program in the planner's seat) and prints or writes the table.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

use super::planners::Seat;
use super::progress;
use crate::harness::{self, Budget};
use crate::matrix::{self, Cell, CellResult, Upstream, Verdict};
use crate::scenario::{self, Scenario};
use crate::shard::Shard;

#[derive(Debug, clap::Args)]
pub struct MatrixArgs {
    /// Also run every cell with this command in every prefill rank's planner seat (the plan protocol, as `check
    /// --planner`): e.g. SGLang's helpers, `python tests/planners/sglang/adapter.py`; cells where it disagrees
    /// with kvrelay are marked ≠.
    #[arg(long)]
    pub planner: Option<String>,
    /// Seconds the planner may spend on one cell.
    #[arg(long, default_value_t = 60, requires = "planner")]
    pub planner_timeout: u64,
    /// Write the markdown table to FILE (default: print it).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Write the table as an HTML page, every cell's full verdict in words.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Replace the table between the matrix markers of FILE (the README's) with this run's.
    #[arg(long, value_name = "FILE")]
    pub update: Option<PathBuf>,
    /// Write every cell's scenario file into DIR (`kvrelay run DIR/<cell>.yaml` reruns one).
    #[arg(long, value_name = "DIR")]
    pub cells: Option<PathBuf>,
    /// Run the supported cells' bytes on this transport (default `sim`, the in-memory fabric).
    #[command(flatten)]
    pub fabric: super::FabricArgs,
    /// Judge only shard K of N of the cells (`K/N`, counted from 1; `slurm`: this Slurm array task's); `kvrelay
    /// merge` combines the shards' `--json` files into the whole table.
    #[arg(long, conflicts_with = "update")]
    pub shard: Option<String>,
    /// Also write every cell's result as JSON to this file (format kvrelay-matrix-1).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// `--json`'s format.
pub(super) const FORMAT: &str = "kvrelay-matrix-1";

/// A matrix run (or one shard of it) as `--json` writes it and `kvrelay merge` reads it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct MatrixResult {
    format: String,
    planner: Option<String>,
    fabric: String,
    /// Cells of the whole matrix.
    cells: usize,
    shard: Shard,
    /// The cells this shard judged, in table order.
    results: Vec<CellResult>,
}

/// `kvrelay matrix`; FAILURE when a cell kvrelay planned failed its run.
pub(super) fn matrix(args: &MatrixArgs) -> anyhow::Result<ExitCode> {
    let budget = Budget::from_env()?;
    let fabric = args.fabric.fabric("sim")?;
    let mut seat =
        args.planner.as_deref().map(|command| Seat::planner(command, Duration::from_secs(args.planner_timeout)));
    let shard = super::sim::shard(args.shard.as_deref())?;
    let all = matrix::cells();
    let total = all.len();
    let cells: Vec<Cell> = shard.pick(all).collect();
    let bar = progress(cells.len() as u64, "matrix");
    let mut results = Vec::new();
    if let Some(dir) = &args.cells {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    for cell in cells {
        if let Some(dir) = &args.cells {
            let path = dir.join(format!("{}.yaml", cell.id()));
            std::fs::write(&path, cell.yaml("ok")).with_context(|| format!("writing {}", path.display()))?;
        }
        let (verdict, expect) = judge(&cell, &budget, &fabric)?;
        let upstream = match (&mut seat, &expect) {
            (Some(seat), Some(scenario)) => Some(match seat.case_of(scenario, &cell.id(), &budget) {
                Ok(()) => Upstream::Same,
                Err(lines) => Upstream::Differs { why: lines.join("; ") },
            }),
            _ => None,
        };
        results.push((cell, CellResult { id: cell.id(), verdict, upstream }));
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(path) = &args.json {
        let result = MatrixResult {
            format: FORMAT.to_owned(),
            planner: args.planner.clone(),
            fabric: fabric.name(),
            cells: total,
            shard,
            results: results.iter().map(|(_, result)| result.clone()).collect(),
        };
        super::write_json(path, &result)?;
    }
    let mut table = matrix::markdown(&results, args.planner.as_deref());
    if fabric != harness::Fabric::Sim {
        table.push_str(&format!("\nTransport: `{}`.\n", fabric.name()));
    }
    match &args.markdown {
        Some(path) => std::fs::write(path, &table).with_context(|| format!("writing {}", path.display()))?,
        None if args.update.is_none() => out!("{table}"),
        None => {}
    }
    if let Some(path) = &args.html {
        let page = matrix::html(&results, args.planner.as_deref());
        std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.update {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let Some(updated) = matrix::splice(&text, &table) else {
            anyhow::bail!(
                "{} has no matrix markers (fix: add the lines `{}` and `{}`)",
                path.display(),
                matrix::BEGIN,
                matrix::END
            );
        };
        std::fs::write(path, updated).with_context(|| format!("writing {}", path.display()))?;
        outln!("updated the matrix in {}", path.display());
    }
    let failed = results.iter().any(|(_, result)| matches!(result.verdict, Verdict::Failed { .. }));
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// `kvrelay merge` of a matrix's shards: the whole table, as the unsharded run prints it.
pub(super) fn merge(results: Vec<(PathBuf, MatrixResult)>, json: Option<&std::path::Path>) -> anyhow::Result<ExitCode> {
    super::one_run(
        &results,
        |result| (result.planner.clone(), result.fabric.clone(), result.cells),
        |result| result.shard,
        "planner, fabric or cell count",
    )?;
    let first = results[0].1.clone();
    let cells = matrix::cells();
    anyhow::ensure!(
        cells.len() == first.cells,
        "the shards judged a matrix of {} cells, this kvrelay's has {} (fix: merge with the kvrelay that ran them)",
        first.cells,
        cells.len()
    );
    let mut by_id: std::collections::BTreeMap<String, CellResult> = std::collections::BTreeMap::new();
    for (_, result) in results {
        for cell in result.results {
            by_id.insert(cell.id.clone(), cell);
        }
    }
    let mut table = Vec::new();
    for cell in cells {
        let Some(result) = by_id.remove(&cell.id()) else {
            anyhow::bail!("no shard judged cell `{}` (fix: merge every shard of one run)", cell.id());
        };
        table.push((cell, result));
    }
    out!("{}", matrix::markdown(&table, first.planner.as_deref()));
    if let Some(path) = json {
        let merged = MatrixResult {
            shard: Shard::ALL,
            results: table.iter().map(|(_, result)| result.clone()).collect(),
            ..first
        };
        super::write_json(path, &merged)?;
    }
    let failed = table.iter().any(|(_, result)| matches!(result.verdict, Verdict::Failed { .. }));
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// kvrelay's verdict on `cell`, and the scenario a planner in the seat is held to (`expect` set to kvrelay's
/// verdict: a clean transfer, or the same rejection kind); none for a cell that is no deployment.
fn judge(cell: &Cell, budget: &Budget, fabric: &harness::Fabric) -> anyhow::Result<(Verdict, Option<Scenario>)> {
    let parse = |expect: &str| scenario::parse(&cell.yaml(expect), &format!("<matrix {}>", cell.id()), &cell.id());
    let scenario = match parse("ok") {
        Ok(scenario) => scenario,
        Err(error) => {
            // The field and the rule (`decode.dcp: 2 does not divide tp 1 ...`), without the cell's own name.
            let why = error
                .diagnostics
                .first()
                .map_or_else(|| error.to_string(), |diagnostic| format!("{}: {}", diagnostic.path, diagnostic.message));
            return Ok((Verdict::Impossible { why }, None));
        }
    };
    if let Err(error) = crate::plan::plan(&scenario.problem) {
        let kind = error.kind().name().to_owned();
        let expect = parse(&format!("{{error: {kind}}}")).ok();
        return Ok((Verdict::Rejected { kind, message: error.to_string() }, expect));
    }
    let outcome = harness::Run::new(&scenario, budget).on(fabric).execute()?;
    if outcome.passed() {
        Ok((Verdict::Supported, Some(scenario)))
    } else {
        let mut why = outcome.failure_text("; ");
        if let Some(violation) = outcome.violations.first() {
            why.push_str(&format!("; {violation}"));
        }
        Ok((Verdict::Failed { why }, Some(scenario)))
    }
}
