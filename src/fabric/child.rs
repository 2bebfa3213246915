//! The child-process fabric: a transfer engine that lives in another program, spoken to over the transport
//! protocol `kvrelay-transport-1` (spec `child/README.md`, JSON Schemas `child/schema/`), so that an engine with no
//! C API (Mooncake's Transfer Engine is pybind11 only) or any vendor's Python-first engine meets the
//! transfer-engine seam ([`TransferEngine`]) natively and is certified like every other fabric
//! (`--fabric child:COMMAND`, `--fabric mooncake`).
//!
//! - **Session.** [`ChildTransport`] starts COMMAND (split on whitespace, no shell) in its own process group with
//!   pipes, and talks JSON lines: one request, one response, in order. The first exchange is `hello` (protocol
//!   version in, the engine's name, version, facts and limits out); then the seam's calls as ops (`engine`,
//!   `register`, `release`, `open`, `connect`, `submit`, `cancel`, `poll`, `settle`, `close`, `reset`, `bye`).
//!   Every node of one transport shares the one child; engines are numbered inside it.
//! - **Memory is shared, never copied through the pipe.** Each registration is a file kvrelay creates (under
//!   `/dev/shm`, or `$KVRELAY_SHM_DIR`), fills with the [`Fill`] and hands to the child by path; the child maps the
//!   file and registers *its* mapping with its engine. kvrelay reads and releases through the same file
//!   (`pread`, the page cache both sides share), so the oracle judges the very bytes the engine wrote. No `unsafe`
//!   and no mapping on this side. Files are removed at release and when an engine is dropped.
//! - **Misbehaviour is an error, never a panic or a hang.** Every read from the child has a deadline (a reader
//!   thread and a channel; `hello` [`STARTUP_TIMEOUT`], every other op [`CALL_TIMEOUT`] or
//!   `$KVRELAY_CHILD_TIMEOUT` seconds). A child that exits, hangs, writes a line that is not JSON or is longer than
//!   [`MAX_LINE_BYTES`], answers another op or sequence number, names a batch, connection or engine it never gave,
//!   or breaks a field's type is *broken*: it is killed (its process group), the text names the command, the op and
//!   the field (and the child's last stderr lines), every later call fails with it
//!   ([`SeamError::Engine`]), and every batch in flight completes [`BatchStatus::Aborted`] with it as the detail.
//!   [`Transport::reset`] starts a fresh child after a broken one. A child's *refusal* (`"ok": false` with an
//!   error kind) is not misbehaviour: it becomes the matching [`SeamError`].
//! - **Checks stay in the child.** kvrelay passes every call through (it refuses only device memory, which a file
//!   cannot stand for): the child's refusals, limits and completions are what certification judges.
//!
//! The child's stderr is kept (its last lines go into errors) and shown prefixed `child: ` with
//! `KVRELAY_CHILD_STDERR=1`. `tests/transports/memcpy_engine.py` is the reference child (plain copies, standard
//! library only); `tests/transports/mooncake_engine.py` puts Mooncake's Transfer Engine behind the protocol.

#![allow(
    clippy::disallowed_methods,
    reason = "the child transport is a process edge: every read from the child has a wall-clock deadline"
)]

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::seam::{
    Batch, BatchId, BatchStatus, Cancelled, Completion, ConnId, Event, Fill, Image, Landed, Memory, MemoryKind, NodeId,
    PeerAddress, RemoteMemory, SeamError, SeamErrorKind, SeamLimits, TransferEngine,
};
use super::transport::{Identity, Transport, TransportError};
use super::verbs::Caps;

/// The protocol's name in `hello`.
pub const PROTOCOL: &str = "kvrelay-transport";
/// The protocol version kvrelay speaks (`kvrelay-transport-1`).
pub const VERSION: u64 = 1;
/// Longest line a child may write.
pub const MAX_LINE_BYTES: u64 = 64 << 20;
/// How long a child may take to start and answer `hello` (imports are paid here).
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a child may take to answer any other op (`$KVRELAY_CHILD_TIMEOUT` seconds replaces it).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The environment variable giving [`CALL_TIMEOUT`] in seconds.
pub const TIMEOUT_ENV: &str = "KVRELAY_CHILD_TIMEOUT";
/// The environment variable that shows the child's stderr (`1`).
pub const STDERR_ENV: &str = "KVRELAY_CHILD_STDERR";
/// The environment variable naming the directory of registration files (default `/dev/shm`).
pub const SHM_ENV: &str = "KVRELAY_SHM_DIR";
/// The JSON Schema of what kvrelay writes (`child/schema/request.schema.json`).
pub const REQUEST_SCHEMA: &str = include_str!("child/schema/request.schema.json");
/// The JSON Schema of what the child answers (`child/schema/response.schema.json`).
pub const RESPONSE_SCHEMA: &str = include_str!("child/schema/response.schema.json");

/// The largest registration kvrelay makes a file for.
const MAX_REGISTRATION: u64 = 1 << 40;
/// Bytes filled per write while registering.
const FILL_CHUNK: u64 = 4 << 20;
/// The child's stderr lines kept for error messages.
const STDERR_TAIL: usize = 6;
/// How long [`Transport::step`] lets pass.
const STEP: Duration = Duration::from_millis(1);
/// How long [`Transport::settle`] lets the child wait for its batches.
const SETTLE: Duration = Duration::from_secs(5);
/// How long a dropped transport waits for the child's answer to `bye` before killing it.
const BYE: Duration = Duration::from_secs(2);

/// Registration files made by this process, numbered.
static FILES: AtomicU64 = AtomicU64::new(0);

/// Deadlines of a child's answers, and where registration files go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildOptions {
    /// For `hello`.
    pub startup: Duration,
    /// For every other op.
    pub call: Duration,
    /// The directory of registration files.
    pub shm_dir: PathBuf,
}

impl Default for ChildOptions {
    /// [`STARTUP_TIMEOUT`]; [`CALL_TIMEOUT`] or `$KVRELAY_CHILD_TIMEOUT` seconds; `$KVRELAY_SHM_DIR`, else
    /// `/dev/shm`, else the temporary directory.
    fn default() -> ChildOptions {
        let call = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .filter(|seconds| *seconds > 0)
            .map_or(CALL_TIMEOUT, Duration::from_secs);
        ChildOptions { startup: STARTUP_TIMEOUT, call, shm_dir: shm_dir() }
    }
}

