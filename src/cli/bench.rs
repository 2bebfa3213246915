//! `kvrelay bench`: the planner on the Kimi-K3 shape, the Kimi-K3 scenario end to end through the engines beside
//! the direct execution, and (with `--fabric`) a real fabric's throughput. Numbers only, never a pass/fail timing.

#![allow(clippy::disallowed_methods, reason = "benchmarks read the wall clock at the CLI edge")]

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use super::load;
use super::shapes::{bench_problem, bench_problem_with, peak_rss_bytes};
use crate::engine::sim::SimOptions;
use crate::fabric::world::ChunkPool;
use crate::harness::{self, Budget};
use crate::model::{Problem, RankId};
use crate::plan;
use crate::scenario;

/// The benchmark problem on contiguous pages 1.. on both sides (a fresh allocator's), where descriptors merge
/// across pages.
fn contiguous_problem(tokens: u32) -> anyhow::Result<Problem> {
    let list = |count: u32| (1..=count).map(|page| page.to_string()).collect::<Vec<_>>().join(", ");
    let pages =
        format!(", prefill_pages: [{}], decode_pages: [{}]", list(tokens.div_ceil(64)), list(tokens.div_ceil(64 * 8)));
    bench_problem_with(tokens, true, &pages)
}

/// Median wall time of `iterations` runs of `work`, and its last result.
fn median(iterations: u32, work: &mut dyn FnMut() -> u64) -> (std::time::Duration, u64) {
    let mut samples = Vec::new();
    let mut result = 0;
    for _ in 0..iterations.max(1) {
        let start = Instant::now();
        result = work();
        samples.push(start.elapsed());
    }
    samples.sort();
    (samples[samples.len() / 2], result)
}

pub(super) fn bench(tokens: u32, iterations: u32) -> anyhow::Result<ExitCode> {
    outln!("bench: Kimi-K3 prefill PP8/TP1 -> decode TP8/DCP8, P=64, {tokens} tokens, 24 MLA layers, 8 decode ranks");
    outln!("{:<14} {:>12} {:>12} {:>10} {:>14} {:>14}", "problem", "plan ms", "expand ms", "groups", "copies", "bytes");
    let mut times = Vec::new();
    for (name, kv_only) in [("kv", true), ("kv+kda state", false)] {
        let problem = bench_problem(tokens, kv_only)?;
        let (plan_time, groups) =
            median(iterations, &mut || plan::plan(&problem).map_or(0, |plan| plan.groups.len() as u64));
        let plan = plan::plan(&problem).map_err(|error| anyhow::anyhow!("plan rejected: {error}"))?;
        let (expand_time, copies) = median(iterations, &mut || {
            // Fold every field a transport needs, so no copy can be optimised away.
            let mut count = 0;
            let mut digest = 0u64;
            for copy in plan.copies() {
                digest = digest.rotate_left(5)
                    ^ copy.source_offset
                    ^ copy.target_offset
                    ^ copy.length
                    ^ u64::from(copy.target_region);
                count += 1;
            }
            std::hint::black_box(digest);
            count
        });
        outln!(
            "{name:<14} {:>12.3} {:>12.3} {groups:>10} {copies:>14} {:>14}",
            plan_time.as_secs_f64() * 1e3,
            expand_time.as_secs_f64() * 1e3,
            plan.bytes_total()
        );
        times.push(plan_time.as_secs_f64());
        if !kv_only {
            let mut per_rank: std::collections::BTreeMap<RankId, (u64, u64)> = std::collections::BTreeMap::new();
            for copy in plan.copies() {
                let entry = per_rank.entry(copy.target).or_default();
                match copy.kind {
                    plan::TransferKind::State { .. } => entry.1 += copy.length,
                    _ => entry.0 += copy.length,
                }
            }
            for (rank, (kv, state)) in per_rank {
                outln!("  decode {rank}: {kv} B kv + {state} B state = {} B", kv + state);
            }
        }
    }
    outln!("ratio plan(kv+kda)/plan(kv): {:.2}", times[1] / times[0].max(1e-12));
    bench_descriptors(tokens, iterations)?;
    Ok(ExitCode::SUCCESS)
}

