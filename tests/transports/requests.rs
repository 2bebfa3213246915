//! A transport shaped like NIXL, certified from its own Rust code: the template for a vendor whose engine moves
//! *requests* of descriptor lists to a peer *agent*, with one status per request and a notification after its
//! bytes, and has no queue pairs, keys or work-request completions (NIXL, Mooncake's Transfer Engine, a GPU copy
//! engine).
//!
//! `Agent` implements `kvrelay::fabric::seam::TransferEngine` directly, from scratch: every rank is an agent with a
//! name; `open` hands out the agent's metadata (`nixl-sample/1 agent=<name>`) as the peer address, as NIXL's
//! `getLocalMD` does, and `connect` loads a peer's metadata (`loadRemoteMD`); `submit` creates a transfer request
//! from the batch's descriptor lists, checking every descriptor against the registrations first (NIXL refuses a
//! request with a descriptor outside registered memory at creation, `NIXL_ERR_NOT_FOUND`, and writes nothing);
//! `poll` makes progress: each posted request moves its bytes, then queues its notification at the target agent,
//! then reports `DONE` (one completion per request). `Requests` implements `kvrelay::certify::Transport` with
//! `verbs() == false`: the seam's cases and every scenario of the corpus apply, the verbs cases do not.
//! Run it from the repository root:
//!
//! ```sh
//! cargo run --release --example certify-requests -- target/certify/requests                      # certified, exit 0
//! cargo run --release --example certify-requests -- target/certify/requests-planted --plant-dropped-tail  # exit 1
//! ```
//!
//! `--plant-dropped-tail` plants a silent bug: a request of more than [`PLANT_FROM`] descriptors skips its last one
//! and still reports `DONE` (as an engine that loses the tail of a long descriptor list would). Only the oracle can
//! see it: the status is Success.
//!
//! To adapt the template, replace [`Fabric`]'s state with your engine's agents and registrations and the bodies of
//! `Agent`'s methods with your engine's calls (create and post a request in `submit`, check its state in `poll`),
//! declare your engine's limits in `limits`, and keep `main`.

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "a command-line example reports on its terminal")]

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use kvrelay::certify::{self, CaseSet, Identity, Options, Transport, TransportError};
use kvrelay::fabric::seam::{
    Batch, BatchId, BatchStatus, Cancelled, Completion, ConnId, Event, Fill, Image, Landed, Memory, MemoryKind, NodeId,
    PeerAddress, RemoteMemory, SeamError, SeamLimits, TransferEngine,
};
use kvrelay::fabric::verbs::Caps;
use kvrelay::harness::Budget;

/// Requests of more descriptors than this lose their last one under `--plant-dropped-tail`.
pub(crate) const PLANT_FROM: usize = 32;
/// What the sample engine accepts (NIXL has no such fixed limits; a real engine declares its own).
pub(crate) const LIMITS: SeamLimits =
    SeamLimits { max_entries: 4096, max_batch_bytes: 1 << 30, batches_in_flight: 8, strided: false, paged: false };
/// The metadata prefix of an agent (what `open` advertises).
const METADATA: &str = "nixl-sample/1 agent=";
/// The largest registration the sample materialises.
const MAX_REGISTRATION: u64 = 8 << 30;

/// One registration: its address and bytes.
struct Region {
    addr: u64,
    bytes: Vec<u8>,
}

/// One agent's state in the shared fabric.
#[derive(Default)]
struct AgentState {
    /// The agent instance this state belongs to (a node's agent may be opened again before the old one is dropped).
    instance: u64,
    regions: Vec<Option<Region>>,
    /// Notifications received: (initiator agent, tag), in arrival order.
    notifications: VecDeque<(String, u32)>,
}

/// Every agent of one transport, and the address space they share.
struct Fabric {
    agents: BTreeMap<String, AgentState>,
    next_addr: u64,
    instances: u64,
    plant_dropped_tail: bool,
}

impl Fabric {
    /// The registered bytes of agent `name` holding `addr..addr + len`, as (region index, offset).
    fn find(&self, name: &str, addr: u64, len: u64) -> Option<(usize, usize)> {
        let agent = self.agents.get(name)?;
        agent.regions.iter().enumerate().find_map(|(index, region)| {
            let region = region.as_ref()?;
            let offset = addr.checked_sub(region.addr)?;
            (offset.checked_add(len)? <= region.bytes.len() as u64).then_some((index, offset as usize))
        })
    }
}

/// One end of a connection: the peer agent it was connected to and the peer's memory it advertised.
struct End {
    peer: Option<(String, Vec<RemoteMemory>)>,
}

