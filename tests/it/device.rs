//! Decode memory judged where it lives (the oracle's resident path, `verify/resident.rs`) and the `cuda` fabric.
//!
//! The resident path is tested on every machine with a judge over host bytes: it must give exactly the dense
//! oracle's violations, coordinates included, however the wrong bytes lie. The tests that need a GPU (feature
//! `cuda`) say `skipped: ...` on stderr and return where no GPU answers: CI has none; `ci/gpu.sh` runs them on one.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use kvrelay::fabric::seam::{self, Compare as _};
use kvrelay::harness::{self, Budget, Fabric};
use kvrelay::scenario::{self, Scenario};
use kvrelay::verify::{self, pattern, Expect, Judge, Observation, Query, RegionKey, ResidentRegion, RowRun};

/// One line on stderr (a skip said, never silent).
fn say(line: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{line}\n").as_bytes());
}

/// A corpus scenario: under `scenarios/` of the working directory where there is one (a test binary carried to
/// a GPU machine runs from the repository's copy there), else of the checkout it was built in.
fn corpus(file: &str) -> Scenario {
    let root = if Path::new("scenarios").is_dir() { Path::new(".") } else { Path::new(env!("CARGO_MANIFEST_DIR")) };
    let path = root.join("scenarios").join(file);
    scenario::load(&path).unwrap_or_else(|error| panic!("{error}"))
}

/// A judge over host copies of the regions, answering as the device compare does (`pattern`'s matchers); counts
/// the queries it was asked.
#[derive(Default)]
struct HostJudge {
    regions: Mutex<BTreeMap<u64, Vec<u8>>>,
    asked: Mutex<usize>,
    calls: Mutex<usize>,
    reads: Mutex<usize>,
}

impl Judge for HostJudge {
    fn judge(&self, queries: &[(u64, Query)], tables: &[&[RowRun]]) -> Result<Vec<bool>, String> {
        *self.asked.lock().unwrap() += queries.len();
        *self.calls.lock().unwrap() += 1;
        let regions = self.regions.lock().unwrap();
        Ok(queries
            .iter()
            .map(|(handle, query)| {
                let region = &regions[handle];
                let bytes = &region[query.start as usize..query.end as usize];
                match query.expect {
                    Expect::Source { number, offset } => pattern::matches_source(number, offset, bytes),
                    Expect::Strided { number, offset, block, stride } => bytes
                        .chunks(block as usize)
                        .zip(0u64..)
                        .all(|(block, k)| pattern::matches_source(number, offset + k * stride, block)),
                    Expect::Sentinel => pattern::matches_sentinel(query.start, bytes),
                    Expect::Rows { table, number, row, source_row } => {
                        tables[table as usize].iter().flat_map(|run| run.each()).all(|(target, source)| {
                            pattern::matches_source(number, source * source_row, rows(region, target, row))
                        })
                    }
                    Expect::SentinelRows { table, row } => tables[table as usize]
                        .iter()
                        .flat_map(|run| run.each())
                        .all(|(target, _)| pattern::matches_sentinel(target * row, rows(region, target, row))),
                }
            })
            .collect())
    }

    fn read(&self, handle: u64, start: u64, out: &mut [u8]) -> Result<(), String> {
        *self.reads.lock().unwrap() += 1;
        let regions = self.regions.lock().unwrap();
        out.copy_from_slice(&regions[&handle][start as usize..start as usize + out.len()]);
        Ok(())
    }

    fn name(&self) -> String {
        "host judge".to_owned()
    }
}

/// Row `at` of `row`-byte rows of `region`.
fn rows(region: &[u8], at: u64, row: u64) -> &[u8] {
    &region[(at * row) as usize..((at + 1) * row) as usize]
}

/// `observation` with every decode image moved behind one [`HostJudge`].
fn resident(observation: &Observation) -> (Observation, Arc<HostJudge>) {
    let judge = Arc::new(HostJudge::default());
    let mut moved = Observation { writes: observation.writes.clone(), ..Observation::default() };
    for (index, (key, bytes)) in observation.images.iter().enumerate() {
        let handle = (index as u64 + 1) << 32;
        judge.regions.lock().unwrap().insert(handle, bytes.clone());
        let region = ResidentRegion { judge: judge.clone(), handle, len: bytes.len() as u64, keep: Arc::new(()) };
        moved.resident.insert(*key, region);
    }
    (moved, judge)
}

/// The DCP relayout scenario run on the in-memory fabric with dense images.
fn dense_run(file: &str) -> (Scenario, Observation) {
    let scenario = corpus(file);
    let outcome = harness::run_on(&scenario, &Budget::bytes(1 << 30), &Fabric::LiveSim, false).expect("runs");
    assert!(outcome.passed(), "{}", outcome.failure_text("; "));
    (scenario, outcome.observation)
}

