//! `kvrelay replay --fabric F` on a real-clock fabric (`cuda`: the GPU): the same load shape in waves of
//! `concurrency` requests, each wave through the engines on `F` with the live driver and every decode byte judged
//! where it lives (the oracle's resident path on the GPU, cross-checked by a host read-back of one region per
//! decode rank). One warm-up wave of one request goes first, not counted. Numbers only.

#![allow(clippy::disallowed_methods, reason = "the replay reads the wall clock at the CLI edge")]

use std::io::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use super::load::{latency_line, progress, request_latencies_ms, wave_text, ReplayArgs};
use crate::engine::live::LiveOptions;
use crate::harness::{self, Budget};
use crate::scenario::{self, Scenario};

/// Why a live wave's run needs no byte budget: the fabric's own memory bounds it (an allocation the GPU cannot
/// hold is refused with its size).
const DEVICE_BOUND: &str = "a live replay is bounded by the fabric's own memory";

/// One wave's figures.
struct Wave {
    failed: usize,
    violations: usize,
    cross_check: Vec<String>,
    bytes: u64,
    latencies_ms: Vec<f64>,
    engine_seconds: f64,
    oracle_seconds: f64,
    cross_check_seconds: f64,
}

/// The decode ranks a wave's host read-back cross-checks: every rank (the warm-up), or the one rank `wave % ranks`,
/// so that the waves of a replay take turns over the ranks and each is read back every `ranks` waves. A read-back
/// through pageable memory costs more than the wave's writes; the device oracle judges every byte of every wave.
#[derive(Clone, Copy)]
enum CrossCheck {
    Every,
    Turn(usize),
}

/// The cross-check's disagreements over the ranks `which` picks, and its seconds.
fn cross_check(
    problem: &crate::model::Problem,
    observation: &crate::verify::Observation,
    ranks: &[(crate::model::RankId, crate::verify::Verdicts)],
    which: CrossCheck,
) -> (Vec<String>, f64) {
    let start = Instant::now();
    let ranks = match which {
        CrossCheck::Every => ranks,
        CrossCheck::Turn(wave) if !ranks.is_empty() => &ranks[wave % ranks.len()..wave % ranks.len() + 1],
        CrossCheck::Turn(_) => ranks,
    };
    let texts = harness::cross_check_ranks_within(problem, observation, ranks, CROSS_CHECK_BYTES)
        .into_iter()
        .map(|it| it.text)
        .collect();
    (texts, start.elapsed().as_secs_f64())
}

/// The host read-back of a wave's cross-check reads at most about this much of the rank it checks (a Kimi-K3 KV layer
/// region of 16 requests is 75 MB, read through pageable memory and walked by the host oracle: more than the wave's
/// writes); the device oracle judges every byte regardless.
const CROSS_CHECK_BYTES: u64 = 32 << 20;

/// Threads planning waves ahead of the GPU, each its own waves in turn (planning is pure and a wave's plan is the
/// replay's slowest host step: 0.16 s of one core a wave of 16 Kimi-K3 32K requests on the lent H100's host). With
/// `--direct` each spreads its wave's requests over [`plan_workers`] threads more.
const PLANNERS: usize = 2;

/// Threads each planner spreads a wave's requests over (`--direct`): the machine's cores beyond the GPU loop and
/// the oracle's thread, shared by the planners.
fn plan_workers() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    (cores.saturating_sub(2) / PLANNERS).max(1)
}

/// What a wave's time went to, in seconds, where the driver tells them apart.
#[derive(Default)]
struct Phases {
    /// On the planning thread, a wave ahead of the GPU.
    plan: f64,
    register: f64,
    batches: f64,
    records: f64,
    execute: f64,
    /// Keeping the decode memory for the oracle, and handing it back after.
    observe: f64,
    teardown: f64,
}

/// A wave parsed (and, for `--direct`, planned and lowered into batches' entries) by the planning thread.
struct Planned {
    scenario: Scenario,
    plan: Option<crate::engine::direct::Lowered>,
    plan_seconds: f64,
}

