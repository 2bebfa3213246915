//! [`CudaEngine`], one rank's transfer engine on the GPU: connections, descriptor tables, launches, completions.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream, PushKernelArg};

use super::{copy_engine_wins, driver, Contents, DeviceAlloc, Region, Shared, PIECE_BYTES, RUN_BYTES};
use crate::fabric::seam::{
    Batch, BatchId, BatchStatus, Cancelled, Completion, ConnId, Event, Fill, Image, Kept, Landed, Memory, MemoryKind,
    NodeId, Pattern, PeerAddress, RemoteMemory, Repeat, SeamError, SeamLimits, TransferEngine,
};

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
pub(super) struct Staging {
    host: *mut u64,
    pub(super) device: DeviceAlloc,
    pub(super) words: usize,
    pub(super) busy: Option<Arc<CudaEvent>>,
    /// Staged for a launch whose event is not recorded yet (set by `stage`, cleared by `staged`); a buffer whose
    /// launch failed stays reserved, never rewritten while a copy may still read it.
    pub(super) reserved: bool,
}

impl Staging {
    /// Page-locked host words and as many device words, for at least `words` words (the next power of two, 4,096
    /// at least).
    pub(super) fn new(ctx: &Arc<CudaContext>, words: usize) -> Result<Staging, SeamError> {
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
    pub(super) fn host(&mut self) -> &mut [u64] {
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
    pub(super) fn new(node: NodeId, shared: Arc<Shared>) -> CudaEngine {
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
        self.shared.settle_fills()?;
        self.shared.device.launched();
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
        self.shared.settle_fills()?;
        self.shared.device.launched();
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
        // Whether nothing on the GPU can still use this engine's unexposed regions: every fill is settled, and
        // nothing this engine launched still runs (its stream reached an event recorded now). Only this engine
        // reads them; only an exposed region can be written by another engine's stream.
        use std::sync::atomic::Ordering::Acquire;
        let device = &self.shared.device;
        let fills_settled = device.fills_settled.load(Acquire) >= device.fills.load(Acquire);
        let quiet = fills_settled
            && self.in_flight.is_empty()
            && self.queued_batches.is_empty()
            && self.stream.record_event(None).is_ok_and(|event| event.is_complete());
        let mut state = self.shared.state();
        for region in self.regions.values_mut() {
            match state.live.remove(&region.ptr) {
                Some(live) if live.exposed => region.written(),
                Some(_) if quiet => region.idle(),
                _ => {}
            }
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
        // Generated on the shared stream, and complete before any engine's stream reads or writes it: every
        // engine settles the queued fills before its next launch (`Shared::settle_fills`).
        let region = self.shared.make_region(len, self.id, Contents::Pattern(pattern))?;
        Ok(self.add_region(region))
    }

    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        self.shared.read_region(self.region(memory)?, offset, out)
    }

    fn release(&mut self, memory: &Memory, _sparse: bool) -> Result<Image, SeamError> {
        self.ring();
        let mut bytes = vec![0u8; self.region(memory)?.len as usize];
        self.read(memory, 0, &mut bytes)?;
        let mut region = self.regions.remove(&memory.id).ok_or(SeamError::UnknownMemory(memory.id))?;
        if self.shared.forget(region.ptr, region.len) {
            region.written();
        }
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
        let mut state = self.shared.state();
        let alive = remote.iter().map(|target| Some(state.writable(target))).collect();
        end.alive = Some((generation, alive));
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
            let mut state = self.shared.state();
            for entry in &batch.entries {
                let index = entry.remote as usize;
                if let (Some(slot @ None), Some(target)) = (cache.get_mut(index), peer.remote.get(index)) {
                    *slot = Some(state.writable(target));
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
