//! The C ABI plug-in fabric (`fabric::plugin`) over the sample plug-in in C (tests/plugins/memcpy), built here
//! with the system C compiler: identity and caps, writes, protection, flush, notifications, the planted wrong
//! offset caught byte for byte and by the oracle through the engines, and load errors with clear messages.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use kvrelay::certify::Transport;
use kvrelay::engine::live::{self, LiveOptions};
use kvrelay::engine::sim::SimOptions;
use kvrelay::fabric::plugin::{Plugin, PluginError, PluginTransport, ABI_VERSION};
use kvrelay::fabric::verbs::{
    Caps, Endpoint, MemoryRegion, NodeId, QpInfo, QpNum, RemoteAddr, Sge, WcKind, WcStatus, WorkCompletion, WorkRequest,
};
use kvrelay::harness;
use kvrelay::verify;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where the tests build their plug-ins: inside target/, one file per variant, replaced atomically.
fn build_dir() -> PathBuf {
    let dir = root().join("target").join("it-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles `source` into `target/it-plugins/<name>` with `cc` and `defines`; panics with the compiler's words.
fn compile(name: &str, source: &Path, defines: &[&str]) -> PathBuf {
    let out = build_dir().join(name);
    let partial = build_dir().join(format!("{name}.{}.partial", std::process::id()));
    let mut command = Command::new("cc");
    command.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I"]);
    command.arg(root().join("src/fabric")).args(defines).arg("-o").arg(&partial).arg(source);
    let output = command.output().unwrap_or_else(|error| {
        panic!("cannot run the system C compiler `cc` ({error}): install one (apt-get install gcc) to test plug-ins")
    });
    assert!(
        output.status.success(),
        "cc failed to build {name} from {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::rename(&partial, &out).unwrap();
    out
}

/// Holds off the other tests of this file: the dynamic loader shares one instance of a shared object between every
/// load of it in the process, and a plug-in is called from one thread at a time (kvrelay_transport.h, "Threads").
pub(crate) fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn sample_source() -> PathBuf {
    root().join("tests/plugins/memcpy/memcpy_transport.c")
}

/// The clean sample, built once per test process.
pub(crate) fn clean() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| compile("libkvrelay_memcpy.so", &sample_source(), &[]))
}

/// The sample with its planted wrong offset.
pub(crate) fn planted() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        compile("libkvrelay_memcpy_planted.so", &sample_source(), &["-DKVRELAY_SAMPLE_PLANT_WRONG_OFFSET"])
    })
}

const CAPS: Caps = Caps { max_sge: 4, max_message: 1 << 20, sq_depth: 64 };

/// Two endpoints of one plug-in with one QP each, connected to each other.
struct Link {
    sender: Box<dyn Endpoint>,
    receiver: Box<dyn Endpoint>,
    send_qp: QpNum,
    recv_qp: QpNum,
    source: MemoryRegion,
    target: MemoryRegion,
    transport: PluginTransport,
}

/// A link whose source region holds `source_len` bytes 1, 2, 3, ... and whose target region is `target_len` zeros.
fn link(path: &Path, source_len: usize, target_len: usize) -> Link {
    let mut transport = PluginTransport::load(path).unwrap();
    let mut sender = transport.open(NodeId(0), CAPS).unwrap();
    let mut receiver = transport.open(NodeId(1), CAPS).unwrap();
    let send = sender.create_qp().unwrap();
    let recv = receiver.create_qp().unwrap();
    sender.connect_qp(send.qpn, recv).unwrap();
    receiver.connect_qp(recv.qpn, send).unwrap();
    let source = sender.register((0..source_len).map(|index| (index % 251 + 1) as u8).collect()).unwrap();
    let target = receiver.register(vec![0; target_len]).unwrap();
    Link { sender, receiver, send_qp: send.qpn, recv_qp: recv.qpn, source, target, transport }
}

impl Link {
    /// A write of `len` source bytes from `from` to `to` in the target region.
    fn write(&self, wr_id: u64, from: u64, to: u64, len: u64) -> WorkRequest {
        WorkRequest {
            wr_id,
            sges: vec![Sge { addr: self.source.addr + from, len, lkey: self.source.lkey }],
            remote: RemoteAddr { addr: self.target.addr + to, rkey: self.target.rkey },
            imm: None,
            signaled: true,
        }
    }

