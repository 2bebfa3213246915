//! Any verbs [`Endpoint`] (the in-memory `SimWorld`, `rdma`, a C plug-in) as a [`TransferEngine`]: a connection end
//! is a reliable-connected queue pair (its address is [`QpInfo::to_text`]); a batch is lowered to gather-list RDMA
//! WRITEs within the endpoint's [`Caps`] ([`gather`]: entries cut at `max_message`, consecutive targets merged up to
//! `max_sge`), its notification rides the last one as a WRITE_WITH_IMM; the work requests of every batch of one
//! queue pair wait in one queue and are posted within the send queue's credits at [`TransferEngine::flush`], every
//! [`SIGNAL_INTERVAL`]th and the last of each post signalled. One completion per batch: success once its last work
//! request settled, or the first error that settles one of them (the rest of its queue pair is then flushed by the
//! verbs contract, so nothing of it lands afterwards).
//!
//! Queue pairs, keys, work-request ids and completion queues stay below the seam; [`VerbsEngine::runs`] tells the
//! in-memory driver which work requests carried which batch, so that it can join the world's landing times.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::time::Duration;

use super::gather::{gather, Piece};
use super::seam::{
    Batch, BatchId, BatchStatus, Cancelled, Completion, ConnId, Event, Fill, Image, Landed, Memory, MemoryKind, NodeId,
    PeerAddress, RemoteMemory, SeamError, SeamLimits, TransferEngine,
};
use super::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, QpInfo, QpNum, RemoteAddr, Sge, WcKind, WcStatus, WorkCompletion,
    WorkRequest,
};

/// Work requests between two signalled ones (selective signalling, seams.md §1).
pub const SIGNAL_INTERVAL: usize = 64;

/// One lowered work request of a batch, waiting or in flight.
#[derive(Debug, Clone)]
struct Lowered {
    batch: BatchId,
    sges: Vec<Sge>,
    remote: RemoteAddr,
    imm: Option<u32>,
    /// The batch entries it carries bytes of.
    entries: Range<u32>,
}

/// One connection end: a queue pair.
#[derive(Debug, Default)]
struct Conn {
    connected: bool,
    remote: Vec<RemoteMemory>,
    waiting: VecDeque<Lowered>,
    in_flight: VecDeque<(u64, Lowered)>,
    /// The queue pair went to the error state: nothing more can run on it.
    broken: bool,
}

/// A batch not yet completed.
#[derive(Debug)]
struct Open {
    conn: ConnId,
    /// Its work requests not yet settled.
    left: usize,
    /// Entry ranges of work requests that settled in success.
    landed: Vec<Range<u32>>,
    cancelled: bool,
}

/// Work requests `first..=last` on `qp` carried (parts of) `batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub batch: BatchId,
    pub qp: QpNum,
    pub first: u64,
    pub last: u64,
}

/// A verbs endpoint met at the transfer-engine seam (module docs).
pub struct VerbsEngine<E: Endpoint> {
    nic: E,
    caps: Caps,
    memory: Vec<Option<MemoryRegion>>,
    conns: BTreeMap<QpNum, Conn>,
    open: BTreeMap<BatchId, Open>,
    next_batch: u64,
    next_wr: u64,
    events: VecDeque<Event>,
    /// Completions taken from the endpoint, not yet processed.
    polled: VecDeque<WorkCompletion>,
    /// The node was seen crashed: its state is forgotten when it comes back.
    restarted: bool,
    runs: Vec<Run>,
}

/// An engine that goes away takes its memory with it, as a process that dies does: every region still registered is
/// deregistered (its keys revoked), so a peer's later write to it fails instead of landing in memory nobody owns
/// (certification case `a_peer_that_dies_mid_transfer_fails_within_the_deadline`).
impl<E: Endpoint> Drop for VerbsEngine<E> {
    fn drop(&mut self) {
        for region in self.memory.iter_mut().filter_map(Option::take) {
            let _ = self.nic.deregister_sparse(&region);
        }
    }
}

impl<E: Endpoint> VerbsEngine<E> {
    pub fn new(nic: E) -> VerbsEngine<E> {
        let caps = nic.caps();
        VerbsEngine {
            nic,
            caps,
            memory: Vec::new(),
            conns: BTreeMap::new(),
            open: BTreeMap::new(),
            next_batch: 0,
            // Work request ids start at 1 (0 is what a receive completion carries).
            next_wr: 1,
            events: VecDeque::new(),
            polled: VecDeque::new(),
            restarted: false,
            runs: Vec::new(),
        }
    }

