//! Decode memory judged where it lives (GPU memory): the oracle asks questions, the memory's owner answers them.
//!
//! The oracle enumerates its expectations exactly as for host bytes (`expect.rs`, the same walk in [`super`]), but
//! instead of reading a resident region it asks [`Query`]s of it: "bytes `[start, end)` hold source region `number`
//! from `offset` on" and "bytes `[start, end)` are still the sentinel". The owner ([`Judge`], e.g. the `cuda`
//! fabric) answers a whole batch at once, at device speed. Bytes are read back to the host only where an answer is
//! no, to decode what they hold into the same coordinates the host oracle prints.
//!
//! Rounds: the first walk records every query and provisionally assumes yes; one [`Judge::judge`] call answers
//! them. Where every answer is yes, the first walk's verdict is final (it assumed what is true). Otherwise the
//! rank is walked again with the answers known: a failed sentinel range is then asked row by row (new queries,
//! answered in the next round), and a failed piece is read back and decoded. Nothing here reads a clock or does IO:
//! the judge is the edge.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

/// What a range of resident bytes must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Expect {
    /// Source region `number`'s pattern from its byte `offset` on (`pattern::source_word`).
    Source { number: u32, offset: u64 },
    /// Blocks of `block` bytes back to back (the query's length a multiple of it): block `k` holds source region
    /// `number`'s pattern from byte `offset + k * stride` on (a run of token rows gathered from strided rows).
    Strided { number: u32, offset: u64, block: u64, stride: u64 },
    /// The decode sentinel (`pattern::SENTINEL_WORD`), as registered.
    Sentinel,
    /// Whole rows of `row` bytes through run table `table` (one of the tables given with the queries): for every
    /// run and `k < count`, row `target + k` holds source region `number`'s bytes from `(source + k * step) *
    /// source_row` on. One question for a layer's share of a request, its table shared by every layer of the rank.
    Rows { table: u32, number: u32, row: u64, source_row: u64 },
    /// Every row of run table `table` (rows of `row` bytes) holds the sentinel.
    SentinelRows { table: u32, row: u64 },
}

/// Rows `target, target + 1, ...` (`count` of them) hold source rows `source, source + step, ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RowRun {
    pub target: u64,
    pub source: u64,
    pub count: u64,
    pub step: u64,
}

impl RowRun {
    /// Every row of the run as (target row, source row).
    pub fn each(self) -> impl Iterator<Item = (u64, u64)> {
        (0..self.count).map(move |k| (self.target + k, self.source + k * self.step))
    }
}

/// One question about bytes `[start, end)` of a resident region (for a table of rows: the bytes its runs span).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Query {
    pub start: u64,
    pub end: u64,
    pub expect: Expect,
}

/// The owner of resident memory: answers queries about it and reads parts of it back. Regions are named by the
/// `handle` their [`ResidentRegion`] carries.
pub trait Judge: Send + Sync {
    /// Whether each query holds (`true`: the bytes are exactly what it expects), in the order given; every query is
    /// inside its region (the oracle checks ranges against [`ResidentRegion::len`] first). `tables` are the run
    /// tables that [`Expect::Rows`] and [`Expect::SentinelRows`] name by index.
    fn judge(&self, queries: &[(u64, Query)], tables: &[&[RowRun]]) -> Result<Vec<bool>, String>;
    /// Copies `out.len()` bytes of region `handle` from byte `start` on into `out`.
    fn read(&self, handle: u64, start: u64, out: &mut [u8]) -> Result<(), String>;
    /// Who answers, for reports (`cuda: NVIDIA H200`).
    fn name(&self) -> String;
}

/// A decode region that stayed where it lives: its judge, its handle there, its length, and what keeps the memory
/// alive until the observation is dropped.
#[derive(Clone)]
pub struct ResidentRegion {
    pub judge: Arc<dyn Judge>,
    pub handle: u64,
    pub len: u64,
    /// Dropped with the last clone of the observation: frees the memory.
    pub keep: Arc<dyn std::any::Any + Send + Sync>,
}

impl fmt::Debug for ResidentRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ResidentRegion({} bytes on {}, handle {:#x})", self.len, self.judge.name(), self.handle)
    }
}

impl ResidentRegion {
    /// The whole region read back to the host.
    pub fn read_all(&self) -> Result<Vec<u8>, String> {
        let len = usize::try_from(self.len).map_err(|_| format!("a {}-byte region does not fit memory", self.len))?;
        let mut bytes = vec![0u8; len];
        self.judge.read(self.handle, 0, &mut bytes)?;
        Ok(bytes)
    }
}

/// The answers known so far and the questions asked in this round, for the walk of one rank.
#[derive(Default, Debug)]
pub(super) struct Asker {
    answers: BTreeMap<(u64, Query), bool>,
    asked: RefCell<Vec<(u64, Query)>>,
    /// The run tables queries name, by index, each once (known by its address, kept alive here so that it stays
    /// unique).
    tables: RefCell<Vec<Rc<Vec<RowRun>>>>,
    /// Each table's index by its address (only looked up: indices follow the order tables were first named).
    table_index: RefCell<BTreeMap<*const Vec<RowRun>, u32>>,
    /// What failed at the judge (a device error), reported as the region's violation.
    pub(super) errors: RefCell<Vec<String>>,
}

impl Asker {
    /// The answer to `query` about region `handle`: known from an earlier round, or recorded and assumed true.
    pub(super) fn ask(&self, handle: u64, query: Query) -> bool {
        match self.answers.get(&(handle, query)) {
            Some(answer) => *answer,
            None => {
                self.asked.borrow_mut().push((handle, query));
                true
            }
        }
    }

    /// The index of run table `table` for [`Expect::Rows`] queries: the same for every call with the same table.
    pub(super) fn table(&self, table: &Rc<Vec<RowRun>>) -> u32 {
        let mut tables = self.tables.borrow_mut();
        *self.table_index.borrow_mut().entry(Rc::as_ptr(table)).or_insert_with(|| {
            tables.push(table.clone());
            tables.len() as u32 - 1
        })
    }

    /// The queries recorded since the last call, answered by `judge`: whether every one held.
    pub(super) fn answer(&mut self, judge: &dyn Judge) -> Result<bool, String> {
        let asked = std::mem::take(self.asked.get_mut());
        if asked.is_empty() {
            return Ok(true);
        }
        let tables = self.tables.borrow();
        let tables: Vec<&[RowRun]> = tables.iter().map(|table| table.as_slice()).collect();
        let answers = judge.judge(&asked, &tables)?;
        if answers.len() != asked.len() {
            return Err(format!("the judge answered {} of {} queries", answers.len(), asked.len()));
        }
        let all = answers.iter().all(|answer| *answer);
        // Where every answer is yes the walk that assumed them is final: nothing is asked again.
        if !all {
            self.answers.extend(asked.into_iter().zip(answers));
        }
        Ok(all)
    }

    /// Whether a walk recorded new queries.
    pub(super) fn pending(&self) -> bool {
        !self.asked.borrow().is_empty()
    }

    /// Bytes `[start, end)` of `region`, read back; a failed read is recorded and reads as zeros.
    pub(super) fn read(&self, region: &ResidentRegion, start: u64, end: u64) -> Vec<u8> {
        let mut out = vec![0u8; (end - start) as usize];
        if let Err(error) = region.judge.read(region.handle, start, &mut out) {
            self.errors.borrow_mut().push(error);
        }
        out
    }
}
