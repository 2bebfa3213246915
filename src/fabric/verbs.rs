//! The fabric seam, shaped like RDMA verbs: one [`Endpoint`] per rank's process, memory registration with
//! lkey/rkey, reliable-connected queue pairs, RDMA WRITE (and WRITE_WITH_IMM) work requests with scatter-gather
//! lists, selective signalling and a non-blocking completion queue.
//!
//! This module is pure vocabulary and the contract; it knows nothing of plans, regions or the oracle.
//! The in-memory implementation is [`super::world::SimWorld`]; a verbs backend implements the same trait, and both
//! must pass the conformance suite, `crate::certify::conformance` (run by `tests/it/conformance.rs`).

use std::collections::BTreeMap;
use std::fmt;

pub use super::seam::{Fill, NodeId};

/// A queue pair number, unique within its node (`ibv_qp::qp_num`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QpNum(pub u32);

impl fmt::Display for QpNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "qp {:#x}", self.0)
    }
}

/// What the bootstrap exchanges so that two QPs can be connected: node and QP number, and on a NIC the port's LID
/// (InfiniBand) and GID (RoCE: the IPv4-mapped GID of the RoCE v2 index). The in-memory fabric leaves both zero.
///
/// Both ends start their packet sequence numbers at [`QpInfo::psn`], derived from the QP number, so the PSN needs
/// no field of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QpInfo {
    pub node: NodeId,
    pub qpn: QpNum,
    pub lid: u16,
    pub gid: [u8; 16],
}

impl QpInfo {
    /// A QP with no LID or GID (the in-memory fabric's).
    pub fn plain(node: NodeId, qpn: QpNum) -> QpInfo {
        QpInfo { node, qpn, lid: 0, gid: [0; 16] }
    }

    /// The first packet sequence number of this QP's send queue (24 bits).
    pub fn psn(&self) -> u32 {
        self.qpn.0.wrapping_mul(0x9E37) & 0x00FF_FFFF
    }

    /// The text form carried in engine keys and link answers: `node<N>-qp<Q>-lid<L>-gid<32 hex digits>`.
    pub fn to_text(&self) -> String {
        let gid: String = self.gid.iter().map(|byte| format!("{byte:02x}")).collect();
        format!("node{}-qp{}-lid{}-gid{gid}", self.node.0, self.qpn.0, self.lid)
    }

    /// The inverse of [`QpInfo::to_text`], found at the end of `text` (anything before `node` is ignored);
    /// `None` if it is not there or malformed.
    pub fn from_text_suffix(text: &str) -> Option<QpInfo> {
        let (rest, gid) = text.rsplit_once("-gid")?;
        let (rest, lid) = rest.rsplit_once("-lid")?;
        let (rest, qpn) = rest.rsplit_once("-qp")?;
        let node = rest.rsplit_once("node").map(|(_, node)| node)?;
        let digits = gid.as_bytes();
        if digits.len() != 32 || !gid.bytes().all(|digit| digit.is_ascii_hexdigit()) {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&gid[index * 2..index * 2 + 2], 16).ok()?;
        }
        let number = |text: &str| text.parse::<u32>().ok().filter(|_| text.bytes().all(|b| b.is_ascii_digit()));
        Some(QpInfo {
            node: NodeId(number(node)?),
            qpn: QpNum(number(qpn)?),
            lid: u16::try_from(number(lid)?).ok()?,
            gid: bytes,
        })
    }
}

/// A registered memory region, as `ibv_reg_mr` returns it.
///
/// The owner uses `lkey` in its own [`Sge`]s; it advertises `addr`, `len` and `rkey` to peers, which write to it
/// with a [`RemoteAddr`]. There is no global namespace of regions: an rkey is only meaningful on its own node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemoryRegion {
    /// Virtual address of the first byte (never zero).
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
}

/// One scatter-gather entry: `len` bytes of local memory at `addr`, inside the region registered with `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Sge {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
}

