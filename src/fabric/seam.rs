//! The transfer-engine seam: what every real transfer engine can meet natively (a verbs NIC, NIXL, Mooncake's
//! Transfer Engine, a GPU copy engine), and all that kvrelay's rank engines ask of a fabric.
//!
//! - **Memory of a kind** ([`MemoryKind`]: host, or device memory of one GPU) is registered with the rank's engine,
//!   which owns it until released. The harness fills it with what a [`Fill`] gives and reads back through the engine
//!   ([`TransferEngine::read`], [`TransferEngine::release`]), so device memory needs no host mirror. A peer sees only
//!   what the owner advertises of it: a [`RemoteMemory`] (address, length, key).
//! - **A peer is reached through an opaque address** ([`PeerAddress`]): [`TransferEngine::open`] makes a connection
//!   end and says what to tell the peer (verbs: a queue pair's number, LID and GID; NIXL: the agent's metadata;
//!   Mooncake: a session id); [`TransferEngine::connect`] joins it to the peer's address and the peer's advertised
//!   memory. The bootstrap carries the addresses (the registration's engine desc, the link answer).
//! - **A transfer is a [`Batch`]** of ([`Entry`]: local memory, offset, remote memory, offset, length; [`Repeat`]ed
//!   at strides and [`Paging`]d through the batch's page tables where the engine declares it) to one
//!   connection with an optional notification, which the peer sees ([`Event::Notified`]) only after every byte of the
//!   batch landed. The engine reports **one completion per batch** ([`Event::Completed`]) with a typed
//!   [`BatchStatus`] and, where it can tell, which entries landed ([`Landed`]).
//! - **Declared limits** ([`SeamLimits`]: entries and bytes per batch, batches in flight per connection), which the
//!   rank engines respect with credits.
//!
//! Nothing here knows plans, models or the oracle, and nothing here names a queue pair: the verbs fabrics meet this
//! seam through [`super::verbs_engine::VerbsEngine`], which lowers a batch to gather-list work requests.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::time::Duration;

/// One rank's process on the fabric (its transfer engine; on a verbs NIC a protection domain, its CQ and QPs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.0)
    }
}

/// The initial contents of a region registered with [`TransferEngine::register`]: `fill(offset, out)` writes the
/// region's bytes from byte `offset` on into `out` (any offset, any length; the same bytes every time).
pub type Fill = std::sync::Arc<dyn Fn(u64, &mut [u8]) + Send + Sync>;

/// Contents an engine can generate where its memory lives (on the GPU for device memory) instead of being handed
/// bytes: the self-describing source pattern or the decode sentinel (`crate::verify::pattern`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pattern {
    /// Source region `number`'s pattern (word `w` is `1 << 63 | number << 40 | w`).
    Source { number: u32 },
    /// The decode sentinel.
    Sentinel,
}

impl Pattern {
    /// The same contents as a [`Fill`], for engines that are handed bytes.
    pub fn fill(self) -> Fill {
        use crate::verify::pattern;
        match self {
            Pattern::Source { number } => {
                std::sync::Arc::new(move |offset, out: &mut [u8]| pattern::fill_source_at(number, offset, out))
            }
            Pattern::Sentinel => std::sync::Arc::new(pattern::fill_sentinel_at),
        }
    }
}

/// One comparison of kept memory with a pattern: `len` bytes of kept memory `handle` from `start` on, as blocks of
/// `block` bytes back to back (`block == len`: one block), hold `pattern`'s bytes: block `k` from the pattern's byte
/// `pattern_offset + k * pattern_stride` on (both ignored for the sentinel, which is the same everywhere). A run of
/// rows gathered from strided source rows is one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Check {
    pub handle: u64,
    pub start: u64,
    pub len: u64,
    pub block: u64,
    pub pattern: Pattern,
    pub pattern_offset: u64,
    pub pattern_stride: u64,
}

/// Rows `target, target + 1, ...` (`count` of them) hold the pattern's rows `source, source + step, ...`: a run of
/// token rows, as every layer of one rank receives it, so one table of runs serves many [`RowsCheck`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RowRun {
    pub target: u64,
    pub source: u64,
    pub count: u64,
    pub step: u64,
}

