//! The control plane between rank processes (domain.md §6.1's bootstrap and ZMQ messages, kvrelay's own
//! transport): every process connects to one TCP [`Hub`], says hello with its node number, and the hub routes
//! engine messages by destination node. The data path never touches it: bytes move over the fabric.
//!
//! The hub starts the run once every expected node said hello, or at the connect deadline with whoever came (a
//! rank that never connects then fails the requests that need it through the decode ranks' waiting timeout); it
//! stops the run once every decode process reported done or went away, or at its time limit. Messages for a node
//! that is not (or no longer) connected are dropped and counted. Nothing here blocks without a deadline.
//!
//! `frame.rs` is the pure codec (fuzzed: `tests/fuzz`, target `control`).

#![allow(clippy::disallowed_methods, reason = "the control plane is an IO edge: its deadlines are wall time")]

pub mod frame;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use frame::{ControlFrame, FrameError, FrameErrorKind, FrameKind};

use crate::engine::live::{Control, Received};
use crate::engine::Envelope;
use crate::fabric::verbs::NodeId;

/// The node number the hub uses as its own (never a rank's).
pub const HUB: NodeId = NodeId(u32::MAX);
/// Longest a write to one process may block before the hub gives up on that message.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the accept loop looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// Why the control plane failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot listen on {addr}: {source} (fix: another port, or a local address of this host)")]
    Bind { addr: String, source: std::io::Error },
    #[error("cannot reach the bootstrap hub at {addr} within {seconds} s: {last} (fix: start the hub first, check HOST:PORT and firewalls)")]
    Connect { addr: String, seconds: u64, last: String },
    #[error("the bootstrap hub at {addr} did not start the run within {seconds} s (fix: start every rank, or raise --connect-timeout)")]
    NoStart { addr: String, seconds: u64 },
    #[error("the bootstrap hub closed the connection before the run started: {0}")]
    Closed(#[source] Box<ControlError>),
    #[error("connection closed: {0}")]
    Disconnected(#[source] std::io::Error),
    #[error("connection closed mid-frame: {0}")]
    MidFrame(#[source] std::io::Error),
    #[error("the connection's reader stopped")]
    ReaderEnded,
    #[error(transparent)]
    Frame(#[from] FrameError),
}

error_kinds! {
    /// The kind of a [`ControlError`].
    pub enum ControlErrorKind {
        /// The hub cannot listen on its address.
        Bind = "bind",
        /// The hub cannot be reached before the deadline.
        Connect = "connect",
        /// The hub did not start the run before the deadline.
        NoStart = "no_start",
        /// The connection ended before the run started.
        Closed = "closed",
        /// The connection ended, between frames or inside one.
        Disconnected = "disconnected",
        /// Bytes that are not a control frame.
        BadFrame = "bad_frame",
    }
}

impl ControlError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> ControlErrorKind {
        match self {
            ControlError::Bind { .. } => ControlErrorKind::Bind,
            ControlError::Connect { .. } => ControlErrorKind::Connect,
            ControlError::NoStart { .. } => ControlErrorKind::NoStart,
            ControlError::Closed(_) => ControlErrorKind::Closed,
            ControlError::Disconnected(_) | ControlError::MidFrame(_) | ControlError::ReaderEnded => {
                ControlErrorKind::Disconnected
            }
            ControlError::Frame(_) => ControlErrorKind::BadFrame,
        }
    }
}

/// Reads one control frame from `stream`: the length prefix, then the body (checked against the limit first).
pub fn read_frame(stream: &mut impl Read) -> Result<ControlFrame, ControlError> {
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix).map_err(ControlError::Disconnected)?;
    let len = frame::body_len(prefix)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(ControlError::MidFrame)?;
    Ok(frame::decode(&body)?)
}

/// Who the hub expects, and its deadlines.
#[derive(Debug, Clone)]
pub struct HubPlan {
    /// Every node of the run, with its name for the log (`prefill pp0-tp1`).
    pub nodes: BTreeMap<NodeId, String>,
    /// The decode nodes: the run ends when each reported done or went away.
    pub decode: BTreeSet<NodeId>,
    /// How long to wait for every node's hello before starting with whoever came.
    pub connect_timeout: Duration,
    /// Wall time after which the hub stops the run whatever its state.
    pub time_limit: Duration,
    /// Seeded faults on the messages it routes (`kvrelay launch --chaos truncate-messages`); `None`: none.
    pub faults: Option<MessageFaults>,
    /// Told once when the run starts (every rank connected, or the connect deadline passed).
    pub started: Option<Sender<()>>,
}

/// The hub's seeded message faults: each routed message is hit with probability `per_mille / 1000`, drawn from the
/// named stream `chaos.messages` of `seed`; a hit message has one of its wire frames cut short at a drawn length
/// (a truncated control message: the receiving rank's decoder must refuse it with a reason, never panic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageFaults {
    pub seed: crate::seed::Seed,
    pub per_mille: u32,
}

