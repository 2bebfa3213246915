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

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use super::seam::{
    Batch, BatchId, BatchStatus, Cancelled, Check, Compare, Completion, ConnId, Event, Fill, Image, Kept, Landed,
    Memory, MemoryKind, NodeId, Pattern, PeerAddress, RemoteMemory, Repeat, RowRun, RowsCheck, SeamError, SeamLimits,
    TransferEngine,
};
use super::transport::{Identity, Transport, TransportError};
use super::verbs::Caps;

/// The environment variable naming the GPU (its ordinal) the fabric runs on.
pub const DEVICE_ENV: &str = "KVRELAY_CUDA_DEVICE";

/// The kernels, compiled by NVRTC when the transport starts (no toolkit needed where kvrelay is built).
const KERNELS: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
struct Copy { u64 src; u64 dst; u64 len; };
struct Check { u64 addr; u64 source; u64 len; u64 block; u64 stride; };
struct Run { u64 src; u64 dst; u64 len; u64 count; u64 src_stride; u64 dst_stride; };
struct Paged {
    u64 src; u64 src_off; u64 dst; u64 dst_off; u64 len; u64 count; u64 src_stride; u64 dst_stride;
    u64 src_table; u64 dst_table; u64 src_item; u64 dst_item; u64 first_chunk; u64 per_chunk; u64 unit;
};

#define SENTINEL 0x5E5E5E5E5E5E5E5Eull
#define LANE (threadIdx.x & 31u)
#define WARP (((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5)
#define WARPS (((u64)gridDim.x * blockDim.x) >> 5)

// One warp per descriptor, 16-byte moves where source, target and length allow, 8-byte or single bytes otherwise.
extern "C" __global__ void kv_gather(const Copy* copies, u64 count) {
    for (u64 i = WARP; i < count; i += WARPS) {
        const Copy c = copies[i];
        const u64 align = c.src | c.dst | c.len;
        if ((align & 15) == 0) {
            const uint4* s = (const uint4*)c.src; uint4* d = (uint4*)c.dst;
            for (u64 k = LANE; k < c.len / 16; k += 32) d[k] = s[k];
        } else if ((align & 7) == 0) {
            const u64* s = (const u64*)c.src; u64* d = (u64*)c.dst;
            for (u64 k = LANE; k < c.len / 8; k += 32) d[k] = s[k];
        } else {
            const unsigned char* s = (const unsigned char*)c.src; unsigned char* d = (unsigned char*)c.dst;
            for (u64 k = LANE; k < c.len; k += 32) d[k] = s[k];
        }
    }
}

// One warp per run (at most 32 KiB of a strided entry: `count` elements of `len` bytes at strides on both sides): the
// run's 16-byte words (8-byte or single bytes where addresses, strides or length are not aligned) spread over the
// lanes in element order, so consecutive lanes read and write consecutive words; four loads in flight per lane
// before their stores.
#define RUN_AT(T, base, u) ((T*)((base) + (u64)((u) / per) * stride) + (u) % per)
extern "C" __global__ void kv_strided(const Run* runs, u64 count) {
    for (u64 i = WARP; i < count; i += WARPS) {
        const Run r = runs[i];
        const u64 align = r.src | r.dst | r.len | r.src_stride | r.dst_stride;
        if ((align & 15) == 0) {
            const unsigned per = (unsigned)(r.len / 16), total = per * (unsigned)r.count;
            unsigned u = LANE;
            for (; u + 96 < total; u += 128) {
                u64 stride = r.src_stride;
                const uint4 a = *RUN_AT(const uint4, r.src, u), b = *RUN_AT(const uint4, r.src, u + 32);
                const uint4 c = *RUN_AT(const uint4, r.src, u + 64), d = *RUN_AT(const uint4, r.src, u + 96);
                stride = r.dst_stride;
                *RUN_AT(uint4, r.dst, u) = a; *RUN_AT(uint4, r.dst, u + 32) = b;
                *RUN_AT(uint4, r.dst, u + 64) = c; *RUN_AT(uint4, r.dst, u + 96) = d;
            }
            for (; u < total; u += 32) {
                u64 stride = r.src_stride;
                const uint4 a = *RUN_AT(const uint4, r.src, u);
                stride = r.dst_stride;
                *RUN_AT(uint4, r.dst, u) = a;
            }
        } else if ((align & 7) == 0) {
            const unsigned per = (unsigned)(r.len / 8), total = per * (unsigned)r.count;
            for (unsigned u = LANE; u < total; u += 32) {
                u64 stride = r.src_stride;
                const u64 a = *RUN_AT(const u64, r.src, u);
                stride = r.dst_stride;
                *RUN_AT(u64, r.dst, u) = a;
            }
        } else {
            const unsigned per = (unsigned)r.len, total = per * (unsigned)r.count;
            for (unsigned u = LANE; u < total; u += 32) {
                u64 stride = r.src_stride;
                const unsigned char a = *RUN_AT(const unsigned char, r.src, u);
                stride = r.dst_stride;
                *RUN_AT(unsigned char, r.dst, u) = a;
            }
        }
    }
}

#define RUN_BYTES 32768ull
#define CHUNK_ELEMENTS 64
#define BLOCK_WARPS 8

// Region byte of logical byte `logical` through `table` (items of `item` bytes), or physical where there is none.
__device__ __forceinline__ u64 paged_at(u64 base, const u32* table, u64 item, u64 logical) {
    return table ? base + (u64)table[logical / item] * item + logical % item : base + logical;
}

// The warp moves `total` units of T: unit u is unit u % per of element u / per, whose addresses are src[] and dst[].
template <typename T>
__device__ __forceinline__ void move_units(const u64* src, const u64* dst, unsigned per, unsigned total) {
    unsigned u = LANE;
    for (; u + 96 < total; u += 128) {
        const T a = ((const T*)src[u / per])[u % per];
        const T b = ((const T*)src[(u + 32) / per])[(u + 32) % per];
        const T c = ((const T*)src[(u + 64) / per])[(u + 64) % per];
        const T d = ((const T*)src[(u + 96) / per])[(u + 96) % per];
        ((T*)dst[u / per])[u % per] = a;
        ((T*)dst[(u + 32) / per])[(u + 32) % per] = b;
        ((T*)dst[(u + 64) / per])[(u + 64) % per] = c;
        ((T*)dst[(u + 96) / per])[(u + 96) % per] = d;
    }
    for (; u < total; u += 32) ((T*)dst[u / per])[u % per] = ((const T*)src[u / per])[u % per];
}

// Paged and strided entries as they were submitted (one descriptor each, `count` elements at strides, offsets on a
// paged side logical bytes of its page table, the tables after the descriptors), cut on the device into chunks of
// at most CHUNK_ELEMENTS elements and RUN_BYTES bytes (an element over RUN_BYTES in pieces): one warp per chunk
// finds its descriptor by binary search over the chunk prefix, resolves its elements' addresses through the tables
// once into shared memory, then moves 16-byte words (8-byte or single bytes where anything is unaligned).
extern "C" __global__ void kv_paged(const Paged* descs, u64 n, u64 chunks) {
    __shared__ u64 addresses[BLOCK_WARPS][2][CHUNK_ELEMENTS];
    const u32* tables = (const u32*)(descs + n);
    u64* src = addresses[threadIdx.x >> 5][0];
    u64* dst = addresses[threadIdx.x >> 5][1];
    for (u64 c = WARP; c < chunks; c += WARPS) {
        u64 lo = 0, hi = n;
        while (hi - lo > 1) {
            const u64 mid = (lo + hi) / 2;
            if (descs[mid].first_chunk <= c) lo = mid; else hi = mid;
        }
        const Paged d = descs[lo];
        const u64 local = c - d.first_chunk;
        u64 first, elements, skip, bytes;
        if (d.per_chunk) {
            first = local * d.per_chunk;
            elements = d.count - first < d.per_chunk ? d.count - first : d.per_chunk;
            skip = 0;
            bytes = d.len;
        } else {
            const u64 pieces = (d.len + RUN_BYTES - 1) / RUN_BYTES;
            first = local / pieces;
            elements = 1;
            skip = (local % pieces) * RUN_BYTES;
            bytes = d.len - skip < RUN_BYTES ? d.len - skip : RUN_BYTES;
        }
        const u32* st = d.src_table ? tables + (d.src_table - 1) : 0;
        const u32* dt = d.dst_table ? tables + (d.dst_table - 1) : 0;
        __syncwarp();
        for (u64 k = LANE; k < elements; k += 32) {
            src[k] = paged_at(d.src, st, d.src_item, d.src_off + (first + k) * d.src_stride) + skip;
            dst[k] = paged_at(d.dst, dt, d.dst_item, d.dst_off + (first + k) * d.dst_stride) + skip;
        }
        __syncwarp();
        const unsigned per = (unsigned)(bytes / d.unit), total = per * (unsigned)elements;
        if (d.unit == 16) move_units<uint4>(src, dst, per, total);
        else if (d.unit == 8) move_units<u64>(src, dst, per, total);
        else move_units<unsigned char>(src, dst, per, total);
    }
}

