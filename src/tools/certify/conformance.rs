//! The transport conformance suite: the contract of [`Endpoint`] (its doc comment, rule by rule) as library cases
//! any [`Transport`] runs, a vendor's plug-in as well as the in-memory fabric or RDMA.
//!
//! Every case starts from [`Transport::reset`], opens two endpoints (nodes 0 and 1) asking for [`SUITE_CAPS`], and
//! returns [`CaseError::Failed`] with what it expected and what it saw, never panicking on anything the transport
//! returns; a transport granting less than a case's minimum gets [`CaseError::Unsupported`]. Messages stay well
//! within one MTU, so "a failed write changes no byte" (the **Protection** rule) holds on hardware too.
//! [`cases`] is the registry; `tests/it/conformance.rs` runs it on every backend and proves each case can fail.

use super::Transport;
use crate::fabric::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpNum, RemoteAddr, Sge, WcKind, WcStatus, WorkCompletion,
    WorkRequest,
};

/// What every case asks the transport for: a shallow send queue keeps the credit cases short.
pub const SUITE_CAPS: Caps = Caps { max_sge: 3, max_message: 1 << 16, sq_depth: 4 };
/// What unwritten target memory holds.
pub const SENTINEL: u8 = 0xEE;
/// Bytes of the sender's patterned source region.
pub const SOURCE_LEN: usize = 256;
/// Bytes of the receiver's sentinel target region.
pub const TARGET_LEN: usize = 256;
/// Bounds every wait, so a transport that never delivers fails instead of hanging.
const SETTLE_ROUNDS: usize = 100;
/// The largest region a case reads back whole (a forged length is a failure, not an allocation).
const MAX_READ: u64 = 1 << 20;
/// The largest message any case moves (`max_message` a case needs).
const MAX_CASE_MESSAGE: u64 = 256;

/// Why a case did not pass.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaseError {
    /// The transport broke the contract: what was expected and what was seen.
    #[error("failed: {0}")]
    Failed(String),
    /// The transport granted less than the case needs (e.g. "needs max_sge >= 3, the transport grants 1").
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// Which part of the contract a case checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    /// Work requests that succeed: ordering, signalling, credits, immediates, gathers, registration.
    Contract,
    /// Out-of-bounds ranges, protection, flushing, misuse and peers that are not connected back.
    ErrorPath,
}

impl Group {
    /// `contract` or `error-path` (the report's spelling).
    pub fn as_str(self) -> &'static str {
        match self {
            Group::Contract => "contract",
            Group::ErrorPath => "error-path",
        }
    }
}

/// One case of the suite.
#[derive(Debug, Clone, Copy)]
pub struct ConformanceCase {
    /// Stable snake_case name (the report's key; never reused for another claim).
    pub id: &'static str,
    pub group: Group,
    /// What the case shows, in one line.
    pub claim: &'static str,
    /// The least the transport must grant; less makes the case [`CaseError::Unsupported`].
    pub caps: Caps,
    pub run: fn(&mut dyn Transport) -> Result<(), CaseError>,
}

/// Returns [`CaseError::Failed`] with the formatted text unless the condition holds.
macro_rules! ensure {
    ($condition:expr, $($what:tt)+) => {
        if !$condition {
            return Err(CaseError::Failed(format!($($what)+)));
        }
    };
}

/// Returns [`CaseError::Failed`] saying what was expected and what was seen unless `seen == expected`.
macro_rules! ensure_eq {
    ($seen:expr, $expected:expr, $($what:tt)+) => {{
        let (seen, expected) = (&$seen, &$expected);
        if seen != expected {
            let what = format!($($what)+);
            return Err(CaseError::Failed(format!("{what}: expected {expected:?}, saw {seen:?}")));
        }
    }};
}

/// Context for a fabric call the case expects to succeed.
trait Context<T> {
    fn context(self, what: &str) -> Result<T, CaseError>;
}

