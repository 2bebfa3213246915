//! The seed's validation load, shared by `kvrelay replay` on every fabric (`replay.rs`: the in-memory fabric,
//! `replay_live.rs`: a real-clock one) and `bench --fabric cuda`: its arguments, one wave's scenario text, and the
//! figures a replay prints (latency percentiles, the progress bar).

#![allow(clippy::disallowed_methods, reason = "the replay's progress reads the wall clock at the CLI edge")]

use std::time::Instant;

/// What `kvrelay replay` replays.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Requests in all.
    #[arg(long, default_value_t = 128)]
    pub requests: u32,
    /// Input tokens of every request.
    #[arg(long, default_value_t = 32768)]
    pub tokens: u32,
    /// Requests in flight at once (one wave through the engines).
    #[arg(long, default_value_t = 16)]
    pub concurrency: u32,
    /// The fabric (default `sim`, the in-memory fabric in simulated time; `cuda`: every byte moved and verified on
    /// the GPU, with the live driver on the real clock).
    #[arg(long, default_value = "sim")]
    pub fabric: String,
    /// With `--fabric cuda`: each wave's plan executed straight through the fabric's engines (`engine::direct`, as
    /// `bench --fabric cuda` times one request: memory registered, descriptors submitted as paged entries, every
    /// completion awaited) instead of rank engines speaking the wire protocol; every decode byte still judged on the
    /// GPU by the oracle.
    #[arg(long)]
    pub direct: bool,
}

/// The scenario text of one wave: the Kimi-K3 PP8/TP1 -> TP8/DCP8 shape (scenarios/basic/kimi-k3-...) with its
/// KDA state, `count` requests of `tokens` tokens.
pub(super) fn wave_text(count: u32, tokens: u32) -> String {
    let requests = vec![format!("{{tokens: {tokens}}}"); count as usize].join(", ");
    format!(
        "model: {{preset: kimi-k3}}\nprefill: {{tp: 1, pp: 8, page_size: 64}}\ndecode: {{tp: 8, dcp: 8, page_size: 64}}\nrequests: [{requests}]\nexpect: ok\n"
    )
}

/// A request's latency in a wave's run: when its last decode room ended (every room starts at the run's start), in
/// milliseconds of the run's clock (simulated, or real for a live fabric).
pub(super) fn request_latencies_ms(run: &crate::engine::sim::SimRun) -> Vec<f64> {
    let mut ended: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    for rooms in run.rooms.values() {
        for (id, room) in rooms {
            let at = ended.entry(*id).or_default();
            *at = (*at).max(room.ended_ns.unwrap_or(run.run_ns));
        }
    }
    ended.values().map(|ns| *ns as f64 / 1e6).collect()
}

/// The progress bar after `done` requests, its message the input tokens/s so far.
pub(super) fn progress(bar: &indicatif::ProgressBar, done: u32, tokens: u32, start: &Instant) {
    let seconds = start.elapsed().as_secs_f64();
    bar.set_position(u64::from(done));
    bar.set_message(format!("replay, {:.0} input tokens/s", f64::from(done) * f64::from(tokens) / seconds.max(1e-12)));
}

/// `latency ms (what): p50 .. p90 .. p99 .. max ..` of sorted `latencies_ms`.
pub(super) fn latency_line(what: &str, latencies_ms: &[f64]) -> String {
    format!(
        "latency ms ({what}): p50 {:.3} p90 {:.3} p99 {:.3} max {:.3}",
        percentile(latencies_ms, 0.50),
        percentile(latencies_ms, 0.90),
        percentile(latencies_ms, 0.99),
        percentile(latencies_ms, 1.0)
    )
}

/// The value at quantile `q` (nearest rank) of sorted `values`.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
