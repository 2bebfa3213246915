//! The simulated deployment: every rank of a problem as an engine on its own `SimWorld` endpoint, a control
//! network with a fixed latency and per-pair FIFO order, and the outcome read back.
//!
//! [`super::tasks::run`] drives it with one tokio task per rank (`tasks.rs`); [`run_stepped`] drives the same engines with a
//! plain loop over (messages, fabric deliveries, timers) in simulated time, as a cross-check. The engines do not
//! know they are simulated; a process driver with real sockets and verbs is the next step (ARCHITECTURE.md).

use std::collections::BTreeMap;

use super::decode::RoomState;
use super::handshake::{classify, Kind};
use super::trace::{TraceEvent, NOTE};
use super::{DecodeEngine, Envelope, Outbox, PrefillEngine};
use crate::fabric::faults::{FaultKind, FaultPlan, Injector, MESSAGE_DELAY_NS, REORDER_NS};
use crate::fabric::seam::BatchId;
use crate::fabric::seam::{Event, Memory, NodeId, Pattern, SeamError, TransferEngine};
use crate::fabric::verbs::Caps;
use crate::fabric::verbs_engine::{Run, VerbsEngine};
use crate::fabric::world::{SimEndpoint, SimWorld};
use crate::model::{Problem, RankId, RankLayout, Side, Topology};
use crate::plan::peer;
use crate::verify::{Observation, RegionKey, Sources, SparseImage, Verdicts, WriteRecord};
use crate::wire::{KvPoll, MemoryDesc, PrefillInfo, RequestMeta, Status};

/// One-way latency of a control message (ZMQ over TCP), in nanoseconds.
pub const CONTROL_LATENCY_NS: u64 = 20_000;

/// How a simulated run is set up.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// What every endpoint's NIC offers.
    pub caps: Caps,
    /// Record the message sequence and engine events.
    pub trace: bool,
    /// Simulated time after which the run stops whatever its state (a hang is reported, never waited out).
    pub time_limit_ns: u64,
    /// Another planner in every prefill rank's seat (`None`: kvrelay's own).
    pub planner: Option<super::seat::SharedPlanner>,
    /// Hand decode memory back as the chunks the fabric materialised (`Observation::sparse`) instead of whole
    /// images: memory and verification follow the bytes written, not the pools. Golden layouts need whole images.
    pub sparse_images: bool,
    /// Lazily filled regions take their chunks from this pool (the caller hands chunks back after judging a run).
    pub chunk_pool: Option<crate::fabric::world::ChunkPool>,
    /// Seeded faults on work requests and control messages (`fabric::faults`); empty: none.
    pub faults: FaultPlan,
}

impl Default for SimOptions {
    fn default() -> SimOptions {
        SimOptions {
            // A ConnectX (mlx5) send queue's gather entries; one message may be as large as a region.
            caps: Caps { max_sge: 30, max_message: 1 << 30, sq_depth: 1024 },
            trace: false,
            time_limit_ns: 10 * super::WAITING_TIMEOUT_NS,
            planner: None,
            sparse_images: false,
            chunk_pool: None,
            faults: FaultPlan::default(),
        }
    }
}

/// How a request ended on a prefill rank (`None`: it never became ready there), and why it failed.
pub use super::prefill::PrefillRoom;

/// What a simulated run left behind.
#[derive(Debug)]
pub struct SimRun {
    /// Every decode region's final bytes and every confirmed write.
    pub observation: Observation,
    /// How each request ended on each decode rank.
    pub rooms: BTreeMap<RankId, BTreeMap<u64, RoomState>>,
    /// How each request ended on each prefill rank (`None`: it never became ready there).
    pub prefill_rooms: BTreeMap<RankId, BTreeMap<u64, PrefillRoom>>,
    /// Message and event log (when asked for), in the order logged (`engine::trace`).
    pub trace: Vec<TraceEvent>,
    /// Control messages delivered, by kind.
    pub messages: BTreeMap<&'static str, u64>,
    /// Faults injected (`SimOptions::faults`), by kind name.
    pub faults: BTreeMap<&'static str, u64>,
    /// Writes whose bytes landed after their completion (`notify_before_data`): (decode rank, request, landing
    /// time in simulated nanoseconds; later than the run when they never landed).
    pub late_landings: Vec<(RankId, u64, u64)>,
    /// Under faults: when the last write into each (decode rank, request) landed, in simulated nanoseconds (late
    /// `notify_before_data` bytes excluded: they are in `late_landings`).
    pub last_landings: BTreeMap<(RankId, u64), u64>,
    /// Decode bytes a planted silent fault changed (`corrupt`, `read_after_release`): (region, offset, the value
    /// it left there, the value the write had put there).
    pub corruptions: Vec<(RegionKey, u64, u8, u8)>,
    /// How long the engines ran: simulated nanoseconds, or wall nanoseconds of a live run (from the first message
    /// to the end; memory set-up and read-back excluded).
    pub run_ns: u64,
    /// Operations the prefill ranks' transfer engines issued below the seam (verbs: work requests posted).
    pub operations: u64,
}