/// Where a WRITE lands on the peer: a virtual address inside the peer's region registered with `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RemoteAddr {
    pub addr: u64,
    pub rkey: u32,
}

/// An RDMA WRITE (or WRITE_WITH_IMM when `imm` is `Some`) work request.
///
/// The bytes of `sges`, gathered in order, land contiguously at `remote`. With `imm`, the peer gets a
/// [`WcKind::RecvImm`] completion carrying it once the data has landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned as given in the completion; the fabric never interprets or deduplicates it.
    pub wr_id: u64,
    /// At most [`Caps::max_sge`] entries; an empty list is a zero-byte write.
    pub sges: Vec<Sge>,
    pub remote: RemoteAddr,
    pub imm: Option<u32>,
    /// `IBV_SEND_SIGNALED`: only signalled work requests complete successfully on the CQ (see [`Endpoint`]).
    pub signaled: bool,
}

impl WorkRequest {
    /// The message length: the sum of the SGE lengths (`None` if it overflows `u64`).
    pub fn byte_len(&self) -> Option<u64> {
        self.sges.iter().try_fold(0u64, |total, sge| total.checked_add(sge.len))
    }

    /// Checks this work request against the limits: at most [`Caps::max_sge`] SGEs and at most
    /// [`Caps::max_message`] bytes. Every fabric refuses a batch holding such a work request before posting any.
    pub fn check(&self, caps: Caps) -> Result<(), FabricError> {
        if self.sges.len() > caps.max_sge {
            return Err(FabricError::TooManySges { wr_id: self.wr_id, given: self.sges.len(), max: caps.max_sge });
        }
        match self.byte_len() {
            Some(len) if len <= caps.max_message => Ok(()),
            len => Err(FabricError::MessageTooLarge {
                wr_id: self.wr_id,
                len: len.unwrap_or(u64::MAX),
                max: caps.max_message,
            }),
        }
    }
}

/// Status of a work completion, mirroring `ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`: every byte landed.
    Success,
    /// `IBV_WC_LOC_PROT_ERR`: an SGE is not inside the local region of its lkey.
    LocalProtection,
    /// `IBV_WC_REM_ACCESS_ERR`: the remote range is not inside the peer's region of the rkey.
    RemoteAccess,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer did not answer (no such QP, or it is not connected back to this one).
    RetryExceeded,
    /// `IBV_WC_WR_FLUSH_ERR`: the QP was already in the error state; the work request did not execute.
    Flushed,
}

/// What a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WcKind {
    /// The sender's completion of a WRITE or WRITE_WITH_IMM (`IBV_WC_RDMA_WRITE`).
    Write,
    /// The receiver's notification of a WRITE_WITH_IMM (`IBV_WC_RECV_RDMA_WITH_IMM`).
    RecvImm,
}

/// One completion queue entry (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's `wr_id` for [`WcKind::Write`]; unspecified for [`WcKind::RecvImm`] (receives are
    /// posted by the endpoint itself; the in-memory fabric reports 0).
    pub wr_id: u64,
    /// The local QP the completion belongs to (the receiver's QP for [`WcKind::RecvImm`]).
    pub qp: QpNum,
    pub status: WcStatus,
    pub kind: WcKind,
    /// The immediate of a [`WcKind::RecvImm`]; `None` for [`WcKind::Write`].
    pub imm: Option<u32>,
    /// Bytes the work request moved: its message length on [`WcStatus::Success`], 0 otherwise.
    pub byte_len: u64,
}

/// Device and QP limits (`ibv_device_attr`, `ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Most SGEs per work request (`max_send_sge`).
    pub max_sge: usize,
    /// Largest message in bytes (`max_msg_sz`).
    pub max_message: u64,
    /// Send queue depth per QP (`max_send_wr`): work requests outstanding at once.
    pub sq_depth: usize,
}

