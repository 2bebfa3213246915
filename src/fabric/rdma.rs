//! The RDMA verbs fabric (cargo feature `rdma`): [`RdmaEndpoint`] implements [`Endpoint`] over libibverbs
//! (rdma-sys 0.3.0) with the contract of [`super::verbs`], and [`write_bandwidth`] is the loopback WRITE benchmark.
//!
//! This is the crate's only module with `unsafe` code (ARCHITECTURE.md, "Unsafe code"): every verbs call is a
//! foreign call on raw pointers, and registered memory is written by the device behind Rust's back. Every `unsafe`
//! block says why it is sound in a `SAFETY:` comment, and the tidy test keeps `unsafe` out of every other file.
//!
//! One endpoint owns one device context, one protection domain, one completion channel with one CQ (the send and
//! receive completions of all its QPs), one MR per registration and its RC QPs. How the contract is kept:
//!
//! The QP bookkeeping every real fabric shares (send-queue slots and credits, the ready completions, the software
//! flush of a failed QP, the `poll_cq` loop) is `super::shell`'s; this module makes the verbs calls.
//!
//! - **Posting.** [`Endpoint::post_send`] checks everything the contract refuses in software first (unknown or
//!   unconnected QP, SGE count, message size, and the send-queue credits with the same `SendQueue` accounting
//!   as the in-memory fabric), so a refused batch never reaches the device; then it makes one `ibv_post_send` of a
//!   linked list (RDMA_WRITE or RDMA_WRITE_WITH_IMM, `IBV_SEND_SIGNALED` per work request), built in reused
//!   buffers without allocating.
//! - **Completions.** The device sees each work request's position on its QP as `wr_id`; the caller's `wr_id` and
//!   message length wait in the shell's ring of `sq_depth` slots indexed by position, so duplicate `wr_id`s are
//!   harmless and a completion frees exactly the slots the contract says when it is handed out by
//!   [`Endpoint::poll_cq`]. Statuses map to the closest kind of failure:
//!
//!   | `ibv_wc_status` | [`WcStatus`] |
//!   | --- | --- |
//!   | `SUCCESS` | `Success` |
//!   | `LOC_PROT_ERR` and the other local errors (`LOC_LEN_ERR`, `LOC_QP_OP_ERR`, ...) | `LocalProtection` |
//!   | `REM_ACCESS_ERR` and the responder's other refusals (`REM_INV_REQ_ERR`, `REM_OP_ERR`, ...) | `RemoteAccess` |
//!   | `RETRY_EXC_ERR`, `RNR_RETRY_EXC_ERR`, `BAD_RESP_ERR`, `RESP_TIMEOUT_ERR` | `RetryExceeded` |
//!   | `WR_FLUSH_ERR` | `Flushed` |
//!
//!   "Local errors" are also `LOC_ACCESS_ERR`, `LOC_EEC_OP_ERR`, `LOC_RDD_VIOL_ERR`, `MW_BIND_ERR`, `FATAL_ERR`,
//!   `GENERAL_ERR` and any unknown value; "refusals" also `REM_INV_RD_REQ_ERR`, `REM_ABORT_ERR`, `INV_EECN_ERR`
//!   and `INV_EEC_STATE_ERR`.
//!
//! - **Errors.** Once a completion in error has been taken off the CQ, the QP is moved to the error state again
//!   (which makes the device flush what it still holds: Soft-RoCE before Linux 6.9 may otherwise leave work
//!   requests posted to a failed QP unflushed), and later posts never reach the device: their Flushed completions
//!   are made here and handed out after the device's last completion of the QP, in post order.
//! - **Notifications.** Every QP keeps receives without SGEs posted for WRITE_WITH_IMM (a WRITE_WITH_IMM consumes
//!   one), re-posted as their completions are taken off the CQ; a successful one becomes a [`WcKind::RecvImm`] with
//!   the immediate in host byte order. Failed and flushed receive completions are dropped: the sender's completion
//!   reports the failure (the responder's QP of a failed write may move to the error state on hardware).
//! - **Memory.** A registration keeps the `Vec`'s heap buffer in place as raw parts (pointer, length, capacity):
//!   no Rust reference to it lives while the device may write it; reads copy through the raw pointer with bounds
//!   checks, and deregistration rebuilds the `Vec` only after the MR is gone. An empty `Vec` has no buffer to
//!   register: it gets a zero-length MR inside a private 2-byte allocation, so its address is real and every
//!   non-empty access to it fails.
//! - **Waiting.** [`RdmaEndpoint::wait`] arms the CQ, takes off what already arrived and otherwise sleeps in
//!   `poll(2)` on the completion channel until an event or the deadline: it never spins.
//!   [`RdmaEndpoint::awaits_completions`] says whether a completion is still certain to come.
//! - **Timeouts.** QPs use `timeout` 14 (4.096 µs × 2¹⁴ ≈ 67 ms) and `retry_cnt` 6, so a peer that is not connected
//!   back completes [`WcStatus::RetryExceeded`] after about 0.5 s; `rnr_retry` 7 waits for receives forever.
//! - **Teardown.** Dropping the endpoint destroys the QPs, then the MRs (handing their memory back to the
//!   allocator), the CQ, the channel, the PD and the context, ignoring errors; a region whose MR cannot be
//!   deregistered is leaked rather than freed under the device.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::io;
use std::mem::ManuallyDrop;
use std::ptr::{self, NonNull};
use std::time::{Duration, Instant};

use rdma_sys::{
    ___ibv_query_port, ibv_access_flags, ibv_ack_cq_events, ibv_alloc_pd, ibv_close_device, ibv_comp_channel,
    ibv_context, ibv_cq, ibv_create_comp_channel, ibv_create_cq, ibv_create_qp, ibv_dealloc_pd, ibv_dereg_mr,
    ibv_destroy_comp_channel, ibv_destroy_cq, ibv_destroy_qp, ibv_device, ibv_device_attr, ibv_free_device_list,
    ibv_get_cq_event, ibv_get_device_list, ibv_get_device_name, ibv_gid, ibv_modify_qp, ibv_mr, ibv_mtu,
    ibv_open_device, ibv_pd, ibv_poll_cq, ibv_port_attr, ibv_port_state, ibv_post_recv, ibv_post_send, ibv_qp,
    ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_query_device, ibv_query_gid,
    ibv_recv_wr, ibv_reg_mr, ibv_req_notify_cq, ibv_resize_cq, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wc,
    ibv_wc_opcode, ibv_wc_status, ibv_wr_opcode, rdma_t,
};

use super::shell::{self, Backend, Shell};
use super::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpInfo, QpNum, RemoteAddr, Sge, WcKind, WcStatus,
    WorkCompletion, WorkRequest,
};

