//! `SimWorld`: the in-memory fabric behind [`Endpoint`], with deterministic simulated time.
//!
//! Every simulated rank gets a [`SimEndpoint`] onto one shared world. Memory is owned per node: each registration
//! gets its own virtual address range on its node (a bump allocator from [`REGION_BASE_ADDR`], regions separated
//! by at least [`REGION_GUARD_BYTES`]) and fresh keys (unique across the world, so a key used on the wrong node
//! never resolves).
//!
//! Posting executes nothing. A work request executes (bounds checked, bytes gathered and written, completions
//! queued) at its delivery time, when [`SimWorld::advance_to`] or [`SimWorld::run_until_idle`] reaches it:
//!
//! - each QP has one wire: a work request starts at the later of its post time and the moment the QP's previous
//!   message has left the wire, occupies the wire for [`wire_time_ns`] of its bytes (the bytes over
//!   [`BANDWIDTH_BYTES_PER_S`], rounded up), and is delivered [`LATENCY_NS`] after it has left the wire;
//! - a work request posted on a QP in the error state is delivered (flushed) at the post time, or at the QP's
//!   previous delivery if that is later, so delivery times never decrease along a QP; work requests already queued
//!   when their QP fails keep their delivery times and are flushed then;
//! - equal delivery times execute in post order (across the whole world).
//!
//! QPs do not share bandwidth (each has the full wire), receive queues and CQ overflow are not modelled, and the
//! responder side of a failed write is unaffected. No clock, no randomness, no hash-ordered collection.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::rc::Rc;

use super::faults::{
    FaultKind, FaultPlan, Injector, COMPLETION_DELAY_NS, CORRUPTION_MASK, NOTIFY_LEAD_NS, RELEASED_BYTES,
    RELEASED_FILL, REORDER_NS, RESTART_NS,
};
use super::memory::Memory;
pub use super::memory::{chunk_bytes, ChunkPool, CHUNK_BYTES};
use super::verbs::{
    Caps, Endpoint, FabricError, Fill, MemoryRegion, NodeId, QpInfo, QpNum, RemoteAddr, SendQueue, Sge, WcKind,
    WcStatus, WorkCompletion, WorkRequest,
};

/// One-way latency of every message, in nanoseconds (NIC processing plus one switch hop).
pub const LATENCY_NS: u64 = 2_000;
/// Wire bandwidth of one QP, in bytes per second (200 Gb/s).
pub const BANDWIDTH_BYTES_PER_S: u64 = 25_000_000_000;
/// Virtual address of the first region registered on each node (never zero, so a zero address is always wrong).
pub const REGION_BASE_ADDR: u64 = 0x1000_0000;
/// Unregistered bytes after every region (at least; region starts are page aligned).
pub const REGION_GUARD_BYTES: u64 = 4096;
const PAGE_BYTES: u64 = 4096;
const FIRST_KEY: u32 = 0x100;
const FIRST_QPN: u32 = 0x40;
/// Deferred bytes below which a flush copies on the calling thread (a thread costs more than a small copy).
const PARALLEL_FLUSH_BYTES: u64 = 16 << 20;

/// Nanoseconds `bytes` occupy one QP's wire: the bytes over [`BANDWIDTH_BYTES_PER_S`], rounded up.
pub fn wire_time_ns(bytes: u64) -> u64 {
    let nanos = (u128::from(bytes) * 1_000_000_000).div_ceil(u128::from(BANDWIDTH_BYTES_PER_S));
    u64::try_from(nanos).unwrap_or(u64::MAX)
}

/// The shared in-memory fabric: every node's memory, QPs and CQ, the pending deliveries and the simulated clock.
///
/// Cloning gives another handle onto the same world.
#[derive(Debug, Clone)]
pub struct SimWorld {
    inner: Rc<RefCell<World>>,
}

/// One node's [`Endpoint`] on a [`SimWorld`].
#[derive(Debug)]
pub struct SimEndpoint {
    world: Rc<RefCell<World>>,
    node: NodeId,
    /// Executes every pending delivery before each poll ([`SimWorld::eager_endpoint`]).
    eager: bool,
}

impl SimWorld {
    /// An empty world at time 0 whose endpoints all report `caps`.
    pub fn new(caps: Caps) -> SimWorld {
        let world = World {
            caps,
            now_ns: 0,
            next_event: 0,
            next_key: FIRST_KEY,
            events: BTreeMap::new(),
            nodes: BTreeMap::new(),
            pool: None,
            faults: None,
            late: BTreeMap::new(),
            corruptions: Vec::new(),
            landed: BTreeMap::new(),
            deferred: Deferred::default(),
        };
        SimWorld { inner: Rc::new(RefCell::new(world)) }
    }

    /// Work requests delivered from now on may fail as `plan` draws ([`super::faults`]).
    pub fn set_faults(&self, plan: &FaultPlan) {
        self.inner.borrow_mut().faults = (!plan.is_empty()).then(|| Injector::new(plan));
    }

