//! `--json` results of `check` (and `sim`, `sim.rs`), and `kvrelay merge`: the shards of one sharded run
//! (`--shard K/N`, every shard once) combined into the report the unsharded command prints.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::{Deserialize, Serialize};

use crate::harness;
use crate::shard::Shard;

/// `check --json`'s format.
pub(super) const CHECK_FORMAT: &str = "kvrelay-check-1";

/// How one scenario of `check` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub(super) enum CaseResult {
    Pass,
    Fail,
    Skip,
}

/// One scenario of `check`: its name (relative to the directory checked), result, problems (a failure's reasons, a
/// skip's why) and the reproduce line of a failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub(super) struct CheckCase {
    pub(super) scenario: String,
    pub(super) result: CaseResult,
    pub(super) problems: Vec<String>,
    pub(super) reproduce: Option<String>,
}

impl CheckCase {
    pub(super) fn new(result: CaseResult, problems: Vec<String>, reproduce: Option<String>) -> CheckCase {
        CheckCase { scenario: String::new(), result, problems, reproduce }
    }
}

/// A `check` (or one shard of it) as `--json` writes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub(super) struct CheckResult {
    format: String,
    dir: String,
    fabric: String,
    shard: Shard,
    /// Every scenario of the run, sharded or not, in order.
    scenarios: Vec<String>,
    /// The scenarios this shard checked.
    cases: Vec<CheckCase>,
}

impl CheckResult {
    pub(super) fn new(
        dir: &Path,
        fabric: &harness::Fabric,
        shard: Shard,
        scenarios: Vec<String>,
        cases: Vec<CheckCase>,
    ) -> CheckResult {
        let (dir, fabric) = (dir.display().to_string(), fabric.name());
        CheckResult { format: CHECK_FORMAT.to_owned(), dir, fabric, shard, scenarios, cases }
    }

    pub(super) fn failed(&self) -> usize {
        self.cases.iter().filter(|case| case.result == CaseResult::Fail).count()
    }

    /// The closing line: scenarios checked, passed, failed (skipped).
    pub(super) fn summary(&self) -> anyhow::Result<()> {
        let count = |result| self.cases.iter().filter(|case| case.result == result).count();
        let (passed, failed, skipped) = (count(CaseResult::Pass), count(CaseResult::Fail), count(CaseResult::Skip));
        match skipped {
            0 => outln!("{} scenarios, {passed} passed, {failed} failed", self.cases.len()),
            _ => outln!("{} scenarios, {passed} passed, {failed} failed, {skipped} skipped", self.cases.len()),
        }
        Ok(())
    }
}

/// `kvrelay merge FILE...`: the files' format (`check --json` or `sim --json`) picks the merge.
pub(super) fn merge(files: &[PathBuf], json: Option<&Path>) -> anyhow::Result<ExitCode> {
    let mut formats = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file).map_err(|error| anyhow::anyhow!("{}: {error}", file.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|error| {
            anyhow::anyhow!("{}: not JSON ({error}) (fix: pass the files --json wrote)", file.display())
        })?;
        let format = value.get("format").and_then(serde_json::Value::as_str).unwrap_or("none").to_owned();
        formats.push((file, format, text));
    }
    let Some((first, format, _)) = formats.first() else { anyhow::bail!("kvrelay merge needs the shards' files") };
    if let Some((file, other, _)) = formats.iter().find(|(_, other, _)| other != format) {
        anyhow::bail!(
            "{} is {format} but {} is {other} (fix: merge the shards of one command)",
            first.display(),
            file.display()
        );
    }
    let texts: Vec<(&PathBuf, &str)> = formats.iter().map(|(file, _, text)| (*file, text.as_str())).collect();
    match format.as_str() {
        CHECK_FORMAT => merge_check(parse(&texts, CHECK_FORMAT)?, json),
        super::sim::FORMAT => super::sim::merge(parse(&texts, super::sim::FORMAT)?, json),
        super::matrix::FORMAT => super::matrix::merge(parse(&texts, super::matrix::FORMAT)?, json),
        super::selftest::FORMAT => super::selftest::merge(parse(&texts, super::selftest::FORMAT)?, json),
        crate::certify::REPORT_FORMAT => super::certify::merge(&texts, json),
        other => anyhow::bail!(
            "{}: format {other} (this kvrelay merges {CHECK_FORMAT}, {}, {}, {} and {}; fix: merge files written by \
             the `--json` of `check`, `sim`, `matrix`, `selftest` or `certify` of the same kvrelay)",
            first.display(),
            super::sim::FORMAT,
            super::matrix::FORMAT,
            super::selftest::FORMAT,
            crate::certify::REPORT_FORMAT
        ),
    }
}

/// Every file's `texts` as a `T` of format `format`.
fn parse<T: serde::de::DeserializeOwned>(
    texts: &[(&PathBuf, &str)],
    format: &str,
) -> anyhow::Result<Vec<(PathBuf, T)>> {
    texts
        .iter()
        .map(|(file, text)| {
            let result = serde_json::from_str(text)
                .map_err(|error| anyhow::anyhow!("{}: a malformed {format} file ({error})", file.display()))?;
            Ok(((*file).clone(), result))
        })
        .collect()
}

/// The shards of one `check`: every scenario's line in the run's order, then the unsharded summary.
fn merge_check(results: Vec<(PathBuf, CheckResult)>, json: Option<&Path>) -> anyhow::Result<ExitCode> {
    let shards = super::one_run(
        &results,
        |result| (result.dir.clone(), result.fabric.clone(), result.scenarios.clone()),
        |result| result.shard,
        "directory, fabric or scenarios",
    )?;
    let first = &results[0].1;
    let mut merged = CheckResult { shard: Shard::ALL, cases: Vec::new(), ..first.clone() };
    merged.cases = results.into_iter().flat_map(|(_, result)| result.cases).collect();
    let position = |name: &str| merged.scenarios.iter().position(|known| known == name).unwrap_or(usize::MAX);
    let mut cases = std::mem::take(&mut merged.cases);
    cases.sort_by_key(|case| position(&case.scenario));
    merged.cases = cases;
    outln!("merge: {} shards of check {} on {}", shards.len(), merged.dir, merged.fabric);
    for case in &merged.cases {
        match case.result {
            CaseResult::Pass => outln!("pass {}", case.scenario),
            CaseResult::Skip => outln!("skip {}: {}", case.scenario, case.problems.join("; ")),
            CaseResult::Fail => {
                outln!("FAIL {}: {}", case.scenario, case.problems.join("; "));
                if let Some(line) = &case.reproduce {
                    outln!("{line}");
                }
            }
        }
    }
    merged.summary()?;
    if let Some(path) = json {
        super::write_json(path, &merged)?;
    }
    Ok(if merged.failed() == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