/// `IBV_LINK_LAYER_INFINIBAND` (an anonymous enum in verbs.h that rdma-sys does not bind).
const LINK_LAYER_INFINIBAND: u8 = 1;
/// QP `timeout`: 4.096 µs × 2^14 ≈ 67 ms per attempt.
const QP_TIMEOUT: u8 = 14;
/// QP `retry_cnt`: 6 retransmissions, so about 0.5 s before `RETRY_EXC_ERR` (not 7: Soft-RoCE takes 7 as "retry
/// forever", as the spec does only for `rnr_retry`).
const QP_RETRY_COUNT: u8 = 6;
/// QP `rnr_retry`: 7 means retry forever while the receiver has no receive posted.
const QP_RNR_RETRY: u8 = 7;
/// `min_rnr_timer` 12: the responder asks a sender to wait 0.64 ms when it has no receive posted.
const QP_MIN_RNR_TIMER: u8 = 12;
/// IP hop limit of RoCE v2 packets (routable, as the RoCE GIDs are).
const HOP_LIMIT: u8 = 64;
/// Receives kept posted per QP for WRITE_WITH_IMM, at least (at least `sq_depth` too).
const MIN_RECEIVES: usize = 64;
/// The CQ's size at open; it grows as QPs are created.
const INITIAL_CQ_ENTRIES: usize = 256;
/// Completions taken off the device per `ibv_poll_cq`.
const POLL_BATCH: usize = 32;
/// The `wr_id` bit that marks the endpoint's own receives (send `wr_id`s are positions, far below it).
const RECEIVE_TAG: u64 = 1 << 63;

/// Why an [`RdmaEndpoint`] could not be opened, or a [`write_bandwidth`] run failed.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    #[error(
        "no RDMA device found: load a driver and create a device (Soft-RoCE: `modprobe rdma_rxe` then \
         `rdma link add rxe0 type rxe netdev <interface>`), or run inside the test guest (run-in-guest.sh)"
    )]
    NoDevices,
    #[error(
        "no RDMA device is named {name:?}; available: {available:?}: pass one of these, or none for the first device \
         with an active port"
    )]
    UnknownDevice { name: String, available: Vec<String> },
    #[error("no active port on {devices} ({ports}): bring the link up (Soft-RoCE: `ip link set <interface> up`)")]
    NoActivePort { devices: String, ports: String },
    #[error(
        "{device} port {port} is RoCE but none of its {entries} GIDs is IPv4-mapped (::ffff:a.b.c.d): give its \
         network interface an IPv4 address (`ip addr add 10.199.0.1/24 dev <interface>`)"
    )]
    NoRoceGid { device: String, port: u8, entries: usize },
    #[error("{call} failed on {device}: {source}")]
    Verbs { device: String, call: &'static str, source: io::Error },
    #[error(transparent)]
    Fabric(#[from] FabricError),
    #[error("benchmark work request {wr_id} completed {status:?}")]
    Transfer { wr_id: u64, status: WcStatus },
    #[error("the benchmark made no progress for {0:?}: the device stopped completing work requests")]
    Stalled(Duration),
}

/// What [`write_bandwidth`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bandwidth {
    /// Bytes written (message size × work requests).
    pub bytes: u64,
    /// Wall time from the first post to the last completion.
    pub seconds: f64,
    /// RDMA WRITE work requests completed.
    pub work_requests: u64,
}

impl Bandwidth {
    /// Bytes per second.
    pub fn bytes_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// C structs for which all-zero bytes are a valid value (integers, raw pointers and unions of them), as C code gets
/// them from `memset(&x, 0, sizeof x)`.
trait PlainData {}
impl PlainData for ibv_device_attr {}
impl PlainData for ibv_port_attr {}
impl PlainData for ibv_gid {}
impl PlainData for ibv_qp_init_attr {}
impl PlainData for ibv_qp_attr {}
impl PlainData for ibv_send_wr {}
impl PlainData for ibv_recv_wr {}
impl PlainData for ibv_wc {}

fn zeroed<T: PlainData>() -> T {
    // SAFETY: `PlainData` is implemented only for verbs structs made of integers, raw pointers and unions of them,
    // for which all-zero bytes are a valid value (null pointers, zero integers).
    unsafe { std::mem::zeroed() }
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

/// The errno of a verbs call that returns it (`ibv_modify_qp`, `ibv_post_send`, ...), or of `errno` itself.
fn errno_of(rc: i32) -> i32 {
    if rc > 0 {
        rc
    } else {
        last_error().raw_os_error().unwrap_or(libc::EIO)
    }
}

/// How peers address this endpoint's port.
#[derive(Debug, Clone, Copy)]
enum PortAddress {
    /// RoCE: the IPv4-mapped GID of this index, in a GRH.
    Roce { gid_index: u8, gid: [u8; 16] },
    /// InfiniBand: the port's LID, no GRH.
    Infiniband { lid: u16 },
}

/// One RDMA endpoint: a device context, a protection domain, a CQ with a completion channel, registered regions and
/// RC QPs (see the module docs for how the [`Endpoint`] contract is kept).
///
/// Fields drop in declaration order after [`Drop::drop`]: QPs, regions, CQ, channel, PD, context.
pub struct RdmaEndpoint {
    qps: BTreeMap<QpNum, Qp>,
    regions: BTreeMap<u64, Registered>,
    cq: Cq,
    channel: Channel,
    pd: Pd,
    /// Held for teardown order only: closed last.
    _context: Context,
    node: NodeId,
    caps: Caps,
    device: String,
    port: u8,
    address: PortAddress,
    path_mtu: ibv_mtu::Type,
    max_cqe: usize,
    max_qp_wr: usize,
    /// CQ entries the QPs may occupy at once (the sum of their send and receive depths).
    cq_reserved: usize,
    /// The QPs' send queues and the completions taken off the CQ (or made here for a failed QP) not handed out yet.
    shell: Shell,
    /// Reused buffers of the hot paths.
    send_wrs: Vec<ibv_send_wr>,
    send_sges: Vec<ibv_sge>,
    wcs: Vec<ibv_wc>,
}

// SAFETY: the endpoint owns every verbs object it points to and nothing else holds them; libibverbs objects may be
// used from any thread (the library is thread-safe), and the endpoint is never shared (`&mut self` for all changes),
// so moving it to another thread is sound.
unsafe impl Send for RdmaEndpoint {}

impl std::fmt::Debug for RdmaEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaEndpoint")
            .field("node", &self.node)
            .field("device", &self.device)
            .field("port", &self.port)
            .field("address", &self.address)
            .field("caps", &self.caps)
            .field("qps", &self.qps.len())
            .field("regions", &self.regions.len())
            .finish_non_exhaustive()
    }
}

/// The fields of an `ibv_wc` the endpoint reads, copied out of the poll buffer.
#[derive(Debug, Clone, Copy)]
struct RawCompletion {
    wr_id: u64,
    status: ibv_wc_status::Type,
    opcode: ibv_wc_opcode::Type,
    byte_len: u32,
    imm: u32,
    qp_num: u32,
}

