//! The tokio driver: every rank as its own task on a current-thread runtime with a paused clock, as it would be
//! one process per rank, with the control network and the fabric as tasks too.
//!
//! Time is tokio's: the paused clock jumps to the next sleeping deadline whenever every task waits, so a run takes
//! no wall time beyond its work and is reproducible (no IO, no randomness: every `select!` is `biased`, delivery is
//! FIFO per destination). Tokio's timers have millisecond resolution, so one simulated nanosecond is one virtual
//! millisecond of the paused clock (exact, and free: nothing really waits). The `SimWorld` is advanced to the
//! clock before any engine posts or polls, so posts start at the engine's own instant.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Notify};
use tokio::time::{sleep_until, Instant};

use super::sim::{event_summary, kind_name, message_line, note_line, Network, Node, Sim, SimOptions, SimRun};
use super::{DecodeEngine, Envelope, Outbox, PrefillEngine};
use crate::fabric::seam::{Event, NodeId, SeamError, TransferEngine};
use crate::fabric::world::SimWorld;
use crate::model::{Problem, RankId, Topology};

/// Runs `problem` through the engines on a fresh in-memory fabric: one tokio task per rank on a paused clock.
pub fn run(problem: &Problem, options: &SimOptions) -> Result<SimRun, SeamError> {
    let sim = Sim::build(problem, options)?;
    drive(sim, problem, options.time_limit_ns)?.finish()
}

/// [`run`] with a mark after each phase: `mark("stage")` once every region is registered and filled,
/// `mark("execute")` once the engines are done, `mark("observe")` once the decode memory is read back (the
/// benchmark's phase timings; the simulation itself reads no clock).
pub fn run_marked(
    problem: &Problem,
    options: &SimOptions,
    mark: &mut dyn FnMut(&'static str),
) -> Result<SimRun, SeamError> {
    let sim = Sim::build(problem, options)?;
    mark("stage");
    let sim = drive(sim, problem, options.time_limit_ns)?;
    mark("execute");
    let run = sim.finish();
    mark("observe");
    run
}

/// A message on its way: when it arrives and its send order, who sent it, what it is.
type InFlight = ((u64, u64), NodeId, Envelope);

/// What every task shares: the clock's origin, the network's queues, the fabric's doorbell and the log.
struct Context {
    start: std::cell::Cell<Instant>,
    world: SimWorld,
    /// One queue per destination node, in send order (each delivered at its arrival time, [`Network`]).
    links: Vec<mpsc::UnboundedSender<InFlight>>,
    /// Rung after every post, so the fabric task looks at its next delivery again.
    doorbell: Rc<Notify>,
    /// Rung (per node) after every delivery, so the node polls its completion queue.
    completions: Vec<Rc<Notify>>,
    log: RefCell<Log>,
    network: RefCell<Network>,
}

/// The trace and the message counts, kept as `Sim` keeps them.
struct Log {
    names: BTreeMap<NodeId, String>,
    trace: Option<Vec<super::trace::TraceEvent>>,
    messages: BTreeMap<&'static str, u64>,
}

impl Context {
    /// Simulated nanoseconds since the start (virtual milliseconds of the paused clock).
    fn now(&self) -> u64 {
        (Instant::now() - self.start.get()).as_millis() as u64
    }

    fn at(&self, ns: u64) -> Instant {
        self.start.get() + Duration::from_millis(ns)
    }

    /// Brings the fabric up to the task's instant and tells every node to look at its completion queue.
    fn sync_fabric(&self) {
        let now = self.now();
        if self.world.next_event().is_some_and(|next| next <= now) {
            self.world.advance_to(now);
            self.completions.iter().for_each(|notify| notify.notify_one());
        } else if self.world.now() < now {
            self.world.advance_to(now);
        }
    }

    /// Sends an engine's messages with the control latency and logs its notes.
    fn dispatch(&self, from: NodeId, out: Outbox) {
        let now = self.now();
        let mut log = self.log.borrow_mut();
        let log = &mut *log;
        if let Some(trace) = &mut log.trace {
            trace.extend(out.notes.iter().map(|note| note_line(now, &log.names, from, note)));
        }
        let mut network = self.network.borrow_mut();
        // A crashed node sends nothing (`crash_prefill`).
        let messages = if self.world.crashed(from) { Vec::new() } else { out.messages };
        for envelope in messages {
            if let Some(link) = self.links.get(envelope.to.0 as usize) {
                for key in network.arrivals(now, from, envelope.to) {
                    let _ = link.send((key, from, envelope.clone()));
                }
            }
        }
        self.doorbell.notify_one();
    }

    fn delivered(&self, from: NodeId, envelope: &Envelope) {
        let now = self.now();
        let mut log = self.log.borrow_mut();
        let log = &mut *log;
        *log.messages.entry(kind_name(&envelope.frames)).or_default() += 1;
        if let Some(trace) = &mut log.trace {
            trace.push(message_line(now, &log.names, from, envelope));
        }
    }
}

/// Runs the built simulation on a paused current-thread runtime; returns it with its log for `Sim::finish`.
pub(super) fn drive(mut sim: Sim, problem: &Problem, limit_ns: u64) -> Result<Sim, SeamError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|_| SeamError::Exhausted("a tokio runtime"))?;
    let local = tokio::task::LocalSet::new();
    let bootstrap = sim.bootstrap(problem);
    let nodes = sim.prefill.len() + sim.decode.len();
    let (links, inboxes): (Vec<_>, Vec<_>) = (0..nodes).map(|_| mpsc::unbounded_channel()).unzip();
    let context = Rc::new(Context {
        start: std::cell::Cell::new(Instant::now()),
        world: sim.world.clone(),
        links,
        doorbell: Rc::new(Notify::new()),
        completions: (0..nodes).map(|_| Rc::new(Notify::new())).collect(),
        log: RefCell::new(Log { names: sim.names.clone(), trace: sim.trace.take(), messages: BTreeMap::new() }),
        network: RefCell::new(std::mem::take(&mut sim.network)),
    });
    let prefill = std::mem::take(&mut sim.prefill);
    let decode = std::mem::take(&mut sim.decode);
    let tasks = run_tasks(context.clone(), prefill, decode, inboxes, bootstrap, limit_ns);
    // The paused clock is the runtime's: read the end of the run inside it.
    let (prefill, decode, now) = local.block_on(&runtime, async {
        let (prefill, decode) = tasks.await;
        (prefill, decode, context.now())
    });
    sim.prefill = prefill;
    sim.decode = decode;
    sim.now = now;
    let log = context.log.replace(Log { names: BTreeMap::new(), trace: None, messages: BTreeMap::new() });
    sim.trace = log.trace;
    sim.messages = log.messages;
    sim.network = context.network.take();
    Ok(sim)
}