/// What the hub saw.
#[derive(Debug, Clone, Default)]
pub struct HubReport {
    /// Nodes that never said hello before the start.
    pub missing: Vec<NodeId>,
    /// Nodes whose connection closed before the stop (decode nodes: before reporting done).
    pub lost: Vec<NodeId>,
    /// Decode nodes that reported done.
    pub done: BTreeSet<NodeId>,
    /// Messages routed, and messages dropped because their destination was not connected.
    pub routed: u64,
    pub dropped: u64,
    /// The run hit the hub's time limit.
    pub timed_out: bool,
    /// Messages the seeded message faults cut short.
    pub truncated: u64,
    /// One line per notable event (connections, losses, drops), in order.
    pub log: Vec<String>,
}

/// What the hub's threads tell it.
enum Event {
    Accepted(usize, TcpStream),
    Frame(usize, ControlFrame),
    Closed(usize, String),
}

/// The bootstrap hub: a TCP listener that routes control frames between rank processes.
pub struct Hub {
    listener: TcpListener,
}

impl Hub {
    /// Listens on `addr` (`HOST:PORT`; port 0 picks a free one).
    pub fn bind(addr: &str) -> Result<Hub, ControlError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| ControlError::Bind { addr: addr.to_owned(), source })?;
        Ok(Hub { listener })
    }

    /// The address the hub listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves one run until it stops; never blocks past `plan`'s deadlines.
    pub fn run(self, plan: &HubPlan) -> HubReport {
        let (events, inbox) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = spawn_acceptor(self.listener, events, Arc::clone(&stop));
        let mut state = HubState::new(plan);
        state.serve(&inbox);
        stop.store(true, Ordering::Relaxed);
        let _ = acceptor.join();
        state.report
    }
}

/// Accepts connections until `stop`, each with a reader thread feeding `events`.
fn spawn_acceptor(listener: TcpListener, events: Sender<Event>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        if listener.set_nonblocking(true).is_err() {
            return;
        }
        let mut next = 0usize;
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_nodelay(true);
                    // A process that stops reading must not stall the hub's routing of everyone else.
                    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
                    let Ok(mut reader) = stream.try_clone() else { continue };
                    let conn = next;
                    next += 1;
                    if events.send(Event::Accepted(conn, stream)).is_err() {
                        return;
                    }
                    let events = events.clone();
                    std::thread::spawn(move || loop {
                        match read_frame(&mut reader) {
                            Ok(frame) => {
                                if events.send(Event::Frame(conn, frame)).is_err() {
                                    return;
                                }
                            }
                            Err(reason) => {
                                let _ = events.send(Event::Closed(conn, reason.to_string()));
                                return;
                            }
                        }
                    });
                }
                Err(_) => std::thread::sleep(ACCEPT_POLL),
            }
        }
    })
}

/// The hub's bookkeeping.
struct HubState<'a> {
    plan: &'a HubPlan,
    /// Open connections not yet identified by a hello.
    pending: BTreeMap<usize, TcpStream>,
    /// Identified nodes: connection and stream.
    nodes: BTreeMap<NodeId, (usize, TcpStream)>,
    /// Parts of the start frame: the published prefill topology.
    published: Vec<Vec<u8>>,
    started: bool,
    begun: Instant,
    report: HubReport,
    /// The message faults' stream, when the plan has faults.
    faults: Option<crate::seed::SimRng>,
}

