//! The plan executed straight through a transport's engines, with no protocol around it: every rank's regions
//! registered as the rank engines register them (the source pattern, the decode sentinel), every prefill engine
//! connected to every decode engine it writes to, the plan's descriptors submitted as one batch per pair (strided
//! entries where the engine takes them, their elements otherwise), completions awaited, and the decode memory
//! observed as a run's, so the oracle judges what moved. This is what `kvrelay bench` times as a fabric's "writes
//! and completions, after planning": bootstrap, metadata and planning are not in [`Direct::execute`].

use std::collections::BTreeMap;
use std::time::Duration;

use super::sim::{register_decode, register_prefill};
use crate::fabric::seam::{
    Batch, BatchStatus, ConnId, Entry, Event, Memory, PageTable, Paging, RemoteMemory, Repeat, SeamError,
    TransferEngine,
};
use crate::model::{Problem, RankId, Side};
use crate::plan::paged::Table as PagedTable;
use crate::plan::Descriptor;
use crate::verify::{Observation, RegionKey, Sources, WriteRecord};

/// Seconds [`Direct::execute`] spent submitting (checking and lowering the batches), at the doorbells (uploads and
/// launches), and waiting for completions after the last doorbell.
#[derive(Debug, Clone, Copy, Default)]
pub struct Phases {
    pub submit: f64,
    pub flush: f64,
    pub wait: f64,
    /// Entries submitted.
    pub entries: usize,
    /// From the first submit to the last completion.
    pub total: f64,
}

/// Seconds [`Direct::prepare`] spent registering every rank's memory (allocations, source patterns, sentinels),
/// lowering the plan into batches (page-table compaction, one batch per pair, connections), and recording the
/// writes the batches make for the oracle.
#[derive(Debug, Clone, Copy, Default)]
pub struct Prepared {
    pub register: f64,
    pub batches: f64,
    pub records: f64,
}

/// One (prefill, decode) pair's entries and the page tables they name, each table once per (request, side, rank,
/// table, item length).
#[derive(Default)]
struct Pair {
    entries: Vec<Entry>,
    tables: Vec<PageTable>,
    index: BTreeMap<(u32, Side, RankId, PagedTable, u64), u32>,
}

impl Pair {
    /// The batch table a paged descriptor's side addresses through (`None`: physical).
    fn table(
        &mut self,
        problem: &Problem,
        request: Option<&crate::model::Request>,
        (side, rank, region, table): (Side, RankId, u32, PagedTable),
    ) -> Result<Option<u32>, SeamError> {
        if table == PagedTable::Physical {
            return Ok(None);
        }
        let missing = SeamError::Exhausted("a page table the plan names");
        let request = request.ok_or(missing.clone())?;
        let item_len = problem.side(side).rank(rank).regions.get(region as usize).ok_or(missing.clone())?.item_len;
        let key = (request.id, side, rank, table, item_len);
        if let Some(index) = self.index.get(&key) {
            return Ok(Some(*index));
        }
        let pages = crate::plan::paged::items(request, side, table).ok_or(missing)?.to_vec();
        let index = self.tables.len() as u32;
        self.tables.push(PageTable { item_len, pages });
        self.index.insert(key, index);
        Ok(Some(index))
    }
}

/// A plan lowered into each (prefill, decode) pair's entries, in plan order: through the requests' page tables
/// where the engines take paged entries (`plan::paged::compact`), at physical offsets otherwise; an entry's local
/// memory is the prefill rank's region index until [`Direct::prepare_lowered`] names the engine's. Needs no engine,
/// so a replay lowers the next wave on its planning thread.
pub struct Lowered {
    paged: bool,
    pairs: BTreeMap<(RankId, RankId), Pair>,
    /// The writes the pairs' batches make, for the oracle, where [`Lowered::record_writes`] computed them already.
    writes: Option<Vec<WriteRecord>>,
}