struct Qp {
    raw: NonNull<ibv_qp>,
    /// Receives posted and not yet completed.
    receives: usize,
    receive_depth: usize,
    /// A receive failed or was flushed: the QP is in the error state, so receives are not re-posted.
    receives_stopped: bool,
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `ibv_create_qp` and is destroyed only here, once; the CQ and PD it uses outlive it
        // (the endpoint drops its QPs first).
        unsafe {
            ibv_destroy_qp(self.raw.as_ptr());
        }
    }
}

/// A registered region: the MR and the memory it covers.
struct Registered {
    /// `None` once deregistered.
    mr: Option<NonNull<ibv_mr>>,
    region: MemoryRegion,
    storage: Storage,
}

enum Storage {
    /// A `Vec`'s heap buffer, taken apart: no Rust reference to it exists while the MR lives. Raw parts own
    /// nothing, so a buffer whose MR cannot be deregistered is leaked, never freed under the device.
    Heap { ptr: NonNull<u8>, len: usize, capacity: usize },
    /// An empty `Vec` (kept as is: the device never touches it) and the private allocation its zero-length MR is in.
    Empty { bytes: Vec<u8>, _anchor: Box<[u8; 2]> },
    /// Handed back by [`Registered::release`].
    Released,
}

impl Registered {
    /// Deregisters the MR (once) and gives the bytes back; on failure the region stays registered.
    fn release(&mut self) -> Result<Vec<u8>, FabricError> {
        if let Some(mr) = self.mr {
            // SAFETY: `mr` came from `ibv_reg_mr` and has not been deregistered (it is reset to `None` right after).
            let rc = unsafe { ibv_dereg_mr(mr.as_ptr()) };
            if rc != 0 {
                return Err(FabricError::Device { call: "ibv_dereg_mr", errno: errno_of(rc) });
            }
            self.mr = None;
        }
        match std::mem::replace(&mut self.storage, Storage::Released) {
            Storage::Heap { ptr, len, capacity } => {
                // SAFETY: the parts came from one `Vec<u8>` taken apart by `register` and are rebuilt only here (the
                // storage no longer holds them); the MR is deregistered, so the device no longer writes the buffer.
                Ok(unsafe { Vec::from_raw_parts(ptr.as_ptr(), len, capacity) })
            }
            Storage::Empty { bytes, .. } => Ok(bytes),
            Storage::Released => Ok(Vec::new()),
        }
    }

    /// The buffer's first byte and length (length 0 for an empty or released region).
    fn raw(&self) -> (*const u8, usize) {
        match &self.storage {
            Storage::Heap { ptr, len, .. } => (ptr.as_ptr(), *len),
            Storage::Empty { .. } | Storage::Released => (ptr::null(), 0),
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // On failure the raw parts stay in place and are leaked with `self`.
        let _ = self.release();
    }
}

struct Context(NonNull<ibv_context>);

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context came from `ibv_open_device` and every object made from it is already destroyed (the
        // endpoint drops it last).
        unsafe {
            ibv_close_device(self.0.as_ptr());
        }
    }
}

struct Pd(NonNull<ibv_pd>);

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: the PD came from `ibv_alloc_pd`; its QPs and MRs are destroyed before it (field order).
        unsafe {
            ibv_dealloc_pd(self.0.as_ptr());
        }
    }
}

struct Channel(NonNull<ibv_comp_channel>);

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: the channel came from `ibv_create_comp_channel`; its CQ is destroyed before it (field order).
        unsafe {
            ibv_destroy_comp_channel(self.0.as_ptr());
        }
    }
}

struct Cq(NonNull<ibv_cq>);

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: the CQ came from `ibv_create_cq`; its QPs are destroyed before it and every event taken from its
        // channel was acknowledged when it was taken (`RdmaEndpoint::wait`).
        unsafe {
            ibv_destroy_cq(self.0.as_ptr());
        }
    }
}

/// The device list, freed on drop (opened contexts stay valid after).
struct DeviceList {
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, RdmaError> {
        let mut count = 0;
        // SAFETY: `count` is a valid out pointer; the list is freed by `Drop`.
        let list = unsafe { ibv_get_device_list(&mut count) };
        let list = NonNull::new(list).ok_or(RdmaError::NoDevices)?;
        Ok(DeviceList { list, len: usize::try_from(count).unwrap_or(0) })
    }

    fn device(&self, index: usize) -> *mut ibv_device {
        assert!(index < self.len, "device index {index} out of {} devices", self.len);
        // SAFETY: the list holds `len` device pointers (then a null), and `index < len`.
        unsafe { *self.list.as_ptr().add(index) }
    }

