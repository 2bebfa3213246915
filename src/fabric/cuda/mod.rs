//! `--fabric cuda` (cargo feature `cuda`): every rank's regions in device memory of one GPU, batches executed on
//! that GPU, decode memory judged there.
//!
//! - **Memory.** A region is one device allocation (`cuMemAlloc`); its pattern is generated on the device (a fill
//!   kernel for the source pattern, `cuMemsetD8` for the sentinel), so nothing is staged through host memory. A
//!   peer is told the allocation's device address; a write lands at that address plus its offset.
//! - **A batch** is validated on the host (local ranges, the peer's advertised ranges, that the peer's memory is
//!   still registered: checked at connect and again only after a registration came or went), then runs on the
//!   engine's own stream. A plain batch: one `cuMemcpyDtoDAsync` per entry (few large entries: the copy engines,
//!   [`copy_engine_wins`], measured) or one launch of the row-gather kernel over a descriptor table. Strided and
//!   paged batches (the engine declares both, `SeamLimits`) wait for the doorbell (`flush`, or the next poll) and go
//!   as one upload and one launch each of `kv_strided` (a warp per run) and `kv_paged` (entries cut into chunks on
//!   the device, addresses resolved through the batch's page tables). A CUDA event recorded after the batch is its
//!   completion; the peer's notification is handed out only after that event completed.
//! - **Comparing on the device.** [`CudaEngine::resident`] keeps a decode region where it is, with a [`Compare`]
//!   that checks it against patterns in one compare launch per batch of checks (the oracle's questions, asked
//!   through the running layer): bytes come back to the host only where they differ.
//! - **Where it runs.** cudarc loads `libcuda` and `libnvrtc` at run time: a machine without them gets a clear
//!   error at [`CudaTransport::new`], never a panic. Every engine of one transport shares one CUDA context on GPU
//!   `$KVRELAY_CUDA_DEVICE` (default 0), so ranks are engines of one process; a peer in another process is refused
//!   at connect (its device addresses would need CUDA IPC handles, which this fabric does not advertise yet).
//!
//! [`Compare`]: super::seam::Compare

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::{result, CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::seam::{ConnId, Fill, Kept, MemoryKind, NodeId, Pattern, SeamError, TransferEngine};
use super::transport::{Identity, Transport, TransportError};
use super::verbs::Caps;

mod ceilings;
mod compare;
mod engine;
mod kernels;
mod spares;

pub use ceilings::Ceilings;
pub use compare::plant;
pub use engine::CudaEngine;

use ceilings::ceilings;
use compare::{DeviceCompare, Holder, JudgeSlot};
use engine::Staging;
use kernels::KERNELS;
use spares::{Found, Spare, Spares};

/// The environment variable naming the GPU (its ordinal) the fabric runs on.
pub const DEVICE_ENV: &str = "KVRELAY_CUDA_DEVICE";

/// Entries up to which a batch runs as one `cuMemcpyDtoDAsync` per entry instead of a gather launch, and the
/// average entry size above which it does so whatever the count: see [`copy_engine_wins`].
const COPY_ENGINE_ENTRIES: usize = 4;
const COPY_ENGINE_MIN_AVERAGE: u64 = 4 << 20;

/// Whether a batch of `entries` entries moving `bytes` runs on the copy engines (one async copy per entry) rather
/// than as one gather launch. A copy costs a few microseconds to issue whatever its size, so the copy engines win
/// only for a handful of entries or for entries of megabytes; measured on the H200 by `kvrelay bench --fabric cuda`
/// (its `gather` and `copy engine` lines).
pub fn copy_engine_wins(entries: usize, bytes: u64) -> bool {
    entries <= COPY_ENGINE_ENTRIES || bytes / (entries.max(1) as u64) >= COPY_ENGINE_MIN_AVERAGE
}

/// Pieces a gather or judge descriptor is cut into, at most, so that one warp's share stays short.
const PIECE_BYTES: u64 = 256 << 10;

/// Bytes of one run of the strided kernel, at most (one warp's share): small enough that a batch of large state
/// blocks still gives every warp of the GPU work.
const RUN_BYTES: u64 = 32 << 10;

/// Warps launched per grid (a grid-stride loop covers the rest): enough to fill 132 SMs several times over.
const GRID_BLOCKS: u32 = 132 * 8;
const BLOCK_THREADS: u32 = 256;

/// How a CUDA call failed, in words.
fn driver(call: &'static str, error: impl std::fmt::Debug) -> SeamError {
    SeamError::Engine { call, message: format!("{error:?}") }
}

/// What every engine of one transport shares: the context, its stream and kernels, the live allocations (so a
/// write to memory whose owner is gone fails instead of landing), notifications waiting for their engine, and the
/// device-memory accounting.
struct Shared {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gather: CudaFunction,
    strided: CudaFunction,
    paged: CudaFunction,
    fill: CudaFunction,
    judge: CudaFunction,
    judge_rows: CudaFunction,
    state: Mutex<State>,
    /// Bumped whenever `State::live` changes: a connection's cached liveness of its peer's memory is current while
    /// this is unchanged, so a batch takes the state's lock only after a registration came or went.
    generation: std::sync::atomic::AtomicU64,
    gpu: u32,
    device: Arc<Device>,
}

/// A live allocation: its length, its owning engine, and whether a peer was told it may write there (a connection
/// to it checked; the allocation then never returns to the spares as still holding its pattern).
#[derive(Debug, Clone, Copy)]
struct Live {
    len: u64,
    owner: u32,
    exposed: bool,
}

#[derive(Default)]
struct State {
    /// Live allocations by device address.
    live: BTreeMap<u64, Live>,
    /// Resident regions handed to the oracle, by device address: their length.
    resident: BTreeMap<u64, u64>,
    /// Notifications for each engine: (its connection end, tag), in the order their batches completed.
    mail: BTreeMap<u32, VecDeque<(ConnId, u32)>>,
    next_engine: u32,
}

impl State {
    /// Whether `target` (a peer's advertised memory) is a live allocation of this length and owner; if so, it is
    /// marked exposed: a write may land there from now on.
    fn writable(&mut self, target: &super::seam::RemoteMemory) -> bool {
        match self.live.get_mut(&target.addr) {
            Some(live) if live.len == target.len && live.owner == target.key => {
                live.exposed = true;
                true
            }
            _ => false,
        }
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn launch_config(items: u64) -> LaunchConfig {
        let warps_per_block = u64::from(BLOCK_THREADS / 32);
        let blocks = items.div_ceil(warps_per_block).clamp(1, u64::from(GRID_BLOCKS)) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    /// Allocates `len` bytes (at least one) of device memory for engine `owner`, accounted: with `cuMemAlloc`,
    /// never from a stream-ordered pool (cudarc's default where the device has one), because pool memory has no
    /// legacy CUDA IPC handle and UCX's `cuda_ipc` then cannot reach it: measured on the H200, NIXL moved such
    /// memory between processes by emulating RDMA over TCP (`rma_am(tcp/lo)`, 0.4 GB/s). A spare of the size is
    /// taken first, one still holding pattern `want` first (`true`: it does; nothing need be generated).
    fn alloc(&self, len: u64, owner: u32, want: Option<Pattern>) -> Result<(DeviceAlloc, u64, bool), SeamError> {
        let size = usize::try_from(len.max(1)).map_err(|_| SeamError::Exhausted("device memory"))?;
        self.ctx.bind_to_thread().map_err(|error| driver("cuCtxSetCurrent", error))?;
        let (ptr, filled) = match self.device.reuse(size, want)? {
            Some(found) => found,
            None => {
                let (mut free, _) = self.ctx.mem_get_info().map_err(|error| driver("cuMemGetInfo", error))?;
                if size > free && self.device.release_spares() > 0 {
                    free = self.ctx.mem_get_info().map_err(|error| driver("cuMemGetInfo", error))?.0;
                }
                if size > free {
                    return Err(SeamError::Engine {
                        call: "cuMemAlloc",
                        message: format!(
                            "{size} bytes asked, {free} free on GPU {} (fix: a smaller scenario)",
                            self.gpu
                        ),
                    });
                }
                // SAFETY: the context is current; the memory is filled (a pattern, a fill, or the sentinel) before
                // anything reads it, and freed once (by `Device::release_spares` or the process's end) after
                // `DeviceAlloc`'s drop hands it back.
                let ptr = unsafe { result::malloc_sync(size) }.map_err(|error| driver("cuMemAlloc", error))?;
                self.account(size as i64);
                (ptr, false)
            }
        };
        let spare = Some(SpareOf { device: self.device.clone(), size, holds: None, idle: false });
        let allocation = DeviceAlloc { ctx: self.ctx.clone(), ptr, spare };
        self.state().live.insert(ptr, Live { len, owner, exposed: false });
        self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok((allocation, ptr, filled))
    }

    /// Forgets the registration at `ptr` (its allocation goes back to the GPU's spares when its `DeviceAlloc`
    /// drops); whether a peer was told it may write there.
    fn forget(&self, ptr: u64, _len: u64) -> bool {
        let live = self.state().live.remove(&ptr);
        self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        live.is_some_and(|live| live.exposed)
    }

    /// Adds `bytes` (negative: frees) to the GPU's accounting, raising its peak.
    fn account(&self, bytes: i64) {
        self.device.account(bytes);
    }

    /// Writes `pattern` over `len` bytes at `ptr`, on the stream.
    fn generate(&self, ptr: u64, len: u64, pattern: Pattern) -> Result<(), SeamError> {
        match pattern {
            Pattern::Sentinel => {
                let mut byte = [0u8];
                Pattern::Sentinel.fill()(0, &mut byte);
                let byte = byte[0];
                // SAFETY: `ptr` is a live allocation of at least `len` bytes.
                unsafe { result::memset_d8_async(ptr, byte, len as usize, self.stream.cu_stream()) }
                    .map_err(|error| driver("cuMemsetD8Async", error))
            }
            Pattern::Source { number } => {
                let number = u64::from(number);
                let mut launch = self.stream.launch_builder(&self.fill);
                launch.arg(&ptr).arg(&len).arg(&number);
                let blocks = (len / 8).div_ceil(u64::from(BLOCK_THREADS)).clamp(1, u64::from(GRID_BLOCKS) * 4) as u32;
                let config =
                    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: the kernel writes `len` bytes from `ptr`, a live allocation of that length.
                unsafe { launch.launch(config) }.map(drop).map_err(|error| driver("kv_fill_source", error))
            }
        }
    }

    /// A region of `len` bytes for engine `owner` holding `contents` (generated on the device for a pattern,
    /// uploaded in 64 MiB pieces for a fill), accounted; ordered before anything later on the stream.
    /// A pattern is generated only where the allocation is not a spare still holding it.
    fn make_region(&self, len: u64, owner: u32, contents: Contents<'_>) -> Result<Region, SeamError> {
        let want = match contents {
            Contents::Pattern(pattern) => Some(pattern),
            Contents::Fill(_) => None,
        };
        let (mut allocation, ptr, holds) = self.alloc(len, owner, want)?;
        let filled = match contents {
            Contents::Pattern(_) if holds => {
                self.device.counters.reused_patterns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Contents::Pattern(pattern) => self.generate_counted(ptr, len, pattern),
            Contents::Fill(fill) => self.upload_fill(ptr, len, fill),
        };
        if let Err(error) = filled {
            self.forget(ptr, len);
            return Err(error);
        }
        if let Some(spare) = &mut allocation.spare {
            spare.holds = want;
        }
        Ok(Region { allocation, ptr, len })
    }

    /// Queues `pattern` over the new region at `ptr` ([`Shared::generate`]) and counts it, for
    /// [`Shared::settle_fills`]: the count goes up after the fill is on the stream.
    fn generate_counted(&self, ptr: u64, len: u64, pattern: Pattern) -> Result<(), SeamError> {
        self.device.launched();
        self.generate(ptr, len, pattern)?;
        self.device.counters.patterns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.device.fills.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }

    /// Waits for every fill queued before this call: an engine calls it before it launches anything that reads or
    /// writes registered memory. A peer learns of a region only after its registration returned, so any fill its
    /// launch depends on was counted before this reads the count.
    fn settle_fills(&self) -> Result<(), SeamError> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        let queued = self.device.fills.load(Acquire);
        if self.device.fills_settled.load(Acquire) >= queued {
            return Ok(());
        }
        self.device.timed(|| self.stream.synchronize()).map_err(|error| driver("cuStreamSynchronize", error))?;
        self.device.fills_settled.fetch_max(queued, AcqRel);
        Ok(())
    }

    /// Waits for every launch and fill queued so far that writes registered memory (the shared stream and every
    /// engine's stream; not the oracle's compare streams, which only read), once for all of them: a keep after
    /// nothing new was queued waits for nothing. Launches are counted before they are queued, so any launch that
    /// happened before this call is waited for.
    fn settle_writes(&self) -> Result<(), cudarc::driver::DriverError> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        let device = &self.device;
        let seen = device.launches.load(Acquire);
        if device.launches_settled.load(Acquire) >= seen {
            return Ok(());
        }
        let streams = device.engine_streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        device.timed(|| {
            device.stream.synchronize()?;
            streams.iter().try_for_each(|stream| stream.synchronize())
        })?;
        device.launches_settled.fetch_max(seen, AcqRel);
        Ok(())
    }

    /// Arbitrary contents (the conformance cases' fills) go up in 64 MiB pieces; patterns never take this path.
    fn upload_fill(&self, ptr: u64, len: u64, fill: &Fill) -> Result<(), SeamError> {
        let mut offset = 0u64;
        let mut piece = vec![0u8; len.min(64 << 20) as usize];
        while offset < len {
            let take = (len - offset).min(piece.len() as u64) as usize;
            fill(offset, &mut piece[..take]);
            // SAFETY: `ptr + offset .. + take` lies inside the allocation of `len` bytes at `ptr`; the stream is
            // synchronised before `piece` is written again.
            unsafe { result::memcpy_htod_async(ptr + offset, &piece[..take], self.stream.cu_stream()) }
                .map_err(|error| driver("cuMemcpyHtoD", error))?;
            self.stream.synchronize().map_err(|error| driver("cuStreamSynchronize", error))?;
            offset += take as u64;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes of `region` from `offset` on into `out`, after everything on the stream.
    fn read_region(&self, region: &Region, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        let end = offset.checked_add(out.len() as u64);
        if end.is_none_or(|end| end > region.len) {
            return Err(SeamError::OutOfRange { offset, len: out.len() as u64, region_len: region.len });
        }
        // Every engine's stream: writes into the region from any of them come first.
        self.ctx.synchronize().map_err(|error| driver("cuCtxSynchronize", error))?;
        // SAFETY: the range lies inside the region's live allocation (checked above); the stream is synchronised
        // before `out` is used.
        unsafe { result::memcpy_dtoh_async(out, region.ptr + offset, self.stream.cu_stream()) }
            .map_err(|error| driver("cuMemcpyDtoH", error))?;
        self.stream.synchronize().map_err(|error| driver("cuStreamSynchronize", error))
    }

    /// Keeps `region` on the device for the oracle's compare kernel (after every launch and fill that writes
    /// registered memory ran, [`Shared::settle_writes`]): no engine may write it any more.
    fn keep_region(self: &Arc<Self>, region: Region) -> Result<Kept, SeamError> {
        if let Err(error) = self.settle_writes() {
            self.forget(region.ptr, region.len);
            return Err(driver("cuStreamSynchronize", error));
        }
        let mut state = self.state();
        state.live.remove(&region.ptr);
        state.resident.insert(region.ptr, region.len);
        drop(state);
        self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let (handle, len) = (region.ptr, region.len);
        let keep = Holder { shared: self.clone(), region: Some(region) };
        Ok(Kept { compare: Arc::new(DeviceCompare(self.clone())), handle, len, keep: Arc::new(keep) })
    }

    /// Uploads `table` (24 bytes an item) to a fresh device buffer on `stream`.
    fn upload(stream: &Arc<CudaStream>, table: &[u64]) -> Result<CudaSlice<u64>, SeamError> {
        stream.clone_htod(table).map_err(|error| driver("cuMemcpyHtoDAsync", error))
    }
}

/// The `cuda` fabric as a [`Transport`]: engines sharing one GPU.
pub struct CudaTransport {
    shared: Arc<Shared>,
    name: String,
}

impl std::fmt::Debug for CudaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaTransport({}, GPU {})", self.name, self.shared.gpu)
    }
}

impl CudaTransport {
    /// Opens GPU `$KVRELAY_CUDA_DEVICE` (default 0) and compiles the kernels (once per process and GPU); an error
    /// names what is missing.
    pub fn new() -> Result<CudaTransport, TransportError> {
        let gpu = match std::env::var(DEVICE_ENV) {
            Ok(text) if !text.trim().is_empty() => text.trim().parse::<u32>().map_err(|_| {
                TransportError::Unavailable(format!("{DEVICE_ENV}={text} is not a GPU ordinal (fix: 0, 1, ...)"))
            })?,
            _ => 0,
        };
        let device = Device::open(gpu).map_err(TransportError::Unavailable)?;
        let name = device.ctx.name().unwrap_or_else(|_| "unknown GPU".to_owned());
        let shared = Shared {
            ctx: device.ctx.clone(),
            stream: device.stream.clone(),
            gather: device.gather.clone(),
            strided: device.strided.clone(),
            paged: device.paged.clone(),
            fill: device.fill.clone(),
            judge: device.judge.clone(),
            judge_rows: device.judge_rows.clone(),
            state: Mutex::default(),
            generation: 0.into(),
            gpu,
            device,
        };
        Ok(CudaTransport { shared: Arc::new(shared), name })
    }

    /// The most device memory this process's engines held at once on this GPU since the last
    /// [`CudaTransport::reset_peak`], in bytes (regions, kept regions and the allocations kept for their reuse; not
    /// descriptor tables).
    pub fn peak_bytes(&self) -> u64 {
        self.shared.device.peak.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Device memory free on this GPU now, in bytes, counting the allocations kept for reuse ([`Spares`]).
    pub fn free_bytes(&self) -> u64 {
        let spare = self.shared.device.spares().bytes();
        self.shared.ctx.mem_get_info().map_or(0, |(free, _)| free as u64) + spare
    }

    /// What the oracle's compares on this GPU cost since the last call (which starts them over).
    pub fn judge_stats(&self) -> JudgeStats {
        self.shared.device.judged.take()
    }

    /// Patterns generated and reused, and the waits for the GPU, since the last call ([`DeviceStats`]).
    pub fn device_stats(&self) -> DeviceStats {
        use std::sync::atomic::Ordering::Relaxed;
        let counters = &self.shared.device.counters;
        DeviceStats {
            patterns: counters.patterns.swap(0, Relaxed),
            reused_patterns: counters.reused_patterns.swap(0, Relaxed),
            waits: counters.waits.swap(0, Relaxed),
            wait_seconds: counters.wait_ns.swap(0, Relaxed) as f64 / 1e9,
        }
    }

    /// Starts the peak over from what is held now.
    pub fn reset_peak(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.shared.device.peak.store(self.shared.device.allocated.load(Relaxed), Relaxed);
    }

    /// A fresh engine for `node` as its own type (one a thread of its own can drive: ranks submit concurrently, as
    /// ranks in their own processes do).
    pub fn cuda_engine(&self, node: NodeId) -> CudaEngine {
        CudaEngine::new(node, self.shared.clone())
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Measures, on this GPU: device-to-device copy (GB/s of payload over `bytes`), pinned host-to-device copy, and
    /// the gather kernel and compare kernel over `rows` rows of `row` bytes scattered by a fixed permutation
    /// (GB/s of payload). For `kvrelay bench --fabric cuda`: the ceilings measured in the same run.
    pub fn ceilings(&self, bytes: u64, row: u64) -> Result<Ceilings, SeamError> {
        ceilings(&self.shared, bytes, row)
    }
}

/// What a region starts with.
pub enum Contents<'a> {
    /// A pattern, generated on the device.
    Pattern(Pattern),
    /// Arbitrary bytes, uploaded.
    Fill(&'a Fill),
}

/// Device memory of one GPU for another transfer engine's registrations (NIXL on VRAM): allocations whose contents
/// are generated on the device, read back through it, and kept there for the oracle's compare kernel, exactly as
/// the `cuda` fabric's own regions.
#[derive(Clone)]
pub struct Gpu(Arc<Shared>);

impl Gpu {
    /// GPU `$KVRELAY_CUDA_DEVICE` (default 0), as [`CudaTransport::new`] opens it.
    pub fn open() -> Result<Gpu, TransportError> {
        Ok(Gpu(CudaTransport::new()?.shared))
    }

    /// The GPU's ordinal on this host.
    pub fn ordinal(&self) -> u32 {
        self.0.gpu
    }

    /// The GPU's name.
    pub fn name(&self) -> String {
        self.0.ctx.name().unwrap_or_else(|_| "unknown GPU".to_owned())
    }

    /// `len` bytes of device memory holding `contents`, complete when this returns (another engine may use it at
    /// once, on its own streams).
    pub fn alloc(&self, len: u64, contents: Contents<'_>) -> Result<DeviceBuffer, SeamError> {
        let region = self.0.make_region(len, 0, contents)?;
        let buffer = DeviceBuffer { shared: self.0.clone(), region: Some(region) };
        self.0.stream.synchronize().map_err(|error| driver("cuStreamSynchronize", error))?;
        Ok(buffer)
    }
}

/// One allocation made through [`Gpu::alloc`]: freed when dropped.
pub struct DeviceBuffer {
    shared: Arc<Shared>,
    region: Option<Region>,
}

impl DeviceBuffer {
    fn region(&self) -> &Region {
        self.region.as_ref().expect("a buffer holds its region until dropped or kept")
    }

    /// Its device address.
    pub fn addr(&self) -> u64 {
        self.region().ptr
    }

    /// Copies `out.len()` bytes from `offset` on into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        self.shared.read_region(self.region(), offset, out)
    }

    /// Keeps the memory on the device for the oracle's compare ([`Kept`]); no engine may write it any more.
    pub fn keep(mut self) -> Result<Kept, SeamError> {
        let region = self.region.take().expect("a buffer holds its region until dropped or kept");
        // Another engine's copies (NIXL's UCX, on streams of its own in this context) are not counted launches:
        // the whole context is waited for.
        if let Err(error) = self.shared.device.timed(|| self.shared.ctx.synchronize()) {
            self.shared.forget(region.ptr, region.len);
            return Err(driver("cuCtxSynchronize", error));
        }
        self.shared.keep_region(region)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(mut region) = self.region.take() {
            self.shared.forget(region.ptr, region.len);
            region.written(); // another engine (NIXL) had it
        }
    }
}

/// One GPU's context, streams and compiled kernels, made once per process (NVRTC takes 20 to 300 ms).
struct Device {
    /// Bytes of device memory this process's engines hold now, and at most so far.
    allocated: std::sync::atomic::AtomicU64,
    peak: std::sync::atomic::AtomicU64,
    /// What the oracle's compares cost on this GPU since the last [`CudaTransport::judge_stats`] reset.
    judged: JudgeCounters,
    /// Regions' allocations handed back, by size, for the next region of the same size ([`Device::reuse`]).
    spares: Mutex<Spares>,
    /// Patterns generated and reused, and the waits for the GPU ([`CudaTransport::device_stats`]).
    counters: Counters,
    /// Patterns and sentinels put on `stream` so far (by any transport on this GPU: they share the stream), and how
    /// many of them a `cuStreamSynchronize` has seen finish: a registration returns once its fill is queued, and an
    /// engine's first launch after it waits for every fill ([`Shared::settle_fills`]), once for a wave of
    /// registrations rather than once a region.
    fills: std::sync::atomic::AtomicU64,
    fills_settled: std::sync::atomic::AtomicU64,
    /// Launches and fills that write registered memory, counted as they are queued, and how many of them a
    /// synchronisation of every engine stream has seen finish ([`Shared::settle_writes`]).
    launches: std::sync::atomic::AtomicU64,
    launches_settled: std::sync::atomic::AtomicU64,
    /// Every stream an engine was given (the pool below holds the idle ones): what a keep waits for.
    engine_streams: Mutex<Vec<Arc<CudaStream>>>,
    /// Streams and descriptor-table buffers of engines gone, for the next engines (a replay's waves make new ones;
    /// `cuStreamCreate`, `cuMemHostAlloc` and `cuMemAlloc` on the doorbell's path cost more than a launch).
    streams: Mutex<Vec<Arc<CudaStream>>>,
    tables: Mutex<Vec<Staging>>,
    /// The oracle's compare slots (a stream and its buffers each), one taken per call: the harness judges decode
    /// ranks on several threads, and their compares run side by side on the GPU.
    judges: Mutex<Vec<JudgeSlot>>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gather: CudaFunction,
    strided: CudaFunction,
    paged: CudaFunction,
    fill: CudaFunction,
    judge: CudaFunction,
    judge_rows: CudaFunction,
}

/// The oracle's compares on one GPU, counted as they run (atomics: the harness judges ranks on several threads).
#[derive(Default)]
struct JudgeCounters {
    calls: std::sync::atomic::AtomicU64,
    checks: std::sync::atomic::AtomicU64,
    entries: std::sync::atomic::AtomicU64,
    table_ns: std::sync::atomic::AtomicU64,
    device_ns: std::sync::atomic::AtomicU64,
    /// From the first call's start to the last call's answers.
    span: Mutex<Option<(std::time::Instant, std::time::Instant)>>,
}

impl JudgeCounters {
    /// One call: its checks and entries, and its start, end of table building, and answers.
    fn add(&self, checks: usize, entries: usize, [began, built, answered]: [std::time::Instant; 3]) {
        use std::sync::atomic::Ordering::Relaxed;
        let (table, device) = (built - began, answered - built);
        let mut span = self.span.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *span = Some(span.map_or((began, answered), |(first, last)| (first.min(began), last.max(answered))));
        drop(span);
        self.calls.fetch_add(1, Relaxed);
        self.checks.fetch_add(checks as u64, Relaxed);
        self.entries.fetch_add(entries as u64, Relaxed);
        self.table_ns.fetch_add(table.as_nanos() as u64, Relaxed);
        self.device_ns.fetch_add(device.as_nanos() as u64, Relaxed);
    }

    fn take(&self) -> JudgeStats {
        use std::sync::atomic::Ordering::Relaxed;
        JudgeStats {
            calls: self.calls.swap(0, Relaxed),
            checks: self.checks.swap(0, Relaxed),
            entries: self.entries.swap(0, Relaxed),
            table_seconds: self.table_ns.swap(0, Relaxed) as f64 / 1e9,
            device_seconds: self.device_ns.swap(0, Relaxed) as f64 / 1e9,
            span_seconds: self
                .span
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take()
                .map_or(0.0, |(first, last)| (last - first).as_secs_f64()),
        }
    }
}

/// What the oracle's compares cost: calls, checks asked, table entries (checks cut into pieces), seconds building
/// tables on the host and seconds from the upload to the answers (summed over threads).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JudgeStats {
    pub calls: u64,
    pub checks: u64,
    pub entries: u64,
    pub table_seconds: f64,
    pub device_seconds: f64,
    /// From the first call's start to the last call's answers (wall clock, the calls overlapping).
    pub span_seconds: f64,
}

/// Counted as regions are registered and engines wait for the GPU (atomics: engines on several threads).
#[derive(Default)]
struct Counters {
    patterns: std::sync::atomic::AtomicU64,
    reused_patterns: std::sync::atomic::AtomicU64,
    waits: std::sync::atomic::AtomicU64,
    wait_ns: std::sync::atomic::AtomicU64,
}

/// Since the last [`CudaTransport::device_stats`]: source patterns and sentinels generated on the device, source
/// patterns found still in place in a spare allocation (nothing generated), and the host's waits for the GPU
/// (`cuCtxSynchronize` or `cuStreamSynchronize` before a reuse, a launch after fills, or keeping memory for the
/// oracle) with the seconds they took.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceStats {
    pub patterns: u64,
    pub reused_patterns: u64,
    pub waits: u64,
    pub wait_seconds: f64,
}

/// A device opened, or why it could not be.
type Opened = Result<Arc<Device>, String>;

/// The devices opened so far, by ordinal.
static DEVICES: std::sync::OnceLock<Mutex<BTreeMap<u32, Opened>>> = std::sync::OnceLock::new();

impl Device {
    fn spares(&self) -> MutexGuard<'_, Spares> {
        self.spares.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A spare allocation of exactly `size` bytes that nothing on the GPU still uses, one holding pattern
    /// `want` first (`true`: it does): where only spares whose last kernel may still run are kept, the context is
    /// synchronised once for all of them (a freed allocation's `cuMemFree` would have waited for its last kernel).
    fn reuse(&self, size: usize, want: Option<Pattern>) -> Result<Option<(u64, bool)>, SeamError> {
        let busy = match self.spares().take(size, want) {
            Found::Spare { ptr, filled } => return Ok(Some((ptr, filled))),
            Found::None => return Ok(None),
            Found::Busy(busy) => busy,
        };
        let synchronised = self.timed(|| self.ctx.synchronize());
        let mut spares = self.spares();
        spares.settled(busy, synchronised.is_ok());
        synchronised.map_err(|error| driver("cuCtxSynchronize", error))?;
        Ok(match spares.take(size, want) {
            Found::Spare { ptr, filled } => Some((ptr, filled)),
            Found::Busy(busy) => {
                spares.settled(busy, false); // another thread took the idle ones meanwhile: a fresh allocation
                None
            }
            Found::None => None,
        })
    }

    /// Frees every spare allocation (after everything on the GPU finished); the bytes freed.
    fn release_spares(&self) -> u64 {
        let (ptrs, bytes) = self.spares().drain();
        if bytes == 0 || self.ctx.bind_to_thread().is_err() {
            return 0;
        }
        for ptr in ptrs {
            // SAFETY: `ptr` came from cuMemAlloc in `Shared::alloc`, no region holds it (its `DeviceAlloc` was
            // dropped), and it is freed once, here; cuMemFree waits for work still using it.
            let _ = unsafe { result::free_sync(ptr) };
        }
        self.account(-(bytes as i64));
        bytes
    }

    /// `synchronise` (a `cuCtxSynchronize` or `cuStreamSynchronize`), counted with the time it waited.
    #[allow(clippy::disallowed_methods, reason = "the fabric times its own waits for the replay's breakdown")]
    fn timed<E>(&self, synchronise: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        use std::sync::atomic::Ordering::Relaxed;
        let start = std::time::Instant::now();
        let outcome = synchronise();
        self.counters.waits.fetch_add(1, Relaxed);
        self.counters.wait_ns.fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
        outcome
    }

    /// A stream for a new engine: one an engine gone left, or a new one.
    fn take_stream(&self) -> Option<Arc<CudaStream>> {
        let kept = self.streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        kept.or_else(|| {
            let stream = self.ctx.new_stream().ok()?;
            self.engine_streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(stream.clone());
            Some(stream)
        })
    }

    /// Counts a launch or fill about to be queued that writes registered memory ([`Shared::settle_writes`]).
    fn launched(&self) {
        self.launches.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// The smallest descriptor-table buffer an engine gone left holding at least `words` words, else a new one.
    fn take_table(&self, words: usize) -> Result<Staging, SeamError> {
        let mut tables = self.tables.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let best = tables
            .iter()
            .enumerate()
            .filter(|(_, staging)| staging.words >= words)
            .min_by_key(|(_, staging)| staging.words)
            .map(|(index, _)| index);
        match best {
            Some(index) => Ok(tables.swap_remove(index)),
            None => {
                drop(tables);
                Staging::new(&self.ctx, words)
            }
        }
    }

    /// An engine's stream and table buffers, once the last launch that read each buffer finished.
    fn give_back(&self, stream: Arc<CudaStream>, tables: Vec<Staging>) {
        let mut idle = Vec::with_capacity(tables.len());
        for mut staging in tables {
            if staging.reserved || staging.busy.take().is_some_and(|event| event.synchronize().is_err()) {
                continue; // a launch that failed may still read it: dropped (freed after its event) instead
            }
            idle.push(staging);
        }
        self.tables.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(idle);
        self.streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(stream);
    }

    /// Adds `bytes` (negative: frees) to the memory this process holds on the GPU, raising its peak.
    fn account(&self, bytes: i64) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = if bytes >= 0 {
            self.allocated.fetch_add(bytes as u64, Relaxed) + bytes as u64
        } else {
            let freed = bytes.unsigned_abs();
            self.allocated.fetch_sub(freed, Relaxed).saturating_sub(freed)
        };
        self.peak.fetch_max(now, Relaxed);
    }

    fn open(gpu: u32) -> Result<Arc<Device>, String> {
        let devices = DEVICES.get_or_init(Mutex::default);
        let mut devices = devices.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        devices.entry(gpu).or_insert_with(|| Device::start(gpu).map(Arc::new)).clone()
    }

    fn start(gpu: u32) -> Result<Device, String> {
        let unavailable = |what: &str, error: String| {
            format!(
                "{what}: {error} (fix: run on a machine with an NVIDIA GPU, its driver and CUDA 13's libnvrtc; {DEVICE_ENV} picks the GPU)"
            )
        };
        let ctx = quietly(|| CudaContext::new(gpu as usize))
            .map_err(|error| unavailable(&format!("no CUDA device {gpu}"), error))?
            .map_err(|error| unavailable(&format!("no CUDA device {gpu}"), format!("{error:?}")))?;
        // SAFETY: one stream per purpose and no slice shared across streams: nothing for cudarc's events to order.
        unsafe { ctx.disable_event_tracking() };
        let ptx = quietly(|| cudarc::nvrtc::compile_ptx(KERNELS))
            .map_err(|error| unavailable("NVRTC did not load", error))?
            .map_err(|error| unavailable("the kernels did not compile", format!("{error:?}")))?;
        let module =
            ctx.load_module(ptx).map_err(|error| unavailable("the kernels did not load", format!("{error:?}")))?;
        let function = |name: &str| {
            module.load_function(name).map_err(|error| unavailable(&format!("kernel {name}"), format!("{error:?}")))
        };
        let (gather, fill, judge) = (function("kv_gather")?, function("kv_fill_source")?, function("kv_judge")?);
        let (strided, paged, judge_rows) = (function("kv_strided")?, function("kv_paged")?, function("kv_judge_rows")?);
        let stream = ctx.new_stream().map_err(|error| unavailable("no stream", format!("{error:?}")))?;
        let (allocated, peak) = (0.into(), 0.into());
        let judged = JudgeCounters::default();
        Ok(Device {
            allocated,
            peak,
            judged,
            spares: Mutex::default(),
            counters: Counters::default(),
            fills: 0.into(),
            fills_settled: 0.into(),
            launches: 0.into(),
            launches_settled: 0.into(),
            engine_streams: Mutex::default(),
            streams: Mutex::default(),
            tables: Mutex::default(),
            judges: Mutex::default(),
            ctx,
            stream,
            gather,
            strided,
            paged,
            fill,
            judge,
            judge_rows,
        })
    }
}

/// Runs `call` with the panic hook silenced: cudarc's dynamic loading panics when a library is missing, which is a
/// machine without a GPU, an error here, not a crash.
fn quietly<T>(call: impl FnOnce() -> T + std::panic::UnwindSafe) -> Result<T, String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(call);
    std::panic::set_hook(hook);
    outcome.map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|text| (*text).to_owned()))
            .map_or_else(
                || "the CUDA libraries did not load".to_owned(),
                // cudarc lists every library name it tried: the first clause says what is missing.
                |text| text.split(" - searched").next().unwrap_or_default().to_owned(),
            )
    })
}