impl Lowered {
    pub fn new(problem: &Problem, descriptors: &[Descriptor], paged: bool) -> Result<Lowered, SeamError> {
        let descriptors = if paged {
            crate::plan::paged::compact(problem, descriptors)
        } else {
            descriptors.iter().map(crate::plan::paged::physical).collect()
        };
        let mut pairs: BTreeMap<(RankId, RankId), Pair> = BTreeMap::new();
        for descriptor in &descriptors {
            let pair = pairs.entry((descriptor.source, descriptor.target)).or_default();
            let request = problem.requests.iter().find(|request| request.id == descriptor.request);
            let prefill = (Side::Prefill, descriptor.source, descriptor.source_region, descriptor.source_table);
            let decode = (Side::Decode, descriptor.target, descriptor.target_region, descriptor.target_table);
            let paging =
                Paging { local: pair.table(problem, request, prefill)?, remote: pair.table(problem, request, decode)? };
            let repeat = Repeat {
                count: descriptor.count,
                local_stride: descriptor.source_stride,
                remote_stride: descriptor.target_stride,
            };
            pair.entries.push(Entry {
                local: descriptor.source_region,
                local_offset: descriptor.source_offset,
                remote: descriptor.target_region,
                remote_offset: descriptor.target_offset,
                len: descriptor.element_len,
                repeat,
                paging,
            });
        }
        Ok(Lowered { paged, pairs, writes: None })
    }

    /// Computes the writes the batches will make, for the oracle (what [`Direct::prepare_lowered`] does otherwise
    /// once the engines are registered): a replay records them on its planning thread, off the GPU's path.
    pub fn record_writes(&mut self) -> Result<(), SeamError> {
        let mut writes = Vec::new();
        for ((_, target), pair) in &mut self.pairs {
            let batch = Batch {
                entries: std::mem::take(&mut pair.entries),
                notify: None,
                tables: std::mem::take(&mut pair.tables),
            };
            let recorded = record_spans(&mut writes, *target, &batch);
            (pair.entries, pair.tables) = (batch.entries, batch.tables);
            recorded?;
        }
        self.writes = Some(writes);
        Ok(())
    }

    /// Plans and lowers every request of `problem` on its own (the problem with that one request: the same
    /// regions, the same pages), `workers` requests at a time on threads of their own, and joins the parts in
    /// request order: a wave of many requests is planned in the time of its slowest few. The plan of one request
    /// does not depend on the others (each request's rows go to its own pages), except through a decode staging
    /// ring, whose chunk offsets are handed out across requests: such a problem is refused. The oracle judges the
    /// result as it judges the whole problem's plan. The bytes the parts move, with them.
    pub fn per_request(problem: &Problem, paged: bool, workers: usize) -> Result<(Lowered, u64), String> {
        let regions = problem.decode.ranks.iter().flat_map(|rank| &rank.regions);
        if regions.clone().any(|region| region.kind == crate::model::RegionKind::Staging) {
            return Err("a decode staging ring places each request after the ones before it: plan the problem whole (Lowered::new)".to_owned());
        }
        let one = |request: &crate::model::Request| -> Result<(Lowered, u64), String> {
            let alone = Problem { requests: vec![request.clone()], ..problem.clone() };
            let descriptors = crate::plan::plan(&alone).map_err(|error| error.to_string())?.descriptors();
            let bytes = descriptors.iter().map(Descriptor::bytes).sum();
            Ok((Lowered::new(&alone, &descriptors, paged).map_err(|error| error.to_string())?, bytes))
        };
        let parts = crate::parallel::spread(&problem.requests, workers, one);
        let mut joined = Lowered { paged, pairs: BTreeMap::new(), writes: None };
        let mut bytes = 0;
        for part in parts {
            let (part, part_bytes) = part?;
            joined.append(part);
            bytes += part_bytes;
        }
        Ok((joined, bytes))
    }

    /// `other`'s entries after this one's, pair by pair, its page tables renumbered after this pair's.
    fn append(&mut self, other: Lowered) {
        for (key, mut pair) in other.pairs {
            let into = self.pairs.entry(key).or_default();
            let shift = into.tables.len() as u32;
            for entry in &mut pair.entries {
                entry.paging.local = entry.paging.local.map(|table| table + shift);
                entry.paging.remote = entry.paging.remote.map(|table| table + shift);
            }
            into.entries.append(&mut pair.entries);
            into.tables.append(&mut pair.tables);
            into.index.extend(pair.index.into_iter().map(|(key, table)| (key, table + shift)));
        }
    }
}