/// What the child said of itself in `hello`.
#[derive(Debug, Clone)]
struct Hello {
    engine: String,
    version: String,
    facts: BTreeMap<String, String>,
    limits: SeamLimits,
}

/// The running child: its process, the writer thread's queue, the reader thread's lines, its stderr's last lines.
struct Running {
    child: Child,
    lines_out: Sender<String>,
    lines_in: Receiver<Result<String, String>>,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

/// Why a call did not give an answer.
enum CallError {
    /// The child refused (`"ok": false`): the seam error's kind, its message and the whole error object.
    Refused { kind: SeamErrorKind, message: String, error: Map<String, Value> },
    /// The child misbehaved; the whole text.
    Broken(String),
}

/// One child process and the protocol's state, shared by every engine of a transport.
struct Session {
    argv: Vec<String>,
    command: String,
    timeouts: ChildOptions,
    running: Option<Running>,
    hello: Option<Hello>,
    seq: u64,
    /// Why the child is broken (every later call fails with it).
    broken: Option<String>,
    /// Counts resets: an engine of an earlier generation is stale.
    generation: u64,
    /// Engine ids the child gave and not yet closed.
    engines: BTreeSet<u64>,
}

impl Session {
    fn new(argv: Vec<String>, timeouts: ChildOptions) -> Session {
        let command = argv.join(" ");
        Session {
            argv,
            command,
            timeouts,
            running: None,
            hello: None,
            seq: 0,
            broken: None,
            generation: 0,
            engines: BTreeSet::new(),
        }
    }

    /// The start of every text about the child.
    fn who(&self) -> String {
        format!("the transport child `{}`", self.command)
    }

    /// Starts the child and exchanges `hello`; on failure the session is broken with the reason.
    fn start(&mut self) -> Result<(), String> {
        self.stop();
        self.broken = None;
        self.engines.clear();
        let result = self.spawn().and_then(|()| self.hello());
        if let Err(text) = &result {
            self.stop();
            self.broken = Some(text.clone());
        }
        result
    }