impl<'a> HubState<'a> {
    fn new(plan: &'a HubPlan) -> HubState<'a> {
        HubState {
            plan,
            pending: BTreeMap::new(),
            nodes: BTreeMap::new(),
            published: Vec::new(),
            started: false,
            begun: Instant::now(),
            report: HubReport::default(),
            faults: plan.faults.map(|faults| faults.seed.stream("chaos.messages")),
        }
    }

    fn serve(&mut self, inbox: &Receiver<Event>) {
        loop {
            if !self.started && (self.nodes.len() == self.plan.nodes.len() || self.past(self.plan.connect_timeout)) {
                self.start();
            }
            if self.started && self.finished() {
                return self.stop();
            }
            if self.past(self.plan.time_limit) {
                self.report.timed_out = true;
                self.report.log.push(format!("time limit of {} s reached", self.plan.time_limit.as_secs()));
                return self.stop();
            }
            match inbox.recv_timeout(Duration::from_millis(20)) {
                Ok(event) => self.on_event(event),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return self.stop(),
            }
        }
    }

    fn past(&self, limit: Duration) -> bool {
        self.begun.elapsed() > limit
    }

    /// Every decode node reported done or went away (or never came).
    fn finished(&self) -> bool {
        self.plan.decode.iter().all(|node| self.report.done.contains(node) || !self.nodes.contains_key(node))
    }

    fn name(&self, node: NodeId) -> String {
        self.plan.nodes.get(&node).cloned().unwrap_or_else(|| node.to_string())
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Accepted(conn, stream) => {
                self.pending.insert(conn, stream);
            }
            Event::Frame(conn, frame) => self.on_frame(conn, frame),
            Event::Closed(conn, reason) => {
                self.pending.remove(&conn);
                let gone = self.nodes.iter().find(|(_, (id, _))| *id == conn).map(|(node, _)| *node);
                if let Some(node) = gone {
                    self.nodes.remove(&node);
                    if !self.report.done.contains(&node) {
                        self.report.lost.push(node);
                        self.report.log.push(format!("{} went away: {reason}", self.name(node)));
                    }
                }
            }
        }
    }

    fn on_frame(&mut self, conn: usize, frame: ControlFrame) {
        match frame.kind {
            FrameKind::Hello => self.on_hello(conn, frame),
            FrameKind::Message => self.route(frame),
            FrameKind::Done => {
                if self.nodes.get(&frame.from).is_some_and(|(id, _)| *id == conn) {
                    self.report.done.insert(frame.from);
                }
            }
            FrameKind::Start | FrameKind::Stop => {
                self.report.log.push(format!("ignored a {:?} frame from connection {conn}", frame.kind));
            }
        }
    }

    fn on_hello(&mut self, conn: usize, frame: ControlFrame) {
        let Some(stream) = self.pending.remove(&conn) else { return };
        let node = frame.from;
        if !self.plan.nodes.contains_key(&node) || self.nodes.contains_key(&node) || self.started {
            let why = if self.started { "after the start" } else { "unknown or duplicate node" };
            self.report.log.push(format!("refused a hello from {node}: {why}"));
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return;
        }
        if !frame.parts.is_empty() {
            self.published = frame.parts;
        }
        self.report.log.push(format!("{} connected", self.name(node)));
        self.nodes.insert(node, (conn, stream));
    }

    fn start(&mut self) {
        self.started = true;
        self.report.missing = self.plan.nodes.keys().filter(|node| !self.nodes.contains_key(node)).copied().collect();
        for node in self.report.missing.clone() {
            self.report.log.push(format!("{} never connected", self.name(node)));
        }
        let published = self.published.clone();
        self.broadcast(FrameKind::Start, &published);
        if let Some(started) = &self.plan.started {
            let _ = started.send(());
        }
    }

    fn stop(&mut self) {
        self.broadcast(FrameKind::Stop, &[]);
    }

    fn broadcast(&mut self, kind: FrameKind, parts: &[Vec<u8>]) {
        for (node, (_, stream)) in &mut self.nodes {
            let frame = ControlFrame::new(kind, HUB, *node, parts.to_vec());
            let _ = stream.write_all(&frame.encode());
        }
    }

    fn route(&mut self, mut frame: ControlFrame) {
        self.truncate(&mut frame);
        let Some((_, stream)) = self.nodes.get_mut(&frame.to) else {
            self.report.dropped += 1;
            return;
        };
        if stream.write_all(&frame.encode()).is_ok() {
            self.report.routed += 1;
        } else {
            self.report.dropped += 1;
        }
    }
}

