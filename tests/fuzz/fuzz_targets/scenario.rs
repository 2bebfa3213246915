//! Fuzz target: any bytes as a scenario file, loaded and (when accepted and small) planned, executed on the
//! in-memory fabric and verified. Panics, aborts, hangs and out-of-memory are the findings; every crash found is
//! kept as a file in tests/hostile/ and pinned by `tests/it/hostile.rs`.
//!
//! Inputs starting with 0xFF are structure-aware: the next byte picks a corpus scenario and each following pair
//! of bytes replaces one number of its text with an edge value, so the fuzzer reaches the planner and the oracle
//! instead of stopping at the YAML parser.

#![no_main]

use kvrelay::harness::{self, Budget};
use kvrelay::scenario;
use libfuzzer_sys::fuzz_target;

/// Simulated memory an accepted input may register.
const BUDGET: u64 = 16 << 20;

/// Numbers at the boundaries the loader, planner and oracle meet.
const EDGES: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "7",
    "8",
    "9",
    "16",
    "64",
    "4096",
    "65536",
    "16777216",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775808",
    "18446744073709551608",
    "18446744073709551615",
    "-1",
];

/// The corpus scenarios, embedded at build time so the target runs from any directory.
const CORPUS: &[&str] = &[
    include_str!("../../../scenarios/basic/baseline-tp1-to-tp1.yaml"),
    include_str!("../../../scenarios/basic/deepseek-v2-lite-dcp1-to-dcp2.yaml"),
    include_str!("../../../scenarios/basic/kimi-k3-example-c.yaml"),
    include_str!("../../../scenarios/basic/mla-tp2-to-tp4.yaml"),
    include_str!("../../../scenarios/basic/mla-tp4-to-tp2.yaml"),
    include_str!("../../../scenarios/draft/kimi-k3-draft-dcp8.yaml"),
    include_str!("../../../scenarios/mha/gqa-replication-tp1-to-tp16.yaml"),
    include_str!("../../../scenarios/mha/llama-3-8b-tp8-to-tp2.yaml"),
    include_str!("../../../scenarios/state/dsa-index-keys-tp2-to-tp4.yaml"),
    include_str!("../../../scenarios/state/kimi-linear-tp4-to-tp2.yaml"),
    include_str!("../../../scenarios/state/older-peer-metadata-defaults.yaml"),
    include_str!("../../../scenarios/state/qwen3-next-tp4-to-tp2.yaml"),
    include_str!("../../../scenarios/state/swa-one-page-drift.yaml"),
    include_str!("../../../scenarios/rejections/conv-groups-out-of-range.yaml"),
    include_str!("../../../scenarios/rejections/mamba-slot-size-mismatch.yaml"),
];

/// A corpus scenario with some of its numbers replaced, as the program in `data` says.
fn mutate(data: &[u8]) -> Vec<u8> {
    let Some((pick, program)) = data.split_first() else { return Vec::new() };
    let text = CORPUS[usize::from(*pick) % CORPUS.len()];
    let mut numbers: Vec<(usize, usize)> = Vec::new();
    let bytes = text.as_bytes();
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'#' {
            at = bytes[at..].iter().position(|byte| *byte == b'\n').map_or(bytes.len(), |end| at + end);
        } else if bytes[at].is_ascii_digit() && (at == 0 || !bytes[at - 1].is_ascii_alphanumeric()) {
            let end = bytes[at..].iter().position(|byte| !byte.is_ascii_digit()).map_or(bytes.len(), |end| at + end);
            numbers.push((at, end));
            at = end;
        } else {
            at += 1;
        }
    }
    let mut replaced: Vec<Option<&str>> = vec![None; numbers.len()];
    for pair in program.chunks_exact(2) {
        if !numbers.is_empty() {
            replaced[usize::from(pair[0]) % numbers.len()] = Some(EDGES[usize::from(pair[1]) % EDGES.len()]);
        }
    }
    let mut out = Vec::new();
    let mut cursor = 0;
    for ((start, end), replacement) in numbers.iter().zip(replaced) {
        if let Some(replacement) = replacement {
            out.extend_from_slice(&bytes[cursor..*start]);
            out.extend_from_slice(replacement.as_bytes());
            cursor = *end;
        }
    }
    out.extend_from_slice(&bytes[cursor..]);
    out
}

fuzz_target!(|data: &[u8]| {
    let bytes = match data.split_first() {
        Some((0xFF, program)) => mutate(program),
        _ => data.to_vec(),
    };
    let scenario = match scenario::parse_bytes(&bytes, "fuzz.yaml", "fuzz", None) {
        Ok(scenario) => scenario,
        Err(error) => {
            let text = error.to_string();
            assert!(text.starts_with("fuzz.yaml"), "an error that does not name the file: {text}");
            return;
        }
    };
    if let Ok(outcome) = harness::run_with(&scenario, &Budget::bytes(BUDGET), &Default::default()) {
        let _ = kvrelay::render::golden(&scenario, &outcome);
    }
});