/// Every run of table `table` (an index into the tables given with the check) in kept memory `handle`, as whole
/// rows of `row` bytes: target row `r` holds `pattern`'s bytes from `s * pattern_row` on, `s` its source row (the
/// sentinel ignores sources). One check stands for as many [`Check`]s as its table has runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RowsCheck {
    pub handle: u64,
    pub table: u32,
    pub row: u64,
    pub pattern: Pattern,
    pub pattern_row: u64,
}

impl RowsCheck {
    /// The check of one run, as a plain [`Check`] (`None`: its byte offsets overflow).
    pub fn run(&self, run: &RowRun) -> Option<Check> {
        Some(Check {
            handle: self.handle,
            start: run.target.checked_mul(self.row)?,
            len: run.count.checked_mul(self.row)?,
            block: self.row,
            pattern: self.pattern,
            pattern_offset: run.source.checked_mul(self.pattern_row)?,
            pattern_stride: run.step.checked_mul(self.pattern_row)?,
        })
    }
}

/// Memory that compares itself with patterns where it lives (a GPU compares its own memory) and reads parts back.
pub trait Compare: Send + Sync {
    /// Whether each check holds, in order (`Err`: the device failed; its words).
    fn compare(&self, checks: &[Check]) -> Result<Vec<bool>, String>;
    /// Whether each of `checks` and then each of `rows` holds, in that order, in one go: a memory that walks tables
    /// of runs itself (the GPU) overrides it; this one asks every run as a plain check. A table index past `tables`
    /// or a run outside the memory is an `Err`.
    fn compare_with_rows(
        &self,
        checks: &[Check],
        tables: &[&[RowRun]],
        rows: &[RowsCheck],
    ) -> Result<Vec<bool>, String> {
        let mut plain = checks.to_vec();
        let mut owner = Vec::new();
        for (index, check) in rows.iter().enumerate() {
            let table = tables.get(check.table as usize).ok_or_else(|| format!("no table {} of runs", check.table))?;
            for run in table.iter() {
                let checked =
                    check.run(run).ok_or_else(|| format!("run {run:?} of {}-byte rows overflows", check.row))?;
                plain.push(checked);
                owner.push(checks.len() + index);
            }
        }
        let answers = self.compare(&plain)?;
        if answers.len() != plain.len() {
            return Err(format!("{} answers to {} checks", answers.len(), plain.len()));
        }
        let mut res = answers[..checks.len()].to_vec();
        res.resize(checks.len() + rows.len(), true);
        for (answer, index) in answers[checks.len()..].iter().zip(owner) {
            res[index] &= *answer;
        }
        Ok(res)
    }
    /// Copies `out.len()` bytes of kept memory `handle` from `start` on into `out`.
    fn read(&self, handle: u64, start: u64, out: &mut [u8]) -> Result<(), String>;
    /// Where it lives, for reports (`cuda GPU 0`).
    fn name(&self) -> String;
}

/// Memory an engine deregistered but kept where it lives ([`TransferEngine::resident`]): compared through
/// `compare` under `handle`; freed when the last clone of `keep` goes.
#[derive(Clone)]
pub struct Kept {
    pub compare: std::sync::Arc<dyn Compare>,
    pub handle: u64,
    pub len: u64,
    pub keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

impl fmt::Debug for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Kept({} bytes on {})", self.len, self.compare.name())
    }
}

/// Where registered memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum MemoryKind {
    /// Host memory (DRAM).
    #[default]
    Host,
    /// Device memory of GPU `gpu` (its index on the host).
    Device { gpu: u32 },
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => write!(f, "host"),
            MemoryKind::Device { gpu } => write!(f, "device (GPU {gpu})"),
        }
    }
}

/// Memory registered with one engine: `id` names it in this engine's [`Entry::local`]; `addr`, `len` and `key` are
/// what the owner advertises to peers ([`Memory::remote`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Memory {
    pub id: u32,
    pub kind: MemoryKind,
    /// The address a peer writes to (never zero).
    pub addr: u64,
    pub len: u64,
    /// What a peer needs beside the address (verbs: the rkey; engines without keys: 0).
    pub key: u32,
}

