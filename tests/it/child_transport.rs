//! The child-process fabric (`kvrelay::fabric::child`, protocol `kvrelay-transport-1`): the reference child
//! (`tests/transports/memcpy_engine.py`) certified through it and its planted bug caught, every line held to the
//! JSON Schemas, misbehaving children turned into clear errors (never a panic or a hang), the registry's
//! `child:COMMAND` and `mooncake`, and Mooncake's Transfer Engine where its wheel is installed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvrelay::certify::{self, CaseSet, Options, Report, Transport, Verdict};
use kvrelay::fabric::child::{ChildOptions, ChildTransport};
use kvrelay::fabric::registry::Fabric;
use kvrelay::fabric::seam::{Batch, BatchStatus, Entry, Event, Landed, MemoryKind, NodeId, SeamErrorKind};
use kvrelay::fabric::verbs::Caps;
use kvrelay::harness::Budget;

use crate::support::{kvrelay, text};

/// What a verbs-shaped transport would be asked for (a child ignores it).
const ASK: Caps = Caps { max_sge: 4, max_message: 1 << 20, sq_depth: 64 };

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn script(name: &str) -> String {
    root().join("tests/transports").join(name).display().to_string()
}

/// `python3 tests/transports/memcpy_engine.py [flags]`.
fn memcpy(flags: &[&str]) -> Vec<String> {
    let mut argv = vec!["python3".to_owned(), script("memcpy_engine.py")];
    argv.extend(flags.iter().map(|flag| (*flag).to_owned()));
    argv
}

fn options() -> Options {
    let mut options = Options::new(Budget::bytes(1 << 30), "kvrelay certify --fabric child:test");
    options.throughput_bytes = 1 << 20;
    options
}

fn certify_on(transport: &mut dyn Transport, options: &Options) -> Report {
    let set = CaseSet::load(&root().join("scenarios/engines")).unwrap();
    certify::certify(transport, &set, options, &mut |_| {})
}

/// The reference child is certified on the seam's cases and every scenario (the verbs cases do not apply); with
/// its planted bug (a long batch's last entry dropped while it reports success) the oracle fails it in
/// coordinates.
#[test]
fn the_memcpy_child_is_certified_and_its_planted_bug_is_caught() {
    let mut clean = ChildTransport::start(memcpy(&[])).unwrap();
    let identity = clean.identity();
    assert_eq!(identity.name, "child:memcpy-sample");
    assert_eq!(identity.facts["protocol"], "kvrelay-transport-1");
    let report = certify_on(&mut clean, &options());
    let failed: Vec<_> = report.results.iter().filter(|result| !result.verdict.acceptable()).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(report.certified() && report.complete(), "{}", report.summary());
    let passed = |report: &Report, group: &str| {
        report.results.iter().filter(|result| result.group == group && result.verdict == Verdict::Pass).count()
    };
    assert_eq!(passed(&report, "seam"), kvrelay::certify::seam::cases().len());
    assert!(passed(&report, "scenario") >= 4, "{}", report.summary());

    let mut planted = ChildTransport::start(memcpy(&["--plant-dropped-tail"])).unwrap();
    let report = certify_on(&mut planted, &options());
    assert!(!report.certified(), "{}", report.summary());
    let dcp = report.results.iter().find(|result| result.id == "scenario/dcp-relayout-two-stages").unwrap();
    assert_eq!(dcp.verdict, Verdict::Fail);
    assert!(dcp.detail.contains("oracle violations"), "{}", dcp.detail);
}

/// `tests/transports/schema_proxy.py` sits between kvrelay and the child and checks every line both ways against
/// src/fabric/child/schema/; a violation makes it exit, which would break the child.
#[test]
fn every_line_keeps_the_json_schemas() {
    let mut argv = vec!["python3".to_owned(), script("schema_proxy.py")];
    argv.extend(memcpy(&[]));
    let mut proxied = ChildTransport::start(argv).unwrap();
    let mut options = options();
    options.only = kvrelay::certify::seam::cases().iter().map(|case| format!("seam/{}", case.id)).collect();
    options.only.push("scenario/dcp-relayout-two-stages".to_owned());
    let report = certify_on(&mut proxied, &options);
    let failed: Vec<_> = report.results.iter().filter(|result| result.verdict != Verdict::Pass).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(proxied.broken().is_none(), "{:?}", proxied.broken());
}

