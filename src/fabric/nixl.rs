//! `--fabric nixl` (cargo feature `nixl`): NVIDIA's NIXL in the transfer-engine seam, through NIXL's own Rust
//! bindings (`nixl-sys`, feature `stub-api`, which loads `libnixl_capi.so` at run time) over the pinned
//! `nixl-cu12==1.5.1` wheel's libraries with the UCX backend, on host memory. `--fabric nixl-cuda` (features `nixl`
//! and `cuda`): the same agents over the `nixl-cu13==1.5.1` wheel with every region in device memory of one GPU
//! (allocated, filled and kept for the oracle's compare kernel by `super::cuda::Gpu`) registered as VRAM, so UCX
//! moves it with `cuda_copy` in one process and `cuda_ipc` between processes.
//!
//! Every rank is a NIXL agent (`kvrelay-<pid>-<n>-node<k>`, UCX backend, no listener thread: metadata travels over
//! kvrelay's own bootstrap). [`TransferEngine::register`] allocates host memory and registers it as DRAM;
//! [`TransferEngine::open`] advertises `kvrelay-nixl/1`, the end's number and the agent's metadata (fetched then,
//! so it holds every registration made before); [`TransferEngine::connect`] loads the peer's metadata. A batch is
//! one NIXL WRITE request: one descriptor per entry in the local and remote lists, created (NIXL checks every
//! descriptor against the registrations it knows here, and refuses the whole request, writing nothing), posted,
//! and polled with `getXferStatus`; its notification is NIXL's own (`notifMsg`), carrying the target end and the
//! tag, which the target sees through `getNotifs`. The engine has no fixed queue limits; kvrelay declares
//! [`LIMITS`].
//!
//! Where the libraries are: `KVRELAY_NIXL_LIB` (the wheel's `.nixl_cu12.mesonpy.libs` folder or the library
//! itself; when set, only there), else `target/engines/nixl/.nixl_cu12.mesonpy.libs` of this checkout (where `ci/engines.sh` unpacks
//! the wheel), else the loader's search path (`LD_LIBRARY_PATH`). The library is opened by its full path before
//! NIXL's stub opens it by name, which then finds the same object (its `SONAME`), and its own `RPATH` finds the
//! wheel's UCX. UCX's environment defaults to what `ci/engines.sh` writes (`UCX_MODULES=^ib`: without it a process
//! that made a UCX backend dies in libnl at exit; `UCX_NET_DEVICES=lo`: test traffic stays on loopback;
//! `UCX_TLS=cma,tcp`), set in this process before the first agent only where the variable is unset.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![allow(
    clippy::disallowed_methods,
    reason = "a real engine's progress, its backoff and settling wait on the wall clock"
)]

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle,
    XferDescList, XferOp, XferRequest, XferStatus,
};

use super::seam::{
    Batch, BatchId, BatchStatus, Cancelled, Completion, ConnId, Event, Fill, Image, Kept, Landed, Memory, MemoryKind,
    NodeId, Pattern, PeerAddress, RemoteMemory, SeamError, SeamLimits, TransferEngine,
};
use super::transport::{Identity, Transport, TransportError};
use super::verbs::Caps;

/// What kvrelay submits to one agent: NIXL has no fixed limits (a per-token list of 824,661 descriptors ran), so
/// these are kvrelay's own bounds on one request and on requests in flight per connection.
pub const LIMITS: SeamLimits =
    SeamLimits { max_entries: 1 << 20, max_batch_bytes: 1 << 40, batches_in_flight: 64, strided: false, paged: false };
/// The script that fetches, unpacks and finds the pinned wheel.
pub const SCRIPT: &str = "ci/engines.sh";
/// The pinned wheel (host memory), and the one for GPU memory (CUDA 13).
pub const WHEEL: &str = "nixl-cu12==1.5.1";
pub const WHEEL_CUDA: &str = "nixl-cu13==1.5.1";
/// The largest single registration (host memory is allocated whole).
const MAX_REGISTRATION: u64 = 64 << 30;
/// What an address starts with.
const ADDRESS_MAGIC: &[u8] = b"kvrelay-nixl/2\0";
/// Where an address says its agent's regions are: host memory, or device memory of this GPU ordinal.
const HOST_SEGMENT: u32 = u32::MAX;