    /// The faults injected so far, by kind name.
    pub fn injected_faults(&self) -> BTreeMap<&'static str, u64> {
        self.inner.borrow().faults.as_ref().map(|faults| faults.injected().clone()).unwrap_or_default()
    }

    /// Under faults, when each work request's bytes landed on its peer, by (posting node, QP, wr_id) (see
    /// [`SimWorld::late_landings`] for the late bytes of `notify_before_data`).
    pub fn landings(&self) -> BTreeMap<(NodeId, QpNum, u64), u64> {
        self.inner.borrow().landed.clone()
    }

    /// Whether `node` crashed (a `crash_prefill` fault): it takes part in nothing any more.
    pub fn crashed(&self, node: NodeId) -> bool {
        self.inner.borrow().nodes.get(&node).is_some_and(|node| node.crashed)
    }

    /// When the bytes of each `notify_before_data` work request landed or are due to land, by (posting node, QP,
    /// wr_id): later than its completion.
    pub fn late_landings(&self) -> BTreeMap<(NodeId, QpNum, u64), u64> {
        self.inner.borrow().late.clone()
    }

    /// Lands the bytes of every `notify_before_data` work request still on its way (at its landing time; nothing
    /// else is delivered): a run read back after its engines stopped sees every byte a completion promised.
    pub fn land_late(&self) {
        let mut world = self.inner.borrow_mut();
        let keys: Vec<(u64, u64)> =
            world.events.iter().filter(|(_, delivery)| delivery.what == What::LateBytes).map(|(key, _)| *key).collect();
        for key in keys {
            let delivery = world.events.remove(&key).expect("listed");
            let peer = world.node(delivery.node).qps[&delivery.qp].peer.expect("delivered on a connected QP");
            world.copy_across(delivery.node, &delivery.wr.sges, peer.node, delivery.wr.remote);
        }
    }

    /// Every byte a planted silent fault (`corrupt`, `read_after_release`) changed: (node, virtual address, the
    /// value it left there, the value the write had put there).
    pub fn corruptions(&self) -> Vec<(NodeId, u64, u8, u8)> {
        self.inner.borrow().corruptions.clone()
    }

    /// Lazily filled regions registered from now on take their chunks from `pool` ([`ChunkPool`]).
    pub fn set_chunk_pool(&self, pool: Option<ChunkPool>) {
        self.inner.borrow_mut().pool = pool;
    }

    /// The endpoint of `node`, creating the node on first use; a second call gives another handle onto the same node.
    pub fn endpoint(&self, node: NodeId) -> SimEndpoint {
        self.inner.borrow_mut().nodes.entry(node).or_insert_with(Node::new);
        SimEndpoint { world: Rc::clone(&self.inner), node, eager: false }
    }

    /// The endpoint of `node` for a driver on a real clock (the live driver's tests, `kvrelay diff --fabric sim`):
    /// before every poll it executes every pending delivery of the world, as if the wire took no time.
    pub fn eager_endpoint(&self, node: NodeId) -> SimEndpoint {
        SimEndpoint { eager: true, ..self.endpoint(node) }
    }

    /// Simulated time, in nanoseconds since the world was created.
    pub fn now(&self) -> u64 {
        self.inner.borrow().now_ns
    }

    /// The delivery time of the earliest pending work request, if any.
    pub fn next_event(&self) -> Option<u64> {
        self.inner.borrow().events.keys().next().map(|&(time_ns, _)| time_ns)
    }

    /// Executes every work request delivered at or before `time_ns`, in delivery order, and sets the clock to
    /// `time_ns`. Time never goes back: an earlier `time_ns` executes nothing.
    pub fn advance_to(&self, time_ns: u64) {
        let mut world = self.inner.borrow_mut();
        while world.next_event_at_or_before(time_ns) {
            world.deliver_next();
        }
        world.now_ns = world.now_ns.max(time_ns);
    }

    /// Executes every pending work request; the clock stops at the last delivery.
    pub fn run_until_idle(&self) {
        let mut world = self.inner.borrow_mut();
        while world.next_event_at_or_before(u64::MAX) {
            world.deliver_next();
        }
    }
}

#[derive(Debug)]
struct World {
    caps: Caps,
    now_ns: u64,
    /// Tie-breaker of the event key: equal delivery times execute in post order.
    next_event: u64,
    next_key: u32,
    events: BTreeMap<(u64, u64), Delivery>,
    nodes: BTreeMap<NodeId, Node>,
    pool: Option<ChunkPool>,
    faults: Option<Injector>,
    /// When the bytes of each `notify_before_data` work request land (or are due to), by (node, QP, wr_id).
    late: BTreeMap<(NodeId, QpNum, u64), u64>,
    /// Bytes a silent fault changed: (node, virtual address, the byte left there, the byte the write had put there).
    corruptions: Vec<(NodeId, u64, u8, u8)>,
    /// Writes checked and completed but whose bytes are not copied yet ([`World::flush`]).
    deferred: Deferred,
    /// Under faults: when each work request's bytes (some or all) landed on its peer, by (node, QP, wr_id); a
    /// `notify_before_data` write's late bytes are in `late` instead.
    landed: BTreeMap<(NodeId, QpNum, u64), u64>,
}

/// Byte copies of executed writes, deferred until someone looks at memory, then made per target node in parallel.
///
/// A write's checks, status and completion happen at its delivery; only its bytes wait. Every read of memory (an
/// endpoint's read, deregistration, a planted fault, a write that is not a plain WRITE between two nodes) flushes
/// first, and so does a write whose source node has bytes on their way in or whose target node is a pending
/// source, so the final bytes are those of copying in delivery order. Copies to one node keep their order; different
/// nodes' memories are disjoint, so copying them on several threads changes nothing but the time.
#[derive(Debug, Default)]
struct Deferred {
    copies: Vec<DeferredCopy>,
    sources: std::collections::BTreeSet<NodeId>,
    targets: std::collections::BTreeSet<NodeId>,
    bytes: u64,
}

/// One WRITE's bytes: `pieces` (source region start, offset in it, length) of node `from`, landing in order at
/// `at` of the region starting at `target` on node `to`.
#[derive(Debug)]
struct DeferredCopy {
    from: NodeId,
    pieces: Vec<(u64, u64, u64)>,
    to: NodeId,
    target: u64,
    at: u64,
}

/// A posted work request waiting for its delivery time.
#[derive(Debug)]
struct Delivery {
    node: NodeId,
    qp: QpNum,
    /// Position on its QP (0 for the first work request ever posted on it).
    seq: u64,
    wr: WorkRequest,
    what: What,
}

/// What a delivery does when its time comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum What {
    /// Execute the work request (checks, bytes, completion).
    Execute,
    /// The late placement of a `notify_before_data` work request: its bytes only (its completion was queued).
    LateBytes,
    /// Queue the sender's completion of the already executed work request, with this status (a delayed or
    /// reordered completion).
    Completion(WcStatus),
    /// The node that crashed at this work request comes back as a new process (`crash_restart_prefill`).
    Restart,
}

