//! A transport certified from its own Rust code: the template for a vendor whose transport is a Rust crate.
//!
//! `LoopbackEndpoint` implements `kvrelay::fabric::verbs::Endpoint` from scratch, over nothing but the public verbs
//! vocabulary and `SendQueue` (the send-queue credit accounting every fabric shares, so that all refuse the same
//! posts). `Loopback` implements `kvrelay::certify::Transport`, and `main` calls `kvrelay::certify::certify`, the
//! library entry point, then writes the same three files as `kvrelay certify`. Run it from the repository root:
//!
//! ```sh
//! cargo run --release --example certify-loopback -- target/certify/loopback            # certified, exit 0
//! cargo run --release --example certify-loopback -- target/certify/loopback-planted --plant-wrong-offset  # exit 1
//! cargo run --release --example certify-loopback -- /tmp/one --case scenario/basic/mla-tp2-to-tp4     # one case
//! ```
//!
//! The "hardware" here is a [`Wire`]: every endpoint of one transport holds the same `Rc<RefCell<Wire>>`, which
//! owns each node's registered memory, QPs and completion queue, so a post on one endpoint writes straight into
//! another endpoint's registered memory and executes before `post_send` returns. To adapt the template:
//!
//! 1. Replace [`Wire`]'s state with handles onto your device (protection domain, CQ, QPs, registrations) and the
//!    bodies of the `Endpoint` methods with the matching calls: `register` pins memory and hands out keys,
//!    `deregister` revokes them, `post_send` rings the doorbell (keep the checks of `Wire::post`: every fabric
//!    refuses exactly the same posts), `poll_cq` reads your CQ.
//! 2. Keep one `SendQueue` per QP: `check_post` before posting, `push` per posted work request, `free_through` when
//!    a completion of yours is polled; it is the contract's credit rule, written once.
//! 3. Grant `Caps` no larger than your device's limits ([`LIMITS`]); make `Transport::step` and `settle` wait for
//!    your hardware (they are no-ops here because posts complete at once) and put your device facts in `identity`.
//! 4. Keep `main`: the case set, the report files and the exit code are what CI reads.
//!
//! `--plant-wrong-offset` plants the kind of bug certification exists to catch: a write landing 4096 bytes or more
//! into its region lands 64 bytes further when that still fits. The conformance cases (regions of a few hundred
//! bytes) still pass; the scenarios moving real KV-cache layouts, and the throughput run, fail byte for byte.

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "a command-line example reports on its terminal")]

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

use kvrelay::certify::{self, CaseSet, Identity, Options, Transport, TransportError};
use kvrelay::fabric::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpInfo, QpNum, RemoteAddr, SendQueue, Sge, WcKind, WcStatus,
    WorkCompletion, WorkRequest,
};
use kvrelay::harness::Budget;

/// The most this transport grants, whatever a caller asks for.
const LIMITS: Caps = Caps { max_sge: 16, max_message: 1 << 30, sq_depth: 1024 };
/// Address of each node's first registration: never zero, so a zero address is always someone's mistake.
const FIRST_ADDR: u64 = 0x5500_0000_0000;
/// Unregistered bytes at least between two registrations; starts are aligned to it too.
const ADDR_GAP: u64 = 64 << 10;
/// First lkey handed out; keys go up by two, the rkey being the lkey with its lowest bit set.
const FIRST_KEY: u32 = 0x1_0000;
/// First QP number of each node.
const FIRST_QPN: u32 = 0x200;
/// The planted bug: writes landing this far or further into their region ...
const PLANT_FROM: usize = 4096;
/// ... land this many bytes further.
const PLANT_SHIFT: usize = 64;

/// The smaller of what a caller asks for and [`LIMITS`], limit by limit.
fn granted(asked: Caps) -> Caps {
    Caps {
        max_sge: asked.max_sge.min(LIMITS.max_sge),
        max_message: asked.max_message.min(LIMITS.max_message),
        sq_depth: asked.sq_depth.min(LIMITS.sq_depth),
    }
}

/// One registration: its bytes (owned until deregistered), where they start and the keys reaching them.
struct Registration {
    addr: u64,
    rkey: u32,
    bytes: Vec<u8>,
}

impl Registration {
    /// Indices of `len` bytes at virtual address `addr`, if every one of them is inside this registration.
    fn span(&self, addr: u64, len: u64) -> Option<Range<usize>> {
        let start = usize::try_from(addr.checked_sub(self.addr)?).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        (end <= self.bytes.len()).then_some(start..end)
    }
}