impl SimRun {
    /// The oracle's verdicts for decode rank `rank`: its failed rooms.
    pub fn verdicts(&self, rank: RankId) -> Verdicts {
        let failed = self.rooms.get(&rank).into_iter().flatten();
        let failed = failed.filter(|(_, room)| room.poll != KvPoll::Success).map(|(id, _)| *id as u32).collect();
        Verdicts { failed, nothing_sent: false }
    }

    /// Every (decode rank, request) that did not end in Success, with its reason.
    pub fn failures(&self) -> Vec<(RankId, u64, String)> {
        let mut res = Vec::new();
        for (rank, rooms) in &self.rooms {
            for (id, room) in rooms.iter().filter(|(_, room)| room.poll != KvPoll::Success) {
                let reason = room.reason.clone().unwrap_or_else(|| format!("ended {:?}", room.poll));
                res.push((*rank, *id, reason));
            }
        }
        res
    }
}

/// A rank: its engine and its endpoint.
pub(super) struct Node<E, N = VerbsEngine<SimEndpoint>> {
    pub(super) engine: E,
    pub(super) nic: N,
    pub(super) regions: Vec<Memory>,
}

/// The simulated deployment being run.
pub(super) struct Sim {
    pub(super) world: SimWorld,
    pub(super) prefill: Vec<Node<PrefillEngine>>,
    pub(super) decode: Vec<Node<DecodeEngine>>,
    pub(super) names: BTreeMap<NodeId, String>,
    in_flight: BTreeMap<(u64, u64), (NodeId, Envelope)>,
    pub(super) now: u64,
    pub(super) trace: Option<Vec<TraceEvent>>,
    pub(super) messages: BTreeMap<&'static str, u64>,
    sparse_images: bool,
    /// The control network: its timing and its faults (work-request faults live in the world).
    pub(super) network: Network,
}

/// The world's corruption log in decode coordinates (region key and offset), in the order planted.
fn corrupted_regions(world: &SimWorld, decode: &[Node<DecodeEngine>]) -> Vec<(RegionKey, u64, u8, u8)> {
    let mut res = Vec::new();
    for (node_id, addr, byte, original) in world.corruptions() {
        for node in decode.iter().filter(|node| node.nic.node() == node_id) {
            let rank = node.engine.rank();
            for (index, region) in node.regions.iter().enumerate() {
                if (region.addr..region.addr + region.len).contains(&addr) {
                    let key = RegionKey { side: Side::Decode, rank, region: index as u32 };
                    res.push((key, addr - region.addr, byte, original));
                }
            }
        }
    }
    res
}

/// The control network's timing and faults, shared by both drivers: when each copy of a message arrives.
///
/// Without faults every message arrives [`CONTROL_LATENCY_NS`] after it was sent and each link (ordered pair of
/// nodes) is FIFO. Seeded faults ([`crate::fabric::faults`]) drop, duplicate, delay (holding the link) or reorder
/// (not holding it) a message. Equal arrival times are delivered in send order (the sequence number).
#[derive(Debug, Default)]
pub(super) struct Network {
    faults: Option<Injector>,
    /// The latest arrival time of a link, which a FIFO message may not precede.
    last: BTreeMap<(NodeId, NodeId), u64>,
    sequence: u64,
}

impl Network {
    pub(super) fn new(faults: &FaultPlan) -> Network {
        Network { faults: (!faults.is_empty()).then(|| Injector::new(faults)), ..Network::default() }
    }