impl<T> Context<T> for Result<T, FabricError> {
    fn context(self, what: &str) -> Result<T, CaseError> {
        self.map_err(|error| CaseError::Failed(format!("{what}: {error}")))
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The fixture.

/// A sender (node 0) and a receiver (node 1) with a patterned source region, a sentinel target region and connected
/// QP pairs: what every case starts from (public for property tests of a transport).
pub struct Link {
    pub sender: Box<dyn Endpoint>,
    pub receiver: Box<dyn Endpoint>,
    /// (sender QP, receiver QP), connected both ways.
    pub qps: Vec<(QpNum, QpNum)>,
    pub source: MemoryRegion,
    pub target: MemoryRegion,
}

impl Link {
    /// Resets `transport`, opens nodes 0 and 1 with [`SUITE_CAPS`] (each granting at least `needs`), registers the
    /// source and target regions and connects `qp_count` QP pairs.
    pub fn open(transport: &mut dyn Transport, qp_count: usize, needs: Caps) -> Result<Link, CaseError> {
        transport.reset();
        let mut sender = open_endpoint(transport, 0, needs)?;
        let mut receiver = open_endpoint(transport, 1, needs)?;
        let source = sender.register(pattern(SOURCE_LEN)).context("registering the source region")?;
        let target = receiver.register(vec![SENTINEL; TARGET_LEN]).context("registering the target region")?;
        let lens = (source.len, target.len);
        ensure_eq!(lens, (SOURCE_LEN as u64, TARGET_LEN as u64), "lengths of the registered source and target");
        let qps = (0..qp_count).map(|_| connect(&mut *sender, &mut *receiver)).collect::<Result<_, _>>()?;
        Ok(Link { sender, receiver, qps, source, target })
    }

    /// A signalled WRITE of `len` source bytes from `source_offset` to `target_offset` (addresses wrap: a region at
    /// the top of the address space gets an address no region has, which the case then reports).
    pub fn write(&self, wr_id: u64, source_offset: u64, target_offset: u64, len: u64) -> WorkRequest {
        WorkRequest {
            wr_id,
            sges: vec![Sge { addr: self.source.addr.wrapping_add(source_offset), len, lkey: self.source.lkey }],
            remote: RemoteAddr { addr: self.target.addr.wrapping_add(target_offset), rkey: self.target.rkey },
            imm: None,
            signaled: true,
        }
    }

    /// The sender's QP of pair `index` (a QP number no endpoint has if there is no such pair).
    pub fn qp(&self, index: usize) -> QpNum {
        self.qps.get(index).map_or(QpNum(u32::MAX), |pair| pair.0)
    }

    /// The receiver's QP of pair `index` (a QP number no endpoint has if there is no such pair).
    pub fn receiver_qp(&self, index: usize) -> QpNum {
        self.qps.get(index).map_or(QpNum(u32::MAX), |pair| pair.1)
    }

    /// The target region's bytes, read by the receiver.
    pub fn target_bytes(&self) -> Result<Vec<u8>, CaseError> {
        read_all(&*self.receiver, &self.target)
    }

    /// Posts on the sender, expecting the post to be accepted.
    fn post(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), CaseError> {
        let ids: Vec<u64> = wrs.iter().map(|wr| wr.wr_id).collect();
        self.sender.post_send(qp, wrs).context(&format!("posting work requests {ids:?} on {qp}"))
    }
}

/// Opens `node` asking for [`SUITE_CAPS`] and checks what it granted: never more than asked, at least `needs`.
fn open_endpoint(transport: &mut dyn Transport, node: u32, needs: Caps) -> Result<Box<dyn Endpoint>, CaseError> {
    let endpoint = transport
        .open(NodeId(node), SUITE_CAPS)
        .map_err(|error| CaseError::Failed(format!("opening node {node}: {error}")))?;
    ensure_eq!(endpoint.node(), NodeId(node), "the endpoint opened for node {node} names its node");
    check_caps(endpoint.caps(), needs)?;
    Ok(endpoint)
}

/// A grant above [`SUITE_CAPS`] breaks `Transport::open`'s promise; one below `needs` makes the case unsupported.
fn check_caps(granted: Caps, needs: Caps) -> Result<(), CaseError> {
    let limits = [
        ("max_sge", granted.max_sge as u64, needs.max_sge as u64, SUITE_CAPS.max_sge as u64),
        ("max_message", granted.max_message, needs.max_message, SUITE_CAPS.max_message),
        ("sq_depth", granted.sq_depth as u64, needs.sq_depth as u64, SUITE_CAPS.sq_depth as u64),
    ];
    for (name, granted, needs, asked) in limits {
        ensure!(granted <= asked, "asked for {name} {asked}, the transport granted more ({granted})");
        if granted < needs {
            return Err(CaseError::Unsupported(format!("needs {name} >= {needs}, the transport grants {granted}")));
        }
    }
    Ok(())
}

/// Creates a QP on each side and connects them to each other (the bootstrap's job).
fn connect(first: &mut dyn Endpoint, second: &mut dyn Endpoint) -> Result<(QpNum, QpNum), CaseError> {
    let first_info = first.create_qp().context("creating a sender QP")?;
    let second_info = second.create_qp().context("creating a receiver QP")?;
    first.connect_qp(first_info.qpn, second_info).context("connecting the sender QP")?;
    second.connect_qp(second_info.qpn, first_info).context("connecting the receiver QP")?;
    Ok((first_info.qpn, second_info.qpn))
}

/// Source bytes: distinct from their neighbours and never equal to the sentinel.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|index| (index % 251) as u8).collect()
}

/// The same work request, unsignalled.
pub fn unsignaled(wr: WorkRequest) -> WorkRequest {
    WorkRequest { signaled: false, ..wr }
}

/// Every byte of one of `endpoint`'s regions.
pub fn read_all(endpoint: &dyn Endpoint, region: &MemoryRegion) -> Result<Vec<u8>, CaseError> {
    ensure!(
        region.len <= MAX_READ,
        "region at {:#x} claims {} bytes (the suite registers at most 256)",
        region.addr,
        region.len
    );
    let mut res = vec![0; usize::try_from(region.len).unwrap_or(0)];
    endpoint.read_local(region, 0, &mut res).context(&format!("reading the region at {:#x}", region.addr))?;
    Ok(res)
}

/// The target image after the given `(source_offset, target_offset, len)` writes of the source pattern.
pub fn expected_target(writes: &[(usize, usize, usize)]) -> Vec<u8> {
    let source = pattern(SOURCE_LEN);
    let mut res = vec![SENTINEL; TARGET_LEN];
    for &(source_offset, target_offset, len) in writes {
        let landing = res.iter_mut().skip(target_offset).take(len);
        for (byte, &carried) in landing.zip(source.iter().skip(source_offset)) {
            *byte = carried;
        }
    }
    res
}

/// Compares two byte images, naming the first differing offset instead of printing both.
fn ensure_bytes(seen: &[u8], expected: &[u8], what: &str) -> Result<(), CaseError> {
    if seen == expected {
        return Ok(());
    }
    let differing = seen.iter().zip(expected).position(|(seen, expected)| seen != expected);
    let detail = match differing {
        Some(offset) => format!(
            "byte {offset} is {:#04x}, expected {:#04x} ({} bytes differ)",
            seen[offset],
            expected[offset],
            seen.iter().zip(expected).filter(|(seen, expected)| seen != expected).count()
        ),
        None => format!("{} bytes, expected {}", seen.len(), expected.len()),
    };
    Err(CaseError::Failed(format!("{what}: {detail}")))
}

/// Polls `endpoint` until exactly `count` completions have arrived (settling in between), then checks no more come.
pub fn drain(
    transport: &mut dyn Transport,
    endpoint: &mut dyn Endpoint,
    count: usize,
) -> Result<Vec<WorkCompletion>, CaseError> {
    let mut res = Vec::new();
    for _ in 0..SETTLE_ROUNDS {
        endpoint.poll_cq(&mut res, usize::MAX);
        if res.len() >= count {
            break;
        }
        transport.settle();
    }
    transport.settle();
    endpoint.poll_cq(&mut res, usize::MAX);
    let summary: Vec<(u64, QpNum, WcStatus)> = res.iter().map(|wc| (wc.wr_id, wc.qp, wc.status)).collect();
    ensure!(res.len() == count, "expected {count} completions on {}, saw {}: {summary:?}", endpoint.node(), res.len());
    Ok(res)
}

/// `(wr_id, status)` of the completions of `qp`, in arrival order.
pub fn on_qp(completions: &[WorkCompletion], qp: QpNum) -> Vec<(u64, WcStatus)> {
    completions.iter().filter(|wc| wc.qp == qp).map(|wc| (wc.wr_id, wc.status)).collect()
}

/// The first completion (drained, so present unless `drain` was asked for none).
fn first(completions: &[WorkCompletion]) -> Result<WorkCompletion, CaseError> {
    completions.first().copied().ok_or_else(|| CaseError::Failed("expected a completion, saw none".to_owned()))
}

/// What a case needs: `max_sge` SGEs, a send queue of `sq_depth`, and messages of [`MAX_CASE_MESSAGE`] bytes.
const fn needs(max_sge: usize, sq_depth: usize) -> Caps {
    Caps { max_sge, max_message: MAX_CASE_MESSAGE, sq_depth }
}

// ---------------------------------------------------------------------------------------------------------------
// Contract: ordering, signalling and credits.

const POST_ORDER: Caps = needs(1, 3);

/// **Ordering**: completions of one QP follow post order even when a large write precedes a small one; two QPs
/// interleave; `byte_len` is each write's length.
fn completions_of_one_qp_arrive_in_post_order(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 2, POST_ORDER)?;
    let (first_qp, second_qp) = (link.qp(0), link.qp(1));
    for (index, len) in [200u64, 1, 50].into_iter().enumerate() {
        let index = index as u64;
        let wr = link.write(1 + index, 0, 0, len);
        link.post(first_qp, &[wr])?;
        let wr = link.write(11 + index, 0, 200, 50 - 20 * index);
        link.post(second_qp, &[wr])?;
    }
    let completions = drain(transport, &mut *link.sender, 6)?;
    let success = WcStatus::Success;
    ensure_eq!(on_qp(&completions, first_qp), [(1, success), (2, success), (3, success)], "completions of {first_qp}");
    ensure_eq!(
        on_qp(&completions, second_qp),
        [(11, success), (12, success), (13, success)],
        "completions of {second_qp}"
    );
    let lens: Vec<u64> = completions.iter().filter(|wc| wc.qp == first_qp).map(|wc| wc.byte_len).collect();
    ensure_eq!(lens, [200, 1, 50], "byte_len of the writes on {first_qp}");
    Ok(())
}

