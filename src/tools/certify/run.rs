//! The case set and its runner: which cases a certification runs, in which order, and how each is judged.
//!
//! Order is fixed: the seam's contract cases, its error-path cases (out of bounds, protection, flush, misuse), every
//! scenario of the corpus through the engines (judged by the oracle per decode rank), then the throughput run.

#![allow(
    clippy::disallowed_methods,
    reason = "certification is an edge: it times each case and dates its report on the wall clock"
)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::conformance::{self, CaseError, ConformanceCase};
use super::report::{CaseResult, Host, Report, Verdict};
use super::throughput::{self, Throughput};
use super::Transport;
use crate::engine::live::LiveOptions;
use crate::harness::{self, Budget, RunError};
use crate::scenario::{self, Scenario};
use crate::shard::Shard;

/// The version of the case set: bumped whenever a case is added, removed or changes its claim, so two reports with
/// the same version and hash ran the same cases.
pub const CASE_SET_VERSION: &str = "kvrelay-certify-4";

/// A scenario registering more than this may be reported unsupported without failing the certification (the case
/// set allows it): a transport on a small host or guest need not hold a multi-gigabyte model shape.
pub const LARGE_SCENARIO_BYTES: u64 = 512 << 20;

/// The part of the case set a case belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    /// The transfer-engine seam's contract (`fabric::seam::TransferEngine`), on every transport.
    Seam,
    /// The verbs contract (`fabric::verbs::Endpoint`), on verbs-shaped transports: ordering, signalling, credits,
    /// notifications.
    Contract,
    /// Out-of-bounds and error paths: protection errors, flushes, misuse, peers not connected back.
    ErrorPath,
    /// A scenario of the corpus through the per-rank engines, judged byte for byte by the oracle.
    Scenario,
    /// Write bandwidth with every byte verified; the figure is reported, never judged.
    Throughput,
}

impl Group {
    pub fn name(self) -> &'static str {
        match self {
            Group::Seam => "seam",
            Group::Contract => "contract",
            Group::ErrorPath => "error-path",
            Group::Scenario => "scenario",
            Group::Throughput => "throughput",
        }
    }
}

/// What a case runs.
#[derive(Debug)]
enum Kind {
    Conformance(&'static ConformanceCase),
    Seam(&'static ConformanceCase),
    Scenario { file: PathBuf, scenario: Box<Scenario>, registered: u64 },
    Throughput,
}

/// One case of the set.
#[derive(Debug)]
pub struct Case {
    /// `group/name`, stable across runs (the `--case` of a reproduce command).
    pub id: String,
    pub group: Group,
    /// What passing shows, in one line.
    pub claim: String,
    kind: Kind,
}

/// The fixed, versioned case set: conformance cases compiled in, the scenarios of a corpus directory, the
/// throughput run; with the hash of all of it.
#[derive(Debug)]
pub struct CaseSet {
    pub cases: Vec<Case>,
    /// SHA-256 over the version, every case's id and claim, and every scenario file's bytes.
    pub hash: String,
}

/// Why a case set could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum CertifyError {
    #[error("{0}")]
    Scenario(#[from] scenario::ScenarioError),
    #[error("reading the scenario corpus {dir}: {error} (fix: run from the repository root or pass --scenarios DIR)")]
    Corpus { dir: String, error: std::io::Error },
    #[error("no scenario files under {0} (fix: pass the corpus directory with --scenarios DIR)")]
    EmptyCorpus(String),
    #[error(
        "no case `{0}` in the case set (fix: an id as listed by a full run, e.g. contract/..., scenario/basic/...)"
    )]
    UnknownCase(String),
}

impl CaseSet {
    /// The case set over the scenario corpus at `corpus` (every `*.yaml` below it, sorted).
    pub fn load(corpus: &Path) -> Result<CaseSet, CertifyError> {
        let mut cases: Vec<Case> = super::seam::cases()
            .iter()
            .map(|case| Case {
                id: format!("seam/{}", case.id),
                group: Group::Seam,
                claim: case.claim.to_owned(),
                kind: Kind::Seam(case),
            })
            .collect();
        cases.extend(conformance::cases().iter().map(conformance_case));
        let mut hasher = Sha256::new();
        hasher.update(CASE_SET_VERSION.as_bytes());
        let files = scenario_files(corpus)?;
        if files.is_empty() {
            return Err(CertifyError::EmptyCorpus(corpus.display().to_string()));
        }
        for file in files {
            let bytes = std::fs::read(&file)
                .map_err(|error| CertifyError::Corpus { dir: file.display().to_string(), error })?;
            hasher.update(Sha256::digest(&bytes));
            cases.push(scenario_case(corpus, file)?);
        }
        cases.push(Case {
            id: "throughput/write-bandwidth".to_owned(),
            group: Group::Throughput,
            claim: "writes stream between two endpoints at the transport's pace and every byte lands".to_owned(),
            kind: Kind::Throughput,
        });
        for case in &cases {
            hasher.update(format!("\n{}\t{}", case.id, case.claim).as_bytes());
        }
        let hash = hasher.finalize().iter().map(|byte| format!("{byte:02x}")).collect();
        Ok(CaseSet { cases, hash })
    }