    /// The endpoint below.
    pub fn endpoint(&self) -> &E {
        &self.nic
    }

    /// Which work requests carried which batch, in post order (consecutive work requests of one batch on one queue
    /// pair in one run).
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    fn region(&self, id: u32) -> Result<MemoryRegion, SeamError> {
        self.memory.get(id as usize).copied().flatten().ok_or(SeamError::UnknownMemory(id))
    }

    /// `batch` as work requests, or why it cannot be posted.
    fn lower(&self, conn: &Conn, id: BatchId, batch: &Batch) -> Result<Vec<Lowered>, SeamError> {
        let mut pieces = Vec::with_capacity(batch.entries.len());
        for (index, entry) in batch.entries.iter().enumerate() {
            let source = self.region(entry.local)?;
            let target = conn.remote.get(entry.remote as usize).ok_or(SeamError::OutOfRange {
                offset: u64::from(entry.remote),
                len: 1,
                region_len: conn.remote.len() as u64,
            })?;
            let out_of_range = || SeamError::OutOfRange { offset: entry.remote_offset, len: entry.len, region_len: 0 };
            // The peer's address and the planned offset come from the wire: add them without wrapping.
            let source_addr = source.addr.checked_add(entry.local_offset).ok_or_else(out_of_range)?;
            let target_addr = target.addr.checked_add(entry.remote_offset).ok_or_else(out_of_range)?;
            let mut done = 0;
            while done < entry.len {
                let len = (entry.len - done).min(self.caps.max_message.max(1));
                pieces.push(Piece {
                    sge: Sge { addr: source_addr.saturating_add(done), len, lkey: source.lkey },
                    remote: RemoteAddr { addr: target_addr.saturating_add(done), rkey: target.key },
                    region: entry.remote,
                    offset: entry.remote_offset.saturating_add(done),
                    entry: index as u32,
                });
                done += len;
            }
        }
        let mut lowered: Vec<Lowered> = gather(pieces, self.caps)
            .into_iter()
            .map(|write| Lowered {
                batch: id,
                sges: write.sges,
                remote: write.remote,
                imm: None,
                entries: write.entries,
            })
            .collect();
        if let Some(tag) = batch.notify {
            match lowered.last_mut() {
                Some(last) => last.imm = Some(tag),
                // A notification alone: a zero-byte WRITE_WITH_IMM to the first advertised memory.
                None => {
                    let target = conn.remote.first().copied().unwrap_or(RemoteMemory { addr: 0, len: 0, key: 0 });
                    lowered.push(Lowered {
                        batch: id,
                        sges: Vec::new(),
                        remote: RemoteAddr { addr: target.addr, rkey: target.key },
                        imm: Some(tag),
                        entries: 0..0,
                    });
                }
            }
        }
        Ok(lowered)
    }

    /// Ends `batch` with `status` (once): its completion event, with the entries known landed.
    fn complete(&mut self, batch: BatchId, status: BatchStatus, detail: String) {
        let Some(open) = self.open.remove(&batch) else { return };
        // A cancelled batch lost its waiting work requests: only what settled in success landed.
        let whole = status == BatchStatus::Success && !open.cancelled;
        let landed = if whole { Landed::All } else { Landed::Entries(merge(open.landed)) };
        let status = if open.cancelled && status == BatchStatus::Success { BatchStatus::Aborted } else { status };
        let detail = if open.cancelled && detail.is_empty() { "cancelled".to_owned() } else { detail };
        self.events.push_back(Event::Completed(Completion { conn: open.conn, batch, status, landed, detail }));
    }

    /// One work request of `batch` settled (`ok`: it succeeded; otherwise the batch fails with `status`, `detail`).
    fn settle(&mut self, lowered: Lowered, ok: bool, status: BatchStatus, detail: &str) {
        let Some(open) = self.open.get_mut(&lowered.batch) else { return };
        open.left = open.left.saturating_sub(1);
        if ok {
            open.landed.push(lowered.entries);
            if open.left == 0 {
                self.complete(lowered.batch, BatchStatus::Success, String::new());
            }
        } else {
            self.complete(lowered.batch, status, detail.to_owned());
        }
    }

