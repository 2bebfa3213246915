//! `kvrelay certify --fabric NAME`: the certification kit's command line. Picks the transport, runs the case set,
//! prints one line per case, and writes the JUnit XML, JSON report and manifest.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

use crate::certify::{self, CaseResult, CaseSet, Options, Transport, Verdict};
use crate::harness::Budget;

/// `kvrelay certify`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct CertifyArgs {
    /// The transport: `sim` (kvrelay's in-memory fabric), `rdma` (verbs; needs the `rdma` feature) or
    /// `plugin:PATH` (a shared object implementing src/fabric/kvrelay_transport.h), `child:COMMAND` (a program
    /// speaking kvrelay-transport-1, src/fabric/child/README.md) or `mooncake` (Mooncake's Transfer Engine behind it).
    #[arg(long, default_value = "sim")]
    pub fabric: String,
    /// RDMA device (default: the first device with an active port).
    #[arg(long)]
    pub device: Option<String>,
    /// The scenario corpus whose every file is a case.
    #[arg(long, default_value = "scenarios")]
    pub scenarios: PathBuf,
    /// Where junit.xml, report.json and manifest.txt go (default: target/certify/<transport>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run only this case (repeatable); such a partial run is never a certification.
    #[arg(long = "case")]
    pub cases: Vec<String>,
    /// List the case set (id, group, claim) and its hash, and run nothing.
    #[arg(long)]
    pub list: bool,
    /// Bytes the throughput case moves.
    #[arg(long, default_value_t = 64 << 20)]
    pub throughput_bytes: u64,
    /// Message size of the throughput case, in bytes.
    #[arg(long, default_value_t = 64 << 10)]
    pub message_bytes: u64,
    /// Seconds a scenario's decode request may wait for the prefill side before it fails.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// Run only shard K of N of the case set (`K/N`, counted from 1; `slurm`: this Slurm array task's): a partial
    /// run whose `--json` reports `kvrelay merge` joins into the whole certification.
    #[arg(long, conflicts_with = "cases")]
    pub shard: Option<String>,
    /// Also write the JSON report (report.json's content, schema src/schemas/certify-report.schema.json) to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl CertifyArgs {
    /// The command line that reruns this certification.
    fn reproduce(&self) -> String {
        let mut line = format!("kvrelay certify --fabric {}", quoted(&self.fabric));
        if let Some(device) = &self.device {
            line.push_str(&format!(" --device {device}"));
        }
        if self.scenarios.as_os_str() != "scenarios" {
            line.push_str(&format!(" --scenarios {}", self.scenarios.display()));
        }
        line
    }

    /// The `kvrelay run` flags for the same transport.
    fn run_flags(&self) -> String {
        let fabric = if self.fabric == "sim" { "live-sim".to_owned() } else { quoted(&self.fabric) };
        let mut flags = format!("--fabric {fabric}");
        if let Some(device) = &self.device {
            flags.push_str(&format!(" --device {device}"));
        }
        flags
    }

    fn out_dir(&self, transport: &str) -> PathBuf {
        let safe: String = transport
            .chars()
            .map(|char| if char.is_ascii_alphanumeric() || char == '-' { char } else { '_' })
            .collect();
        self.out.clone().unwrap_or_else(|| PathBuf::from("target/certify").join(safe))
    }
}