/// Spawns the network, the fabric and one task per rank; returns every rank's node once the decode ranks are done
/// (or the time limit passed).
async fn run_tasks(
    context: Rc<Context>,
    prefill: Vec<Node<PrefillEngine>>,
    decode: Vec<Node<DecodeEngine>>,
    inboxes: Vec<mpsc::UnboundedReceiver<InFlight>>,
    bootstrap: (Topology, BTreeMap<RankId, NodeId>),
    limit_ns: u64,
) -> (Vec<Node<PrefillEngine>>, Vec<Node<DecodeEngine>>) {
    // The paused clock starts with the runtime: measure simulated time from here.
    context.start.set(Instant::now());
    let (stop, stopped) = watch::channel(false);
    let mut queues = Vec::new();
    for inbox in inboxes {
        let (deliver, queue) = mpsc::unbounded_channel();
        queues.push(queue);
        let context = context.clone();
        tokio::task::spawn_local(postman(context, inbox, deliver));
    }
    tokio::task::spawn_local(fabric(context.clone(), stopped.clone()));
    let mut queues = queues.into_iter();
    let flags = (0..prefill.len() + decode.len()).map(|_| std::cell::Cell::new(false)).collect();
    let finished = Rc::new(Finished { done: flags, notify: Notify::new() });
    let prefill_count = prefill.len();
    let prefill: Vec<_> = prefill
        .into_iter()
        .enumerate()
        .map(|(index, node)| {
            let queue = queues.next().expect("a queue per node");
            let rank = PrefillRank { index, limit_ns, finished: finished.clone() };
            tokio::task::spawn_local(prefill_rank(context.clone(), node, queue, rank, stopped.clone()))
        })
        .collect();

    let decode: Vec<_> = decode
        .into_iter()
        .enumerate()
        .map(|(index, node)| {
            let queue = queues.next().expect("a queue per node");
            let index = prefill_count + index;
            let rank = DecodeRank { index, bootstrap: bootstrap.clone(), limit_ns, finished: finished.clone() };
            tokio::task::spawn_local(decode_rank(context.clone(), node, queue, rank, stopped.clone()))
        })
        .collect();
    // Every rank keeps serving (a finished decode rank still takes late statuses) until all ranks are done: every
    // decode room and every prefill room ended (or the rank crashed, or the time limit passed).
    while !finished.done.iter().all(std::cell::Cell::get) {
        finished.notify.notified().await;
    }
    let _ = stop.send(true);
    let mut decoded = Vec::new();
    for handle in decode {
        decoded.push(handle.await.expect("a decode task never panics"));
    }
    let mut prefilled = Vec::new();
    for handle in prefill {
        prefilled.push(handle.await.expect("a prefill task never panics"));
    }
    (prefilled, decoded)
}

/// One destination's postman: holds the messages on their way to it and hands each over at its arrival time, in
/// (arrival, send order) — the stepped driver's order.
async fn postman(
    context: Rc<Context>,
    mut inbox: mpsc::UnboundedReceiver<InFlight>,
    deliver: mpsc::UnboundedSender<(NodeId, Envelope)>,
) {
    let mut held: BTreeMap<(u64, u64), (NodeId, Envelope)> = BTreeMap::new();
    let mut open = true;
    while open || !held.is_empty() {
        let next = held.keys().next().map(|&(at, _)| at);
        // Messages already sent are taken in first: one sent later may arrive earlier (a reordered one waits).
        tokio::select! {
            biased;
            message = inbox.recv(), if open => match message {
                Some((key, from, envelope)) => {
                    held.insert(key, (from, envelope));
                }
                None => open = false,
            },
            _ = sleep_until(context.at(next.unwrap_or(0))), if next.is_some() => {
                let (_, (from, envelope)) = held.pop_first().expect("a message is held");
                let _ = deliver.send((from, envelope));
            }
        }
    }
}