/// Why an endpoint call failed (as opposed to a work request completing in error).
///
/// A failed [`Endpoint::post_send`] posted nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FabricError {
    #[error("the send queue of {qp} is full ({depth} outstanding): poll completions to free slots, then post again")]
    QueueFull { qp: QpNum, depth: usize },
    #[error("{qp} would hold {depth} unsignalled work requests: signal at least one work request in every {depth}")]
    SignalRequired { qp: QpNum, depth: usize },
    #[error("{0} does not exist on this endpoint: use a QP number returned by create_qp")]
    UnknownQp(QpNum),
    #[error("{0} is not connected: call connect_qp with the peer's QpInfo before posting")]
    NotConnected(QpNum),
    #[error("{0} is already connected: create another QP for another peer")]
    AlreadyConnected(QpNum),
    #[error("work request {wr_id} has {given} scatter-gather entries but the fabric allows {max}: split it")]
    TooManySges { wr_id: u64, given: usize, max: usize },
    #[error("work request {wr_id} moves {len} bytes but the fabric allows {max} per message: split it")]
    MessageTooLarge { wr_id: u64, len: u64, max: u64 },
    #[error("no region at {addr:#x} with these keys on this endpoint: pass a region its own register returned")]
    UnknownRegion { addr: u64 },
    #[error("bytes {offset}..{offset}+{len} are outside the {region_len}-byte region: read within the region")]
    OutOfRegion { offset: u64, len: u64, region_len: u64 },
    #[error("the fabric ran out of {0}: use a new world or fewer registrations and QPs")]
    Exhausted(&'static str),
    /// A hardware fabric's device refused a call the contract allows (a registration over the locked-memory limit,
    /// a QP over the device's limits); `errno` is what the verbs call reported.
    #[error(
        "the RDMA device refused {call}: {}: check the device limits and `ulimit -l` (locked memory)",
        std::io::Error::from_raw_os_error(*errno)
    )]
    Device { call: &'static str, errno: i32 },
    /// A C ABI transport plug-in (`super::plugin`) refused a call, or broke its contract in its answer; `code` is
    /// its `KVRELAY_ERR_*` return code (src/fabric/kvrelay_transport.h) and `message` its own text for the error.
    #[error("the transport plug-in failed {call} (code {code}): {message}: see the plug-in's documentation and src/fabric/kvrelay_transport.h")]
    Plugin { call: &'static str, code: i32, message: String },
}

/// The send-queue credits of one QP, kept the same way by every fabric so that all refuse exactly the same posts
/// (the **Posting** and **Selective signalling** rules of [`Endpoint`]).
///
/// Slots are tracked by position: the `n`th work request ever posted on the QP has position `n - 1`, and
/// positions `freed..posted` hold slots. Polling the completion of position `p` frees every slot up to and
/// including `p` ([`SendQueue::free_through`] with `p + 1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SendQueue {
    posted: u64,
    freed: u64,
    /// One past the position of the last signalled work request posted (0 if none).
    signaled_end: u64,
}

impl SendQueue {
    /// Whether `wrs` may be posted now on `qp` with these limits: each work request within `caps`
    /// ([`WorkRequest::check`]), then room for all of them in a queue of `caps.sq_depth`
    /// ([`FabricError::QueueFull`]), and never `sq_depth` outstanding after the last signalled one
    /// ([`FabricError::SignalRequired`]). Checks only; [`SendQueue::push`] records what was posted.
    pub fn check_post(&self, qp: QpNum, caps: Caps, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        for wr in wrs {
            wr.check(caps)?;
        }
        if wrs.is_empty() {
            return Ok(());
        }
        let depth = caps.sq_depth;
        let count = wrs.len() as u64;
        if self.outstanding() + count > depth as u64 {
            return Err(FabricError::QueueFull { qp, depth });
        }
        let signaled_end = match wrs.iter().rposition(|wr| wr.signaled) {
            Some(index) => self.posted + index as u64 + 1,
            None => self.signaled_end,
        };
        // Outstanding work requests after the last signalled one: no completion will ever free their slots.
        let unsignaled_tail = self.posted + count - signaled_end.max(self.freed);
        if unsignaled_tail >= depth as u64 {
            return Err(FabricError::SignalRequired { qp, depth });
        }
        Ok(())
    }