/// `text` as one shell word (`child:COMMAND` holds spaces).
fn quoted(text: &str) -> String {
    if text.bytes().all(|byte| byte.is_ascii_alphanumeric() || b"-_.:/=+@,".contains(&byte)) {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

/// `kvrelay merge` of a sharded certification's `--json` reports: the whole report, its summary, and exit 0 only
/// when the merged run is a certification.
pub(super) fn merge(texts: &[(&PathBuf, &str)], json: Option<&std::path::Path>) -> anyhow::Result<ExitCode> {
    let mut reports = Vec::new();
    for (file, text) in texts {
        reports.push(certify::Report::from_json(text).map_err(|error| anyhow::anyhow!("{}: {error}", file.display()))?);
    }
    let merged = certify::Report::merge(reports).map_err(anyhow::Error::msg)?;
    for result in &merged.results {
        print_case(result)?;
    }
    if let Some(throughput) = &merged.throughput {
        outln!("throughput: {throughput}");
    }
    outln!("{}", merged.summary());
    if let Some(path) = json {
        std::fs::write(path, merged.json()).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(if merged.certified() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Runs `kvrelay certify`.
pub(super) fn certify(args: &CertifyArgs) -> anyhow::Result<ExitCode> {
    let set = CaseSet::load(&args.scenarios)?;
    set.check_ids(&args.cases)?;
    if args.list {
        list(&set)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut transport = transport(args)?;
    let mut options = Options::new(Budget::from_env()?, &args.reproduce());
    options.only = args.cases.clone();
    options.shard = super::sim::shard(args.shard.as_deref())?;
    options.run_flags = Some(args.run_flags());
    options.throughput_bytes = args.throughput_bytes;
    options.message_bytes = args.message_bytes;
    options.live.waiting_timeout_ns = args.timeout.saturating_mul(1_000_000_000);
    options.live.time_limit = Duration::from_secs(args.timeout.saturating_mul(2));
    let identity = transport.identity();
    outln!(
        "certifying {} ({}) with case set {} {}",
        identity.name,
        identity.version,
        certify::CASE_SET_VERSION,
        set.hash
    );
    let mut printed = Ok(());
    let in_shard = options.shard.pick(&set.cases).count();
    let planned = if options.only.is_empty() { in_shard } else { options.only.len() };
    let bar = super::progress(planned as u64, "certify");
    let report = certify::certify(&mut *transport, &set, &options, &mut |result| {
        if printed.is_ok() {
            printed = bar.suspend(|| print_case(result));
        }
        bar.inc(1);
    });
    bar.finish_and_clear();
    printed?;
    let written = report.write(&args.out_dir(&identity.name))?;
    if let Some(path) = &args.json {
        std::fs::write(path, report.json()).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(throughput) = &report.throughput {
        outln!("throughput: {throughput}");
    }
    outln!("{}", report.summary());
    outln!("wrote {}, {} and {}", written.junit.display(), written.json.display(), written.manifest.display());
    let pages = report.results.iter().filter(|result| result.page.is_some()).count();
    if pages > 0 {
        let dir = written.junit.with_file_name("pages");
        outln!("and {pages} report pages in {} (index.html; each linked from its case in junit.xml)", dir.display());
    }
    Ok(if report.certified() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn list(set: &CaseSet) -> std::io::Result<()> {
    outln!("case set {} ({} cases), sha256 {}", certify::CASE_SET_VERSION, set.cases.len(), set.hash);
    for case in &set.cases {
        outln!("{:<64} {}", case.id, case.claim);
    }
    Ok(())
}

/// One line per case; a failure's detail and reproduce line follow it.
fn print_case(result: &CaseResult) -> std::io::Result<()> {
    let verdict = match result.verdict {
        Verdict::Pass => "pass",
        Verdict::Fail => "FAIL",
        Verdict::Unsupported { allowed: true } => "unsupported (allowed)",
        Verdict::Unsupported { allowed: false } => "UNSUPPORTED",
    };
    outln!("{verdict:<6} {:>8.3}s  {}", result.seconds, result.id);
    if !result.detail.is_empty() && result.verdict != Verdict::Pass {
        for line in result.detail.lines().take(8) {
            outln!("         {line}");
        }
        outln!("         reproduce: {}", result.reproduce);
    }
    Ok(())
}

/// The transport `--fabric` names (the fabric registry's one parser).
fn transport(args: &CertifyArgs) -> anyhow::Result<Box<dyn Transport>> {
    let fabric =
        crate::fabric::registry::Fabric::parse(&args.fabric, args.device.clone()).map_err(anyhow::Error::msg)?;
    fabric.transport().map_err(anyhow::Error::msg)
}
