//! A certification's results as files: JUnit XML (for any CI system), a JSON report, and a manifest (the facts a
//! reader needs to trust or reproduce the run, one per line).

#![allow(clippy::disallowed_methods, reason = "a report is dated: the one wall-clock read of a certification")]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::render::markup_escape as escape;
use crate::shard::Shard;

use super::{Identity, Throughput};

/// How a case ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    /// The transport lacks a capability the case needs; `allowed` when the case set lets a certification pass
    /// without it (never silently: it is listed as such in every file).
    Unsupported {
        allowed: bool,
    },
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Unsupported { allowed: true } => "unsupported (allowed)",
            Verdict::Unsupported { allowed: false } => "unsupported (not allowed)",
        }
    }

    /// Whether this verdict keeps a certification valid.
    pub fn acceptable(self) -> bool {
        matches!(self, Verdict::Pass | Verdict::Unsupported { allowed: true })
    }
}

/// One case's result.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseResult {
    pub id: String,
    pub group: String,
    pub claim: String,
    pub verdict: Verdict,
    /// Why it failed or is unsupported, or what it measured; empty for a plain pass.
    pub detail: String,
    pub seconds: f64,
    /// One line that reruns this case alone.
    pub reproduce: String,
    /// A scenario case's HTML page (`kvrelay report`'s), written to [`CaseResult::page_path`] beside junit.xml.
    pub page: Option<String>,
}

impl CaseResult {
    /// Where [`Report::write`] puts this case's page, relative to junit.xml: `pages/<id>.html`.
    pub fn page_path(&self) -> Option<String> {
        self.page.as_ref().map(|_| format!("pages/{}.html", crate::report::file_stem(&self.id)))
    }
}

/// The machine the certification ran on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Host {
    pub hostname: String,
    pub kernel: String,
    pub cpus: usize,
    pub arch: String,
}

impl Host {
    /// This machine, from /proc (fields that cannot be read stay empty).
    pub fn this() -> Host {
        let read = |path: &str| std::fs::read_to_string(path).map(|text| text.trim().to_owned()).unwrap_or_default();
        Host {
            hostname: read("/proc/sys/kernel/hostname"),
            kernel: read("/proc/sys/kernel/osrelease"),
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            arch: std::env::consts::ARCH.to_owned(),
        }
    }
}

/// Everything a certification found.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub kvrelay_version: String,
    pub case_set_version: String,
    pub case_set_hash: String,
    /// Cases in the whole set (a run of fewer is partial).
    pub case_set_size: usize,
    pub transport: Identity,
    pub host: Host,
    /// UTC, RFC 3339.
    pub date: String,
    pub results: Vec<CaseResult>,
    pub throughput: Option<Throughput>,
    /// The shard of the set this run took (`Shard::ALL`: every case asked for).
    pub shard: Shard,
}

/// The paths [`Report::write`] wrote.
#[derive(Debug, Clone)]
pub struct Written {
    pub junit: PathBuf,
    pub json: PathBuf,
    pub manifest: PathBuf,
}

impl Report {
    /// Whether every case of the set ran.
    pub fn complete(&self) -> bool {
        self.results.len() == self.case_set_size
    }

    /// Certified: the whole set ran, and every case passed or is unsupported in a way the set allows.
    pub fn certified(&self) -> bool {
        self.complete() && self.results.iter().all(|result| result.verdict.acceptable())
    }

    /// Cases with `verdict`.
    pub fn count(&self, verdict: Verdict) -> usize {
        self.results.iter().filter(|result| result.verdict == verdict).count()
    }