/// The memory segment an address carries for regions of `kind`, and back.
fn segment_of(kind: MemoryKind) -> u32 {
    match kind {
        MemoryKind::Host => HOST_SEGMENT,
        MemoryKind::Device { gpu } => gpu,
    }
}

fn kind_of(segment: u32) -> MemoryKind {
    if segment == HOST_SEGMENT {
        MemoryKind::Host
    } else {
        MemoryKind::Device { gpu: segment }
    }
}
/// How long `settle` waits for requests in flight at most, and how long it waits for stray notifications.
const SETTLE_LIMIT: Duration = Duration::from_secs(20);
const QUIET: Duration = Duration::from_millis(20);
/// UCX's environment where the user set none (see the module doc); on GPU memory `UCX_TLS` is
/// [`UCX_TLS_DEVICE`] instead (engines.md §1: 418 GB/s between two processes on one H200, against 208 with UCX's
/// own choice).
const UCX_DEFAULTS: [(&str, &str); 3] = [("UCX_MODULES", "^ib"), ("UCX_NET_DEVICES", "lo"), ("UCX_TLS", "cma,tcp")];
const UCX_TLS_DEVICE: &str = "cuda_copy,cuda_ipc,tcp";

/// Where a NIXL fabric's agents put their regions.
#[derive(Clone)]
enum Placement {
    Host,
    #[cfg(feature = "cuda")]
    Device(super::cuda::Gpu),
}

impl Placement {
    fn kind(&self) -> MemoryKind {
        match self {
            Placement::Host => MemoryKind::Host,
            #[cfg(feature = "cuda")]
            Placement::Device(gpu) => MemoryKind::Device { gpu: gpu.ordinal() },
        }
    }

    /// NIXL's memory type and device id of the regions.
    fn segment(&self) -> (MemType, u64) {
        match self {
            Placement::Host => (MemType::Dram, 0),
            #[cfg(feature = "cuda")]
            Placement::Device(gpu) => (MemType::Vram, u64::from(gpu.ordinal())),
        }
    }

    fn on_device(&self) -> bool {
        self.kind() != MemoryKind::Host
    }
}

/// Agents made by this process, for unique names.
static AGENTS: AtomicU64 = AtomicU64::new(0);

/// The loaded library (kept for the process's life) and where it was found, or why it was not.
/// `device`: the process's agents register GPU memory (the first caller decides, for the process's life).
fn library(device: bool) -> Result<&'static Path, TransportError> {
    /// Whether it was opened for GPU memory, and the library with its path or what was tried.
    type Loaded = (bool, Result<(libloading::Library, PathBuf), String>);
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    let (loaded_for_device, loaded) = LOADED.get_or_init(|| {
        for (name, value) in UCX_DEFAULTS {
            let value = if device && name == "UCX_TLS" { UCX_TLS_DEVICE } else { value };
            if std::env::var_os(name).is_none() {
                std::env::set_var(name, value);
            }
        }
        let mut tried = Vec::new();
        for candidate in candidates(device) {
            // SAFETY: loading NIXL's C API runs its initialisers (C++ statics of libnixl, UCX's), which have no
            // preconditions on this process; the handle lives as long as the process (a static).
            match unsafe { libloading::Library::new(&candidate) } {
                Ok(library) => return (device, Ok((library, candidate))),
                Err(error) => tried.push(format!("{}: {error}", candidate.display())),
            }
        }
        (device, Err(tried.join("; ")))
    });
    if *loaded_for_device != device {
        let (first, then) = if device { ("host", "GPU") } else { ("GPU", "host") };
        return Err(TransportError::Unavailable(format!(
            "this process already opened NIXL for {first} memory and cannot open it again for {then} memory (the two \
             wheels and their UCX settings are one per process) (fix: run --fabric nixl and --fabric nixl-cuda in \
             separate processes)"
        )));
    }
    let (wheel, flag) = if device { (WHEEL_CUDA, " --nixl-cu13") } else { (WHEEL, "") };
    let folder = unpacked_folder(device);
    match loaded {
        Ok((_, path)) => Ok(path),
        Err(tried) => Err(TransportError::Unavailable(format!(
            "NIXL's C API (libnixl_capi.so from the {wheel} wheel) is not found (tried {tried}) (fix: bash \
             {SCRIPT}{flag}, which downloads and unpacks the wheel into target/engines/{folder}; or set \
             KVRELAY_NIXL_LIB to the wheel's folder of that name)"
        ))),
    }
}