impl Transport for CudaTransport {
    fn identity(&self) -> Identity {
        let mut identity =
            Identity { name: "cuda".to_owned(), version: "cudarc 0.19.10".to_owned(), ..Identity::default() };
        let facts = &mut identity.facts;
        facts.insert("device".to_owned(), format!("GPU {}: {}", self.shared.gpu, self.name));
        if let Ok((major, minor)) = self.shared.ctx.compute_capability() {
            facts.insert("compute_capability".to_owned(), format!("{major}.{minor}"));
        }
        if let Ok(total) = self.shared.ctx.total_mem() {
            facts.insert("memory".to_owned(), format!("{} GiB", total >> 30));
        }
        facts.insert("memory_kind".to_owned(), MemoryKind::Device { gpu: self.shared.gpu }.to_string());
        identity
    }

    fn verbs(&self) -> bool {
        false
    }

    fn engine(&mut self, node: NodeId, _caps: Caps) -> Result<Box<dyn TransferEngine>, TransportError> {
        Ok(Box::new(self.cuda_engine(node)))
    }

    fn step(&mut self) {
        std::thread::sleep(Duration::from_micros(200));
    }

    fn settle(&mut self) {
        let _ = self.shared.ctx.synchronize();
    }

    fn reset(&mut self) {
        let _ = self.shared.ctx.synchronize();
        self.shared.state().mail.clear();
    }
}