    /// One line: the verdict and the counts.
    pub fn summary(&self) -> String {
        let verdict = match (self.certified(), self.complete()) {
            (true, _) => "CERTIFIED",
            (false, true) => "NOT CERTIFIED",
            (false, false) => "NOT CERTIFIED (partial run)",
        };
        format!(
            "{verdict}: {} on {}: {} cases run of {}: {} passed, {} failed, {} unsupported (allowed), {} unsupported \
             (not allowed); case set {} {}",
            self.transport.name,
            self.host.hostname,
            self.results.len(),
            self.case_set_size,
            self.count(Verdict::Pass),
            self.count(Verdict::Fail),
            self.count(Verdict::Unsupported { allowed: true }),
            self.count(Verdict::Unsupported { allowed: false }),
            self.case_set_version,
            &self.case_set_hash[..self.case_set_hash.len().min(16)],
        )
    }

    /// Writes `junit.xml`, `report.json` and `manifest.txt` into `dir` (created if missing).
    pub fn write(&self, dir: &Path) -> std::io::Result<Written> {
        std::fs::create_dir_all(dir)?;
        let written =
            Written { junit: dir.join("junit.xml"), json: dir.join("report.json"), manifest: dir.join("manifest.txt") };
        std::fs::write(&written.junit, self.junit())?;
        std::fs::write(&written.json, self.json())?;
        std::fs::write(&written.manifest, self.manifest())?;
        let mut entries = Vec::new();
        for result in &self.results {
            let (Some(page), Some(path)) = (&result.page, result.page_path()) else { continue };
            std::fs::create_dir_all(dir.join("pages"))?;
            std::fs::write(dir.join(&path), page)?;
            entries.push(crate::report::IndexEntry {
                scenario: result.id.clone(),
                href: path.trim_start_matches("pages/").to_owned(),
                passed: result.verdict == Verdict::Pass,
                violations: None,
                failure: result.detail.lines().next().unwrap_or_default().to_owned(),
            });
        }
        if !entries.is_empty() {
            let title = format!("kvrelay certify: {}", self.transport.name);
            std::fs::write(dir.join("pages/index.html"), crate::report::index(&title, &entries))?;
        }
        Ok(written)
    }

    /// The manifest: one `key: value` fact per line, then one line per case (verdict, seconds, id, reproduce).
    pub fn manifest(&self) -> String {
        let mut text = String::new();
        let mut fact = |key: &str, value: &str| {
            let _ = writeln!(text, "{key}: {}", one_line(value));
        };
        fact("verdict", &self.summary());
        fact("kvrelay-version", &self.kvrelay_version);
        fact("case-set-version", &self.case_set_version);
        fact("case-set-hash", &self.case_set_hash);
        fact("transport", &self.transport.name);
        fact("transport-version", &self.transport.version);
        for (key, value) in &self.transport.facts {
            fact(&format!("transport-fact.{key}"), value);
        }
        fact("host", &self.host.hostname);
        fact("kernel", &self.host.kernel);
        fact("cpus", &self.host.cpus.to_string());
        fact("arch", &self.host.arch);
        fact("date", &self.date);
        if let Some(throughput) = &self.throughput {
            fact("throughput", &throughput.to_string());
        }
        for result in &self.results {
            let verdict = result.verdict.name().replace(' ', "-");
            let _ = writeln!(text, "case: {verdict} {:.3}s {} | {}", result.seconds, result.id, result.reproduce);
        }
        text
    }

    /// The JSON report (schema: `report.schema` in src/tools/certify/README.md).
    pub fn json(&self) -> String {
        let cases: Vec<JsonCase<'_>> = self.results.iter().map(JsonCase::from).collect();
        let throughput = self.throughput.map(|figure| JsonThroughput {
            bytes: figure.bytes,
            message_bytes: figure.message_bytes,
            work_requests: figure.work_requests,
            seconds: figure.seconds,
            mib_per_second: figure.mib_per_second(),
            work_requests_per_second: figure.work_requests_per_second(),
        });
        let report = JsonReport {
            format: FORMAT,
            certified: self.certified(),
            complete: self.complete(),
            summary: self.summary(),
            kvrelay_version: &self.kvrelay_version,
            case_set: JsonCaseSet {
                version: &self.case_set_version,
                hash: &self.case_set_hash,
                size: self.case_set_size,
            },
            transport: JsonTransport {
                name: &self.transport.name,
                version: &self.transport.version,
                facts: &self.transport.facts,
            },
            host: &self.host,
            date: &self.date,
            throughput,
            shard: self.shard,
            cases,
        };
        let mut text = serde_json::to_string_pretty(&report).expect("a report of strings and numbers serialises");
        text.push('\n');
        text
    }

