//! External planners: another program in the prefill ranks' planner seat ([`crate::engine::seat`]), speaking the
//! plan protocol (`README.md` here; `protocol.rs` renders and parses its messages) as JSON lines on its stdin and
//! stdout. One long-lived process serves a whole `kvrelay check --planner CMD` run, so an interpreter starts once.
//!
//! A planner that exits, hangs past the case's deadline, or answers something that is not a well-formed answer to
//! the query fails the case with a reason prefixed [`PROTOCOL_ERROR`], is killed, and is started afresh for the
//! next case: it never stalls the run. Its rejection of a room (`error`) is not a protocol error: it is the
//! planner's verdict, judged against the scenario's expectation like kvrelay's own.
//!
//! `reference.rs` is kvrelay's own planner behind the protocol (`kvrelay planner`), the protocol's reference
//! implementation.

#![allow(clippy::disallowed_methods, reason = "the external planner is a process edge: its deadlines are wall time")]

pub mod connector;
pub mod protocol;
pub mod reference;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use crate::engine::seat::{LinkQuery, Planner, SeatCopy, SeatError, SeatQuery};
use protocol::Answer;

/// The prefix of every failure that is the planner's fault as a program rather than its verdict on a room.
pub const PROTOCOL_ERROR: &str = "planner protocol error";
/// Longest line a planner may answer with.
pub const MAX_LINE_BYTES: u64 = 1 << 28;
/// How long a planner may take to start and say hello.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Why an external planner failed as a program (its verdict on a room is not an error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExternalError {
    #[error("cannot start `{command}`: {reason}")]
    Start { command: String, reason: String },
    #[error("no pipes to the planner")]
    NoPipes,
    #[error("the planner is not running")]
    NotRunning,
    #[error("the planner closed its input")]
    InputClosed,
    #[error("no answer within {:.1} s", .timeout.as_secs_f64())]
    Timeout { timeout: Duration },
    #[error("the planner's output ended")]
    OutputEnded,
    #[error("the planner exited (its output closed)")]
    Exited,
    #[error("a line longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong,
    #[error("a line that is not UTF-8")]
    NotUtf8,
    #[error("reading the planner's output failed: {reason}")]
    Read { reason: String },
    #[error("a {query} answer {problem}")]
    WrongShape { query: &'static str, problem: &'static str },
    #[error(transparent)]
    Protocol(#[from] protocol::ProtocolError),
}

error_kinds! {
    /// The kind of an [`ExternalError`].
    pub enum ExternalErrorKind {
        /// The planner process cannot be started or has no pipes.
        Start = "start",
        /// The planner stopped reading, stopped writing or exited.
        Exited = "exited",
        /// No answer before the case's deadline.
        Timeout = "timeout",
        /// A line that is too long, not UTF-8, or could not be read.
        BadLine = "bad_line",
        /// An answer that breaks the plan protocol.
        Protocol = "protocol",
    }
}

impl ExternalError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> ExternalErrorKind {
        use ExternalError as E;
        match self {
            E::Start { .. } | E::NoPipes => ExternalErrorKind::Start,
            E::NotRunning | E::InputClosed | E::OutputEnded | E::Exited => ExternalErrorKind::Exited,
            E::Timeout { .. } => ExternalErrorKind::Timeout,
            E::LineTooLong | E::NotUtf8 | E::Read { .. } => ExternalErrorKind::BadLine,
            E::WrongShape { .. } | E::Protocol(_) => ExternalErrorKind::Protocol,
        }
    }

    /// The failure as the engines report it for a room: prefixed [`PROTOCOL_ERROR`].
    pub fn reason(&self) -> String {
        format!("{PROTOCOL_ERROR}: {self}")
    }
}

/// A running planner process: its stdin (fed by a writer thread, so a planner that stops reading cannot block
/// kvrelay) and its stdout lines (read by a reader thread).
struct Running {
    child: Child,
    lines_out: Sender<String>,
    lines_in: Receiver<Result<String, ExternalError>>,
}

/// An external planner: `sh -c COMMAND`, started on first use and again after a failure.
pub struct ProcessPlanner {
    command: String,
    case_timeout: Duration,
    running: Option<Running>,
    /// The name its hello gave, once it has started.
    pub name: Option<String>,
    case: String,
    case_started: Instant,
    next_id: u64,
    /// The first protocol failure of the current case (later queries of the case fail at once).
    failure: Option<ExternalError>,
}

impl ProcessPlanner {
    /// A planner run as `sh -c command`, each case answered within `case_timeout` in all.
    pub fn new(command: &str, case_timeout: Duration) -> ProcessPlanner {
        ProcessPlanner {
            command: command.to_owned(),
            case_timeout,
            running: None,
            name: None,
            case: String::new(),
            case_started: Instant::now(),
            next_id: 1,
            failure: None,
        }
    }

    /// Starts a case (its file name goes into every query); the case's deadline starts now.
    pub fn start_case(&mut self, case: &str) {
        self.case = case.to_owned();
        self.case_started = Instant::now();
        self.failure = None;
    }

    /// The protocol failure of the current case, if any.
    pub fn failure(&self) -> Option<&ExternalError> {
        self.failure.as_ref()
    }