    fn target_bytes(&self) -> Vec<u8> {
        let mut out = vec![0; self.target.len as usize];
        self.receiver.read_local(&self.target, 0, &mut out).unwrap();
        out
    }

    fn source_bytes(&self, from: u64, len: u64) -> Vec<u8> {
        let mut out = vec![0; len as usize];
        self.sender.read_local(&self.source, from, &mut out).unwrap();
        out
    }
}

fn poll(endpoint: &mut dyn Endpoint) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    endpoint.poll_cq(&mut out, 64);
    out
}

#[test]
fn the_sample_plugin_reads_back_its_identity_and_caps() {
    let _serial = serial();
    let transport = PluginTransport::load(clean()).unwrap();
    let identity = transport.identity();
    assert_eq!(identity.name, "plugin:memcpy-sample");
    assert_eq!(identity.version, "1.0.0");
    assert_eq!(identity.facts["planted_wrong_offset"], "0");
    assert_eq!(identity.facts["abi_version"], ABI_VERSION.to_string());
    assert_eq!(identity.facts["path"], clean().canonicalize().unwrap().display().to_string());
    let limits = transport.plugin().capabilities();
    assert_eq!((limits.max_sge, limits.sq_depth, limits.max_message), (16, 4096, 1 << 30));
    assert_eq!(limits.max_registered_bytes, 1 << 40);
    // An endpoint grants what it is asked within those limits, and never more.
    let plugin = transport.plugin();
    let endpoint = plugin.open(NodeId(3), CAPS).unwrap();
    assert_eq!((endpoint.caps(), endpoint.node()), (CAPS, NodeId(3)));
    let greedy = plugin.open(NodeId(4), Caps { max_sge: 99, max_message: u64::MAX, sq_depth: 1 << 20 }).unwrap();
    assert_eq!(greedy.caps(), Caps { max_sge: 16, max_message: 1 << 30, sq_depth: 4096 });
    assert_eq!(PluginTransport::load(planted()).unwrap().identity().name, "plugin:memcpy-sample-planted");
}

#[test]
fn a_write_lands_and_completes() {
    let _serial = serial();
    let mut link = link(clean(), 256, 512);
    let wr = link.write(7, 16, 100, 64);
    link.sender.post_send(link.send_qp, &[wr]).unwrap();
    let completions = poll(link.sender.as_mut());
    assert_eq!(
        completions,
        vec![WorkCompletion {
            wr_id: 7,
            qp: link.send_qp,
            status: WcStatus::Success,
            kind: WcKind::Write,
            imm: None,
            byte_len: 64
        }]
    );
    let target = link.target_bytes();
    assert_eq!(target[100..164], link.source_bytes(16, 64)[..]);
    assert!(target[..100].iter().chain(&target[164..]).all(|&byte| byte == 0), "bytes outside the write changed");
    assert!(poll(link.receiver.as_mut()).is_empty(), "a plain WRITE notifies nobody");
}

#[test]
fn a_write_out_of_the_remote_region_completes_remote_access_writes_nothing_and_flushes_what_follows() {
    let _serial = serial();
    let mut link = link(clean(), 256, 512);
    let mut straddling = link.write(1, 0, 500, 16);
    straddling.signaled = false;
    let after = link.write(2, 0, 0, 16);
    link.sender.post_send(link.send_qp, &[straddling, after]).unwrap();
    let statuses: Vec<(u64, WcStatus, u64)> =
        poll(link.sender.as_mut()).iter().map(|wc| (wc.wr_id, wc.status, wc.byte_len)).collect();
    assert_eq!(statuses, vec![(1, WcStatus::RemoteAccess, 0), (2, WcStatus::Flushed, 0)]);
    // A QP in the error state stays there: a later post is flushed too.
    link.sender.post_send(link.send_qp, &[link.write(3, 0, 0, 8)]).unwrap();
    let later: Vec<WcStatus> = poll(link.sender.as_mut()).iter().map(|wc| wc.status).collect();
    assert_eq!(later, vec![WcStatus::Flushed]);
    assert!(link.target_bytes().iter().all(|&byte| byte == 0), "a failed or flushed write changed the target");
}