/// One prefill engine's batches, by connection.
struct Sender<N> {
    nic: N,
    batches: Vec<(ConnId, RankId, Batch)>,
}

/// Every rank's engine with its memory registered and its connections made, the batches built.
pub struct Direct<N> {
    senders: Vec<Sender<N>>,
    receivers: Vec<(RankId, N, Vec<Memory>)>,
    bytes: u64,
    /// The writes the batches make, for the observation (computed before anything is timed).
    writes: Vec<WriteRecord>,
    prepared: Prepared,
}

impl<N: TransferEngine> Direct<N> {
    /// Registers every rank of `problem` on the engine `open` gives it (prefill ranks first, as the rank engines'
    /// nodes), connects each prefill engine to the decode engines `descriptors` write to, and builds one batch per
    /// pair from them: [`Lowered::new`] then [`Direct::prepare_lowered`].
    pub fn prepare(
        problem: &Problem,
        descriptors: &[Descriptor],
        open: impl FnMut(usize) -> Result<N, SeamError>,
    ) -> Result<Direct<N>, SeamError> {
        Direct::prepare_lowered(problem, None, descriptors, open)
    }

    /// [`Direct::prepare`] with the plan already lowered (`Some`, on another thread, say: it needs no engine), or
    /// lowered here for the engines' limits (`None`).
    #[allow(clippy::disallowed_methods, reason = "the phases are timed at this edge for the benchmark")]
    pub fn prepare_lowered(
        problem: &Problem,
        lowered: Option<Lowered>,
        descriptors: &[Descriptor],
        mut open: impl FnMut(usize) -> Result<N, SeamError>,
    ) -> Result<Direct<N>, SeamError> {
        let start = std::time::Instant::now();
        let sources = Sources::new(problem);
        let mut node = 0;
        let mut senders = BTreeMap::new();
        for layout in &problem.prefill.ranks {
            let mut nic = open(node)?;
            let regions = register_prefill(&mut nic, &sources, layout)?;
            node += 1;
            senders.insert(layout.rank, (nic, regions));
        }
        let mut receivers = BTreeMap::new();
        for layout in &problem.decode.ranks {
            let mut nic = open(node)?;
            let regions = register_decode(&mut nic, layout)?;
            node += 1;
            receivers.insert(layout.rank, (nic, regions));
        }
        let registered = std::time::Instant::now();
        let paged = senders.values().next().is_some_and(|(nic, _)| nic.limits().paged);
        let (lowered, recorded) = match lowered {
            Some(mut lowered) if lowered.paged == paged => {
                let recorded = lowered.writes.take();
                (lowered, recorded)
            }
            Some(lowered) if descriptors.is_empty() => {
                return Err(SeamError::Engine {
                    call: "prepare",
                    message: format!(
                        "the plan was lowered for engines that {} paged entries and these {}: lower it for them (pass its descriptors)",
                        if lowered.paged { "take" } else { "do not take" },
                        if paged { "do" } else { "do not" }
                    ),
                })
            }
            _ => (Lowered::new(problem, descriptors, paged)?, None),
        };
        let mut bytes = 0u64;
        let mut batches: BTreeMap<RankId, Vec<(ConnId, RankId, Batch)>> = BTreeMap::new();
        for ((source, target), Pair { mut entries, tables, .. }) in lowered.pairs {
            let (sender, regions) = senders.get_mut(&source).ok_or(SeamError::UnknownMemory(0))?;
            // The lowering named the prefill rank's regions by index: the engine's ids for them.
            for entry in &mut entries {
                entry.local = regions.get(entry.local as usize).ok_or(SeamError::UnknownMemory(entry.local))?.id;
            }
            let (receiver, regions) = receivers.get_mut(&target).ok_or(SeamError::UnknownMemory(0))?;
            let (conn, address) = sender.open()?;
            let (back, peer_address) = receiver.open()?;
            let remote: Vec<RemoteMemory> = regions.iter().map(Memory::remote).collect();
            sender.connect(conn, &peer_address, &remote)?;
            receiver.connect(back, &address, &[])?;
            let mut batch = Batch { entries, notify: None, tables };
            bytes += batch.byte_len().unwrap_or(0);
            if !sender.limits().strided {
                batch = Batch::of(batch.physical_elements().ok_or(SeamError::Exhausted("page table entries"))?);
            }
            batches.entry(source).or_default().push((conn, target, batch));
        }
        let senders: Vec<Sender<N>> = senders
            .into_iter()
            .map(|(rank, (nic, _))| Sender { nic, batches: batches.remove(&rank).unwrap_or_default() })
            .collect();
        let receivers = receivers.into_iter().map(|(rank, (nic, regions))| (rank, nic, regions)).collect();
        let lowered = std::time::Instant::now();
        let writes = match recorded {
            Some(writes) => writes,
            None => write_records(&senders)?,
        };
        let prepared = Prepared {
            register: (registered - start).as_secs_f64(),
            batches: (lowered - registered).as_secs_f64(),
            records: lowered.elapsed().as_secs_f64(),
        };
        Ok(Direct { senders, receivers, bytes, writes, prepared })
    }