// Source region `number`'s pattern over a whole allocation (8-byte aligned): word w is 1<<63 | number<<40 | w.
extern "C" __global__ void kv_fill_source(unsigned char* dst, u64 len, u64 number) {
    const u64 base = (1ull << 63) | (number << 40);
    const u64 words = len / 8;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 w = (u64)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += stride) ((u64*)dst)[w] = base | w;
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < len % 8) dst[words * 8 + t] = (unsigned char)((base | words) >> (8 * t));
}

__device__ __forceinline__ unsigned char expected_byte(u64 source, u64 sentinel, u64 at) {
    if (sentinel) return 0x5E;
    const u64 word = (1ull << 63) | ((source >> 40) << 40) | (at / 8);
    return (unsigned char)(word >> (8 * (at % 8)));
}

// Whether `len` bytes at `addr` are source `base`'s words from byte `offset` on (the sentinel where `sentinel`): a
// warp's lanes OR the differences they see.
__device__ __forceinline__ u64 judge_block(u64 addr, u64 offset, u64 len, u64 source, u64 sentinel) {
    const u64 base = sentinel ? 0 : ((1ull << 63) | ((source >> 40) << 40));
    u64 diff = 0;
    if (((addr | offset | len) & 15) == 0) {
        const uint4* found = (const uint4*)addr;
        for (u64 k = LANE; k < len / 16; k += 32) {
            const uint4 f = found[k];
            const u64 w0 = sentinel ? SENTINEL : (base | (offset / 8 + 2 * k));
            const u64 w1 = sentinel ? SENTINEL : (base | (offset / 8 + 2 * k + 1));
            diff |= ((((u64)f.y << 32) | f.x) ^ w0) | ((((u64)f.w << 32) | f.z) ^ w1);
        }
    } else if (((addr | offset | len) & 7) == 0) {
        const u64* found = (const u64*)addr;
        for (u64 k = LANE; k < len / 8; k += 32) diff |= found[k] ^ (sentinel ? SENTINEL : (base | (offset / 8 + k)));
    } else {
        const unsigned char* found = (const unsigned char*)addr;
        for (u64 k = LANE; k < len; k += 32) diff |= found[k] ^ expected_byte(source, sentinel, offset + k);
    }
    return diff;
}

// One warp per check: whether `len` bytes at `addr`, as blocks of `block` bytes, are source `number`'s with block k
// from byte `offset + k * stride` on (source packs number << 40 | offset), or the sentinel (len's top bit). A failing
// check sets bad[i] and *any.
extern "C" __global__ void kv_judge(const Check* checks, u64 count, u32* bad, u32* any) {
    for (u64 i = WARP; i < count; i += WARPS) {
        const Check c = checks[i];
        const u64 sentinel = c.len >> 63;
        const u64 len = c.len & ~(1ull << 63);
        const u64 offset = c.source & ((1ull << 40) - 1);
        u64 diff = 0;
        for (u64 at = 0, k = 0; at < len; at += c.block, k++) {
            diff |= judge_block(c.addr + at, offset + k * c.stride, c.block, c.source, sentinel);
        }
        if (__any_sync(0xffffffffu, diff != 0) && LANE == 0) { bad[i] = 1; *any = 1; }
    }
}

struct RowsCheck { u64 addr; u64 row; u64 source; u64 pattern_row; u64 first_run; u64 first_work; };
struct RowRun { u64 target; u64 source; u64 count; u64 step; };

// One warp per run of a table named by a check (runs cut on the host to at most PIECE_BYTES of the check's rows):
// it finds its check by binary search over the checks' first work items, then compares the run's rows, target row
// t at addr + t * row, source row s the pattern's bytes from s * pattern_row on (source packs number << 40, its top
// bit the sentinel). A failing run sets bad[check] and *any.
extern "C" __global__ void kv_judge_rows(const RowsCheck* checks, u64 n, const RowRun* runs, u64 works, u32* bad,
                                         u32* any) {
    for (u64 w = WARP; w < works; w += WARPS) {
        u64 lo = 0, hi = n;
        while (hi - lo > 1) {
            const u64 mid = (lo + hi) / 2;
            if (checks[mid].first_work <= w) lo = mid; else hi = mid;
        }
        const RowsCheck c = checks[lo];
        const RowRun r = runs[c.first_run + (w - c.first_work)];
        const u64 sentinel = c.source >> 63;
        u64 diff = 0;
        if (sentinel || (r.step == 1 && c.pattern_row == c.row)) {
            diff = judge_block(c.addr + r.target * c.row, r.source * c.pattern_row, r.count * c.row, c.source, sentinel);
        } else {
            for (u64 k = 0; k < r.count; k++) {
                const u64 at = (r.source + k * r.step) * c.pattern_row;
                diff |= judge_block(c.addr + (r.target + k) * c.row, at, c.row, c.source, sentinel);
            }
        }
        if (__any_sync(0xffffffffu, diff != 0) && LANE == 0) { bad[lo] = 1; *any = 1; }
    }
}
"#;

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