#[derive(Debug)]
struct Node {
    /// By start address.
    regions: BTreeMap<u64, Region>,
    by_lkey: BTreeMap<u32, u64>,
    by_rkey: BTreeMap<u32, u64>,
    next_addr: u64,
    qps: BTreeMap<QpNum, Qp>,
    next_qpn: u32,
    cq: VecDeque<Cqe>,
    /// Crashed (`crash_prefill`): every QP in the error state, the CQ lost, nothing polled any more.
    crashed: bool,
}

#[derive(Debug)]
struct Region {
    addr: u64,
    memory: Memory,
    lkey: u32,
    rkey: u32,
}

/// One QP's state.
#[derive(Debug, Default)]
struct Qp {
    /// `None` while in the reset state.
    peer: Option<QpInfo>,
    /// The error state: every later work request is flushed.
    failed: bool,
    /// Send-queue credits, by position (the same accounting as every fabric).
    queue: SendQueue,
    wire_free_ns: u64,
    last_delivery_ns: u64,
    /// Hung (`timeout`): no work request on it lands or completes any more.
    stalled: bool,
    /// The time until which a completion of this QP is held back (a later one may not overtake it).
    completions_held_until: u64,
}

/// A completion waiting in a CQ; polling a sender's completion frees its QP's slots up to `frees_through`.
#[derive(Debug)]
struct Cqe {
    wc: WorkCompletion,
    frees_through: Option<u64>,
}

impl World {
    fn node(&self, node: NodeId) -> &Node {
        self.nodes.get(&node).expect("endpoints exist only for nodes SimWorld::endpoint created")
    }

    fn node_mut(&mut self, node: NodeId) -> &mut Node {
        self.nodes.get_mut(&node).expect("endpoints exist only for nodes SimWorld::endpoint created")
    }

    fn fresh_key(&mut self) -> Result<u32, FabricError> {
        let key = self.next_key;
        self.next_key = key.checked_add(1).ok_or(FabricError::Exhausted("memory keys"))?;
        Ok(key)
    }

    fn register(&mut self, node: NodeId, memory: Memory) -> Result<MemoryRegion, FabricError> {
        let lkey = self.fresh_key()?;
        let rkey = self.fresh_key()?;
        self.node_mut(node).insert(memory, lkey, rkey)
    }

    fn post(&mut self, node: NodeId, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        let caps = self.caps;
        let state = self.node(node).qps.get(&qp).ok_or(FabricError::UnknownQp(qp))?;
        if state.peer.is_none() {
            return Err(FabricError::NotConnected(qp));
        }
        state.queue.check_post(qp, caps, wrs)?;
        for wr in wrs {
            self.schedule(node, qp, wr.clone());
        }
        Ok(())
    }

    fn schedule(&mut self, node: NodeId, qp: QpNum, wr: WorkRequest) {
        let now_ns = self.now_ns;
        let state = self.node_mut(node).qps.get_mut(&qp).expect("checked by post");
        let time_ns = state.delivery_time(now_ns, wr.byte_len().expect("checked by check_post"));
        let seq = state.queue.push(wr.signaled);
        let key = (time_ns, self.next_event);
        self.next_event += 1;
        self.events.insert(key, Delivery { node, qp, seq, wr, what: What::Execute });
    }

    fn next_event_at_or_before(&self, time_ns: u64) -> bool {
        self.events.keys().next().is_some_and(|&(event_ns, _)| event_ns <= time_ns)
    }

    fn deliver_next(&mut self) {
        let ((time_ns, _), delivery) = self.events.pop_first().expect("caller checked an event is pending");
        self.now_ns = self.now_ns.max(time_ns);
        match delivery.what {
            What::Execute => self.execute_delivery(&delivery),
            What::LateBytes => {
                // The bytes of a completed `notify_before_data` work request, landing now whatever its QP's state.
                let peer = self.node(delivery.node).qps[&delivery.qp].peer.expect("delivered on a connected QP");
                self.copy_across(delivery.node, &delivery.wr.sges, peer.node, delivery.wr.remote);
            }
            What::Restart => self.restart(delivery.node),
            What::Completion(status) => {
                let node = self.node_mut(delivery.node);
                if !node.crashed {
                    node.cq.push_back(send_completion(&delivery, status));
                }
            }
        }
    }

    /// A work request's delivery: a drawn fault, the execution, the completion.
    fn execute_delivery(&mut self, delivery: &Delivery) {
        let qp = &self.node(delivery.node).qps[&delivery.qp];
        let (failed, stalled) = (qp.failed, qp.stalled);
        if stalled {
            // A hung queue pair (`timeout`): nothing lands, nothing completes.
            return;
        }
        let fault = match &mut self.faults {
            Some(faults) if !failed => faults.on_work_request(delivery.node, delivery.qp),
            _ => None,
        };
        match fault {
            Some(FaultKind::CrashPrefill) => return self.crash(delivery.node),
            Some(FaultKind::CrashRestartPrefill) => {
                self.crash(delivery.node);
                let at = self.now_ns.saturating_add(RESTART_NS);
                let restart = Delivery { wr: delivery.wr.clone(), what: What::Restart, ..*delivery };
                self.events.insert((at, self.next_event), restart);
                self.next_event += 1;
                return;
            }
            Some(FaultKind::Timeout) => {
                self.node_mut(delivery.node).qps.get_mut(&delivery.qp).expect("QPs are never destroyed").stalled = true;
                return;
            }
            _ => {}
        }
        let status = self.execute_with(delivery, fault);
        let landed = match fault {
            Some(FaultKind::TornWrite) => true,
            Some(FaultKind::NotifyBeforeData) => false,
            _ => status == WcStatus::Success,
        };
        if landed && self.faults.is_some() {
            self.landed.insert((delivery.node, delivery.qp, delivery.wr.wr_id), self.now_ns);
        }
        if self.node(delivery.node).crashed {
            // Flushed work requests of a crashed node complete into a CQ nobody polls.
            return;
        }
        let qp = self.node_mut(delivery.node).qps.get_mut(&delivery.qp).expect("QPs are never destroyed");
        qp.failed |= status != WcStatus::Success;
        if delivery.wr.signaled || status != WcStatus::Success {
            let completions = match fault {
                Some(FaultKind::DropCompletion) => 0,
                Some(FaultKind::DuplicateCompletion) => 2,
                _ => 1,
            };
            let hold = match fault {
                Some(FaultKind::DelayCompletion) => COMPLETION_DELAY_NS,
                Some(FaultKind::ReorderCompletion) => REORDER_NS,
                _ => 0,
            };
            for _ in 0..completions {
                self.complete(delivery, status, hold);
            }
        }
    }