    /// Checks that every id in `only` names a case.
    pub fn check_ids(&self, only: &[String]) -> Result<(), CertifyError> {
        match only.iter().find(|id| !self.cases.iter().any(|case| &case.id == *id)) {
            Some(id) => Err(CertifyError::UnknownCase(id.clone())),
            None => Ok(()),
        }
    }
}

fn conformance_case(case: &'static ConformanceCase) -> Case {
    let group = if case.group == conformance::Group::ErrorPath { Group::ErrorPath } else { Group::Contract };
    Case {
        id: format!("{}/{}", group.name(), case.id),
        group,
        claim: case.claim.to_owned(),
        kind: Kind::Conformance(case),
    }
}

fn scenario_case(corpus: &Path, file: PathBuf) -> Result<Case, CertifyError> {
    let scenario = scenario::load(&file)?;
    let relative = file.strip_prefix(corpus).unwrap_or(&file).with_extension("");
    let registered = harness::simulated_bytes(&scenario.problem).unwrap_or(u64::MAX);
    let claim = format!("{}: every decode byte lands where domain.md says, or the expected failure", scenario.name);
    let id = format!("scenario/{}", relative.display());
    Ok(Case {
        id,
        group: Group::Scenario,
        claim,
        kind: Kind::Scenario { file, scenario: Box::new(scenario), registered },
    })
}

/// Every `*.yaml`/`*.yml` file below `dir`, sorted; symbolic links are not followed.
fn scenario_files(dir: &Path) -> Result<Vec<PathBuf>, CertifyError> {
    let corpus_error = |error| CertifyError::Corpus { dir: dir.display().to_string(), error };
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).map_err(corpus_error)? {
            let entry = entry.map_err(corpus_error)?;
            let kind = entry.file_type().map_err(corpus_error)?;
            let path = entry.path();
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() && path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// How a certification runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Only these case ids (empty: all). A partial run is never a certification.
    pub only: Vec<String>,
    /// Only this shard of the set's cases (`kvrelay merge` joins the shards' reports into the whole).
    pub shard: Shard,
    /// Simulated memory a scenario case may register on this transport.
    pub budget: Budget,
    /// Deadlines of each scenario's engines on the real clock.
    pub live: LiveOptions,
    /// Bytes the throughput run moves, in messages of `message_bytes`.
    pub throughput_bytes: u64,
    pub message_bytes: u64,
    /// The command that reruns this certification; `--case ID` is appended for one case.
    pub reproduce: String,
    /// The `kvrelay run` flags that put one scenario on this transport (e.g. `--fabric plugin:PATH`), when the
    /// `kvrelay` binary can: a failed scenario case then says how to trace it.
    pub run_flags: Option<String>,
}

impl Options {
    /// Defaults: every case, scenario deadlines of 60 s, 64 MiB of throughput in 64 KiB messages.
    pub fn new(budget: Budget, reproduce: &str) -> Options {
        let live = LiveOptions::default();
        Options {
            only: Vec::new(),
            shard: Shard::ALL,
            budget,
            live,
            throughput_bytes: 64 << 20,
            message_bytes: 64 << 10,
            reproduce: reproduce.to_owned(),
            run_flags: None,
        }
    }
}