#[test]
fn a_clean_resident_observation_passes_in_one_round_of_queries() {
    let (scenario, observation) = dense_run("engines/dcp-relayout-two-stages.yaml");
    let (moved, judge) = resident(&observation);
    assert!(verify::check(&scenario.problem, &moved).is_empty());
    let asked = *judge.asked.lock().unwrap();
    assert!(asked > 0, "the resident path asked nothing");
    // Runs of token rows are asked whole: fewer questions than the decode rows written.
    let written_rows: u64 = observation
        .writes
        .iter()
        .map(|write| {
            let region = &scenario.problem.decode.rank(write.target.rank).regions[write.target.region as usize];
            write.length / region.row_len()
        })
        .sum();
    assert!((asked as u64) < written_rows, "{asked} questions for {written_rows} rows: runs were asked row by row");
    // Latent KV regions are asked whole: one question per request and one for the rows between, per region.
    let problem = &scenario.problem;
    let regions: usize = problem.decode.ranks.iter().map(|rank| rank.regions.len()).sum();
    let whole = regions * (problem.requests.len() + 1);
    assert!(asked <= whole, "{asked} questions for {regions} regions of {} requests", problem.requests.len());
    // One round per decode rank (every piece and gap asked in one call), nothing read back.
    assert_eq!(*judge.calls.lock().unwrap(), scenario.problem.decode.ranks.len());
    assert_eq!(*judge.reads.lock().unwrap(), 0, "clean memory was read back");
}

#[test]
fn wrong_bytes_in_resident_memory_read_as_the_dense_oracle_reads_them() {
    let (scenario, observation) = dense_run("engines/dcp-relayout-two-stages.yaml");
    let keys: Vec<RegionKey> = observation.images.keys().copied().collect();
    // A flipped byte inside a written row, a written row shifted by 8 bytes, and a byte of never-written memory.
    let mut planted = observation.clone();
    let (first, last) = (observation.writes[0], observation.writes[observation.writes.len() - 1]);
    planted.images.get_mut(&first.target).unwrap()[first.offset as usize + 1] ^= 0xFF;
    let (start, end) = (last.offset as usize, (last.offset + last.length) as usize);
    planted.images.get_mut(&last.target).unwrap().copy_within(start..end - 8, start + 8);
    let unwritten = keys.iter().find_map(|key| {
        let len = observation.images[key].len() as u64;
        let written = |at: u64| {
            observation.writes.iter().any(|w| w.target == *key && (w.offset..w.offset + w.length).contains(&at))
        };
        (0..len).rev().step_by(4096).find(|at| !written(*at)).map(|at| (*key, at))
    });
    let (key, at) = unwritten.expect("some decode memory is never written");
    planted.images.get_mut(&key).unwrap()[at as usize] = 0;
    let dense = verify::check(&scenario.problem, &planted);
    assert!(dense.len() >= 3, "the planted bytes were not all found: {dense:?}");
    let (moved, _) = resident(&planted);
    let on_judge = verify::check(&scenario.problem, &moved);
    assert_eq!(on_judge, dense, "the resident path reads other coordinates than the dense oracle");
    for key in &keys {
        let cross = verify::cross_check_region(&scenario.problem, &moved, *key, &verify::Verdicts::all_succeeded());
        assert_eq!(cross, None, "device and read-back verdicts differ on {key:?}");
    }
}

#[test]
fn a_judge_that_fails_is_a_violation_never_a_pass() {
    struct Broken;
    impl Judge for Broken {
        fn judge(&self, _: &[(u64, Query)], _: &[&[RowRun]]) -> Result<Vec<bool>, String> {
            Err("the device is gone".to_owned())
        }
        fn read(&self, _: u64, _: u64, _: &mut [u8]) -> Result<(), String> {
            Err("the device is gone".to_owned())
        }
        fn name(&self) -> String {
            "broken".to_owned()
        }
    }
    let (scenario, observation) = dense_run("engines/dcp-relayout-two-stages.yaml");
    let mut moved = Observation { writes: observation.writes.clone(), ..Observation::default() };
    for (key, bytes) in &observation.images {
        let region = ResidentRegion { judge: Arc::new(Broken), handle: 1, len: bytes.len() as u64, keep: Arc::new(()) };
        moved.resident.insert(*key, region);
    }
    let violations = verify::check(&scenario.problem, &moved);
    assert!(!violations.is_empty());
    assert!(violations
        .iter()
        .all(|violation| violation.to_string().contains("could not be judged: the device is gone")));
}

