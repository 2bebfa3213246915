//! The live driver: the same engines on a real clock, over any [`TransferEngine`] that moves real bytes (a verbs NIC through `VerbsEngine`, a NIXL agent),
//! with control messages through a [`Control`]: an in-process queue when every rank shares the process
//! ([`run_local`], `kvrelay run --fabric rdma`), or the TCP hub of [`crate::control`] when each rank is its own
//! process ([`serve`], `kvrelay serve`/`launch`).
//!
//! One thread runs every local engine: it polls each endpoint's completion queue, delivers control messages and
//! fires due timers, and when a round made no progress it waits with a bounded back-off (20 µs doubling to 1 ms,
//! capped by the next timer) on the endpoint's completion channel ([`TransferEngine::wait`]) or, with several local
//! endpoints, by sleeping. Every wait has a deadline; the run as a whole has [`LiveOptions::time_limit`].

#![allow(
    clippy::disallowed_methods,
    reason = "the live driver is the real-clock edge of the engines (the simulation drivers never read it)"
)]

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::seat::SharedPlanner;
use super::sim::{self, kind_name, message_line, note_line, Node, SimRun};
use super::{DecodeEngine, Envelope, Outbox, PrefillEngine};
use crate::fabric::seam::{NodeId, SeamError, TransferEngine};
use crate::fabric::transport::TransportError;
use crate::model::{Problem, Topology};

/// Shortest idle wait between two rounds without progress.
const FIRST_BACKOFF: Duration = Duration::from_micros(20);
/// Longest idle wait: a message or completion is noticed at most this late.
const MAX_BACKOFF: Duration = Duration::from_millis(1);

/// How a live run is set up.
#[derive(Debug, Clone)]
pub struct LiveOptions {
    /// How long a decode room may wait for the prefill side (domain.md §6.4), in nanoseconds of the real clock.
    pub waiting_timeout_ns: u64,
    /// Wall time after which the run stops whatever its state (a hang is reported, never waited out).
    pub time_limit: Duration,
    /// Record the message sequence and engine events.
    pub trace: bool,
    /// Another planner in every local prefill rank's seat (`None`: kvrelay's own).
    pub planner: Option<SharedPlanner>,
}

impl Default for LiveOptions {
    fn default() -> LiveOptions {
        LiveOptions {
            waiting_timeout_ns: 60_000_000_000,
            time_limit: Duration::from_secs(120),
            trace: false,
            planner: None,
        }
    }
}

/// What a [`Control`] had for the driver.
#[derive(Debug)]
pub enum Received {
    /// A message from a node to one of this process's nodes.
    Message(NodeId, Envelope),
    /// Nothing now.
    Idle,
    /// The run is over (the hub said so, or it is gone).
    Stop,
}

/// How control messages travel between engines.
pub trait Control {
    /// Sends `envelope` from local node `from`; a message to a node that is gone is dropped (its engine's
    /// deadline fails what depended on it).
    fn send(&mut self, from: NodeId, envelope: Envelope);
    /// The next message for a local node, if one is there now; never blocks.
    fn try_recv(&mut self) -> Received;
    /// Local decode node `node` has ended every room.
    fn finished(&mut self, node: NodeId) {
        let _ = node;
    }
}

/// Every node in this process: a FIFO queue, delivered in send order.
#[derive(Debug, Default)]
pub struct LocalControl {
    queue: VecDeque<(NodeId, Envelope)>,
}

impl Control for LocalControl {
    fn send(&mut self, from: NodeId, envelope: Envelope) {
        self.queue.push_back((from, envelope));
    }

    fn try_recv(&mut self) -> Received {
        self.queue.pop_front().map_or(Received::Idle, |(from, envelope)| Received::Message(from, envelope))
    }
}

/// Why a live run could not run.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error("the fabric refused: {0}")]
    Fabric(#[from] SeamError),
    /// The transport could not open a rank's engine.
    #[error("{0}")]
    Open(#[from] TransportError),
    /// `serve` was asked for a node that is no rank of the scenario.
    #[error("{0} is not a rank of this scenario")]
    NoSuchNode(NodeId),
}

impl LiveError {
    /// `fabric`, `open` or `no_such_node`: what failed.
    pub fn kind(&self) -> &'static str {
        match self {
            LiveError::Fabric(_) => "fabric",
            LiveError::Open(_) => "open",
            LiveError::NoSuchNode(_) => "no_such_node",
        }
    }
}