const SELECTIVE: Caps = needs(1, 2);

/// **Selective signalling**: unsignalled writes execute without completing; polling the signalled one behind them
/// frees all their slots.
fn only_signalled_work_requests_complete_and_free_the_slots_before_them(
    transport: &mut dyn Transport,
) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, SELECTIVE)?;
    let depth = link.sender.caps().sq_depth;
    let qp = link.qp(0);
    let unsignaled_count = depth.saturating_sub(1) as u64;
    let mut batch: Vec<WorkRequest> =
        (0..unsignaled_count).map(|index| unsignaled(link.write(index, index, index, 1))).collect();
    batch.push(link.write(99, 50, 50, 1));
    link.post(qp, &batch)?;
    let completions = drain(transport, &mut *link.sender, 1)?;
    ensure_eq!(on_qp(&completions, qp), [(99, WcStatus::Success)], "only the signalled write completes");
    let mut writes: Vec<(usize, usize, usize)> = (0..depth.saturating_sub(1)).map(|index| (index, index, 1)).collect();
    writes.push((50, 50, 1));
    ensure_bytes(&link.target_bytes()?, &expected_target(&writes), "unsignalled writes execute too")?;
    // A full queue's worth of new posts is accepted only if polling the one completion freed every slot.
    let batch: Vec<WorkRequest> = (0..depth as u64).map(|index| link.write(200 + index, 0, 100, 1)).collect();
    link.post(qp, &batch)?;
    drain(transport, &mut *link.sender, depth)?;
    Ok(())
}

/// **Selective signalling**: a send queue holding only unsignalled work requests would never free a slot, so such
/// a post is refused with `SignalRequired` and posts nothing.
fn posts_that_leave_a_full_queue_unsignalled_are_refused(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, SELECTIVE)?;
    let depth = link.sender.caps().sq_depth;
    let qp = link.qp(0);
    let batch: Vec<WorkRequest> = (0..depth as u64).map(|index| unsignaled(link.write(index, 0, 0, 8))).collect();
    let refused = Err(FabricError::SignalRequired { qp, depth });
    ensure_eq!(link.sender.post_send(qp, &batch), refused, "posting {depth} unsignalled writes");
    link.post(qp, batch.get(1..).unwrap_or_default())?;
    let one_more = unsignaled(link.write(50, 0, 100, 8));
    ensure_eq!(link.sender.post_send(qp, &[one_more]), refused, "one more unsignalled write");
    link.post(qp, &[link.write(51, 0, 100, 8)])?;
    let completions = drain(transport, &mut *link.sender, 1)?;
    ensure_eq!(on_qp(&completions, qp), [(51, WcStatus::Success)], "the refused unsignalled writes never ran");
    ensure_bytes(&link.target_bytes()?, &expected_target(&[(0, 0, 8), (0, 100, 8)]), "target after the posts")
}

/// **Posting**: posting past the depth fails with `QueueFull` and posts nothing, even the part of a batch that
/// would fit; polling completions returns the credits.
fn posting_past_the_send_queue_depth_is_refused_until_completions_are_polled(
    transport: &mut dyn Transport,
) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, SELECTIVE)?;
    let depth = link.sender.caps().sq_depth;
    let qp = link.qp(0);
    for index in 0..depth.saturating_sub(1) as u64 {
        link.post(qp, &[link.write(index, 0, 0, 4)])?;
    }
    let full = Err(FabricError::QueueFull { qp, depth });
    let straddling = [link.write(100, 0, 100, 4), link.write(101, 0, 110, 4)];
    ensure_eq!(link.sender.post_send(qp, &straddling), full, "a batch straddling the depth");
    link.post(qp, &[link.write(depth as u64, 0, 0, 4)])?;
    ensure_eq!(link.sender.post_send(qp, &[link.write(102, 0, 120, 4)]), full, "a post on a full queue");
    let completions = drain(transport, &mut *link.sender, depth)?;
    let ran: Vec<u64> = completions.iter().map(|wc| wc.wr_id).filter(|&wr_id| wr_id >= 100).collect();
    ensure!(ran.is_empty(), "refused work requests ran: {ran:?}");
    ensure_bytes(&link.target_bytes()?, &expected_target(&[(0, 0, 4)]), "the refused writes leave no byte")?;
    link.post(qp, &straddling)?;
    drain(transport, &mut *link.sender, 2)?;
    Ok(())
}

/// **Ordering** (wr_id): the fabric neither interprets nor deduplicates wr_ids.
fn duplicate_wr_ids_are_reported_as_given(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, POST_ORDER)?;
    let batch = [link.write(7, 0, 0, 4), link.write(7, 4, 4, 4), link.write(7, 8, 8, 4)];
    link.post(link.qp(0), &batch)?;
    let completions = drain(transport, &mut *link.sender, 3)?;
    ensure_eq!(on_qp(&completions, link.qp(0)), [(7, WcStatus::Success); 3], "three completions with wr_id 7");
    ensure_bytes(&link.target_bytes()?, &expected_target(&[(0, 0, 12)]), "target after the three writes")
}