    /// (arrival time, sequence number) of every copy of a message from `from` to `to` sent at `now`: none when it
    /// is dropped, two when duplicated.
    pub(super) fn arrivals(&mut self, now: u64, from: NodeId, to: NodeId) -> Vec<(u64, u64)> {
        let fault = self.faults.as_mut().and_then(|faults| faults.on_message(from, to));
        let sent = now.saturating_add(CONTROL_LATENCY_NS);
        let last = self.last.entry((from, to)).or_default();
        let (at, copies) = match fault {
            Some(FaultKind::DropMessage) => return Vec::new(),
            Some(FaultKind::ReorderMessage) => (sent.saturating_add(REORDER_NS), 1),
            Some(FaultKind::DelayMessage) => (sent.saturating_add(MESSAGE_DELAY_NS).max(*last), 1),
            Some(FaultKind::DuplicateMessage) => (sent.max(*last), 2),
            _ => (sent.max(*last), 1),
        };
        if fault != Some(FaultKind::ReorderMessage) {
            *last = at;
        }
        (0..copies)
            .map(|_| {
                self.sequence += 1;
                (at, self.sequence)
            })
            .collect()
    }

    /// Control-message faults injected so far, by kind name.
    pub(super) fn injected(&self) -> impl Iterator<Item = (&&'static str, &u64)> {
        self.faults.iter().flat_map(|faults| faults.injected())
    }
}

/// Hands a judged run's sparse decode chunks back to `pool` for the next run (`SimOptions::chunk_pool`).
pub fn recycle(pool: &crate::fabric::world::ChunkPool, observation: Observation) {
    for image in observation.sparse.into_values() {
        pool.recycle(image.chunks.into_values());
    }
}

/// [`super::tasks::run`] with the single-threaded event loop instead of tasks (the same engines, stepped by hand).
pub fn run_stepped(problem: &Problem, options: &SimOptions) -> Result<SimRun, SeamError> {
    let mut sim = Sim::build(problem, options)?;
    sim.start(problem);
    sim.run_loop(options.time_limit_ns);
    sim.finish()
}

impl Sim {
    pub(super) fn build(problem: &Problem, options: &SimOptions) -> Result<Sim, SeamError> {
        let world = SimWorld::new(options.caps);
        world.set_chunk_pool(options.chunk_pool.clone());
        world.set_faults(&options.faults);
        let mut names = BTreeMap::new();
        let (mut prefill, decode) =
            build_nodes(problem, &mut names, |node| Ok(VerbsEngine::new(world.endpoint(node))))?;
        for node in &mut prefill {
            node.engine.set_planner(options.planner.clone());
        }
        let trace = options.trace.then(Vec::new);
        Ok(Sim {
            world,
            prefill,
            decode,
            names,
            in_flight: BTreeMap::new(),
            now: 0,
            trace,
            messages: BTreeMap::new(),
            sparse_images: options.sparse_images,
            network: Network::new(&options.faults),
        })
    }

    /// Bootstrap (domain.md §6.1 steps 1-2): prefill rank 0's published topology, through the wire, and the
    /// directory of prefill ranks.
    pub(super) fn bootstrap(&self, problem: &Problem) -> (Topology, BTreeMap<RankId, NodeId>) {
        let published = published_topology(&prefill_info(problem).encode());
        (published.unwrap_or(problem.prefill.topology), directory(problem))
    }

    pub(super) fn start(&mut self, problem: &Problem) {
        let (published, directory) = self.bootstrap(problem);
        for index in 0..self.decode.len() {
            let mut out = Outbox::default();
            let node = &mut self.decode[index];
            node.engine.start(0, &published, &directory, &mut node.nic, &mut out);
            let from = node.nic.node();
            self.dispatch(from, out);
        }
    }

    pub(super) fn dispatch(&mut self, from: NodeId, out: Outbox) {
        if let Some(trace) = &mut self.trace {
            trace.extend(out.notes.iter().map(|note| note_line(self.now, &self.names, from, note)));
        }
        // A crashed node sends nothing (`crash_prefill`).
        let messages = if self.world.crashed(from) { Vec::new() } else { out.messages };
        for envelope in messages {
            for key in self.network.arrivals(self.now, from, envelope.to) {
                self.in_flight.insert(key, (from, envelope.clone()));
            }
        }
    }

    fn next_time(&self) -> Option<u64> {
        let timers = self.prefill.iter().filter_map(|node| node.engine.next_timer());
        let timers = timers.chain(self.decode.iter().filter_map(|node| node.engine.next_timer()));
        let message = self.in_flight.keys().next().map(|(time, _)| *time);
        timers.chain(message).chain(self.world.next_event()).min()
    }