/// Runs every rank of `problem` in this process, each on the endpoint `open` gives for its node, with an
/// in-process control queue; the outcome reads back as the simulation's.
pub fn run_local<N: TransferEngine>(
    problem: &Problem,
    options: &LiveOptions,
    mut open: impl FnMut(NodeId) -> Result<N, TransportError>,
) -> Result<SimRun, LiveError> {
    let nodes = problem.prefill.ranks.len() + problem.decode.ranks.len();
    let mut endpoints = VecDeque::new();
    for node in 0..nodes {
        endpoints.push_back(open(NodeId(node as u32)).map_err(LiveError::Open)?);
    }
    let mut names = BTreeMap::new();
    let (mut prefill, decode) = sim::build_nodes(problem, &mut names, |_| {
        Ok(endpoints.pop_front().expect("one endpoint per node, opened above"))
    })?;
    for node in &mut prefill {
        node.engine.set_planner(options.planner.clone());
    }
    let published = sim::published_topology(&sim::prefill_info(problem).encode());
    let mut live = Live::new(prefill, decode, LocalControl::default(), names, options);
    live.start(published, &sim::directory(problem));
    live.run(Finish::AllDecodeDone);
    live.finish()
}

/// One rank of `problem` in this process, on `nic`, with `control` to the other processes. `published` is the
/// prefill topology the hub's start frame carried (`None`: nobody published one, so a decode rank fails its rooms).
/// Runs until the control says stop (or the time limit passes); the outcome holds this rank's rooms (and, for a
/// decode rank, its memory). `judge` sees the outcome while the rank's engine is still open: a decode process
/// gives its verdict before its engine is torn down, so an engine that fails at teardown (a peer killed
/// mid-transfer) cannot take the verdict with it.
pub fn serve<N: TransferEngine, C: Control, R>(
    problem: &Problem,
    node: NodeId,
    nic: N,
    control: C,
    published: Option<Topology>,
    options: &LiveOptions,
    judge: impl FnOnce(&SimRun) -> R,
) -> Result<R, LiveError> {
    let index = node.0 as usize;
    let prefill_count = problem.prefill.ranks.len();
    let mut names = BTreeMap::new();
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    if let Some(layout) = problem.prefill.ranks.get(index) {
        names.insert(node, format!("prefill {}", layout.rank));
        prefill.push(sim::prefill_node(problem, &crate::verify::Sources::new(problem), layout, nic)?);
    } else if let Some(layout) = index.checked_sub(prefill_count).and_then(|at| problem.decode.ranks.get(at)) {
        names.insert(node, format!("decode {}", layout.rank));
        decode.push(sim::decode_node(problem, layout, nic)?);
    } else {
        return Err(LiveError::NoSuchNode(node));
    }
    let mut live = Live::new(prefill, decode, control, names, options);
    live.start(published, &sim::directory(problem));
    live.run(Finish::Stopped);
    let run = live.finish()?;
    let judged = judge(&run);
    drop(live);
    Ok(judged)
}

/// When the loop ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finish {
    /// Every local decode engine ended its rooms (all ranks are local).
    AllDecodeDone,
    /// The control said stop.
    Stopped,
}

/// The local engines, their control and the clock.
struct Live<N, C> {
    prefill: Vec<Node<PrefillEngine, N>>,
    decode: Vec<Node<DecodeEngine, N>>,
    /// Whether each decode node has told the control it is done.
    reported: Vec<bool>,
    control: C,
    names: BTreeMap<NodeId, String>,
    start: Instant,
    time_limit: Duration,
    trace: Option<Vec<super::trace::TraceEvent>>,
    messages: BTreeMap<&'static str, u64>,
}

impl<N: TransferEngine, C: Control> Live<N, C> {
    fn new(
        prefill: Vec<Node<PrefillEngine, N>>,
        decode: Vec<Node<DecodeEngine, N>>,
        control: C,
        names: BTreeMap<NodeId, String>,
        options: &LiveOptions,
    ) -> Live<N, C> {
        // Real fabrics and emulated devices need longer than simulated time: both sides wait as long.
        let prefill: Vec<_> = prefill
            .into_iter()
            .map(|mut node| {
                node.engine = node.engine.with_timeout(options.waiting_timeout_ns);
                node
            })
            .collect();
        let decode: Vec<_> = decode
            .into_iter()
            .map(|mut node| {
                node.engine = node.engine.with_timeout(options.waiting_timeout_ns);
                node
            })
            .collect();
        Live {
            prefill,
            reported: vec![false; decode.len()],
            decode,
            control,
            names,
            start: Instant::now(),
            time_limit: options.time_limit,
            trace: options.trace.then(Vec::new),
            messages: BTreeMap::new(),
        }
    }