    /// JUnit XML: one `<testsuite>` per group, one `<testcase>` per case; an allowed unsupported case is
    /// `<skipped>` with its reason, a failure or a disallowed unsupported case is `<failure>`.
    pub fn junit(&self) -> String {
        let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let failures = self.results.iter().filter(|result| !result.verdict.acceptable()).count();
        let seconds: f64 = self.results.iter().map(|result| result.seconds).sum();
        let _ = writeln!(
            xml,
            "<testsuites name=\"kvrelay certify {}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" time=\"{seconds:.3}\" timestamp=\"{}\">",
            escape(&self.transport.name),
            self.results.len(),
            escape(&self.date)
        );
        // Every group once, in the order its first case ran (cases of one group need not be adjacent).
        let mut groups: Vec<&str> = Vec::new();
        for result in &self.results {
            if !groups.contains(&result.group.as_str()) {
                groups.push(&result.group);
            }
        }
        for group in groups {
            self.junit_suite(&mut xml, group);
        }
        xml.push_str("</testsuites>\n");
        xml
    }

    fn junit_suite(&self, xml: &mut String, group: &str) {
        let cases: Vec<&CaseResult> = self.results.iter().filter(|result| result.group == group).collect();
        let failures = cases.iter().filter(|result| !result.verdict.acceptable()).count();
        let skipped = cases.iter().filter(|result| result.verdict == Verdict::Unsupported { allowed: true }).count();
        let seconds: f64 = cases.iter().map(|result| result.seconds).sum();
        let _ = writeln!(
            xml,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\" time=\"{seconds:.3}\" hostname=\"{}\" timestamp=\"{}\">",
            escape(group),
            cases.len(),
            escape(&self.host.hostname),
            escape(&self.date)
        );
        self.junit_properties(xml);
        for case in cases {
            junit_case(xml, case);
        }
        xml.push_str("  </testsuite>\n");
    }

    fn junit_properties(&self, xml: &mut String) {
        xml.push_str("    <properties>\n");
        let mut property = |name: &str, value: &str| {
            let _ = writeln!(xml, "      <property name=\"{}\" value=\"{}\"/>", escape(name), escape(value));
        };
        property("kvrelay.version", &self.kvrelay_version);
        property("case-set.version", &self.case_set_version);
        property("case-set.hash", &self.case_set_hash);
        property("transport.name", &self.transport.name);
        property("transport.version", &self.transport.version);
        for (key, value) in &self.transport.facts {
            property(&format!("transport.{key}"), value);
        }
        property("host.kernel", &self.host.kernel);
        xml.push_str("    </properties>\n");
    }
}

fn junit_case(xml: &mut String, case: &CaseResult) {
    let _ = write!(
        xml,
        "    <testcase classname=\"kvrelay.certify.{}\" name=\"{}\" time=\"{:.3}\">",
        escape(&case.group),
        escape(&case.id),
        case.seconds
    );
    match case.verdict {
        Verdict::Pass => {}
        Verdict::Unsupported { allowed: true } => {
            let _ =
                write!(xml, "<skipped message=\"unsupported, allowed by the case set: {}\"/>", escape(&case.detail));
        }
        Verdict::Fail | Verdict::Unsupported { allowed: false } => {
            let first = case.detail.lines().next().unwrap_or_default();
            let message = format!("{}: {first}", case.verdict.name());
            let _ = write!(
                xml,
                "<failure message=\"{}\" type=\"{}\">{}\nclaim: {}\nreproduce: {}</failure>",
                escape(&message),
                escape(case.verdict.name()),
                escape(&case.detail),
                escape(&case.claim),
                escape(&case.reproduce)
            );
        }
    }
    let attachment = case.page_path().map_or(String::new(), |path| format!("\n[[ATTACHMENT|{path}]]"));
    if let Some(path) = case.page_path() {
        let _ = write!(xml, "<properties><property name=\"report\" value=\"{}\"/></properties>", escape(&path));
    }
    let _ = writeln!(
        xml,
        "<system-out>reproduce: {}{}</system-out></testcase>",
        escape(&case.reproduce),
        escape(&attachment)
    );
}

fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// The JSON Schema of `report.json` (`kvrelay schema certify-report`).
pub fn report_schema() -> serde_json::Value {
    schemars::schema_for!(JsonReport<'static>).to_value()
}

/// `report.json`'s `format`.
pub const FORMAT: &str = "kvrelay-certification-report-1";

#[derive(Serialize, schemars::JsonSchema)]
struct JsonReport<'a> {
    format: &'static str,
    certified: bool,
    complete: bool,
    summary: String,
    kvrelay_version: &'a str,
    case_set: JsonCaseSet<'a>,
    transport: JsonTransport<'a>,
    host: &'a Host,
    date: &'a str,
    throughput: Option<JsonThroughput>,
    shard: Shard,
    cases: Vec<JsonCase<'a>>,
}

/// `report.json` read back (`kvrelay merge` of a sharded certification): what [`Report`] needs.
#[derive(serde::Deserialize)]
struct ReadReport {
    format: String,
    kvrelay_version: String,
    case_set: ReadCaseSet,
    transport: ReadTransport,
    host: Host,
    date: String,
    throughput: Option<ReadThroughput>,
    #[serde(default = "all")]
    shard: Shard,
    cases: Vec<ReadCase>,
}

fn all() -> Shard {
    Shard::ALL
}

#[derive(serde::Deserialize)]
struct ReadCaseSet {
    version: String,
    hash: String,
    size: usize,
}

#[derive(serde::Deserialize)]
struct ReadTransport {
    name: String,
    version: String,
    facts: std::collections::BTreeMap<String, String>,
}

#[derive(serde::Deserialize)]
struct ReadThroughput {
    bytes: u64,
    message_bytes: u64,
    work_requests: u64,
    seconds: f64,
}

#[derive(serde::Deserialize)]
struct ReadCase {
    id: String,
    group: String,
    claim: String,
    verdict: String,
    detail: String,
    seconds: f64,
    reproduce: String,
}

impl Report {
    /// A `report.json` read back; the error names what is wrong with it.
    pub fn from_json(text: &str) -> Result<Report, String> {
        let read: ReadReport =
            serde_json::from_str(text).map_err(|error| format!("not a certification report: {error}"))?;
        if read.format != FORMAT {
            return Err(format!("format `{}`, not {FORMAT}", read.format));
        }
        let verdicts = [
            Verdict::Pass,
            Verdict::Fail,
            Verdict::Unsupported { allowed: true },
            Verdict::Unsupported { allowed: false },
        ];
        let mut results = Vec::new();
        for case in read.cases {
            let Some(verdict) = verdicts.into_iter().find(|verdict| verdict.name() == case.verdict) else {
                return Err(format!("case {}: unknown verdict `{}`", case.id, case.verdict));
            };
            let ReadCase { id, group, claim, detail, seconds, reproduce, .. } = case;
            results.push(CaseResult { id, group, claim, verdict, detail, seconds, reproduce, page: None });
        }
        Ok(Report {
            kvrelay_version: read.kvrelay_version,
            case_set_version: read.case_set.version,
            case_set_hash: read.case_set.hash,
            case_set_size: read.case_set.size,
            transport: Identity {
                name: read.transport.name,
                version: read.transport.version,
                facts: read.transport.facts,
            },
            host: read.host,
            date: read.date,
            results,
            throughput: read.throughput.map(|figure| Throughput {
                bytes: figure.bytes,
                message_bytes: figure.message_bytes,
                work_requests: figure.work_requests,
                seconds: figure.seconds,
            }),
            shard: read.shard,
        })
    }