#[test]
fn a_write_with_a_bad_lkey_completes_local_protection() {
    let _serial = serial();
    let mut link = link(clean(), 256, 512);
    let mut wr = link.write(4, 0, 0, 16);
    wr.sges[0].lkey = link.target.lkey; // a key of the other node
    link.sender.post_send(link.send_qp, &[wr]).unwrap();
    assert_eq!(poll(link.sender.as_mut())[0].status, WcStatus::LocalProtection);
}

#[test]
fn write_with_imm_notifies_the_receiver_after_the_data() {
    let _serial = serial();
    let mut link = link(clean(), 256, 512);
    let mut wr = link.write(9, 0, 32, 128);
    wr.imm = Some(0xfeed);
    wr.signaled = false;
    link.sender.post_send(link.send_qp, &[wr]).unwrap();
    let notes = poll(link.receiver.as_mut());
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!((notes[0].kind, notes[0].imm, notes[0].qp), (WcKind::RecvImm, Some(0xfeed), link.recv_qp));
    assert_eq!((notes[0].status, notes[0].byte_len), (WcStatus::Success, 128));
    assert_eq!(link.target_bytes()[32..160], link.source_bytes(0, 128)[..]);
    assert!(poll(link.sender.as_mut()).is_empty(), "an unsignalled success completes nothing at the sender");
}

#[test]
fn a_peer_that_is_not_connected_back_completes_retry_exceeded() {
    let _serial = serial();
    let mut transport = PluginTransport::load(clean()).unwrap();
    let mut sender = transport.open(NodeId(0), CAPS).unwrap();
    let mut receiver = transport.open(NodeId(1), CAPS).unwrap();
    let send = sender.create_qp().unwrap();
    let lonely: QpInfo = receiver.create_qp().unwrap();
    sender.connect_qp(send.qpn, lonely).unwrap();
    let source = sender.register(vec![1; 64]).unwrap();
    let target = receiver.register(vec![0; 64]).unwrap();
    let wr = WorkRequest {
        wr_id: 5,
        sges: vec![Sge { addr: source.addr, len: 8, lkey: source.lkey }],
        remote: RemoteAddr { addr: target.addr, rkey: target.rkey },
        imm: None,
        signaled: true,
    };
    sender.post_send(send.qpn, &[wr]).unwrap();
    assert_eq!(poll(sender.as_mut())[0].status, WcStatus::RetryExceeded);
    assert_eq!(receiver.deregister(&target).unwrap(), vec![0; 64]);
}

#[test]
fn deregistration_revokes_the_keys_and_hands_the_bytes_back() {
    let _serial = serial();
    let mut link = link(clean(), 64, 64);
    link.sender.post_send(link.send_qp, &[link.write(1, 0, 0, 8)]).unwrap();
    assert_eq!(poll(link.sender.as_mut())[0].status, WcStatus::Success);
    let bytes = link.receiver.deregister(&link.target).unwrap();
    assert_eq!(bytes[..8], link.source_bytes(0, 8)[..]);
    link.sender.post_send(link.send_qp, &[link.write(2, 0, 0, 8)]).unwrap();
    assert_eq!(poll(link.sender.as_mut())[0].status, WcStatus::RemoteAccess);
}

/// Where a 128-byte write to `offset` of a 16 KiB region lands on `path`'s plug-in: the offset of the copied bytes.
fn landing(path: &Path, offset: u64) -> usize {
    let mut link = link(path, 256, 16384);
    link.sender.post_send(link.send_qp, &[link.write(1, 0, offset, 128)]).unwrap();
    assert_eq!(poll(link.sender.as_mut())[0].status, WcStatus::Success, "the planted bug hides behind no error");
    let target = link.target_bytes();
    let expected = link.source_bytes(0, 128);
    let at = target.windows(128).position(|window| window == expected).expect("the bytes landed somewhere");
    let written = target.iter().filter(|&&byte| byte != 0).count();
    assert_eq!(written, 128, "exactly the write's bytes changed");
    at
}