impl Memory {
    /// What a peer is told of this memory.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory { addr: self.addr, len: self.len, key: self.key }
    }
}

/// A peer's memory as it advertised it: writes land at `addr + offset` for offsets within `len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RemoteMemory {
    pub addr: u64,
    pub len: u64,
    pub key: u32,
}

/// What a rank tells a peer so that the peer can reach it: opaque bytes, meaningful only to the same kind of engine.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PeerAddress(pub Vec<u8>);

impl fmt::Display for PeerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(text) if text.bytes().all(|byte| byte.is_ascii_graphic()) => write!(f, "{text}"),
            _ => write!(f, "{} bytes", self.0.len()),
        }
    }
}

/// One end of a connection, unique within its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u32);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "connection {}", self.0)
    }
}

/// A submitted batch, unique within its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BatchId(pub u64);

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch {}", self.0)
    }
}

/// `len` bytes of local memory `local` from `local_offset` to the peer's advertised memory number `remote` (its
/// index in the list given to [`TransferEngine::connect`]) from `remote_offset`; [`Repeat`]ed at strides on both
/// sides where the engine takes strided entries ([`SeamLimits::strided`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Entry {
    pub local: u32,
    pub local_offset: u64,
    pub remote: u32,
    pub remote_offset: u64,
    /// Bytes of one element (the whole entry when it is not repeated).
    pub len: u64,
    pub repeat: Repeat,
    /// The page tables the offsets go through, if any ([`Paging`]).
    pub paging: Paging,
}

/// Which of the batch's [`PageTable`]s ([`Batch::tables`]) an entry's offsets (and strides) on each side are
/// logical bytes of: logical byte `l` of a table with `item_len`-byte items lies at region byte `pages[l /
/// item_len] * item_len + l % item_len`. What a GPU kernel that addresses a KV cache by page index takes natively,
/// and the tables the peers already exchange (domain.md §2.3: the prefill rank's pages, the decode's
/// `dst_kv_indices`): a DCP relayout over the allocator's shuffled pages is then one entry per decode rank, layer and
/// chunk (`plan::paged`). No element crosses an item on a paged side. Only an engine declaring
/// [`SeamLimits::paged`] is handed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Paging {
    pub local: Option<u32>,
    pub remote: Option<u32>,
}

impl Paging {
    /// Physical offsets on both sides.
    pub const NONE: Paging = Paging { local: None, remote: None };
}

/// Items of `item_len` bytes of a region, in a request's order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PageTable {
    pub item_len: u64,
    pub pages: Vec<u32>,
}

impl PageTable {
    /// The region byte logical byte `logical` lies at, if the table lists its item (`None` on overflow).
    pub fn physical(&self, logical: u64) -> Option<u64> {
        let item = logical.checked_div(self.item_len)?;
        let page = *self.pages.get(usize::try_from(item).ok()?)?;
        u64::from(page).checked_mul(self.item_len)?.checked_add(logical % self.item_len)
    }

    /// One past the last region byte the table's items reach (`None` on overflow).
    pub fn reach(&self) -> Option<u64> {
        let last = self.pages.iter().copied().max().map_or(0, |page| u64::from(page) + 1);
        last.checked_mul(self.item_len)
    }

    /// One past the last logical byte (`None` on overflow).
    pub fn logical_len(&self) -> Option<u64> {
        (self.pages.len() as u64).checked_mul(self.item_len)
    }

    /// Whether `count` elements of `len` bytes from logical `offset` on at `stride` each stay inside one item.
    pub fn keeps_in_items(&self, offset: u64, stride: u64, len: u64, count: u64) -> bool {
        let item = self.item_len;
        if item == 0 || len > item {
            return count == 0 || len == 0;
        }
        let fits = |at: u64| at % item + len <= item;
        if count <= 1 || stride % item == 0 {
            return count == 0 || fits(offset);
        }
        if item % stride == 0 && offset % stride + len <= stride {
            return true; // every item boundary is a multiple of the stride, and no element crosses one
        }
        (0..count).all(|k| fits(offset + k * stride))
    }
}