/// Where `ci/engines.sh` unpacks the wheel's libraries, under `target/engines`.
fn unpacked_folder(device: bool) -> &'static str {
    if device {
        "nixl-cu13/.nixl_cu13.mesonpy.libs"
    } else {
        "nixl/.nixl_cu12.mesonpy.libs"
    }
}

/// Where `libnixl_capi.so` may be, in order (the CUDA 13 wheel's for GPU memory).
fn candidates(device: bool) -> Vec<PathBuf> {
    if let Some(value) = std::env::var_os("KVRELAY_NIXL_LIB") {
        // Named by the user: that copy or none.
        let path = PathBuf::from(value);
        return vec![if path.is_dir() { path.join("libnixl_capi.so") } else { path }];
    }
    let mut candidates = Vec::new();
    let unpacked = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/engines").join(unpacked_folder(device));
    candidates.push(unpacked.join("libnixl_capi.so"));
    candidates.push(PathBuf::from("libnixl_capi.so"));
    candidates
}

/// The wheel's version, read off the `*.dist-info` folder beside the library's folder.
fn wheel_version(library: &Path) -> Option<String> {
    let root = library.parent()?.parent()?;
    let mut names: Vec<String> = std::fs::read_dir(root)
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with("nixl_cu") && name.ends_with(".dist-info"))
        .collect();
    names.sort();
    let name = names.pop()?;
    Some(name.trim_end_matches(".dist-info").replacen('-', " ", 1))
}

/// Memory handed to NIXL by address (`register_memory` takes a descriptor, not a slice): host memory (DRAM) or
/// device memory of GPU `device` (VRAM).
#[derive(Debug)]
struct Range {
    addr: usize,
    len: usize,
    mem_type: MemType,
    device: u64,
}

impl MemoryRegion for Range {
    // SAFETY: the range is a live allocation of its `Registration`, which outlives the registration handle.
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Range {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn device_id(&self) -> u64 {
        self.device
    }
}

/// Where a registration's bytes live: a heap allocation (owned through a raw pointer, since NIXL writes into it
/// behind Rust's back) or a device allocation.
enum Storage {
    Host(*mut [u8]),
    #[cfg(feature = "cuda")]
    Device(super::cuda::DeviceBuffer),
    /// Taken out (handed back or kept).
    Gone,
}

/// One registration: its bytes and NIXL's handle for them.
struct Registration {
    memory: Memory,
    handle: Option<RegistrationHandle>,
    storage: Storage,
}

impl Registration {
    fn new(
        agent: &Agent,
        id: u32,
        len: u64,
        contents: Contents,
        placement: &Placement,
    ) -> Result<Registration, SeamError> {
        if len > MAX_REGISTRATION {
            return Err(SeamError::Exhausted("memory (a registration over 64 GiB)"));
        }
        let size = usize::try_from(len).map_err(|_| SeamError::Exhausted("addressable memory"))?;
        let (storage, addr) = match placement {
            Placement::Host => {
                let mut bytes = vec![0u8; size.max(1)].into_boxed_slice();
                contents.fill()(0, &mut bytes[..size]);
                let bytes = Box::into_raw(bytes);
                (Storage::Host(bytes), bytes as *mut u8 as usize)
            }
            #[cfg(feature = "cuda")]
            Placement::Device(gpu) => {
                let buffer = match &contents {
                    Contents::Pattern(pattern) => gpu.alloc(len, super::cuda::Contents::Pattern(*pattern))?,
                    Contents::Fill(fill) => gpu.alloc(len, super::cuda::Contents::Fill(fill))?,
                };
                let addr = buffer.addr() as usize;
                (Storage::Device(buffer), addr)
            }
        };
        let (mem_type, device) = placement.segment();
        let kind = placement.kind();
        let mut registration =
            Registration { memory: Memory { id, kind, addr: addr as u64, len, key: 0 }, handle: None, storage };
        let handle = agent
            .register_memory(&Range { addr, len: size.max(1), mem_type, device }, None)
            .map_err(|error| SeamError::Engine { call: "registerMem", message: error.to_string() })?;
        registration.handle = Some(handle);
        Ok(registration)
    }