#[derive(Default)]
struct State {
    /// Live allocations by device address: (length, owning engine).
    live: BTreeMap<u64, (u64, u32)>,
    /// Resident regions handed to the oracle, by device address: their length.
    resident: BTreeMap<u64, u64>,
    /// Notifications for each engine: (its connection end, tag), in the order their batches completed.
    mail: BTreeMap<u32, VecDeque<(ConnId, u32)>>,
    next_engine: u32,
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
    /// memory between processes by emulating RDMA over TCP (`rma_am(tcp/lo)`, 0.4 GB/s).
    fn alloc(&self, len: u64, owner: u32) -> Result<(DeviceAlloc, u64), SeamError> {
        let size = usize::try_from(len.max(1)).map_err(|_| SeamError::Exhausted("device memory"))?;
        self.ctx.bind_to_thread().map_err(|error| driver("cuCtxSetCurrent", error))?;
        let ptr = match self.device.reuse(size)? {
            Some(ptr) => ptr,
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
                ptr
            }
        };
        let allocation = DeviceAlloc { ctx: self.ctx.clone(), ptr, spare: Some((self.device.clone(), size)) };
        self.state().live.insert(ptr, (len, owner));
        self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok((allocation, ptr))
    }

    /// Forgets the registration at `ptr` (its allocation goes back to the GPU's spares when its `DeviceAlloc` drops).
    fn forget(&self, ptr: u64, _len: u64) {
        self.state().live.remove(&ptr);
        self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
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
    fn make_region(&self, len: u64, owner: u32, contents: Contents<'_>) -> Result<Region, SeamError> {
        let (allocation, ptr) = self.alloc(len, owner)?;
        let filled = match contents {
            Contents::Pattern(pattern) => self.generate(ptr, len, pattern),
            Contents::Fill(fill) => self.upload_fill(ptr, len, fill),
        };
        if let Err(error) = filled {
            self.forget(ptr, len);
            return Err(error);
        }
        Ok(Region { _allocation: allocation, ptr, len })
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

    /// Keeps `region` on the device for the oracle's compare kernel (after everything on the stream ran): no
    /// engine may write it any more.
    fn keep_region(self: &Arc<Self>, region: Region) -> Result<Kept, SeamError> {
        if let Err(error) = self.ctx.synchronize() {
            self.forget(region.ptr, region.len);
            return Err(driver("cuCtxSynchronize", error));
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
        let spare = self.shared.device.spares().bytes;
        self.shared.ctx.mem_get_info().map_or(0, |(free, _)| free as u64) + spare
    }

    /// What the oracle's compares on this GPU cost since the last call (which starts them over).
    pub fn judge_stats(&self) -> JudgeStats {
        self.shared.device.judged.take()
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
        self.shared.keep_region(region)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            self.shared.forget(region.ptr, region.len);
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
}

impl JudgeCounters {
    fn add(&self, checks: usize, entries: usize, table: std::time::Duration, device: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
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
}

/// A device opened, or why it could not be.
type Opened = Result<Arc<Device>, String>;

/// The devices opened so far, by ordinal.
static DEVICES: std::sync::OnceLock<Mutex<BTreeMap<u32, Opened>>> = std::sync::OnceLock::new();

/// Device allocations no region holds, kept for the next region of the same size: a replay's waves register the
/// same regions again, and `cuMemAlloc` plus `cuMemFree` of a wave's gigabytes cost more than its writes. Each is
/// refilled (pattern, fill or sentinel) before anything reads it, as a fresh allocation is; counted in the device
/// memory the process holds (`Device::allocated`), freed when an allocation does not fit beside them.
#[derive(Default)]
struct Spares {
    by_size: BTreeMap<usize, Vec<u64>>,
    bytes: u64,
}

impl Device {
    fn spares(&self) -> MutexGuard<'_, Spares> {
        self.spares.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A spare allocation of exactly `size` bytes, once every stream finished what it still did with it (a freed
    /// allocation's last kernel may still run: `cuMemFree` would have waited for it).
    fn reuse(&self, size: usize) -> Result<Option<u64>, SeamError> {
        let ptr = {
            let mut spares = self.spares();
            let ptr = spares.by_size.get_mut(&size).and_then(Vec::pop);
            if ptr.is_some() {
                spares.bytes -= size as u64;
            }
            ptr
        };
        if ptr.is_some() {
            self.ctx.synchronize().map_err(|error| driver("cuCtxSynchronize", error))?;
        }
        Ok(ptr)
    }

    fn keep_spare(&self, ptr: u64, size: usize) {
        let mut spares = self.spares();
        spares.by_size.entry(size).or_default().push(ptr);
        spares.bytes += size as u64;
    }

    /// Frees every spare allocation (after everything on the GPU finished); the bytes freed.
    fn release_spares(&self) -> u64 {
        let spares = std::mem::take(&mut *self.spares());
        if spares.bytes == 0 || self.ctx.bind_to_thread().is_err() {
            return 0;
        }
        for (_, ptrs) in spares.by_size {
            for ptr in ptrs {
                // SAFETY: `ptr` came from cuMemAlloc in `Shared::alloc`, no region holds it (its `DeviceAlloc` was
                // dropped), and it is freed once, here; cuMemFree waits for work still using it.
                let _ = unsafe { result::free_sync(ptr) };
            }
        }
        self.account(-(spares.bytes as i64));
        spares.bytes
    }

    /// A stream for a new engine: one an engine gone left, or a new one.
    fn take_stream(&self) -> Option<Arc<CudaStream>> {
        let kept = self.streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        kept.or_else(|| self.ctx.new_stream().ok())
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

/// One `cuMemAlloc` allocation: a region's goes back to its GPU's spares when dropped (`spare`: the GPU and the
/// allocation's size), any other is freed (with its context current).
struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: u64,
    spare: Option<(Arc<Device>, usize)>,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if let Some((device, size)) = self.spare.take() {
            device.keep_spare(self.ptr, size);
        } else if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in `Shared::alloc` and is freed once, here; cuMemFree waits for
            // work still using it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A region this engine registered.
struct Region {
    _allocation: DeviceAlloc,
    ptr: u64,
    len: u64,
}

/// A connection end's peer once connected: its engine, the end it opened, its advertised memory.
#[derive(Clone)]
struct Peer {
    engine: u32,
    conn: ConnId,
    remote: Arc<[RemoteMemory]>,
}

/// A batch lowered for the GPU ([`CudaEngine::lower`]).
enum Table {
    /// Three words a copy: source, target, length.
    Flat(Vec<u64>),
    /// Six words a run: source, target, element length, count, source stride, target stride.
    Runs(Vec<u64>),
}

/// A connection end.
#[derive(Default)]
struct Conn {
    peer: Option<Peer>,
    /// Whether each of the peer's memories was registered (`None`: not looked at yet), as of a
    /// [`Shared::generation`].
    alive: Option<(u64, Vec<Option<bool>>)>,
}

/// A batch on the stream.
struct InFlight {
    conn: ConnId,
    batch: BatchId,
    /// Recorded after its launch (shared by the batches of one doorbell).
    event: Arc<CudaEvent>,
    notify: Option<(u32, ConnId, u32)>,
}

/// A descriptor table's way to the GPU, reused from doorbell to doorbell: page-locked host words (so that the upload
/// is an asynchronous DMA, not a staged copy the submitting thread waits for) and device words of the same
/// capacity. Free again once `busy`, the event recorded after the launch that read it, has completed.
struct Staging {
    host: *mut u64,
    device: DeviceAlloc,
    words: usize,
    busy: Option<Arc<CudaEvent>>,
    /// Staged for a launch whose event is not recorded yet (set by `stage`, cleared by `staged`); a buffer whose
    /// launch failed stays reserved, never rewritten while a copy may still read it.
    reserved: bool,
}

impl Staging {
    /// Page-locked host words and as many device words, for at least `words` words (the next power of two, 4,096
    /// at least).
    fn new(ctx: &Arc<CudaContext>, words: usize) -> Result<Staging, SeamError> {
        let capacity = words.max(1 << 12).next_power_of_two();
        let bytes = capacity * std::mem::size_of::<u64>();
        ctx.bind_to_thread().map_err(|error| driver("cuCtxSetCurrent", error))?;
        // SAFETY: the context is current; both allocations are freed once by `Staging`'s drop (the device words
        // through `DeviceAlloc`).
        let device = unsafe { result::malloc_sync(bytes) }.map_err(|error| driver("cuMemAlloc", error))?;
        let device = DeviceAlloc { ctx: ctx.clone(), ptr: device, spare: None };
        // SAFETY: as above; the page-locked words are freed once by `Staging`'s drop.
        let host = unsafe { result::malloc_host(bytes, 0) }.map_err(|error| driver("cuMemHostAlloc", error))?;
        Ok(Staging { host: host.cast(), device, words: capacity, busy: None, reserved: false })
    }

    /// The page-locked words, for a caller that waited for every copy that reads or writes them.
    fn host(&mut self) -> &mut [u64] {
        // SAFETY: `host` holds `words` page-locked words owned by this value; `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.words) }
    }
}

// SAFETY: `host` is page-locked memory owned by this value alone (allocated in `CudaEngine::stage`, freed once in
// `drop`); nothing else holds the pointer.
unsafe impl Send for Staging {}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(event) = &self.busy {
            let _ = event.synchronize();
        }
        if self.device.ctx.bind_to_thread().is_ok() {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once, here, after the last launch that read it.
            let _ = unsafe { result::free_host(self.host.cast()) };
        }
    }
}

/// Descriptors of the paged kernel (15 words each: source, source offset, target, target offset, element length,
/// count, strides, tables (1 + their u32 index after the descriptors; 0 for none), item lengths, first chunk,
/// elements per chunk (0: an element in pieces), unit), the page tables after them, and the chunks so far.
#[derive(Default)]
struct PagedQueue {
    words: Vec<u64>,
    tables: Vec<u32>,
    chunks: u64,
}

/// Words of one descriptor of the paged kernel.
const PAGED_WORDS: usize = 15;
/// Elements of one chunk of the paged kernel, at most (its shared memory holds their addresses).
const CHUNK_ELEMENTS: u64 = 64;

/// A batch whose runs wait for the doorbell: its connection, id and notification.
type Queued = (ConnId, BatchId, Option<(u32, ConnId, u32)>);

/// One rank's engine on the `cuda` fabric.
pub struct CudaEngine {
    node: NodeId,
    id: u32,
    shared: Arc<Shared>,
    /// This engine's own stream: its batches run there, beside other engines' (each rank its own queue, as ranks in
    /// their own processes have).
    stream: Arc<CudaStream>,
    regions: BTreeMap<u32, Region>,
    next_region: u32,
    conns: BTreeMap<ConnId, Conn>,
    in_flight: VecDeque<InFlight>,
    /// Runs of strided batches submitted since the last doorbell ([`CudaEngine::ring`]), and those batches.
    queued: Vec<u64>,
    queued_batches: Vec<Queued>,
    /// Paged batches' descriptors, their page tables and chunks since the last doorbell.
    paged: PagedQueue,
    ready: VecDeque<Event>,
    next_batch: u64,
    operations: u64,
    /// Descriptor tables' buffers, reused ([`Staging`]).
    staging: Vec<Staging>,
}

impl CudaEngine {
    fn new(node: NodeId, shared: Arc<Shared>) -> CudaEngine {
        let id = {
            let mut state = shared.state();
            state.next_engine += 1;
            let id = state.next_engine;
            state.mail.insert(id, VecDeque::new());
            id
        };
        let stream = shared.device.take_stream().unwrap_or_else(|| shared.stream.clone());
        CudaEngine {
            node,
            id,
            stream,
            shared,
            regions: BTreeMap::new(),
            next_region: 0,
            conns: BTreeMap::new(),
            in_flight: VecDeque::new(),
            queued: Vec::new(),
            queued_batches: Vec::new(),
            paged: PagedQueue::default(),
            ready: VecDeque::new(),
            next_batch: 0,
            operations: 0,
            staging: Vec::new(),
        }
    }

    /// `words` on their way to the GPU on this engine's stream, through a free staging buffer (a new one, of the next
    /// power of two words, when none is free and large enough): its index and the device address the kernel reads.
    fn stage(&mut self, words: &[u64]) -> Result<(usize, u64), SeamError> {
        let free = self.staging.iter().position(|staging| {
            !staging.reserved
                && staging.words >= words.len()
                && staging.busy.as_ref().is_none_or(|event| event.is_complete())
        });
        let index = match free {
            Some(index) => index,
            None => {
                self.staging.push(self.shared.device.take_table(words.len())?);
                self.staging.len() - 1
            }
        };
        let staging = &mut self.staging[index];
        // SAFETY: `host` holds `staging.words >= words.len()` words, and no copy reads them any more (its last
        // launch's event completed, or it never had one).
        let host = unsafe { std::slice::from_raw_parts_mut(staging.host, words.len()) };
        host.copy_from_slice(words);
        // SAFETY: the device words hold as many; the host words stay untouched until `busy` completes.
        unsafe { result::memcpy_htod_async(staging.device.ptr, &*host, self.stream.cu_stream()) }
            .map_err(|error| driver("cuMemcpyHtoDAsync", error))?;
        staging.busy = None;
        staging.reserved = true;
        Ok((index, staging.device.ptr))
    }

    /// Marks the staging buffers `used` busy until `event`.
    fn staged(&mut self, used: &[Option<usize>], event: &Arc<CudaEvent>) {
        for index in used.iter().flatten() {
            let staging = &mut self.staging[*index];
            staging.busy = Some(event.clone());
            staging.reserved = false;
        }
    }

    fn region(&self, memory: &Memory) -> Result<&Region, SeamError> {
        self.regions.get(&memory.id).ok_or(SeamError::UnknownMemory(memory.id))
    }

    fn add_region(&mut self, region: Region) -> Memory {
        let id = self.next_region;
        self.next_region += 1;
        let (addr, len) = (region.ptr, region.len);
        self.regions.insert(id, region);
        Memory { id, kind: MemoryKind::Device { gpu: self.shared.gpu }, addr, len, key: self.id }
    }

    /// The copies of `batch` appended to `table` for the GPU, checked against this engine's regions and the peer's
    /// advertised memory (a remote range outside it, or memory no longer registered, is the completion status
    /// instead, and `table` is left as it was). A flat batch: (source address, target address, length) per copy,
    /// each at most `piece` bytes; a batch with strided entries: (source, target, element length, count, source
    /// stride, target stride) per run of at most [`RUN_BYTES`], an element longer than that cut into pieces.
    fn lower(
        &self,
        peer: &Peer,
        alive: &[bool],
        batch: &Batch,
        piece: u64,
        table: &mut Vec<u64>,
    ) -> Result<Result<(), BatchStatus>, SeamError> {
        let strided = batch.strided();
        let before = table.len();
        table.reserve(batch.entries.len() * if strided { 6 } else { 3 });
        let failed = |table: &mut Vec<u64>, status| {
            table.truncate(before);
            Ok(Err(status))
        };
        // Entries of one batch mostly name the same few regions: each is looked up once. `alive`: whether each of the
        // peer's memories is still registered.
        let mut local: Option<(u32, &Region)> = None;
        for entry in &batch.entries {
            let region = match local {
                Some((id, region)) if id == entry.local => region,
                _ => {
                    let Some(region) = self.regions.get(&entry.local) else {
                        table.truncate(before);
                        return Err(SeamError::UnknownMemory(entry.local));
                    };
                    local = Some((entry.local, region));
                    region
                }
            };
            if entry.local_end().is_none_or(|end| end > region.len) {
                return failed(table, BatchStatus::LocalProtection);
            }
            let index = entry.remote as usize;
            let Some(target) = peer.remote.get(index).copied().filter(|_| alive[index]) else {
                return failed(table, BatchStatus::RemoteAccess);
            };
            if entry.remote_end().is_none_or(|end| end > target.len) {
                return failed(table, BatchStatus::RemoteAccess);
            }
            let (src, dst, len) = (region.ptr + entry.local_offset, target.addr + entry.remote_offset, entry.len);
            let Repeat { count, local_stride, remote_stride } = entry.repeat;
            if !strided {
                let mut done = 0;
                while done < len {
                    let take = (len - done).min(piece);
                    table.extend([src + done, dst + done, take]);
                    done += take;
                }
            } else if len > RUN_BYTES {
                for k in 0..count {
                    let (src, dst) = (src + k * local_stride, dst + k * remote_stride);
                    let mut done = 0;
                    while done < len {
                        let take = (len - done).min(RUN_BYTES);
                        table.extend([src + done, dst + done, take, 1, 0, 0]);
                        done += take;
                    }
                }
            } else if let Some(per_run) = RUN_BYTES.checked_div(len) {
                let per_run = per_run.max(1);
                let mut k = 0;
                while k < count {
                    let take = (count - k).min(per_run);
                    table.extend([
                        src + k * local_stride,
                        dst + k * remote_stride,
                        len,
                        take,
                        local_stride,
                        remote_stride,
                    ]);
                    k += take;
                }
            }
        }
        Ok(Ok(()))
    }

    /// The entries of a paged `batch` appended to the paged queue, checked like [`CudaEngine::lower`] (a paged side:
    /// every item its table lists inside the region; the batch's offsets were checked against the tables at
    /// submit); the status instead where a range is outside, and the queue left as it was.
    fn lower_paged(
        &self,
        peer: &Peer,
        alive: &[bool],
        batch: &Batch,
        queue: &mut PagedQueue,
    ) -> Result<Result<(), BatchStatus>, SeamError> {
        let (words, tables, chunks) = (queue.words.len(), queue.tables.len(), queue.chunks);
        let reset = |queue: &mut PagedQueue| {
            queue.words.truncate(words);
            queue.tables.truncate(tables);
            queue.chunks = chunks;
        };
        let failed = |queue: &mut PagedQueue, status| {
            reset(queue);
            Ok(Err(status))
        };
        // Each table the batch carries, once: where it starts in the queue's tables (plus one), and its reach.
        let mut placed: Vec<Option<(u64, u64)>> = vec![None; batch.tables.len()];
        let mut place = |queue: &mut PagedQueue, index: Option<u32>| -> Option<(u64, u64, u64)> {
            let index = index? as usize;
            let table = &batch.tables[index];
            let (at, reach) = *placed[index].get_or_insert_with(|| {
                let at = queue.tables.len() as u64 + 1;
                queue.tables.extend(&table.pages);
                (at, table.reach().unwrap_or(u64::MAX))
            });
            Some((at, reach, table.item_len))
        };
        for entry in &batch.entries {
            let Some(region) = self.regions.get(&entry.local) else {
                reset(queue);
                return Err(SeamError::UnknownMemory(entry.local));
            };
            let index = entry.remote as usize;
            let Some(target) = peer.remote.get(index).copied().filter(|_| alive[index]) else {
                return failed(queue, BatchStatus::RemoteAccess);
            };
            let local = place(queue, entry.paging.local);
            let remote = place(queue, entry.paging.remote);
            let local_end = local.map_or(entry.local_end(), |(_, reach, _)| Some(reach));
            if local_end.is_none_or(|end| end > region.len) {
                return failed(queue, BatchStatus::LocalProtection);
            }
            let remote_end = remote.map_or(entry.remote_end(), |(_, reach, _)| Some(reach));
            if remote_end.is_none_or(|end| end > target.len) {
                return failed(queue, BatchStatus::RemoteAccess);
            }
            let Repeat { count, local_stride, remote_stride } = entry.repeat;
            let (len, src, dst) = (entry.len, region.ptr, target.addr);
            if len == 0 || count == 0 {
                continue;
            }
            let (local_table, local_item) = local.map_or((0, 0), |(at, _, item)| (at, item));
            let (remote_table, remote_item) = remote.map_or((0, 0), |(at, _, item)| (at, item));
            let align = src | dst | entry.local_offset | entry.remote_offset | len | local_item | remote_item;
            let align = align | if count > 1 { local_stride | remote_stride } else { 0 };
            let unit = if align % 16 == 0 {
                16
            } else if align % 8 == 0 {
                8
            } else {
                1
            };
            let (per_chunk, chunks) = if len <= RUN_BYTES {
                let per = (RUN_BYTES / len).clamp(1, CHUNK_ELEMENTS);
                (per, count.div_ceil(per))
            } else {
                (0, count * len.div_ceil(RUN_BYTES))
            };
            queue.words.extend([
                src,
                entry.local_offset,
                dst,
                entry.remote_offset,
                len,
                count,
                local_stride,
                remote_stride,
                local_table,
                remote_table,
                local_item,
                remote_item,
                queue.chunks,
                per_chunk,
                unit,
            ]);
            queue.chunks += chunks;
        }
        Ok(Ok(()))
    }

    /// Puts `table` ([`CudaEngine::lower`]) on the stream: a flat table as one copy-engine copy each
    /// (`copy_engines`, see [`copy_engine_wins`]) or one gather launch, runs as one launch of the strided kernel;
    /// the uploaded table, if any.
    fn issue(&mut self, table: &Table, copy_engines: bool) -> Result<Option<usize>, SeamError> {
        let (words, function, per_block) = match table {
            Table::Flat(words) => (words, self.shared.gather.clone(), false),
            Table::Runs(words) => (words, self.shared.strided.clone(), true),
        };
        if words.is_empty() {
            return Ok(None);
        }
        if copy_engines && !per_block {
            for copy in words.chunks_exact(3) {
                // SAFETY: both ranges were checked against live allocations of this context.
                unsafe { result::memcpy_dtod_async(copy[1], copy[0], copy[2] as usize, self.stream.cu_stream()) }
                    .map_err(|error| driver("cuMemcpyDtoDAsync", error))?;
            }
            self.operations += (words.len() / 3) as u64;
            return Ok(None);
        }
        let count = (words.len() / if per_block { 6 } else { 3 }) as u64;
        let (index, device) = self.stage(words)?;
        let mut launch = self.stream.launch_builder(&function);
        launch.arg(&device).arg(&count);
        // SAFETY: every descriptor's source and target were checked against live allocations; `device` holds the
        // table, uploaded before the launch on the same stream.
        unsafe { launch.launch(Shared::launch_config(count)) }
            .map_err(|error| driver(if per_block { "kv_strided" } else { "kv_gather" }, error))?;
        self.operations += count;
        Ok(Some(index))
    }

    /// The doorbell: every strided batch queued since the last one goes on the stream as one upload of their runs
    /// and one launch of the strided kernel, with one event for all of them. A device error fails them.
    fn ring(&mut self) {
        if self.queued_batches.is_empty() {
            return;
        }
        let table = Table::Runs(std::mem::take(&mut self.queued));
        let paged = std::mem::take(&mut self.paged);
        let batches = std::mem::take(&mut self.queued_batches);
        let issued = self.issue(&table, false).and_then(|runs| {
            let paged = self.issue_paged(paged)?;
            let event = self.stream.record_event(None).map_err(|error| driver("cuEventRecord", error))?;
            Ok((Arc::new(event), [runs, paged]))
        });
        match issued {
            Ok((event, used)) => {
                self.staged(&used, &event);
                for (conn, batch, notify) in batches {
                    self.in_flight.push_back(InFlight { conn, batch, event: event.clone(), notify });
                }
            }
            Err(error) => {
                for (conn, batch, _) in batches {
                    self.complete_now(conn, batch, BatchStatus::Aborted, format!("the GPU refused the batch: {error}"));
                }
            }
        }
    }

    /// One upload of the paged queue (descriptors, then the tables two to a word) and one launch of the paged kernel.
    fn issue_paged(&mut self, mut queue: PagedQueue) -> Result<Option<usize>, SeamError> {
        if queue.words.is_empty() {
            return Ok(None);
        }
        let count = (queue.words.len() / PAGED_WORDS) as u64;
        let tables =
            queue.tables.chunks(2).map(|pair| u64::from(pair[0]) | u64::from(*pair.get(1).unwrap_or(&0)) << 32);
        queue.words.extend(tables);
        let (index, device) = self.stage(&queue.words)?;
        let function = self.shared.paged.clone();
        let mut launch = self.stream.launch_builder(&function);
        launch.arg(&device).arg(&count).arg(&queue.chunks);
        // SAFETY: every descriptor's ranges were checked against live allocations (through its tables); `device`
        // holds them, uploaded before the launch on the same stream.
        unsafe { launch.launch(Shared::launch_config(queue.chunks)) }.map_err(|error| driver("kv_paged", error))?;
        self.operations += count;
        Ok(Some(index))
    }

    /// Moves completed batches (in stream order) to `ready`, handing their notifications to the peers.
    fn reap(&mut self) {
        while let Some(front) = self.in_flight.front() {
            let (status, detail) = match front.event.try_is_complete() {
                Ok(false) => return,
                Ok(true) => (BatchStatus::Success, String::new()),
                Err(error) => (BatchStatus::Aborted, format!("the GPU reported {error:?}")),
            };
            let done = self.in_flight.pop_front().expect("front exists");
            if let (BatchStatus::Success, Some((peer, conn, tag))) = (status, done.notify) {
                if let Some(mail) = self.shared.state().mail.get_mut(&peer) {
                    mail.push_back((conn, tag));
                }
            }
            let landed = if status == BatchStatus::Success { Landed::All } else { Landed::Unknown };
            self.ready.push_back(Event::Completed(Completion {
                conn: done.conn,
                batch: done.batch,
                status,
                landed,
                detail,
            }));
        }
    }

    /// A lowered batch queued for the doorbell, or completed at once with the status its lowering found.
    fn enqueue(
        &mut self,
        conn: ConnId,
        id: BatchId,
        notify: Option<(u32, ConnId, u32)>,
        lowered: Result<(), BatchStatus>,
    ) -> Result<BatchId, SeamError> {
        match lowered {
            Ok(()) => self.queued_batches.push((conn, id, notify)),
            Err(status) => {
                self.complete_now(conn, id, status, format!("{}: a range outside registered memory", status.name()))
            }
        }
        Ok(id)
    }

    fn complete_now(&mut self, conn: ConnId, batch: BatchId, status: BatchStatus, detail: String) {
        let landed = if status == BatchStatus::Success { Landed::All } else { Landed::Entries(Vec::new()) };
        self.ready.push_back(Event::Completed(Completion { conn, batch, status, landed, detail }));
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        let mut state = self.shared.state();
        for region in self.regions.values() {
            state.live.remove(&region.ptr);
        }
        state.mail.remove(&self.id);
        drop(state);
        self.shared.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        // The regions' allocations go back to the GPU's spares as `regions` drops (still counted as held); the
        // stream and the table buffers to the GPU's pools.
        if !Arc::ptr_eq(&self.stream, &self.shared.stream) {
            self.shared.device.give_back(self.stream.clone(), std::mem::take(&mut self.staging));
        }
    }
}

/// The address an engine advertises: the process (device addresses mean nothing in another) and the engine.
fn address(engine: u32, conn: ConnId) -> PeerAddress {
    PeerAddress(format!("cuda/1 pid={} engine={engine} conn={}", std::process::id(), conn.0).into_bytes())
}

/// The engine and connection end an address names, if it is this process's.
fn parse_address(peer: &PeerAddress) -> Result<(u32, ConnId), SeamError> {
    let text = String::from_utf8_lossy(&peer.0).into_owned();
    let bad = |why: String| SeamError::BadAddress { address: text.clone(), why };
    let mut fields =
        text.strip_prefix("cuda/1 ").ok_or_else(|| bad("not a cuda fabric address".to_owned()))?.split(' ');
    let mut field = |name: &str| {
        fields
            .next()
            .and_then(|field| field.strip_prefix(name))
            .and_then(|value| value.parse::<u32>().ok())
            .ok_or_else(|| bad(format!("no `{name}` field")))
    };
    let (pid, engine, conn) = (field("pid=")?, field("engine=")?, field("conn=")?);
    if pid != std::process::id() {
        return Err(bad(format!(
            "the peer is process {pid}: device memory of another process needs CUDA IPC handles, which the cuda fabric does not advertise (run the ranks in one process: `kvrelay check --fabric cuda`)"
        )));
    }
    Ok((engine, ConnId(conn)))
}

impl TransferEngine for CudaEngine {
    fn node(&self) -> NodeId {
        self.node
    }

    fn limits(&self) -> SeamLimits {
        SeamLimits {
            max_entries: 1 << 22,
            max_batch_bytes: u64::MAX,
            batches_in_flight: 1024,
            strided: true,
            paged: true,
        }
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device { gpu: self.shared.gpu }
    }

    fn register(&mut self, _kind: MemoryKind, len: u64, _item_len: u64, fill: Fill) -> Result<Memory, SeamError> {
        let region = self.shared.make_region(len, self.id, Contents::Fill(&fill))?;
        // Complete before any engine's stream reads it.
        self.shared.stream.synchronize().map_err(|error| driver("cuStreamSynchronize", error))?;
        Ok(self.add_region(region))
    }

    fn register_pattern(
        &mut self,
        _kind: MemoryKind,
        len: u64,
        _item_len: u64,
        pattern: Pattern,
    ) -> Result<Memory, SeamError> {
        let region = self.shared.make_region(len, self.id, Contents::Pattern(pattern))?;
        // Generated on the shared stream: complete before any engine's stream reads or writes it.
        self.shared.stream.synchronize().map_err(|error| driver("cuStreamSynchronize", error))?;
        Ok(self.add_region(region))
    }

    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        self.shared.read_region(self.region(memory)?, offset, out)
    }

    fn release(&mut self, memory: &Memory, _sparse: bool) -> Result<Image, SeamError> {
        self.ring();
        let mut bytes = vec![0u8; self.region(memory)?.len as usize];
        self.read(memory, 0, &mut bytes)?;
        let region = self.regions.remove(&memory.id).ok_or(SeamError::UnknownMemory(memory.id))?;
        self.shared.forget(region.ptr, region.len);
        Ok(Image::from([(0, bytes)]))
    }

    fn resident(&mut self, memory: &Memory) -> Option<Kept> {
        // Everything submitted has run before the oracle looks (keep_region synchronises).
        self.ring();
        let region = self.regions.remove(&memory.id)?;
        self.shared.keep_region(region).ok()
    }

    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError> {
        let conn = ConnId(self.conns.len() as u32);
        self.conns.insert(conn, Conn::default());
        Ok((conn, address(self.id, conn)))
    }

    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError> {
        let (engine, peer_conn) = parse_address(peer)?;
        let end = self.conns.get_mut(&conn).ok_or(SeamError::UnknownConnection(conn))?;
        if end.peer.is_some() {
            return Err(SeamError::AlreadyConnected(conn));
        }
        // The peer's memory is checked here, as a NIC checks keys when a peer connects: a batch takes the shared
        // state's lock only after a registration came or went since.
        let generation = self.shared.generation.load(std::sync::atomic::Ordering::Acquire);
        let state = self.shared.state();
        let live = |target: &RemoteMemory| {
            Some(state.live.get(&target.addr).is_some_and(|(len, owner)| *len == target.len && *owner == target.key))
        };
        end.alive = Some((generation, remote.iter().map(live).collect()));
        drop(state);
        end.peer = Some(Peer { engine, conn: peer_conn, remote: Arc::from(remote) });
        Ok(())
    }

    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError> {
        SeamError::check_limits(&batch, self.limits())?;
        let generation = self.shared.generation.load(std::sync::atomic::Ordering::Acquire);
        let end = self.conns.get_mut(&conn).ok_or(SeamError::UnknownConnection(conn))?;
        let peer = end.peer.clone().ok_or(SeamError::NotConnected(conn))?;
        // Whether each peer memory the batch names is still registered: known for the connection until a
        // registration comes or goes (the shared state's lock is taken only for memories not known yet).
        let cache = match &mut end.alive {
            Some((known, cache)) if *known == generation => cache,
            slot => &mut slot.insert((generation, vec![None; peer.remote.len()])).1,
        };
        let unknown = batch.entries.iter().any(|entry| cache.get(entry.remote as usize).is_some_and(Option::is_none));
        if unknown {
            let state = self.shared.state();
            for entry in &batch.entries {
                let index = entry.remote as usize;
                if let (Some(slot @ None), Some(target)) = (cache.get_mut(index), peer.remote.get(index)) {
                    let live = state.live.get(&target.addr);
                    *slot = Some(live.is_some_and(|(len, owner)| *len == target.len && *owner == target.key));
                }
            }
        }
        let alive: Vec<bool> = cache.iter().map(|alive| *alive == Some(true)).collect();
        // Refused whole when an entry names unknown memory, before anything else (entries mostly repeat a region).
        let mut known = None;
        for entry in &batch.entries {
            if known != Some(entry.local) {
                if !self.regions.contains_key(&entry.local) {
                    return Err(SeamError::UnknownMemory(entry.local));
                }
                known = Some(entry.local);
            }
        }
        let id = BatchId(self.next_batch);
        self.next_batch += 1;
        // Whole entries for the copy engines; pieces of at most PIECE_BYTES for the gather kernel's warps.
        let copy_engines = copy_engine_wins(batch.entries.len(), batch.byte_len().unwrap_or(u64::MAX));
        let piece = if copy_engines { u64::MAX } else { PIECE_BYTES };
        // The notification goes to the end the peer opened (the address it gave names it).
        let notify = batch.notify.map(|tag| (peer.engine, peer.conn, tag));
        // Paged and strided batches wait for the doorbell (flush, or the next poll), to share one upload and launch:
        // their descriptors go straight into the doorbell's tables.
        if batch.paged() {
            let mut queue = std::mem::take(&mut self.paged);
            let lowered = self.lower_paged(&peer, &alive, &batch, &mut queue);
            self.paged = queue;
            return self.enqueue(conn, id, notify, lowered?);
        }
        if batch.strided() {
            let mut queued = std::mem::take(&mut self.queued);
            let lowered = self.lower(&peer, &alive, &batch, piece, &mut queued);
            self.queued = queued;
            return self.enqueue(conn, id, notify, lowered?);
        }
        let mut words = Vec::new();
        if let Err(status) = self.lower(&peer, &alive, &batch, piece, &mut words)? {
            self.complete_now(conn, id, status, format!("{}: a range outside registered memory", status.name()));
            return Ok(id);
        }
        let table = Table::Flat(words);
        self.ring(); // stream order is submission order
        let used = self.issue(&table, copy_engines)?;
        let event = Arc::new(self.stream.record_event(None).map_err(|error| driver("cuEventRecord", error))?);
        self.staged(&[used], &event);
        self.in_flight.push_back(InFlight { conn, batch: id, event, notify });
        Ok(id)
    }

    fn flush(&mut self) {
        self.ring();
    }

    fn cancel(&mut self, batch: BatchId) -> Cancelled {
        let queued = self.queued_batches.iter().any(|(_, queued, _)| *queued == batch);
        if queued || self.in_flight.iter().any(|flight| flight.batch == batch) {
            Cancelled::Draining
        } else {
            Cancelled::Ended
        }
    }

    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        self.ring();
        self.reap();
        if let Some(mail) = self.shared.state().mail.get_mut(&self.id) {
            while let Some((conn, tag)) = mail.pop_front() {
                self.ready.push_back(Event::Notified { conn, tag });
            }
        }
        let take = self.ready.len().min(max);
        out.extend(self.ready.drain(..take));
        take
    }

    #[allow(clippy::disallowed_methods, reason = "a real-clock engine bounds its wait by the clock")]
    fn wait(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        self.ring();
        loop {
            self.reap();
            let mail = self.shared.state().mail.get(&self.id).is_some_and(|mail| !mail.is_empty());
            if !self.ready.is_empty() || mail {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn operations(&self) -> u64 {
        self.operations
    }
}

/// A kept region's memory, freed when the last handle goes.
struct Holder {
    shared: Arc<Shared>,
    region: Option<Region>,
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            self.shared.state().resident.remove(&region.ptr);
            drop(region); // its allocation goes back to the GPU's spares
        }
    }
}

/// Overwrites byte `offset` of kept memory (the `keep` of a [`Kept`] this fabric made) with `byte`: how a test
/// plants a wrong byte in device memory for the oracle to find. Errors for anything else or a byte outside it.
pub fn plant(keep: &(dyn std::any::Any + Send + Sync), offset: u64, byte: u8) -> Result<(), String> {
    let holder = keep.downcast_ref::<Holder>().ok_or("not memory the cuda fabric kept")?;
    let region = holder.region.as_ref().ok_or("the memory was freed")?;
    if offset >= region.len {
        return Err(format!("byte {offset} is outside the {}-byte memory", region.len));
    }
    holder.shared.ctx.synchronize().map_err(|error| format!("cuCtxSynchronize: {error:?}"))?;
    // SAFETY: one byte inside a live allocation.
    unsafe { result::memset_d8_async(region.ptr + offset, byte, 1, holder.shared.stream.cu_stream()) }
        .map_err(|error| format!("cuMemsetD8Async: {error:?}"))?;
    holder.shared.stream.synchronize().map_err(|error| format!("cuStreamSynchronize: {error:?}"))
}

/// Kept memory compared on the GPU: a batch of checks is one compare launch.
struct DeviceCompare(Arc<Shared>);

/// One compare's stream and buffers, reused from call to call (`Device::judges`): the words uploaded (checks, row
/// checks, runs) and the flags read back, page-locked on the host.
struct JudgeSlot {
    stream: Arc<CudaStream>,
    words: Option<Staging>,
    flags: Option<Staging>,
}

/// A compare slot taken from the GPU's pool, handed back when dropped.
struct TakenSlot<'a> {
    device: &'a Device,
    slot: Option<JudgeSlot>,
}

impl TakenSlot<'_> {
    fn take(device: &Device) -> Result<TakenSlot<'_>, String> {
        let kept = device.judges.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        let slot = match kept {
            Some(slot) => slot,
            None => {
                let stream = device.ctx.new_stream().map_err(|error| format!("cuStreamCreate: {error:?}"))?;
                JudgeSlot { stream, words: None, flags: None }
            }
        };
        Ok(TakenSlot { device, slot: Some(slot) })
    }

    fn slot(&mut self) -> &mut JudgeSlot {
        self.slot.as_mut().expect("held until dropped")
    }
}

impl Drop for TakenSlot<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            // Only a slot whose stream finished: a call that failed half-way may still have a copy in flight.
            if slot.stream.synchronize().is_ok() {
                self.device.judges.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(slot);
            }
        }
    }
}