    fn spawn(&mut self) -> Result<(), String> {
        let (program, args) = self.argv.split_first().ok_or_else(|| format!("{}: the command is empty", self.who()))?;
        let mut child = Command::new(program)
            .args(args)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|error| format!("{} cannot start: {error}", self.who()))?;
        let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let (Some(mut stdin), Some(stdout), Some(stderr)) = (stdin, stdout, stderr) else {
            stop(child);
            return Err(format!("{}: no pipes to the child", self.who()));
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let kept = Arc::clone(&tail);
        let show = std::env::var(STDERR_ENV).is_ok_and(|value| value == "1");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if show {
                    let _ = writeln!(std::io::stderr(), "child: {line}");
                }
                if let Ok(mut tail) = kept.lock() {
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        });
        let (lines_out, to_write) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in to_write {
                if stdin.write_all(line.as_bytes()).and_then(|()| stdin.write_all(b"\n")).is_err() {
                    return;
                }
                let _ = stdin.flush();
            }
        });
        let (sender, lines_in) = mpsc::channel();
        std::thread::spawn(move || read_lines(BufReader::new(stdout), &sender));
        self.running = Some(Running { child, lines_out, lines_in, stderr: tail });
        Ok(())
    }

    fn hello(&mut self) -> Result<(), String> {
        let answer = match self.exchange("hello", json!({"protocol": PROTOCOL, "version": VERSION})) {
            Ok(answer) => answer,
            Err(CallError::Broken(text)) => return Err(text),
            Err(CallError::Refused { message, .. }) => {
                return Err(format!("{} refused the hello of {PROTOCOL} version {VERSION}: {message}", self.who()))
            }
        };
        let field = Fields { session: self, op: "hello", map: &answer };
        let protocol = field.text("protocol")?;
        let version = field.u64("version")?;
        if protocol != PROTOCOL || version != VERSION {
            return Err(field.wrong(
                "version",
                &format!("speaks {protocol} version {version}, kvrelay speaks {PROTOCOL} version {VERSION}"),
            ));
        }
        let engine = field.text("engine")?;
        let version = field.text("engine_version")?;
        let mut facts = BTreeMap::new();
        match answer.get("facts") {
            None | Some(Value::Null) => {}
            Some(Value::Object(map)) => {
                for (name, value) in map {
                    let value = match value {
                        Value::String(text) => text.clone(),
                        other => other.to_string(),
                    };
                    facts.insert(name.clone(), value);
                }
            }
            Some(_) => return Err(field.wrong("facts", "expected an object of texts")),
        }
        let limits = match answer.get("limits") {
            Some(Value::Object(map)) => {
                let limits = Fields { session: self, op: "hello", map };
                let positive = |name: &str| -> Result<u64, String> {
                    let value = limits.u64(name)?;
                    if value == 0 {
                        return Err(limits.wrong(name, "must be at least 1"));
                    }
                    Ok(value)
                };
                let max_entries = usize::try_from(positive("max_entries")?).unwrap_or(usize::MAX);
                let max_batch_bytes = positive("max_batch_bytes")?;
                let batches_in_flight = usize::try_from(positive("batches_in_flight")?).unwrap_or(usize::MAX);
                SeamLimits { max_entries, max_batch_bytes, batches_in_flight, strided: false, paged: false }
            }
            _ => return Err(field.wrong("limits", "expected {max_entries, max_batch_bytes, batches_in_flight}")),
        };
        self.hello = Some(Hello { engine, version, facts, limits });
        Ok(())
    }

    /// Sends `op` with `fields` and returns the answer's fields; a broken child breaks the session.
    fn call(&mut self, op: &'static str, fields: Value) -> Result<Map<String, Value>, CallError> {
        if let Some(text) = &self.broken {
            return Err(CallError::Broken(text.clone()));
        }
        let result = self.exchange(op, fields);
        if let Err(CallError::Broken(text)) = &result {
            self.stop();
            self.broken = Some(text.clone());
        }
        result
    }

    /// Marks the child broken by a bad answer to `op` (`text` from [`Fields`]) and returns the text.
    fn break_with(&mut self, text: String) -> String {
        self.stop();
        self.broken.get_or_insert(text).clone()
    }

    fn exchange(&mut self, op: &'static str, fields: Value) -> Result<Map<String, Value>, CallError> {
        let who = self.who();
        self.seq += 1;
        let seq = self.seq;
        let mut message = match fields {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        message.insert("op".to_owned(), Value::from(op));
        message.insert("seq".to_owned(), Value::from(seq));
        let timeout = if op == "hello" { self.timeouts.startup } else { self.timeouts.call };
        let Some(running) = self.running.as_mut() else {
            return Err(CallError::Broken(format!("{who} is not running (op `{op}`)")));
        };
        if running.lines_out.send(Value::Object(message).to_string()).is_err() {
            let why = exited(running, "closed its input");
            return Err(CallError::Broken(format!("{who} {why} (op `{op}`)")));
        }
        let line = match running.lines_in.recv_timeout(timeout) {
            Ok(Ok(line)) => line,
            Ok(Err(why)) => return Err(CallError::Broken(format!("{who} {} (op `{op}`)", exited(running, &why)))),
            Err(RecvTimeoutError::Timeout) => {
                let seconds = timeout.as_secs_f64();
                return Err(CallError::Broken(format!("{who} gave no answer to op `{op}` within {seconds:.1} s")));
            }
            Err(RecvTimeoutError::Disconnected) => {
                let why = exited(running, "closed its output");
                return Err(CallError::Broken(format!("{who} {why} (op `{op}`)")));
            }
        };
        let bad = |problem: String| CallError::Broken(format!("{who}: op `{op}`: {problem}: {}", excerpt(&line)));
        let value: Value =
            serde_json::from_str(&line).map_err(|error| bad(format!("an answer that is not JSON ({error})")))?;
        let Value::Object(mut answer) = value else {
            return Err(bad("an answer that is not a JSON object".to_owned()));
        };
        match answer.get("seq") {
            Some(value) if value.as_u64() == Some(seq) => {}
            Some(value) => return Err(bad(format!("field `seq`: answered {value}, expected {seq}"))),
            None => return Err(bad("field `seq` is missing".to_owned())),
        }
        match answer.get("op") {
            Some(Value::String(answered)) if answered == op => {}
            Some(value) => return Err(bad(format!("field `op`: answered {value}, expected \"{op}\""))),
            None => return Err(bad("field `op` is missing".to_owned())),
        }
        match answer.get("ok") {
            Some(Value::Bool(true)) => {
                answer.remove("seq");
                answer.remove("op");
                answer.remove("ok");
                Ok(answer)
            }
            Some(Value::Bool(false)) => {
                let Some(Value::Object(error)) = answer.remove("error") else {
                    return Err(bad("field `error`: expected {kind, message} with `ok: false`".to_owned()));
                };
                let kind = error.get("kind").and_then(Value::as_str).unwrap_or_default();
                let Some(kind) = seam_kind(kind) else {
                    let known = KIND_NAMES.iter().map(|(_, name)| *name).collect::<Vec<_>>().join(", ");
                    return Err(bad(format!("field `error.kind`: {kind:?} is not one of {known}")));
                };
                let Some(message) = error.get("message").and_then(Value::as_str) else {
                    return Err(bad("field `error.message`: expected a text".to_owned()));
                };
                Err(CallError::Refused { kind, message: message.to_owned(), error })
            }
            _ => Err(bad("field `ok`: expected true or false".to_owned())),
        }
    }

    /// Says `bye` (briefly) and kills the child's process group.
    fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            stop(running.child);
        }
    }

    fn shutdown(&mut self) {
        if self.running.is_some() && self.broken.is_none() {
            self.timeouts.call = BYE;
            let _ = self.exchange("bye", json!({}));
        }
        self.stop();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Describes how the child's output ended: its exit status when it has one, and its last stderr lines.
fn exited(running: &mut Running, why: &str) -> String {
    let deadline = Instant::now() + Duration::from_millis(500);
    let status = loop {
        match running.child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => break None,
        }
    };
    // The stderr reader may still be taking the last lines in.
    std::thread::sleep(Duration::from_millis(20));
    let mut text = match status {
        Some(status) => format!("exited ({status}): {why}"),
        None => why.to_owned(),
    };
    let tail: Vec<String> = running.stderr.lock().map(|tail| tail.iter().cloned().collect()).unwrap_or_default();
    if !tail.is_empty() {
        text.push_str(&format!("; its last stderr lines: {}", tail.join(" | ")));
    }
    text
}

/// The start of a line, for messages.
fn excerpt(line: &str) -> String {
    let mut cut: String = line.chars().take(200).collect();
    if cut.len() < line.len() {
        cut.push_str("...");
    }
    format!("`{cut}`")
}

/// Kills the child's whole process group (`kill -KILL -- -PGID`: no `unsafe` for a signal), then the child (also
/// the external planner's, `running::external`).
pub(crate) fn stop(mut child: Child) {
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
    let _ = child.kill();
    let _ = child.wait();
}

/// Forwards each line of `reader` (at most [`MAX_LINE_BYTES`]) to `sender`, then why it stopped.
fn read_lines(mut reader: impl BufRead, sender: &Sender<Result<String, String>>) {
    loop {
        let mut line = Vec::new();
        let read = (&mut reader).take(MAX_LINE_BYTES).read_until(b'\n', &mut line);
        let message = match read {
            Ok(0) => Err("closed its output".to_owned()),
            Ok(_) if line.last() != Some(&b'\n') && line.len() as u64 >= MAX_LINE_BYTES => {
                Err(format!("wrote a line longer than {MAX_LINE_BYTES} bytes"))
            }
            Ok(_) => String::from_utf8(line)
                .map(|text| text.trim_end().to_owned())
                .map_err(|_| "wrote a line that is not UTF-8".to_owned()),
            Err(error) => Err(format!("could not be read: {error}")),
        };
        let end = message.is_err();
        if sender.send(message).is_err() || end {
            return;
        }
    }
}

