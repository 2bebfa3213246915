//! The certification kit (`kvrelay::certify`): a sound transport is certified, a transport that misplaces bytes or
//! lacks a capability is not, the case set is hashed over its contents, and the three files say the same.

use std::path::{Path, PathBuf};

use kvrelay::certify::{self, CaseSet, Identity, Options, Report, SimTransport, Transport, TransportError, Verdict};
use kvrelay::fabric::verbs::{Caps, Endpoint, NodeId};
use kvrelay::harness::Budget;

use crate::conformance::{Broken, Sabotage};

/// The transfer-engine seam's NIXL-shaped template transport (also `--example certify-requests`).
#[path = "../transports/requests.rs"]
pub(crate) mod requests;
use crate::support::{kvrelay, text};

/// A small corpus: four scenarios through the engines, including a failed registration.
fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/engines")
}

pub(crate) fn options() -> Options {
    let mut options = Options::new(Budget::bytes(1 << 30), "kvrelay certify --fabric test");
    options.throughput_bytes = 1 << 20;
    options
}

pub(crate) fn run(transport: &mut dyn Transport, options: &Options) -> Report {
    let set = CaseSet::load(&corpus()).unwrap();
    certify::certify(transport, &set, options, &mut |_| {})
}

/// The in-memory fabric granting at most one scatter-gather entry per work request.
struct OneSge(SimTransport);

impl Transport for OneSge {
    fn identity(&self) -> Identity {
        Identity { name: "one-sge".to_owned(), ..Identity::default() }
    }
    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, TransportError> {
        self.0.open(node, Caps { max_sge: 1, ..caps })
    }
    fn step(&mut self) {
        self.0.step();
    }
    fn settle(&mut self) {
        self.0.settle();
    }
    fn reset(&mut self) {
        self.0.reset();
    }
}

#[test]
fn the_in_memory_fabric_is_certified_on_every_case() {
    let report = run(&mut SimTransport::eager(), &options());
    let failed: Vec<_> = report.results.iter().filter(|result| result.verdict != Verdict::Pass).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(report.certified() && report.complete(), "{}", report.summary());
    let throughput = report.throughput.expect("the throughput case measured");
    assert_eq!(throughput.bytes, 1 << 20);
    for group in ["seam", "contract", "error-path", "scenario", "throughput"] {
        assert!(report.results.iter().any(|result| result.group == group), "no {group} case ran");
    }
    let junit = report.junit();
    assert_eq!(junit.matches("<testcase ").count(), report.results.len(), "each case once in junit.xml");
    assert_eq!(junit.matches("<testsuite ").count(), 5, "one suite per group");
}

#[test]
fn a_transport_that_misplaces_writes_fails_with_decoded_coordinates() {
    let report = run(&mut Broken { inner: SimTransport::eager(), sabotage: Sabotage::ShiftWrites }, &options());
    assert!(!report.certified(), "{}", report.summary());
    let scenario = report
        .results
        .iter()
        .find(|result| result.id == "scenario/dcp-relayout-two-stages")
        .expect("the scenario case ran");
    assert_eq!(scenario.verdict, Verdict::Fail);
    assert!(scenario.detail.contains("oracle violations"), "{}", scenario.detail);
    assert!(scenario.detail.contains("decode"), "violations are decoded into coordinates: {}", scenario.detail);
    // Writes shifted one byte past a region's end complete RemoteAccess and break their queue pair: the prefill rank fails
    // the rooms of every write still waiting on it at once, not at the decode side's waiting timeout.
    assert!(scenario.detail.contains("RemoteAccess"), "{}", scenario.detail);
    assert!(!scenario.detail.contains("timed out"), "{}", scenario.detail);
    assert_eq!(scenario.reproduce, "kvrelay certify --fabric test --case scenario/dcp-relayout-two-stages");
    assert!(report.count(Verdict::Fail) >= 4, "{}", report.summary());
    // The JUnit file links the case's report page, written beside it, which draws the misplaced bytes in red.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("certify-pages");
    let _ = std::fs::remove_dir_all(&dir);
    let written = report.write(&dir).unwrap();
    let junit = std::fs::read_to_string(&written.junit).unwrap();
    let link = "<property name=\"report\" value=\"pages/scenario_dcp-relayout-two-stages.html\"/>";
    assert!(junit.contains(link), "{junit}");
    assert!(junit.contains("[[ATTACHMENT|pages/scenario_dcp-relayout-two-stages.html]]"), "{junit}");
    let page = std::fs::read_to_string(dir.join("pages/scenario_dcp-relayout-two-stages.html")).unwrap();
    assert!(page.contains("class=\"violation\""), "the page marks the violations");
    assert!(dir.join("pages/index.html").exists());
}