    /// The node dies (`crash_prefill`) before the work request goes on the wire: its QPs fail, its CQ is lost.
    fn crash(&mut self, node: NodeId) {
        let node = self.node_mut(node);
        node.crashed = true;
        node.cq.clear();
        node.qps.values_mut().for_each(|qp| qp.failed = true);
    }

    /// A crashed node's new process: up again with an empty completion queue; what the old one had posted is gone and
    /// its queue pairs stay in the error state.
    fn restart(&mut self, node: NodeId) {
        let stale: Vec<(u64, u64)> = self
            .events
            .iter()
            .filter(|(_, delivery)| delivery.node == node && delivery.what != What::LateBytes)
            .map(|(key, _)| *key)
            .collect();
        for key in stale {
            self.events.remove(&key);
        }
        let node = self.node_mut(node);
        node.crashed = false;
        node.cq.clear();
    }

    /// Queues the sender's completion of `delivery` now, or `hold` later; either way after every completion of the
    /// same QP still held back (one QP's completions stay in order).
    fn complete(&mut self, delivery: &Delivery, status: WcStatus, hold: u64) {
        let now_ns = self.now_ns;
        let qp = self.node_mut(delivery.node).qps.get_mut(&delivery.qp).expect("QPs are never destroyed");
        let at = now_ns.saturating_add(hold).max(qp.completions_held_until);
        if at <= now_ns {
            let cqe = send_completion(delivery, status);
            return self.node_mut(delivery.node).cq.push_back(cqe);
        }
        qp.completions_held_until = at;
        let held = Delivery { wr: delivery.wr.clone(), what: What::Completion(status), ..*delivery };
        self.events.insert((at, self.next_event), held);
        self.next_event += 1;
    }

    /// [`World::execute`] under a drawn fault (module docs of [`super::faults`]).
    fn execute_with(&mut self, delivery: &Delivery, fault: Option<FaultKind>) -> WcStatus {
        match fault {
            Some(FaultKind::WrError(status)) => status.into(),
            Some(FaultKind::TornWrite) => {
                let half = delivery.wr.byte_len().expect("checked by check_post") / 2;
                let wr = WorkRequest { sges: cut_sges(&delivery.wr.sges, half), ..delivery.wr.clone() };
                let torn = Delivery { wr, ..*delivery };
                match self.execute(&torn) {
                    WcStatus::Success => WcStatus::RetryExceeded,
                    status => status,
                }
            }
            Some(FaultKind::NotifyBeforeData) => {
                // Completes now; the bytes land NOTIFY_LEAD_NS later (the checks happen then).
                let land_ns = self.now_ns + NOTIFY_LEAD_NS;
                let late = Delivery { wr: delivery.wr.clone(), what: What::LateBytes, ..*delivery };
                self.late.insert((delivery.node, delivery.qp, delivery.wr.wr_id), land_ns);
                self.events.insert((land_ns, self.next_event), late);
                self.next_event += 1;
                WcStatus::Success
            }
            Some(FaultKind::Corrupt) => {
                let status = self.execute(delivery);
                let len = delivery.wr.byte_len().expect("checked by check_post");
                if status == WcStatus::Success && len > 0 {
                    self.plant(delivery, len / 2..len / 2 + 1, |byte| byte ^ CORRUPTION_MASK);
                }
                status
            }
            Some(FaultKind::ReadAfterRelease) => {
                let status = self.execute(delivery);
                let len = delivery.wr.byte_len().expect("checked by check_post").min(RELEASED_BYTES);
                if status == WcStatus::Success {
                    self.plant(delivery, 0..len, |_| RELEASED_FILL);
                }
                status
            }
            _ => self.execute(delivery),
        }
    }

    /// Replaces bytes `range` of the message `delivery` wrote on its peer by `bad(byte)` (a silent fault), and logs
    /// every byte it changed.
    fn plant(&mut self, delivery: &Delivery, range: Range<u64>, bad: impl Fn(u8) -> u8) {
        self.flush();
        let peer = self.node(delivery.node).qps[&delivery.qp].peer.expect("delivered on a connected QP");
        let target = self.node_mut(peer.node);
        let Some(&addr) = target.by_rkey.get(&delivery.wr.remote.rkey) else { return };
        let region = target.regions.get_mut(&addr).expect("key index follows the regions");
        let Some(span) = region.range(delivery.wr.remote.addr + range.start, range.end - range.start) else { return };
        let mut bytes = vec![0u8; span.len()];
        region.memory.read(span.start as u64, &mut bytes);
        let planted: Vec<u8> = bytes.iter().map(|&byte| bad(byte)).collect();
        region.memory.write(span.start as u64, &planted);
        let first = delivery.wr.remote.addr + range.start;
        for (at, (&original, &left)) in (first..).zip(bytes.iter().zip(&planted)) {
            if original != left {
                self.corruptions.push((peer.node, at, left, original));
            }
        }
    }