    fn names(&self) -> Vec<String> {
        (0..self.len)
            .map(|index| {
                // SAFETY: the device pointer is valid while the list lives; libibverbs returns a NUL-terminated name
                // it owns, copied here before the list is freed.
                unsafe { CStr::from_ptr(ibv_get_device_name(self.device(index))) }.to_string_lossy().into_owned()
            })
            .collect()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from `ibv_get_device_list` and is freed once; contexts opened from it stay valid.
        unsafe { ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// A device context and the port an endpoint uses, before the PD and CQ exist.
struct OpenPort {
    context: Context,
    device: String,
    port: u8,
    attr: ibv_port_attr,
    device_attr: ibv_device_attr,
}

fn open_context(list: &DeviceList, index: usize, name: &str) -> Result<Context, RdmaError> {
    // SAFETY: the device pointer is valid while the list lives; the context is closed by `Context`'s drop.
    let context = unsafe { ibv_open_device(list.device(index)) };
    let context = NonNull::new(context).ok_or_else(|| RdmaError::Verbs {
        device: name.to_owned(),
        call: "ibv_open_device",
        source: last_error(),
    })?;
    Ok(Context(context))
}

fn query_device(context: &Context, device: &str) -> Result<ibv_device_attr, RdmaError> {
    let mut attr: ibv_device_attr = zeroed();
    // SAFETY: the context is open and `attr` is a valid out pointer of the right type.
    let rc = unsafe { ibv_query_device(context.0.as_ptr(), &mut attr) };
    if rc != 0 {
        let source = io::Error::from_raw_os_error(errno_of(rc));
        return Err(RdmaError::Verbs { device: device.to_owned(), call: "ibv_query_device", source });
    }
    Ok(attr)
}

fn query_port(context: &Context, port: u8) -> Result<ibv_port_attr, io::Error> {
    let mut attr: ibv_port_attr = zeroed();
    // SAFETY: the context is open and `attr` is a valid out pointer (rdma-sys passes its size to the provider).
    let rc = unsafe { ___ibv_query_port(context.0.as_ptr(), port, &mut attr) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(errno_of(rc)));
    }
    Ok(attr)
}

fn port_state_name(state: ibv_port_state::Type) -> &'static str {
    match state {
        ibv_port_state::IBV_PORT_DOWN => "DOWN",
        ibv_port_state::IBV_PORT_INIT => "INIT",
        ibv_port_state::IBV_PORT_ARMED => "ARMED",
        ibv_port_state::IBV_PORT_ACTIVE => "ACTIVE",
        ibv_port_state::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

/// Opens `index` and returns its first active port, or `None` after noting each port's state in `ports`.
fn first_active_port(
    list: &DeviceList,
    index: usize,
    name: &str,
    ports: &mut Vec<String>,
) -> Result<Option<OpenPort>, RdmaError> {
    let context = open_context(list, index, name)?;
    let device_attr = query_device(&context, name)?;
    for port in 1..=device_attr.phys_port_cnt {
        match query_port(&context, port) {
            Ok(attr) if attr.state == ibv_port_state::IBV_PORT_ACTIVE => {
                return Ok(Some(OpenPort { context, device: name.to_owned(), port, attr, device_attr }));
            }
            Ok(attr) => ports.push(format!("{name} port {port}: {}", port_state_name(attr.state))),
            Err(error) => ports.push(format!("{name} port {port}: {error}")),
        }
    }
    if device_attr.phys_port_cnt == 0 {
        ports.push(format!("{name}: no ports"));
    }
    Ok(None)
}

/// Whether a GID is IPv4-mapped (`::ffff:a.b.c.d`), the form RoCE v2 uses for IPv4 addresses.
fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&byte| byte == 0) && gid[10..12] == [0xff, 0xff] && gid[12..] != [0; 4]
}

/// Whether the kernel says GID `index` of the port is RoCE v2 (sysfs `gid_attrs/types`; rdma-sys binds no
/// `ibv_query_gid_type`/`ibv_query_gid_ex`).
fn is_roce_v2(device: &str, port: u8, index: usize) -> bool {
    let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
    std::fs::read_to_string(path).is_ok_and(|kind| kind.trim().eq_ignore_ascii_case("RoCE v2"))
}

/// The port's address: the LID on InfiniBand; on RoCE the IPv4-mapped GID whose type is RoCE v2, else the first
/// IPv4-mapped GID.
fn port_address(open: &OpenPort) -> Result<PortAddress, RdmaError> {
    if open.attr.link_layer == LINK_LAYER_INFINIBAND {
        return Ok(PortAddress::Infiniband { lid: open.attr.lid });
    }
    let entries = usize::try_from(open.attr.gid_tbl_len).unwrap_or(0);
    let mut first_mapped = None;
    for index in 0..entries.min(usize::from(u8::MAX) + 1) {
        let mut gid: ibv_gid = zeroed();
        // SAFETY: the context is open, `index` is inside the port's GID table and `gid` is a valid out pointer.
        let rc = unsafe { ibv_query_gid(open.context.0.as_ptr(), open.port, index as i32, &mut gid) };
        if rc != 0 {
            continue;
        }
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        let raw = unsafe { gid.raw };
        if !is_ipv4_mapped(&raw) {
            continue;
        }
        let address = PortAddress::Roce { gid_index: index as u8, gid: raw };
        if is_roce_v2(&open.device, open.port, index) {
            return Ok(address);
        }
        first_mapped.get_or_insert(address);
    }
    first_mapped.ok_or(RdmaError::NoRoceGid { device: open.device.clone(), port: open.port, entries })
}

fn clamp_caps(asked: Caps, device: &ibv_device_attr, port: &ibv_port_attr) -> Caps {
    Caps {
        max_sge: asked.max_sge.min(usize::try_from(device.max_sge).unwrap_or(0)),
        max_message: asked.max_message.min(u64::from(port.max_msg_sz)),
        sq_depth: asked.sq_depth.min(usize::try_from(device.max_qp_wr).unwrap_or(0)),
    }
}

impl RdmaEndpoint {
    /// Opens `device` (by name; `None`: the first device with an active port) on its first active port, with one
    /// PD, one completion channel and one CQ. `caps` is clamped to the device's `max_sge` and `max_qp_wr` and the
    /// port's maximum message size; [`Endpoint::caps`] gives the effective limits.
    pub fn open(node: NodeId, device: Option<&str>, caps: Caps) -> Result<RdmaEndpoint, RdmaError> {
        let list = DeviceList::get()?;
        let names = list.names();
        if names.is_empty() {
            return Err(RdmaError::NoDevices);
        }
        let candidates: Vec<usize> = match device {
            Some(name) => match names.iter().position(|it| it == name) {
                Some(index) => vec![index],
                None => return Err(RdmaError::UnknownDevice { name: name.to_owned(), available: names }),
            },
            None => (0..names.len()).collect(),
        };
        let mut ports = Vec::new();
        for index in candidates.iter().copied() {
            if let Some(open) = first_active_port(&list, index, &names[index], &mut ports)? {
                drop(list);
                return RdmaEndpoint::with_port(node, open, caps);
            }
        }
        let devices = candidates.iter().map(|&index| names[index].as_str()).collect::<Vec<_>>().join(", ");
        Err(RdmaError::NoActivePort { devices, ports: ports.join("; ") })
    }

    fn with_port(node: NodeId, open: OpenPort, caps: Caps) -> Result<RdmaEndpoint, RdmaError> {
        let address = port_address(&open)?;
        let device = open.device.clone();
        let verbs_error = |call: &'static str| RdmaError::Verbs { device: device.clone(), call, source: last_error() };
        let raw_context = open.context.0.as_ptr();
        // SAFETY: the context is open; the PD is deallocated by `Pd`'s drop.
        let pd = Pd(NonNull::new(unsafe { ibv_alloc_pd(raw_context) }).ok_or_else(|| verbs_error("ibv_alloc_pd"))?);
        // SAFETY: the context is open; the channel is destroyed by `Channel`'s drop, after its CQ.
        let channel = unsafe { ibv_create_comp_channel(raw_context) };
        let channel = Channel(NonNull::new(channel).ok_or_else(|| verbs_error("ibv_create_comp_channel"))?);
        // SAFETY: the channel is live; reading its file descriptor field.
        let fd = unsafe { (*channel.0.as_ptr()).fd };
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL only change its status flags.
        let nonblocking = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        if nonblocking != 0 {
            return Err(verbs_error("fcntl(O_NONBLOCK) on the completion channel"));
        }
        let max_cqe = usize::try_from(open.device_attr.max_cqe).unwrap_or(0).max(1);
        let entries = INITIAL_CQ_ENTRIES.min(max_cqe) as i32;
        // SAFETY: the context and channel are live; the CQ is destroyed by `Cq`'s drop, before the channel.
        let cq = unsafe { ibv_create_cq(raw_context, entries, ptr::null_mut(), channel.0.as_ptr(), 0) };
        let cq = Cq(NonNull::new(cq).ok_or_else(|| verbs_error("ibv_create_cq"))?);
        Ok(RdmaEndpoint {
            qps: BTreeMap::new(),
            regions: BTreeMap::new(),
            cq,
            channel,
            pd,
            node,
            caps: clamp_caps(caps, &open.device_attr, &open.attr),
            device: open.device,
            port: open.port,
            address,
            path_mtu: open.attr.active_mtu,
            max_cqe,
            max_qp_wr: usize::try_from(open.device_attr.max_qp_wr).unwrap_or(0),
            cq_reserved: 0,
            shell: Shell::default(),
            send_wrs: Vec::new(),
            send_sges: Vec::new(),
            wcs: (0..POLL_BATCH).map(|_| zeroed()).collect(),
            _context: open.context,
        })
    }