/// Wave `wave` of `count` requests, parsed, and where `direct` planned and lowered as the cuda fabric's engines
/// take it (paged entries), its requests spread over `workers` threads.
fn plan_wave(count: u32, tokens: u32, wave: u64, direct: bool, workers: usize) -> anyhow::Result<Planned> {
    let scenario = scenario::parse_seeded(&wave_text(count, tokens), "<replay>", "replay-kimi-k3", Some(wave))?;
    let start = Instant::now();
    let plan = if direct {
        let (mut lowered, _) = crate::engine::direct::Lowered::per_request(&scenario.problem, true, workers)
            .map_err(anyhow::Error::msg)?;
        lowered.record_writes()?;
        Some(lowered)
    } else {
        None
    };
    Ok(Planned { scenario, plan, plan_seconds: start.elapsed().as_secs_f64() })
}

/// A wave's writes done on the GPU, its decode memory kept for the oracle.
struct Executed {
    scenario: Scenario,
    observation: crate::verify::Observation,
    which: CrossCheck,
    wave: Wave,
    phases: Phases,
}

/// The oracle's verdict on an executed wave (every decode rank on the GPU, one cross-checked by a host read-back),
/// its decode memory handed back after: the wave's figures complete.
fn judge_executed(executed: Executed) -> (Wave, Phases) {
    let Executed { scenario, observation, which, mut wave, mut phases } = executed;
    let problem = &scenario.problem;
    let start = Instant::now();
    let ranks: Vec<_> =
        problem.decode.ranks.iter().map(|layout| (layout.rank, crate::verify::Verdicts::all_succeeded())).collect();
    wave.violations = harness::check_ranks(problem, &observation, &ranks).len();
    wave.oracle_seconds = start.elapsed().as_secs_f64();
    (wave.cross_check, wave.cross_check_seconds) = cross_check(problem, &observation, &ranks, which);
    let start = Instant::now();
    drop(observation); // the decode memory goes back to the GPU's spares
    phases.teardown = start.elapsed().as_secs_f64();
    (wave, phases)
}

fn run_wave(
    planned: Planned,
    fabric: &harness::Fabric,
    direct: Option<&Device>,
    which: CrossCheck,
) -> anyhow::Result<(Wave, Phases)> {
    if let (Some(device), Some(_)) = (direct, &planned.plan) {
        return Ok(judge_executed(device.direct_execute(planned, which)?));
    }
    let scenario = &planned.scenario;
    let live = LiveOptions { time_limit: Duration::from_secs(300), ..LiveOptions::default() };
    let start = Instant::now();
    let run = harness::Run::new(scenario, &Budget::unbounded(DEVICE_BOUND)).on(fabric).live_options(&live).engines()?;
    let run = run.map_err(anyhow::Error::msg)?;
    let engine_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let violations = harness::oracle(scenario, &run, &run.observation).len();
    let oracle_seconds = start.elapsed().as_secs_f64();
    let ranks: Vec<_> = scenario
        .problem
        .decode
        .ranks
        .iter()
        .map(|layout| (layout.rank, harness::verdicts(&scenario.expect, &run, layout.rank)))
        .collect();
    let (cross_check, cross_check_seconds) = cross_check(&scenario.problem, &run.observation, &ranks, which);
    let wave = Wave {
        failed: run.failures().len(),
        violations,
        cross_check,
        bytes: run.observation.writes.iter().map(|write| write.length).sum(),
        latencies_ms: request_latencies_ms(&run),
        engine_seconds,
        oracle_seconds,
        cross_check_seconds,
    };
    Ok((wave, Phases::default()))
}

/// Requests per wave: `concurrency`, halved while a wave's registered memory would not fit in `free` bytes (with
/// `overlapped`, beside the decode memory of the wave before it, which the oracle still judges).
fn wave_size(concurrency: u32, tokens: u32, free: Option<u64>, overlapped: bool) -> anyhow::Result<u32> {
    let mut size = concurrency;
    while let Some(free) = free {
        let probe = scenario::parse_seeded(&wave_text(size, tokens), "<replay>", "replay-kimi-k3", Some(0))?;
        let judged = if overlapped { harness::side_bytes(&probe.problem.decode) } else { Some(0) };
        let held = harness::simulated_bytes(&probe.problem).zip(judged);
        let needed = held.and_then(|(wave, judged)| wave.checked_add(judged)).unwrap_or(u64::MAX);
        if needed <= free / 10 * 9 || size == 1 {
            break;
        }
        size /= 2;
    }
    Ok(size)
}