/// An entry's elements: `count` of them, the k-th `k * local_stride` bytes after the first on the local side and
/// `k * remote_stride` on the remote side. What a GPU copy engine (`cuMemcpy2D`'s pitches) or a gather kernel
/// takes natively, and a NIC through strided memory keys: one entry for a DCP relayout's every-DCP-th row
/// (domain.md §2.4) instead of one per row. Engines that do not declare [`SeamLimits::strided`] are never handed
/// one (a rank engine lowers it to single elements first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Repeat {
    pub count: u64,
    pub local_stride: u64,
    pub remote_stride: u64,
}

impl Repeat {
    /// One element: a plain entry.
    pub const ONCE: Repeat = Repeat { count: 1, local_stride: 0, remote_stride: 0 };
}

impl Entry {
    /// A plain (unrepeated) entry.
    pub fn new(local: u32, local_offset: u64, remote: u32, remote_offset: u64, len: u64) -> Entry {
        Entry { local, local_offset, remote, remote_offset, len, repeat: Repeat::ONCE, paging: Paging::NONE }
    }

    /// Bytes moved (`None` on overflow).
    pub fn bytes(&self) -> Option<u64> {
        self.len.checked_mul(self.repeat.count)
    }

    /// One past the last byte touched from `offset` on at `stride` (`None` on overflow; `offset` for no element).
    fn end(&self, offset: u64, stride: u64) -> Option<u64> {
        match self.repeat.count {
            0 => Some(offset),
            count => (count - 1).checked_mul(stride)?.checked_add(offset)?.checked_add(self.len),
        }
    }

    /// One past the last local byte the entry reads (`None` on overflow).
    pub fn local_end(&self) -> Option<u64> {
        self.end(self.local_offset, self.repeat.local_stride)
    }

    /// One past the last remote byte the entry writes (`None` on overflow).
    pub fn remote_end(&self) -> Option<u64> {
        self.end(self.remote_offset, self.repeat.remote_stride)
    }

    /// The k-th element as a plain entry (offsets still logical where the entry is paged).
    pub fn element(&self, k: u64) -> Entry {
        Entry::new(
            self.local,
            self.local_offset + k * self.repeat.local_stride,
            self.remote,
            self.remote_offset + k * self.repeat.remote_stride,
            self.len,
        )
    }

    /// Every element as a plain entry, in order (the entry itself when it is not repeated).
    pub fn elements(&self) -> impl Iterator<Item = Entry> + '_ {
        (0..self.repeat.count).map(|k| self.element(k))
    }
}

/// Writes to one peer, with an optional notification the peer sees after all of them landed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Batch {
    pub entries: Vec<Entry>,
    pub notify: Option<u32>,
    /// The page tables paged entries name ([`Paging`]).
    pub tables: Vec<PageTable>,
}

impl Batch {
    /// The bytes the batch moves (`None` if the sum overflows).
    pub fn byte_len(&self) -> Option<u64> {
        self.entries.iter().try_fold(0u64, |total, entry| total.checked_add(entry.bytes()?))
    }

    /// A batch of `entries` with no notification and no page table.
    pub fn of(entries: Vec<Entry>) -> Batch {
        Batch { entries, notify: None, tables: Vec::new() }
    }

    /// Whether an entry is repeated ([`Repeat`]).
    pub fn strided(&self) -> bool {
        self.entries.iter().any(|entry| entry.repeat != Repeat::ONCE)
    }

    /// Whether an entry is paged ([`Paging`]).
    pub fn paged(&self) -> bool {
        self.entries.iter().any(|entry| entry.paging != Paging::NONE)
    }

