//! What several benchmarks and the replay share: the Kimi-K3 benchmark problem and the process's peak memory.

use crate::model::Problem;
use crate::scenario;

/// The benchmark problem: Kimi-K3 (24 MLA layers, 69 KDA layers unless `kv_only`), prefill PP8/TP1, decode
/// TP8/DCP8, P = 64, one chunk.
pub(super) fn bench_problem(tokens: u32, kv_only: bool) -> anyhow::Result<Problem> {
    bench_problem_with(tokens, kv_only, "")
}

/// The benchmark problem with `pages` (scenario text of explicit page lists, or empty).
pub(super) fn bench_problem_with(tokens: u32, kv_only: bool, pages: &str) -> anyhow::Result<Problem> {
    let state = if kv_only { ", state: []" } else { "" };
    let text = format!(
        "model: {{preset: kimi-k3{state}}}\nprefill: {{pp: 8, page_size: 64}}\ndecode: {{tp: 8, dcp: 8, page_size: 64}}\nrequests: [{{tokens: {tokens}{pages}}}]\nexpect: ok\n"
    );
    Ok(scenario::parse(&text, "<bench>", "bench-kimi-k3")?.problem)
}

/// The process's peak resident memory (`VmHWM` of /proc/self/status), in bytes.
pub(super) fn peak_rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