pub(super) fn replay_live(args: &ReplayArgs, fabric: &harness::Fabric) -> anyhow::Result<ExitCode> {
    let (requests, tokens, concurrency) = (args.requests.max(1), args.tokens.max(1), args.concurrency.max(1));
    outln!(
        "replay: {requests} requests of {tokens} input tokens at concurrency {concurrency}, Kimi-K3 prefill PP8/TP1 -> decode TP8/DCP8 with KDA state, on the {} fabric (live driver, real clock), every decode byte judged where it lives",
        fabric.name()
    );
    let device = Device::open(fabric)?;
    let direct = match (&device, args.direct) {
        (Some(device), true) if matches!(fabric, harness::Fabric::Cuda) => Some(device),
        (_, true) => anyhow::bail!("--direct runs on the cuda fabric only (fix: --fabric cuda, or leave --direct out)"),
        _ => None,
    };
    if direct.is_some() {
        outln!("driver: each wave's plan executed straight through the cuda fabric's engines (engine::direct), no rank engines or wire protocol");
    }
    let batch = wave_size(concurrency, tokens, device.as_ref().map(Device::free_bytes), direct.is_some())?;
    if batch < concurrency {
        outln!("note: {concurrency} requests of {tokens} tokens do not fit the device's free memory; waves of {batch}");
    }
    let workers = plan_workers();
    let warm = plan_wave(1, tokens, 0, direct.is_some(), workers)?;
    let (probe, _) = run_wave(warm, fabric, direct, CrossCheck::Every)?;
    if probe.violations > 0 || probe.failed > 0 || !probe.cross_check.is_empty() {
        anyhow::bail!("the one-request warm-up wave failed: run `kvrelay replay --fabric {} --requests 1 --concurrency 1 --tokens {tokens}`", fabric.name());
    }
    if let Some(device) = direct {
        // A serving engine allocates its KV pools once, at start-up, not per request: two full waves (as many as
        // the loop below holds at once) registered, executed and judged before the clock starts, so the timed
        // waves reuse their device memory instead of timing `cuMemAlloc`.
        let full = batch.min(requests);
        let first = device.direct_execute(plan_wave(full, tokens, 0, true, workers)?, CrossCheck::Every)?;
        let second = device.direct_execute(plan_wave(full, tokens, 0, true, workers)?, CrossCheck::Every)?;
        for (warm, _) in [first, second].map(judge_executed) {
            if warm.violations > 0 || warm.failed > 0 || !warm.cross_check.is_empty() {
                anyhow::bail!("a full warm-up wave failed: run `kvrelay replay --fabric cuda --direct --requests {full} --concurrency {full} --tokens {tokens}`");
            }
        }
        outln!("warm-up: two full waves of {full} requests registered, executed and judged before the clock starts (their device memory is reused, as a serving engine's KV pool is)");
    }
    if let Some(device) = &device {
        device.reset_peak();
        device.stats_line(); // counted from here on
    }
    let start = Instant::now();
    let (mut done, mut wave) = (0u32, 0u64);
    let (mut bytes, mut violations, mut failed, mut engine_seconds, mut oracle_seconds) =
        (0u64, 0usize, 0usize, 0.0, 0.0);
    let (mut cross_check_seconds, mut planning_wait) = (0.0, 0.0);
    let mut cross_check = Vec::new();
    let mut latencies_ms = Vec::new();
    let mut phases = Phases::default();
    let mut registering = Vec::new();
    let bar = super::progress(u64::from(requests), "replay");
    // The waves, planned on PLANNERS threads ahead of the fabric (the plan is pure: the planner needs nothing the
    // fabric holds), as a serving system plans the next requests while the last ones move.
    let waves: Vec<(u32, u64)> = (0..u64::from(requests.div_ceil(batch)))
        .map(|wave| (batch.min(requests - wave as u32 * batch), wave + 1))
        .collect();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        // Planner `p` plans waves p, p + PLANNERS, ... and holds at most one ahead; the GPU loop takes them in order.
        let planners = PLANNERS.min(waves.len()).max(1);
        let direct_planning = direct.is_some();
        let mut inboxes = Vec::with_capacity(planners);
        for planner in 0..planners {
            let (sender, inbox) = std::sync::mpsc::sync_channel::<anyhow::Result<Planned>>(1);
            inboxes.push(inbox);
            let mine: Vec<(u32, u64)> = waves.iter().copied().skip(planner).step_by(planners).collect();
            scope.spawn(move || {
                for (count, wave) in mine {
                    if sender.send(plan_wave(count, tokens, wave, direct_planning, workers)).is_err() {
                        break;
                    }
                }
            });
        }
        // With --direct the oracle judges wave w on a thread of its own while wave w + 1 is registered and written
        // (a rendezvous: the GPU loop hands a wave over only once the oracle is free, so at most two waves' decode
        // memory is held); its verdicts come back in wave order.
        let (to_oracle, oracle_inbox) = std::sync::mpsc::sync_channel::<Executed>(0);
        let oracle = scope.spawn(move || oracle_inbox.into_iter().map(judge_executed).collect::<Vec<_>>());
        let mut judged = Vec::new();
        for index in 0.. {
            let waited = Instant::now();
            let Ok(next) = inboxes[index % planners].recv() else { break };
            planning_wait += waited.elapsed().as_secs_f64();
            let next = next?;
            let count = next.scenario.problem.requests.len() as u32;
            let which = CrossCheck::Turn(wave as usize);
            let wave_result = match direct {
                Some(device) => device.direct_execute(next, which).map(|executed| {
                    // The oracle's thread is gone only if it panicked: its join says so below.
                    let _ = to_oracle.send(executed);
                    (count, None)
                }),
                None => run_wave(next, fabric, direct, which).map(|figures| (count, Some(figures))),
            };
            let (count, figures) = wave_result.map_err(|error| anyhow::anyhow!("{error}, in wave {wave}"))?;
            judged.extend(figures);
            done += count;
            wave += 1;
            progress(&bar, done, tokens, &start);
        }
        drop(to_oracle);
        judged.extend(oracle.join().map_err(|_| anyhow::anyhow!("the oracle's thread panicked"))?);
        for (figures, wave_phases) in judged {
            phases.plan += wave_phases.plan;
            phases.register += wave_phases.register;
            registering.push(wave_phases.register);
            phases.batches += wave_phases.batches;
            phases.records += wave_phases.records;
            phases.execute += wave_phases.execute;
            phases.observe += wave_phases.observe;
            phases.teardown += wave_phases.teardown;
            failed += figures.failed;
            violations += figures.violations;
            cross_check.extend(figures.cross_check);
            bytes += figures.bytes;
            latencies_ms.extend(figures.latencies_ms);
            engine_seconds += figures.engine_seconds;
            oracle_seconds += figures.oracle_seconds;
            cross_check_seconds += figures.cross_check_seconds;
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let input_tokens = u64::from(requests) * u64::from(tokens);
    latencies_ms.sort_by(f64::total_cmp);
    outln!("requests: {requests}");
    outln!("input tokens: {input_tokens}");
    let beside = if direct.is_some() {
        "; oracle and cross-check on their own thread, beside the next wave's writes"
    } else {
        ""
    };
    outln!(
        "seconds: {seconds:.3} (engines {engine_seconds:.3}, oracle {oracle_seconds:.3}, cross-check {cross_check_seconds:.3}: one decode rank a wave, in turn; waiting for the planning thread {planning_wait:.3}{beside})"
    );
    if direct.is_some() {
        outln!(
            "  engines: planning and lowering into entries {:.3} (each wave's wall seconds, summed: {PLANNERS} planners a wave ahead, each spreading its wave's requests over {workers} threads), registering (device allocations, source patterns, sentinels) {:.3}, building batches {:.3}, recording the writes for the oracle {:.3}, writes and completions {:.3}, keeping decode memory for the oracle {:.3}, handing it back {:.3}",
            phases.plan,
            phases.register,
            phases.batches,
            phases.records,
            phases.execute,
            phases.observe,
            phases.teardown
        );
        let by_wave: Vec<String> = registering.iter().map(|seconds| format!("{seconds:.3}")).collect();
        outln!("  registering, wave by wave: {}", by_wave.join(" "));
    }
    outln!("input tokens/s: {:.0}", input_tokens as f64 / seconds.max(1e-12));
    outln!("bytes moved: {bytes}");
    outln!("bytes/s: {:.0}", bytes as f64 / seconds.max(1e-12));
    if let Some(device) = &device {
        outln!("device: {}", device.name());
        outln!("device memory peak bytes: {}", device.peak_bytes());
        outln!("device work: {}", device.stats_line());
    }
    let latency_what = if direct.is_some() {
        "real clock, a wave's writes and completions (its requests complete together)"
    } else {
        "real clock, each request's last decode room in its wave"
    };
    outln!("{}", latency_line(latency_what, &latencies_ms));
    outln!("failed requests: {failed}");
    outln!("violations: {violations}");
    outln!("cross-check disagreements (device oracle vs host read-back): {}", cross_check.len());
    for text in cross_check.iter().take(5) {
        outln!("  {text}");
    }
    let pass = violations == 0 && failed == 0 && cross_check.is_empty();
    Ok(if pass { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The GPU of a `cuda` replay, for its free memory and peak.
#[cfg(feature = "cuda")]
struct Device(crate::fabric::cuda::CudaTransport);

#[cfg(feature = "cuda")]
impl Device {
    fn open(fabric: &harness::Fabric) -> anyhow::Result<Option<Device>> {
        if !matches!(fabric, harness::Fabric::Cuda | harness::Fabric::NixlCuda) {
            return Ok(None);
        }
        Ok(Some(Device(crate::fabric::cuda::CudaTransport::new().map_err(anyhow::Error::msg)?)))
    }
    fn free_bytes(&self) -> u64 {
        self.0.free_bytes()
    }
    fn reset_peak(&self) {
        self.0.reset_peak();
    }
    fn peak_bytes(&self) -> u64 {
        self.0.peak_bytes()
    }
    fn name(&self) -> String {
        self.0.device_name().to_owned()
    }
    /// What the GPU did since the last call, in words.
    fn stats_line(&self) -> String {
        let stats = self.0.device_stats();
        format!(
            "{} patterns and sentinels generated, {} source patterns found still in place in reused memory (none generated), {} waits for the GPU ({:.3} s)",
            stats.patterns, stats.reused_patterns, stats.waits, stats.wait_seconds
        )
    }

    /// One wave through `engine::direct` on this GPU, planned and lowered already: registered, executed with one
    /// thread per prefill engine, its decode memory kept for the oracle ([`judge_executed`]).
    fn direct_execute(&self, planned: Planned, which: CrossCheck) -> anyhow::Result<Executed> {
        use crate::engine::direct::Direct;
        use crate::fabric::seam::NodeId;

        let Planned { scenario, plan, plan_seconds } = planned;
        let lowered = plan.ok_or_else(|| anyhow::anyhow!("a --direct wave came unplanned"))?;
        let problem = &scenario.problem;
        let start = Instant::now();
        let open = |node: usize| Ok(self.0.cuda_engine(NodeId(node as u32)));
        let mut direct = Direct::prepare_lowered(problem, Some(lowered), &[], open)?;
        let prepare = start.elapsed().as_secs_f64();
        let prepared = direct.prepared();
        let executed = direct.execute_parallel(Duration::from_secs(60)).map_err(anyhow::Error::msg)?;
        let bytes = direct.bytes();
        let start = Instant::now();
        let observation = direct.observe()?;
        let observe = start.elapsed().as_secs_f64();
        let wave = Wave {
            failed: 0,
            violations: 0,
            cross_check: Vec::new(),
            bytes,
            latencies_ms: vec![executed.total * 1e3; problem.requests.len()],
            engine_seconds: prepare + executed.total,
            oracle_seconds: 0.0,
            cross_check_seconds: 0.0,
        };
        let phases = Phases {
            plan: plan_seconds,
            register: prepared.register,
            batches: prepared.batches,
            records: prepared.records,
            execute: executed.total,
            observe,
            teardown: 0.0,
        };
        Ok(Executed { scenario, observation, which, wave, phases })
    }
}

/// No GPU in this build: nothing to ask.
#[cfg(not(feature = "cuda"))]
struct Device;

#[cfg(not(feature = "cuda"))]
impl Device {
    fn open(_: &harness::Fabric) -> anyhow::Result<Option<Device>> {
        Ok(None)
    }
    fn free_bytes(&self) -> u64 {
        0
    }
    fn reset_peak(&self) {}
    fn peak_bytes(&self) -> u64 {
        0
    }
    fn name(&self) -> String {
        String::new()
    }
    fn stats_line(&self) -> String {
        String::new()
    }
    fn direct_execute(&self, planned: Planned, _: CrossCheck) -> anyhow::Result<Executed> {
        let _ = (planned.scenario, planned.plan_seconds);
        anyhow::bail!("--direct needs the cuda feature (fix: build with --features cuda)")
    }
}