/// The seam error kinds by their protocol names.
const KIND_NAMES: [(SeamErrorKind, &str); 9] = [
    (SeamErrorKind::UnknownMemory, "unknown_memory"),
    (SeamErrorKind::UnknownConnection, "unknown_connection"),
    (SeamErrorKind::NotConnected, "not_connected"),
    (SeamErrorKind::AlreadyConnected, "already_connected"),
    (SeamErrorKind::BadAddress, "bad_address"),
    (SeamErrorKind::OverLimits, "over_limits"),
    (SeamErrorKind::OutOfRange, "out_of_range"),
    (SeamErrorKind::Exhausted, "exhausted"),
    (SeamErrorKind::Engine, "engine"),
];

fn seam_kind(name: &str) -> Option<SeamErrorKind> {
    KIND_NAMES.iter().find(|(_, known)| *known == name).map(|(kind, _)| *kind)
}

/// The fields of one answer, with errors naming the child, the op and the field.
struct Fields<'a> {
    session: &'a Session,
    op: &'static str,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn wrong(&self, field: &str, problem: &str) -> String {
        format!("{}: op `{}`: field `{field}`: {problem}", self.session.who(), self.op)
    }

    fn u64(&self, field: &str) -> Result<u64, String> {
        match self.map.get(field) {
            Some(value) => value
                .as_u64()
                .ok_or_else(|| self.wrong(field, &format!("expected a non-negative integer, got {value}"))),
            None => Err(self.wrong(field, "missing")),
        }
    }

    fn u32(&self, field: &str) -> Result<u32, String> {
        let value = self.u64(field)?;
        u32::try_from(value).map_err(|_| self.wrong(field, &format!("{value} is larger than 2^32 - 1")))
    }

    fn text(&self, field: &str) -> Result<String, String> {
        match self.map.get(field) {
            Some(Value::String(text)) => Ok(text.clone()),
            Some(value) => Err(self.wrong(field, &format!("expected a text, got {value}"))),
            None => Err(self.wrong(field, "missing")),
        }
    }
}

/// What a refusal is about, to build the matching [`SeamError`].
#[derive(Default)]
struct About<'a> {
    conn: Option<ConnId>,
    memory: Option<u32>,
    batch: Option<&'a Batch>,
    address: Option<&'a PeerAddress>,
    exhausted: Option<&'static str>,
}

/// The [`SeamError`] a refusal of `op` stands for.
fn refusal(
    op: &'static str,
    kind: SeamErrorKind,
    message: String,
    error: &Map<String, Value>,
    about: About<'_>,
    limits: SeamLimits,
) -> SeamError {
    let number = |name: &str| error.get(name).and_then(Value::as_u64).unwrap_or(0);
    let engine = || SeamError::Engine { call: op, message: message.clone() };
    match kind {
        SeamErrorKind::UnknownMemory => {
            let memory = error.get("memory").and_then(Value::as_u64).and_then(|id| u32::try_from(id).ok());
            match memory.or(about.memory).or(about.batch.and_then(|batch| batch.entries.first().map(|e| e.local))) {
                Some(id) => SeamError::UnknownMemory(id),
                None => engine(),
            }
        }
        SeamErrorKind::UnknownConnection => about.conn.map_or_else(engine, SeamError::UnknownConnection),
        SeamErrorKind::NotConnected => about.conn.map_or_else(engine, SeamError::NotConnected),
        SeamErrorKind::AlreadyConnected => about.conn.map_or_else(engine, SeamError::AlreadyConnected),
        SeamErrorKind::BadAddress => SeamError::BadAddress {
            address: about.address.map(ToString::to_string).unwrap_or_default(),
            why: message.clone(),
        },
        SeamErrorKind::OverLimits => {
            let (entries, bytes) =
                about.batch.map_or((0, 0), |batch| (batch.entries.len(), batch.byte_len().unwrap_or(u64::MAX)));
            SeamError::OverLimits { entries, bytes, max_entries: limits.max_entries, max_bytes: limits.max_batch_bytes }
        }
        SeamErrorKind::OutOfRange => {
            SeamError::OutOfRange { offset: number("offset"), len: number("len"), region_len: number("region_len") }
        }
        SeamErrorKind::Exhausted => SeamError::Exhausted(about.exhausted.unwrap_or("the child's resources")),
        // A child is never handed strided entries (its submit refuses them first): no protocol name.
        SeamErrorKind::Strided | SeamErrorKind::Engine => engine(),
    }
}

/// One registration: kvrelay's memory, and the file the child mapped.
struct Registration {
    memory: Memory,
    file: File,
    path: PathBuf,
}

/// Where registration files go: `$KVRELAY_SHM_DIR`, else `/dev/shm`, else the temporary directory.
fn shm_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(SHM_ENV) {
        return PathBuf::from(dir);
    }
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// Creates a registration file of `len` bytes (at least one, so that every file can be mapped) holding `fill`.
fn create_file(dir: &Path, len: u64, fill: &Fill) -> Result<(File, PathBuf), SeamError> {
    let number = FILES.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("kvrelay-{}-{number}", std::process::id()));
    let failed = |what: &str, error: std::io::Error| {
        if error.kind() == std::io::ErrorKind::StorageFull {
            SeamError::Exhausted("memory (the registration files' file system is full)")
        } else {
            SeamError::Engine { call: "register", message: format!("{what} {}: {error}", path.display()) }
        }
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|error| failed("creating", error))?;
    let written = (|| {
        file.set_len(len.max(1))?;
        let mut buffer = vec![0u8; FILL_CHUNK.min(len) as usize];
        let mut offset = 0;
        while offset < len {
            let chunk = (len - offset).min(FILL_CHUNK) as usize;
            fill(offset, &mut buffer[..chunk]);
            file.write_all_at(&buffer[..chunk], offset)?;
            offset += chunk as u64;
        }
        Ok(())
    })();
    match written {
        Ok(()) => Ok((file, path)),
        Err(error) => {
            let error = failed("filling", error);
            let _ = std::fs::remove_file(&path);
            Err(error)
        }
    }
}