impl JudgeSlot {
    /// `buffer`, holding at least `words` words (replaced by a larger one where it holds fewer).
    fn ensure<'a>(
        buffer: &'a mut Option<Staging>,
        ctx: &Arc<CudaContext>,
        words: usize,
    ) -> Result<&'a mut Staging, String> {
        if buffer.as_ref().is_none_or(|staging| staging.words < words) {
            *buffer = None;
            *buffer = Some(Staging::new(ctx, words).map_err(|error| error.to_string())?);
        }
        Ok(buffer.as_mut().expect("set above"))
    }
}

/// A batch of compares laid out for the two judge kernels: `words` holds the plain checks (5 words each), then the
/// row checks (6 words each), then the runs of their tables (4 words each, cut to at most PIECE_BYTES of rows).
#[derive(Default)]
struct JudgeTable {
    words: Vec<u64>,
    /// The check each plain entry (a piece of a check) answers for.
    owner: Vec<u32>,
    rows: u64,
    runs: u64,
    /// Warps' work items for the row kernel: the runs of every row check's table.
    works: u64,
}

impl JudgeTable {
    /// `checks` as plain entries, every check inside kept memory (`kept`: address to length).
    fn plain(&mut self, checks: &[Check], kept: &BTreeMap<u64, u64>) -> Result<(), String> {
        for (index, check) in checks.iter().enumerate() {
            let handle = check.handle;
            let len = kept.get(&handle).copied().ok_or_else(|| format!("no kept memory at {handle:#x}"))?;
            if check.start.checked_add(check.len).is_none_or(|end| end > len) || check.len >= 1 << 62 {
                return Err(format!("bytes {}.. ({} bytes) are outside the {len}-byte memory", check.start, check.len));
            }
            let plain = check.block == check.len || check.pattern == Pattern::Sentinel;
            if !plain && (check.block == 0 || check.len % check.block != 0) {
                return Err(format!("a check of {} bytes is not made of {}-byte blocks", check.len, check.block));
            }
            let (block, stride) = if plain { (check.len, 0) } else { (check.block, check.pattern_stride) };
            let (source, flag) = match check.pattern {
                Pattern::Source { number } => {
                    let offset = check.pattern_offset;
                    let last = (check.len / block.max(1)).saturating_sub(1);
                    let end = last.checked_mul(stride).and_then(|span| span.checked_add(offset + block));
                    (source_word(number, end)?, 0)
                }
                Pattern::Sentinel => (0, 1u64 << 63),
            };
            // Pieces of at most PIECE_BYTES: whole blocks where blocks are smaller, a plain check cut anywhere.
            let per_piece = if plain { PIECE_BYTES } else { (PIECE_BYTES / block).max(1) * block };
            let mut done = 0;
            while done < check.len {
                let piece = (check.len - done).min(per_piece);
                let skipped = if plain { done } else { done / block * stride };
                let source = if flag == 0 { source + skipped + check.pattern_offset } else { 0 };
                let piece_block = if plain { piece } else { block };
                self.words.extend([handle + check.start + done, source, piece | flag, piece_block, stride]);
                self.owner.push(index as u32);
                done += piece;
            }
        }
        Ok(())
    }