/// The in-memory fabric's limits (`SimOptions::default`) and Soft-RoCE's (`ibv_devinfo` on rxe0: max_sge 32,
/// max_msg_sz 8 MiB; the send-queue depth kvrelay asks for, `RDMA_CAPS`).
fn lowerings() -> [plan::Limits; 2] {
    let caps = SimOptions::default().caps;
    [
        plan::Limits { max_sge: caps.max_sge, max_message: caps.max_message, sq_depth: caps.sq_depth },
        plan::Limits { max_sge: 32, max_message: 8 << 20, sq_depth: harness::RDMA_CAPS.sq_depth },
    ]
}

/// Descriptors and their lowering to work requests, timed beside the per-row expansion in the same run.
fn bench_descriptors(tokens: u32, iterations: u32) -> anyhow::Result<()> {
    let [sim_limits, roce_limits] = lowerings();
    outln!("descriptors (plan+lower = plan, descriptors and lowering to soft-roce limits, max_sge 32, 8 MiB):");
    outln!(
        "{:<14} {:>8} {:>8} {:>10} {:>8} {:>12} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "problem",
        "descr",
        "paged",
        "copies",
        "ratio",
        "plan+lower",
        "+paged ms",
        "expand ms",
        "wr sim",
        "wr soft-roce",
        "sge soft-roce",
        "wr packed"
    );
    let problems = [
        ("kv contiguous", contiguous_problem(tokens)?),
        ("kv shuffled", bench_problem(tokens, true)?),
        ("kv+kda shuf.", bench_problem(tokens, false)?),
    ];
    for (name, problem) in problems {
        let (lower_time, _) = median(iterations, &mut || {
            let Ok(plan) = plan::plan(&problem) else { return 0 };
            let descriptors = plan.descriptors();
            plan::lower(&descriptors, roce_limits).work_request_count()
        });
        let plan = plan::plan(&problem).map_err(|error| anyhow::anyhow!("plan rejected: {error}"))?;
        let (expand_time, copies) = median(iterations, &mut || {
            let Ok(plan) = plan::plan(&problem) else { return 0 };
            let mut count = 0;
            let mut digest = 0u64;
            for copy in plan.copies() {
                digest = digest.rotate_left(5) ^ copy.source_offset ^ copy.target_offset ^ copy.length;
                count += 1;
            }
            std::hint::black_box(digest);
            count
        });
        let descriptors = plan.descriptors();
        let (paged_time, paged) = median(iterations, &mut || {
            let Ok(plan) = plan::plan(&problem) else { return 0 };
            plan::paged::compact(&problem, &plan.descriptors()).len() as u64
        });
        let (sim, roce) = (plan::lower(&descriptors, sim_limits), plan::lower(&descriptors, roce_limits));
        outln!(
            "{name:<14} {:>8} {paged:>8} {copies:>10} {:>8.0} {:>12.3} {:>10.3} {:>12.3} {:>12} {:>12} {:>12} {:>12}",
            descriptors.len(),
            copies as f64 / (descriptors.len().max(1) as f64),
            lower_time.as_secs_f64() * 1e3,
            paged_time.as_secs_f64() * 1e3,
            expand_time.as_secs_f64() * 1e3,
            sim.work_request_count(),
            roce.work_request_count(),
            roce.sge_count(),
            plan::packed_work_request_count(&descriptors, roce_limits)
        );
    }
    outln!("(contiguous: pages 1.. on both sides; shuffled: the allocator's default; plan+lower, +paged ms and");
    outln!(" expand ms all include planning; paged = descriptors addressed through the request's page tables");
    outln!(" (`plan::paged`, schema kvrelay-plan-3), +paged ms = plan, descriptors and that compaction; copies = the");
    outln!(" per-row expansion; wr = work requests for the one request; wr packed = soft-roce work requests after a");
    outln!(" pack buffer (domain.md §2.8) makes sources contiguous, counted only)");
    Ok(())
}