/// Registration files are shared, not copied: kvrelay reads what the child wrote, and removes the files.
#[test]
fn memory_is_shared_through_files_and_removed_at_release() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("child-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let files = || std::fs::read_dir(&dir).unwrap().count();
    let options = ChildOptions { shm_dir: dir.clone(), ..ChildOptions::default() };
    let mut transport = ChildTransport::start_with(memcpy(&[]), options).unwrap();
    let mut sender = transport.engine(NodeId(0), ASK).unwrap();
    let mut receiver = transport.engine(NodeId(1), ASK).unwrap();
    let source = sender.register(MemoryKind::Host, 4096, 0, Arc::new(|_, out: &mut [u8]| out.fill(7))).unwrap();
    let target = receiver.register(MemoryKind::Host, 4096, 0, Arc::new(|_, out: &mut [u8]| out.fill(0))).unwrap();
    let device = sender.register(MemoryKind::Device { gpu: 0 }, 16, 0, Arc::new(|_, _: &mut [u8]| {}));
    assert_eq!(device.unwrap_err().kind(), SeamErrorKind::Engine);
    let (conn, sender_address) = sender.open().unwrap();
    let (back, receiver_address) = receiver.open().unwrap();
    sender.connect(conn, &receiver_address, &[target.remote()]).unwrap();
    receiver.connect(back, &sender_address, &[]).unwrap();
    let entry = Entry::new(source.id, 0, 0, 100, 10);
    let batch = sender.submit(conn, Batch { entries: vec![entry], notify: Some(5), tables: Vec::new() }).unwrap();
    let mut events = Vec::new();
    for _ in 0..100 {
        sender.poll(&mut events, usize::MAX);
        if !events.is_empty() {
            break;
        }
        transport.step();
    }
    let Some(Event::Completed(completion)) = events.first() else { panic!("{events:?}") };
    assert_eq!((completion.batch, completion.status, &completion.landed), (batch, BatchStatus::Success, &Landed::All));
    let mut notified = Vec::new();
    receiver.poll(&mut notified, usize::MAX);
    assert_eq!(notified, [Event::Notified { conn: back, tag: 5 }]);
    let mut bytes = [0u8; 12];
    receiver.read(&target, 99, &mut bytes).unwrap();
    assert_eq!(bytes, [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0]);
    assert_eq!(files(), 2);
    let image = receiver.release(&target, false).unwrap();
    assert_eq!(image[&0][100..110], [7; 10]);
    assert_eq!(files(), 1);
    drop(sender);
    assert_eq!(files(), 0);
    std::fs::remove_dir(&dir).unwrap();
}

/// A child command from a Python one-liner.
fn python(code: &str) -> Vec<String> {
    vec!["python3".to_owned(), "-c".to_owned(), code.to_owned()]
}

fn quick() -> ChildOptions {
    ChildOptions { startup: Duration::from_secs(3), call: Duration::from_secs(2), ..ChildOptions::default() }
}

