//! `kvrelay bench --fabric cuda`: the GPU's ceilings measured in the same run (device-to-device copy, pinned
//! host-to-device), the fabric's two ways of executing a batch over scattered rows (the gather kernel, one copy-engine
//! copy per row) and the oracle's compare kernel, each as a share of the copy ceiling; then the Kimi-K3 32K request
//! through the engines on the GPU and its verification there. Numbers only, never a pass/fail timing.

#![allow(clippy::disallowed_methods, reason = "the benchmark reads the wall clock at the CLI edge")]

use std::io::Write as _;
use std::time::Instant;

use super::load::wave_text;
use crate::fabric::cuda::CudaTransport;
use crate::harness::{self, Budget};
use crate::scenario;

/// Bytes of the ceiling runs: 1 GiB, past the H200's 60 MiB L2 many times over.
const CEILING_BYTES: u64 = 1 << 30;
/// A Kimi-K3 MLA token row (576 fp16 values).
const ROW_BYTES: u64 = 1152;

/// `fabric`: `cuda`, or `nixl-cuda` (NIXL's agents moving the same device memory; its ceilings are the GPU's).
pub(super) fn bench_cuda(fabric: &harness::Fabric, iterations: u32) -> anyhow::Result<()> {
    let transport = CudaTransport::new().map_err(anyhow::Error::msg)?;
    outln!("bench: GPU {}", transport.device_name());
    let ceilings = transport.ceilings(CEILING_BYTES, ROW_BYTES)?;
    let share = |rate: f64| 100.0 * rate / ceilings.device_copy.max(1e-12);
    outln!(
        "ceiling: device-to-device copy {:.0} GB/s of payload ({:.0} GB/s counting read and write), 1 GiB, best of 5",
        ceilings.device_copy,
        2.0 * ceilings.device_copy
    );
    outln!("ceiling: pinned host-to-device {:.1} GB/s (256 MiB, best of 5)", ceilings.host_to_device);
    outln!(
        "gather kernel, 1 GiB of {ROW_BYTES}-byte rows scattered: {:.0} GB/s, {:.0}% of the copy ceiling",
        ceilings.gather,
        share(ceilings.gather)
    );
    outln!(
        "copy engines, one cuMemcpyDtoDAsync per {ROW_BYTES}-byte row (20,000 rows): {:.1} GB/s, {:.1}% of the copy ceiling",
        ceilings.copy_engine_rows,
        share(ceilings.copy_engine_rows)
    );
    outln!(
        "compare kernel (the oracle's device check) over the same rows: {:.0} GB/s, {:.0}% of the copy ceiling",
        ceilings.judge,
        share(ceilings.judge)
    );
    let scenario = scenario::parse_seeded(&wave_text(1, 32768), "<bench>", "bench-kimi-k3", Some(0))?;
    let budget = Budget::unbounded("the GPU's own memory bounds the benchmark");
    let (mut best_run, mut best_oracle, mut bytes) = (f64::INFINITY, f64::INFINITY, 0u64);
    for _ in 0..iterations.clamp(1, 5) {
        let run = harness::Run::new(&scenario, &budget).on(fabric).engines()?;
        let run = run.map_err(anyhow::Error::msg)?;
        anyhow::ensure!(run.failures().is_empty(), "the Kimi-K3 request failed on the GPU: {:?}", run.failures());
        let start = Instant::now();
        let violations = harness::oracle(&scenario, &run, &run.observation);
        let oracle = start.elapsed().as_secs_f64();
        anyhow::ensure!(violations.is_empty(), "the oracle found {} violations on the GPU", violations.len());
        bytes = run.observation.writes.iter().map(|write| write.length).sum();
        best_run = best_run.min(run.run_ns as f64 / 1e9);
        best_oracle = best_oracle.min(oracle);
    }
    let rate = |seconds: f64| bytes as f64 / seconds.max(1e-12) / 1e9;
    outln!(
        "kimi-k3 32K request (KV and KDA state, {bytes} B) through the engines on {} on the GPU (every rank an engine of this process), end to end (bootstrap, planning, writes, completions): {best_run:.4} s, {:.1} GB/s, {:.1}% of the copy ceiling",
        fabric.name(),
        rate(best_run),
        share(rate(best_run))
    );
    outln!(
        "its verification on the GPU (the oracle's enumeration on the host, compares on the device): {best_oracle:.4} s, {:.1} GB/s, {:.1}% of the copy ceiling",
        rate(best_oracle),
        share(rate(best_oracle))
    );
    if matches!(fabric, harness::Fabric::Cuda) {
        direct(&scenario, iterations, &share)?;
    }
    outln!("device memory peak: {} bytes", transport.peak_bytes());
    Ok(())
}