/// The Kimi-K3 scenario on the in-memory fabric, phase by phase (stage, execute, observe, verify every decode
/// byte), beside memcpy of the same byte count in the same run, and the process's peak resident memory.
pub(super) fn bench_memory_fabric(runs: u32) -> anyhow::Result<ExitCode> {
    let path = Path::new(K3_SCENARIO);
    let scenario = load(path, None)?;
    let problem = &scenario.problem;
    let budget = Budget::from_env()?;
    harness::check_budget(problem, &budget)?;
    // Peak RSS of this figure alone: reset the high-water mark (Linux: "5" to clear_refs) before the first run.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    outln!("bench: {} on the in-memory fabric (stage, execute, observe, verify), best of {runs}", path.display());
    let phases = ["stage", "execute", "observe", "verify"];
    let mut best: Option<(f64, Vec<f64>, u64, usize)> = None;
    let mut cold = None;
    // Chunks come back after each judged run: the runs after the first reuse memory the first faulted in, as a
    // decode server reuses its registered pools.
    let pool = ChunkPool::new(4 << 30);
    for _ in 0..runs.max(1) {
        let mut marks = vec![("start", Instant::now())];
        let options = SimOptions { sparse_images: true, chunk_pool: Some(pool.clone()), ..SimOptions::default() };
        let mut mark = |phase| marks.push((phase, Instant::now()));
        let run = harness::Run::new(&scenario, &budget).sim_options(&options).marked(&mut mark).engines()?;
        let run = run.map_err(anyhow::Error::msg)?;
        let violations = harness::oracle(&scenario, &run, &run.observation).len();
        marks.push(("verify", Instant::now()));
        let bytes: u64 = run.observation.writes.iter().map(|write| write.length).sum();
        crate::engine::sim::recycle(&pool, run.observation);
        let seconds: Vec<f64> = marks.windows(2).map(|pair| (pair[1].1 - pair[0].1).as_secs_f64()).collect();
        let total = (marks[marks.len() - 1].1 - marks[0].1).as_secs_f64();
        cold.get_or_insert(total);
        if best.as_ref().is_none_or(|(best, ..)| total < *best) {
            best = Some((total, seconds, bytes, violations));
        }
    }
    let peak = peak_rss_bytes();
    let (total, seconds, bytes, violations) = best.expect("at least one run");
    let memcpy = memcpy_seconds(bytes);
    let phase_text: Vec<String> =
        phases.iter().zip(&seconds).map(|(phase, seconds)| format!("{phase} {:.3}", seconds)).collect();
    outln!("phases (s): {}", phase_text.join(", "));
    let (fabric_gbps, memcpy_gbps) = (bytes as f64 / total.max(1e-12) / 1e9, bytes as f64 / memcpy.max(1e-12) / 1e9);
    let cold = cold.unwrap_or(total);
    outln!(
        "kvrelay-memfabric bytes={bytes} seconds={total:.3} gbps={fabric_gbps:.3} memcpy_gbps={memcpy_gbps:.3} ratio={:.3} cold_seconds={cold:.3} cold_ratio={:.3} peak_rss_bytes={} violations={violations}",
        fabric_gbps / memcpy_gbps.max(1e-12),
        memcpy / cold.max(1e-12),
        peak.map_or_else(|| "unknown".to_owned(), |peak| peak.to_string()),
    );
    Ok(ExitCode::SUCCESS)
}