/// Where the planted bug puts `span` inside a region of `region_len` bytes (unchanged when it would not fit).
fn misplaced(span: Range<usize>, region_len: usize) -> Range<usize> {
    let shifted = span.start.checked_add(PLANT_SHIFT).zip(span.end.checked_add(PLANT_SHIFT));
    match shifted {
        Some((start, end)) if span.start >= PLANT_FROM && end <= region_len => start..end,
        _ => span,
    }
}

/// A WRITE completion on `qp` with `status` and `byte_len`, with wr_id 0 and no immediate.
fn completion(qp: QpNum, status: WcStatus, byte_len: u64) -> WorkCompletion {
    WorkCompletion { wr_id: 0, qp, status, kind: WcKind::Write, imm: None, byte_len }
}

/// One QP: its peer once connected (`None` in RESET), whether it is in the error state, and its credits.
#[derive(Default)]
struct Qp {
    peer: Option<QpInfo>,
    in_error: bool,
    credits: SendQueue,
}

/// A completion waiting to be polled; polling a sender's completion frees its QP's slots before `frees_until`.
struct Pending {
    wc: WorkCompletion,
    frees_until: Option<u64>,
}

/// One node's share of the wire: its memory (by lkey), its QPs and its completion queue.
struct Host {
    memory: BTreeMap<u32, Registration>,
    next_addr: u64,
    qps: BTreeMap<QpNum, Qp>,
    next_qpn: u32,
    cq: VecDeque<Pending>,
}

impl Host {
    fn new() -> Host {
        Host {
            memory: BTreeMap::new(),
            next_addr: FIRST_ADDR,
            qps: BTreeMap::new(),
            next_qpn: FIRST_QPN,
            cq: VecDeque::new(),
        }
    }

    /// The registration `region` names, if this host has it with exactly these address, keys and length.
    fn owned(&self, region: &MemoryRegion) -> Result<&Registration, FabricError> {
        let found = self.memory.get(&region.lkey).filter(|it| it.addr == region.addr && it.rkey == region.rkey);
        found.filter(|it| it.bytes.len() as u64 == region.len).ok_or(FabricError::UnknownRegion { addr: region.addr })
    }

    /// Reserves `len` bytes of address space, followed by at least [`ADDR_GAP`] unregistered bytes.
    fn reserve(&mut self, len: u64) -> Result<u64, FabricError> {
        let addr = self.next_addr;
        let next = addr.checked_add(len).and_then(|end| end.checked_add(ADDR_GAP));
        let next = next.and_then(|end| end.checked_next_multiple_of(ADDR_GAP));
        self.next_addr = next.ok_or(FabricError::Exhausted("virtual address space"))?;
        Ok(addr)
    }

    /// The bytes of `sges` in order, or `None` when one leaves the registration of its lkey.
    fn gather(&self, sges: &[Sge]) -> Option<Vec<u8>> {
        let mut gathered = Vec::new();
        for sge in sges {
            let source = self.memory.get(&sge.lkey)?;
            gathered.extend_from_slice(source.bytes.get(source.span(sge.addr, sge.len)?)?);
        }
        Some(gathered)
    }

    /// Writes `bytes` at `remote`; `false` (nothing written) when they leave the registration of its rkey.
    fn land(&mut self, remote: RemoteAddr, bytes: &[u8], plant: bool) -> bool {
        let target = self.memory.get_mut(&(remote.rkey & !1)).filter(|it| it.rkey == remote.rkey);
        let Some(target) = target else { return false };
        let Some(mut span) = target.span(remote.addr, bytes.len() as u64) else { return false };
        if plant {
            span = misplaced(span, target.bytes.len());
        }
        target.bytes.get_mut(span).map(|landing| landing.copy_from_slice(bytes)).is_some()
    }

    /// Whether this host's `qpn` is connected back to `node`'s `from`.
    fn answers(&self, qpn: QpNum, node: NodeId, from: QpNum) -> bool {
        let peer = self.qps.get(&qpn).and_then(|qp| qp.peer);
        peer.is_some_and(|peer| peer.node == node && peer.qpn == from)
    }
}

/// Everything the endpoints of one transport share: each node's host, the key counter, and the planted bug.
struct Wire {
    hosts: BTreeMap<NodeId, Host>,
    next_key: u32,
    plant_wrong_offset: bool,
}

impl Wire {
    fn new(plant_wrong_offset: bool) -> Wire {
        Wire { hosts: BTreeMap::new(), next_key: FIRST_KEY, plant_wrong_offset }
    }

    /// `node`'s host, created on first use.
    fn host(&mut self, node: NodeId) -> &mut Host {
        self.hosts.entry(node).or_insert_with(Host::new)
    }