/// A GPU fabric where it cannot run (no GPU, no NIXL, or a build without the feature) fails the run with a fix
/// named, never a harness error or a crash; where it can, the scenario passes and the test says it skipped.
#[rstest::rstest]
#[case::cuda(Fabric::Cuda, &["cuda", "CUDA", "GPU"])]
#[case::nixl_on_vram(Fabric::NixlCuda, &["NIXL", "nixl", "GPU", "CUDA"])]
fn a_gpu_fabric_is_a_clear_error_where_it_cannot_run(#[case] fabric: Fabric, #[case] words: &[&str]) {
    let scenario = corpus("engines/dcp-relayout-two-stages.yaml");
    let outcome = harness::run_on(&scenario, &Budget::bytes(1 << 30), &fabric, false);
    match outcome {
        Ok(outcome) if outcome.passed() => {
            say(&format!("skipped: {} ran here, and the scenario passed", fabric.name()))
        }
        Ok(outcome) => {
            let text = outcome.failure_text("; ");
            assert!(text.contains("fix:"), "no fix named: {text}");
            assert!(words.iter().any(|word| text.contains(word)), "{text}");
        }
        Err(error) => panic!("a missing GPU or engine is a failed run, not a harness error: {error}"),
    }
}

/// Kept memory over host bytes that answers plain checks only: [`Compare::compare_with_rows`]'s own expansion of
/// tables into plain checks answers for it.
struct PlainCompare(Vec<u8>);

impl seam::Compare for PlainCompare {
    fn compare(&self, checks: &[seam::Check]) -> Result<Vec<bool>, String> {
        checks
            .iter()
            .map(|check| {
                let bytes = self.0.get(check.start as usize..(check.start + check.len) as usize).ok_or("outside")?;
                Ok(bytes.chunks(check.block as usize).zip(0u64..).all(|(block, k)| match check.pattern {
                    seam::Pattern::Source { number } => {
                        pattern::matches_source(number, check.pattern_offset + k * check.pattern_stride, block)
                    }
                    seam::Pattern::Sentinel => pattern::matches_sentinel(0, block),
                }))
            })
            .collect()
    }
    fn read(&self, _: u64, _: u64, _: &mut [u8]) -> Result<(), String> {
        Err("not read".to_owned())
    }
    fn name(&self) -> String {
        "plain".to_owned()
    }
}