    /// Nanoseconds of the real clock since the run started.
    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn start(&mut self, published: Option<Topology>, directory: &BTreeMap<crate::model::RankId, NodeId>) {
        let now = self.now();
        for index in 0..self.decode.len() {
            let mut out = Outbox::default();
            let node = &mut self.decode[index];
            match &published {
                Some(topology) => node.engine.start(now, topology, directory, &mut node.nic, &mut out),
                None => node.engine.abandon(now, "no prefill rank published its topology at bootstrap", &mut out),
            }
            let from = node.nic.node();
            self.dispatch(from, out);
        }
    }

    fn run(&mut self, finish: Finish) {
        let mut backoff = FIRST_BACKOFF;
        loop {
            let (progress, stopped) = self.round();
            let all_done = self.decode.iter().all(|node| node.engine.done());
            if stopped || (finish == Finish::AllDecodeDone && all_done) || self.start.elapsed() > self.time_limit {
                return;
            }
            if progress {
                backoff = FIRST_BACKOFF;
                continue;
            }
            self.idle(backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One pass over completions, messages and timers: whether anything happened, and whether to stop.
    fn round(&mut self) -> (bool, bool) {
        let mut progress = self.poll_completions();
        let (delivered, stopped) = self.deliver_messages();
        progress |= delivered;
        progress |= self.fire_timers();
        for (index, node) in self.decode.iter().enumerate() {
            if node.engine.done() && !self.reported[index] {
                self.reported[index] = true;
                self.control.finished(node.nic.node());
            }
        }
        (progress, stopped)
    }

    /// Waits up to `backoff` (less if a timer is due sooner) for something to happen, without spinning.
    fn idle(&mut self, backoff: Duration) {
        let timers = self.prefill.iter().filter_map(|node| node.engine.next_timer());
        let next = timers.chain(self.decode.iter().filter_map(|node| node.engine.next_timer())).min();
        let wait = next.map_or(backoff, |at| backoff.min(Duration::from_nanos(at.saturating_sub(self.now()))));
        let nics = self.prefill.iter_mut().map(|node| &mut node.nic as &mut dyn TransferEngine);
        let mut nics = nics.chain(self.decode.iter_mut().map(|node| &mut node.nic as &mut dyn TransferEngine));
        match (nics.next(), nics.next()) {
            (Some(only), None) => {
                only.wait(wait);
            }
            _ => std::thread::sleep(wait),
        }
    }

    fn poll_completions(&mut self) -> bool {
        let (outboxes, any) = sim::poll_all(&mut self.prefill, &mut self.decode, self.trace.is_some());
        outboxes.into_iter().for_each(|(from, out)| self.dispatch(from, out));
        any
    }

    /// Delivers every message there is now: whether any was, and whether the control said stop.
    fn deliver_messages(&mut self) -> (bool, bool) {
        let mut delivered = false;
        loop {
            let (from, envelope) = match self.control.try_recv() {
                Received::Message(from, envelope) => (from, envelope),
                Received::Idle => return (delivered, false),
                Received::Stop => return (delivered, true),
            };
            delivered = true;
            let now = self.now();
            *self.messages.entry(kind_name(&envelope.frames)).or_default() += 1;
            if let Some(trace) = &mut self.trace {
                trace.push(message_line(now, &self.names, from, &envelope));
            }
            let out = sim::deliver(&mut self.prefill, &mut self.decode, now, from, &envelope);
            self.dispatch(envelope.to, out);
        }
    }

    fn fire_timers(&mut self) -> bool {
        let now = self.now();
        let outboxes = sim::fire_due_timers(&mut self.prefill, &mut self.decode, now);
        let fired = !outboxes.is_empty();
        outboxes.into_iter().for_each(|(from, out)| self.dispatch(from, out));
        fired
    }

    fn dispatch(&mut self, from: NodeId, out: Outbox) {
        if let Some(trace) = &mut self.trace {
            let now = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            trace.extend(out.notes.iter().map(|note| note_line(now, &self.names, from, note)));
        }
        for envelope in out.messages {
            self.control.send(from, envelope);
        }
    }

    /// The run's observations; the engines stay open until `self` is dropped.
    fn finish(&mut self) -> Result<SimRun, LiveError> {
        let run_ns = self.now();
        let mut run = sim::finish_nodes(&mut self.prefill, &mut self.decode, false)?;
        run.run_ns = run_ns;
        run.trace = self.trace.take().unwrap_or_default();
        run.messages = std::mem::take(&mut self.messages);
        Ok(run)
    }
}