/// One `cuMemAlloc` allocation: a region's goes back to its GPU's spares when dropped (`spare`), any other is freed
/// (with its context current).
struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: u64,
    spare: Option<SpareOf>,
}

/// Where a region's allocation goes when dropped: its GPU's spares, as `size` bytes still holding pattern `holds`
/// (set for a generated source pattern until anything may have written it, and for the sentinel a kept region is
/// reset to when the oracle hands it back), `idle` where its last use on the GPU is known to have finished.
struct SpareOf {
    device: Arc<Device>,
    size: usize,
    holds: Option<Pattern>,
    idle: bool,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if let Some(SpareOf { device, size, holds, idle }) = self.spare.take() {
            device.spares().keep(size, Spare { ptr: self.ptr, holds }, idle);
        } else if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in `Shared::alloc` and is freed once, here; cuMemFree waits for
            // work still using it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A region this engine registered.
struct Region {
    allocation: DeviceAlloc,
    ptr: u64,
    len: u64,
}

impl Region {
    /// Something may have written the region (a peer was told of it, a test may plant a byte, another engine had
    /// it): its allocation no longer holds its pattern when handed back.
    fn written(&mut self) {
        self.holds(None);
    }

    /// What the region's allocation holds when handed back.
    fn holds(&mut self, pattern: Option<Pattern>) {
        if let Some(spare) = &mut self.allocation.spare {
            spare.holds = pattern;
        }
    }

    /// Nothing on the GPU can still use the region (its last use was waited for): its allocation is reused with no
    /// synchronisation.
    fn idle(&mut self) {
        if let Some(spare) = &mut self.allocation.spare {
            spare.idle = true;
        }
    }
}