#[test]
fn the_planted_variant_misplaces_a_write_at_offset_4096_or_more_and_the_clean_one_does_not() {
    let _serial = serial();
    assert_eq!(landing(clean(), 8192), 8192);
    assert_eq!(landing(clean(), 4096), 4096);
    assert_eq!(landing(planted(), 8192), 8192 + 64);
    assert_eq!(landing(planted(), 4096), 4096 + 64);
    // Small offsets, as small conformance cases use, land right even on the planted variant.
    assert_eq!(landing(planted(), 100), 100);
    // Where the shifted write would not fit, it lands right (no protection error would hide the bug).
    assert_eq!(landing(planted(), 16384 - 128), 16384 - 128);
}

/// Runs the engines of `path` (a scenario file) over the plug-in and returns the oracle's violations and the
/// run's failed requests.
fn engines_over(plugin: &Path, scenario: &str) -> (Vec<verify::Violation>, Vec<(kvrelay::model::RankId, u64, String)>) {
    let scenario = kvrelay::scenario::load(&root().join(scenario)).unwrap();
    let problem = &scenario.problem;
    let mut transport = PluginTransport::load(plugin).unwrap();
    let caps = SimOptions::default().caps;
    let run = live::run_local(problem, &LiveOptions::default(), |node| transport.engine(node, caps)).unwrap();
    let mut violations = Vec::new();
    for layout in &problem.decode.ranks {
        let verdicts = harness::verdicts(&scenario.expect, &run, layout.rank);
        violations.extend(verify::check_rank(problem, layout.rank, &run.observation, &verdicts));
    }
    assert!(transport.faults().is_empty(), "the sample plug-in broke the ABI: {:?}", transport.faults());
    (violations, run.failures())
}

#[test]
fn the_engines_over_the_clean_plugin_pass_the_oracle_and_over_the_planted_one_fail_it() {
    let _serial = serial();
    let scenario = "scenarios/basic/baseline-tp1-to-tp1.yaml";
    let (violations, failures) = engines_over(clean(), scenario);
    assert!(violations.is_empty(), "{}", kvrelay::render::violations(&violations));
    assert!(failures.is_empty(), "{failures:?}");
    let (violations, _) = engines_over(planted(), scenario);
    assert!(!violations.is_empty(), "the oracle missed the planted wrong offset");
}

#[test]
fn a_missing_file_is_refused_with_its_path_and_the_fix() {
    let _serial = serial();
    let path = build_dir().join("no-such-plugin.so");
    let error = Plugin::load(&path).unwrap_err();
    assert!(matches!(error, PluginError::NotFound { .. }), "{error:?}");
    let text = error.to_string();
    assert!(text.contains(&path.display().to_string()) && text.contains("ci/plugin.sh"), "{text}");
}

#[test]
fn a_file_that_is_not_a_shared_object_is_refused() {
    let _serial = serial();
    let path = build_dir().join(format!("not-a-plugin.{}.so", std::process::id()));
    std::fs::write(&path, "#!/bin/sh\necho this is not ELF\n").unwrap();
    let error = Plugin::load(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(error, PluginError::NotSharedObject { .. }), "{error:?}");
    let text = error.to_string();
    assert!(text.contains("not a loadable shared object") && text.contains("-shared -fPIC"), "{text}");
}

#[test]
fn a_plugin_of_another_abi_version_is_refused() {
    let _serial = serial();
    let path = compile("libkvrelay_memcpy_abi999.so", &sample_source(), &["-DSAMPLE_ABI_VERSION=999u"]);
    let error = Plugin::load(&path).unwrap_err();
    assert!(matches!(error, PluginError::AbiMismatch { found: 999, expected: ABI_VERSION, .. }), "{error:?}");
    let text = error.to_string();
    assert!(text.contains("ABI version 999") && text.contains("rebuild it against"), "{text}");
}

#[test]
fn a_shared_object_without_the_entry_symbol_is_refused() {
    let _serial = serial();
    let source = build_dir().join(format!("no_entry.{}.c", std::process::id()));
    std::fs::write(&source, "int kvrelay_something_else(void) { return 1; }\n").unwrap();
    let path = compile("libkvrelay_no_entry.so", &source, &[]);
    std::fs::remove_file(&source).unwrap();
    let error = Plugin::load(&path).unwrap_err();
    assert!(matches!(error, PluginError::MissingSymbol { .. }), "{error:?}");
    assert!(error.to_string().contains("kvrelay_transport_v1"), "{error}");
}