/// The Kimi-K3 request's plan executed straight through the `cuda` engines (`engine::direct`: every prefill
/// engine's batches of strided entries, one per decode peer, submitted, then every completion awaited), timed from
/// the first submit to the last completion, best of `iterations`; then the oracle judges the decode memory on the
/// GPU, timed the same way.
fn direct(scenario: &scenario::Scenario, iterations: u32, share: &dyn Fn(f64) -> f64) -> anyhow::Result<()> {
    use crate::engine::direct::Direct;

    let problem = &scenario.problem;
    let descriptors = crate::plan::plan(problem)?.descriptors();
    let engines = CudaTransport::new().map_err(anyhow::Error::msg)?;
    let (mut best_run, mut best_oracle, mut bytes) = (f64::INFINITY, f64::INFINITY, 0u64);
    let (mut best_walk, mut best_whole) = (f64::INFINITY, f64::INFINITY);
    let mut best_phases = crate::engine::direct::Phases::default();
    let mut best_judged = crate::fabric::cuda::JudgeStats::default();
    let spreads = verification_spreads();
    let mut best_spread = vec![f64::INFINITY; spreads.len()];
    for _ in 0..iterations.clamp(1, 5) {
        let mut direct = Direct::prepare(problem, &descriptors, |node| {
            Ok(engines.cuda_engine(crate::fabric::seam::NodeId(node as u32)))
        })?;
        bytes = direct.bytes();
        let phases = direct.execute_parallel(std::time::Duration::from_secs(10)).map_err(anyhow::Error::msg)?;
        let seconds = phases.total;
        if seconds < best_run {
            (best_run, best_phases) = (seconds, phases);
        }
        let observation = direct.observe()?;
        let ranks: Vec<_> =
            problem.decode.ranks.iter().map(|layout| (layout.rank, crate::verify::Verdicts::all_succeeded())).collect();
        engines.judge_stats();
        let start = Instant::now();
        let violations = harness::check_ranks(problem, &observation, &ranks);
        let oracle = start.elapsed().as_secs_f64();
        let judged = engines.judge_stats();
        if oracle < best_oracle {
            (best_oracle, best_judged) = (oracle, judged);
        }
        anyhow::ensure!(violations.is_empty(), "the oracle found {} violations in the direct run", violations.len());
        let start = Instant::now();
        let walked = harness::check_ranks(problem, &walk_only(&observation), &ranks);
        best_walk = best_walk.min(start.elapsed().as_secs_f64());
        anyhow::ensure!(walked.is_empty(), "the oracle's walk alone found {} violations", walked.len());
        let start = Instant::now();
        let whole = harness::check_ranks_in_parts(problem, &observation, &ranks, 1);
        best_whole = best_whole.min(start.elapsed().as_secs_f64());
        anyhow::ensure!(whole.is_empty(), "the oracle found {} violations judging whole ranks", whole.len());
        for ((parts, threads), best) in spreads.iter().zip(&mut best_spread) {
            let start = Instant::now();
            let spread = harness::check_ranks_on(problem, &observation, &ranks, *parts, *threads);
            *best = best.min(start.elapsed().as_secs_f64());
            anyhow::ensure!(spread.is_empty(), "the oracle found {} violations in {parts} parts", spread.len());
        }
    }
    let rate = |seconds: f64| bytes as f64 / seconds.max(1e-12) / 1e9;
    outln!(
        "kimi-k3 32K request executed by the cuda fabric (writes and completions, after planning: the plan's {} strided descriptors as {} paged entries through the requests' page tables, one batch per prefill-decode pair, every prefill engine on a thread of its own, from the first submit to the last completion), best of {}: {best_run:.6} s, {:.0} GB/s, {:.1}% of the copy ceiling",
        descriptors.len(),
        best_phases.entries,
        iterations.clamp(1, 5),
        rate(best_run),
        share(rate(best_run))
    );
    outln!(
        "  slowest sender: submitting (checks, lowering to runs) {:.6} s, doorbell (table upload, launch) {:.6} s, waiting for completions {:.6} s",
        best_phases.submit,
        best_phases.flush,
        best_phases.wait
    );
    outln!(
        "its verification on the GPU (oracle, every decode rank): {best_oracle:.4} s, {:.1} GB/s, {:.1}% of the copy ceiling",
        rate(best_oracle),
        share(rate(best_oracle))
    );
    outln!(
        "  its compares: {} calls, {} checks as {} table entries; building tables {:.6} s, upload to answers {:.6} s (summed over the oracle's threads); from the first call's start to the last answers {:.6} s",
        best_judged.calls,
        best_judged.checks,
        best_judged.entries,
        best_judged.table_seconds,
        best_judged.device_seconds,
        best_judged.span_seconds
    );
    outln!(
        "  the oracle's walk alone (the same ranks on the same threads, every question answered yes at once, no compares): {best_walk:.6} s; the verification with each rank whole (one part, one compare call a rank): {best_whole:.6} s"
    );
    let by_spread: Vec<String> = spreads
        .iter()
        .zip(&best_spread)
        .map(|((parts, threads), seconds)| format!("{parts}/{threads} {:.3} ms", seconds * 1e3))
        .collect();
    outln!(
        "  the verification by parts a rank / threads (the default: {} parts, {} threads), best of {}: {}",
        harness::rank_parts(problem.decode.ranks.len()),
        crate::parallel::cores(),
        iterations.clamp(1, 5),
        by_spread.join(", ")
    );
    Ok(())
}