    /// What [`Direct::prepare`] spent its time on.
    pub fn prepared(&self) -> Prepared {
        self.prepared
    }

    /// Bytes the batches move.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Submits every batch (each engine's, then its doorbell) and waits for every completion, at most `timeout` per
    /// wait; the first batch that did not succeed, in words. The batches are handed over: a second call submits
    /// nothing.
    #[allow(clippy::disallowed_methods, reason = "the phases are timed at this edge for the benchmark")]
    pub fn execute(&mut self, timeout: Duration) -> Result<Phases, String> {
        let start = std::time::Instant::now();
        let mut phases = Phases::default();
        let mut waiting = Vec::with_capacity(self.senders.len());
        for sender in &mut self.senders {
            phases.entries += sender.entries();
            let (count, submit, flush) = sender.submit()?;
            waiting.push(count);
            phases.submit += submit;
            phases.flush += flush;
        }
        let submitted = start.elapsed();
        for (sender, waiting) in self.senders.iter_mut().zip(waiting) {
            sender.wait(waiting, timeout)?;
        }
        phases.wait = (start.elapsed() - submitted).as_secs_f64();
        phases.total = start.elapsed().as_secs_f64();
        Ok(phases)
    }

    /// The decode memory as an observation (kept where it lives where the engine can, read back otherwise) and
    /// the writes the batches made, for the oracle.
    pub fn observe(mut self) -> Result<Observation, SeamError> {
        let mut observation = Observation { writes: std::mem::take(&mut self.writes), ..Observation::default() };
        for (rank, nic, regions) in &mut self.receivers {
            for (index, region) in regions.iter().enumerate() {
                let key = RegionKey { side: Side::Decode, rank: *rank, region: index as u32 };
                if let Some(kept) = nic.resident(region) {
                    observation.resident.insert(key, super::resident::resident(kept));
                } else {
                    let mut image = nic.release(region, false)?;
                    observation.images.insert(key, image.remove(&0).unwrap_or_default());
                }
            }
        }
        Ok(observation)
    }
}