// ---------------------------------------------------------------------------------------------------------------
// Contract: immediates, gathers, registration.

/// **Ordering** (immediates): the receiver's RecvImm carries the immediate and, when polled, the data of that write
/// and of every earlier write on the QP has landed.
fn write_with_imm_notifies_the_receiver_after_the_data_landed(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, SELECTIVE)?;
    let (qp, receiver_qp) = (link.qp(0), link.receiver_qp(0));
    let with_imm = WorkRequest { imm: Some(0xC0FFEE), ..link.write(2, 16, 64, 32) };
    link.post(qp, &[unsignaled(link.write(1, 0, 0, 16)), with_imm])?;
    let note = first(&drain(transport, &mut *link.receiver, 1)?)?;
    ensure_eq!(
        (note.kind, note.status, note.imm, note.qp, note.byte_len),
        (WcKind::RecvImm, WcStatus::Success, Some(0xC0FFEE), receiver_qp, 32),
        "the receiver's notification (kind, status, imm, qp, byte_len)"
    );
    ensure_bytes(&link.target_bytes()?, &expected_target(&[(0, 0, 16), (16, 64, 32)]), "target at the RecvImm")?;
    let completion = first(&drain(transport, &mut *link.sender, 1)?)?;
    ensure_eq!(
        (completion.wr_id, completion.kind, completion.imm),
        (2, WcKind::Write, None),
        "the sender's completion (wr_id, kind, imm)"
    );
    Ok(())
}

const GATHER: Caps = needs(3, 1);

/// The bytes that land are the SGEs gathered in order, across regions, contiguously at the remote address.
fn multi_sge_writes_land_as_the_gathered_bytes(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, GATHER)?;
    let second: Vec<u8> = (0..32).map(|index| 200 - index).collect();
    let second_region = link.sender.register(second.clone()).context("registering a second source region")?;
    let (source, lkey) = (link.source.addr, link.source.lkey);
    let sges = vec![
        Sge { addr: source.wrapping_add(3), len: 5, lkey },
        Sge { addr: second_region.addr.wrapping_add(10), len: 7, lkey: second_region.lkey },
        Sge { addr: source.wrapping_add(100), len: 2, lkey },
    ];
    let wr = WorkRequest { sges, ..link.write(1, 0, 40, 0) };
    link.post(link.qp(0), &[wr])?;
    let completion = first(&drain(transport, &mut *link.sender, 1)?)?;
    ensure_eq!((completion.status, completion.byte_len), (WcStatus::Success, 14), "the gather's (status, byte_len)");
    let pattern = pattern(SOURCE_LEN);
    let gathered = pattern[3..8].iter().chain(&second[10..17]).chain(&pattern[100..102]);
    let mut expected = vec![SENTINEL; TARGET_LEN];
    for (byte, &carried) in expected.iter_mut().skip(40).zip(gathered) {
        *byte = carried;
    }
    ensure_bytes(&link.target_bytes()?, &expected, "target after the gather")
}

const PLAIN: Caps = needs(1, 1);

/// **Memory**: deregistering hands back the current bytes and revokes the keys: a later read, deregistration or
/// write to the region fails.
fn deregister_returns_the_bytes_and_revokes_the_keys(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, PLAIN)?;
    link.post(link.qp(0), &[link.write(1, 10, 20, 30)])?;
    drain(transport, &mut *link.sender, 1)?;
    let target = link.target;
    let bytes = link.receiver.deregister(&target).context("deregistering the target")?;
    ensure_bytes(&bytes, &expected_target(&[(10, 20, 30)]), "the bytes deregister hands back")?;
    let unknown = Err(FabricError::UnknownRegion { addr: target.addr });
    ensure_eq!(link.receiver.deregister(&target).map(drop), unknown, "deregistering twice");
    ensure_eq!(link.receiver.read_local(&target, 0, &mut [0; 1]), unknown, "reading a deregistered region");
    link.post(link.qp(0), &[link.write(2, 0, 0, 8)])?;
    let completions = drain(transport, &mut *link.sender, 1)?;
    ensure_eq!(on_qp(&completions, link.qp(0)), [(2, WcStatus::RemoteAccess)], "a write to a deregistered region");
    Ok(())
}

/// A zero-byte write is a valid message: it completes with byte_len 0 and changes nothing.
fn a_zero_byte_write_completes_and_changes_nothing(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, PLAIN)?;
    let wr = WorkRequest { sges: Vec::new(), ..link.write(1, 0, 0, 0) };
    link.post(link.qp(0), &[wr])?;
    let completion = first(&drain(transport, &mut *link.sender, 1)?)?;
    ensure_eq!((completion.status, completion.byte_len), (WcStatus::Success, 0), "the zero-byte write's completion");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "target after a zero-byte write")
}

/// QP pairs the many-pairs case connects.
const PAIRS: usize = 12;

/// Many QP pairs between two endpoints each carry their own writes and notifications (on hardware the shared CQ
/// grows as QPs are created).
fn many_qp_pairs_each_deliver_their_writes(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, PAIRS, PLAIN)?;
    for index in 0..PAIRS {
        let offset = 16 * index as u64;
        let wr = WorkRequest { imm: Some(index as u32), ..link.write(index as u64, offset, offset, 16) };
        link.post(link.qp(index), &[wr])?;
    }
    let completions = drain(transport, &mut *link.sender, PAIRS)?;
    for index in 0..PAIRS {
        let qp = link.qp(index);
        ensure_eq!(on_qp(&completions, qp), [(index as u64, WcStatus::Success)], "completions of {qp}");
    }
    let mut notes = drain(transport, &mut *link.receiver, PAIRS)?;
    notes.sort_by_key(|note| note.imm);
    let expected: Vec<(QpNum, Option<u32>)> =
        (0..PAIRS).map(|index| (link.receiver_qp(index), Some(index as u32))).collect();
    let seen: Vec<(QpNum, Option<u32>)> = notes.iter().map(|note| (note.qp, note.imm)).collect();
    ensure_eq!(seen, expected, "one notification per pair (qp, imm)");
    ensure_bytes(&link.target_bytes()?, &expected_target(&[(0, 0, 16 * PAIRS)]), "target after every pair wrote")
}