    /// `rows` and the runs of the `tables` they name (appended after the plain entries), each check's every run
    /// inside its kept memory.
    fn rows(&mut self, tables: &[&[RowRun]], rows: &[RowsCheck], kept: &BTreeMap<u64, u64>) -> Result<(), String> {
        // Rows per piece of each table's runs: PIECE_BYTES of the widest rows checked through it.
        let mut cap = vec![0u64; tables.len()];
        for check in rows {
            let slot = cap.get_mut(check.table as usize).ok_or_else(|| format!("no table {} of runs", check.table))?;
            let rows = (PIECE_BYTES / check.row.max(1)).max(1);
            *slot = if *slot == 0 { rows } else { (*slot).min(rows) };
        }
        // Every table's pieces, and how far its rows reach (past the last target row, the last source row).
        let mut runs = Vec::new();
        let mut placed = Vec::with_capacity(tables.len());
        for (table, cap) in tables.iter().zip(&cap) {
            let (first, mut target_end, mut source_last) = (runs.len() as u64 / 4, 0u64, 0u64);
            for run in table.iter().filter(|_| *cap > 0) {
                let end = run.target.checked_add(run.count);
                let last =
                    run.count.saturating_sub(1).checked_mul(run.step).and_then(|span| span.checked_add(run.source));
                let (Some(end), Some(last)) = (end, last) else {
                    return Err(format!("run {run:?} overflows"));
                };
                (target_end, source_last) = (target_end.max(end), source_last.max(last));
                let mut done = 0;
                while done < run.count {
                    let count = (run.count - done).min(*cap);
                    runs.extend([run.target + done, run.source + done * run.step, count, run.step]);
                    done += count;
                }
            }
            placed.push((first, runs.len() as u64 / 4 - first, target_end, source_last));
        }
        for check in rows {
            let (first, pieces, target_end, source_last) = placed[check.table as usize];
            let handle = check.handle;
            let len = kept.get(&handle).copied().ok_or_else(|| format!("no kept memory at {handle:#x}"))?;
            if target_end.checked_mul(check.row).is_none_or(|end| end > len) {
                return Err(format!(
                    "table {} reaches row {target_end} of {}-byte rows, past the {len}-byte memory",
                    check.table, check.row
                ));
            }
            let source = match check.pattern {
                Pattern::Source { number } => {
                    let end = source_last.checked_mul(check.pattern_row).and_then(|at| at.checked_add(check.row));
                    source_word(number, end)?
                }
                Pattern::Sentinel => 1u64 << 63,
            };
            self.words.extend([handle, check.row, source, check.pattern_row, first, self.works]);
            self.works += pieces;
        }
        self.rows = rows.len() as u64;
        self.runs = runs.len() as u64 / 4;
        self.words.extend(runs);
        Ok(())
    }
}