    /// A work completion from the endpoint's queue.
    fn on_completion(&mut self, completion: WorkCompletion) {
        if completion.kind == WcKind::RecvImm {
            if let Some(tag) = completion.imm {
                self.events.push_back(Event::Notified { conn: ConnId(completion.qp.0), tag });
            }
            return;
        }
        let Some(conn) = self.conns.get_mut(&completion.qp) else { return };
        if !conn.in_flight.iter().any(|(wr_id, _)| *wr_id == completion.wr_id) {
            return; // a duplicate or unknown completion: nothing of ours
        }
        // Completions arrive in order per queue pair: this one settles every unsignalled write before it.
        let mut settled = Vec::new();
        while let Some((wr_id, lowered)) = conn.in_flight.pop_front() {
            settled.push(lowered);
            if wr_id == completion.wr_id {
                break;
            }
        }
        let ok = completion.status == WcStatus::Success;
        if !ok {
            conn.broken = true;
            settled.extend(conn.waiting.drain(..));
        }
        let detail = format!("work request {} completed with {:?}", completion.wr_id, completion.status);
        let status = batch_status(completion.status);
        for lowered in settled {
            self.settle(lowered, ok, status, &detail);
        }
    }

    /// Posts waiting work requests on every queue pair as far as credits allow (module docs).
    fn pump(&mut self) {
        let depth = self.caps.sq_depth.max(1);
        let mut failed: Vec<(Lowered, String)> = Vec::new();
        for (qp, conn) in &mut self.conns {
            if conn.broken {
                // A queue pair in the error state never runs another write (verbs contract, **Errors**).
                let reason = format!("{qp} is in the error state after a failed work request");
                failed.extend(conn.waiting.drain(..).map(|lowered| (lowered, reason.clone())));
                continue;
            }
            while !conn.broken && !conn.waiting.is_empty() && conn.in_flight.len() < depth {
                let room = depth - conn.in_flight.len();
                let batch: Vec<Lowered> = conn.waiting.drain(..room.min(conn.waiting.len())).collect();
                let mut requests = Vec::with_capacity(batch.len());
                for (index, lowered) in batch.iter().enumerate() {
                    let signaled = index + 1 == batch.len() || (self.next_wr as usize) % SIGNAL_INTERVAL == 0;
                    requests.push(WorkRequest {
                        wr_id: self.next_wr,
                        sges: lowered.sges.clone(),
                        remote: lowered.remote,
                        imm: lowered.imm,
                        signaled,
                    });
                    self.next_wr += 1;
                }
                if let Err(error) = self.nic.post_send(*qp, &requests) {
                    failed.extend(batch.into_iter().map(|lowered| (lowered, format!("posting failed: {error}"))));
                    conn.broken = true;
                    break;
                }
                for (request, lowered) in requests.iter().zip(&batch) {
                    log_run(&mut self.runs, *qp, request.wr_id, lowered.batch);
                }
                conn.in_flight.extend(requests.iter().map(|request| request.wr_id).zip(batch));
            }
        }
        for (lowered, reason) in failed {
            self.settle(lowered, false, BatchStatus::Aborted, &reason);
        }
    }
}

/// Appends work request `wr_id` of `batch` on `qp` to the run log, extending the last run when it continues it.
fn log_run(runs: &mut Vec<Run>, qp: QpNum, wr_id: u64, batch: BatchId) {
    if let Some(last) = runs.last_mut() {
        if (last.qp, last.batch) == (qp, batch) && last.last + 1 == wr_id {
            last.last = wr_id;
            return;
        }
    }
    runs.push(Run { batch, qp, first: wr_id, last: wr_id });
}