    /// Registers `bytes` on `node` with a fresh lkey (even) and rkey (the lkey plus one), unique on the wire.
    fn register(&mut self, node: NodeId, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        let lkey = self.next_key;
        self.next_key = lkey.checked_add(2).ok_or(FabricError::Exhausted("memory keys"))?;
        let host = self.host(node);
        let len = bytes.len() as u64;
        let addr = host.reserve(len)?;
        host.memory.insert(lkey, Registration { addr, rkey: lkey | 1, bytes });
        Ok(MemoryRegion { addr, len, lkey, rkey: lkey | 1 })
    }

    /// Checks a batch the way every fabric does, then executes and completes each work request in order.
    fn post(&mut self, node: NodeId, qpn: QpNum, caps: Caps, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        let qp = self.hosts.get(&node).and_then(|host| host.qps.get(&qpn)).ok_or(FabricError::UnknownQp(qpn))?;
        let peer = qp.peer.ok_or(FabricError::NotConnected(qpn))?;
        qp.credits.check_post(qpn, caps, wrs)?;
        for wr in wrs {
            let in_error = self.host(node).qps.get(&qpn).is_some_and(|qp| qp.in_error);
            let status = if in_error { WcStatus::Flushed } else { self.execute(node, qpn, peer, wr) };
            self.complete(node, qpn, wr, status);
        }
        Ok(())
    }

    /// Moves one work request's bytes: peer check, gather, bounds-checked landing, then the receiver's RecvImm.
    fn execute(&mut self, node: NodeId, qpn: QpNum, peer: QpInfo, wr: &WorkRequest) -> WcStatus {
        let plant = self.plant_wrong_offset;
        if !self.hosts.get(&peer.node).is_some_and(|host| host.answers(peer.qpn, node, qpn)) {
            return WcStatus::RetryExceeded;
        }
        let Some(bytes) = self.host(node).gather(&wr.sges) else { return WcStatus::LocalProtection };
        let receiver = self.host(peer.node);
        if !receiver.land(wr.remote, &bytes, plant) {
            return WcStatus::RemoteAccess;
        }
        if let Some(imm) = wr.imm {
            let landed = completion(peer.qpn, WcStatus::Success, bytes.len() as u64);
            let wc = WorkCompletion { kind: WcKind::RecvImm, imm: Some(imm), ..landed };
            receiver.cq.push_back(Pending { wc, frees_until: None });
        }
        WcStatus::Success
    }

    /// Takes a send-queue slot for `wr`; a failure moves the QP to the error state. Signalled and failed work
    /// requests complete; a successful unsignalled one completes silently (a later completion frees its slot).
    fn complete(&mut self, node: NodeId, qpn: QpNum, wr: &WorkRequest, status: WcStatus) {
        let host = self.host(node);
        let Some(qp) = host.qps.get_mut(&qpn) else { return };
        let position = qp.credits.push(wr.signaled);
        let ok = status == WcStatus::Success;
        qp.in_error |= !ok;
        if wr.signaled || !ok {
            let byte_len = if ok { wr.byte_len().unwrap_or(0) } else { 0 };
            let wc = WorkCompletion { wr_id: wr.wr_id, ..completion(qpn, status, byte_len) };
            host.cq.push_back(Pending { wc, frees_until: position.checked_add(1) });
        }
    }
}

/// One node's endpoint onto its transport's wire.
struct LoopbackEndpoint {
    wire: Rc<RefCell<Wire>>,
    node: NodeId,
    caps: Caps,
}

impl Endpoint for LoopbackEndpoint {
    fn caps(&self) -> Caps {
        self.caps
    }

    fn node(&self) -> NodeId {
        self.node
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        self.wire.borrow_mut().register(self.node, bytes)
    }