/// **Protection** (empty regions): an empty region is a real registration: it has an address and keys, a zero-byte
/// write to it completes, a one-byte write does not, and deregistering hands back the same (empty) vector.
fn an_empty_region_takes_zero_byte_writes_only(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 2, PLAIN)?;
    let empty = link.receiver.register(Vec::with_capacity(64)).context("registering an empty region")?;
    ensure!(empty.len == 0 && empty.addr != 0, "an empty region has length 0 and an address, saw {empty:?}");
    link.receiver.read_local(&empty, 0, &mut []).context("reading nothing of the empty region")?;
    let outside = Err(FabricError::OutOfRegion { offset: 0, len: 1, region_len: 0 });
    ensure_eq!(link.receiver.read_local(&empty, 0, &mut [0]), outside, "reading a byte of the empty region");
    let remote = RemoteAddr { addr: empty.addr, rkey: empty.rkey };
    let zero_bytes = WorkRequest { sges: Vec::new(), remote, ..link.write(1, 0, 0, 0) };
    link.post(link.qp(0), &[zero_bytes])?;
    let one_byte = WorkRequest { remote, ..link.write(2, 0, 0, 1) };
    link.post(link.qp(1), &[one_byte])?;
    let completions = drain(transport, &mut *link.sender, 2)?;
    ensure_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::Success)], "a zero-byte write to the empty region");
    ensure_eq!(on_qp(&completions, link.qp(1)), [(2, WcStatus::RemoteAccess)], "a one-byte write to the empty region");
    let bytes = link.receiver.deregister(&empty).context("deregistering the empty region")?;
    ensure!(bytes.is_empty() && bytes.capacity() >= 64, "the registered vector comes back as it was");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "the target region")
}

// ---------------------------------------------------------------------------------------------------------------
// Error paths: protection.

/// **Protection**: a remote range that leaves the rkey's region completes RemoteAccess and changes no byte of the
/// target, of its neighbours or of the source.
fn out_of_bounds_remote_range(
    transport: &mut dyn Transport,
    remote_addr: fn(u64) -> u64,
    len: u64,
) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, PLAIN)?;
    let mut neighbours = Vec::new();
    for _ in 0..2 {
        neighbours.push(link.receiver.register(vec![SENTINEL; 64]).context("registering a neighbouring region")?);
    }
    let mut wr = link.write(1, 0, 0, len);
    wr.remote.addr = remote_addr(link.target.addr);
    link.post(link.qp(0), &[wr])?;
    let completions = drain(transport, &mut *link.sender, 1)?;
    ensure_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::RemoteAccess)], "the out-of-bounds write");
    ensure_eq!(first(&completions)?.byte_len, 0, "byte_len of a failed write");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "the target region")?;
    for neighbour in &neighbours {
        ensure_bytes(&read_all(&*link.receiver, neighbour)?, &[SENTINEL; 64], "a neighbouring region")?;
    }
    ensure_bytes(&read_all(&*link.sender, &link.source)?, &pattern(SOURCE_LEN), "the source region")
}

fn out_of_bounds_past_the_end(transport: &mut dyn Transport) -> Result<(), CaseError> {
    out_of_bounds_remote_range(transport, |addr| addr.wrapping_add(TARGET_LEN as u64 - 4), 8)
}

fn out_of_bounds_before_the_start(transport: &mut dyn Transport) -> Result<(), CaseError> {
    out_of_bounds_remote_range(transport, |addr| addr.wrapping_sub(4), 8)
}

fn out_of_bounds_one_byte_past_the_end(transport: &mut dyn Transport) -> Result<(), CaseError> {
    out_of_bounds_remote_range(transport, |addr| addr.wrapping_add(TARGET_LEN as u64), 1)
}

fn out_of_bounds_wrapping_the_address_space(transport: &mut dyn Transport) -> Result<(), CaseError> {
    out_of_bounds_remote_range(transport, |_| u64::MAX - 8, 16)
}

/// **Protection**: an SGE outside the region of its lkey (or with a revoked lkey) completes LocalProtection and
/// writes nothing.
fn bad_local_range(transport: &mut dyn Transport, source_addr: fn(u64) -> u64, revoked: bool) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, PLAIN)?;
    let mut wr = link.write(1, 0, 0, 8);
    let sge = Sge { addr: source_addr(link.source.addr), len: 8, lkey: link.source.lkey };
    wr.sges = vec![sge];
    if revoked {
        let stale = link.sender.register(pattern(64)).context("registering a region to revoke")?;
        link.sender.deregister(&stale).context("deregistering it")?;
        wr.sges = vec![Sge { addr: stale.addr, len: 8, lkey: stale.lkey }];
    }
    link.post(link.qp(0), &[wr])?;
    let completions = drain(transport, &mut *link.sender, 1)?;
    ensure_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::LocalProtection)], "the write with a bad SGE");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "the target region")
}

fn bad_local_past_the_end(transport: &mut dyn Transport) -> Result<(), CaseError> {
    bad_local_range(transport, |addr| addr.wrapping_add(SOURCE_LEN as u64 - 4), false)
}

fn bad_local_before_the_start(transport: &mut dyn Transport) -> Result<(), CaseError> {
    bad_local_range(transport, |addr| addr.wrapping_sub(4), false)
}

fn bad_local_revoked_lkey(transport: &mut dyn Transport) -> Result<(), CaseError> {
    bad_local_range(transport, |addr| addr, true)
}

/// **Memory**: regions belong to their endpoint: another endpoint cannot read or deregister them, a forged region
/// is unknown, and reads stay inside.
fn regions_are_owned_by_their_endpoint(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let link = Link::open(transport, 1, PLAIN)?;
    let Link { mut sender, receiver, target, .. } = link;
    let unknown = Err(FabricError::UnknownRegion { addr: target.addr });
    ensure_eq!(sender.read_local(&target, 0, &mut [0; 4]), unknown, "the sender reading the receiver's region");
    ensure_eq!(sender.deregister(&target).map(drop), unknown, "the sender deregistering the receiver's region");
    let forged = MemoryRegion { len: target.len.wrapping_add(1), ..target };
    ensure_eq!(receiver.read_local(&forged, 0, &mut [0; 4]), unknown, "reading a forged (longer) region");
    let offset = target.len.saturating_sub(2);
    let outside = Err(FabricError::OutOfRegion { offset, len: 4, region_len: target.len });
    ensure_eq!(receiver.read_local(&target, offset, &mut [0; 4]), outside, "reading across the region's end");
    let mut tail = [0; 2];
    receiver.read_local(&target, offset, &mut tail).context("reading the region's last two bytes")?;
    ensure_eq!(tail, [SENTINEL; 2], "the region's last two bytes");
    Ok(())
}