    /// Copies bytes out (NIXL may write other bytes of the allocation meanwhile: no reference to it is made).
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        let outside = SeamError::OutOfRange { offset, len: out.len() as u64, region_len: self.memory.len };
        let end = offset.checked_add(out.len() as u64).ok_or(outside.clone())?;
        if end > self.memory.len {
            return Err(outside);
        }
        match &self.storage {
            Storage::Host(bytes) => {
                // SAFETY: offset..end is within the live allocation of `bytes` (checked above), `out` is a distinct
                // buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (*bytes as *const u8).add(offset as usize),
                        out.as_mut_ptr(),
                        out.len(),
                    )
                };
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Storage::Device(buffer) => buffer.read(offset, out),
            Storage::Gone => Err(SeamError::UnknownMemory(self.memory.id)),
        }
    }

    /// Deregisters and hands the bytes back.
    fn into_bytes(mut self) -> Result<Vec<u8>, SeamError> {
        self.handle = None; // deregisters
        match std::mem::replace(&mut self.storage, Storage::Gone) {
            Storage::Host(bytes) => {
                // SAFETY: `bytes` came from Box::into_raw in `new` and is taken out exactly once (Drop sees Gone).
                let mut bytes = unsafe { Box::from_raw(bytes) }.into_vec();
                bytes.truncate(self.memory.len as usize);
                Ok(bytes)
            }
            #[cfg(feature = "cuda")]
            Storage::Device(buffer) => {
                let mut bytes = vec![0u8; self.memory.len as usize];
                buffer.read(0, &mut bytes)?;
                Ok(bytes)
            }
            Storage::Gone => Err(SeamError::UnknownMemory(self.memory.id)),
        }
    }

    /// Deregisters and keeps device memory where it is for the oracle's compare; host memory is not kept.
    fn keep(&mut self) -> Option<Kept> {
        #[cfg(feature = "cuda")]
        if matches!(self.storage, Storage::Device(_)) {
            self.handle = None; // deregisters: no peer reaches it any more
            if let Storage::Device(buffer) = std::mem::replace(&mut self.storage, Storage::Gone) {
                return buffer.keep().ok();
            }
        }
        None
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.handle = None; // deregisters before the memory goes
        if let Storage::Host(bytes) = std::mem::replace(&mut self.storage, Storage::Gone) {
            // SAFETY: `bytes` came from Box::into_raw in `new` and was not taken out (it was still in `storage`).
            drop(unsafe { Box::from_raw(bytes) });
        }
    }
}

/// What a registration starts with.
enum Contents {
    Pattern(Pattern),
    Fill(Fill),
}

impl Contents {
    fn fill(&self) -> Fill {
        match self {
            Contents::Pattern(pattern) => pattern.fill(),
            Contents::Fill(fill) => fill.clone(),
        }
    }
}

/// One end of a connection: the peer agent it writes to, the peer's end number and its advertised memory.
struct End {
    /// The peer agent's name, its end number, its regions' NIXL device id, and its advertised memory.
    peer: Option<(String, u32, u64, Vec<RemoteMemory>)>,
}

/// A posted request.
struct Posted {
    id: BatchId,
    conn: ConnId,
    request: Option<XferRequest>,
    cancelled: bool,
}

/// One agent and everything it owns. Fields drop in order: requests, then registrations, then the agent.
struct AgentState {
    posted: Vec<Posted>,
    registrations: Vec<Option<Registration>>,
    ends: Vec<End>,
    events: VecDeque<Event>,
    next_batch: u64,
    descriptors: u64,
    /// Polling an agent makes UCX progress (several system calls): an agent that found nothing backs off, up to
    /// [`MAX_BACKOFF`], until it finds something or submits.
    next_check: Instant,
    backoff: Duration,
    node: NodeId,
    name: String,
    placement: Placement,
    agent: Agent,
}

/// The longest an idle agent goes unpolled.
const MAX_BACKOFF: Duration = Duration::from_millis(1);

/// The notification text of a batch: the target end and the tag.
fn notification(conn: u32, tag: u32) -> String {
    format!("kvrelay:{conn}:{tag}")
}

fn parse_notification(text: &str) -> Option<(u32, u32)> {
    let (conn, tag) = text.strip_prefix("kvrelay:")?.split_once(':')?;
    Some((conn.parse().ok()?, tag.parse().ok()?))
}