/// Source `number`'s word for the judge kernels (`number << 40`), its pattern read up to byte `end` (`None`:
/// overflowed).
fn source_word(number: u32, end: Option<u64>) -> Result<u64, String> {
    if end.is_none_or(|end| end >= 1 << 40) || number >= 1 << 23 {
        return Err(format!("source {number} is read past its pattern's range"));
    }
    Ok(u64::from(number) << 40)
}

impl Compare for DeviceCompare {
    fn compare(&self, checks: &[Check]) -> Result<Vec<bool>, String> {
        self.compare_with_rows(checks, &[], &[])
    }

    /// One upload of every check, row check and run through reused page-locked buffers, one launch of each judge
    /// kernel, one read-back of the flags.
    #[allow(clippy::disallowed_methods, reason = "the fabric times its own compares for the benchmark")]
    fn compare_with_rows(
        &self,
        checks: &[Check],
        tables: &[&[RowRun]],
        rows: &[RowsCheck],
    ) -> Result<Vec<bool>, String> {
        let shared = &self.0;
        let began = Instant::now();
        let mut table = JudgeTable::default();
        // The lengths of the kept memory asked about, copied out under the lock: the tables are built without it,
        // so the harness's per-rank threads build theirs side by side.
        let kept: BTreeMap<u64, u64> = {
            let state = shared.state();
            let handles = checks.iter().map(|check| check.handle).chain(rows.iter().map(|check| check.handle));
            handles.filter_map(|handle| state.resident.get(&handle).map(|len| (handle, *len))).collect()
        };
        table.plain(checks, &kept)?;
        table.rows(tables, rows, &kept)?;
        let mut answers = vec![true; checks.len() + rows.len()];
        let plain = table.owner.len() as u64;
        if plain == 0 && table.works == 0 {
            return Ok(answers);
        }
        let built = Instant::now();
        let failed = |call: &str, error: cudarc::driver::DriverError| format!("{call}: {error:?}");
        shared.ctx.bind_to_thread().map_err(|error| failed("cuCtxSetCurrent", error))?;
        let mut taken = TakenSlot::take(&shared.device)?;
        let buffers = taken.slot();
        let stream = &buffers.stream.clone();
        // Flags: [any, bad of each plain entry, bad of each row check].
        let flag_count = 1 + plain as usize + rows.len();
        let words = JudgeSlot::ensure(&mut buffers.words, &shared.ctx, table.words.len())?;
        words.host()[..table.words.len()].copy_from_slice(&table.words);
        let base = words.device.ptr;
        // SAFETY: the device buffer holds at least as many words; the host words are not written again before the
        // stream is synchronised below.
        unsafe { result::memcpy_htod_async(base, &words.host()[..table.words.len()], stream.cu_stream()) }
            .map_err(|error| failed("cuMemcpyHtoDAsync", error))?;
        let flags = JudgeSlot::ensure(&mut buffers.flags, &shared.ctx, flag_count.div_ceil(2))?;
        let (any, bad) = (flags.device.ptr, flags.device.ptr + 4);
        // SAFETY: the flags buffer holds at least `flag_count` 4-byte words.
        unsafe { result::memset_d8_async(any, 0, 4 * flag_count, stream.cu_stream()) }
            .map_err(|error| failed("cuMemsetD8Async", error))?;
        if plain > 0 {
            let mut launch = stream.launch_builder(&shared.judge);
            launch.arg(&base).arg(&plain).arg(&bad).arg(&any);
            // SAFETY: every entry lies inside kept memory (checked above) that its `Holder` keeps alive; the table
            // and flags are as long as the launch reads.
            unsafe { launch.launch(Shared::launch_config(plain)) }.map_err(|error| failed("kv_judge", error))?;
        }
        if table.works > 0 {
            let row_checks = base + 8 * 5 * plain;
            let runs = row_checks + 8 * 6 * table.rows;
            let row_bad = bad + 4 * plain;
            let mut launch = stream.launch_builder(&shared.judge_rows);
            launch.arg(&row_checks).arg(&table.rows).arg(&runs).arg(&table.works).arg(&row_bad).arg(&any);
            // SAFETY: as above: every run of every row check lies inside its kept memory (checked above).
            unsafe { launch.launch(Shared::launch_config(table.works)) }
                .map_err(|error| failed("kv_judge_rows", error))?;
        }
        let host = flags.host();
        // SAFETY: the flags' host words hold at least `flag_count` 4-byte words, read after the synchronisation.
        let host = unsafe { std::slice::from_raw_parts_mut(host.as_mut_ptr().cast::<u32>(), flag_count) };
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_async(&mut *host, any, stream.cu_stream()) }
            .map_err(|error| failed("cuMemcpyDtoHAsync", error))?;
        stream.synchronize().map_err(|error| failed("cuStreamSynchronize", error))?;
        if host[0] != 0 {
            for (flag, index) in host[1..=plain as usize].iter().zip(&table.owner) {
                if *flag != 0 {
                    answers[*index as usize] = false;
                }
            }
            for (answer, flag) in answers[checks.len()..].iter_mut().zip(&host[1 + plain as usize..]) {
                *answer = *flag == 0;
            }
        }
        shared.device.judged.add(
            checks.len() + rows.len(),
            plain as usize + table.works as usize,
            built - began,
            built.elapsed(),
        );
        Ok(answers)
    }

    fn read(&self, handle: u64, start: u64, out: &mut [u8]) -> Result<(), String> {
        let shared = &self.0;
        let len =
            shared.state().resident.get(&handle).copied().ok_or_else(|| format!("no kept memory at {handle:#x}"))?;
        if start.checked_add(out.len() as u64).is_none_or(|end| end > len) {
            return Err(format!("bytes {start}.. ({} bytes) are outside the {len}-byte region", out.len()));
        }
        shared.ctx.bind_to_thread().map_err(|error| format!("cuCtxSetCurrent: {error:?}"))?;
        let mut taken = TakenSlot::take(&shared.device)?;
        let stream = taken.slot().stream.clone();
        // SAFETY: the range lies inside kept memory that its `Holder` keeps alive.
        unsafe { result::memcpy_dtoh_async(out, handle + start, stream.cu_stream()) }
            .map_err(|error| format!("cuMemcpyDtoHAsync: {error:?}"))?;
        stream.synchronize().map_err(|error| format!("cuStreamSynchronize: {error:?}"))
    }

    fn name(&self) -> String {
        format!("cuda GPU {}", self.0.gpu)
    }
}