/// **Protection**: an rkey reaches only its own region: a revoked rkey, or a valid rkey with another region's
/// address, completes RemoteAccess and writes nothing.
fn a_wrong_rkey(transport: &mut dyn Transport, revoked: bool) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, PLAIN)?;
    let other = link.receiver.register(vec![SENTINEL; 64]).context("registering a second target region")?;
    let mut wr = link.write(1, 0, 0, 8);
    if revoked {
        wr.remote = RemoteAddr { addr: other.addr, rkey: other.rkey };
        link.receiver.deregister(&other).context("deregistering the second target region")?;
    } else {
        wr.remote.addr = other.addr;
    }
    link.post(link.qp(0), &[wr])?;
    let completions = drain(transport, &mut *link.sender, 1)?;
    ensure_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::RemoteAccess)], "the write with a wrong rkey");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "the target region")?;
    if !revoked {
        ensure_bytes(&read_all(&*link.receiver, &other)?, &[SENTINEL; 64], "the region the address names")?;
    }
    Ok(())
}

fn a_wrong_rkey_revoked(transport: &mut dyn Transport) -> Result<(), CaseError> {
    a_wrong_rkey(transport, true)
}

fn a_wrong_rkey_of_another_region(transport: &mut dyn Transport) -> Result<(), CaseError> {
    a_wrong_rkey(transport, false)
}

const GUARD: Caps = needs(1, 2);

/// **Protection** and **Errors**: a write that runs past the end of its region, or carries an rkey no region has,
/// completes RemoteAccess: the target region's bytes outside the write's range, a region registered right after it
/// and the source keep their bytes (the range itself is undefined by the contract; within one MTU hardware writes
/// none of it either). The QP is then in the error state: a valid write behind it flushes.
fn guard_bytes(
    transport: &mut dyn Transport,
    unknown_rkey: bool,
    target_offset: usize,
    len: usize,
) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, GUARD)?;
    let neighbour = link.receiver.register(vec![SENTINEL; TARGET_LEN]).context("registering a neighbour region")?;
    let mut wr = link.write(1, 8, target_offset as u64, len as u64);
    if unknown_rkey {
        let live = [link.target.rkey, neighbour.rkey];
        let flipped = (0..32).map(|bit| link.target.rkey ^ (1 << bit)).find(|rkey| !live.contains(rkey));
        wr.remote.rkey = flipped.unwrap_or(!link.target.rkey);
    }
    let behind = link.write(2, 0, 0, 8);
    link.post(link.qp(0), &[wr, behind])?;
    let completions = drain(transport, &mut *link.sender, 2)?;
    let expected = [(1, WcStatus::RemoteAccess), (2, WcStatus::Flushed)];
    ensure_eq!(on_qp(&completions, link.qp(0)), expected, "the refused write and the one behind it");
    ensure_eq!(first(&completions)?.byte_len, 0, "byte_len of the refused write");
    let target = link.target_bytes()?;
    let end = target_offset.saturating_add(len).min(TARGET_LEN);
    let before = target.get(..target_offset).unwrap_or_default();
    ensure_bytes(before, &vec![SENTINEL; before.len()], "bytes before the refused write")?;
    let after = target.get(end..).unwrap_or_default();
    ensure_bytes(after, &vec![SENTINEL; after.len()], "bytes after the refused write")?;
    ensure_bytes(&read_all(&*link.receiver, &neighbour)?, &[SENTINEL; TARGET_LEN], "the neighbouring region")?;
    ensure_bytes(&read_all(&*link.sender, &link.source)?, &pattern(SOURCE_LEN), "the source region")
}

fn guard_bytes_past_the_end(transport: &mut dyn Transport) -> Result<(), CaseError> {
    guard_bytes(transport, false, TARGET_LEN - 16, 32)
}

fn guard_bytes_unknown_rkey(transport: &mut dyn Transport) -> Result<(), CaseError> {
    guard_bytes(transport, true, 96, 32)
}

// ---------------------------------------------------------------------------------------------------------------
// Error paths: flushing, misuse, peers.

const FLUSH: Caps = needs(1, 4);

/// **Errors**: the first failure moves its QP to the error state: every later work request on it, queued or posted
/// later, completes Flushed (unsignalled ones too) and writes nothing; another QP keeps working.
fn after_an_error_later_work_requests_flush_and_other_qps_continue(
    transport: &mut dyn Transport,
) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 2, FLUSH)?;
    let (broken, healthy) = (link.qp(0), link.qp(1));
    let out_of_bounds = link.write(2, 0, TARGET_LEN as u64, 8);
    let batch = [link.write(1, 0, 0, 8), out_of_bounds, unsignaled(link.write(3, 0, 20, 8)), link.write(4, 0, 30, 8)];
    link.post(broken, &batch)?;
    link.post(healthy, &[link.write(11, 0, 100, 8)])?;
    let completions = drain(transport, &mut *link.sender, 5)?;
    let (success, flushed) = (WcStatus::Success, WcStatus::Flushed);
    let expected = [(1, success), (2, WcStatus::RemoteAccess), (3, flushed), (4, flushed)];
    ensure_eq!(on_qp(&completions, broken), expected, "completions of the failing {broken}");
    ensure_eq!(on_qp(&completions, healthy), [(11, success)], "completions of the healthy {healthy}");
    link.post(broken, &[unsignaled(link.write(5, 0, 40, 8))])?;
    link.post(healthy, &[link.write(12, 0, 110, 8)])?;
    let completions = drain(transport, &mut *link.sender, 2)?;
    ensure_eq!(on_qp(&completions, broken), [(5, flushed)], "an unsignalled post on a QP in error");
    ensure_eq!(on_qp(&completions, healthy), [(12, success)], "a later post on the healthy {healthy}");
    let expected = expected_target(&[(0, 0, 8), (0, 100, 8), (0, 110, 8)]);
    ensure_bytes(&link.target_bytes()?, &expected, "target after the failure")
}