impl AgentState {
    fn new(node: NodeId, placement: Placement) -> Result<AgentState, TransportError> {
        library(placement.on_device())?;
        let name = format!("kvrelay-{}-{}-node{}", std::process::id(), AGENTS.fetch_add(1, Ordering::Relaxed), node.0);
        let open = |what: &str, error: nixl_sys::NixlError| {
            TransportError::Open(format!(
                "NIXL agent {name}: {what} failed: {error} (fix: check {SCRIPT}'s UCX settings)"
            ))
        };
        // No progress thread: with one, every agent's UCX worker is polled in a busy loop (2 cores, 16 agents);
        // polling a request's state or the notifications makes the progress instead.
        let config = AgentConfig { enable_prog_thread: false, ..AgentConfig::default() };
        let agent = Agent::new_configured(&name, &config).map_err(|error| open("createAgent", error))?;
        let (_, params) = agent.get_plugin_params("UCX").map_err(|error| open("getPluginParams(UCX)", error))?;
        agent.create_backend("UCX", &params).map_err(|error| open("createBackend(UCX)", error))?;
        Ok(AgentState {
            posted: Vec::new(),
            registrations: Vec::new(),
            ends: Vec::new(),
            events: VecDeque::new(),
            next_batch: 0,
            descriptors: 0,
            next_check: Instant::now(),
            backoff: Duration::ZERO,
            node,
            name,
            placement,
            agent,
        })
    }

    /// Registers `len` bytes holding `contents` where this agent's regions live (`kind` must be that place).
    fn register(&mut self, kind: MemoryKind, len: u64, contents: Contents) -> Result<Memory, SeamError> {
        let placed = self.placement.kind();
        if kind != placed {
            let message = format!(
                "this NIXL fabric registers {placed} memory, not {kind} (fix: --fabric nixl for host memory, \
                 --fabric nixl-cuda for device memory)"
            );
            return Err(SeamError::Engine { call: "registerMem", message });
        }
        let id = u32::try_from(self.registrations.len()).map_err(|_| SeamError::Exhausted("memory ids"))?;
        let registration = Registration::new(&self.agent, id, len, contents, &self.placement)?;
        let memory = registration.memory;
        self.registrations.push(Some(registration));
        Ok(memory)
    }

    fn registration(&self, id: u32) -> Result<&Registration, SeamError> {
        self.registrations.get(id as usize).and_then(Option::as_ref).ok_or(SeamError::UnknownMemory(id))
    }

    /// [`AgentState::advance`] unless the agent is backing off.
    fn advance_when_due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next_check {
            return false;
        }
        let found = self.advance();
        self.backoff =
            if found { Duration::ZERO } else { (self.backoff * 2).clamp(Duration::from_micros(20), MAX_BACKOFF) };
        self.next_check = now + self.backoff;
        found
    }

    /// Checks every posted request and takes new notifications: whether anything happened.
    fn advance(&mut self) -> bool {
        let before = self.events.len();
        let mut still = Vec::with_capacity(self.posted.len());
        for mut posted in std::mem::take(&mut self.posted) {
            let state = match &posted.request {
                Some(request) => self.agent.get_xfer_status(request),
                None => Ok(XferStatus::Success),
            };
            let (status, landed, detail) = match state {
                Ok(XferStatus::InProgress) => {
                    still.push(posted);
                    continue;
                }
                Ok(XferStatus::Success) if posted.cancelled => (
                    BatchStatus::Aborted,
                    Landed::All,
                    "cancelled; NIXL had finished it (every byte landed)".to_owned(),
                ),
                Ok(XferStatus::Success) => (BatchStatus::Success, Landed::All, String::new()),
                Err(error) => (BatchStatus::Unreachable, Landed::Unknown, format!("getXferStatus: {error}")),
            };
            posted.request = None; // releases the request
            let completion = Completion { conn: posted.conn, batch: posted.id, status, landed, detail };
            self.events.push_back(Event::Completed(completion));
        }
        self.posted = still;
        self.take_notifications();
        self.events.len() > before
    }

    fn take_notifications(&mut self) {
        let Ok(mut map) = NotificationMap::new() else { return };
        if self.agent.get_notifications(&mut map, None).is_err() {
            return;
        }
        // A notification that is not UTF-8, or names no end of this agent, is not kvrelay's: it is dropped (a
        // batch's own notification always names its target end).
        let Ok(taken) = map.take_notifs() else { return };
        // Sorted by initiator (the map NIXL's bindings give has no stable order); each initiator's own order is kept.
        let taken: BTreeMap<String, Vec<String>> = taken.into_iter().collect();
        for text in taken.into_values().flatten() {
            if let Some((conn, tag)) = parse_notification(&text).filter(|(conn, _)| (*conn as usize) < self.ends.len())
            {
                self.events.push_back(Event::Notified { conn: ConnId(conn), tag });
            }
        }
    }
}