/// The (parts a rank, threads) the benchmark times the verification with: 1, 2 and 4 parts on 4, 8 and every core,
/// so a run shows which spread this machine's cores and GPU favour.
fn verification_spreads() -> Vec<(u32, usize)> {
    let cores = crate::parallel::cores();
    let mut threads: Vec<usize> = [4, 8, cores].into_iter().filter(|threads| *threads <= cores).collect();
    threads.dedup();
    [1, 2, 4].into_iter().flat_map(|parts| threads.iter().map(move |threads| (parts, *threads))).collect()
}

/// A judge that answers every question yes without looking: the oracle's walk timed alone.
struct Yes;

impl crate::verify::Judge for Yes {
    fn judge(
        &self,
        queries: &[(u64, crate::verify::Query)],
        _: &[&[crate::verify::RowRun]],
    ) -> Result<Vec<bool>, String> {
        Ok(vec![true; queries.len()])
    }
    fn read(&self, _: u64, _: u64, _: &mut [u8]) -> Result<(), String> {
        Err("the walk-only judge reads nothing".to_owned())
    }
    fn name(&self) -> String {
        "walk only".to_owned()
    }
}

/// `observation`'s resident regions behind [`Yes`] (the same handles and lengths; the memory stays the original's).
fn walk_only(observation: &crate::verify::Observation) -> crate::verify::Observation {
    let yes: std::sync::Arc<dyn crate::verify::Judge> = std::sync::Arc::new(Yes);
    let mut walked = crate::verify::Observation { writes: observation.writes.clone(), ..Default::default() };
    for (key, region) in &observation.resident {
        walked.resident.insert(*key, crate::verify::ResidentRegion { judge: yes.clone(), ..region.clone() });
    }
    walked
}