#[track_caller]
fn start_error(argv: Vec<String>) -> String {
    match ChildTransport::start_with(argv, quick()) {
        Ok(_) => panic!("the child started"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn a_child_that_exits_prints_garbage_or_never_answers_is_a_clear_error() {
    let exits = start_error(python("import sys; print('about to fail', file=sys.stderr); sys.exit(3)"));
    assert!(exits.contains("the transport child `python3 -c"), "{exits}");
    assert!(exits.contains("exited (exit status: 3)") && exits.contains("op `hello`"), "{exits}");
    assert!(exits.contains("about to fail"), "the child's stderr is quoted: {exits}");

    let garbage = start_error(python("input(); print('hello there')"));
    assert!(garbage.contains("op `hello`: an answer that is not JSON"), "{garbage}");
    assert!(garbage.contains("hello there"), "{garbage}");

    let silent = start_error(python("import time; time.sleep(600)"));
    assert!(silent.contains("gave no answer to op `hello` within 3.0 s"), "{silent}");

    let long = start_error(python("input(); print('x' * ((64 << 20) + 10))"));
    assert!(long.contains("wrote a line longer than"), "{long}");

    let wrong = start_error(python(
        "import json; m = json.loads(input()); print(json.dumps({'op': 'hello', 'seq': m['seq'] + 1, 'ok': True}))",
    ));
    assert!(wrong.contains("field `seq`: answered 2, expected 1"), "{wrong}");

    let missing = start_error(python(
        "import json; m = json.loads(input()); print(json.dumps({'op': 'hello', 'seq': m['seq'], 'ok': True, \
         'protocol': 'kvrelay-transport', 'version': 1, 'engine': 'x', 'engine_version': '1'}))",
    ));
    assert!(missing.contains("op `hello`: field `limits`"), "{missing}");

    let nothing = start_error(vec!["/nonexistent/engine".to_owned()]);
    assert!(nothing.contains("cannot start"), "{nothing}");
}

/// The reference child with one op replaced by `body` (a Python method taking `self, msg`).
fn misbehaving(op: &str, body: &str) -> Vec<String> {
    let code = format!(
        "import sys; sys.argv = ['memcpy']; sys.path.insert(0, {dir:?}); import memcpy_engine as m\n\
         def bad(self, msg):\n    {body}\n\
         setattr(m.Child, 'op_{op}', bad); m.main()",
        dir = root().join("tests/transports").display().to_string(),
    );
    python(&code)
}

/// Runs the seam's first case on `argv`: its detail.
fn seam_case(argv: Vec<String>) -> (Verdict, String) {
    let mut transport = ChildTransport::start_with(argv, quick()).unwrap();
    let mut options = options();
    options.only = vec!["seam/batch_lands_exactly_and_notifies_after_its_bytes".to_owned()];
    let report = certify_on(&mut transport, &options);
    let result = &report.results[0];
    (result.verdict, result.detail.clone())
}

#[test]
fn a_child_that_breaks_the_protocol_mid_run_fails_the_case_naming_the_op_and_field() {
    let (verdict, detail) = seam_case(misbehaving(
        "poll",
        "return {'events': [{'event': 'completed', 'conn': 0, 'batch': 999, 'status': 'success', 'landed': 'all'}]}",
    ));
    assert_eq!(verdict, Verdict::Fail);
    assert!(detail.contains("op `poll`: field `events[0].batch`: batch 999 is not in flight"), "{detail}");
    assert!(detail.contains("Aborted"), "the batch in flight completes aborted: {detail}");

    let (verdict, detail) = seam_case(misbehaving("submit", "return {'batch': 'seven'}"));
    assert_eq!(verdict, Verdict::Fail);
    assert!(detail.contains("op `submit`: field `batch`: expected a non-negative integer"), "{detail}");

    let (verdict, detail) = seam_case(misbehaving("submit", "import time; time.sleep(600)"));
    assert_eq!(verdict, Verdict::Fail);
    assert!(detail.contains("gave no answer to op `submit` within 2.0 s"), "{detail}");

    let (verdict, detail) = seam_case(misbehaving("open", "import os; os._exit(9)"));
    assert_eq!(verdict, Verdict::Fail);
    assert!(detail.contains("exited (exit status: 9)") && detail.contains("op `open`"), "{detail}");

    let (verdict, detail) = seam_case(misbehaving("poll", "return {'events': [{'event': 'landed', 'conn': 0}]}"));
    assert_eq!(verdict, Verdict::Fail);
    assert!(detail.contains("field `events[0].event`"), "{detail}");

    let (verdict, detail) = seam_case(misbehaving("register", "raise m.Refusal('no_such_kind', 'what')"));
    assert_eq!(verdict, Verdict::Fail);
    assert!(detail.contains("field `error.kind`: \"no_such_kind\" is not one of"), "{detail}");
}

/// After a broken case the next one starts a fresh child.
#[test]
fn a_reset_replaces_a_broken_child() {
    let mut transport = ChildTransport::start_with(memcpy(&[]), quick()).unwrap();
    let mut engine = transport.engine(NodeId(0), ASK).unwrap();
    drop(transport.engine(NodeId(1), ASK));
    engine.register(MemoryKind::Host, 8, 0, Arc::new(|_, out: &mut [u8]| out.fill(1))).unwrap();
    assert!(transport.broken().is_none());
    transport.reset();
    let stale = engine.open().unwrap_err();
    assert!(stale.to_string().contains("belongs to a case before the last reset"), "{stale}");
    let mut fresh = transport.engine(NodeId(0), ASK).unwrap();
    fresh.open().unwrap();
}

#[test]
fn the_registry_parses_child_and_mooncake() {
    let child = Fabric::parse("child:python3 tests/transports/memcpy_engine.py", None).unwrap();
    assert_eq!(child, Fabric::Child { command: "python3 tests/transports/memcpy_engine.py".to_owned() });
    assert_eq!(child.flags(), ["--fabric", "child:python3 tests/transports/memcpy_engine.py"]);
    assert_eq!(Fabric::parse("mooncake", None).unwrap(), Fabric::Mooncake);
    assert_eq!(Fabric::Mooncake.name(), "mooncake");
    let unknown = Fabric::parse("child:", None).unwrap_err().to_string();
    assert!(unknown.contains("child:COMMAND or mooncake"), "{unknown}");
}

/// `kvrelay run --fabric child:COMMAND` puts a scenario on the child; the oracle judges it, the planted bug fails.
#[test]
fn kvrelay_run_puts_a_scenario_on_a_child() {
    let scenario = "scenarios/engines/dcp-relayout-two-stages.yaml";
    let clean = format!("child:python3 {}", script("memcpy_engine.py"));
    let output = kvrelay(&["run", scenario, "--fabric", &clean]);
    assert!(output.status.success(), "{}{}", text(&output.stdout), text(&output.stderr));
    assert!(text(&output.stdout).contains("verdict: pass"), "{}", text(&output.stdout));
    let planted = format!("{clean} --plant-dropped-tail");
    let output = kvrelay(&["run", scenario, "--fabric", &planted]);
    assert!(!output.status.success());
    assert!(text(&output.stdout).contains("oracle violations"), "{}", text(&output.stdout));
}

/// Ranks as processes: every `kvrelay serve` process starts its own child, and the reference child reaches the
/// engines of the others through the files they list.
#[test]
fn kvrelay_launch_runs_ranks_as_processes_each_with_its_own_child() {
    let scenario = "scenarios/engines/dcp-relayout-two-stages.yaml";
    let fabric = format!("child:python3 {}", script("memcpy_engine.py"));
    let output = kvrelay(&["launch", scenario, "--fabric", &fabric, "--timeout", "30"]);
    let out = format!("{}{}", text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{out}");
    assert!(out.contains("pass dcp-relayout-two-stages (4 processes"), "{out}");
}

/// The venv's python with the pinned Mooncake wheel (`KVRELAY_MOONCAKE_PYTHON`), or `None` with a printed line.
fn mooncake_python() -> Option<String> {
    match std::env::var("KVRELAY_MOONCAKE_PYTHON") {
        Ok(python) if Path::new(&python).exists() => Some(python),
        _ => {
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                b"skipped: KVRELAY_MOONCAKE_PYTHON does not name a python with mooncake-transfer-engine-non-cuda 0.3.13.post1\n",
            );
            None
        }
    }
}

/// Mooncake's Transfer Engine behind the protocol: the seam's cases and the engines' scenarios.
#[test]
fn mooncake_through_the_child_protocol() {
    let Some(python_path) = mooncake_python() else { return };
    let mut transport = ChildTransport::start(vec![python_path.clone(), script("mooncake_engine.py")]).unwrap();
    let identity = transport.identity();
    assert_eq!(identity.name, "child:mooncake-transfer-engine");
    assert_eq!(identity.version, "0.3.13.post1");
    let report = certify_on(&mut transport, &options());
    let lines: Vec<String> =
        report.results.iter().map(|result| format!("{:?} {} {}", result.verdict, result.id, result.detail)).collect();
    let seam: Vec<&String> = lines.iter().filter(|line| line.contains(" seam/")).collect();
    assert!(seam.iter().all(|line| line.starts_with("Pass")), "{seam:#?}");
    let scenarios: Vec<&String> = lines.iter().filter(|line| line.contains(" scenario/")).collect();
    assert!(scenarios.iter().all(|line| line.starts_with("Pass")), "{scenarios:#?}");

    let scenario = "scenarios/engines/dcp-relayout-two-stages.yaml";
    let env = [("KVRELAY_MOONCAKE_PYTHON", python_path.as_str())];
    let output =
        crate::support::kvrelay_with_env(&["launch", scenario, "--fabric", "mooncake", "--timeout", "30"], &env);
    let out = format!("{}{}", text(&output.stdout), text(&output.stderr));
    assert!(output.status.success() && out.contains("pass dcp-relayout-two-stages (4 processes, mooncake)"), "{out}");
}