/// Sorted, disjoint ranges covering what `ranges` cover.
fn merge(mut ranges: Vec<Range<u32>>) -> Vec<Range<u32>> {
    ranges.sort_unstable_by_key(|range| (range.start, range.end));
    let mut merged: Vec<Range<u32>> = Vec::new();
    for range in ranges.into_iter().filter(|range| !range.is_empty()) {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

/// A verbs completion status as a batch status.
fn batch_status(status: WcStatus) -> BatchStatus {
    match status {
        WcStatus::Success => BatchStatus::Success,
        WcStatus::LocalProtection => BatchStatus::LocalProtection,
        WcStatus::RemoteAccess => BatchStatus::RemoteAccess,
        WcStatus::RetryExceeded => BatchStatus::Unreachable,
        WcStatus::Flushed => BatchStatus::Aborted,
    }
}

/// A verbs call's refusal at the seam.
fn refused(call: &'static str, error: FabricError) -> SeamError {
    match error {
        FabricError::Exhausted(what) => SeamError::Exhausted(what),
        FabricError::OutOfRegion { offset, len, region_len } => SeamError::OutOfRange { offset, len, region_len },
        error => SeamError::Engine { call, message: error.to_string() },
    }
}

impl<E: Endpoint> TransferEngine for VerbsEngine<E> {
    fn node(&self) -> NodeId {
        self.nic.node()
    }

    /// The work requests of a batch queue here, so a rank engine may submit without limit.
    fn limits(&self) -> SeamLimits {
        SeamLimits::UNLIMITED
    }

    fn register(&mut self, kind: MemoryKind, len: u64, item_len: u64, fill: Fill) -> Result<Memory, SeamError> {
        if kind != MemoryKind::Host {
            return Err(SeamError::Engine {
                call: "register",
                message: format!("a verbs endpoint registers host memory only, not {kind}"),
            });
        }
        let region = self.nic.register_filled(len, item_len, fill).map_err(|error| refused("register", error))?;
        let id = u32::try_from(self.memory.len()).map_err(|_| SeamError::Exhausted("memory ids"))?;
        self.memory.push(Some(region));
        Ok(Memory { id, kind, addr: region.addr, len: region.len, key: region.rkey })
    }

    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        let region = self.region(memory.id)?;
        self.nic.read_local(&region, offset, out).map_err(|error| refused("read", error))
    }

    fn release(&mut self, memory: &Memory, sparse: bool) -> Result<Image, SeamError> {
        let region = self.region(memory.id)?;
        let image = if sparse {
            self.nic.deregister_sparse(&region)
        } else {
            self.nic.deregister(&region).map(|bytes| BTreeMap::from([(0, bytes)]))
        };
        self.memory[memory.id as usize] = None;
        image.map_err(|error| refused("release", error))
    }

    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError> {
        let qp = self.nic.create_qp().map_err(|error| refused("open", error))?;
        self.conns.insert(qp.qpn, Conn::default());
        Ok((ConnId(qp.qpn.0), PeerAddress(qp.to_text().into_bytes())))
    }

    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError> {
        let qp = QpNum(conn.0);
        let bad = |why: &str| SeamError::BadAddress { address: peer.to_string(), why: why.to_owned() };
        let text = std::str::from_utf8(&peer.0).map_err(|_| bad("not a queue pair's text"))?;
        let info = QpInfo::from_text_suffix(text)
            .filter(|info| info.to_text() == text)
            .ok_or_else(|| bad("expected node<N>-qp<Q>-lid<L>-gid<32 hex digits>"))?;
        let state = self.conns.get_mut(&qp).ok_or(SeamError::UnknownConnection(conn))?;
        if state.connected {
            return Err(SeamError::AlreadyConnected(conn));
        }
        self.nic.connect_qp(qp, info).map_err(|error| refused("connect", error))?;
        state.connected = true;
        state.remote = remote.to_vec();
        Ok(())
    }

    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError> {
        SeamError::check_limits(&batch, self.limits())?;
        let qp = QpNum(conn.0);
        let state = self.conns.get(&qp).ok_or(SeamError::UnknownConnection(conn))?;
        if !state.connected {
            return Err(SeamError::NotConnected(conn));
        }
        let id = BatchId(self.next_batch);
        let lowered = self.lower(state, id, &batch)?;
        self.next_batch += 1;
        self.open.insert(id, Open { conn, left: lowered.len(), landed: Vec::new(), cancelled: false });
        if lowered.is_empty() {
            self.complete(id, BatchStatus::Success, String::new());
        }
        self.conns.get_mut(&qp).expect("checked above").waiting.extend(lowered);
        Ok(id)
    }

    fn flush(&mut self) {
        self.pump();
    }

    fn cancel(&mut self, batch: BatchId) -> Cancelled {
        let Some(open) = self.open.get_mut(&batch) else { return Cancelled::Ended };
        let conn = self.conns.get_mut(&QpNum(open.conn.0)).expect("a batch's connection exists");
        let before = conn.waiting.len();
        conn.waiting.retain(|lowered| lowered.batch != batch);
        open.left -= before - conn.waiting.len();
        open.cancelled = true;
        if open.left == 0 {
            self.open.remove(&batch);
            return Cancelled::Whole;
        }
        Cancelled::Draining
    }

    /// Completions are taken one at a time: one that ends no batch lets the queue pairs post at once (its freed
    /// credits), one that ends batches returns their events first, so that the rank engine reacts (cancels) before
    /// the next [`TransferEngine::flush`] posts more.
    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        if self.nic.crashed() {
            // A crashed process runs no code; when it comes back it is a new process with a new engine.
            self.restarted = true;
            let mut dropped = Vec::new();
            while self.nic.poll_cq(&mut dropped, 4096) > 0 {
                dropped.clear();
            }
            return 0;
        }
        if self.restarted {
            self.restarted = false;
            self.conns.clear();
            self.open.clear();
            self.events.clear();
            self.polled.clear();
        }
        while self.events.is_empty() {
            if self.polled.is_empty() {
                let mut completions = Vec::new();
                while self.nic.poll_cq(&mut completions, 4096) > 0 {}
                self.polled.extend(completions);
            }
            let Some(completion) = self.polled.pop_front() else { break };
            self.on_completion(completion);
            if self.events.is_empty() {
                self.pump();
            }
        }
        let count = max.min(self.events.len());
        out.extend(self.events.drain(..count));
        count
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        !self.events.is_empty() || self.nic.wait(timeout)
    }

    fn crashed(&self) -> bool {
        self.nic.crashed()
    }

    /// Work requests posted.
    fn operations(&self) -> u64 {
        self.next_wr - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::seam::Entry;
    use crate::fabric::world::SimWorld;
    use std::sync::Arc;

    const CAPS: Caps = Caps { max_sge: 2, max_message: 256, sq_depth: 4 };

    fn pair(
    ) -> (VerbsEngine<crate::fabric::world::SimEndpoint>, VerbsEngine<crate::fabric::world::SimEndpoint>, SimWorld)
    {
        let world = SimWorld::new(CAPS);
        (VerbsEngine::new(world.endpoint(NodeId(0))), VerbsEngine::new(world.endpoint(NodeId(1))), world)
    }

    fn filled(byte: u8) -> Fill {
        Arc::new(move |_, out: &mut [u8]| out.fill(byte))
    }

    /// A batch of many entries lands byte for byte, completes once, and its notification reaches the peer.
    #[test]
    fn a_batch_lands_completes_once_and_notifies_after_its_bytes() {
        let (mut a, mut b, world) = pair();
        let source = a.register(MemoryKind::Host, 4096, 0, filled(7)).unwrap();
        let target = b.register(MemoryKind::Host, 4096, 0, filled(0)).unwrap();
        let (conn_a, address_a) = a.open().unwrap();
        let (conn_b, address_b) = b.open().unwrap();
        a.connect(conn_a, &address_b, &[target.remote()]).unwrap();
        b.connect(conn_b, &address_a, &[]).unwrap();
        let entries: Vec<Entry> = (0..20).map(|k| Entry::new(source.id, 100 * k, 0, 200 * k, 100)).collect();
        let id = a.submit(conn_a, Batch { entries, notify: Some(9), tables: Vec::new() }).unwrap();
        a.flush();
        let mut events = Vec::new();
        for _ in 0..64 {
            world.run_until_idle();
            a.poll(&mut events, usize::MAX);
            a.flush();
        }
        let completed: Vec<&Event> = events.iter().filter(|event| matches!(event, Event::Completed(_))).collect();
        assert_eq!(completed.len(), 1, "{events:?}");
        let Event::Completed(done) = completed[0] else { unreachable!() };
        assert_eq!((done.batch, done.status, &done.landed), (id, BatchStatus::Success, &Landed::All));
        let mut notified = Vec::new();
        b.poll(&mut notified, usize::MAX);
        assert_eq!(notified, [Event::Notified { conn: conn_b, tag: 9 }]);
        let mut out = vec![0u8; 4096];
        b.read(&target, 0, &mut out).unwrap();
        for (offset, byte) in out.iter().enumerate() {
            let written = offset < 4000 && offset % 200 < 100;
            assert_eq!(*byte, if written { 7 } else { 0 }, "byte {offset}");
        }
    }

    /// A batch naming memory the peer never advertised is refused whole at submit.
    #[test]
    fn a_batch_naming_unadvertised_memory_is_refused_at_submit() {
        let (mut a, mut b, _world) = pair();
        let source = a.register(MemoryKind::Host, 64, 0, filled(1)).unwrap();
        let (conn_a, _) = a.open().unwrap();
        let (_, address_b) = b.open().unwrap();
        a.connect(conn_a, &address_b, &[]).unwrap();
        let entry = Entry::new(source.id, 0, 0, 0, 8);
        let error = a.submit(conn_a, Batch { entries: vec![entry], notify: None, tables: Vec::new() }).unwrap_err();
        assert_eq!(error.kind(), crate::fabric::seam::SeamErrorKind::OutOfRange);
    }

    #[test]
    fn merge_joins_touching_ranges() {
        assert_eq!(merge(vec![4..6, 0..2, 2..3, 8..8, 5..7]), [0..3, 4..7]);
    }
}