/// The fabric: sleeps until the next delivery, executes it, and rings the nodes.
async fn fabric(context: Rc<Context>, mut stopped: watch::Receiver<bool>) {
    loop {
        let next = context.world.next_event();
        tokio::select! {
            biased;
            _ = stopped.changed() => return,
            _ = context.doorbell.notified() => {}
            _ = sleep_until(context.at(next.unwrap_or(0))), if next.is_some() => context.sync_fabric(),
        }
    }
}

/// What a prefill task needs besides its node: the time limit, and where to say it is done.
struct PrefillRank {
    /// Its flag in `finished`.
    index: usize,
    limit_ns: u64,
    finished: Rc<Finished>,
}

async fn prefill_rank(
    context: Rc<Context>,
    mut node: Node<PrefillEngine>,
    mut inbox: mpsc::UnboundedReceiver<(NodeId, Envelope)>,
    rank: PrefillRank,
    mut stopped: watch::Receiver<bool>,
) -> Node<PrefillEngine> {
    let me = node.nic.node();
    let ring = context.completions[me.0 as usize].clone();
    let mut events: Vec<Event> = Vec::new();
    loop {
        // Done while every room that reached it ended (or it crashed): a room may still come, so this is a state,
        // set again after every step, not an event.
        let done = node.engine.done() || context.now() > rank.limit_ns;
        if rank.finished.done[rank.index].replace(done) != done {
            rank.finished.notify.notify_one();
        }
        let timer = node.engine.next_timer().map(|timer| timer.min(rank.limit_ns + 1));
        let mut out = Outbox::default();
        tokio::select! {
            biased;
            _ = stopped.changed() => return node,
            _ = ring.notified() => {
                context.sync_fabric();
                node.engine.wake(&mut node.nic, &mut out);
                while node.nic.poll(&mut events, usize::MAX) > 0 {
                    if context.log.borrow().trace.is_some() {
                        out.note(event_summary(&events));
                    }
                    for event in events.drain(..) {
                        node.engine.on_event(event, &mut node.nic, &mut out);
                    }
                }
            }
            Some((from, envelope)) = inbox.recv() => {
                context.sync_fabric();
                context.delivered(from, &envelope);
                node.engine.on_message(context.now(), from, &envelope.frames, &mut node.nic, &mut out);
            }
            _ = sleep_until(context.at(timer.unwrap_or(0))), if timer.is_some() => {
                context.sync_fabric();
                node.engine.on_tick(context.now(), &mut node.nic, &mut out);
            }
        }
        context.dispatch(me, out);
    }
}

/// What a decode task needs besides its node: the bootstrap, the time limit, and where to say it is done.
struct DecodeRank {
    /// Its flag in `finished`.
    index: usize,
    bootstrap: (Topology, BTreeMap<RankId, NodeId>),
    limit_ns: u64,
    finished: Rc<Finished>,
}

/// Which ranks are done (prefill ranks first, then decode ranks): every room ended, or the time limit passed.
struct Finished {
    done: Vec<std::cell::Cell<bool>>,
    notify: Notify,
}

async fn decode_rank(
    context: Rc<Context>,
    mut node: Node<DecodeEngine>,
    mut inbox: mpsc::UnboundedReceiver<(NodeId, Envelope)>,
    rank: DecodeRank,
    mut stopped: watch::Receiver<bool>,
) -> Node<DecodeEngine> {
    let me = node.nic.node();
    let mut out = Outbox::default();
    node.engine.start(context.now(), &rank.bootstrap.0, &rank.bootstrap.1, &mut node.nic, &mut out);
    context.dispatch(me, out);
    let ring = context.completions[me.0 as usize].clone();
    let mut events: Vec<Event> = Vec::new();
    let mut reported = false;
    loop {
        if !reported && (node.engine.done() || context.now() > rank.limit_ns) {
            reported = true;
            rank.finished.done[rank.index].set(true);
            rank.finished.notify.notify_one();
        }
        let timer = node.engine.next_timer().filter(|_| !reported).map(|timer| timer.min(rank.limit_ns + 1));
        let mut out = Outbox::default();
        tokio::select! {
            biased;
            _ = stopped.changed() => return node,
            _ = ring.notified() => {
                while node.nic.poll(&mut events, usize::MAX) > 0 {
                    events.clear();
                }
            }
            Some((from, envelope)) = inbox.recv() => {
                context.sync_fabric();
                context.delivered(from, &envelope);
                node.engine.on_message(context.now(), from, &envelope.frames, &mut node.nic, &mut out);
            }
            _ = sleep_until(context.at(timer.unwrap_or(0))), if timer.is_some() => {
                node.engine.on_tick(context.now(), &mut out);
            }
        }
        context.dispatch(me, out);
    }
}