    /// Every remote byte range the batch writes, in entry order, as (remote memory, physical offset, length):
    /// elements that follow one another on the remote side given as one range, cut where a paged side's item ends.
    /// The same bytes in the same order as [`Batch::physical_elements`]' remote ranges, without an entry per
    /// element. `None` where a paged offset is outside its table or a length overflows.
    pub fn remote_spans(&self, mut span: impl FnMut(u32, u64, u64)) -> Option<()> {
        for entry in &self.entries {
            let table = match entry.paging.remote {
                Some(index) => Some(self.tables.get(index as usize)?),
                None => None,
            };
            let Repeat { count, remote_stride, .. } = entry.repeat;
            // Elements whose remote bytes follow one another are one run.
            let (runs, run_len, run_stride) = if count > 1 && remote_stride != entry.len {
                (count, entry.len, remote_stride)
            } else {
                (count.min(1), entry.bytes()?, 0)
            };
            for k in 0..runs {
                let start = k.checked_mul(run_stride)?.checked_add(entry.remote_offset)?;
                let mut done = 0;
                while done < run_len {
                    let at = start.checked_add(done)?;
                    let take = table
                        .map_or(run_len - done, |t| (t.item_len.max(1) - at % t.item_len.max(1)).min(run_len - done));
                    let physical = match table {
                        Some(t) => t.physical(at)?,
                        None => at,
                    };
                    span(entry.remote, physical, take);
                    done += take;
                }
            }
        }
        Some(())
    }

    /// Every element of every entry as a plain entry with physical offsets, in order: what an engine that takes
    /// neither strided nor paged entries is handed instead. `None` where a paged offset is outside its table.
    pub fn physical_elements(&self) -> Option<Vec<Entry>> {
        let mut out = Vec::new();
        for entry in &self.entries {
            let table = |index: Option<u32>| match index {
                Some(index) => self.tables.get(index as usize).map(Some),
                None => Some(None),
            };
            let (local, remote) = (table(entry.paging.local)?, table(entry.paging.remote)?);
            for element in entry.elements() {
                let mut done = 0;
                // An element stays inside one item on a paged side; cut it where an item ends anyway.
                while done < element.len {
                    let (from, to) = (element.local_offset + done, element.remote_offset + done);
                    let room = |table: Option<&PageTable>, at: u64| {
                        table.map_or(u64::MAX, |t| t.item_len - at % t.item_len.max(1))
                    };
                    let take = (element.len - done).min(room(local, from)).min(room(remote, to)).max(1);
                    let physical = |table: Option<&PageTable>, at: u64| table.map_or(Some(at), |t| t.physical(at));
                    out.push(Entry::new(
                        element.local,
                        physical(local, from)?,
                        element.remote,
                        physical(remote, to)?,
                        take,
                    ));
                    done += take;
                }
            }
        }
        Some(out)
    }
}

/// How a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BatchStatus {
    /// Every byte landed.
    Success,
    /// A local range is outside its registered memory.
    LocalProtection,
    /// A remote range is outside the peer's advertised memory, or its key is wrong.
    RemoteAccess,
    /// The peer did not answer.
    Unreachable,
    /// The batch did not run (or stopped): cancelled, or behind an earlier failure on its connection.
    Aborted,
}

impl BatchStatus {
    pub fn name(self) -> &'static str {
        match self {
            BatchStatus::Success => "success",
            BatchStatus::LocalProtection => "local_protection",
            BatchStatus::RemoteAccess => "remote_access",
            BatchStatus::Unreachable => "unreachable",
            BatchStatus::Aborted => "aborted",
        }
    }
}

/// Which entries of a batch are known to have landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Landed {
    /// Every entry (a successful batch).
    All,
    /// These ranges of entry indices, sorted and disjoint (possibly none).
    Entries(Vec<Range<u32>>),
    /// The engine cannot tell: callers treat every target byte of the batch as undefined.
    Unknown,
}

/// One batch's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub conn: ConnId,
    pub batch: BatchId,
    pub status: BatchStatus,
    pub landed: Landed,
    /// The engine's own words for a failure (empty on success), e.g. `work request 3 completed with RetryExceeded`.
    pub detail: String,
}

/// What [`TransferEngine::poll`] hands out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A batch this engine submitted ended.
    Completed(Completion),
    /// A peer's batch with a notification landed here whole, on this engine's end `conn`.
    Notified { conn: ConnId, tag: u32 },
}