/// Runs `set` (or `options.only` of it) through `transport` and reports every case; `progress` sees each result as
/// it is decided. The library entry point of the certification kit: a Rust transport implements [`Transport`]
/// and calls this.
pub fn certify(
    transport: &mut dyn Transport,
    set: &CaseSet,
    options: &Options,
    progress: &mut dyn FnMut(&CaseResult),
) -> Report {
    let mut results = Vec::new();
    let mut measured = None;
    let mine = options.shard.pick(&set.cases);
    for case in mine.filter(|case| options.only.is_empty() || options.only.contains(&case.id)) {
        let start = Instant::now();
        let mut page = None;
        let (verdict, detail) = match &case.kind {
            Kind::Seam(case) => judge_conformance(transport, case),
            Kind::Conformance(_) | Kind::Throughput if !transport.verbs() => not_verbs(),
            Kind::Conformance(conformance) => judge_conformance(transport, conformance),
            Kind::Scenario { file, scenario, registered } => {
                let reproduce = reproduce_line(options, case);
                let (verdict, mut detail, drawn) =
                    judge_scenario(transport, scenario, *registered, options, &reproduce);
                page = drawn;
                if let (Verdict::Fail, Some(flags)) = (verdict, &options.run_flags) {
                    detail.push_str(&format!("\ntrace it: kvrelay run {} {flags} --trace", file.display()));
                }
                (verdict, detail)
            }
            Kind::Throughput => {
                let (verdict, detail, figure) = judge_throughput(transport, options);
                measured = figure;
                (verdict, detail)
            }
        };
        let result = CaseResult {
            id: case.id.clone(),
            group: case.group.name().to_owned(),
            claim: case.claim.clone(),
            verdict,
            detail,
            seconds: start.elapsed().as_secs_f64(),
            reproduce: reproduce_line(options, case),
            page,
        };
        progress(&result);
        results.push(result);
    }
    transport.reset();
    Report {
        kvrelay_version: env!("CARGO_PKG_VERSION").to_owned(),
        case_set_version: CASE_SET_VERSION.to_owned(),
        case_set_hash: set.hash.clone(),
        case_set_size: set.cases.len(),
        transport: transport.identity(),
        host: Host::this(),
        date: super::report::utc_now(),
        results,
        throughput: measured,
        shard: options.shard,
    }
}

/// A verbs case on a transport that meets only the transfer-engine seam: it does not apply.
fn not_verbs() -> (Verdict, String) {
    let why = "the transport meets the transfer-engine seam, not verbs: the verbs contract does not apply";
    (Verdict::Unsupported { allowed: true }, why.to_owned())
}

fn reproduce_line(options: &Options, case: &Case) -> String {
    format!("{} --case {}", options.reproduce, case.id)
}

fn judge_conformance(transport: &mut dyn Transport, case: &ConformanceCase) -> (Verdict, String) {
    transport.reset();
    match (case.run)(transport) {
        Ok(()) => (Verdict::Pass, String::new()),
        Err(CaseError::Failed(why)) => (Verdict::Fail, why),
        // The case set allows no unsupported contract case: every one is what the engines rely on.
        Err(CaseError::Unsupported(why)) => (Verdict::Unsupported { allowed: false }, why),
    }
}

fn judge_scenario(
    transport: &mut dyn Transport,
    scenario: &Scenario,
    registered: u64,
    options: &Options,
    reproduce: &str,
) -> (Verdict, String, Option<String>) {
    transport.reset();
    let fabric = transport.identity().name;
    let outcome =
        harness::Run::new(scenario, &options.budget).live_options(&options.live).on_transport(transport).execute();
    let draw = |outcome: &mut harness::Outcome| {
        // Device memory is read back for the picture only; the verdict was given where it lives.
        let _ = outcome.observation.materialise();
        let context = crate::report::PageContext { reproduce, mutant: None, fabric: &fabric };
        Some(crate::report::page(scenario, outcome, &context))
    };
    match outcome {
        Ok(mut outcome) if outcome.passed() => (Verdict::Pass, String::new(), draw(&mut outcome)),
        Ok(mut outcome) => {
            let mut detail = outcome.failure_text("; ");
            for violation in outcome.violations.iter().take(5) {
                detail.push_str(&format!("\n{violation}"));
            }
            (Verdict::Fail, detail, draw(&mut outcome))
        }
        Err(error @ RunError::OverBudget { .. }) => {
            let allowed = registered > LARGE_SCENARIO_BYTES;
            let why = format!("memory: {error}");
            (Verdict::Unsupported { allowed }, why, None)
        }
        Err(error) => (Verdict::Fail, error.to_string(), None),
    }
}

fn judge_throughput(transport: &mut dyn Transport, options: &Options) -> (Verdict, String, Option<Throughput>) {
    transport.reset();
    match throughput::measure(transport, options.throughput_bytes, options.message_bytes) {
        Ok(figure) => (Verdict::Pass, figure.to_string(), Some(figure)),
        Err(CaseError::Failed(why)) => (Verdict::Fail, why, None),
        Err(CaseError::Unsupported(why)) => (Verdict::Unsupported { allowed: false }, why, None),
    }
}