impl HubState<'_> {
    /// Cuts one wire frame of `frame` short when the seeded message faults hit it (logged with the drawn numbers).
    fn truncate(&mut self, frame: &mut ControlFrame) {
        use rand::RngExt as _;
        let (Some(faults), Some(rng)) = (self.plan.faults, self.faults.as_mut()) else { return };
        let filled: Vec<usize> = (0..frame.parts.len()).filter(|part| !frame.parts[*part].is_empty()).collect();
        if filled.is_empty() || rng.random_range(0..1000) >= faults.per_mille {
            return;
        }
        let part = filled[rng.random_range(0..filled.len())];
        let was = frame.parts[part].len();
        let cut = rng.random_range(0..was);
        frame.parts[part].truncate(cut);
        let (from, to) = (self.name(frame.from), self.name(frame.to));
        self.report.truncated += 1;
        self.report
            .log
            .push(format!("truncated a message from {from} to {to}: frame {part} cut from {was} to {cut} bytes"));
    }
}

/// A rank process's connection to the hub: the [`Control`] of [`crate::engine::live::serve`].
pub struct Client {
    addr: String,
    writer: TcpStream,
    inbox: Receiver<Result<ControlFrame, ControlError>>,
    stopped: bool,
}

impl Client {
    /// Connects to the hub at `addr` (retrying until `timeout`: the hub may start after this process) and says
    /// hello as `node`, with `published` (prefill rank 0's `PrefillInfo` frames; empty for every other rank).
    pub fn connect(
        addr: &str,
        node: NodeId,
        published: Vec<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Client, ControlError> {
        let begun = Instant::now();
        let stream = loop {
            let attempt = addr
                .to_socket_addrs()
                .map_err(|error| error.to_string())
                .and_then(|mut addrs| addrs.next().ok_or_else(|| "no address".to_owned()))
                .and_then(|sock| TcpStream::connect_timeout(&sock, timeout).map_err(|error| error.to_string()));
            match attempt {
                Ok(stream) => break stream,
                Err(last) if begun.elapsed() >= timeout => {
                    return Err(ControlError::Connect { addr: addr.to_owned(), seconds: timeout.as_secs(), last });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut reader =
            stream.try_clone().map_err(|error| ControlError::Closed(Box::new(ControlError::Disconnected(error))))?;
        let (frames, inbox) = mpsc::channel();
        std::thread::spawn(move || loop {
            let frame = read_frame(&mut reader);
            let end = frame.is_err();
            if frames.send(frame).is_err() || end {
                return;
            }
        });
        let mut client = Client { addr: addr.to_owned(), writer: stream, inbox, stopped: false };
        client.write(ControlFrame::new(FrameKind::Hello, node, HUB, published));
        Ok(client)
    }

    /// Waits for the hub's start frame and returns its parts (the published prefill topology; empty if none).
    pub fn wait_start(&mut self, timeout: Duration) -> Result<Vec<Vec<u8>>, ControlError> {
        let no_start = || ControlError::NoStart { addr: self.addr.clone(), seconds: timeout.as_secs() };
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(left) {
                Ok(Ok(frame)) if frame.kind == FrameKind::Start => return Ok(frame.parts),
                Ok(Ok(_)) => {}
                Ok(Err(reason)) => return Err(ControlError::Closed(Box::new(reason))),
                Err(RecvTimeoutError::Timeout) => return Err(no_start()),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ControlError::Closed(Box::new(ControlError::ReaderEnded)));
                }
            }
        }
    }

    fn write(&mut self, frame: ControlFrame) {
        if self.writer.write_all(&frame.encode()).is_err() {
            self.stopped = true;
        }
    }
}

impl Control for Client {
    fn send(&mut self, from: NodeId, envelope: Envelope) {
        self.write(ControlFrame::new(FrameKind::Message, from, envelope.to, envelope.frames));
    }

    fn try_recv(&mut self) -> Received {
        if self.stopped {
            return Received::Stop;
        }
        match self.inbox.try_recv() {
            Ok(Ok(frame)) => match frame.kind {
                FrameKind::Message => Received::Message(frame.from, Envelope { to: frame.to, frames: frame.parts }),
                FrameKind::Stop => {
                    self.stopped = true;
                    Received::Stop
                }
                _ => Received::Idle,
            },
            Err(TryRecvError::Empty) => Received::Idle,
            Ok(Err(_)) | Err(TryRecvError::Disconnected) => {
                self.stopped = true;
                Received::Stop
            }
        }
    }

    fn finished(&mut self, node: NodeId) {
        self.write(ControlFrame::new(FrameKind::Done, node, HUB, Vec::new()));
    }
}

impl Drop for Client {
    /// Closes the connection for both directions (the reader thread holds a clone of the socket), so the hub sees
    /// this process go away at once.
    fn drop(&mut self) {
        let _ = self.writer.shutdown(std::net::Shutdown::Both);
    }
}