    fn run_loop(&mut self, limit: u64) {
        while !self.decode.iter().all(|node| node.engine.done()) || !self.prefill.iter().all(|node| node.engine.done())
        {
            let Some(next) = self.next_time() else { break };
            if next > limit {
                break;
            }
            self.now = self.now.max(next);
            self.world.advance_to(self.now);
            self.poll_completions();
            self.deliver_messages();
            self.fire_timers();
        }
    }

    fn poll_completions(&mut self) {
        let (outboxes, _) = poll_all(&mut self.prefill, &mut self.decode, self.trace.is_some());
        outboxes.into_iter().for_each(|(from, out)| self.dispatch(from, out));
    }

    fn deliver_messages(&mut self) {
        while let Some(entry) = self.in_flight.first_entry() {
            if entry.key().0 > self.now {
                break;
            }
            let (from, envelope) = entry.remove();
            *self.messages.entry(kind_name(&envelope.frames)).or_default() += 1;
            self.trace_message(from, &envelope);
            let out = deliver(&mut self.prefill, &mut self.decode, self.now, from, &envelope);
            self.dispatch(envelope.to, out);
        }
    }

    fn fire_timers(&mut self) {
        let outboxes = fire_due_timers(&mut self.prefill, &mut self.decode, self.now);
        outboxes.into_iter().for_each(|(from, out)| self.dispatch(from, out));
    }

    pub(super) fn trace_message(&mut self, from: NodeId, envelope: &Envelope) {
        if let Some(trace) = &mut self.trace {
            trace.push(message_line(self.now, &self.names, from, envelope));
        }
    }

    /// Deregisters every decode region into the observation (prefill memory is dropped: the oracle recomputes it).
    pub(super) fn finish(mut self) -> Result<SimRun, SeamError> {
        self.world.land_late();
        let mut run = finish_nodes(&mut self.prefill, &mut self.decode, self.sparse_images)?;
        run.run_ns = self.now;
        run.trace = self.trace.unwrap_or_default();
        run.messages = self.messages;
        run.faults = self.world.injected_faults();
        let late = self.world.late_landings();
        for node in &self.prefill {
            let runs = batch_runs(node);
            let id = node.nic.node();
            let mut seen = std::collections::BTreeSet::new();
            for written in node.engine.written().iter().filter(|written| seen.insert(written.batch)) {
                for wrs in runs.get(&written.batch).into_iter().flatten() {
                    for (_, &land) in late.range((id, wrs.qp, wrs.first)..=(id, wrs.qp, wrs.last)) {
                        run.late_landings.push((written.target, written.room, land));
                    }
                }
            }
        }
        run.last_landings = last_landings(&self.prefill, &self.world.landings());
        run.corruptions = corrupted_regions(&self.world, &self.decode);
        for (kind, count) in self.network.injected() {
            *run.faults.entry(kind).or_default() += count;
        }
        Ok(run)
    }
}

/// When the last write into each (decode rank, request) landed: the world's landing times joined with the batches
/// each prefill engine submitted and the work requests its verbs engine lowered them to.
fn last_landings(
    prefill: &[Node<PrefillEngine>],
    landed: &BTreeMap<(NodeId, crate::fabric::verbs::QpNum, u64), u64>,
) -> BTreeMap<(RankId, u64), u64> {
    let mut last = BTreeMap::new();
    for node in prefill {
        let id = node.nic.node();
        let runs = batch_runs(node);
        for posted in node.engine.posted() {
            for run in runs.get(&posted.batch).into_iter().flatten() {
                for (_, &at) in landed.range((id, run.qp, run.first)..=(id, run.qp, run.last)) {
                    let entry = last.entry((posted.target, posted.room)).or_insert(at);
                    *entry = (*entry).max(at);
                }
            }
        }
    }
    last
}

/// The work-request runs of each batch a prefill node's verbs engine posted.
fn batch_runs(node: &Node<PrefillEngine>) -> BTreeMap<BatchId, Vec<Run>> {
    let mut runs: BTreeMap<BatchId, Vec<Run>> = BTreeMap::new();
    for run in node.nic.runs() {
        runs.entry(run.batch).or_default().push(*run);
    }
    runs
}