/// One node's transfer engine, living in the child.
pub struct ChildEngine {
    node: NodeId,
    /// The child's number for it.
    id: u64,
    session: Rc<RefCell<Session>>,
    generation: u64,
    limits: SeamLimits,
    memory: BTreeMap<u32, Registration>,
    next_memory: u32,
    /// Ends the child opened, and whether each is connected.
    conns: BTreeMap<u32, bool>,
    /// Batches submitted and not completed: their connection and entry count.
    in_flight: BTreeMap<u64, (ConnId, usize)>,
    /// Completions made here for a broken child's batches.
    ready: VecDeque<Event>,
    operations: u64,
}

impl ChildEngine {
    /// Calls `op` for this engine (its `engine` field added).
    fn call(&self, op: &'static str, fields: Value) -> Result<Map<String, Value>, CallError> {
        let mut session = self.session.borrow_mut();
        if session.generation != self.generation {
            let text = format!("{}: engine {} belongs to a case before the last reset", session.who(), self.id);
            return Err(CallError::Broken(text));
        }
        let mut fields = match fields {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        fields.insert("engine".to_owned(), Value::from(self.id));
        session.call(op, Value::Object(fields))
    }

    /// Breaks the session with a bad answer's text (from [`Fields`]); the seam error for the call.
    fn broken(&self, op: &'static str, text: String) -> SeamError {
        let text = self.session.borrow_mut().break_with(text);
        SeamError::Engine { call: op, message: text }
    }

    fn seam_error(&self, op: &'static str, error: CallError, about: About<'_>) -> SeamError {
        match error {
            CallError::Refused { kind, message, error } => refusal(op, kind, message, &error, about, self.limits),
            CallError::Broken(text) => SeamError::Engine { call: op, message: text },
        }
    }

    fn registration(&self, memory: &Memory) -> Result<&Registration, SeamError> {
        self.memory.get(&memory.id).ok_or(SeamError::UnknownMemory(memory.id))
    }

    /// Moves up to `max` completions made here into `out`.
    fn hand_out(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        let count = self.ready.len().min(max);
        out.extend(self.ready.drain(..count));
        count
    }

    /// Completes every batch in flight [`BatchStatus::Aborted`] with `text`: the child is gone.
    fn abort_all(&mut self, text: &str) {
        for (batch, (conn, _)) in std::mem::take(&mut self.in_flight) {
            self.ready.push_back(Event::Completed(Completion {
                conn,
                batch: BatchId(batch),
                status: BatchStatus::Aborted,
                landed: Landed::Unknown,
                detail: text.to_owned(),
            }));
        }
    }

    /// Checks one event of a `poll` answer and takes its batch out of flight.
    fn event(&mut self, session: &Session, index: usize, value: &Value) -> Result<Event, String> {
        let op = "poll";
        let Value::Object(map) = value else {
            return Err(format!("{}: op `poll`: field `events[{index}]`: expected an object", session.who()));
        };
        let field = Fields { session, op, map };
        let name = |inner: &str| format!("events[{index}].{inner}");
        let conn = field.u32("conn").map_err(|_| field.wrong(&name("conn"), "expected a connection number"))?;
        if !self.conns.contains_key(&conn) {
            return Err(field.wrong(&name("conn"), &format!("connection {conn} was never opened on this engine")));
        }
        match map.get("event").and_then(Value::as_str) {
            Some("notified") => {
                let tag = field.u32("tag").map_err(|_| field.wrong(&name("tag"), "expected a 32-bit tag"))?;
                Ok(Event::Notified { conn: ConnId(conn), tag })
            }
            Some("completed") => {
                let batch = field.u64("batch").map_err(|_| field.wrong(&name("batch"), "expected a batch number"))?;
                let Some(&(batch_conn, entries)) = self.in_flight.get(&batch) else {
                    return Err(field.wrong(&name("batch"), &format!("batch {batch} is not in flight on this engine")));
                };
                if batch_conn.0 != conn {
                    let problem = format!("batch {batch} was submitted on connection {}, not {conn}", batch_conn.0);
                    return Err(field.wrong(&name("conn"), &problem));
                }
                let status = map.get("status").and_then(Value::as_str).unwrap_or_default();
                let status = STATUSES.into_iter().find(|known| known.name() == status).ok_or_else(|| {
                    let names = STATUSES.map(BatchStatus::name).join(", ");
                    field.wrong(&name("status"), &format!("{status:?} is not one of {names}"))
                })?;
                let landed =
                    landed(map.get("landed"), entries).map_err(|problem| field.wrong(&name("landed"), &problem))?;
                let detail = match map.get("detail") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(text)) => text.clone(),
                    Some(_) => return Err(field.wrong(&name("detail"), "expected a text")),
                };
                self.in_flight.remove(&batch);
                Ok(Event::Completed(Completion { conn: ConnId(conn), batch: BatchId(batch), status, landed, detail }))
            }
            _ => Err(field.wrong(&name("event"), "expected \"completed\" or \"notified\"")),
        }
    }
}

/// Every batch status, as the protocol names them ([`BatchStatus::name`]).
const STATUSES: [BatchStatus; 5] = [
    BatchStatus::Success,
    BatchStatus::LocalProtection,
    BatchStatus::RemoteAccess,
    BatchStatus::Unreachable,
    BatchStatus::Aborted,
];

/// A completion's `landed`: `"all"`, `"unknown"`, or sorted disjoint `[start, end)` ranges of entry indices.
fn landed(value: Option<&Value>, entries: usize) -> Result<Landed, String> {
    match value {
        Some(Value::String(text)) if text == "all" => Ok(Landed::All),
        Some(Value::String(text)) if text == "unknown" => Ok(Landed::Unknown),
        Some(Value::Array(ranges)) => {
            let mut out = Vec::with_capacity(ranges.len());
            let mut end_before = 0u64;
            for range in ranges {
                let pair = range.as_array().filter(|pair| pair.len() == 2);
                let bounds = pair.and_then(|pair| Some((pair[0].as_u64()?, pair[1].as_u64()?)));
                let Some((start, end)) = bounds else {
                    return Err(format!("expected [start, end) pairs of entry indices, got {range}"));
                };
                if start >= end || start < end_before || end > entries as u64 {
                    return Err(format!(
                        "ranges must be non-empty, sorted, disjoint and within the batch's {entries} entries, got {range}"
                    ));
                }
                end_before = end;
                let start = u32::try_from(start).map_err(|_| format!("{start} is too large"))?;
                let end = u32::try_from(end).map_err(|_| format!("{end} is too large"))?;
                out.push(start..end);
            }
            Ok(Landed::Entries(out))
        }
        other => Err(format!("expected \"all\", \"unknown\" or a list of ranges, got {other:?}")),
    }
}