    /// Runs one work request: checks, then gathers and writes, then notifies the receiver of an immediate.
    fn execute(&mut self, delivery: &Delivery) -> WcStatus {
        let qp = &self.node(delivery.node).qps[&delivery.qp];
        if qp.failed {
            return WcStatus::Flushed;
        }
        let peer = qp.peer.expect("posting requires a connected QP");
        if !self.connected_back(peer, QpInfo::plain(delivery.node, delivery.qp)) {
            return WcStatus::RetryExceeded;
        }
        if delivery.wr.imm.is_none() && peer.node != delivery.node {
            return self.copy_across(delivery.node, &delivery.wr.sges, peer.node, delivery.wr.remote);
        }
        self.flush();
        let Some(bytes) = self.node(delivery.node).gather(&delivery.wr.sges) else {
            return WcStatus::LocalProtection;
        };
        let target = self.node_mut(peer.node);
        if !target.scatter(delivery.wr.remote, &bytes) {
            return WcStatus::RemoteAccess;
        }
        if let Some(imm) = delivery.wr.imm {
            let wc = WorkCompletion {
                wr_id: 0,
                qp: peer.qpn,
                status: WcStatus::Success,
                kind: WcKind::RecvImm,
                imm: Some(imm),
                byte_len: bytes.len() as u64,
            };
            target.cq.push_back(Cqe { wc, frees_through: None });
        }
        WcStatus::Success
    }

    /// The common case, a WRITE between two nodes, without a staging copy: every SGE is checked, then the remote
    /// range, then each SGE's bytes are copied (or generated) straight into place. Same checks, same order, same
    /// statuses as gather then scatter, and nothing is written unless all pass.
    fn copy_across(&mut self, from: NodeId, sges: &[Sge], to: NodeId, remote: RemoteAddr) -> WcStatus {
        if self.deferred.targets.contains(&from) || self.deferred.sources.contains(&to) {
            self.flush();
        }
        let (source, target) = (self.node(from), self.node(to));
        let mut pieces = Vec::with_capacity(sges.len());
        for sge in sges {
            let Some(region) = source.by_lkey.get(&sge.lkey).map(|addr| &source.regions[addr]) else {
                return WcStatus::LocalProtection;
            };
            let Some(range) = region.range(sge.addr, sge.len) else {
                return WcStatus::LocalProtection;
            };
            pieces.push((region.addr, range.start as u64, sge.len));
        }
        let len = pieces.iter().map(|(.., len)| len).sum();
        let Some(&addr) = target.by_rkey.get(&remote.rkey) else {
            return WcStatus::RemoteAccess;
        };
        let Some(range) = target.regions[&addr].range(remote.addr, len) else {
            return WcStatus::RemoteAccess;
        };
        let deferred = &mut self.deferred;
        deferred.copies.push(DeferredCopy { from, pieces, to, target: addr, at: range.start as u64 });
        deferred.sources.insert(from);
        deferred.targets.insert(to);
        deferred.bytes += len;
        WcStatus::Success
    }

    /// Copies every deferred write's bytes ([`Deferred`]): the copies to each target node in order, the target nodes
    /// spread over the machine's cores when there are bytes enough to be worth a thread.
    fn flush(&mut self) {
        if self.deferred.copies.is_empty() {
            return;
        }
        let deferred = std::mem::take(&mut self.deferred);
        let mut by_target: BTreeMap<NodeId, Vec<DeferredCopy>> = BTreeMap::new();
        for copy in deferred.copies {
            by_target.entry(copy.to).or_default().push(copy);
        }
        let mut sources = BTreeMap::new();
        let mut targets = Vec::new();
        for (id, node) in self.nodes.iter_mut() {
            match by_target.remove(id) {
                Some(copies) => targets.push((node, copies)),
                None => {
                    sources.insert(*id, &*node);
                }
            }
        }
        let threads = std::thread::available_parallelism().map_or(1, usize::from).min(targets.len());
        if threads <= 1 || deferred.bytes < PARALLEL_FLUSH_BYTES {
            return targets.into_iter().for_each(|(node, copies)| node.apply(&copies, &sources));
        }
        let mut lanes: Vec<Vec<(&mut Node, Vec<DeferredCopy>)>> = (0..threads).map(|_| Vec::new()).collect();
        for (index, target) in targets.into_iter().enumerate() {
            lanes[index % threads].push(target);
        }
        let sources = &sources;
        std::thread::scope(|scope| {
            for lane in lanes {
                scope.spawn(move || lane.into_iter().for_each(|(node, copies)| node.apply(&copies, sources)));
            }
        });
    }

    /// Whether `peer` exists and is connected to `local` (an RC QP answers only its own peer).
    fn connected_back(&self, peer: QpInfo, local: QpInfo) -> bool {
        let peer_qp = self.nodes.get(&peer.node).and_then(|node| node.qps.get(&peer.qpn));
        peer_qp.is_some_and(|qp| qp.peer == Some(local))
    }
}

/// The first `len` bytes of a gather list.
fn cut_sges(sges: &[Sge], len: u64) -> Vec<Sge> {
    let mut left = len;
    let mut res = Vec::new();
    for sge in sges {
        if left == 0 {
            break;
        }
        res.push(Sge { len: sge.len.min(left), ..*sge });
        left -= sge.len.min(left);
    }
    res
}

/// The sender's completion of a delivered work request; polling it frees the slots up to and including its own.
fn send_completion(delivery: &Delivery, status: WcStatus) -> Cqe {
    let byte_len = if status == WcStatus::Success { delivery.wr.byte_len().expect("checked by check_post") } else { 0 };
    let wc =
        WorkCompletion { wr_id: delivery.wr.wr_id, qp: delivery.qp, status, kind: WcKind::Write, imm: None, byte_len };
    Cqe { wc, frees_through: Some(delivery.seq + 1) }
}

impl Qp {
    /// Delivery time of the next work request of `bytes` posted at `now_ns` (the module docs' model).
    fn delivery_time(&mut self, now_ns: u64, bytes: u64) -> u64 {
        let time_ns = if self.failed {
            now_ns
        } else {
            self.wire_free_ns = self.wire_free_ns.max(now_ns).saturating_add(wire_time_ns(bytes));
            self.wire_free_ns.saturating_add(LATENCY_NS)
        };
        self.last_delivery_ns = self.last_delivery_ns.max(time_ns);
        self.last_delivery_ns
    }
}