/// Polls every node's transfer engine and hands the prefill side's events to its engines (a decode engine submits
/// nothing, so its events are drained): the outboxes per sender, and whether any event came.
pub(super) fn poll_all<N: TransferEngine>(
    prefill: &mut [Node<PrefillEngine, N>],
    decode: &mut [Node<DecodeEngine, N>],
    trace: bool,
) -> (Vec<(NodeId, Outbox)>, bool) {
    let mut events: Vec<Event> = Vec::new();
    let mut outboxes = Vec::new();
    let mut any = false;
    for node in prefill.iter_mut() {
        let mut out = Outbox::default();
        node.engine.wake(&mut node.nic, &mut out);
        while node.nic.poll(&mut events, usize::MAX) > 0 {
            any = true;
            if trace {
                out.note(event_summary(&events));
            }
            for event in events.drain(..) {
                node.engine.on_event(event, &mut node.nic, &mut out);
            }
        }
        outboxes.push((node.nic.node(), out));
    }
    for node in decode.iter_mut() {
        while node.nic.poll(&mut events, usize::MAX) > 0 {
            any = true;
            events.clear();
        }
    }
    (outboxes, any)
}

/// Hands `envelope` from `from` to its destination node at `now`: that engine's outbox (a note when the
/// destination is not among these nodes).
pub(super) fn deliver<N: TransferEngine>(
    prefill: &mut [Node<PrefillEngine, N>],
    decode: &mut [Node<DecodeEngine, N>],
    now: u64,
    from: NodeId,
    envelope: &Envelope,
) -> Outbox {
    let mut out = Outbox::default();
    let to = envelope.to;
    if let Some(node) = prefill.iter_mut().find(|node| node.nic.node() == to) {
        node.engine.on_message(now, from, &envelope.frames, &mut node.nic, &mut out);
    } else if let Some(node) = decode.iter_mut().find(|node| node.nic.node() == to) {
        node.engine.on_message(now, from, &envelope.frames, &mut node.nic, &mut out);
    } else {
        out.note(format!("dropped a message for {to}, which is not in this process"));
    }
    out
}

/// Fires every engine timer due at `now`: the outboxes per sender.
pub(super) fn fire_due_timers<N: TransferEngine>(
    prefill: &mut [Node<PrefillEngine, N>],
    decode: &mut [Node<DecodeEngine, N>],
    now: u64,
) -> Vec<(NodeId, Outbox)> {
    let due = |timer: Option<u64>| timer.is_some_and(|time| time <= now);
    let mut outboxes = Vec::new();
    for node in prefill.iter_mut().filter(|node| due(node.engine.next_timer())) {
        let mut out = Outbox::default();
        node.engine.on_tick(now, &mut node.nic, &mut out);
        outboxes.push((node.nic.node(), out));
    }
    for node in decode.iter_mut().filter(|node| due(node.engine.next_timer())) {
        let mut out = Outbox::default();
        node.engine.on_tick(now, &mut out);
        outboxes.push((node.nic.node(), out));
    }
    outboxes
}

/// Every prefill node and every decode node of a deployment.
pub(super) type Nodes<N> = (Vec<Node<PrefillEngine, N>>, Vec<Node<DecodeEngine, N>>);

/// Builds every rank of `problem` as a node on the endpoint `open` gives for its node number (prefill ranks first,
/// then decode ranks, in layout order), naming each in `names`.
pub(super) fn build_nodes<N: TransferEngine>(
    problem: &Problem,
    names: &mut BTreeMap<NodeId, String>,
    mut open: impl FnMut(NodeId) -> Result<N, SeamError>,
) -> Result<Nodes<N>, SeamError> {
    let sources = Sources::new(problem);
    let mut prefill = Vec::new();
    for layout in &problem.prefill.ranks {
        let node = NodeId(names.len() as u32);
        names.insert(node, format!("prefill {}", layout.rank));
        prefill.push(prefill_node(problem, &sources, layout, open(node)?)?);
    }
    let mut decode = Vec::new();
    for layout in &problem.decode.ranks {
        let node = NodeId(names.len() as u32);
        names.insert(node, format!("decode {}", layout.rank));
        decode.push(decode_node(problem, layout, open(node)?)?);
    }
    Ok((prefill, decode))
}

/// The node of prefill rank `layout`: its regions registered on `nic`, filled with the source pattern.
pub(super) fn prefill_node<N: TransferEngine>(
    problem: &Problem,
    sources: &Sources<'_>,
    layout: &RankLayout,
    mut nic: N,
) -> Result<Node<PrefillEngine, N>, SeamError> {
    let regions = register_prefill(&mut nic, sources, layout)?;
    let engine = PrefillEngine::new(
        layout.rank,
        problem.model.clone(),
        problem.prefill.topology,
        layout.clone(),
        regions.clone(),
        &problem.requests,
        nic.limits(),
    )
    .with_early_send(problem.early_send);
    Ok(Node { engine, nic, regions })
}

