//! `kvrelay replay`: a production load shape replayed through the engines on the in-memory fabric, every decode
//! byte verified. Waves of `concurrency` requests (one problem per wave); a wave's decode chunks go back to a
//! [`ChunkPool`] for the next, as a decode server reuses its pools; numbers only, never a pass/fail timing.

#![allow(clippy::disallowed_methods, reason = "the replay reads the wall clock at the CLI edge")]

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Instant;

use crate::engine::sim::SimOptions;
use crate::fabric::world::ChunkPool;
use crate::harness::{self, Budget};
use crate::limits::{MEMORY_BUDGET_ENV, REPLAY_MEMORY_SHARE};
use crate::scenario;

use super::load::{latency_line, progress, request_latencies_ms, wave_text, ReplayArgs};

/// Why a wave's run needs no budget of its own: waves are sized from what a probe wave materialises.
const WAVES: &str = "replay sizes its waves from the probe wave's footprint";

/// Requests per wave: `concurrency`, or as many as fit `budget` at the footprint a one-request probe wave (run
/// and verified before the clock starts, not counted) materialises; its chunks go to `pool` for the first wave.
fn wave_size(concurrency: u32, tokens: u32, budget: &Budget, pool: &ChunkPool) -> anyhow::Result<u32> {
    let probe = scenario::parse_seeded(&wave_text(1, tokens), "<replay>", "replay-kimi-k3", Some(0))?;
    if harness::simulated_bytes(&probe.problem).is_none() {
        anyhow::bail!("{tokens} tokens per request make the pools larger than 2^64 bytes (fix: fewer --tokens)");
    }
    let options = SimOptions { sparse_images: true, chunk_pool: Some(pool.clone()), ..SimOptions::default() };
    let run = harness::Run::new(&probe, &Budget::unbounded(WAVES)).sim_options(&options).engines()?;
    let run = run.map_err(|error| anyhow::anyhow!("{error}, in the probe wave"))?;
    let violations = harness::oracle(&probe, &run, &run.observation).len();
    if violations > 0 || !run.failures().is_empty() {
        anyhow::bail!("the one-request probe wave failed ({violations} violations): run `kvrelay replay --requests 1 --concurrency 1 --tokens {tokens}` to see it");
    }
    let footprint: u64 =
        run.observation.sparse.values().flat_map(|image| image.chunks.values()).map(|c| c.len() as u64).sum();
    crate::engine::sim::recycle(pool, run.observation);
    outln!("footprint: {footprint} bytes of decode memory per request (a one-request probe wave, not counted)");
    let fits = budget.bytes / footprint.max(1);
    if fits == 0 {
        anyhow::bail!("one request of {tokens} tokens materialises {footprint} bytes, more than the budget of {budget} (fix: fewer --tokens, or set {MEMORY_BUDGET_ENV})");
    }
    Ok(u32::try_from(fits).unwrap_or(u32::MAX).min(concurrency))
}

pub(super) fn replay(args: &ReplayArgs) -> anyhow::Result<ExitCode> {
    let fabric = harness::Fabric::parse(&args.fabric, None).map_err(anyhow::Error::msg)?;
    if !fabric.simulated() {
        return super::replay_live::replay_live(args, &fabric);
    }
    let (requests, tokens, concurrency) = (args.requests.max(1), args.tokens.max(1), args.concurrency.max(1));
    let budget = Budget::from_env_share(REPLAY_MEMORY_SHARE)?;
    outln!(
        "replay: {requests} requests of {tokens} input tokens at concurrency {concurrency}, Kimi-K3 prefill PP8/TP1 -> decode TP8/DCP8 with KDA state, in-memory fabric (sparse images), every decode byte verified"
    );
    let pool = ChunkPool::new(budget.bytes);
    let batch = wave_size(concurrency, tokens, &budget, &pool)?;
    if batch < concurrency {
        outln!("note: {concurrency} requests of {tokens} tokens do not fit the memory budget ({budget}); each wave runs as runs of at most {batch} requests");
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let start = Instant::now();
    let (mut done, mut bytes, mut violations, mut failed) = (0u32, 0u64, 0usize, 0usize);
    let mut latencies_ms: Vec<f64> = Vec::new();
    let mut wave = 0u64;
    let bar = super::progress(u64::from(requests), "replay");
    while done < requests {
        let count = batch.min(requests - done);
        let scenario = scenario::parse_seeded(&wave_text(count, tokens), "<replay>", "replay-kimi-k3", Some(wave + 1))?;
        let options = SimOptions { sparse_images: true, chunk_pool: Some(pool.clone()), ..SimOptions::default() };
        let run = harness::Run::new(&scenario, &Budget::unbounded(WAVES)).sim_options(&options).engines()?;
        let run = run.map_err(|error| anyhow::anyhow!("{error}, in wave {wave}"))?;
        failed += run.failures().len();
        violations += harness::oracle(&scenario, &run, &run.observation).len();
        bytes += run.observation.writes.iter().map(|write| write.length).sum::<u64>();
        latencies_ms.extend(request_latencies_ms(&run));
        crate::engine::sim::recycle(&pool, run.observation);
        done += count;
        wave += 1;
        progress(&bar, done, tokens, &start);
    }
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let input_tokens = u64::from(requests) * u64::from(tokens);
    latencies_ms.sort_by(f64::total_cmp);
    let peak = super::shapes::peak_rss_bytes();
    outln!("requests: {requests}");
    outln!("input tokens: {input_tokens}");
    outln!("seconds: {seconds:.3}");
    outln!("input tokens/s: {:.0}", input_tokens as f64 / seconds.max(1e-12));
    outln!("bytes moved: {bytes}");
    outln!("bytes/s: {:.0}", bytes as f64 / seconds.max(1e-12));
    outln!("peak rss bytes: {}", peak.map_or_else(|| "unknown".to_owned(), |peak| peak.to_string()));
    outln!("{}", latency_line("simulated completion of each request's rooms in its wave", &latencies_ms));
    outln!("failed requests: {failed}");
    outln!("violations: {violations}");
    Ok(if violations == 0 && failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