impl Node {
    /// Makes `copies` (all to this node) in order, reading their sources in `sources`.
    fn apply(&mut self, copies: &[DeferredCopy], sources: &BTreeMap<NodeId, &Node>) {
        for copy in copies {
            let source = sources[&copy.from];
            let region = self.regions.get_mut(&copy.target).expect("a region is never removed with writes pending");
            let mut at = copy.at;
            for &(addr, start, len) in &copy.pieces {
                region.memory.copy_from(at, &source.regions[&addr].memory, start, len);
                at += len;
            }
        }
    }

    fn new() -> Node {
        Node {
            regions: BTreeMap::new(),
            by_lkey: BTreeMap::new(),
            by_rkey: BTreeMap::new(),
            next_addr: REGION_BASE_ADDR,
            qps: BTreeMap::new(),
            next_qpn: FIRST_QPN,
            cq: VecDeque::new(),
            crashed: false,
        }
    }

    fn insert(&mut self, memory: Memory, lkey: u32, rkey: u32) -> Result<MemoryRegion, FabricError> {
        let addr = self.next_addr;
        let len = memory.len();
        let exhausted = FabricError::Exhausted("virtual address space");
        let end = addr.checked_add(len).and_then(|end| end.checked_add(REGION_GUARD_BYTES)).ok_or(exhausted.clone())?;
        self.next_addr = end.checked_next_multiple_of(PAGE_BYTES).ok_or(exhausted)?;
        self.regions.insert(addr, Region { addr, memory, lkey, rkey });
        self.by_lkey.insert(lkey, addr);
        self.by_rkey.insert(rkey, addr);
        Ok(MemoryRegion { addr, len, lkey, rkey })
    }

    /// The region `region` names, if it is registered here with exactly these keys and length.
    fn owned(&self, region: &MemoryRegion) -> Result<&Region, FabricError> {
        self.regions
            .get(&region.addr)
            .filter(|it| it.lkey == region.lkey && it.rkey == region.rkey && it.memory.len() == region.len)
            .ok_or(FabricError::UnknownRegion { addr: region.addr })
    }

    fn remove(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        self.owned(region)?;
        let removed = self.regions.remove(&region.addr).expect("checked by owned");
        self.by_lkey.remove(&removed.lkey);
        self.by_rkey.remove(&removed.rkey);
        Ok(removed.memory.into_vec())
    }

    fn remove_chunks(&mut self, region: &MemoryRegion) -> Result<BTreeMap<u64, Vec<u8>>, FabricError> {
        self.owned(region)?;
        let removed = self.regions.remove(&region.addr).expect("checked by owned");
        self.by_lkey.remove(&removed.lkey);
        self.by_rkey.remove(&removed.rkey);
        Ok(removed.memory.into_chunks())
    }

    fn read(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        let owned = self.owned(region)?;
        let len = out.len() as u64;
        let range = owned.addr.checked_add(offset).and_then(|addr| owned.range(addr, len));
        let range = range.ok_or(FabricError::OutOfRegion { offset, len, region_len: region.len })?;
        owned.memory.read(range.start as u64, out);
        Ok(())
    }

    fn create_qp(&mut self, node: NodeId) -> Result<QpInfo, FabricError> {
        let qpn = QpNum(self.next_qpn);
        self.next_qpn = self.next_qpn.checked_add(1).ok_or(FabricError::Exhausted("QP numbers"))?;
        self.qps.insert(qpn, Qp::default());
        Ok(QpInfo::plain(node, qpn))
    }

    fn connect(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        let qp = self.qps.get_mut(&local).ok_or(FabricError::UnknownQp(local))?;
        if qp.peer.is_some() {
            return Err(FabricError::AlreadyConnected(local));
        }
        qp.peer = Some(remote);
        Ok(())
    }

    /// The SGEs' bytes in order, or `None` if one is outside the region of its lkey.
    fn gather(&self, sges: &[Sge]) -> Option<Vec<u8>> {
        let mut bytes = Vec::new();
        for sge in sges {
            let region = &self.regions[self.by_lkey.get(&sge.lkey)?];
            let range = region.range(sge.addr, sge.len)?;
            let at = bytes.len();
            bytes.resize(at + range.len(), 0);
            region.memory.read(range.start as u64, &mut bytes[at..]);
        }
        Some(bytes)
    }

    /// Writes `bytes` at `remote`, or returns false (writing nothing) if they leave the region of its rkey.
    fn scatter(&mut self, remote: RemoteAddr, bytes: &[u8]) -> bool {
        let Some(&addr) = self.by_rkey.get(&remote.rkey) else {
            return false;
        };
        let region = self.regions.get_mut(&addr).expect("key index follows the regions");
        let Some(range) = region.range(remote.addr, bytes.len() as u64) else {
            return false;
        };
        region.memory.write(range.start as u64, bytes);
        true
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let count = max.min(self.cq.len());
        for cqe in self.cq.drain(..count) {
            if let Some(end) = cqe.frees_through {
                let qp = self.qps.get_mut(&cqe.wc.qp).expect("QPs are never destroyed");
                qp.queue.free_through(end);
            }
            out.push(cqe.wc);
        }
        count
    }
}

impl Region {
    /// Indices of `len` bytes at virtual address `addr`, if they lie inside this region.
    fn range(&self, addr: u64, len: u64) -> Option<Range<usize>> {
        let start = addr.checked_sub(self.addr)?;
        let end = start.checked_add(len)?;
        (end <= self.memory.len()).then_some(start as usize..end as usize)
    }
}

impl SimEndpoint {
    fn with<T>(&self, f: impl FnOnce(&Node) -> T) -> T {
        f(self.world.borrow().node(self.node))
    }