/// The node of decode rank `layout`: its regions registered on `nic`, filled with the sentinel, advertised in its
/// registration.
pub(super) fn decode_node<N: TransferEngine>(
    problem: &Problem,
    layout: &RankLayout,
    mut nic: N,
) -> Result<Node<DecodeEngine, N>, SeamError> {
    let regions = register_decode(&mut nic, layout)?;
    let descs: Vec<MemoryDesc> = regions
        .iter()
        .map(|memory| MemoryDesc { address: memory.addr, length_bytes: memory.len, rkey: memory.key })
        .collect();
    let registration = peer::advertise(problem, layout.rank, &descs);
    let engine =
        DecodeEngine::new(layout.rank, problem.model.clone(), problem.decode.topology, registration, &problem.requests);
    Ok(Node { engine, nic, regions })
}

/// What the nodes left behind: every confirmed write and every decode region's bytes (deregistered), each rank's
/// rooms. Prefill memory is handed back unobserved (the oracle recomputes its pattern). No trace or counts.
pub(super) fn finish_nodes<N: TransferEngine>(
    prefill: &mut [Node<PrefillEngine, N>],
    decode: &mut [Node<DecodeEngine, N>],
    sparse: bool,
) -> Result<SimRun, SeamError> {
    let mut observation = Observation::default();
    for node in prefill.iter() {
        for written in node.engine.written() {
            let target = RegionKey { side: Side::Decode, rank: written.target, region: written.region };
            observation.writes.push(WriteRecord { target, offset: written.offset, length: written.length });
        }
    }
    let prefill_rooms = prefill.iter().map(|node| (node.engine.rank(), node.engine.rooms())).collect();
    // Prefill bytes are not observed: handed back sparsely, so a lazily filled source is never materialised.
    for node in prefill.iter_mut() {
        for region in &node.regions {
            // Memory an engine can keep where it lives is dropped there, never read back (device memory).
            if node.nic.resident(region).is_none() {
                drop(node.nic.release(region, true)?);
            }
        }
    }
    let mut rooms = BTreeMap::new();
    for node in decode.iter_mut() {
        let rank = node.engine.rank();
        for (index, region) in node.regions.iter().enumerate() {
            let key = RegionKey { side: Side::Decode, rank, region: index as u32 };
            if let Some(resident) = node.nic.resident(region) {
                observation.resident.insert(key, super::resident::resident(resident));
            } else if sparse {
                let image = SparseImage { len: region.len, chunks: node.nic.release(region, true)? };
                observation.sparse.insert(key, image);
            } else {
                let mut image = node.nic.release(region, false)?;
                observation.images.insert(key, image.remove(&0).unwrap_or_default());
            }
        }
        rooms.insert(rank, node.engine.rooms().clone());
    }
    Ok(SimRun {
        observation,
        rooms,
        prefill_rooms,
        trace: Vec::new(),
        messages: BTreeMap::new(),
        faults: BTreeMap::new(),
        late_landings: Vec::new(),
        last_landings: BTreeMap::new(),
        corruptions: Vec::new(),
        run_ns: 0,
        operations: prefill.iter().map(|node| node.nic.operations()).sum(),
    })
}

/// What prefill rank 0 publishes at bootstrap (domain.md §6.1 step 1): its parallel layout and page size.
pub fn prefill_info(problem: &Problem) -> PrefillInfo {
    let topology = &problem.prefill.topology;
    PrefillInfo {
        ip: "127.0.0.1".to_owned(),
        port: 17000,
        attn_tp_size: topology.tp,
        attn_tp_rank: 0,
        dcp_size: topology.dcp,
        dcp_rank: 0,
        pp_size: topology.pp,
        pp_rank: 0,
        page_size: topology.page_size,
        kv_cache_dtype: format!("{}-byte", problem.model.dtype_bytes),
        attn_dp_size: topology.dp,
        attn_dp_rank: 0,
        attn_cp_size: topology.cp,
        attn_cp_rank: 0,
    }
}