#[test]
fn a_capability_the_transport_lacks_is_reported_and_fails_the_certification() {
    let report = run(&mut OneSge(SimTransport::eager()), &options());
    let unsupported: Vec<_> =
        report.results.iter().filter(|result| result.verdict == Verdict::Unsupported { allowed: false }).collect();
    assert!(!unsupported.is_empty(), "a multi-SGE case needs max_sge >= 2: {}", report.summary());
    assert!(unsupported.iter().all(|result| result.detail.contains("max_sge")), "{unsupported:#?}");
    assert!(!report.certified());
}

#[test]
fn a_scenario_over_the_memory_budget_is_unsupported_and_allowed_only_when_large() {
    let set = CaseSet::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/basic")).unwrap();
    let mut options = Options::new(Budget::bytes(1 << 20), "kvrelay certify --fabric sim");
    options.only = vec!["scenario/kimi-k3-pp8-tp1-to-tp8-dcp8".to_owned(), "scenario/kimi-k3-example-c".to_owned()];
    let report = certify::certify(&mut SimTransport::eager(), &set, &options, &mut |_| {});
    let verdict = |id: &str| report.results.iter().find(|result| result.id == id).unwrap().verdict;
    // 2.9 GB registered: the case set lets a small host leave it out, saying so.
    assert_eq!(verdict("scenario/kimi-k3-pp8-tp1-to-tp8-dcp8"), Verdict::Unsupported { allowed: true });
    assert_eq!(verdict("scenario/kimi-k3-example-c"), Verdict::Unsupported { allowed: false });
    assert!(!report.certified() && !report.complete(), "a partial run is never a certification");
}