/// One rank's NIXL agent at the seam.
pub struct NixlEngine(Rc<RefCell<AgentState>>);

impl TransferEngine for NixlEngine {
    fn node(&self) -> NodeId {
        self.0.borrow().node
    }

    fn limits(&self) -> SeamLimits {
        LIMITS
    }

    fn register(&mut self, kind: MemoryKind, len: u64, _item_len: u64, fill: Fill) -> Result<Memory, SeamError> {
        self.0.borrow_mut().register(kind, len, Contents::Fill(fill))
    }

    fn register_pattern(
        &mut self,
        kind: MemoryKind,
        len: u64,
        _item_len: u64,
        pattern: Pattern,
    ) -> Result<Memory, SeamError> {
        self.0.borrow_mut().register(kind, len, Contents::Pattern(pattern))
    }

    fn memory_kind(&self) -> MemoryKind {
        self.0.borrow().placement.kind()
    }

    fn resident(&mut self, memory: &Memory) -> Option<Kept> {
        let mut state = self.0.borrow_mut();
        let slot = state.registrations.get_mut(memory.id as usize)?;
        let kept = slot.as_mut()?.keep()?;
        *slot = None;
        Some(kept)
    }

    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        self.0.borrow().registration(memory.id)?.read(offset, out)
    }

    fn release(&mut self, memory: &Memory, _sparse: bool) -> Result<Image, SeamError> {
        let mut state = self.0.borrow_mut();
        let slot = state.registrations.get_mut(memory.id as usize).ok_or(SeamError::UnknownMemory(memory.id))?;
        let registration = slot.take().ok_or(SeamError::UnknownMemory(memory.id))?;
        Ok(BTreeMap::from([(0, registration.into_bytes()?)]))
    }

    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError> {
        let mut state = self.0.borrow_mut();
        let conn = u32::try_from(state.ends.len()).map_err(|_| SeamError::Exhausted("connections"))?;
        let metadata = state
            .agent
            .get_local_md()
            .map_err(|error| SeamError::Engine { call: "getLocalMD", message: error.to_string() })?;
        state.ends.push(End { peer: None });
        let segment = segment_of(state.placement.kind());
        let mut address = ADDRESS_MAGIC.to_vec();
        address.extend_from_slice(&conn.to_le_bytes());
        address.extend_from_slice(&segment.to_le_bytes());
        address.extend_from_slice(&metadata);
        Ok((ConnId(conn), PeerAddress(address)))
    }

    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError> {
        let bad = |why: String| SeamError::BadAddress { address: peer.to_string(), why };
        let rest = peer
            .0
            .strip_prefix(ADDRESS_MAGIC)
            .ok_or_else(|| bad("not a kvrelay NIXL address (fix: both sides must run --fabric nixl)".to_owned()))?;
        let (end, metadata) =
            rest.split_first_chunk::<4>().ok_or_else(|| bad("it ends before its end number".to_owned()))?;
        let (segment, metadata) =
            metadata.split_first_chunk::<4>().ok_or_else(|| bad("it ends before its memory segment".to_owned()))?;
        let theirs = kind_of(u32::from_le_bytes(*segment));
        let mut state = self.0.borrow_mut();
        let ours = state.placement.kind();
        if (ours == MemoryKind::Host) != (theirs == MemoryKind::Host) {
            return Err(bad(format!(
                "the peer's regions are in {theirs} memory and this agent's in {ours} memory (fix: run every rank \
                 with the same fabric, --fabric nixl or --fabric nixl-cuda)"
            )));
        }
        match state.ends.get(conn.0 as usize) {
            None => return Err(SeamError::UnknownConnection(conn)),
            Some(End { peer: Some(_) }) => return Err(SeamError::AlreadyConnected(conn)),
            Some(End { peer: None }) => {}
        }
        let name = state
            .agent
            .load_remote_md(metadata)
            .map_err(|error| bad(format!("NIXL's loadRemoteMD refused its metadata: {error}")))?;
        // NIXL's device id of the peer's regions: its GPU's ordinal (0 for host memory).
        let device = match theirs {
            MemoryKind::Host => 0,
            MemoryKind::Device { gpu } => u64::from(gpu),
        };
        state.ends[conn.0 as usize].peer = Some((name, u32::from_le_bytes(*end), device, remote.to_vec()));
        Ok(())
    }

    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError> {
        let mut state = self.0.borrow_mut();
        let end = state.ends.get(conn.0 as usize).ok_or(SeamError::UnknownConnection(conn))?;
        let (peer, peer_end, peer_device, remote) = end.peer.clone().ok_or(SeamError::NotConnected(conn))?;
        SeamError::check_limits(&batch, LIMITS)?;
        if state.posted.iter().filter(|posted| posted.conn == conn).count() >= LIMITS.batches_in_flight {
            let bytes = batch.byte_len().unwrap_or(u64::MAX);
            let (max_entries, max_bytes) = (LIMITS.max_entries, LIMITS.max_batch_bytes);
            return Err(SeamError::OverLimits { entries: batch.entries.len(), bytes, max_entries, max_bytes });
        }
        let engine =
            |call: &'static str, error: nixl_sys::NixlError| SeamError::Engine { call, message: error.to_string() };
        // Both sides' regions are where this fabric puts them (the peer runs the same fabric: its address says so).
        let (mem_type, device) = state.placement.segment();
        let mut local = XferDescList::new(mem_type).map_err(|error| engine("createXferDlist", error))?;
        let mut target = XferDescList::new(mem_type).map_err(|error| engine("createXferDlist", error))?;
        for entry in &batch.entries {
            let memory = state.registration(entry.local)?.memory;
            let within =
                |offset: u64, region_len: u64| offset.checked_add(entry.len).is_some_and(|end| end <= region_len);
            if !within(entry.local_offset, memory.len) {
                return Err(SeamError::OutOfRange {
                    offset: entry.local_offset,
                    len: entry.len,
                    region_len: memory.len,
                });
            }
            let outside =
                |region_len| SeamError::OutOfRange { offset: entry.remote_offset, len: entry.len, region_len };
            let peer_memory = remote.get(entry.remote as usize).ok_or(outside(0))?;
            if !within(entry.remote_offset, peer_memory.len) {
                return Err(outside(peer_memory.len));
            }
            let remote_addr = peer_memory.addr.checked_add(entry.remote_offset).ok_or(outside(peer_memory.len))?;
            local.add_desc((memory.addr + entry.local_offset) as usize, entry.len as usize, device);
            target.add_desc(remote_addr as usize, entry.len as usize, peer_device);
        }
        let mut args = OptArgs::new().map_err(|error| engine("createOptArgs", error))?;
        if let Some(tag) = batch.notify {
            let text = notification(peer_end, tag);
            args.set_notification_message(text.as_bytes()).map_err(|error| engine("setNotifMsg", error))?;
            args.set_has_notification(true).map_err(|error| engine("setHasNotif", error))?;
        }
        let id = BatchId(state.next_batch);
        let request = if batch.entries.is_empty() {
            // Nothing to write: only the notification, which NIXL sends by itself.
            if let Some(tag) = batch.notify {
                state
                    .agent
                    .send_notification(&peer, notification(peer_end, tag).as_bytes(), None)
                    .map_err(|error| engine("genNotif", error))?;
            }
            None
        } else {
            let request = state.agent.create_xfer_req(XferOp::Write, &local, &target, &peer, Some(&args)).map_err(
                |error| SeamError::Engine {
                    call: "createXferReq",
                    message: format!(
                        "{error}: NIXL agent {} refused the request, writing nothing (a descriptor outside the memory {peer} \
                         registered, or a peer whose metadata is stale)",
                        state.name
                    ),
                },
            )?;
            state.agent.post_xfer_req(&request, Some(&args)).map_err(|error| engine("postXferReq", error))?;
            Some(request)
        };
        state.next_batch += 1;
        state.descriptors += batch.entries.len() as u64;
        (state.backoff, state.next_check) = (Duration::ZERO, Instant::now());
        state.posted.push(Posted { id, conn, request, cancelled: false });
        Ok(id)
    }

    fn cancel(&mut self, batch: BatchId) -> Cancelled {
        let mut state = self.0.borrow_mut();
        match state.posted.iter_mut().find(|posted| posted.id == batch) {
            Some(posted) => {
                posted.cancelled = true;
                Cancelled::Draining
            }
            None => Cancelled::Ended,
        }
    }

    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        let mut state = self.0.borrow_mut();
        if state.events.len() < max {
            state.advance_when_due();
        }
        let count = state.events.len().min(max);
        out.extend(state.events.drain(..count));
        count
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.0.borrow_mut();
        loop {
            if !state.events.is_empty() || state.advance() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep((deadline - now).min(Duration::from_micros(200)));
        }
    }

    fn operations(&self) -> u64 {
        self.0.borrow().descriptors
    }
}