    /// Records one posted work request and returns its position.
    pub fn push(&mut self, signaled: bool) -> u64 {
        let position = self.posted;
        self.posted += 1;
        if signaled {
            self.signaled_end = self.posted;
        }
        position
    }

    /// Frees every slot before position `end` (a polled completion of position `end - 1`); never un-frees.
    pub fn free_through(&mut self, end: u64) {
        self.freed = self.freed.max(end.min(self.posted));
    }

    /// How many work requests were ever posted (the position the next one gets).
    pub fn posted(&self) -> u64 {
        self.posted
    }

    /// One past the position of the last signalled work request posted (0 if none).
    pub fn signaled_end(&self) -> u64 {
        self.signaled_end
    }

    /// Slots held now: posted work requests whose slots no polled completion has freed yet.
    pub fn outstanding(&self) -> u64 {
        self.posted - self.freed
    }
}

/// One rank's process on the fabric.
///
/// Semantics every implementation keeps (the conformance suite checks each):
/// - **Ordering.** Completions of one QP arrive in post order; nothing is promised across QPs. A
///   [`WcKind::RecvImm`] at the receiver implies every earlier WRITE on that QP has landed.
/// - **Posting.** [`Endpoint::post_send`] is all-or-nothing: a batch that would overflow the send queue, or that
///   holds an invalid work request, posts nothing and returns the error; the caller keeps its credits.
///   Posting does not execute anything: the bytes are gathered and written later (the in-memory fabric executes
///   them when its world's time reaches their delivery time).
/// - **Selective signalling.** A successful unsignalled work request produces no completion; its send-queue slot
///   is freed when the completion of a later work request on the same QP is polled (a signalled one, or an error).
///   A signalled work request's slot is freed when its own completion is polled. Because of this, a batch whose
///   last work request is unsignalled is refused with [`FabricError::SignalRequired`] when the send queue would then
///   hold `sq_depth` work requests after the last signalled one: at least one in every `sq_depth` must be signalled.
/// - **Errors.** The first work request that fails moves its QP to the error state; every later work request on
///   that QP (already posted or posted afterwards) completes [`WcStatus::Flushed`] without executing. Failed and
///   flushed work requests always produce a completion, signalled or not. Other QPs are unaffected. A QP in the
///   error state stays there.
/// - **Protection.** A WRITE with an SGE outside the local region of its lkey completes
///   [`WcStatus::LocalProtection`]; one whose remote range is outside the peer's region of its rkey completes
///   [`WcStatus::RemoteAccess`]. The in-memory fabric then writes no byte; hardware writes none for messages within
///   one MTU, so callers must treat the target range of a failed write as undefined. A byte outside every target
///   range is never changed. An empty SGE and a zero-byte message are checked by the in-memory fabric but not by
///   hardware (InfiniBand C9-88: a zero-length WRITE validates neither address nor key; NICs skip empty SGEs): such
///   a work request may complete successfully with keys or addresses that a non-empty one would fail on.
/// - **Memory.** Only the owning endpoint reads or deregisters its regions; peers reach them only through rkeys.
pub trait Endpoint {
    /// The device and QP limits.
    fn caps(&self) -> Caps;
    /// Which node this endpoint is.
    fn node(&self) -> NodeId;
    /// Registers `bytes` (an MR) and returns its address and keys; the endpoint owns the bytes until deregistered.
    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError>;
    /// Registers `len` bytes holding what `fill` gives, as [`Endpoint::register`] of those bytes would. By default
    /// the bytes are built and registered; the in-memory fabric materialises them lazily, per chunk a write reaches,
    /// so that untouched memory costs nothing. `item_len` is the unit the memory is used in (a page of one layer, a
    /// state slot; 0 when there is none): a lazy fabric sizes its chunks in whole items.
    fn register_filled(&mut self, len: u64, item_len: u64, fill: Fill) -> Result<MemoryRegion, FabricError> {
        let _ = item_len;
        let len = usize::try_from(len).map_err(|_| FabricError::Exhausted("memory"))?;
        let mut bytes = vec![0u8; len];
        fill(0, &mut bytes);
        self.register(bytes)
    }
    /// Deregisters a region of this endpoint and hands back its bytes (no second copy). Work requests that reach
    /// it afterwards complete in error.
    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError>;
    /// [`Endpoint::deregister`], the bytes handed back as the chunks materialised, by start offset: a byte in no
    /// chunk was never written and still holds what the region was registered with. By default one chunk of
    /// every byte.
    fn deregister_sparse(&mut self, region: &MemoryRegion) -> Result<BTreeMap<u64, Vec<u8>>, FabricError> {
        let bytes = self.deregister(region)?;
        Ok(if bytes.is_empty() { BTreeMap::new() } else { BTreeMap::from([(0, bytes)]) })
    }
    /// Copies `out.len()` bytes of one of this endpoint's regions, from `offset` within it, into `out`.
    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError>;
    /// Creates a QP (in the reset state) and returns what the bootstrap must tell the peer.
    fn create_qp(&mut self) -> Result<QpInfo, FabricError>;
    /// Connects a local QP to a peer's QP (RESET → RTR → RTS). The peer must connect its QP back to this one;
    /// otherwise work requests complete [`WcStatus::RetryExceeded`].
    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError>;
    /// Posts a batch of WRITE work requests on a connected QP (one doorbell), all or nothing.
    fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError>;
    /// Moves up to `max` available completions into `out` (appending) and returns how many; never blocks.
    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize;
    /// Blocks until a completion may be ready to poll or `timeout` has passed, without spinning a core (a verbs
    /// fabric waits on its completion channel); `true` when one may be ready. The in-memory fabric's time is
    /// simulated, so by default an endpoint returns `false` at once and its driver advances the world instead.
    fn wait(&mut self, timeout: std::time::Duration) -> bool {
        let _ = timeout;
        false
    }
    /// Whether this endpoint's node crashed (the in-memory fabric's `crash_prefill` fault): its engine must then
    /// process nothing more. A real endpoint never reports it (a crashed process runs no code).
    fn crashed(&self) -> bool {
        false
    }
}

/// A boxed endpoint is an endpoint (the certification kit and the live driver take transports' endpoints boxed).
impl<E: Endpoint + ?Sized> Endpoint for Box<E> {
    fn caps(&self) -> Caps {
        (**self).caps()
    }

    fn node(&self) -> NodeId {
        (**self).node()
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        (**self).register(bytes)
    }

    fn register_filled(&mut self, len: u64, item_len: u64, fill: Fill) -> Result<MemoryRegion, FabricError> {
        (**self).register_filled(len, item_len, fill)
    }

    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        (**self).deregister(region)
    }

    fn deregister_sparse(&mut self, region: &MemoryRegion) -> Result<BTreeMap<u64, Vec<u8>>, FabricError> {
        (**self).deregister_sparse(region)
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        (**self).read_local(region, offset, out)
    }

    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        (**self).create_qp()
    }

    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        (**self).connect_qp(local, remote)
    }

    fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        (**self).post_send(qp, wrs)
    }

    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        (**self).poll_cq(out, max)
    }

    fn wait(&mut self, timeout: std::time::Duration) -> bool {
        (**self).wait(timeout)
    }

    fn crashed(&self) -> bool {
        (**self).crashed()
    }
}