    /// The device's name (e.g. `rxe0`).
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The port used (numbered from 1).
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The GID table index QPs use as their source GID (RoCE), or `None` on InfiniBand.
    pub fn gid_index(&self) -> Option<u8> {
        match self.address {
            PortAddress::Roce { gid_index, .. } => Some(gid_index),
            PortAddress::Infiniband { .. } => None,
        }
    }

    /// Completions already taken off the device's CQ (by [`RdmaEndpoint::wait`], or left over from a
    /// [`Endpoint::poll_cq`] with a small `max`) that the next `poll_cq` hands out first.
    pub fn ready(&self) -> usize {
        self.shell.ready()
    }

    /// Whether a send completion is certain to come that has not been taken off the device yet: a signalled work
    /// request is behind the last completion taken, or a QP has failed and the device still holds work requests
    /// (they all complete, flushed). Unsignalled work requests on a healthy QP complete only if they fail, which
    /// cannot be known in advance. Use it to drain before tearing down, with [`RdmaEndpoint::wait`].
    pub fn awaits_completions(&self) -> bool {
        self.shell.awaits_completions()
    }

    /// Blocks until a completion is ready for [`Endpoint::poll_cq`] or `timeout` has passed, and says whether one is.
    ///
    /// Arms the CQ (`ibv_req_notify_cq`), takes everything that already arrived off it, and if nothing is ready
    /// sleeps in `poll(2)` on the completion channel's descriptor until an event (taken with `ibv_get_cq_event` and
    /// acknowledged at once) or the deadline. A zero timeout only takes what arrived. Never spins.
    pub fn wait(&mut self, timeout: Duration) -> bool {
        #[allow(clippy::disallowed_methods, reason = "waiting for the device needs a deadline on the wall clock")]
        let deadline = Instant::now().checked_add(timeout);
        loop {
            // SAFETY: the CQ is live; arming it asks for an event on the channel at the next completion.
            let armed = unsafe { ibv_req_notify_cq(self.cq.0.as_ptr(), 0) };
            // Completions that arrived before arming raise no event: take them all off now (even with some ready,
            // so that `ready` and `awaits_completions` reflect everything that has arrived).
            self.fetch();
            if self.shell.ready() > 0 {
                return true;
            }
            if armed != 0 {
                return false;
            }
            #[allow(clippy::disallowed_methods, reason = "waiting for the device needs a deadline on the wall clock")]
            let remaining =
                deadline.map_or(Duration::from_secs(3600), |it| it.saturating_duration_since(Instant::now()));
            // Round up to whole milliseconds so a short wait still sleeps; zero stays a check.
            let millis = remaining.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32;
            // SAFETY: the channel is live.
            let fd = unsafe { (*self.channel.0.as_ptr()).fd };
            let mut pollfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: `pollfd` is one valid entry and the count says one.
            let rc = unsafe { libc::poll(&mut pollfd, 1, millis) };
            if rc > 0 {
                self.take_events();
            } else if rc < 0 && last_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if rc <= 0 || remaining.is_zero() {
                self.fetch();
                return self.shell.ready() > 0;
            }
        }
    }

    /// Takes and acknowledges every pending event of the (non-blocking) completion channel.
    fn take_events(&mut self) {
        loop {
            let mut cq: *mut ibv_cq = ptr::null_mut();
            let mut context: *mut libc::c_void = ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; the out pointers are valid.
            let rc = unsafe { ibv_get_cq_event(self.channel.0.as_ptr(), &mut cq, &mut context) };
            if rc != 0 || cq.is_null() {
                return;
            }
            // SAFETY: `cq` is the channel's only CQ, just returned with one unacknowledged event.
            unsafe { ibv_ack_cq_events(cq, 1) };
        }
    }

    /// Takes every completion the device has off the CQ into `ready` (re-posting receives as they complete).
    fn fetch(&mut self) {
        while self.fetch_batch(POLL_BATCH) == POLL_BATCH {}
    }

    /// Polls up to `want` (at most [`POLL_BATCH`]) completions off the device, appends what they mean to `ready`
    /// (at most one each) and returns how many were polled.
    fn fetch_batch(&mut self, want: usize) -> usize {
        let want = want.min(self.wcs.len()) as i32;
        // SAFETY: the CQ is live and `wcs` has room for `want` entries.
        let polled = unsafe { ibv_poll_cq(self.cq.0.as_ptr(), want, self.wcs.as_mut_ptr()) };
        let polled = usize::try_from(polled).unwrap_or(0);
        for index in 0..polled {
            let raw = self.raw_completion(index);
            self.take(raw);
        }
        polled
    }