    /// The shards of one certification (same case set, transport and kvrelay; every shard once) as one report:
    /// the cases in the set's order (each shard took every `count`th case), the throughput of the shard that ran it.
    pub fn merge(mut shards: Vec<Report>) -> Result<Report, String> {
        let Some(first) = shards.first() else { return Err("no reports to merge".to_owned()) };
        let key = |report: &Report| {
            (
                report.case_set_hash.clone(),
                report.transport.name.clone(),
                report.transport.version.clone(),
                report.kvrelay_version.clone(),
            )
        };
        let want = key(first);
        if let Some(other) = shards.iter().find(|report| key(report) != want) {
            return Err(format!(
                "the reports are of different runs: case set {} on {} {} (kvrelay {}) and case set {} on {} {} (kvrelay {})",
                want.0, want.1, want.2, want.3, other.case_set_hash, other.transport.name, other.transport.version, other.kvrelay_version
            ));
        }
        let marks: Vec<Shard> = shards.iter().map(|report| report.shard).collect();
        crate::shard::complete(&marks)?;
        shards.sort_by_key(|report| report.shard.index);
        let mut merged = Report { results: Vec::new(), throughput: None, shard: Shard::ALL, ..shards[0].clone() };
        merged.throughput = shards.iter().find_map(|report| report.throughput);
        let mut queues: Vec<std::vec::IntoIter<CaseResult>> =
            shards.into_iter().map(|report| report.results.into_iter()).collect();
        // Shard k took cases k-1, k-1+N, ...: taking one from each in turn restores the set's order.
        loop {
            let before = merged.results.len();
            for queue in &mut queues {
                merged.results.extend(queue.next());
            }
            if merged.results.len() == before {
                break;
            }
        }
        Ok(merged)
    }
}

#[derive(Serialize, schemars::JsonSchema)]
struct JsonCaseSet<'a> {
    version: &'a str,
    hash: &'a str,
    size: usize,
}

#[derive(Serialize, schemars::JsonSchema)]
struct JsonTransport<'a> {
    name: &'a str,
    version: &'a str,
    facts: &'a std::collections::BTreeMap<String, String>,
}

#[derive(Serialize, schemars::JsonSchema)]
struct JsonThroughput {
    bytes: u64,
    message_bytes: u64,
    work_requests: u64,
    seconds: f64,
    mib_per_second: f64,
    work_requests_per_second: f64,
}

#[derive(Serialize, schemars::JsonSchema)]
struct JsonCase<'a> {
    id: &'a str,
    group: &'a str,
    claim: &'a str,
    verdict: &'static str,
    detail: &'a str,
    seconds: f64,
    reproduce: &'a str,
    /// The case's HTML page, relative to report.json.
    page: Option<String>,
}

impl<'a> From<&'a CaseResult> for JsonCase<'a> {
    fn from(result: &'a CaseResult) -> JsonCase<'a> {
        JsonCase {
            id: &result.id,
            group: &result.group,
            claim: &result.claim,
            verdict: result.verdict.name(),
            detail: &result.detail,
            seconds: result.seconds,
            reproduce: &result.reproduce,
            page: result.page_path(),
        }
    }
}

/// Now, UTC, as RFC 3339 (`2026-12-01T05:24:30Z`).
pub fn utc_now() -> String {
    let seconds = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_secs());
    rfc3339(seconds)
}

/// `seconds` since the Unix epoch as RFC 3339 UTC (the civil-from-days algorithm of H. Hinnant's date library).
pub fn rfc3339(seconds: u64) -> String {
    let days = (seconds / 86_400) as i64;
    let (hour, minute, second) = (seconds % 86_400 / 3600, seconds % 3600 / 60, seconds % 60);
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates_match_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_102_670), "2026-12-01T05:24:30Z");
    }

    #[test]
    fn xml_escaping_covers_markup_and_control_characters() {
        assert_eq!(escape("a<b & \"c\" 'd'>\u{1}\n"), "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;\u{FFFD}\n");
    }
}