/// A posted transfer request: its descriptors resolved to addresses, waiting for progress.
struct Request {
    id: BatchId,
    conn: ConnId,
    peer: String,
    /// (local address, remote address, length).
    descriptors: Vec<(u64, u64, u64)>,
    notify: Option<u32>,
}

/// One rank's agent.
pub(crate) struct Agent {
    node: NodeId,
    name: String,
    instance: u64,
    fabric: Rc<RefCell<Fabric>>,
    memory: Vec<Option<Memory>>,
    ends: Vec<End>,
    posted: VecDeque<Request>,
    next_request: u64,
    descriptors: u64,
}

impl Agent {
    fn in_flight(&self, conn: ConnId) -> usize {
        self.posted.iter().filter(|request| request.conn == conn).count()
    }

    fn memory(&self, id: u32) -> Result<Memory, SeamError> {
        self.memory.get(id as usize).copied().flatten().ok_or(SeamError::UnknownMemory(id))
    }

    /// Makes progress on every posted request: bytes, then the notification, then `DONE`.
    fn progress(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        let mut fabric = self.fabric.borrow_mut();
        while let Some(request) = self.posted.pop_front() {
            let mut descriptors = request.descriptors.as_slice();
            if fabric.plant_dropped_tail && descriptors.len() > PLANT_FROM {
                descriptors = &descriptors[..descriptors.len() - 1];
            }
            let mut ok = true;
            for &(local, remote, len) in descriptors {
                let source = fabric.find(&self.name, local, len);
                let target = fabric.find(&request.peer, remote, len);
                let (Some((source_region, source_offset)), Some((target_region, target_offset))) = (source, target)
                else {
                    ok = false; // released since the request was created
                    break;
                };
                let bytes = fabric.agents[&self.name].regions[source_region].as_ref().expect("found").bytes
                    [source_offset..source_offset + len as usize]
                    .to_vec();
                let target = fabric.agents.get_mut(&request.peer).expect("found").regions[target_region]
                    .as_mut()
                    .expect("found");
                target.bytes[target_offset..target_offset + len as usize].copy_from_slice(&bytes);
            }
            if let (true, Some(tag)) = (ok, request.notify) {
                let peer = fabric.agents.get_mut(&request.peer).expect("found");
                peer.notifications.push_back((self.name.clone(), tag));
            }
            let (status, landed, detail) = match ok {
                true => (BatchStatus::Success, Landed::All, String::new()),
                false => (BatchStatus::RemoteAccess, Landed::Unknown, "NIXL_ERR_NOT_FOUND at progress".to_owned()),
            };
            events.push(Event::Completed(Completion { conn: request.conn, batch: request.id, status, landed, detail }));
        }
        events
    }
}

impl TransferEngine for Agent {
    fn node(&self) -> NodeId {
        self.node
    }

    fn limits(&self) -> SeamLimits {
        LIMITS
    }