/// What an engine accepts: a rank engine never submits more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeamLimits {
    /// Most entries in one batch.
    pub max_entries: usize,
    /// Most bytes in one batch.
    pub max_batch_bytes: u64,
    /// Most batches in flight (submitted, not completed) on one connection.
    pub batches_in_flight: usize,
    /// Whether entries may be [`Repeat`]ed (strided): the engine executes them natively.
    pub strided: bool,
    /// Whether entries may be [`Paging`]d through the batch's page tables: the engine executes them natively.
    pub paged: bool,
}

impl SeamLimits {
    /// No limit an engine needs to respect (an engine that queues internally).
    pub const UNLIMITED: SeamLimits = SeamLimits {
        max_entries: usize::MAX,
        max_batch_bytes: u64::MAX,
        batches_in_flight: usize::MAX,
        strided: false,
        paged: false,
    };
}

/// Whether a cancelled batch may still land bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// Nothing more of it will land and no completion will come for it.
    Whole,
    /// Parts are on the wire: its completion (usually [`BatchStatus::Aborted`]) comes once they settled.
    Draining,
    /// It already ended (its completion was or will be handed out).
    Ended,
}

/// The kind of a [`SeamError`], for callers that match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SeamErrorKind {
    UnknownMemory,
    UnknownConnection,
    NotConnected,
    AlreadyConnected,
    BadAddress,
    OverLimits,
    Strided,
    OutOfRange,
    Exhausted,
    Engine,
}