    fn with_mut<T>(&mut self, f: impl FnOnce(&mut Node) -> T) -> T {
        f(self.world.borrow_mut().node_mut(self.node))
    }

    /// `f` on this node's memory, every deferred write's bytes copied first ([`Deferred`]).
    fn with_memory<T>(&self, f: impl FnOnce(&mut Node) -> T) -> T {
        let mut world = self.world.borrow_mut();
        world.flush();
        f(world.node_mut(self.node))
    }
}

impl Endpoint for SimEndpoint {
    fn caps(&self) -> Caps {
        self.world.borrow().caps
    }

    fn node(&self) -> NodeId {
        self.node
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        self.world.borrow_mut().register(self.node, Memory::Dense(bytes))
    }

    /// Lazily: no byte is materialised until a write reaches its chunk ([`chunk_bytes`] of `item_len`).
    fn register_filled(&mut self, len: u64, item_len: u64, fill: Fill) -> Result<MemoryRegion, FabricError> {
        let pool = self.world.borrow().pool.clone();
        let memory = Memory::lazy(len, chunk_bytes(item_len), fill, pool);
        self.world.borrow_mut().register(self.node, memory)
    }

    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        self.with_memory(|node| node.remove(region))
    }

    fn deregister_sparse(&mut self, region: &MemoryRegion) -> Result<BTreeMap<u64, Vec<u8>>, FabricError> {
        self.with_memory(|node| node.remove_chunks(region))
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        self.with_memory(|node| node.read(region, offset, out))
    }

    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        let id = self.node;
        self.with_mut(|node| node.create_qp(id))
    }

    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        self.with_mut(|node| node.connect(local, remote))
    }

    fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        self.world.borrow_mut().post(self.node, qp, wrs)
    }

    fn crashed(&self) -> bool {
        self.with(|node| node.crashed)
    }

    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        if self.eager {
            SimWorld { inner: Rc::clone(&self.world) }.run_until_idle();
        }
        self.with_mut(|node| node.poll(out, max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_time_rounds_up_to_whole_nanoseconds() {
        assert_eq!(wire_time_ns(0), 0);
        assert_eq!(wire_time_ns(1), 1);
        assert_eq!(wire_time_ns(25), 1);
        assert_eq!(wire_time_ns(26), 2);
        assert_eq!(wire_time_ns(25_000_000_000), 1_000_000_000);
    }

    #[test]
    fn regions_get_disjoint_page_aligned_ranges_with_a_guard_gap() {
        let world = SimWorld::new(Caps { max_sge: 1, max_message: 1, sq_depth: 1 });
        let mut endpoint = world.endpoint(NodeId(0));
        let first = endpoint.register(vec![0; 5000]).unwrap();
        let second = endpoint.register(Vec::new()).unwrap();
        let third = endpoint.register(vec![0; 1]).unwrap();
        assert_eq!(first.addr, REGION_BASE_ADDR);
        assert!(second.addr >= first.addr + first.len + REGION_GUARD_BYTES);
        assert!(third.addr >= second.addr + REGION_GUARD_BYTES);
        assert_eq!(second.addr % PAGE_BYTES, 0);
        let keys = [first.lkey, first.rkey, second.lkey, second.rkey, third.lkey, third.rkey];
        assert!(keys.windows(2).all(|pair| pair[0] < pair[1]), "keys must be fresh: {keys:?}");
    }

    /// Two connected nodes, each with a 64-byte region (the source filled with 7s), and a world planting `kind` on
    /// every work request.
    fn linked(kind: FaultKind) -> (SimWorld, SimEndpoint, SimEndpoint, QpNum, MemoryRegion, MemoryRegion) {
        let world = SimWorld::new(Caps { max_sge: 4, max_message: 1 << 20, sq_depth: 16 });
        world.set_faults(&FaultPlan {
            seed: 1,
            rules: vec![super::super::faults::FaultRule { kind, probability: 1.0 }],
        });
        let (mut sender, mut receiver) = (world.endpoint(NodeId(0)), world.endpoint(NodeId(1)));
        let source = sender.register(vec![7; 64]).unwrap();
        let target = receiver.register(vec![0; 64]).unwrap();
        let (a, b) = (sender.create_qp().unwrap(), receiver.create_qp().unwrap());
        sender.connect_qp(a.qpn, b).unwrap();
        receiver.connect_qp(b.qpn, a).unwrap();
        (world, sender, receiver, a.qpn, source, target)
    }

    fn write(source: &MemoryRegion, target: &MemoryRegion, wr_id: u64) -> WorkRequest {
        WorkRequest {
            wr_id,
            sges: vec![Sge { addr: source.addr, len: 64, lkey: source.lkey }],
            remote: RemoteAddr { addr: target.addr, rkey: target.rkey },
            imm: None,
            signaled: true,
        }
    }

    /// A crash: the write never lands, the node is marked crashed, its completion queue stays empty, and what it
    /// posts later is flushed into nothing.
    #[test]
    fn a_crashed_node_moves_no_byte_and_completes_nothing() {
        let (world, mut sender, receiver, qp, source, target) = linked(FaultKind::CrashPrefill);
        sender.post_send(qp, &[write(&source, &target, 1)]).unwrap();
        world.run_until_idle();
        assert!(world.crashed(NodeId(0)) && sender.crashed() && !receiver.crashed());
        let mut completions = Vec::new();
        assert_eq!(sender.poll_cq(&mut completions, 16), 0);
        sender.post_send(qp, &[write(&source, &target, 2)]).unwrap();
        world.run_until_idle();
        assert_eq!(sender.poll_cq(&mut completions, 16), 0);
        let mut bytes = vec![1; 64];
        receiver.read_local(&target, 0, &mut bytes).unwrap();
        assert_eq!(bytes, vec![0; 64]);
        assert_eq!(world.injected_faults().get("crash_prefill"), Some(&1));
    }

    /// A notification before its data: the Success completion is there before the bytes, which land
    /// NOTIFY_LEAD_NS later (their time logged).
    #[test]
    fn a_notification_before_its_data_completes_before_the_bytes_land() {
        let (world, mut sender, receiver, qp, source, target) = linked(FaultKind::NotifyBeforeData);
        sender.post_send(qp, &[write(&source, &target, 1)]).unwrap();
        let delivered = world.next_event().unwrap();
        world.advance_to(delivered);
        let mut completions = Vec::new();
        assert_eq!(sender.poll_cq(&mut completions, 16), 1);
        assert_eq!(completions[0].status, WcStatus::Success);
        let mut bytes = vec![1; 64];
        receiver.read_local(&target, 0, &mut bytes).unwrap();
        assert_eq!(bytes, vec![0; 64], "not landed yet");
        assert_eq!(world.late_landings().get(&(NodeId(0), qp, 1)), Some(&(delivered + NOTIFY_LEAD_NS)));
        world.advance_to(delivered + NOTIFY_LEAD_NS);
        receiver.read_local(&target, 0, &mut bytes).unwrap();
        assert_eq!(bytes, vec![7; 64]);
    }
    /// A delayed completion: the bytes land at delivery, the completion comes COMPLETION_DELAY_NS later, and the
    /// QP's later completions stay behind it.
    #[test]
    fn a_delayed_completion_comes_late_and_in_queue_pair_order() {
        let (world, mut sender, receiver, qp, source, target) = linked(FaultKind::DelayCompletion);
        sender.post_send(qp, &[write(&source, &target, 1), write(&source, &target, 2)]).unwrap();
        let delivered = world.next_event().unwrap();
        world.advance_to(delivered);
        let mut bytes = vec![1; 64];
        receiver.read_local(&target, 0, &mut bytes).unwrap();
        assert_eq!(bytes, vec![7; 64], "landed at delivery");
        let mut completions = Vec::new();
        assert_eq!(sender.poll_cq(&mut completions, 16), 0);
        world.advance_to(delivered + COMPLETION_DELAY_NS);
        assert_eq!(sender.poll_cq(&mut completions, 16), 1);
        world.run_until_idle();
        sender.poll_cq(&mut completions, 16);
        let order: Vec<u64> = completions.iter().map(|wc| wc.wr_id).collect();
        assert_eq!(order, [1, 2]);
    }

    /// A reordered completion lets another queue pair's later completion overtake it on the shared completion
    /// queue. The fault seed is the first under which the first queue pair's draw fires and the second's does not.
    #[test]
    fn a_reordered_completion_is_overtaken_by_another_queue_pairs() {
        let fires = |seed: u64, qp: u32| {
            let plan = FaultPlan {
                seed,
                rules: vec![super::super::faults::FaultRule { kind: FaultKind::ReorderCompletion, probability: 0.5 }],
            };
            Injector::new(&plan).on_work_request(NodeId(0), QpNum(qp)).is_some()
        };
        let (world, mut sender, mut receiver, qp, source, target) = linked(FaultKind::ReorderCompletion);
        let (other, back) = (sender.create_qp().unwrap(), receiver.create_qp().unwrap());
        sender.connect_qp(other.qpn, back).unwrap();
        receiver.connect_qp(back.qpn, other).unwrap();
        let seed = (0..1000).find(|&seed| fires(seed, qp.0) && !fires(seed, other.qpn.0)).unwrap();
        world.set_faults(&FaultPlan {
            seed,
            rules: vec![super::super::faults::FaultRule { kind: FaultKind::ReorderCompletion, probability: 0.5 }],
        });
        sender.post_send(qp, &[write(&source, &target, 1)]).unwrap();
        world.advance_to(world.next_event().unwrap());
        sender.post_send(other.qpn, &[write(&source, &target, 2)]).unwrap();
        world.run_until_idle();
        let mut completions = Vec::new();
        sender.poll_cq(&mut completions, 16);
        let order: Vec<u64> = completions.iter().map(|wc| wc.wr_id).collect();
        assert_eq!(order, [2, 1]);
        assert_eq!(world.injected_faults().get("reorder_completion"), Some(&1));
    }

    /// A hung queue pair: neither the work request that hit it nor any later one lands or completes.
    #[test]
    fn a_hung_queue_pair_lands_and_completes_nothing() {
        let (world, mut sender, receiver, qp, source, target) = linked(FaultKind::Timeout);
        sender.post_send(qp, &[write(&source, &target, 1)]).unwrap();
        world.run_until_idle();
        sender.post_send(qp, &[write(&source, &target, 2)]).unwrap();
        world.run_until_idle();
        let mut completions = Vec::new();
        assert_eq!(sender.poll_cq(&mut completions, 16), 0);
        let mut bytes = vec![1; 64];
        receiver.read_local(&target, 0, &mut bytes).unwrap();
        assert_eq!(bytes, vec![0; 64]);
        assert_eq!(world.injected_faults().get("timeout"), Some(&1), "drawn once: the hung QP draws no more");
    }

    /// A read after release: the work request completes successfully, its message lands as the reused page's
    /// bytes, and every changed byte is logged with the value the write had put there.
    #[test]
    fn a_read_after_release_lands_the_reused_pages_bytes_silently() {
        let (world, mut sender, receiver, qp, source, target) = linked(FaultKind::ReadAfterRelease);
        sender.post_send(qp, &[write(&source, &target, 1)]).unwrap();
        world.run_until_idle();
        let mut completions = Vec::new();
        assert_eq!(sender.poll_cq(&mut completions, 16), 1);
        assert_eq!(completions[0].status, WcStatus::Success);
        let mut bytes = vec![1; 64];
        receiver.read_local(&target, 0, &mut bytes).unwrap();
        assert_eq!(bytes, vec![RELEASED_FILL; 64]);
        let log = world.corruptions();
        assert_eq!(log.len(), 64);
        assert_eq!(log[0], (NodeId(1), target.addr, RELEASED_FILL, 7));
    }
}