    fn register(&mut self, kind: MemoryKind, len: u64, _item_len: u64, fill: Fill) -> Result<Memory, SeamError> {
        if kind != MemoryKind::Host {
            let message = format!("the sample registers DRAM only, not {kind}");
            return Err(SeamError::Engine { call: "register", message });
        }
        if len > MAX_REGISTRATION {
            return Err(SeamError::Exhausted("memory"));
        }
        let mut bytes = vec![0u8; len as usize];
        fill(0, &mut bytes);
        let mut fabric = self.fabric.borrow_mut();
        let addr = fabric.next_addr;
        // A gap between registrations, so that a range running past one never lands in the next.
        fabric.next_addr = addr.checked_add(len + (1 << 20)).ok_or(SeamError::Exhausted("addresses"))?;
        let regions = &mut fabric.agents.get_mut(&self.name).expect("an agent's own state").regions;
        regions.push(Some(Region { addr, bytes }));
        let id = u32::try_from(self.memory.len()).map_err(|_| SeamError::Exhausted("memory ids"))?;
        let memory = Memory { id, kind, addr, len, key: 0 };
        self.memory.push(Some(memory));
        Ok(memory)
    }

    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        let memory = self.memory(memory.id)?;
        let outside = SeamError::OutOfRange { offset, len: out.len() as u64, region_len: memory.len };
        let start = memory.addr.checked_add(offset).ok_or(outside.clone())?;
        let fabric = self.fabric.borrow();
        let (region, at) = fabric.find(&self.name, start, out.len() as u64).ok_or(outside)?;
        let bytes = &fabric.agents[&self.name].regions[region].as_ref().expect("found").bytes;
        out.copy_from_slice(&bytes[at..at + out.len()]);
        Ok(())
    }

    fn release(&mut self, memory: &Memory, _sparse: bool) -> Result<Image, SeamError> {
        self.memory(memory.id)?;
        self.memory[memory.id as usize] = None;
        let mut fabric = self.fabric.borrow_mut();
        let regions = &mut fabric.agents.get_mut(&self.name).expect("an agent's own state").regions;
        let region =
            regions.get_mut(memory.id as usize).and_then(Option::take).ok_or(SeamError::UnknownMemory(memory.id))?;
        Ok(BTreeMap::from([(0, region.bytes)]))
    }

    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError> {
        let conn = ConnId(u32::try_from(self.ends.len()).map_err(|_| SeamError::Exhausted("connections"))?);
        self.ends.push(End { peer: None });
        Ok((conn, PeerAddress(format!("{METADATA}{}", self.name).into_bytes())))
    }

    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError> {
        let bad = |why: &str| SeamError::BadAddress { address: peer.to_string(), why: why.to_owned() };
        let text = std::str::from_utf8(&peer.0).map_err(|_| bad("agent metadata is text"))?;
        let name = text.strip_prefix(METADATA).ok_or_else(|| bad("expected `nixl-sample/1 agent=<name>`"))?;
        if !self.fabric.borrow().agents.contains_key(name) {
            return Err(bad("no such agent on this fabric"));
        }
        let end = self.ends.get_mut(conn.0 as usize).ok_or(SeamError::UnknownConnection(conn))?;
        if end.peer.is_some() {
            return Err(SeamError::AlreadyConnected(conn));
        }
        end.peer = Some((name.to_owned(), remote.to_vec()));
        Ok(())
    }

    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError> {
        let end = self.ends.get(conn.0 as usize).ok_or(SeamError::UnknownConnection(conn))?;
        let (peer, remote) = end.peer.clone().ok_or(SeamError::NotConnected(conn))?;
        SeamError::check_limits(&batch, LIMITS)?;
        if self.in_flight(conn) >= LIMITS.batches_in_flight {
            let bytes = batch.byte_len().unwrap_or(u64::MAX);
            let (max_entries, max_bytes) = (LIMITS.max_entries, LIMITS.max_batch_bytes);
            return Err(SeamError::OverLimits { entries: batch.entries.len(), bytes, max_entries, max_bytes });
        }
        // Every descriptor is checked against the registrations when the request is created: one outside them
        // refuses the whole request, and nothing is written.
        let mut descriptors = Vec::with_capacity(batch.entries.len());
        let fabric = self.fabric.borrow();
        for entry in &batch.entries {
            let local = self.memory(entry.local)?;
            let target = remote.get(entry.remote as usize);
            let outside =
                |region_len| SeamError::OutOfRange { offset: entry.remote_offset, len: entry.len, region_len };
            let target = target.ok_or(outside(0))?;
            let local_addr = local.addr.checked_add(entry.local_offset).ok_or(outside(local.len))?;
            let remote_addr = target.addr.checked_add(entry.remote_offset).ok_or(outside(target.len))?;
            let within_advertised = entry.remote_offset.checked_add(entry.len).is_some_and(|end| end <= target.len);
            if fabric.find(&self.name, local_addr, entry.len).is_none() {
                return Err(SeamError::OutOfRange {
                    offset: entry.local_offset,
                    len: entry.len,
                    region_len: local.len,
                });
            }
            if !within_advertised || fabric.find(&peer, remote_addr, entry.len).is_none() {
                return Err(outside(target.len));
            }
            descriptors.push((local_addr, remote_addr, entry.len));
        }
        drop(fabric);
        let id = BatchId(self.next_request);
        self.next_request += 1;
        self.descriptors += descriptors.len() as u64;
        self.posted.push_back(Request { id, conn, peer, descriptors, notify: batch.notify });
        Ok(id)
    }

    fn cancel(&mut self, batch: BatchId) -> Cancelled {
        let before = self.posted.len();
        self.posted.retain(|request| request.id != batch);
        if self.posted.len() < before {
            Cancelled::Whole
        } else {
            Cancelled::Ended
        }
    }

    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        let mut events = self.progress();
        let mut fabric = self.fabric.borrow_mut();
        let agent = fabric.agents.get_mut(&self.name).expect("an agent's own state");
        for (initiator, tag) in agent.notifications.drain(..) {
            let from = format!("{METADATA}{initiator}");
            let conn = self
                .ends
                .iter()
                .position(|end| end.peer.as_ref().is_some_and(|(name, _)| format!("{METADATA}{name}") == from));
            if let Some(conn) = conn {
                events.push(Event::Notified { conn: ConnId(conn as u32), tag });
            }
        }
        let count = events.len().min(max);
        out.extend(events.into_iter().take(count));
        count
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        let _ = timeout;
        !self.posted.is_empty()
    }

    fn operations(&self) -> u64 {
        self.descriptors
    }
}