    fn raw_completion(&self, index: usize) -> RawCompletion {
        let wc = &self.wcs[index];
        RawCompletion {
            wr_id: wc.wr_id,
            status: wc.status,
            opcode: wc.opcode,
            byte_len: wc.byte_len,
            // SAFETY: both union members are `u32`, so either reading is valid whatever the opcode; the immediate is
            // used only for RECV_RDMA_WITH_IMM.
            imm: u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }),
            qp_num: wc.qp_num,
        }
    }

    /// Appends what a completion taken off the CQ means to the caller to `ready`, if anything (a receive re-posts
    /// itself; a send completion may release the completions of work requests flushed here).
    fn take(&mut self, raw: RawCompletion) {
        let qpn = QpNum(raw.qp_num);
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        if raw.wr_id & RECEIVE_TAG != 0 {
            qp.receives = qp.receives.saturating_sub(1);
            if raw.status != ibv_wc_status::IBV_WC_SUCCESS {
                qp.receives_stopped = true;
                return;
            }
            qp.post_receives();
            if raw.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                let wc = WorkCompletion {
                    wr_id: 0,
                    qp: qpn,
                    status: WcStatus::Success,
                    kind: WcKind::RecvImm,
                    imm: Some(raw.imm),
                    byte_len: u64::from(raw.byte_len),
                };
                self.shell.push_notification(wc);
            }
            return;
        }
        let status = wc_status(raw.status);
        self.shell.complete(qpn, raw.wr_id, status);
        if status != WcStatus::Success && self.shell.fail(qpn) {
            // Make sure the device flushes everything it still holds: Soft-RoCE before Linux 6.9 may leave work
            // requests posted to a QP already in error unflushed until its completer runs again, and moving the QP
            // to the error state (where it already is) runs it. On other devices this changes nothing.
            let mut attr: ibv_qp_attr = zeroed();
            attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
            let _ = qp.modify(&mut attr, ibv_qp_attr_mask::IBV_QP_STATE, "ibv_modify_qp(ERR)");
        }
    }

    fn qp_info(&self, qpn: QpNum) -> QpInfo {
        match self.address {
            PortAddress::Roce { gid, .. } => QpInfo { node: self.node, qpn, lid: 0, gid },
            PortAddress::Infiniband { lid } => QpInfo { node: self.node, qpn, lid, gid: [0; 16] },
        }
    }

    /// Grows the CQ (if needed) so it holds `extra` more entries than the QPs already reserve.
    fn reserve_cq(&mut self, extra: usize) -> Result<(), FabricError> {
        let needed = self.cq_reserved.checked_add(extra).ok_or(FabricError::Exhausted("completion queue entries"))?;
        // SAFETY: the CQ is live; `cqe` is its current capacity.
        let capacity = usize::try_from(unsafe { (*self.cq.0.as_ptr()).cqe }).unwrap_or(0);
        if needed > capacity {
            if needed > self.max_cqe {
                return Err(FabricError::Exhausted("completion queue entries"));
            }
            let entries = needed.max(capacity.saturating_mul(2)).min(self.max_cqe) as i32;
            // SAFETY: the CQ is live and owned by this endpoint; resizing keeps its completions.
            let rc = unsafe { ibv_resize_cq(self.cq.0.as_ptr(), entries) };
            if rc != 0 {
                return Err(FabricError::Device { call: "ibv_resize_cq", errno: errno_of(rc) });
            }
        }
        self.cq_reserved = needed;
        Ok(())
    }

    /// RESET → INIT, receives posted, → RTR → RTS.
    fn bring_up(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        let (port, path_mtu, address) = (self.port, self.path_mtu, self.address);
        let local_psn = QpInfo::plain(self.node, local).psn();
        let qp = self.qps.get_mut(&local).ok_or(FabricError::UnknownQp(local))?;
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        let mut attr: ibv_qp_attr = zeroed();
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = access.0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        qp.modify(&mut attr, mask, "ibv_modify_qp(INIT)")?;
        qp.post_receives();

        let mut attr: ibv_qp_attr = zeroed();
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path_mtu;
        attr.dest_qp_num = remote.qpn.0;
        attr.rq_psn = remote.psn();
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = QP_MIN_RNR_TIMER;
        attr.ah_attr.port_num = port;
        match address {
            PortAddress::Roce { gid_index, .. } => {
                attr.ah_attr.is_global = 1;
                attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
                attr.ah_attr.grh.sgid_index = gid_index;
                attr.ah_attr.grh.hop_limit = HOP_LIMIT;
            }
            PortAddress::Infiniband { .. } => attr.ah_attr.dlid = remote.lid,
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        qp.modify(&mut attr, mask, "ibv_modify_qp(RTR)")?;

        let mut attr: ibv_qp_attr = zeroed();
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = local_psn;
        attr.timeout = QP_TIMEOUT;
        attr.retry_cnt = QP_RETRY_COUNT;
        attr.rnr_retry = QP_RNR_RETRY;
        attr.max_rd_atomic = 1;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        qp.modify(&mut attr, mask, "ibv_modify_qp(RTS)")
    }

    /// Builds the linked list of `wrs` in the reused buffers; positions start at `first_position`.
    fn build_send_list(&mut self, wrs: &[WorkRequest], first_position: u64) {
        self.send_sges.clear();
        self.send_wrs.clear();
        for wr in wrs {
            // Lengths fit: every message was checked against `max_message`, at most the port's u32 maximum.
            self.send_sges.extend(wr.sges.iter().map(|sge| ibv_sge {
                addr: sge.addr,
                length: sge.len as u32,
                lkey: sge.lkey,
            }));
        }
        let sges = self.send_sges.as_mut_ptr();
        let mut first_sge = 0;
        for (index, wr) in wrs.iter().enumerate() {
            let mut raw: ibv_send_wr = zeroed();
            raw.wr_id = first_position + index as u64;
            raw.num_sge = wr.sges.len() as i32;
            // Pointers into `send_sges`, which is not touched again until the post is done.
            raw.sg_list = if wr.sges.is_empty() { ptr::null_mut() } else { sges.wrapping_add(first_sge) };
            first_sge += wr.sges.len();
            raw.opcode = match wr.imm {
                Some(_) => ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                None => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            };
            raw.send_flags = if wr.signaled { ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            if let Some(imm) = wr.imm {
                raw.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            raw.wr.rdma = rdma_t { remote_addr: wr.remote.addr, rkey: wr.remote.rkey };
            self.send_wrs.push(raw);
        }
        let list = self.send_wrs.as_mut_ptr();
        for index in 1..self.send_wrs.len() {
            self.send_wrs[index - 1].next = list.wrapping_add(index);
        }
    }
}

impl Qp {
    fn modify(
        &mut self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        call: &'static str,
    ) -> Result<(), FabricError> {
        // SAFETY: the QP is live and `attr` is a valid attribute struct for the fields `mask` names.
        let rc = unsafe { ibv_modify_qp(self.raw.as_ptr(), attr, mask.0 as i32) };
        if rc != 0 {
            return Err(FabricError::Device { call, errno: errno_of(rc) });
        }
        Ok(())
    }

    /// Tops the QP's receives (no SGEs: a WRITE_WITH_IMM lands in an MR and only needs one to complete) up to its
    /// depth, unless the QP has failed.
    fn post_receives(&mut self) {
        while !self.receives_stopped && self.receives < self.receive_depth {
            let mut wr: ibv_recv_wr = zeroed();
            wr.wr_id = RECEIVE_TAG;
            let mut bad: *mut ibv_recv_wr = ptr::null_mut();
            // SAFETY: the QP is live; `wr` is one receive without SGEs (null list, count 0) that the provider copies
            // before returning.
            let rc = unsafe { ibv_post_recv(self.raw.as_ptr(), &mut wr, &mut bad) };
            if rc != 0 {
                self.receives_stopped = true;
                return;
            }
            self.receives += 1;
        }
    }
}

fn wc_status(status: ibv_wc_status::Type) -> WcStatus {
    use ibv_wc_status::*;
    match status {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        IBV_WC_REM_ACCESS_ERR
        | IBV_WC_REM_INV_REQ_ERR
        | IBV_WC_REM_OP_ERR
        | IBV_WC_REM_INV_RD_REQ_ERR
        | IBV_WC_REM_ABORT_ERR
        | IBV_WC_INV_EECN_ERR
        | IBV_WC_INV_EEC_STATE_ERR => WcStatus::RemoteAccess,
        IBV_WC_RETRY_EXC_ERR | IBV_WC_RNR_RETRY_EXC_ERR | IBV_WC_BAD_RESP_ERR | IBV_WC_RESP_TIMEOUT_ERR => {
            WcStatus::RetryExceeded
        }
        _ => WcStatus::LocalProtection,
    }
}

impl Drop for RdmaEndpoint {
    fn drop(&mut self) {
        // QPs before the MRs they may still reference, then the fields: CQ, channel, PD, context.
        self.qps.clear();
        self.regions.clear();
        self.shell.clear();
    }
}

impl Endpoint for RdmaEndpoint {
    fn caps(&self) -> Caps {
        self.caps
    }

    fn node(&self) -> NodeId {
        self.node
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0 as i32;
        let (start, len, storage) = if bytes.is_empty() {
            let anchor = Box::new([0u8; 2]);
            // A zero-length MR at a page-aligned address covers no page and is refused: use the unaligned byte.
            let base = anchor.as_ptr();
            let start = if (base as usize) % 4096 == 0 { base.wrapping_add(1) } else { base };
            (start.cast_mut(), 0, Storage::Empty { bytes, _anchor: anchor })
        } else {
            let mut bytes = ManuallyDrop::new(bytes);
            let (ptr, len, capacity) = (bytes.as_mut_ptr(), bytes.len(), bytes.capacity());
            let ptr = NonNull::new(ptr).expect("a non-empty Vec has a heap buffer");
            (ptr.as_ptr(), len, Storage::Heap { ptr, len, capacity })
        };
        // SAFETY: `start..start + len` is memory this endpoint owns until the MR is deregistered (a Vec's buffer
        // taken apart, or the private anchor with `len` 0); the PD is live.
        let mr = unsafe { ibv_reg_mr(self.pd.0.as_ptr(), start.cast(), len, access) };
        let Some(mr) = NonNull::new(mr) else {
            let errno = last_error().raw_os_error().unwrap_or(libc::EIO);
            // Hand the buffer back to the allocator: the device never got it.
            drop(Registered { mr: None, region: MemoryRegion { addr: 0, len: 0, lkey: 0, rkey: 0 }, storage });
            return Err(FabricError::Device { call: "ibv_reg_mr", errno });
        };
        // SAFETY: `mr` is the live MR just returned; its keys are plain integers.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        let region = MemoryRegion { addr: start as u64, len: len as u64, lkey, rkey };
        self.regions.insert(region.addr, Registered { mr: Some(mr), region, storage });
        Ok(region)
    }

    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        let unknown = FabricError::UnknownRegion { addr: region.addr };
        let registered = self.regions.get_mut(&region.addr).filter(|it| it.region == *region).ok_or(unknown)?;
        let bytes = registered.release()?;
        self.regions.remove(&region.addr);
        Ok(bytes)
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        let registered = self
            .regions
            .get(&region.addr)
            .filter(|it| it.region == *region)
            .ok_or(FabricError::UnknownRegion { addr: region.addr })?;
        let (base, len) = registered.raw();
        let count = out.len() as u64;
        let out_of_region = FabricError::OutOfRegion { offset, len: count, region_len: region.len };
        let end = offset.checked_add(count).filter(|&end| end <= len as u64).ok_or(out_of_region)?;
        if count > 0 {
            // SAFETY: `offset..end` lies inside the live buffer of `len` bytes (checked above) and `out` is a
            // separate Rust slice; the copy goes through the raw pointer, so no reference to memory the device may
            // be writing is created (bytes a write is landing on concurrently are unspecified, as on any NIC).
            unsafe { ptr::copy_nonoverlapping(base.add(offset as usize), out.as_mut_ptr(), (end - offset) as usize) };
        }
        Ok(())
    }

    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        let send_depth = self.caps.sq_depth.max(1);
        let receive_depth = self.caps.sq_depth.max(MIN_RECEIVES).min(self.max_qp_wr.max(1));
        self.reserve_cq(send_depth + receive_depth)?;
        let mut init: ibv_qp_init_attr = zeroed();
        init.send_cq = self.cq.0.as_ptr();
        init.recv_cq = self.cq.0.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = send_depth as u32;
        init.cap.max_recv_wr = receive_depth as u32;
        init.cap.max_send_sge = self.caps.max_sge.max(1) as u32;
        init.cap.max_recv_sge = 1;
        // SAFETY: the PD and CQ are live and `init` is a complete RC QP description; the QP is destroyed by `Qp`'s
        // drop, before the CQ and PD.
        let raw = unsafe { ibv_create_qp(self.pd.0.as_ptr(), &mut init) };
        let Some(raw) = NonNull::new(raw) else {
            let errno = last_error().raw_os_error().unwrap_or(libc::EIO);
            self.cq_reserved -= send_depth + receive_depth;
            return Err(FabricError::Device { call: "ibv_create_qp", errno });
        };
        // SAFETY: `raw` is the live QP just created.
        let qpn = QpNum(unsafe { (*raw.as_ptr()).qp_num });
        let qp = Qp { raw, receives: 0, receive_depth, receives_stopped: false };
        self.qps.insert(qpn, qp);
        self.shell.add_qp(qpn, send_depth);
        Ok(self.qp_info(qpn))
    }

    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        self.shell.check_connect(local)?;
        self.bring_up(local, remote)?;
        self.shell.connect(local);
        Ok(())
    }

    fn post_send(&mut self, qpn: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        self.shell.check_post(qpn, self.caps, wrs)?;
        if wrs.is_empty() {
            return Ok(());
        }
        let book = self.shell.qp(qpn).expect("checked by check_post");
        if book.failed() {
            // The device reported the QP's failure: it would only flush these (and Soft-RoCE before Linux 6.9 may
            // never do it), so they are flushed here, after the device's last completion.
            self.shell.record(qpn, wrs);
            return Ok(());
        }
        let first_position = book.queue().posted();
        let raw_qp = self.qps.get(&qpn).expect("the shell's QPs are the endpoint's").raw.as_ptr();
        self.build_send_list(wrs, first_position);
        let head = self.send_wrs.as_mut_ptr();
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is live; `head` starts a list of `wrs.len()` work requests linked through `next` (the last
        // null), whose SGE pointers point into `send_sges`; both buffers stay untouched until the call returns, and
        // the provider copies the work requests into its queue before returning.
        let rc = unsafe { ibv_post_send(raw_qp, head, &mut bad) };
        // On failure the device took the work requests before `bad`: they will complete, so they are recorded.
        let posted = if rc == 0 {
            wrs.len()
        } else if bad.is_null() {
            0
        } else {
            (bad as usize).saturating_sub(head as usize) / std::mem::size_of::<ibv_send_wr>()
        };
        self.shell.record(qpn, &wrs[..posted.min(wrs.len())]);
        if rc != 0 {
            return Err(FabricError::Device { call: "ibv_post_send", errno: errno_of(rc) });
        }
        Ok(())
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        RdmaEndpoint::wait(self, timeout)
    }

    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        shell::poll_cq(self, out, max)
    }
}