impl<N: TransferEngine + Send> Direct<N> {
    /// [`Direct::execute`] with each prefill engine driven by a thread of its own, as ranks in their own processes
    /// submit concurrently; the phases are the slowest thread's.
    #[allow(clippy::disallowed_methods, reason = "the phases are timed at this edge for the benchmark")]
    pub fn execute_parallel(&mut self, timeout: Duration) -> Result<Phases, String> {
        let barrier = std::sync::Barrier::new(self.senders.len() + 1);
        let (start, results) = std::thread::scope(|scope| {
            let barrier = &barrier;
            let threads: Vec<_> = self
                .senders
                .iter_mut()
                .map(|sender| {
                    scope.spawn(move || {
                        // Every thread exists before the clock starts: spawning is not the fabric's time.
                        barrier.wait();
                        let entries = sender.entries();
                        let (count, submit, flush) = sender.submit()?;
                        let start = std::time::Instant::now();
                        sender.wait(count, timeout)?;
                        let wait = start.elapsed().as_secs_f64();
                        Ok((Phases { submit, flush, wait, entries, total: 0.0 }, std::time::Instant::now()))
                    })
                })
                .collect();
            barrier.wait();
            let start = std::time::Instant::now();
            let results: Vec<Result<(Phases, std::time::Instant), String>> = threads
                .into_iter()
                .map(|thread| thread.join().unwrap_or_else(|_| Err("a sender thread panicked".to_owned())))
                .collect();
            (start, results)
        });
        let mut phases = Phases::default();
        for result in results {
            let (one, end) = result?;
            phases.submit = phases.submit.max(one.submit);
            phases.flush = phases.flush.max(one.flush);
            phases.wait = phases.wait.max(one.wait);
            phases.entries += one.entries;
            phases.total = phases.total.max(end.saturating_duration_since(start).as_secs_f64());
        }
        Ok(phases)
    }
}

impl<N: TransferEngine> Sender<N> {
    /// Entries in this engine's batches.
    fn entries(&self) -> usize {
        self.batches.iter().map(|(_, _, batch)| batch.entries.len()).sum()
    }

    /// Submits this engine's batches and rings its doorbell: how many, and the seconds each took.
    #[allow(clippy::disallowed_methods, reason = "the phases are timed at this edge for the benchmark")]
    fn submit(&mut self) -> Result<(usize, f64, f64), String> {
        let start = std::time::Instant::now();
        let mut count = 0;
        for (conn, _, batch) in std::mem::take(&mut self.batches) {
            self.nic.submit(conn, batch).map_err(|error| format!("submitting: {error}"))?;
            count += 1;
        }
        let flush = std::time::Instant::now();
        self.nic.flush();
        Ok((count, (flush - start).as_secs_f64(), flush.elapsed().as_secs_f64()))
    }

    /// Waits for `waiting` completions, at most `timeout` per wait; the first batch that did not succeed, in words.
    fn wait(&mut self, mut waiting: usize, timeout: Duration) -> Result<(), String> {
        let mut events = Vec::new();
        while waiting > 0 {
            events.clear();
            if self.nic.poll(&mut events, usize::MAX) == 0 && !self.nic.wait(timeout) {
                return Err(format!("{waiting} batches did not complete within {timeout:?}"));
            }
            for event in &events {
                if let Event::Completed(completion) = event {
                    if completion.status != BatchStatus::Success {
                        return Err(format!("a batch ended {}: {}", completion.status.name(), completion.detail));
                    }
                    waiting -= 1;
                }
            }
        }
        Ok(())
    }
}

/// Every range the senders' batches write, as write records (ranges that continue one another merged), computed
/// from the entries' runs, not element by element (a wave of the seed's load is millions of elements).
fn write_records<N>(senders: &[Sender<N>]) -> Result<Vec<WriteRecord>, SeamError> {
    let mut writes: Vec<WriteRecord> = Vec::new();
    for sender in senders {
        for (_, target, batch) in &sender.batches {
            record_spans(&mut writes, *target, batch)?;
        }
    }
    Ok(writes)
}

/// The decode bytes `batch` writes on rank `target`, appended to `writes` (runs that continue the last one joined).
fn record_spans(writes: &mut Vec<WriteRecord>, target: RankId, batch: &Batch) -> Result<(), SeamError> {
    batch
        .remote_spans(|region, offset, length| {
            let target = RegionKey { side: Side::Decode, rank: target, region };
            match writes.last_mut() {
                Some(last) if last.target == target && last.offset + last.length == offset => {
                    last.length += length;
                }
                _ => writes.push(WriteRecord { target, offset, length }),
            }
        })
        .ok_or(SeamError::Exhausted("page table entries"))
}