#[test]
fn a_table_of_runs_is_answered_run_by_run_where_memory_walks_no_tables() {
    // Rows of 16 bytes: rows 0..4 hold source 3's rows 8, 10, 12, 14; rows 4..6 are sentinel.
    let row = 16u64;
    let mut bytes = vec![0u8; 6 * row as usize];
    for k in 0..4u64 {
        pattern::fill_source_at(3, (8 + 2 * k) * row, &mut bytes[(k * row) as usize..((k + 1) * row) as usize]);
    }
    pattern::fill_sentinel_at(4 * row, &mut bytes[4 * row as usize..]);
    let data = [seam::RowRun { target: 0, source: 8, count: 4, step: 2 }];
    let gaps = [seam::RowRun { target: 4, source: 0, count: 2, step: 0 }];
    let source = seam::Pattern::Source { number: 3 };
    let rows = [
        seam::RowsCheck { handle: 0, table: 0, row, pattern: source, pattern_row: row },
        seam::RowsCheck { handle: 0, table: 1, row, pattern: seam::Pattern::Sentinel, pattern_row: 0 },
        seam::RowsCheck { handle: 0, table: 1, row, pattern: source, pattern_row: row },
    ];
    let plain = [seam::Check {
        handle: 0,
        start: 0,
        len: row,
        block: row,
        pattern: source,
        pattern_offset: 8 * row,
        pattern_stride: row,
    }];
    let tables: [&[seam::RowRun]; 2] = [&data, &gaps];
    let memory = PlainCompare(bytes.clone());
    assert_eq!(memory.compare_with_rows(&plain, &tables, &rows), Ok(vec![true, true, true, false]));
    // One wrong byte in the third row: the data table's answer is no, the gaps' still yes.
    bytes[2 * row as usize + 5] ^= 1;
    let memory = PlainCompare(bytes);
    assert_eq!(memory.compare_with_rows(&plain, &tables, &rows), Ok(vec![true, false, true, false]));
    // A table that does not exist is an error, never an answer.
    let missing = [seam::RowsCheck { table: 2, ..rows[0] }];
    assert!(memory.compare_with_rows(&[], &tables, &missing).is_err());
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use kvrelay::fabric::cuda::{self, CudaTransport};

    /// The GPU, or why there is none (the caller skips, saying so).
    fn gpu() -> Option<CudaTransport> {
        match CudaTransport::new() {
            Ok(transport) => Some(transport),
            Err(error) => {
                say(&format!("skipped: no GPU here ({error})"));
                None
            }
        }
    }

    /// Runs the DCP relayout scenario on `fabric`, plants a wrong byte in its first decode region on the device,
    /// and checks the device oracle's verdict: one violation, on that rank's row 0, identical to the host oracle's
    /// over the same memory read back.
    fn planted_byte_is_caught_with_the_host_oracles_coordinates(fabric: &Fabric) {
        let scenario = corpus("engines/dcp-relayout-two-stages.yaml");
        let outcome = harness::run_on(&scenario, &Budget::bytes(1 << 30), fabric, false).expect("runs");
        assert!(outcome.passed(), "{}", outcome.failure_text("; "));
        let observation = outcome.observation;
        assert!(observation.images.is_empty(), "decode memory came back to the host");
        let (key, region) = observation.resident.iter().next().expect("decode memory stayed on the GPU");
        cuda::plant(&*region.keep, 7, 0xA5).expect("planted");
        let run = outcome.engine.as_ref().expect("ran");
        let on_device = harness::oracle(&scenario, run, &observation);
        let mut read_back = observation.clone();
        read_back.materialise().expect("read back");
        let on_host = harness::oracle(&scenario, run, &read_back);
        assert_eq!(on_device.len(), 1, "{on_device:?}");
        assert_eq!(on_device, on_host, "device and host oracles disagree");
        assert_eq!(on_device[0].rank, key.rank);
        assert!(on_device[0].to_string().contains("row 0"), "{}", on_device[0]);
    }

    #[test]
    fn a_planted_wrong_byte_in_device_memory_is_caught_with_the_host_oracles_coordinates() {
        let Some(_gpu) = gpu() else { return };
        planted_byte_is_caught_with_the_host_oracles_coordinates(&Fabric::Cuda);
    }

    #[test]
    fn the_corpus_runs_identically_on_the_gpu_and_the_in_memory_fabric() {
        let Some(_gpu) = gpu() else { return };
        for file in [
            "engines/dcp-relayout-two-stages.yaml",
            "basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml",
            "mha/llama-3-8b-tp8-to-tp2.yaml",
        ] {
            let report = harness::diff(&corpus(file), &Budget::bytes(4 << 30), &Fabric::Cuda).expect("runs");
            assert!(report.other.passed(), "{file}: {}", report.other.failure_text("; "));
            assert!(report.differences.is_empty(), "{file}: {:?}", &report.differences[..1]);
        }
    }

    /// The `cuda` fabric takes strided entries (one per run of a DCP relayout, TP head slices, state slices) and
    /// its strided kernel lands them byte-exact: the plan's descriptors executed straight through its engines, the
    /// decode memory judged on the device, no violation; and the engines declare strided entries.
    #[test]
    fn strided_entries_run_on_the_gpu_byte_exact() {
        use kvrelay::engine::direct::Direct;
        use kvrelay::fabric::seam::{NodeId, TransferEngine as _};
        let Some(transport) = gpu() else { return };
        for file in [
            "basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml",
            "mha/llama-3-70b-tp4-to-tp8.yaml",
            "state/qwen3-next-tp1-to-tp4.yaml",
        ] {
            let scenario = corpus(file);
            let problem = &scenario.problem;
            let descriptors = kvrelay::plan::plan(problem).expect("plans").descriptors();
            assert!(descriptors.iter().any(|descriptor| descriptor.count > 1), "{file}: nothing strided");
            let mut direct = Direct::prepare(problem, &descriptors, |node| {
                let engine = transport.cuda_engine(NodeId(node as u32));
                assert!(engine.limits().strided, "the cuda fabric declares strided entries");
                Ok(engine)
            })
            .expect("prepared");
            direct.execute_parallel(std::time::Duration::from_secs(10)).expect("every batch completes");
            let observation = direct.observe().expect("observed");
            assert!(observation.images.is_empty(), "{file}: decode memory came back to the host");
            let ranks: Vec<_> = problem
                .decode
                .ranks
                .iter()
                .map(|layout| (layout.rank, kvrelay::verify::Verdicts::all_succeeded()))
                .collect();
            let violations = harness::check_ranks(problem, &observation, &ranks);
            assert!(violations.is_empty(), "{file}: {}", violations[0]);
        }
    }

    /// NIXL on VRAM (features `nixl` and `cuda`): the GPU and the nixl-cu13 libraries, or why not (the caller
    /// skips, saying so).
    #[cfg(feature = "nixl")]
    fn nixl_on_gpu() -> Option<CudaTransport> {
        let gpu = gpu()?;
        match kvrelay::fabric::nixl::NixlTransport::on_gpu() {
            Ok(_) => Some(gpu),
            Err(error) => {
                say(&format!("skipped: no NIXL for GPU memory here ({error})"));
                None
            }
        }
    }

    #[cfg(feature = "nixl")]
    #[test]
    fn nixl_on_vram_lands_every_byte_and_a_planted_wrong_byte_is_caught_on_the_device() {
        let Some(_gpu) = nixl_on_gpu() else { return };
        planted_byte_is_caught_with_the_host_oracles_coordinates(&Fabric::NixlCuda);
    }
}