/// The prefill topology a decode rank learns from published `PrefillInfo` frames (`None`: malformed).
pub fn published_topology(frames: &[Vec<u8>]) -> Option<Topology> {
    PrefillInfo::decode(frames).ok().map(|info| Topology {
        tp: info.attn_tp_size,
        dp: info.attn_dp_size,
        cp: info.attn_cp_size,
        // Not published (as in SGLang): the decode side pulls per its own setting.
        all_cp: false,
        pp: info.pp_size,
        dcp: info.dcp_size,
        page_size: info.page_size,
        // Not published: a prefill's staging shows in the writes it makes, never to the decode's gates.
        staging_chunk_pages: 0,
    })
}

/// Where each prefill rank listens: node numbers in layout order, as [`build_nodes`] assigns them.
pub(super) fn directory(problem: &Problem) -> BTreeMap<RankId, NodeId> {
    problem.prefill.ranks.iter().enumerate().map(|(index, layout)| (layout.rank, NodeId(index as u32))).collect()
}

/// Prefill rank `layout`'s regions registered on `nic`, each holding its source pattern (no rank engine: what
/// `engine::direct` registers).
pub(super) fn register_prefill<N: TransferEngine>(
    nic: &mut N,
    sources: &Sources<'_>,
    layout: &RankLayout,
) -> Result<Vec<Memory>, SeamError> {
    register_regions(nic, layout, |index| Pattern::Source { number: sources.number(layout.rank, index) })
}

/// Decode rank `layout`'s regions registered on `nic`, filled with the sentinel (no rank engine, no registration
/// message: what `engine::direct` registers).
pub(super) fn register_decode<N: TransferEngine>(nic: &mut N, layout: &RankLayout) -> Result<Vec<Memory>, SeamError> {
    register_regions(nic, layout, |_| Pattern::Sentinel)
}

/// Registers every region of `layout` on `nic`, in the engine's kind of memory, each holding the pattern
/// `pattern(region index)` gives (generated in place: the in-memory fabric materialises only the chunks written to,
/// and reads the rest from the pattern; a device fabric generates it on the device).
fn register_regions<N: TransferEngine>(
    nic: &mut N,
    layout: &RankLayout,
    mut pattern: impl FnMut(u32) -> Pattern,
) -> Result<Vec<Memory>, SeamError> {
    let mut regions = Vec::new();
    let kind = nic.memory_kind();
    for (index, region) in layout.regions.iter().enumerate() {
        regions.push(nic.register_pattern(kind, region.len_bytes(), region.item_len, pattern(index as u32))?);
    }
    Ok(regions)
}

/// The trace event of an engine's note at `now`.
pub(super) fn note_line(now: u64, names: &BTreeMap<NodeId, String>, from: NodeId, note: &str) -> TraceEvent {
    TraceEvent { time_ns: now, kind: NOTE, from: names[&from].clone(), to: None, text: note.to_owned() }
}

/// The trace event of a message delivered at `now`.
pub(super) fn message_line(
    now: u64,
    names: &BTreeMap<NodeId, String>,
    from: NodeId,
    envelope: &Envelope,
) -> TraceEvent {
    let to = names.get(&envelope.to).map_or("?", String::as_str).to_owned();
    TraceEvent {
        time_ns: now,
        kind: kind_name(&envelope.frames),
        from: names[&from].clone(),
        to: Some(to),
        text: describe(&envelope.frames),
    }
}

/// One trace line for events polled together: how many batches ended, with which statuses, up to which batch.
pub(super) fn event_summary(events: &[Event]) -> String {
    let mut statuses: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut last = None;
    for event in events {
        match event {
            Event::Completed(completion) => {
                *statuses.entry(completion.status.name()).or_default() += 1;
                last = Some(completion.batch);
            }
            Event::Notified { .. } => *statuses.entry("notified").or_default() += 1,
        }
    }
    let statuses: Vec<String> = statuses.iter().map(|(status, count)| format!("{count} {status}")).collect();
    let last = last.map_or_else(String::new, |batch| format!(", up to {batch}"));
    format!("{} events ({}){last}", events.len(), statuses.join(", "))
}

/// The kind of a message, for counting.
pub(super) fn kind_name(frames: &[Vec<u8>]) -> &'static str {
    match classify(frames) {
        Kind::Registration => "registration",
        Kind::Link => "link",
        Kind::RequestMeta => "metadata",
        Kind::Status => "status",
        Kind::Abort => "abort",
        Kind::AbortAck => "abort-ack",
        Kind::Unknown => "unknown",
    }
}