/// Seconds memcpy takes to move `bytes` bytes: 64 MiB buffers (past any cache), copied over and over, best of 3.
fn memcpy_seconds(bytes: u64) -> f64 {
    let chunk = 64usize << 20;
    let source: Vec<u8> = (0..chunk).map(|index| index as u8 | 1).collect();
    let mut target = vec![0u8; chunk];
    target.copy_from_slice(&source);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        let mut left = bytes as usize;
        while left > 0 {
            let len = left.min(chunk);
            target[..len].copy_from_slice(std::hint::black_box(&source[..len]));
            std::hint::black_box(&mut target);
            left -= len;
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    best
}

const K3_SCENARIO: &str = "scenarios/basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml";

/// The Kimi-K3 scenario end to end (plan, move, verify) through the engines and directly, side by side.
pub(super) fn bench_engines(runs: u32) -> anyhow::Result<ExitCode> {
    let path = Path::new(K3_SCENARIO);
    let scenario = load(path, None)?;
    let budget = Budget::from_env()?;
    outln!("bench: {} end to end (plan, move, verify), {runs} runs each", path.display());
    // Interleaved (direct, engines, direct, engines, ...) so neither path always pays for fresh pages first.
    let (mut engine_times, mut direct_times) = (Vec::new(), Vec::new());
    let (mut passed, mut clean) = (0, 0);
    for _ in 0..runs.max(1) {
        let (time, verdict) = median(1, &mut || {
            let violations = harness::run_direct(&scenario.problem, &budget).ok().flatten();
            u64::from(violations.is_some_and(|violations| violations.is_empty()))
        });
        direct_times.push(time);
        clean = verdict;
        let (time, verdict) = median(1, &mut || {
            harness::run_with(&scenario, &budget, &SimOptions::default())
                .map_or(0, |outcome| u64::from(outcome.passed()))
        });
        engine_times.push(time);
        passed = verdict;
    }
    engine_times.sort();
    direct_times.sort();
    let (engines, direct) = (engine_times[engine_times.len() / 2], direct_times[direct_times.len() / 2]);
    outln!("{:<10} {:>10} {:>8}", "path", "seconds", "verdict");
    outln!("{:<10} {:>10.3} {:>8}", "engines", engines.as_secs_f64(), if passed == 1 { "pass" } else { "FAIL" });
    outln!("{:<10} {:>10.3} {:>8}", "direct", direct.as_secs_f64(), if clean == 1 { "pass" } else { "FAIL" });
    outln!("ratio engines/direct: {:.2}", engines.as_secs_f64() / direct.as_secs_f64().max(1e-12));
    Ok(ExitCode::SUCCESS)
}

/// `kvrelay bench --fabric F`: the fabric's write bandwidth per message size (one `kvrelay-bw` line each, to set
/// beside the device's own `ib_write_bw`), then the posted-work-request rate of a token-granular DCP scenario
/// through the engines on that fabric (one `kvrelay-wr-rate` line).
pub(super) fn bench_fabric(
    fabric: &harness::Fabric,
    sizes: &[u64],
    iterations: u32,
    wr_scenario: &Path,
    across: bool,
) -> anyhow::Result<ExitCode> {
    outln!("bench: fabric {}", fabric.name());
    #[cfg(feature = "cuda")]
    if matches!(fabric, harness::Fabric::Cuda | harness::Fabric::NixlCuda) {
        super::bench_cuda::bench_cuda(fabric, iterations)?;
    }
    if !fabric.transport().map_err(anyhow::Error::msg)?.verbs() {
        super::bench_lists::bench_engine_lists(fabric, iterations, across, &[])?;
    }
    for &bytes in sizes {
        match write_bandwidth(fabric, bytes)? {
            // MiB/s, perftest's "MB/sec", so the two figures divide.
            Some((moved, seconds, work_requests)) => outln!(
                "kvrelay-bw bytes={bytes} mbps={:.2} work_requests={work_requests} seconds={seconds:.3} (MiB/s)",
                moved as f64 / seconds.max(1e-12) / f64::from(1u32 << 20)
            ),
            None => outln!("kvrelay-bw bytes={bytes}: not measured ({} has no device to saturate)", fabric.name()),
        }
    }
    let scenario = load(wr_scenario, None)?;
    let mut best: Option<(u64, f64)> = None;
    for _ in 0..iterations.max(1) {
        let run =
            harness::Run::new(&scenario, &Budget::from_env()?).on(fabric).engines()?.map_err(anyhow::Error::msg)?;
        let failed = run.failures();
        if let Some((rank, request, reason)) = failed.first() {
            anyhow::bail!("the work-request rate run failed: request {request} on decode {rank}: {reason}");
        }
        let seconds = run.run_ns as f64 / 1e9;
        let work_requests = run.operations;
        if best.is_none_or(|(_, best)| seconds < best) {
            best = Some((work_requests, seconds));
        }
    }
    let (work_requests, seconds) = best.expect("at least one run");
    outln!(
        "kvrelay-wr-rate scenario={} work_requests={work_requests} seconds={seconds:.4} per_second={:.0} (best of {})",
        scenario.file,
        work_requests as f64 / seconds.max(1e-12),
        iterations.max(1)
    );
    Ok(ExitCode::SUCCESS)
}

/// Bytes moved, seconds and work requests of a write-bandwidth run of `bytes`-byte messages; `None` for a fabric
/// without a device.
#[cfg(feature = "rdma")]
fn write_bandwidth(fabric: &harness::Fabric, bytes: u64) -> anyhow::Result<Option<(u64, f64, u64)>> {
    let harness::Fabric::Rdma { device } = fabric else { return Ok(None) };
    // About 128 MiB per size (at least 1000 messages): seconds at Soft-RoCE's ~50 MB/s, a blink on a NIC.
    let iterations = ((128u64 << 20) / bytes.max(1)).max(1000);
    let result = crate::fabric::rdma::write_bandwidth(device.as_deref(), bytes, iterations, 64)?;
    Ok(Some((result.bytes, result.seconds, result.work_requests)))
}

#[cfg(not(feature = "rdma"))]
fn write_bandwidth(fabric: &harness::Fabric, _: u64) -> anyhow::Result<Option<(u64, f64, u64)>> {
    match fabric {
        harness::Fabric::Rdma { .. } => anyhow::bail!(harness::RDMA_MISSING),
        _ => Ok(None),
    }
}

/// One shape of the scaling table: its tokens, label and scenario text.
struct ScalingShape {
    tokens: u32,
    label: String,
    text: String,
}

/// Pages `1..=count` as a YAML flow list body.
fn page_list(count: u32) -> String {
    (1..=count).map(|page| page.to_string()).collect::<Vec<_>>().join(", ")
}

/// The rows of `kvrelay bench --scaling` up to `max_tokens`: the K3 token sweep (contiguous and shuffled pages), the
/// DCP sweep (decode TP = DCP) and the Llama-3-70B TP sweep, the last two at 32K tokens (or `max_tokens` if fewer).
fn scaling_shapes(max_tokens: u32) -> Vec<ScalingShape> {
    let mut shapes = Vec::new();
    let k3 = |tokens: u32, dcp: u32, pages: &str| {
        format!(
            "model: {{preset: kimi-k3, state: []}}\nprefill: {{pp: 8, page_size: 64}}\ndecode: {{tp: {dcp}, dcp: {dcp}, page_size: 64}}\nrequests: [{{tokens: {tokens}{pages}}}]\nexpect: ok\n"
        )
    };
    for tokens in [4u32 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20].into_iter().filter(|&it| it <= max_tokens) {
        let pages = format!(
            ", prefill_pages: [{}], decode_pages: [{}]",
            page_list(tokens.div_ceil(64)),
            page_list(tokens.div_ceil(64 * 8))
        );
        shapes.push(ScalingShape {
            tokens,
            label: "K3 PP8/TP1->TP8/DCP8 contiguous".into(),
            text: k3(tokens, 8, &pages),
        });
        shapes.push(ScalingShape { tokens, label: "K3 PP8/TP1->TP8/DCP8 shuffled".into(), text: k3(tokens, 8, "") });
    }
    let tokens = max_tokens.min(32 << 10);
    for dcp in [1u32, 2, 4, 8, 16, 32, 64] {
        shapes.push(ScalingShape {
            tokens,
            label: format!("K3 PP8/TP1->TP{dcp}/DCP{dcp} shuffled"),
            text: k3(tokens, dcp, ""),
        });
    }
    for (prefill, decode) in [(1u32, 1u32), (1, 8), (1, 64), (2, 16), (4, 32), (8, 8), (8, 64)] {
        let text = format!(
            "model: {{preset: llama-3-70b}}\nprefill: {{tp: {prefill}, page_size: 64}}\ndecode: {{tp: {decode}, page_size: 64}}\nrequests: [{{tokens: {tokens}}}]\nexpect: ok\n"
        );
        shapes.push(ScalingShape { tokens, label: format!("Llama-3-70B TP{prefill}->TP{decode} shuffled"), text });
    }
    shapes
}

/// Bytes every rank of both sides registers, or `None` past `u64`.
fn registered_bytes(problem: &Problem) -> Option<u64> {
    let mut total = 0u64;
    for side in [&problem.prefill, &problem.decode] {
        for rank in &side.ranks {
            for region in &rank.regions {
                total = total.checked_add(region.item_len.checked_mul(u64::from(region.item_count))?)?;
            }
        }
    }
    Some(total)
}

/// Bytes the plan moves, or `None` past `u64`.
fn moved_bytes(plan: &plan::Plan) -> Option<u64> {
    let mut total = 0u64;
    for group in &plan.groups {
        let rows = group.runs.iter().try_fold(0u64, |sum, run| sum.checked_add(run.rows))?;
        for entry in group.entries.iter() {
            total = total.checked_add(entry.length.checked_mul(rows)?)?;
        }
    }
    Some(total)
}

/// Heap bytes of the plan's transfer groups: the group vector and each distinct shared entry and row-run list (the
/// explain strings and the allocator's overhead are left out), or `None` past `u64`.
fn plan_heap_bytes(plan: &plan::Plan) -> Option<u64> {
    let size = |count: usize, each: usize| (count as u64).checked_mul(each as u64);
    let mut total = size(plan.groups.capacity(), std::mem::size_of::<plan::TransferGroup>())?;
    let mut seen = std::collections::BTreeSet::new();
    for group in &plan.groups {
        if seen.insert(group.entries.as_ptr() as usize) {
            total = total.checked_add(size(group.entries.len(), std::mem::size_of::<plan::EntryPair>())?)?;
        }
        if seen.insert(group.runs.as_ptr() as usize) {
            total = total.checked_add(size(group.runs.len(), std::mem::size_of::<plan::RowRun>())?)?;
        }
    }
    Some(total)
}

/// What one row of the scaling table reports.
struct ScalingRow {
    plan_ms: f64,
    lower_ms: f64,
    descriptors: u64,
    paged_ms: f64,
    paged: u64,
    copies: u64,
    work_requests: u64,
    moved: Option<u64>,
    registered: Option<u64>,
    heap: Option<u64>,
}

fn scaling_row(shape: &ScalingShape, iterations: u32) -> Result<ScalingRow, super::CliError> {
    let problem = scenario::parse(&shape.text, "<bench>", "bench-scaling")?.problem;
    let (plan_time, _) = median(iterations, &mut || {
        plan::plan(&problem).map_or(0, |plan| std::hint::black_box(plan.groups.len()) as u64)
    });
    let plan = plan::plan(&problem)?;
    let [_, roce] = lowerings();
    let (lower_time, work_requests) = median(iterations, &mut || {
        let descriptors = plan.descriptors();
        plan::lower(&descriptors, roce).work_request_count()
    });
    let descriptors = plan.descriptors();
    let (paged_time, paged) = median(iterations, &mut || plan::paged::compact(&problem, &descriptors).len() as u64);
    Ok(ScalingRow {
        plan_ms: plan_time.as_secs_f64() * 1e3,
        lower_ms: lower_time.as_secs_f64() * 1e3,
        descriptors: descriptors.len() as u64,
        paged_ms: paged_time.as_secs_f64() * 1e3,
        paged,
        copies: plan.copy_count(),
        work_requests,
        moved: moved_bytes(&plan),
        registered: registered_bytes(&problem),
        heap: plan_heap_bytes(&plan),
    })
}

/// `kvrelay bench --scaling`: planning only (no fabric, no byte moves), one markdown row per shape.
pub(super) fn bench_scaling(max_tokens: u32, iterations: u32) -> anyhow::Result<ExitCode> {
    let iterations = iterations.clamp(1, 5);
    let show = |value: Option<u64>| value.map_or_else(|| "overflow".to_owned(), |it| it.to_string());
    outln!(
        "| tokens | shape | plan ms | plan ms / 1K tokens | descr+lower ms | descriptors | paged ms | paged descriptors | per-row copies | work requests (soft-roce) | bytes moved | registered bytes (both sides) | plan heap bytes |"
    );
    outln!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for shape in scaling_shapes(max_tokens) {
        match scaling_row(&shape, iterations) {
            Ok(row) => outln!(
                "| {} | {} | {:.3} | {:.4} | {:.3} | {} | {:.3} | {} | {} | {} | {} | {} | {} |",
                shape.tokens,
                shape.label,
                row.plan_ms,
                row.plan_ms / (f64::from(shape.tokens) / 1024.0),
                row.lower_ms,
                row.descriptors,
                row.paged_ms,
                row.paged,
                row.copies,
                row.work_requests,
                show(row.moved),
                show(row.registered),
                show(row.heap)
            ),
            Err(error) => {
                outln!(
                    "| {} | {} | not planned: {} |||||||||||",
                    shape.tokens,
                    shape.label,
                    error.to_string().replace('|', "/")
                )
            }
        }
    }
    outln!(
        "(median of {iterations} runs; plan = plan::plan; descr+lower = descriptors and their lowering to soft-roce limits, max_sge 32, 8 MiB messages; paged = plan::paged::compact of those descriptors, alone; per-row copies counted, not expanded; plan heap = group vector and shared entry and row-run lists)"
    );
    Ok(ExitCode::SUCCESS)
}