impl TransferEngine for ChildEngine {
    fn node(&self) -> NodeId {
        self.node
    }

    fn limits(&self) -> SeamLimits {
        self.limits
    }

    fn register(&mut self, kind: MemoryKind, len: u64, _item_len: u64, fill: Fill) -> Result<Memory, SeamError> {
        if kind != MemoryKind::Host {
            let message = format!("the child transport shares host memory through files only, not {kind}");
            return Err(SeamError::Engine { call: "register", message });
        }
        if len > MAX_REGISTRATION {
            return Err(SeamError::Exhausted("memory (a registration of more than 1 TiB)"));
        }
        let id = self.next_memory;
        self.next_memory = id.checked_add(1).ok_or(SeamError::Exhausted("memory ids"))?;
        let dir = self.session.borrow().timeouts.shm_dir.clone();
        let (file, path) = create_file(&dir, len, &fill)?;
        let fields = json!({"memory": id, "path": path.display().to_string(), "len": len, "kind": "host"});
        let answer = match self.call("register", fields) {
            Ok(answer) => answer,
            Err(error) => {
                let _ = std::fs::remove_file(&path);
                let about = About { memory: Some(id), exhausted: Some("memory"), ..About::default() };
                return Err(self.seam_error("register", error, about));
            }
        };
        let checked = {
            let session = self.session.borrow();
            let field = Fields { session: &session, op: "register", map: &answer };
            let addr = field.u64("addr");
            let key = field.u32("key");
            match (addr, key) {
                (Ok(0), _) => Err(field.wrong("addr", "an address is never 0")),
                (Ok(addr), _) if addr.checked_add(len).is_none() => {
                    Err(field.wrong("addr", &format!("{addr} + {len} bytes leaves the address space")))
                }
                (Ok(addr), Ok(key)) => Ok((addr, key)),
                (Err(text), _) | (_, Err(text)) => Err(text),
            }
        };
        match checked {
            Ok((addr, key)) => {
                let memory = Memory { id, kind, addr, len, key };
                self.memory.insert(id, Registration { memory, file, path });
                Ok(memory)
            }
            Err(text) => {
                let _ = std::fs::remove_file(&path);
                Err(self.broken("register", text))
            }
        }
    }

    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        let registration = self.registration(memory)?;
        let len = out.len() as u64;
        let outside = SeamError::OutOfRange { offset, len, region_len: registration.memory.len };
        if offset.checked_add(len).is_none_or(|end| end > registration.memory.len) {
            return Err(outside);
        }
        registration.file.read_exact_at(out, offset).map_err(|error| SeamError::Engine {
            call: "read",
            message: format!("reading {}: {error}", registration.path.display()),
        })
    }

    fn release(&mut self, memory: &Memory, _sparse: bool) -> Result<Image, SeamError> {
        self.registration(memory)?;
        match self.call("release", json!({"memory": memory.id})) {
            Ok(_) | Err(CallError::Broken(_)) => {}
            Err(error) => {
                return Err(self.seam_error("release", error, About { memory: Some(memory.id), ..About::default() }))
            }
        }
        // A broken child's bytes are still in the file: the oracle judges them.
        let registration = self.memory.remove(&memory.id).ok_or(SeamError::UnknownMemory(memory.id))?;
        let mut bytes = vec![0u8; registration.memory.len as usize];
        let read = registration.file.read_exact_at(&mut bytes, 0);
        let _ = std::fs::remove_file(&registration.path);
        read.map_err(|error| SeamError::Engine {
            call: "release",
            message: format!("reading {}: {error}", registration.path.display()),
        })?;
        Ok(BTreeMap::from([(0, bytes)]))
    }

    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError> {
        let answer = self.call("open", json!({})).map_err(|error| {
            self.seam_error("open", error, About { exhausted: Some("connections"), ..About::default() })
        })?;
        let checked = {
            let session = self.session.borrow();
            let field = Fields { session: &session, op: "open", map: &answer };
            let conn = field.u32("conn");
            let address = match (answer.get("address"), answer.get("address_b64")) {
                (Some(Value::String(text)), _) => Ok(text.clone().into_bytes()),
                (None, Some(Value::String(encoded))) => {
                    base64_decode(encoded).ok_or_else(|| field.wrong("address_b64", "not standard base64"))
                }
                _ => Err(field.wrong("address", "expected `address` (a text) or `address_b64`")),
            };
            match (conn, address) {
                (Ok(conn), _) if self.conns.contains_key(&conn) => {
                    Err(field.wrong("conn", &format!("connection {conn} was already opened on this engine")))
                }
                (Ok(conn), Ok(address)) => Ok((conn, address)),
                (Err(text), _) | (_, Err(text)) => Err(text),
            }
        };
        let (conn, address) = checked.map_err(|text| self.broken("open", text))?;
        self.conns.insert(conn, false);
        Ok((ConnId(conn), PeerAddress(address)))
    }

    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError> {
        let remote: Vec<Value> =
            remote.iter().map(|memory| json!({"addr": memory.addr, "len": memory.len, "key": memory.key})).collect();
        let mut fields = json!({"conn": conn.0, "remote": remote});
        match std::str::from_utf8(&peer.0) {
            Ok(text) => fields["address"] = Value::from(text),
            Err(_) => fields["address_b64"] = Value::from(base64_encode(&peer.0)),
        }
        self.call("connect", fields).map_err(|error| {
            self.seam_error("connect", error, About { conn: Some(conn), address: Some(peer), ..About::default() })
        })?;
        if let Some(connected) = self.conns.get_mut(&conn.0) {
            *connected = true;
        }
        Ok(())
    }

    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError> {
        SeamError::check_limits(&batch, SeamLimits { strided: false, ..SeamLimits::UNLIMITED })?;
        let entries: Vec<Value> = batch
            .entries
            .iter()
            .map(|entry| json!([entry.local, entry.local_offset, entry.remote, entry.remote_offset, entry.len]))
            .collect();
        let fields = json!({"conn": conn.0, "entries": entries, "notify": batch.notify});
        let answer = self.call("submit", fields).map_err(|error| {
            let about =
                About { conn: Some(conn), batch: Some(&batch), exhausted: Some("batch slots"), ..About::default() };
            self.seam_error("submit", error, about)
        })?;
        let checked = {
            let session = self.session.borrow();
            let field = Fields { session: &session, op: "submit", map: &answer };
            match field.u64("batch") {
                Ok(id) if self.in_flight.contains_key(&id) => {
                    Err(field.wrong("batch", &format!("batch {id} is already in flight on this engine")))
                }
                other => other,
            }
        };
        let id = checked.map_err(|text| self.broken("submit", text))?;
        self.in_flight.insert(id, (conn, batch.entries.len()));
        self.operations += batch.entries.len() as u64;
        Ok(BatchId(id))
    }

    fn cancel(&mut self, batch: BatchId) -> Cancelled {
        if !self.in_flight.contains_key(&batch.0) {
            return Cancelled::Ended;
        }
        let answer = match self.call("cancel", json!({"batch": batch.0})) {
            Ok(answer) => answer,
            // A refusal leaves the batch to complete; a broken child's batches complete Aborted at the next poll.
            Err(_) => return Cancelled::Draining,
        };
        match answer.get("cancelled").and_then(Value::as_str) {
            Some("whole") => {
                self.in_flight.remove(&batch.0);
                Cancelled::Whole
            }
            Some("draining") => Cancelled::Draining,
            Some("ended") => Cancelled::Ended,
            _ => {
                let text = {
                    let session = self.session.borrow();
                    Fields { session: &session, op: "cancel", map: &answer }
                        .wrong("cancelled", "expected \"whole\", \"draining\" or \"ended\"")
                };
                self.broken("cancel", text);
                Cancelled::Draining
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        let mut count = self.hand_out(out, max);
        if count == max || (self.in_flight.is_empty() && self.conns.is_empty()) {
            return count;
        }
        let want = (max - count).min(u32::MAX as usize);
        let answer = match self.call("poll", json!({"max": want})) {
            Ok(answer) => answer,
            // Broken already (or an engine of an earlier case): its batches end here.
            Err(CallError::Broken(text)) => {
                self.abort_all(&text);
                return count + self.hand_out(out, max - count);
            }
            Err(CallError::Refused { kind, message, .. }) => {
                let kind = KIND_NAMES.iter().find(|(known, _)| *known == kind).map_or("?", |(_, name)| name);
                let text = format!("{}: op `poll` refused ({kind}): {message}", self.session.borrow().who());
                let text = self.session.borrow_mut().break_with(text);
                self.abort_all(&text);
                return count + self.hand_out(out, max - count);
            }
        };
        // Events are taken one by one: those before a bad one are handed out, the bad one breaks the child.
        let session = Rc::clone(&self.session);
        let problem = {
            let session = session.borrow();
            let field = Fields { session: &session, op: "poll", map: &answer };
            match answer.get("events") {
                Some(Value::Array(events)) if events.len() > want => {
                    Some(field.wrong("events", &format!("{} events, more than the {want} asked for", events.len())))
                }
                Some(Value::Array(events)) => {
                    let mut problem = None;
                    for (index, event) in events.iter().enumerate() {
                        match self.event(&session, index, event) {
                            Ok(event) => {
                                out.push(event);
                                count += 1;
                            }
                            Err(text) => {
                                problem = Some(text);
                                break;
                            }
                        }
                    }
                    problem
                }
                _ => Some(field.wrong("events", "expected a list")),
            }
        };
        if let Some(text) = problem {
            let text = session.borrow_mut().break_with(text);
            self.abort_all(&text);
            count += self.hand_out(out, max - count);
        }
        count
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        std::thread::sleep(timeout.min(STEP));
        !self.in_flight.is_empty() || !self.ready.is_empty()
    }

    fn operations(&self) -> u64 {
        self.operations
    }
}

impl Drop for ChildEngine {
    fn drop(&mut self) {
        let same = {
            let session = self.session.borrow();
            session.generation == self.generation && session.broken.is_none()
        };
        if same {
            let _ = self.call("close", json!({}));
            self.session.borrow_mut().engines.remove(&self.id);
        }
        for registration in std::mem::take(&mut self.memory).into_values() {
            let _ = std::fs::remove_file(&registration.path);
        }
    }
}

/// A transport whose engines live in a child process speaking `kvrelay-transport-1`.
pub struct ChildTransport {
    session: Rc<RefCell<Session>>,
}

impl ChildTransport {
    /// Starts `argv` (program and arguments) and exchanges `hello`, with the default [`ChildOptions`].
    pub fn start(argv: Vec<String>) -> Result<ChildTransport, TransportError> {
        ChildTransport::start_with(argv, ChildOptions::default())
    }

    /// Starts `argv` with `options`.
    pub fn start_with(argv: Vec<String>, timeouts: ChildOptions) -> Result<ChildTransport, TransportError> {
        let mut session = Session::new(argv, timeouts);
        session.start().map_err(TransportError::Unavailable)?;
        Ok(ChildTransport { session: Rc::new(RefCell::new(session)) })
    }

    /// `command` split on whitespace.
    pub fn argv(command: &str) -> Vec<String> {
        command.split_whitespace().map(str::to_owned).collect()
    }

    /// Why the child is broken, if it is.
    pub fn broken(&self) -> Option<String> {
        self.session.borrow().broken.clone()
    }
}

/// Why an op outside the seam (the connector seat's, `crate::external::connector`) got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// The child refused the op (`"ok": false`), in its words.
    #[error("{0}")]
    Refused(String),
    /// The child is broken (it exited, timed out or answered malformed): the whole text.
    #[error("{0}")]
    Broken(String),
}