/// An agent that goes away takes its registrations with it, as a process that dies does: a request to it then
/// finds no memory and fails (certification case `a_peer_that_dies_mid_transfer_fails_within_the_deadline`).
impl Drop for Agent {
    fn drop(&mut self) {
        let mut fabric = self.fabric.borrow_mut();
        if fabric.agents.get(&self.name).is_some_and(|state| state.instance == self.instance) {
            fabric.agents.remove(&self.name);
        }
    }
}

/// The transport: one fabric per case, agents opened onto it.
pub(crate) struct Requests {
    fabric: Rc<RefCell<Fabric>>,
    plant_dropped_tail: bool,
}

impl Requests {
    pub(crate) fn new(plant_dropped_tail: bool) -> Requests {
        let fabric = Fabric { agents: BTreeMap::new(), next_addr: 1 << 32, instances: 0, plant_dropped_tail };
        Requests { fabric: Rc::new(RefCell::new(fabric)), plant_dropped_tail }
    }
}

impl Transport for Requests {
    fn identity(&self) -> Identity {
        let mut identity =
            Identity { name: "requests".to_owned(), version: "template-1".to_owned(), ..Identity::default() };
        let facts = [
            ("fabric", "one in-process fabric of agents, NIXL-shaped requests".to_owned()),
            ("max_entries", LIMITS.max_entries.to_string()),
            ("batches_in_flight", LIMITS.batches_in_flight.to_string()),
            ("planted-dropped-tail", self.plant_dropped_tail.to_string()),
        ];
        identity.facts.extend(facts.map(|(name, value)| (name.to_owned(), value)));
        identity
    }

    fn verbs(&self) -> bool {
        false
    }

    fn engine(&mut self, node: NodeId, _caps: Caps) -> Result<Box<dyn TransferEngine>, TransportError> {
        let name = format!("agent-{}", node.0);
        let mut fabric = self.fabric.borrow_mut();
        fabric.instances += 1;
        let instance = fabric.instances;
        fabric.agents.insert(name.clone(), AgentState { instance, ..AgentState::default() });
        drop(fabric);
        Ok(Box::new(Agent {
            node,
            name,
            instance,
            fabric: Rc::clone(&self.fabric),
            memory: Vec::new(),
            ends: Vec::new(),
            posted: VecDeque::new(),
            next_request: 0,
            descriptors: 0,
        }))
    }

    /// Nothing to wait for: requests make progress when their agent polls.
    fn step(&mut self) {}

    /// Nothing to wait for: requests make progress when their agent polls.
    fn settle(&mut self) {}

    fn reset(&mut self) {
        *self = Requests::new(self.plant_dropped_tail);
    }
}

/// The command line: `OUT_DIR [--plant-dropped-tail] [--case ID]...`.
#[allow(dead_code, reason = "the integration tests include this file for its transport, not its command line")]
fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(args.next().unwrap_or_else(|| "target/certify/requests".to_owned()));
    let (mut planted, mut only) = (false, Vec::new());
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--plant-dropped-tail" => planted = true,
            "--case" => match args.next() {
                Some(id) => only.push(id),
                None => {
                    eprintln!("error: --case needs a case id");
                    return ExitCode::FAILURE;
                }
            },
            other => {
                eprintln!("error: unknown argument `{other}` (fix: OUT_DIR [--plant-dropped-tail] [--case ID]...)");
                return ExitCode::FAILURE;
            }
        }
    }
    let set = match CaseSet::load("scenarios".as_ref()).and_then(|set| set.check_ids(&only).map(|()| set)) {
        Ok(set) => set,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let budget = Budget::from_env().unwrap_or_else(|_| Budget::bytes(4 << 30));
    let flag = if planted { " --plant-dropped-tail" } else { "" };
    let reproduce = format!("cargo run --release --example certify-requests -- {}{flag}", out.display());
    let mut options = Options::new(budget, &reproduce);
    options.only = only;
    let mut transport = Requests::new(planted);
    let report = certify::certify(&mut transport, &set, &options, &mut |result| {
        println!("{:<26} {}", result.verdict.name(), result.id);
    });
    println!("{}", report.summary());
    match report.write(&out) {
        Ok(written) => {
            println!("wrote {}, {}, {}", written.junit.display(), written.json.display(), written.manifest.display())
        }
        Err(error) => {
            eprintln!("error: writing the report into {}: {error}", out.display());
            return ExitCode::FAILURE;
        }
    }
    if report.certified() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