impl Backend for RdmaEndpoint {
    fn shell(&mut self) -> &mut Shell {
        &mut self.shell
    }

    fn fetch(&mut self, want: usize) -> bool {
        let want = want.min(POLL_BATCH);
        self.fetch_batch(want) == want
    }
}

/// Loopback RDMA WRITE bandwidth on one device: two endpoints, one connected QP pair, `iterations` writes of
/// `message_bytes` from one region to the other with `depth` work requests kept outstanding and one in every
/// `depth / 4` (at least 1) signalled, posted as lists. Polls the CQ without sleeping (as `ib_write_bw` does) and
/// fails if nothing completes for 10 s.
pub fn write_bandwidth(
    device: Option<&str>,
    message_bytes: u64,
    iterations: u64,
    depth: usize,
) -> Result<Bandwidth, RdmaError> {
    const STALL: Duration = Duration::from_secs(10);
    let caps = Caps { max_sge: 1, max_message: message_bytes, sq_depth: depth.max(1) };
    let mut sender = RdmaEndpoint::open(NodeId(0), device, caps)?;
    let mut receiver = RdmaEndpoint::open(NodeId(1), Some(sender.device()), caps)?;
    let caps = sender.caps();
    if caps.max_message < message_bytes {
        let max = caps.max_message;
        return Err(FabricError::MessageTooLarge { wr_id: 0, len: message_bytes, max }.into());
    }
    let len = usize::try_from(message_bytes).map_err(|_| FabricError::Exhausted("address space"))?;
    let source = sender.register(vec![0xA5; len])?;
    let target = receiver.register(vec![0; len])?;
    let sender_info = sender.create_qp()?;
    let receiver_info = receiver.create_qp()?;
    sender.connect_qp(sender_info.qpn, receiver_info)?;
    receiver.connect_qp(receiver_info.qpn, sender_info)?;
    let qp = sender_info.qpn;

    let depth = caps.sq_depth as u64;
    let batch_len = (depth / 4).max(1);
    let write = |wr_id: u64, signaled: bool| WorkRequest {
        wr_id,
        sges: vec![Sge { addr: source.addr, len: message_bytes, lkey: source.lkey }],
        remote: RemoteAddr { addr: target.addr, rkey: target.rkey },
        imm: None,
        signaled,
    };
    let batch: Vec<WorkRequest> = (0..batch_len).map(|index| write(index, index + 1 == batch_len)).collect();
    let tail_len = iterations % batch_len;
    let tail: Vec<WorkRequest> = (0..tail_len).map(|index| write(index, index + 1 == tail_len)).collect();
    let mut completions = Vec::with_capacity(POLL_BATCH);
    let (mut posted, mut completed, mut outstanding) = (0u64, 0u64, 0u64);
    #[allow(clippy::disallowed_methods, reason = "a benchmark reads the wall clock")]
    let start = Instant::now();
    let mut last_progress = start;
    while completed < iterations {
        while posted < iterations {
            let list = if iterations - posted >= batch_len { &batch } else { &tail };
            if outstanding + list.len() as u64 > depth {
                break;
            }
            sender.post_send(qp, list)?;
            posted += list.len() as u64;
            outstanding += list.len() as u64;
        }
        completions.clear();
        if sender.poll_cq(&mut completions, POLL_BATCH) == 0 {
            #[allow(clippy::disallowed_methods, reason = "a benchmark reads the wall clock")]
            let now = Instant::now();
            if now.duration_since(last_progress) > STALL {
                return Err(RdmaError::Stalled(STALL));
            }
            continue;
        }
        #[allow(clippy::disallowed_methods, reason = "a benchmark reads the wall clock")]
        let now = Instant::now();
        last_progress = now;
        for wc in &completions {
            if wc.status != WcStatus::Success {
                return Err(RdmaError::Transfer { wr_id: wc.wr_id, status: wc.status });
            }
            // A signalled completion frees its own slot and every unsignalled one before it: a whole list.
            let freed = (wc.wr_id + 1).min(outstanding);
            outstanding -= freed;
            completed += freed;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    receiver.deregister(&target)?;
    sender.deregister(&source)?;
    Ok(Bandwidth { bytes: message_bytes * iterations, seconds, work_requests: iterations })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapped_gids_are_recognised() {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        assert!(!is_ipv4_mapped(&gid), "::ffff:0.0.0.0 is no address");
        gid[12..].copy_from_slice(&[10, 199, 0, 1]);
        assert!(is_ipv4_mapped(&gid));
        let mut link_local = [0u8; 16];
        link_local[0] = 0xfe;
        link_local[1] = 0x80;
        link_local[15] = 1;
        assert!(!is_ipv4_mapped(&link_local));
    }

    #[test]
    fn completion_statuses_map_to_the_closest_kind() {
        use ibv_wc_status::*;
        assert_eq!(wc_status(IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(wc_status(IBV_WC_REM_ACCESS_ERR), WcStatus::RemoteAccess);
        assert_eq!(wc_status(IBV_WC_REM_INV_REQ_ERR), WcStatus::RemoteAccess);
        assert_eq!(wc_status(IBV_WC_LOC_PROT_ERR), WcStatus::LocalProtection);
        assert_eq!(wc_status(IBV_WC_LOC_LEN_ERR), WcStatus::LocalProtection);
        assert_eq!(wc_status(IBV_WC_RETRY_EXC_ERR), WcStatus::RetryExceeded);
        assert_eq!(wc_status(IBV_WC_RNR_RETRY_EXC_ERR), WcStatus::RetryExceeded);
        assert_eq!(wc_status(IBV_WC_WR_FLUSH_ERR), WcStatus::Flushed);
        assert_eq!(wc_status(9999), WcStatus::LocalProtection);
    }

    #[test]
    fn caps_are_clamped_to_the_device_and_port() {
        let mut device: ibv_device_attr = zeroed();
        device.max_sge = 2;
        device.max_qp_wr = 100;
        let mut port: ibv_port_attr = zeroed();
        port.max_msg_sz = 1 << 20;
        let asked = Caps { max_sge: 30, max_message: 1 << 30, sq_depth: 64 };
        assert_eq!(clamp_caps(asked, &device, &port), Caps { max_sge: 2, max_message: 1 << 20, sq_depth: 64 });
    }
}