/// The sample built with test hook `SAMPLE_MISBEHAVE=<mode>` (see memcpy_transport.c).
fn misbehaving(mode: u32) -> PathBuf {
    let define = format!("-DSAMPLE_MISBEHAVE={mode}");
    compile(&format!("libkvrelay_memcpy_misbehave{mode}.so"), &sample_source(), &[&define])
}

/// Posts two signalled writes and one more afterwards on a misbehaving plug-in: what completes, and the faults.
fn misbehaving_run(mode: u32) -> (Vec<(u64, WcStatus)>, Vec<String>) {
    let plugin = Plugin::load(misbehaving(mode)).unwrap();
    let mut sender = plugin.open(NodeId(0), CAPS).unwrap();
    let mut receiver = plugin.open(NodeId(1), CAPS).unwrap();
    let send = sender.create_qp().unwrap();
    let recv = receiver.create_qp().unwrap();
    sender.connect_qp(send.qpn, recv).unwrap();
    receiver.connect_qp(recv.qpn, send).unwrap();
    let source = sender.register(vec![7; 64]).unwrap();
    let target = receiver.register(vec![0; 64]).unwrap();
    let wr = |wr_id: u64| WorkRequest {
        wr_id,
        sges: vec![Sge { addr: source.addr, len: 8, lkey: source.lkey }],
        remote: RemoteAddr { addr: target.addr, rkey: target.rkey },
        imm: None,
        signaled: true,
    };
    sender.post_send(send.qpn, &[wr(1), wr(2)]).unwrap();
    let mut completions = poll(&mut sender);
    sender.post_send(send.qpn, &[wr(3)]).unwrap();
    completions.extend(poll(&mut sender));
    assert!(completions.iter().all(|wc| wc.byte_len == 0 && wc.kind == WcKind::Write && wc.qp == send.qpn));
    (completions.iter().map(|wc| (wc.wr_id, wc.status)).collect(), sender.faults())
}

#[test]
fn a_plugin_that_breaks_its_completions_gets_completions_in_error_and_faults() {
    let _serial = serial();
    let in_error = vec![(1, WcStatus::LocalProtection), (2, WcStatus::Flushed), (3, WcStatus::Flushed)];
    for (mode, fault) in
        [(1, "unknown status code 77"), (2, "never created"), (3, "byte_len 9 for a work request of 8")]
    {
        let (completions, faults) = misbehaving_run(mode);
        assert_eq!(completions, in_error, "SAMPLE_MISBEHAVE={mode}");
        assert!(faults[0].contains(fault), "SAMPLE_MISBEHAVE={mode}: {faults:?}");
    }
}

#[test]
fn a_plugin_with_a_null_info_or_a_null_function_is_refused() {
    let _serial = serial();
    let error = Plugin::load(misbehaving(4)).unwrap_err();
    assert!(matches!(error, PluginError::BadInfo { .. }), "{error:?}");
    assert!(error.to_string().contains("returned NULL"), "{error}");
    let error = Plugin::load(misbehaving(5)).unwrap_err();
    assert!(matches!(error, PluginError::NullFunction { function: "post", .. }), "{error:?}");
    assert!(error.to_string().contains("only `wait` and `last_error` may be NULL"), "{error}");
}

#[test]
fn reset_closes_the_endpoints_which_still_hand_their_memory_back() {
    let _serial = serial();
    let mut link = link(clean(), 64, 64);
    link.sender.post_send(link.send_qp, &[link.write(1, 0, 0, 8)]).unwrap();
    link.transport.settle();
    link.transport.step();
    assert_eq!(poll(link.sender.as_mut())[0].status, WcStatus::Success);
    link.transport.reset();
    let error = link.sender.post_send(link.send_qp, &[link.write(2, 0, 0, 8)]).unwrap_err();
    assert!(error.to_string().contains("closed"), "{error}");
    assert!(link.sender.create_qp().is_err());
    let mut landed = vec![0; 8];
    link.receiver.read_local(&link.target, 0, &mut landed).unwrap();
    assert_eq!(landed, link.source_bytes(0, 8));
    assert_eq!(link.receiver.deregister(&link.target).unwrap()[..8], landed[..]);
    // The transport opens fresh endpoints after a reset.
    assert!(link.transport.open(NodeId(0), CAPS).is_ok());
}