    fn ensure_running(&mut self) -> Result<(), ExternalError> {
        if self.running.is_some() {
            return Ok(());
        }
        // Its own process group, so that stopping it stops whatever it started too (`sh -c` may fork the command);
        // its stderr is forwarded line by line through a pipe, so no leftover process holds kvrelay's own.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(&self.command)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|error| ExternalError::Start { command: self.command.clone(), reason: error.to_string() })?;
        let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let (Some(mut stdin), Some(stdout), Some(stderr)) = (stdin, stdout, stderr) else {
            return Err(ExternalError::NoPipes);
        };
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = writeln!(std::io::stderr(), "planner: {line}");
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
        self.running = Some(Running { child, lines_out, lines_in });
        let hello = self.exchange(protocol::hello().to_string(), STARTUP_TIMEOUT)?;
        self.name = Some(protocol::parse_hello(&hello)?);
        Ok(())
    }

    /// Sends `line` and waits up to `timeout` for the planner's next line.
    fn exchange(&mut self, line: String, timeout: Duration) -> Result<String, ExternalError> {
        let running = self.running.as_mut().ok_or(ExternalError::NotRunning)?;
        running.lines_out.send(line).map_err(|_| ExternalError::InputClosed)?;
        match running.lines_in.recv_timeout(timeout) {
            Ok(Ok(line)) => Ok(line),
            Ok(Err(reason)) => Err(reason),
            Err(RecvTimeoutError::Timeout) => Err(ExternalError::Timeout { timeout }),
            Err(RecvTimeoutError::Disconnected) => Err(ExternalError::OutputEnded),
        }
    }

    /// Fails the case with `reason` (its first failure is kept) and stops the process (the next case starts a
    /// fresh one); the case's first failure.
    fn broken(&mut self, reason: ExternalError) -> ExternalError {
        if let Some(running) = self.running.take() {
            crate::fabric::child::stop(running.child);
        }
        self.failure.get_or_insert(reason).clone()
    }

    /// Sends the query `render(id)` and parses the answer with `parse(line, id)`, within the case's deadline.
    fn ask(
        &mut self,
        render: impl FnOnce(u64, &str) -> serde_json::Value,
        parse: impl FnOnce(&str, u64) -> Result<Answer, protocol::ProtocolError>,
    ) -> Result<Answer, ExternalError> {
        if let Some(reason) = &self.failure {
            return Err(reason.clone());
        }
        let answer = self.ensure_running().and_then(|()| {
            let id = self.next_id;
            self.next_id += 1;
            let line = render(id, &self.case).to_string();
            let left = self.case_timeout.saturating_sub(self.case_started.elapsed());
            Ok(parse(&self.exchange(line, left)?, id)?)
        });
        answer.map_err(|reason| self.broken(reason))
    }
}

impl Planner for ProcessPlanner {
    fn link(&mut self, query: &LinkQuery<'_>) -> Result<(), SeatError> {
        let answer = self.ask(|id, case| protocol::link_query(id, case, query), protocol::parse_link_answer);
        match answer.map_err(|error| SeatError::Broken(error.reason()))? {
            Answer::Linked => Ok(()),
            Answer::Rejected(text) => Err(SeatError::Rejected(text)),
            Answer::Copies(_) => {
                let error = self.broken(ExternalError::WrongShape { query: "link", problem: "with copies" });
                Err(SeatError::Broken(error.reason()))
            }
        }
    }

    fn plan(&mut self, query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, SeatError> {
        let chunks = query.request.chunks.len();
        let parse = |line: &str, id| protocol::parse_answer(line, id, chunks);
        match self.ask(|id, case| protocol::query(id, case, query), parse).map_err(|e| SeatError::Broken(e.reason()))? {
            Answer::Copies(copies) => Ok(copies),
            Answer::Rejected(text) => Err(SeatError::Rejected(text)),
            Answer::Linked => {
                let error = self.broken(ExternalError::WrongShape { query: "plan", problem: "without copies" });
                Err(SeatError::Broken(error.reason()))
            }
        }
    }
}

impl Drop for ProcessPlanner {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            crate::fabric::child::stop(running.child);
        }
    }
}

/// Forwards each line of `reader` (at most [`MAX_LINE_BYTES`]) to `sender`, then why it stopped.
fn read_lines(mut reader: impl BufRead, sender: &Sender<Result<String, ExternalError>>) {
    loop {
        let mut line = Vec::new();
        let read = (&mut reader).take(MAX_LINE_BYTES).read_until(b'\n', &mut line);
        let message = match read {
            Ok(0) => Err(ExternalError::Exited),
            Ok(_) if line.last() != Some(&b'\n') && line.len() as u64 >= MAX_LINE_BYTES => {
                Err(ExternalError::LineTooLong)
            }
            Ok(_) => match String::from_utf8(line) {
                Ok(text) => Ok(text.trim_end().to_owned()),
                Err(_) => Err(ExternalError::NotUtf8),
            },
            Err(error) => Err(ExternalError::Read { reason: error.to_string() }),
        };
        let end = message.is_err();
        if sender.send(message).is_err() || end {
            return;
        }
    }
}