#[test]
fn the_junit_json_and_manifest_files_agree_with_the_report() {
    let mut options = options();
    options.only = vec!["scenario/legacy-registration".to_owned(), "throughput/write-bandwidth".to_owned()];
    let report = run(&mut Broken { inner: SimTransport::eager(), sabotage: Sabotage::ShiftWrites }, &options);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("certify-files-{}", std::process::id()));
    let written = report.write(&dir).unwrap();
    let junit = std::fs::read_to_string(&written.junit).unwrap();
    assert!(
        junit.contains("<testsuites name=\"kvrelay certify broken-ShiftWrites\" tests=\"2\" failures=\"2\""),
        "{junit}"
    );
    assert_eq!(junit.matches("<testcase ").count(), 2);
    assert_eq!(junit.matches("<failure ").count(), 2);
    assert!(junit.contains("case-set.hash"), "{junit}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&written.json).unwrap()).unwrap();
    assert_eq!(json["certified"], false);
    assert_eq!(json["complete"], false);
    assert_eq!(json["case_set"]["hash"], report.case_set_hash.as_str());
    assert_eq!(json["cases"].as_array().unwrap().len(), 2);
    assert_eq!(json["cases"][0]["verdict"], "fail");
    let manifest = std::fs::read_to_string(&written.manifest).unwrap();
    assert!(manifest.contains(&format!("case-set-hash: {}", report.case_set_hash)), "{manifest}");
    assert!(manifest.contains("case: fail "), "{manifest}");
    assert!(manifest.contains("--case scenario/legacy-registration"), "{manifest}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_case_set_hash_covers_every_scenario_byte() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("certify-hash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = corpus().join("legacy-registration.yaml");
    let copy = dir.join("legacy-registration.yaml");
    std::fs::copy(&source, &copy).unwrap();
    let before = CaseSet::load(&dir).unwrap().hash;
    assert_eq!(CaseSet::load(&dir).unwrap().hash, before, "the hash is a function of the contents");
    let mut bytes = std::fs::read(&copy).unwrap();
    bytes.extend_from_slice(b"\n# one more comment byte\n");
    std::fs::write(&copy, bytes).unwrap();
    assert_ne!(CaseSet::load(&dir).unwrap().hash, before);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_cli_lists_the_case_set_and_refuses_unknown_cases_and_transports() {
    let listed = kvrelay(&["certify", "--list", "--scenarios", "scenarios/engines"]);
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    let out = text(&listed.stdout);
    assert!(out.starts_with("case set kvrelay-certify-4 ("), "{out}");
    assert!(out.contains("seam/batch_lands_exactly_and_notifies_after_its_bytes"), "{out}");
    assert!(out.contains("scenario/legacy-registration"), "{out}");
    let unknown = kvrelay(&["certify", "--case", "scenario/nothing-here", "--scenarios", "scenarios/engines"]);
    assert!(!unknown.status.success());
    assert!(text(&unknown.stderr).contains("no case `scenario/nothing-here`"), "{}", text(&unknown.stderr));
    let transport = kvrelay(&["certify", "--fabric", "carrier-pigeon", "--scenarios", "scenarios/engines"]);
    assert!(!transport.status.success());
    assert!(text(&transport.stderr).contains("unknown fabric `carrier-pigeon`"), "{}", text(&transport.stderr));
}

/// The sample C plug-in through the whole kit: clean, certified on every conformance case and scenario; with its
/// planted wrong offset, every verbs conformance case still passes (their regions are smaller than 4 KiB) while the
/// scenario cases catch it in coordinates, and the seam cases (64 KiB regions) and the throughput case's byte check
/// catch it too.
#[test]
fn the_sample_plugin_is_certified_clean_and_refused_with_its_planted_offset() {
    use kvrelay::fabric::plugin::PluginTransport;
    let _serial = crate::plugin::serial();
    let clean = run(&mut PluginTransport::load(crate::plugin::clean()).unwrap(), &options());
    assert!(clean.certified(), "{}\n{:#?}", clean.summary(), clean.results);
    let planted = run(&mut PluginTransport::load(crate::plugin::planted()).unwrap(), &options());
    assert!(!planted.certified());
    let failed: Vec<&str> = planted
        .results
        .iter()
        .filter(|result| result.verdict == Verdict::Fail)
        .map(|result| result.id.as_str())
        .collect();
    let caught_by = |id: &str| ["scenario/", "throughput/", "seam/"].iter().any(|group| id.starts_with(group));
    assert!(failed.iter().all(|id| caught_by(id)), "{failed:?}");
    assert!(failed.contains(&"throughput/write-bandwidth"), "{failed:?}");
    let relayout = planted.results.iter().find(|result| result.id == "scenario/dcp-relayout-two-stages").unwrap();
    assert_eq!(relayout.verdict, Verdict::Fail);
    assert!(relayout.detail.contains("decode pp0/tp"), "{}", relayout.detail);
}

/// `kvrelay run --fabric plugin:PATH`, the command a failed scenario case names to trace it: the clean sample
/// passes, the planted one fails with the oracle's violations.
#[test]
fn kvrelay_run_puts_a_scenario_on_a_plugin_and_the_oracle_judges_it() {
    let scenario = "scenarios/engines/dcp-relayout-two-stages.yaml";
    let clean = format!("plugin:{}", crate::plugin::clean().display());
    let output = kvrelay(&["run", scenario, "--fabric", &clean]);
    assert!(output.status.success(), "{}{}", text(&output.stdout), text(&output.stderr));
    assert!(text(&output.stdout).contains("verdict: pass"), "{}", text(&output.stdout));
    let planted = format!("plugin:{}", crate::plugin::planted().display());
    let output = kvrelay(&["run", scenario, "--fabric", &planted]);
    assert!(!output.status.success());
    assert!(text(&output.stdout).contains("oracle violations"), "{}", text(&output.stdout));
}

/// The seam is not verbs in disguise: a transport shaped like NIXL (requests of descriptor lists to a peer agent,
/// one status per request, a notification after its bytes; no queue pairs, keys or work-request completions) meets
/// it natively and is certified on the seam's cases and every scenario, the verbs cases not applying to it; with its
/// planted bug (the last descriptor of a long request silently dropped) the oracle fails it in coordinates.
#[test]
fn a_nixl_shaped_transport_is_certified_through_the_seam_and_its_planted_bug_is_caught() {
    let report = run(&mut requests::Requests::new(false), &options());
    let failed: Vec<_> = report.results.iter().filter(|result| !result.verdict.acceptable()).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(report.certified() && report.complete(), "{}", report.summary());
    let passed = |group: &str| {
        report.results.iter().filter(|result| result.group == group && result.verdict == Verdict::Pass).count()
    };
    assert_eq!(passed("seam"), kvrelay::certify::seam::cases().len());
    assert_eq!(passed("scenario"), report.results.iter().filter(|result| result.group == "scenario").count());
    assert_eq!(passed("contract") + passed("error-path"), 0, "verbs cases do not apply to a NIXL-shaped transport");

    let planted = run(&mut requests::Requests::new(true), &options());
    assert!(!planted.certified(), "{}", planted.summary());
    let dcp = planted.results.iter().find(|result| result.id == "scenario/dcp-relayout-two-stages").unwrap();
    assert_eq!(dcp.verdict, Verdict::Fail);
    assert!(dcp.detail.contains("decode rank") || dcp.detail.contains("decode pp"), "{}", dcp.detail);
    assert!(dcp.detail.contains("oracle violations"), "{}", dcp.detail);
}

/// `kvrelay certify --shard K/N --json` on every shard, merged: the whole case set in its order, certified as the
/// unsharded run is, while each shard alone is a partial run that certifies nothing.
#[test]
fn a_sharded_certification_merges_into_the_whole_one() {
    let temp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("certify-shards");
    std::fs::create_dir_all(&temp).unwrap();
    let file = |name: &str| temp.join(name).display().to_string();
    let certify = |extra: &[&str]| {
        let mut args = vec!["certify", "--scenarios", "scenarios/engines", "--throughput-bytes", "1048576"];
        args.extend_from_slice(extra);
        kvrelay(&args)
    };
    let all = certify(&["--json", &file("all.json"), "--out", &file("all")]);
    assert!(all.status.success(), "{}", text(&all.stdout));
    for index in 1..=3 {
        let name = format!("{index}");
        let shard = certify(&[
            "--shard",
            &format!("{index}/3"),
            "--json",
            &file(&format!("{name}.json")),
            "--out",
            &file(&name),
        ]);
        assert!(!shard.status.success(), "a shard alone certified: {}", text(&shard.stdout));
        assert!(text(&shard.stdout).contains("NOT CERTIFIED (partial run)"), "{}", text(&shard.stdout));
    }
    let merged = kvrelay(&["merge", &file("3.json"), &file("1.json"), &file("2.json"), "--json", &file("merged.json")]);
    assert!(merged.status.success(), "{}{}", text(&merged.stdout), text(&merged.stderr));
    assert!(text(&merged.stdout).contains("CERTIFIED: "), "{}", text(&merged.stdout));
    let cases = |name: &str| -> Vec<(String, String)> {
        let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file(name)).unwrap()).unwrap();
        let cases = value["cases"].as_array().unwrap();
        cases.iter().map(|case| (case["id"].to_string(), case["verdict"].to_string())).collect()
    };
    assert_eq!(cases("merged.json"), cases("all.json"));
    let missing = kvrelay(&["merge", &file("1.json"), &file("2.json")]);
    assert!(!missing.status.success() && text(&missing.stderr).contains("3/3 missing"), "{}", text(&missing.stderr));
}