/// NIXL as a [`Transport`]: one agent per node, all in this process.
pub struct NixlTransport {
    identity: Identity,
    agents: Vec<Weak<RefCell<AgentState>>>,
    placement: Placement,
}

impl NixlTransport {
    /// Finds and loads NIXL's libraries (a clear error naming [`SCRIPT`] when they are missing); regions in host
    /// memory.
    pub fn new() -> Result<NixlTransport, TransportError> {
        NixlTransport::placed(Placement::Host)
    }

    /// NIXL on GPU memory: every region in device memory of GPU `$KVRELAY_CUDA_DEVICE` (default 0), registered
    /// as VRAM, over the [`WHEEL_CUDA`] wheel's libraries.
    #[cfg(feature = "cuda")]
    pub fn on_gpu() -> Result<NixlTransport, TransportError> {
        NixlTransport::placed(Placement::Device(super::cuda::Gpu::open()?))
    }

    fn placed(placement: Placement) -> Result<NixlTransport, TransportError> {
        let library = library(placement.on_device())?;
        let version = wheel_version(library).unwrap_or_else(|| "NIXL (version unknown)".to_owned());
        let mut facts = BTreeMap::new();
        facts.insert("backend".to_owned(), "UCX".to_owned());
        let memory = match &placement {
            Placement::Host => "host (DRAM)".to_owned(),
            #[cfg(feature = "cuda")]
            Placement::Device(gpu) => format!("device (VRAM), GPU {}: {}", gpu.ordinal(), gpu.name()),
        };
        facts.insert("memory".to_owned(), memory);
        facts.insert("library".to_owned(), library.display().to_string());
        facts.insert("bindings".to_owned(), "nixl-sys 1.5.2 (stub-api)".to_owned());
        facts.insert("max_entries".to_owned(), LIMITS.max_entries.to_string());
        facts.insert("batches_in_flight".to_owned(), LIMITS.batches_in_flight.to_string());
        for (name, _) in UCX_DEFAULTS {
            facts.insert(name.to_owned(), std::env::var(name).unwrap_or_default());
        }
        let name = if placement.on_device() { "nixl-cuda" } else { "nixl" }.to_owned();
        Ok(NixlTransport { identity: Identity { name, version, facts }, agents: Vec::new(), placement })
    }