/// Why an engine call failed (as opposed to a batch completing in error). A failed submit submitted nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeamError {
    #[error("memory {0} is not registered with this engine: use the id its register returned")]
    UnknownMemory(u32),
    #[error("{0} does not exist on this engine: use a connection open returned")]
    UnknownConnection(ConnId),
    #[error("{0} is not connected: call connect with the peer's address first")]
    NotConnected(ConnId),
    #[error("{0} is already connected: open another end for another peer")]
    AlreadyConnected(ConnId),
    #[error("the peer address `{address}` is not one this engine understands: {why}")]
    BadAddress { address: String, why: String },
    #[error("a batch of {entries} entries and {bytes} bytes exceeds the engine's limits ({max_entries} entries, {max_bytes} bytes): split it")]
    OverLimits { entries: usize, bytes: u64, max_entries: usize, max_bytes: u64 },
    #[error("entry {entry} repeats {count} times at strides {local_stride}/{remote_stride}, and this engine takes no strided entries: submit each element as its own entry")]
    Strided { entry: usize, count: u64, local_stride: u64, remote_stride: u64 },
    #[error("entry {entry} is paged ({why}): {fix}")]
    Paged { entry: usize, why: String, fix: &'static str },
    #[error("bytes {offset}..{offset}+{len} are outside the {region_len}-byte memory: stay within the memory")]
    OutOfRange { offset: u64, len: u64, region_len: u64 },
    #[error("the engine ran out of {0}: use fewer registrations or connections")]
    Exhausted(&'static str),
    /// The engine below (a NIC, a library) refused the call; its own words.
    #[error("the transfer engine refused {call}: {message}")]
    Engine { call: &'static str, message: String },
}

impl SeamError {
    pub fn kind(&self) -> SeamErrorKind {
        match self {
            SeamError::UnknownMemory(_) => SeamErrorKind::UnknownMemory,
            SeamError::UnknownConnection(_) => SeamErrorKind::UnknownConnection,
            SeamError::NotConnected(_) => SeamErrorKind::NotConnected,
            SeamError::AlreadyConnected(_) => SeamErrorKind::AlreadyConnected,
            SeamError::BadAddress { .. } => SeamErrorKind::BadAddress,
            SeamError::OverLimits { .. } => SeamErrorKind::OverLimits,
            SeamError::Strided { .. } | SeamError::Paged { .. } => SeamErrorKind::Strided,
            SeamError::OutOfRange { .. } => SeamErrorKind::OutOfRange,
            SeamError::Exhausted(_) => SeamErrorKind::Exhausted,
            SeamError::Engine { .. } => SeamErrorKind::Engine,
        }
    }

    /// Checks `batch` against `limits` ([`SeamError::OverLimits`], [`SeamError::Strided`]).
    pub fn check_limits(batch: &Batch, limits: SeamLimits) -> Result<(), SeamError> {
        if !limits.strided {
            if let Some((entry, repeated)) =
                batch.entries.iter().enumerate().find(|(_, entry)| entry.repeat != Repeat::ONCE)
            {
                let Repeat { count, local_stride, remote_stride } = repeated.repeat;
                return Err(SeamError::Strided { entry, count, local_stride, remote_stride });
            }
        }
        if batch.paged() {
            check_paging(batch, limits)?;
        }
        let bytes = batch.byte_len().unwrap_or(u64::MAX);
        if batch.entries.len() > limits.max_entries || bytes > limits.max_batch_bytes {
            return Err(SeamError::OverLimits {
                entries: batch.entries.len(),
                bytes,
                max_entries: limits.max_entries,
                max_bytes: limits.max_batch_bytes,
            });
        }
        Ok(())
    }
}

/// The paged entries of `batch` against `limits` and its tables: declared, naming a table the batch carries, inside
/// the table's logical bytes, no element across an item.
fn check_paging(batch: &Batch, limits: SeamLimits) -> Result<(), SeamError> {
    for (index, entry) in batch.entries.iter().enumerate() {
        if entry.paging == Paging::NONE {
            continue;
        }
        let refuse = |why: String, fix| Err(SeamError::Paged { entry: index, why, fix });
        if !limits.paged {
            return refuse(
                "this engine takes no paged entries".to_owned(),
                "submit the entry's elements at their physical offsets (Batch::physical_elements)",
            );
        }
        let sides = [
            (entry.paging.local, entry.local_offset, entry.repeat.local_stride, entry.local_end()),
            (entry.paging.remote, entry.remote_offset, entry.repeat.remote_stride, entry.remote_end()),
        ];
        for (table, offset, stride, end) in sides {
            let Some(table) = table else { continue };
            let Some(pages) = batch.tables.get(table as usize) else {
                let tables = batch.tables.len();
                return refuse(format!("it names table {table} of {tables}"), "name a table the batch carries");
            };
            if end.zip(pages.logical_len()).is_none_or(|(end, len)| end > len) {
                return refuse(format!("it reaches past table {table}'s logical bytes"), "stay within the table");
            }
            if !pages.keeps_in_items(offset, stride, entry.len, entry.repeat.count) {
                return refuse(format!("an element crosses an item of table {table}"), "cut elements at items");
            }
        }
    }
    Ok(())
}

/// A released region's bytes: the chunks the engine can tell were touched, by start offset; a byte in no chunk
/// still holds what the memory was registered with. One chunk of every byte when the engine cannot tell.
pub type Image = BTreeMap<u64, Vec<u8>>;

/// One rank's transfer engine.
///
/// Semantics every implementation keeps (`crate::certify::conformance` checks them through the seam):
/// - **Submitting** is non-blocking and all or nothing: a batch over the limits, naming unknown memory or an
///   unconnected end, is refused and nothing of it runs. [`TransferEngine::flush`] lets everything submitted
///   since the last flush start (a doorbell; engines that start at submit need not do anything).
/// - **One completion per batch**, whatever happened, unless it was cancelled [`Cancelled::Whole`]. After a
///   batch's completion no byte of it lands any more. A failed batch's target bytes are undefined except the entries
///   its [`Landed`] names.
/// - **Notification.** A batch's notification reaches the peer only after every byte of the batch landed.
/// - **Protection.** A byte outside every entry's target range never changes.
/// - **Memory.** Only the owner reads or releases its memory; peers reach it only through its advertised
///   [`RemoteMemory`].
pub trait TransferEngine {
    /// Which rank's process this engine is.
    fn node(&self) -> NodeId;
    /// What a rank engine may submit.
    fn limits(&self) -> SeamLimits;
    /// Registers `len` bytes of memory of `kind` holding what `fill` gives. `item_len` is the unit the memory is
    /// used in (a page of one layer, a state slot; 0 when none): an engine that materialises memory lazily sizes its
    /// chunks in whole items.
    fn register(&mut self, kind: MemoryKind, len: u64, item_len: u64, fill: Fill) -> Result<Memory, SeamError>;
    /// [`TransferEngine::register`] of memory holding `pattern`, which an engine may generate where the memory
    /// lives (by default it is handed the pattern's bytes).
    fn register_pattern(
        &mut self,
        kind: MemoryKind,
        len: u64,
        item_len: u64,
        pattern: Pattern,
    ) -> Result<Memory, SeamError> {
        self.register(kind, len, item_len, pattern.fill())
    }
    /// The kind of memory this engine's ranks register their regions in (host by default; a device fabric's GPU).
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    /// Deregisters `memory` but keeps its bytes where they live, to be compared there with patterns ([`Kept`]);
    /// `None` when this engine has no such path (the caller releases it and reads its bytes).
    fn resident(&mut self, memory: &Memory) -> Option<Kept> {
        let _ = memory;
        None
    }
    /// Copies `out.len()` bytes of this engine's memory `memory` from `offset` into `out` (through the device for
    /// device memory).
    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError>;
    /// Deregisters `memory` and hands back its bytes as an [`Image`] (`sparse`: only the chunks the engine knows
    /// were touched; otherwise one chunk of every byte).
    fn release(&mut self, memory: &Memory, sparse: bool) -> Result<Image, SeamError>;
    /// A new connection end and the address the peer must be told.
    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError>;
    /// Joins end `conn` to the peer at `peer`, whose advertised memory is `remote` (numbered as [`Entry::remote`];
    /// empty for an end that only receives).
    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError>;
    /// Submits `batch` on `conn` (see the trait's **Submitting**).
    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError>;
    /// Starts everything submitted since the last flush.
    fn flush(&mut self) {}
    /// Stops `batch` as far as it can (see [`Cancelled`]).
    fn cancel(&mut self, batch: BatchId) -> Cancelled;
    /// Moves up to `max` events into `out` (appending) and returns how many; never blocks.
    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize;
    /// Blocks until an event may be ready or `timeout` passed; `true` when one may be ready. Engines on simulated
    /// time return `false` at once and their driver advances the world.
    fn wait(&mut self, timeout: Duration) -> bool {
        let _ = timeout;
        false
    }
    /// Whether this engine's process crashed (a simulated fault): its rank processes nothing more.
    fn crashed(&self) -> bool {
        false
    }
    /// How many operations the engine issued below the seam so far (verbs: work requests posted; a descriptor-list
    /// engine: descriptors), for reports; 0 when it does not count.
    fn operations(&self) -> u64 {
        0
    }
}

impl<T: TransferEngine + ?Sized> TransferEngine for Box<T> {
    fn node(&self) -> NodeId {
        (**self).node()
    }
    fn limits(&self) -> SeamLimits {
        (**self).limits()
    }
    fn register(&mut self, kind: MemoryKind, len: u64, item_len: u64, fill: Fill) -> Result<Memory, SeamError> {
        (**self).register(kind, len, item_len, fill)
    }
    fn register_pattern(
        &mut self,
        kind: MemoryKind,
        len: u64,
        item_len: u64,
        pattern: Pattern,
    ) -> Result<Memory, SeamError> {
        (**self).register_pattern(kind, len, item_len, pattern)
    }
    fn memory_kind(&self) -> MemoryKind {
        (**self).memory_kind()
    }
    fn resident(&mut self, memory: &Memory) -> Option<Kept> {
        (**self).resident(memory)
    }
    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        (**self).read(memory, offset, out)
    }
    fn release(&mut self, memory: &Memory, sparse: bool) -> Result<Image, SeamError> {
        (**self).release(memory, sparse)
    }
    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError> {
        (**self).open()
    }
    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError> {
        (**self).connect(conn, peer, remote)
    }
    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError> {
        (**self).submit(conn, batch)
    }
    fn flush(&mut self) {
        (**self).flush()
    }
    fn cancel(&mut self, batch: BatchId) -> Cancelled {
        (**self).cancel(batch)
    }
    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        (**self).poll(out, max)
    }
    fn wait(&mut self, timeout: Duration) -> bool {
        (**self).wait(timeout)
    }
    fn crashed(&self) -> bool {
        (**self).crashed()
    }
    fn operations(&self) -> u64 {
        (**self).operations()
    }
}