/// One line naming a message by its decoded content.
fn describe(frames: &[Vec<u8>]) -> String {
    match classify(frames) {
        Kind::Registration => format!("registration ({} frames)", frames.len()),
        Kind::Link => match super::handshake::LinkAck::decode(frames) {
            Some(ack) => match ack.error {
                None => format!("linked, peer address {}", crate::fabric::seam::PeerAddress(ack.address)),
                Some(error) => format!("link refused: {error}"),
            },
            None => "malformed link answer".to_owned(),
        },
        Kind::RequestMeta => match RequestMeta::decode(frames) {
            Ok(meta) if meta.is_dummy() => format!("metadata room {} (dummy)", meta.room),
            Ok(meta) => format!(
                "metadata room {} ({} pages, prefix {}): pages {}{}{}",
                meta.room,
                meta.kv_indices.len(),
                meta.decode_prefix_len,
                numbers(&meta.kv_indices),
                meta.aux_index.map(|aux| format!(", aux row {aux}")).unwrap_or_default(),
                meta.state_indices
                    .iter()
                    .enumerate()
                    .map(|(component, indices)| format!(", state{component} {}", numbers(indices)))
                    .collect::<String>(),
            ),
            Err(error) => format!("malformed metadata: {error}"),
        },
        Kind::Status => match Status::decode(frames) {
            Ok(status) if status.reason.is_empty() => format!("status room {} {:?}", status.room, status.status),
            Ok(status) => format!("status room {} {:?}: {}", status.room, status.status, status.reason),
            Err(error) => format!("malformed status: {error}"),
        },
        Kind::Abort | Kind::AbortAck => match super::handshake::Abort::decode(frames) {
            Some(abort) if abort.ack => format!("abort acknowledged, room {}", abort.room),
            Some(abort) => format!("abort room {}", abort.room),
            None => "malformed abort".to_owned(),
        },
        Kind::Unknown => format!("unknown message of {} frames", frames.len()),
    }
}

/// A list of page or slot numbers for a trace line: `[7 3 12]`.
fn numbers(values: &[u32]) -> String {
    let values: Vec<String> = values.iter().map(u32::to_string).collect();
    format!("[{}]", values.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::faults::FaultRule;

    const A: NodeId = NodeId(0);
    const B: NodeId = NodeId(1);

    /// A network whose `kind` rule (probability one half) fires on the first message from A to B and not on the
    /// second: the first seed for which it does.
    fn first_only(kind: FaultKind) -> Network {
        let plan = |seed| FaultPlan { seed, rules: vec![FaultRule { kind, probability: 0.5 }] };
        let fires = |seed| {
            let mut injector = Injector::new(&plan(seed));
            (injector.on_message(A, B).is_some(), injector.on_message(A, B).is_some())
        };
        let seed = (0..1000).find(|&seed| fires(seed) == (true, false)).expect("some seed");
        Network::new(&plan(seed))
    }

    #[test]
    fn without_faults_a_link_is_fifo_at_the_control_latency() {
        let mut network = Network::new(&FaultPlan::default());
        assert_eq!(network.arrivals(0, A, B), [(CONTROL_LATENCY_NS, 1)]);
        assert_eq!(network.arrivals(5, A, B), [(CONTROL_LATENCY_NS + 5, 2)]);
    }

    /// A delayed message holds its link: the next message on it, sent later, arrives after it.
    #[test]
    fn a_delayed_message_holds_its_link() {
        let mut network = first_only(FaultKind::DelayMessage);
        let [(first, _)] = network.arrivals(0, A, B)[..] else { panic!("one copy") };
        let [(second, _)] = network.arrivals(1, A, B)[..] else { panic!("one copy") };
        assert_eq!(first, CONTROL_LATENCY_NS + MESSAGE_DELAY_NS);
        assert_eq!(second, first, "waits behind it");
    }

    /// A reordered message does not hold its link: the next message on it overtakes it.
    #[test]
    fn a_reordered_message_is_overtaken_by_the_next_on_its_link() {
        let mut network = first_only(FaultKind::ReorderMessage);
        let [(first, _)] = network.arrivals(0, A, B)[..] else { panic!("one copy") };
        let [(second, _)] = network.arrivals(1, A, B)[..] else { panic!("one copy") };
        assert!(second < first, "{second} overtakes {first}");
    }
}
