//! The fabric and process commands: `diff` (two fabrics, byte for byte), `serve` (one rank), `hub` (the bootstrap
//! hub alone) and `launch` (every rank as a process).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use super::{load, Deadlines};
use crate::harness::{self, Budget};
use crate::scenario::Scenario;

/// `kvrelay diff`: each scenario on the in-memory fabric and on `fabric`, compared byte for byte.
pub(super) fn diff(paths: &[PathBuf], fabric: &harness::Fabric, seed: Option<u64>) -> anyhow::Result<ExitCode> {
    let budget = Budget::from_env()?;
    let (mut failed, mut skipped) = (0, 0);
    for path in paths {
        let scenario = load(path, seed)?;
        if !fabric.simulated() && !scenario.faults.is_empty() {
            outln!("skip {}: its faults are injected by the in-memory fabric only", scenario.file);
            skipped += 1;
            continue;
        }
        let report = harness::diff(&scenario, &budget, fabric)?;
        let regions = report.reference.observation.images.len();
        let verdict = |outcome: &harness::Outcome| match outcome.passed() {
            true => "pass".to_owned(),
            false => format!("FAIL ({})", outcome.failure_text("; ")),
        };
        outln!("diff {}: sim vs {}", scenario.file, fabric.name());
        outln!("  decode bytes compared: {} in {regions} regions", report.bytes);
        let writes = &report.other.observation.writes;
        let moved: u64 = writes.iter().map(|write| write.length).sum();
        outln!("  {}: {} writes confirmed, {moved} bytes moved", fabric.name(), writes.len());
        outln!("  sim: {}; {}: {}", verdict(&report.reference), fabric.name(), verdict(&report.other));
        if report.differences.is_empty() {
            outln!("  identical");
        } else {
            outln!("  {} rows differ:", report.differences.len());
            for difference in report.differences.iter().take(20) {
                outln!("    {difference}");
            }
        }
        if !report.differences.is_empty() || !report.reference.passed() || !report.other.passed() {
            failed += 1;
            let name = fabric_flag(fabric);
            eprintln!("FAIL diff {}", scenario.file);
            eprintln!("reproduce: {} diff {} {name} --seed {}", fabric.cargo_run(), scenario.file, scenario.seed);
        }
    }
    let compared = paths.len() - skipped;
    match skipped {
        0 => outln!("{} of {compared} scenarios identical on both fabrics", compared - failed),
        _ => outln!(
            "{} of {compared} scenarios identical on both fabrics ({skipped} with faults skipped)",
            compared - failed
        ),
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The `--fabric`/`--device` flags that select `fabric`.
fn fabric_flag(fabric: &harness::Fabric) -> String {
    fabric.flags().join(" ")
}

/// `kvrelay serve`: one rank; a decode rank prints its verdict (human line and machine line).
pub(super) fn serve(scenario: &Scenario, options: &crate::process::ServeOptions) -> anyhow::Result<ExitCode> {
    // The verdict is printed while the rank's engine is still open: an engine that aborts at teardown (its peer
    // killed mid-transfer) leaves the verdict on stdout, and the launcher reports the abnormal exit beside it.
    let mut printed = Ok(());
    let verdict = crate::process::serve(scenario, options, |verdict| printed = print_verdict(verdict))?;
    printed?;
    let Some(verdict) = verdict else {
        outln!("prefill {} done", options.rank);
        return Ok(ExitCode::SUCCESS);
    };
    Ok(if verdict.violation_count == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `kvrelay serve` placed by a launcher: global rank 0 also runs the hub (`hub`), bound before its own rank
/// connects, its report printed after the rank's verdict; the exit code fails if either failed.
pub(super) fn serve_placed(
    scenario: &Scenario,
    placed: &crate::process::launcher::Placed,
    options: &crate::process::ServeOptions,
    hub: bool,
    deadlines: &Deadlines,
) -> anyhow::Result<ExitCode> {
    outln!(
        "{} rank {}: {} {} (hub {})",
        placed.launcher,
        placed.global,
        match placed.role {
            crate::process::Role::Prefill => "prefill",
            crate::process::Role::Decode => "decode",
        },
        placed.rank,
        placed.bootstrap
    );
    if placed.global != 0 || !hub {
        return serve(scenario, options);
    }
    let bound = crate::control::Hub::bind(&placed.bootstrap)?;
    let connect = Duration::from_secs(deadlines.connect_timeout);
    let plan = crate::process::hub_plan(&scenario.problem, connect, deadlines.live().time_limit);
    let running = std::thread::spawn(move || bound.run(&plan));
    let served = serve(scenario, options);
    let report = running.join().map_err(|_| anyhow::anyhow!("the hub's thread panicked"))?;
    print_hub(&report)?;
    let hub_passed = report.missing.is_empty() && report.lost.is_empty() && !report.timed_out;
    match served? {
        code if code == ExitCode::SUCCESS && hub_passed => Ok(ExitCode::SUCCESS),
        _ => Ok(ExitCode::FAILURE),
    }
}

/// A decode process's verdict: the human line, its violations, the machine line the launcher reads.
fn print_verdict(verdict: &crate::process::RankVerdict) -> anyhow::Result<()> {
    let succeeded = verdict.rooms.iter().filter(|room| room.poll == crate::wire::KvPoll::Success as u8).count();
    outln!(
        "verdict decode {}: {} requests, {succeeded} succeeded, {} violations in {} bytes",
        verdict.rank,
        verdict.rooms.len(),
        verdict.violation_count,
        verdict.bytes
    );
    for violation in &verdict.violations {
        outln!("  {violation}");
    }
    outln!("{}{}", crate::process::VERDICT_PREFIX, serde_json::to_string(verdict)?);
    std::io::Write::flush(&mut std::io::stdout())?;
    Ok(())
}

/// `kvrelay hub`: the bootstrap hub of one run, for ranks on several hosts.
pub(super) fn hub(scenario: &Scenario, bootstrap: &str, deadlines: &Deadlines) -> anyhow::Result<ExitCode> {
    let hub = crate::control::Hub::bind(bootstrap)?;
    outln!("hub listening on {}", hub.local_addr().map_or_else(|| bootstrap.to_owned(), |addr| addr.to_string()));
    let connect = Duration::from_secs(deadlines.connect_timeout);
    let report = hub.run(&crate::process::hub_plan(&scenario.problem, connect, deadlines.live().time_limit));
    print_hub(&report)?;
    Ok(if report.missing.is_empty() && report.lost.is_empty() && !report.timed_out {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_hub(report: &crate::control::HubReport) -> anyhow::Result<()> {
    for line in &report.log {
        outln!("hub: {line}");
    }
    outln!("hub: {} messages routed, {} dropped", report.routed, report.dropped);
    Ok(())
}

/// `kvrelay launch`: every rank as a process on this host; the gathered verdicts.
pub(super) fn launch(
    path: &Path,
    scenario: &Scenario,
    options: &crate::process::LaunchOptions,
) -> anyhow::Result<ExitCode> {
    let launched = crate::process::launch(path, scenario, options)?;
    print_hub(&launched.hub)?;
    for exit in &launched.exits {
        outln!("process {exit}");
    }
    for (index, verdict) in &launched.verdicts {
        match verdict {
            Ok(verdict) => {
                let succeeded = verdict.rooms.iter().filter(|room| room.poll == crate::wire::KvPoll::Success as u8);
                outln!(
                    "decode {index} ({}): {} of {} requests succeeded, {} violations in {} bytes",
                    verdict.rank,
                    succeeded.count(),
                    verdict.rooms.len(),
                    verdict.violation_count,
                    verdict.bytes
                );
            }
            Err(why) => outln!("decode {index}: {why}"),
        }
    }
    for exit in &launched.after_verdict {
        outln!("note: {exit} after its verdict (the verdict stands)");
    }
    if let Some((injected, struck, succeeded, failed)) = &launched.chaos {
        outln!("chaos {injected}; {struck}");
        outln!("chaos: {succeeded} requests succeeded byte-exact, {failed} failed with a reason");
    }
    let chaos =
        options.chaos.map(|chaos| format!(" --chaos {}", crate::process::chaos::name(chaos))).unwrap_or_default();
    if launched.failures.is_empty() {
        outln!("pass {}{chaos} ({} processes, {})", scenario.name, launched.exits.len(), options.fabric.name());
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "FAIL {}: {}",
            scenario.name,
            launched.failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
        );
        eprintln!(
            "reproduce: {} launch {} {}{chaos} --seed {}",
            options.fabric.cargo_run(),
            scenario.file,
            fabric_flag(&options.fabric),
            scenario.seed
        );
        Ok(ExitCode::FAILURE)
    }
}