    fn live(&self) -> Vec<Rc<RefCell<AgentState>>> {
        self.agents.iter().filter_map(Weak::upgrade).collect()
    }
}

impl Transport for NixlTransport {
    fn identity(&self) -> Identity {
        self.identity.clone()
    }

    fn verbs(&self) -> bool {
        false
    }

    fn engine(&mut self, node: NodeId, _caps: Caps) -> Result<Box<dyn TransferEngine>, TransportError> {
        let state = Rc::new(RefCell::new(AgentState::new(node, self.placement.clone())?));
        self.agents.push(Rc::downgrade(&state));
        Ok(Box::new(NixlEngine(state)))
    }

    fn step(&mut self) {
        for state in self.live() {
            state.borrow_mut().advance();
        }
        std::thread::sleep(Duration::from_millis(1));
    }

    /// Waits until no agent has a request in flight and no notification arrived for [`QUIET`] (at most
    /// [`SETTLE_LIMIT`]).
    fn settle(&mut self) {
        let start = Instant::now();
        let mut quiet_since = Instant::now();
        while start.elapsed() < SETTLE_LIMIT {
            let live = self.live();
            let mut busy = false;
            for state in &live {
                let mut state = state.borrow_mut();
                if state.advance() {
                    quiet_since = Instant::now();
                }
                busy |= !state.posted.is_empty();
            }
            if !busy && quiet_since.elapsed() >= QUIET {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn reset(&mut self) {
        self.agents.clear();
    }
}