/// **Errors**: work requests posted while their QP is failing, and after its failure was polled, all complete
/// Flushed in post order, signalled or not (Soft-RoCE before Linux 6.9 needs the verbs fabric's help for this).
fn work_requests_posted_on_a_failing_qp_all_flush(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, FLUSH)?;
    let qp = link.qp(0);
    let mut bad_lkey = unsignaled(link.write(0, 0, 0, 8));
    for sge in &mut bad_lkey.sges {
        sge.lkey = link.source.lkey ^ 0x8000_0000;
    }
    link.post(qp, &[bad_lkey])?;
    link.post(qp, &[link.write(1, 0, 8, 8), link.write(2, 0, 16, 8), unsignaled(link.write(3, 0, 24, 8))])?;
    let flushed = WcStatus::Flushed;
    let completions = drain(transport, &mut *link.sender, 4)?;
    let expected = [(0, WcStatus::LocalProtection), (1, flushed), (2, flushed), (3, flushed)];
    ensure_eq!(on_qp(&completions, qp), expected, "the failure and the posts queued behind it");
    let batch = [unsignaled(link.write(4, 0, 32, 8)), unsignaled(link.write(5, 0, 40, 8)), link.write(6, 0, 48, 8)];
    link.post(qp, &batch)?;
    link.post(qp, &[link.write(7, 0, 56, 8)])?;
    let completions = drain(transport, &mut *link.sender, 4)?;
    let expected = [(4, flushed), (5, flushed), (6, flushed), (7, flushed)];
    ensure_eq!(on_qp(&completions, qp), expected, "posts after the failure was polled");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "the target region")
}

/// **Posting**: misuse is a typed error, never a panic, and a refused batch posts nothing.
fn misuse_of_qps_and_regions_is_an_error_not_a_panic(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 1, PLAIN)?;
    let wr = link.write(1, 0, 0, 8);
    let never_created = QpNum(0xdead_beef);
    let unknown = Err(FabricError::UnknownQp(never_created));
    ensure_eq!(link.sender.post_send(never_created, std::slice::from_ref(&wr)), unknown, "posting on no QP");
    let lonely = link.sender.create_qp().context("creating an unconnected QP")?;
    ensure_eq!(link.sender.connect_qp(never_created, lonely), unknown, "connecting no QP");
    let not_connected = Err(FabricError::NotConnected(lonely.qpn));
    ensure_eq!(link.sender.post_send(lonely.qpn, std::slice::from_ref(&wr)), not_connected, "posting unconnected");
    let peer = link.receiver.create_qp().context("creating a receiver QP")?;
    let again = Err(FabricError::AlreadyConnected(link.qp(0)));
    ensure_eq!(link.sender.connect_qp(link.qp(0), peer), again, "connecting a connected QP again");
    misuse_of_limits(&mut link, &wr)?;
    // The valid first halves of the refused batches never ran.
    transport.settle();
    let mut completions = Vec::new();
    link.sender.poll_cq(&mut completions, usize::MAX);
    ensure!(completions.is_empty(), "refused batches ran: {completions:?}");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "the target region")
}

/// Batches holding a work request past `max_sge` or `max_message` are refused whole.
fn misuse_of_limits(link: &mut Link, wr: &WorkRequest) -> Result<(), CaseError> {
    let caps = link.sender.caps();
    let too_many = WorkRequest { sges: wr.sges.iter().cycle().take(caps.max_sge + 1).copied().collect(), ..wr.clone() };
    let refused = link.sender.post_send(link.qp(0), &[wr.clone(), too_many]);
    ensure!(
        matches!(refused, Err(FabricError::TooManySges { wr_id: 1, .. })),
        "expected TooManySges for a batch with {} SGEs in one work request, saw {refused:?}",
        caps.max_sge + 1
    );
    let huge_sge = wr.sges.iter().map(|sge| Sge { len: caps.max_message.saturating_add(1), ..*sge });
    let huge = WorkRequest { sges: huge_sge.collect(), ..wr.clone() };
    let refused = link.sender.post_send(link.qp(0), &[wr.clone(), huge]);
    ensure!(
        matches!(refused, Err(FabricError::MessageTooLarge { .. })),
        "expected MessageTooLarge for a {}-byte message, saw {refused:?}",
        caps.max_message.saturating_add(1)
    );
    Ok(())
}

/// **Errors** (peers): an RC QP answers only the QP it is connected to: a peer that never connected back makes
/// writes complete RetryExceeded, and the ones behind them Flushed.
fn a_peer_that_is_not_connected_back_exceeds_retries(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut link = Link::open(transport, 0, GUARD)?;
    let local = link.sender.create_qp().context("creating a sender QP")?;
    let remote = link.receiver.create_qp().context("creating a receiver QP")?;
    link.sender.connect_qp(local.qpn, remote).context("connecting the sender QP only")?;
    link.post(local.qpn, &[link.write(1, 0, 0, 8), link.write(2, 0, 8, 8)])?;
    let completions = drain(transport, &mut *link.sender, 2)?;
    let expected = [(1, WcStatus::RetryExceeded), (2, WcStatus::Flushed)];
    ensure_eq!(on_qp(&completions, local.qpn), expected, "writes to a peer not connected back");
    ensure_bytes(&link.target_bytes()?, &[SENTINEL; TARGET_LEN], "the target region")
}

// ---------------------------------------------------------------------------------------------------------------
// The registry.

const fn case(
    id: &'static str,
    group: Group,
    claim: &'static str,
    caps: Caps,
    run: fn(&mut dyn Transport) -> Result<(), CaseError>,
) -> ConformanceCase {
    ConformanceCase { id, group, claim, caps, run }
}

use Group::{Contract, ErrorPath};