impl ChildTransport {
    /// Sends `op` (an op the seam does not use) with `fields` and waits up to `timeout` for the answer's fields.
    pub fn call(&self, op: &'static str, fields: Value, timeout: Duration) -> Result<Map<String, Value>, OpError> {
        let mut session = self.session.borrow_mut();
        let call = session.timeouts.call;
        session.timeouts.call = timeout;
        let answer = session.call(op, fields);
        session.timeouts.call = call;
        answer.map_err(|error| match error {
            CallError::Refused { message, .. } => OpError::Refused(message),
            CallError::Broken(text) => OpError::Broken(text),
        })
    }

    /// Marks the child broken by a malformed answer to `op` (`problem` says which field) and returns the text.
    pub fn break_with(&self, op: &str, problem: &str) -> String {
        let mut session = self.session.borrow_mut();
        let text = format!("{}: op `{op}`: {problem}", session.who());
        session.break_with(text)
    }

    /// Another handle on the same child (its session is shared, and ends with the last handle).
    pub fn handle(&self) -> ChildTransport {
        ChildTransport { session: Rc::clone(&self.session) }
    }

    /// The child's default deadline of an op.
    pub fn call_timeout(&self) -> Duration {
        self.session.borrow().timeouts.call
    }
}

impl Transport for ChildTransport {
    fn identity(&self) -> Identity {
        let session = self.session.borrow();
        let Some(hello) = &session.hello else {
            return Identity { name: "child".to_owned(), ..Identity::default() };
        };
        let mut facts = hello.facts.clone();
        facts.insert("protocol".to_owned(), format!("{PROTOCOL}-{VERSION}"));
        facts.insert("command".to_owned(), session.command.clone());
        facts.insert("max_entries".to_owned(), hello.limits.max_entries.to_string());
        facts.insert("max_batch_bytes".to_owned(), hello.limits.max_batch_bytes.to_string());
        facts.insert("batches_in_flight".to_owned(), hello.limits.batches_in_flight.to_string());
        Identity { name: format!("child:{}", hello.engine), version: hello.version.clone(), facts }
    }