/// Ceilings and kernel rates measured on the GPU (GB/s of payload).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ceilings {
    /// One large device-to-device copy.
    pub device_copy: f64,
    /// Pinned host to device.
    pub host_to_device: f64,
    /// The gather kernel over scattered rows.
    pub gather: f64,
    /// One `cuMemcpyDtoDAsync` per row, same rows.
    pub copy_engine_rows: f64,
    /// The compare kernel over the gathered rows.
    pub judge: f64,
}

/// Times `run` between two events on `stream` (milliseconds), best of `reps`.
fn timed(
    stream: &Arc<CudaStream>,
    reps: u32,
    mut run: impl FnMut() -> Result<(), SeamError>,
) -> Result<f64, SeamError> {
    let mut best = f64::MAX;
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    for _ in 0..reps {
        let start = stream.record_event(timing).map_err(|error| driver("cuEventRecord", error))?;
        run()?;
        let end = stream.record_event(timing).map_err(|error| driver("cuEventRecord", error))?;
        let ms = start.elapsed_ms(&end).map_err(|error| driver("cuEventElapsedTime", error))?;
        best = best.min(f64::from(ms));
    }
    Ok(best)
}

fn ceilings(shared: &Arc<Shared>, bytes: u64, row: u64) -> Result<Ceilings, SeamError> {
    let stream = &shared.stream;
    let gbs = |moved: u64, ms: f64| moved as f64 / (ms.max(1e-9) * 1e6);
    let (src, src_ptr) = shared.alloc(bytes, 0)?;
    let (dst, dst_ptr) = shared.alloc(bytes, 0)?;
    shared.generate(src_ptr, bytes, Pattern::Source { number: 1 })?;
    let copy_ms = timed(stream, 5, || {
        // SAFETY: both allocations are `bytes` long.
        unsafe { result::memcpy_dtod_async(dst_ptr, src_ptr, bytes as usize, stream.cu_stream()) }
            .map_err(|error| driver("cuMemcpyDtoDAsync", error))
    })?;
    // Pinned host to device, 256 MiB.
    let pinned_len = (bytes.min(256 << 20)) as usize;
    let mut pinned = {
        // SAFETY: the pinned buffer is only copied from, after being written.
        unsafe { shared.ctx.alloc_pinned::<u8>(pinned_len) }
    }
    .map_err(|error| driver("cuMemHostAlloc", error))?;
    pinned.as_mut_slice().map_err(|error| driver("cuMemHostAlloc", error))?.fill(7);
    let host_ms = timed(stream, 5, || {
        let host = pinned.as_slice().map_err(|error| driver("cuMemHostAlloc", error))?;
        // SAFETY: the target allocation holds at least `pinned_len` bytes.
        unsafe { result::memcpy_htod_async(dst_ptr, host, stream.cu_stream()) }
            .map_err(|error| driver("cuMemcpyHtoDAsync", error))
    })?;
    // Rows scattered by a fixed odd-stride permutation.
    let rows = bytes / row;
    let stride = (rows / 2 + 1) | 1;
    let mut table = Vec::with_capacity(rows as usize * 3);
    let mut checks = Vec::with_capacity(rows as usize * 5);
    for index in 0..rows {
        let from = (index * stride) % rows;
        table.extend([src_ptr + from * row, dst_ptr + index * row, row]);
        checks.extend([dst_ptr + index * row, (1u64 << 40) | (from * row), row, row, 0]);
    }
    let device_table = Shared::upload(stream, &table)?;
    let count = rows;
    let gather_ms = timed(stream, 5, || {
        let mut launch = stream.launch_builder(&shared.gather);
        launch.arg(&device_table).arg(&count);
        // SAFETY: every row lies inside the two allocations.
        unsafe { launch.launch(Shared::launch_config(count)) }.map(drop).map_err(|error| driver("kv_gather", error))
    })?;
    let device_checks = Shared::upload(stream, &checks)?;
    let mut bad = stream.alloc_zeros::<u32>(rows as usize).map_err(|error| driver("cuMemAlloc", error))?;
    let mut any = stream.alloc_zeros::<u32>(1).map_err(|error| driver("cuMemAlloc", error))?;
    let judge_ms = timed(stream, 5, || {
        let mut launch = stream.launch_builder(&shared.judge);
        launch.arg(&device_checks).arg(&count).arg(&mut bad).arg(&mut any);
        // SAFETY: every check lies inside the target allocation.
        unsafe { launch.launch(Shared::launch_config(count)) }.map(drop).map_err(|error| driver("kv_judge", error))
    })?;
    let flagged = stream.clone_dtoh(&any).map_err(|error| driver("cuMemcpyDtoH", error))?;
    if flagged.first().copied() != Some(0) {
        return Err(SeamError::Engine {
            call: "kv_judge",
            message: "the gathered rows did not compare equal".to_owned(),
        });
    }
    // The copy engines, one copy per row, over at most 20,000 rows (launch-bound; scaled).
    let some = rows.min(20_000);
    let rows_ms = timed(stream, 2, || {
        for index in 0..some {
            let [src, dst, len] =
                [table[index as usize * 3], table[index as usize * 3 + 1], table[index as usize * 3 + 2]];
            // SAFETY: as for the gather.
            unsafe { result::memcpy_dtod_async(dst, src, len as usize, stream.cu_stream()) }
                .map_err(|error| driver("cuMemcpyDtoDAsync", error))?;
        }
        Ok(())
    })?;
    drop((src, dst));
    shared.forget(src_ptr, bytes);
    shared.forget(dst_ptr, bytes);
    Ok(Ceilings {
        device_copy: gbs(bytes, copy_ms),
        host_to_device: gbs(pinned_len as u64, host_ms),
        gather: gbs(rows * row, gather_ms),
        copy_engine_rows: gbs(some * row, rows_ms),
        judge: gbs(rows * row, judge_ms),
    })
}