static CASES: &[ConformanceCase] = &[
    case(
        "completions_of_one_qp_arrive_in_post_order",
        Contract,
        "completions of one QP arrive in post order, whatever the sizes; QPs interleave; byte_len is the length",
        POST_ORDER,
        completions_of_one_qp_arrive_in_post_order,
    ),
    case(
        "only_signalled_work_requests_complete_and_free_the_slots_before_them",
        Contract,
        "unsignalled writes land without completing; polling the signalled one behind them frees their slots",
        SELECTIVE,
        only_signalled_work_requests_complete_and_free_the_slots_before_them,
    ),
    case(
        "posts_that_leave_a_full_queue_unsignalled_are_refused",
        Contract,
        "a post leaving sq_depth unsignalled work requests is refused with SignalRequired and posts nothing",
        SELECTIVE,
        posts_that_leave_a_full_queue_unsignalled_are_refused,
    ),
    case(
        "posting_past_the_send_queue_depth_is_refused_until_completions_are_polled",
        Contract,
        "a post past sq_depth is refused whole with QueueFull until polled completions return the credits",
        SELECTIVE,
        posting_past_the_send_queue_depth_is_refused_until_completions_are_polled,
    ),
    case(
        "out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_past_the_end",
        ErrorPath,
        "a write running past the end of the rkey's region completes RemoteAccess and changes no byte",
        PLAIN,
        out_of_bounds_past_the_end,
    ),
    case(
        "out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_before_the_start",
        ErrorPath,
        "a write starting before the rkey's region completes RemoteAccess and changes no byte",
        PLAIN,
        out_of_bounds_before_the_start,
    ),
    case(
        "out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_one_byte_past_the_end",
        ErrorPath,
        "a one-byte write just past the rkey's region completes RemoteAccess and changes no byte",
        PLAIN,
        out_of_bounds_one_byte_past_the_end,
    ),
    case(
        "out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_wrapping_the_address_space",
        ErrorPath,
        "a remote range wrapping the address space completes RemoteAccess and changes no byte",
        PLAIN,
        out_of_bounds_wrapping_the_address_space,
    ),
    case(
        "bad_local_range_or_lkey_completes_local_protection_past_the_end",
        ErrorPath,
        "an SGE running past the end of its lkey's region completes LocalProtection and writes nothing",
        PLAIN,
        bad_local_past_the_end,
    ),
    case(
        "bad_local_range_or_lkey_completes_local_protection_before_the_start",
        ErrorPath,
        "an SGE starting before its lkey's region completes LocalProtection and writes nothing",
        PLAIN,
        bad_local_before_the_start,
    ),
    case(
        "bad_local_range_or_lkey_completes_local_protection_revoked_lkey",
        ErrorPath,
        "an SGE with a deregistered region's lkey completes LocalProtection and writes nothing",
        PLAIN,
        bad_local_revoked_lkey,
    ),
    case(
        "after_an_error_later_work_requests_flush_and_other_qps_continue",
        ErrorPath,
        "after a QP's first failure every later work request on it flushes, signalled or not; other QPs go on",
        FLUSH,
        after_an_error_later_work_requests_flush_and_other_qps_continue,
    ),
    case(
        "work_requests_posted_on_a_failing_qp_all_flush",
        ErrorPath,
        "work requests posted while a QP fails and after its failure was polled all complete Flushed in order",
        FLUSH,
        work_requests_posted_on_a_failing_qp_all_flush,
    ),
    case(
        "misuse_of_qps_and_regions_is_an_error_not_a_panic",
        ErrorPath,
        "unknown, unconnected or reconnected QPs and over-limit work requests are typed errors posting nothing",
        PLAIN,
        misuse_of_qps_and_regions_is_an_error_not_a_panic,
    ),
    case(
        "regions_are_owned_by_their_endpoint",
        ErrorPath,
        "only the owning endpoint reads or deregisters a region, forged regions are unknown, reads stay inside",
        PLAIN,
        regions_are_owned_by_their_endpoint,
    ),
    case(
        "a_wrong_rkey_completes_remote_access_revoked_rkey",
        ErrorPath,
        "a write with a deregistered region's rkey completes RemoteAccess and writes nothing",
        PLAIN,
        a_wrong_rkey_revoked,
    ),
    case(
        "a_wrong_rkey_completes_remote_access_rkey_of_another_region",
        ErrorPath,
        "an rkey with another region's address completes RemoteAccess and writes neither region",
        PLAIN,
        a_wrong_rkey_of_another_region,
    ),
    case(
        "guard_bytes_around_a_refused_write_stay_unchanged_past_the_end",
        ErrorPath,
        "a write past its region's end keeps every byte outside its range, the neighbour's and the source's",
        GUARD,
        guard_bytes_past_the_end,
    ),
    case(
        "guard_bytes_around_a_refused_write_stay_unchanged_unknown_rkey",
        ErrorPath,
        "a write with an rkey no region has keeps every byte outside its range; the write behind it flushes",
        GUARD,
        guard_bytes_unknown_rkey,
    ),
    case(
        "a_peer_that_is_not_connected_back_exceeds_retries",
        ErrorPath,
        "writes to a peer QP that never connected back complete RetryExceeded, then Flushed, and land nothing",
        GUARD,
        a_peer_that_is_not_connected_back_exceeds_retries,
    ),
    case(
        "duplicate_wr_ids_are_reported_as_given",
        Contract,
        "the fabric neither interprets nor deduplicates wr_ids",
        POST_ORDER,
        duplicate_wr_ids_are_reported_as_given,
    ),
    case(
        "write_with_imm_notifies_the_receiver_after_the_data_landed",
        Contract,
        "a WRITE_WITH_IMM's RecvImm carries the immediate once its data and every earlier write's have landed",
        SELECTIVE,
        write_with_imm_notifies_the_receiver_after_the_data_landed,
    ),
    case(
        "multi_sge_writes_land_as_the_gathered_bytes",
        Contract,
        "a multi-SGE write lands its SGEs gathered in order, across regions, contiguously",
        GATHER,
        multi_sge_writes_land_as_the_gathered_bytes,
    ),
    case(
        "deregister_returns_the_bytes_and_revokes_the_keys",
        Contract,
        "deregistering hands back the region's current bytes and revokes its keys",
        PLAIN,
        deregister_returns_the_bytes_and_revokes_the_keys,
    ),
    case(
        "a_zero_byte_write_completes_and_changes_nothing",
        Contract,
        "a zero-byte write completes successfully with byte_len 0 and changes no byte",
        PLAIN,
        a_zero_byte_write_completes_and_changes_nothing,
    ),
    case(
        "many_qp_pairs_each_deliver_their_writes",
        Contract,
        "twelve QP pairs between two endpoints each deliver their own write and immediate",
        PLAIN,
        many_qp_pairs_each_deliver_their_writes,
    ),
    case(
        "an_empty_region_takes_zero_byte_writes_only",
        Contract,
        "an empty region has an address and keys, takes a zero-byte write, refuses a one-byte one",
        PLAIN,
        an_empty_region_takes_zero_byte_writes_only,
    ),
];

/// Every case of the suite, in a fixed order (ids are stable across versions).
pub fn cases() -> &'static [ConformanceCase] {
    CASES
}

/// The case with this id, if there is one.
pub fn case_by_id(id: &str) -> Option<&'static ConformanceCase> {
    CASES.iter().find(|case| case.id == id)
}