    fn verbs(&self) -> bool {
        false
    }

    fn engine(&mut self, node: NodeId, _caps: Caps) -> Result<Box<dyn TransferEngine>, TransportError> {
        let mut session = self.session.borrow_mut();
        let answer = match session.call("engine", json!({"node": node.0})) {
            Ok(answer) => answer,
            Err(CallError::Broken(text)) => return Err(TransportError::Open(text)),
            Err(CallError::Refused { message, .. }) => {
                return Err(TransportError::Open(format!("{} refused an engine for {node}: {message}", session.who())))
            }
        };
        let id = {
            let field = Fields { session: &session, op: "engine", map: &answer };
            match field.u64("engine") {
                Ok(id) if session.engines.contains(&id) => {
                    Err(field.wrong("engine", &format!("engine {id} is already in use")))
                }
                other => other,
            }
        };
        let id = id.map_err(|text| TransportError::Open(session.break_with(text)))?;
        session.engines.insert(id);
        let limits = session.hello.as_ref().map_or(SeamLimits::UNLIMITED, |hello| hello.limits);
        let generation = session.generation;
        drop(session);
        Ok(Box::new(ChildEngine {
            node,
            id,
            session: Rc::clone(&self.session),
            generation,
            limits,
            memory: BTreeMap::new(),
            next_memory: 0,
            conns: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            ready: VecDeque::new(),
            operations: 0,
        }))
    }

    fn step(&mut self) {
        std::thread::sleep(STEP);
    }

    /// Asks the child to let every batch it holds finish (`settle`, bounded by [`SETTLE`]).
    fn settle(&mut self) {
        let mut session = self.session.borrow_mut();
        let call = session.timeouts.call;
        session.timeouts.call = call + SETTLE;
        let _ = session.call("settle", json!({"timeout_ms": SETTLE.as_millis() as u64}));
        session.timeouts.call = call;
    }

    /// Forgets every engine (`reset`); a broken child is replaced by a fresh one.
    fn reset(&mut self) {
        let mut session = self.session.borrow_mut();
        session.generation += 1;
        let reset = session.running.is_some() && session.call("reset", json!({})).is_ok();
        if reset {
            session.engines.clear();
        } else {
            let _ = session.start();
        }
    }
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let word =
            chunk.iter().enumerate().fold(0u32, |word, (index, byte)| word | u32::from(*byte) << (16 - 8 * index));
        for index in 0..4 {
            if index <= chunk.len() {
                out.push(BASE64[(word >> (18 - 6 * index) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The bytes of standard base64 with padding (`None` when it is not).
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if text.len() % 4 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    for (number, quad) in text.chunks(4).enumerate() {
        let last = number + 1 == text.len() / 4;
        let padding = quad.iter().rev().take_while(|byte| **byte == b'=').count();
        if padding > 2 || (padding > 0 && !last) {
            return None;
        }
        let mut word = 0u32;
        for (index, byte) in quad.iter().enumerate() {
            let value = if index >= 4 - padding { 0 } else { BASE64.iter().position(|known| known == byte)? as u32 };
            word |= value << (18 - 6 * index);
        }
        out.extend_from_slice(&word.to_be_bytes()[1..4 - padding]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for bytes in [&b""[..], b"f", b"fo", b"foo", b"foob", b"fooba", b"foobar", &[0, 255, 128, 7]] {
            let text = base64_encode(bytes);
            assert_eq!(base64_decode(&text).as_deref(), Some(bytes), "{text}");
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_decode("Zm8"), None);
        assert_eq!(base64_decode("Z=8="), None);
        assert_eq!(base64_decode("Zm!="), None);
    }

    #[test]
    fn landed_ranges_are_checked() {
        assert_eq!(landed(Some(&json!("all")), 3), Ok(Landed::All));
        assert_eq!(landed(Some(&json!([[0, 1], [2, 3]])), 3), Ok(Landed::Entries(vec![0..1, 2..3])));
        assert!(landed(Some(&json!([[1, 1]])), 3).is_err());
        assert!(landed(Some(&json!([[0, 4]])), 3).is_err());
        assert!(landed(Some(&json!([[2, 3], [0, 1]])), 3).is_err());
        assert!(landed(None, 3).is_err());
    }
}