    /// Revokes both keys and hands back the bytes, as they are now.
    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        let mut wire = self.wire.borrow_mut();
        let host = wire.host(self.node);
        host.owned(region)?;
        let removed = host.memory.remove(&region.lkey).ok_or(FabricError::UnknownRegion { addr: region.addr })?;
        Ok(removed.bytes)
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        let wire = self.wire.borrow();
        let unknown = FabricError::UnknownRegion { addr: region.addr };
        let source = wire.hosts.get(&self.node).ok_or(unknown)?.owned(region)?;
        let len = out.len() as u64;
        let outside = FabricError::OutOfRegion { offset, len, region_len: region.len };
        let span = source.addr.checked_add(offset).and_then(|addr| source.span(addr, len));
        out.copy_from_slice(span.and_then(|span| source.bytes.get(span)).ok_or(outside)?);
        Ok(())
    }

    /// A QP in RESET: it takes posts once connected.
    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        let mut wire = self.wire.borrow_mut();
        let host = wire.host(self.node);
        let qpn = QpNum(host.next_qpn);
        host.next_qpn = qpn.0.checked_add(1).ok_or(FabricError::Exhausted("QP numbers"))?;
        host.qps.insert(qpn, Qp::default());
        Ok(QpInfo::plain(self.node, qpn))
    }

    /// RESET → connected, once: the peer must connect back for writes to land.
    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        let mut wire = self.wire.borrow_mut();
        let qp = wire.host(self.node).qps.get_mut(&local).ok_or(FabricError::UnknownQp(local))?;
        match qp.peer {
            Some(_) => Err(FabricError::AlreadyConnected(local)),
            None => {
                qp.peer = Some(remote);
                Ok(())
            }
        }
    }

    fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        self.wire.borrow_mut().post(self.node, qp, self.caps, wrs)
    }

    /// Hands out completions in order; a sender's completion returns its QP's credits up to its own.
    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let mut wire = self.wire.borrow_mut();
        let host = wire.host(self.node);
        let taken = max.min(host.cq.len());
        for pending in host.cq.drain(..taken) {
            let qp = host.qps.get_mut(&pending.wc.qp);
            if let (Some(qp), Some(end)) = (qp, pending.frees_until) {
                qp.credits.free_through(end);
            }
            out.push(pending.wc);
        }
        taken
    }
}

/// The transport: one wire per case, endpoints opened onto it.
struct Loopback {
    wire: Rc<RefCell<Wire>>,
    plant_wrong_offset: bool,
}

impl Loopback {
    fn new(plant_wrong_offset: bool) -> Loopback {
        Loopback { wire: Rc::new(RefCell::new(Wire::new(plant_wrong_offset))), plant_wrong_offset }
    }
}

impl Transport for Loopback {
    fn identity(&self) -> Identity {
        let mut identity =
            Identity { name: "loopback".to_owned(), version: "template-2".to_owned(), ..Identity::default() };
        let facts = [
            ("fabric", "one in-process wire, executing at post".to_owned()),
            ("max_sge", LIMITS.max_sge.to_string()),
            ("max_message", LIMITS.max_message.to_string()),
            ("sq_depth", LIMITS.sq_depth.to_string()),
            ("planted-offset", if self.plant_wrong_offset { PLANT_SHIFT } else { 0 }.to_string()),
        ];
        identity.facts.extend(facts.map(|(name, value)| (name.to_owned(), value)));
        identity
    }

    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, TransportError> {
        self.wire.borrow_mut().host(node);
        Ok(Box::new(LoopbackEndpoint { wire: Rc::clone(&self.wire), node, caps: granted(caps) }))
    }

    /// Nothing to wait for: every work request executed when it was posted.
    fn step(&mut self) {}

    /// Nothing to wait for: every work request executed when it was posted.
    fn settle(&mut self) {}

    /// A fresh wire; endpoints of earlier cases keep the old one to themselves.
    fn reset(&mut self) {
        *self = Loopback::new(self.plant_wrong_offset);
    }
}

/// The command line: `OUT_DIR [--plant-wrong-offset] [--case ID]...`.
struct Args {
    out: PathBuf,
    planted: bool,
    cases: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(args.next().unwrap_or_else(|| "target/certify/loopback".to_owned()));
    let (mut planted, mut cases) = (false, Vec::new());
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--plant-wrong-offset" => planted = true,
            "--case" => cases.push(args.next().ok_or("--case needs a case id")?),
            other => {
                return Err(format!("unknown argument `{other}` (fix: OUT_DIR [--plant-wrong-offset] [--case ID]...)"))
            }
        }
    }
    Ok(Args { out, planted, cases })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut transport = Loopback::new(args.planted);
    let set = match CaseSet::load("scenarios".as_ref()).and_then(|set| set.check_ids(&args.cases).map(|()| set)) {
        Ok(set) => set,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let budget = Budget::from_env().unwrap_or_else(|_| Budget::bytes(4 << 30));
    let planted = if args.planted { " --plant-wrong-offset" } else { "" };
    let reproduce = format!("cargo run --release --example certify-loopback -- {}{planted}", args.out.display());
    let mut options = Options::new(budget, &reproduce);
    options.only = args.cases;
    let report = certify::certify(&mut transport, &set, &options, &mut |result| {
        println!("{:<26} {}", result.verdict.name(), result.id);
    });
    println!("{}", report.summary());
    match report.write(&args.out) {
        Ok(written) => {
            println!("wrote {}, {}, {}", written.junit.display(), written.json.display(), written.manifest.display())
        }
        Err(error) => {
            eprintln!("error: writing the report into {}: {error}", args.out.display());
            return ExitCode::FAILURE;
        }
    }
    if report.certified() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
