//! The oracle: from the rules of domain.md alone, where every decode byte must come from, checked byte by byte.
//!
//! Start at [`check`]. The oracle never calls the planner: `expect.rs` enumerates, token by token and channel by
//! channel, which prefill bytes must land where (domain.md §1–§8, §12), and [`check`] compares every decode byte
//! against that, reading the fabric's write log for double writes. `decode.rs` turns bytes back into coordinates
//! through the self-describing source pattern (`pattern.rs`).

mod decode;
mod expect;
pub mod pattern;
mod resident;

pub use decode::{item_noun, rank_heads, tensor_name, Described, Origin, Run, Sources};
pub use resident::{Expect, Judge, Query, ResidentRegion, RowRun};

use resident::Asker;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::model::{Problem, RankId, Region, Side};

/// Address of one registered region in a fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionKey {
    pub side: Side,
    pub rank: RankId,
    pub region: u32,
}

/// One write the fabric performed (from its completion log, not from the plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteRecord {
    pub target: RegionKey,
    pub offset: u64,
    pub length: u64,
}

/// What a run left behind: every decode region's bytes and every write performed.
#[derive(Debug, Clone, Default)]
pub struct Observation {
    pub images: BTreeMap<RegionKey, Vec<u8>>,
    /// Decode regions held sparsely instead (a region is in `images` or here): the oracle judges them alike.
    pub sparse: BTreeMap<RegionKey, SparseImage>,
    /// Decode regions that stayed where they live (device memory), judged there (`resident.rs`).
    pub resident: BTreeMap<RegionKey, ResidentRegion>,
    pub writes: Vec<WriteRecord>,
}

impl Observation {
    /// Reads every resident region back into [`Observation::images`] (for consumers of host bytes: `diff`, the
    /// layout picture); the first region that cannot be read names the failure.
    pub fn materialise(&mut self) -> Result<(), String> {
        for (key, region) in std::mem::take(&mut self.resident) {
            let bytes =
                region.read_all().map_err(|error| format!("decode {} region {}: {error}", key.rank, key.region))?;
            self.images.insert(key, bytes);
        }
        Ok(())
    }
}

/// A decode region's bytes as a lazily materialising fabric held them: `len` bytes of which only `chunks` (by
/// start offset, disjoint, each inside the region) were ever materialised; every other byte is the sentinel the
/// region was registered with, never written (the fabric materialises a chunk before any write reaches it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SparseImage {
    pub len: u64,
    pub chunks: BTreeMap<u64, Vec<u8>>,
}

/// A decode region's bytes under judgement, dense or sparse.
#[derive(Debug, Clone)]
enum Image<'a> {
    Dense(&'a [u8]),
    Sparse(Chunks<'a>),
    /// Asked, not read: the region's owner answers (`resident.rs`).
    Resident(&'a ResidentRegion, &'a Asker),
}

/// A sparse image's chunks as sorted vectors (a region judged piece by piece looks chunks up by binary search
/// instead of walking the map).
#[derive(Debug, Clone)]
struct Chunks<'a> {
    len: u64,
    starts: Vec<u64>,
    bytes: Vec<&'a [u8]>,
}

impl<'a> Chunks<'a> {
    fn new(image: &'a SparseImage) -> Self {
        let (starts, bytes) = image.chunks.iter().map(|(start, bytes)| (*start, bytes.as_slice())).unzip();
        Chunks { len: image.len, starts, bytes }
    }
}

impl<'a> Image<'a> {
    fn len(&self) -> u64 {
        match self {
            Image::Dense(bytes) => bytes.len() as u64,
            Image::Sparse(chunks) => chunks.len,
            Image::Resident(region, _) => region.len,
        }
    }

    /// Bytes `[start, end)` (inside the region): borrowed where they lie in one piece of memory.
    fn slice(&self, start: u64, end: u64) -> Cow<'a, [u8]> {
        let image = match self {
            Image::Dense(bytes) => return Cow::Borrowed(&bytes[start as usize..end as usize]),
            Image::Sparse(chunks) => chunks,
            Image::Resident(region, asker) => return Cow::Owned(asker.read(region, start, end)),
        };
        if let Some((chunk_start, chunk)) = Self::overlapping(image, start, end).next() {
            if chunk_start <= start && end <= chunk_start + chunk.len() as u64 {
                return Cow::Borrowed(&chunk[(start - chunk_start) as usize..(end - chunk_start) as usize]);
            }
        }
        let mut out = vec![0u8; (end - start) as usize];
        pattern::fill_sentinel_at(start, &mut out);
        for (chunk_start, chunk) in Self::overlapping(image, start, end) {
            let (from, to) = (start.max(chunk_start), end.min(chunk_start + chunk.len() as u64));
            out[(from - start) as usize..(to - start) as usize]
                .copy_from_slice(&chunk[(from - chunk_start) as usize..(to - chunk_start) as usize]);
        }
        Cow::Owned(out)
    }

    /// Whether bytes `[start, end)` are source region `number`'s from `source_offset` on, compared in place chunk by
    /// chunk (no copy of a range that spans chunks); a part never materialised holds the sentinel and is compared as
    /// such (the same answer as comparing [`Image::slice`], without its copy).
    fn holds_source(&self, start: u64, end: u64, number: u32, source_offset: u64) -> bool {
        let image = match self {
            Image::Dense(bytes) => {
                return pattern::matches_source(number, source_offset, &bytes[start as usize..end as usize]);
            }
            Image::Sparse(chunks) => chunks,
            Image::Resident(region, asker) => {
                let expect = resident::Expect::Source { number, offset: source_offset };
                return asker.ask(region.handle, resident::Query { start, end, expect });
            }
        };
        let hole_matches = |from: u64, to: u64| {
            let mut hole = vec![0u8; (to - from) as usize];
            pattern::fill_sentinel_at(from, &mut hole);
            pattern::matches_source(number, source_offset + (from - start), &hole)
        };
        let mut cursor = start;
        for (chunk_start, chunk) in Self::overlapping(image, start, end) {
            let (from, to) = (start.max(chunk_start), end.min(chunk_start + chunk.len() as u64));
            if from >= to {
                continue;
            }
            let bytes = &chunk[(from - chunk_start) as usize..(to - chunk_start) as usize];
            if (from > cursor && !hole_matches(cursor, from))
                || !pattern::matches_source(number, source_offset + (from - start), bytes)
            {
                return false;
            }
            cursor = to;
        }
        cursor >= end || hole_matches(cursor, end)
    }

    /// Whether every element of run `piece` holds its source bytes (region `number`): one question to resident
    /// memory, element by element elsewhere.
    fn holds_run(&self, piece: &expect::Piece, number: u32) -> bool {
        if let Image::Resident(region, asker) = self {
            let (start, end) = (piece.target_offset, piece.target_offset + piece.span());
            let expect = resident::Expect::Strided {
                number,
                offset: piece.source_offset,
                block: piece.length,
                stride: piece.source_stride,
            };
            return asker.ask(region.handle, resident::Query { start, end, expect });
        }
        (0..piece.count).map(|k| piece.element(k)).all(|element| {
            let (start, end) = (element.target_offset, element.target_offset + element.length);
            self.holds_source(start, end, number, element.source_offset)
        })
    }

    /// The chunks that hold a byte of `[start, end)`, in order, with their start offsets.
    fn overlapping<'c>(image: &'c Chunks<'a>, start: u64, end: u64) -> impl Iterator<Item = (u64, &'a [u8])> + 'c {
        // The last chunk starting at or before `start` may reach into the range; every later one starting before
        // `end` does.
        let first = image.starts.partition_point(|chunk_start| *chunk_start <= start).saturating_sub(1);
        let starts = image.starts[first..].iter().copied().take_while(move |chunk_start| *chunk_start < end);
        starts
            .zip(image.bytes[first..].iter().copied())
            .filter(move |(chunk_start, chunk)| chunk_start + chunk.len() as u64 > start)
    }

    /// The materialised parts of `[start, end)`: all of it for a dense image; for a sparse one only the
    /// materialised chunks' parts, since an absent chunk is untouched memory.
    fn materialised(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        match self {
            Image::Dense(_) | Image::Resident(..) => vec![(start, end)],
            Image::Sparse(image) => Self::overlapping(image, start, end)
                .map(|(chunk_start, chunk)| (start.max(chunk_start), end.min(chunk_start + chunk.len() as u64)))
                .collect(),
        }
    }
}

/// What a range of decode bytes holds, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// Never written.
    Sentinel,
    /// Exactly these source bytes.
    From(Described),
    /// Anything else; `near` decodes the first source run inside it, if any.
    Damaged { differing_bytes: u64, near: Option<Described> },
}

/// `1 byte differs`, `n bytes differ`.
fn differ(bytes: u64) -> String {
    match bytes {
        1 => "1 byte differs".to_owned(),
        n => format!("{n} bytes differ"),
    }
}

impl fmt::Display for Content {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Content::Sentinel => f.write_str("sentinel (never written)"),
            Content::From(described) => write!(f, "{described}"),
            Content::Damaged { differing_bytes, near: Some(near) } => {
                write!(f, "a damaged range ({}) around {near}", differ(*differing_bytes))
            }
            Content::Damaged { differing_bytes, near: None } => {
                write!(f, "bytes of no known origin ({})", differ(*differing_bytes))
            }
        }
    }
}

/// One broken promise, in decoded coordinates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rank: RankId,
    /// `layer 83 kv`, `layer 5 K`, `layer 4 conv (mamba state 0)`, ...
    pub region: String,
    /// `row 197`, `row 35 bytes 256..512`, `item 3 bytes 0..3072`.
    pub place: String,
    /// The same place as numbers: the decode region (its index on the rank) and the bytes (for pictures).
    pub at: Located,
    pub kind: ViolationKind,
}

/// Where a [`Violation`] is: region `region` of the rank (index into its regions), bytes `offset..offset+length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Located {
    pub region: u32,
    pub offset: u64,
    pub length: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViolationKind {
    /// The bytes hold something other than what the rules place there.
    Wrong { expected: Content, found: Content },
    /// Bytes were written more than once.
    Overwritten { offset: u64, length: u64 },
    /// The rules place a token here but the problem gives no decode page for it.
    Unplaceable { request: u32, position: u32 },
    /// Source and target rows differ in length, so no byte-exact placement exists.
    Geometry { source_len: u64, target_len: u64 },
    /// The rules place bytes past the end of the registered region (its pool is too small for the indices).
    OutsideRegion { end: u64, region_len: u64 },
    /// A position-indexed state component has index lists of different lengths.
    IndexLengths { request: u32, prefill: usize, decode: usize },
    /// Resident memory could not be judged (its owner failed to answer or to read back).
    Unjudged { why: String },
    /// A recorded write reaches outside the rank's decode memory: past the end of its region (`region_len`), or into a
    /// region the rank does not have (`None`). The fabrics refuse such writes, so one is a bug of the run itself.
    StrayWrite { offset: u64, length: u64, region_len: Option<u64> },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "decode {}, {}, {}: {}", self.rank, self.region, self.place, self.kind)
    }
}

impl fmt::Display for ViolationKind {
    /// What is wrong, without where (the part of a [`Violation`]'s line after its coordinates).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ViolationKind::Wrong { expected, found } => write!(f, "expected {expected}, found {found}"),
            ViolationKind::Overwritten { offset, length } => {
                write!(f, "bytes {offset}..{} written more than once", offset + length)
            }
            ViolationKind::Unplaceable { request, position } => {
                write!(f, "no decode page for token {position} of request {request}")
            }
            ViolationKind::Geometry { source_len, target_len } => {
                write!(f, "rows differ: prefill {source_len} B, decode {target_len} B")
            }
            ViolationKind::OutsideRegion { end, region_len } => {
                write!(f, "the rules place bytes up to {end}, past the region's {region_len} B")
            }
            ViolationKind::IndexLengths { request, prefill, decode } => {
                write!(f, "request {request} has {prefill} prefill and {decode} decode state indices")
            }
            ViolationKind::Unjudged { why } => write!(f, "could not be judged: {why}"),
            ViolationKind::StrayWrite { offset, length, region_len: Some(len) } => {
                write!(
                    f,
                    "a write of bytes {offset}..{} reaches past the region's {len} B",
                    offset.saturating_add(*length)
                )
            }
            ViolationKind::StrayWrite { offset, length, region_len: None } => {
                let end = offset.saturating_add(*length);
                write!(f, "a write of bytes {offset}..{end} names a decode region this rank does not have")
            }
        }
    }
}

/// How each request ended, as far as the oracle is concerned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdicts {
    /// Requests that ended Failed: their bytes may be anything, but only inside their own destination items.
    pub failed: BTreeSet<u32>,
    /// No byte may have been written at all (the plan was rejected before any transfer).
    pub nothing_sent: bool,
}

impl Verdicts {
    /// Every request succeeded.
    pub fn all_succeeded() -> Verdicts {
        Verdicts::default()
    }

    /// The plan was rejected: every request failed and nothing may have moved.
    pub fn rejected() -> Verdicts {
        Verdicts { failed: BTreeSet::new(), nothing_sent: true }
    }
}

/// Checks a completed transfer: every decode byte against the rules, and every write happened once.
pub fn check(problem: &Problem, observation: &Observation) -> Vec<Violation> {
    check_outcome(problem, observation, &Verdicts::all_succeeded())
}

/// Checks a rejected transfer: nothing was written and every decode byte is still the sentinel.
pub fn check_untouched(problem: &Problem, observation: &Observation) -> Vec<Violation> {
    check_outcome(problem, observation, &Verdicts::rejected())
}

/// Judges any run, including one where requests failed part-way: a succeeded request's bytes must be exactly
/// where the rules place them; a failed request may leave bytes only inside its own destination items; every
/// other byte must still be the sentinel, and no byte may be written twice outside failed requests' items.
pub fn check_outcome(problem: &Problem, observation: &Observation, verdicts: &Verdicts) -> Vec<Violation> {
    let ranks: Vec<_> = problem.decode.ranks.iter().map(|layout| (layout.rank, verdicts.clone())).collect();
    check_ranks(problem, observation, &ranks)
}

/// [`check_rank`] for each `(rank, verdicts)`, in the order given. The oracle is pure and starts no thread: the
/// harness judges ranks in parallel across the machine's cores (`harness::check_ranks`, the same list).
pub fn check_ranks(problem: &Problem, observation: &Observation, ranks: &[(RankId, Verdicts)]) -> Vec<Violation> {
    ranks.iter().flat_map(|(rank, verdicts)| check_rank(problem, *rank, observation, verdicts)).collect()
}

/// [`check_outcome`] for one decode rank alone: `observation` needs only that rank's images and writes, so a
/// decode process can verify its own memory.
pub fn check_rank(problem: &Problem, rank: RankId, observation: &Observation, verdicts: &Verdicts) -> Vec<Violation> {
    let sources = Sources::new(problem);
    Share::all(1).flat_map(|share| check_rank_share(&sources, rank, observation, verdicts, share)).collect()
}

/// A share of [`check_rank`]'s work: part `part` of `parts` of the rank's regions (from `part * n / parts` up to
/// the next part's first, `n` the rank's regions), or its writes (each written once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    Regions { part: u32, parts: u32 },
    Writes,
}

impl Share {
    /// A rank's shares in [`check_rank`]'s order: its regions in `parts` parts, then its writes.
    pub fn all(parts: u32) -> impl Iterator<Item = Share> {
        let parts = parts.max(1);
        (0..parts).map(move |part| Share::Regions { part, parts }).chain([Share::Writes])
    }
}

/// The violations of one [`Share`] of [`check_rank`], judged against `sources` (built once for the problem: every
/// share reads it). The shares' violations, concatenated in [`Share::all`]'s order, are exactly [`check_rank`]'s:
/// a rank's regions are judged independently of each other, so the harness spreads a rank's shares over cores.
pub fn check_rank_share(
    sources: &Sources<'_>,
    rank: RankId,
    observation: &Observation,
    verdicts: &Verdicts,
    share: Share,
) -> Vec<Violation> {
    let problem = sources.problem;
    let mut violations = Vec::new();
    let (part, parts) = match share {
        Share::Writes => {
            check_writes(problem, observation, rank, verdicts, &mut violations);
            return violations;
        }
        Share::Regions { part, parts } => (part, parts.max(1)),
    };
    let regions = problem.decode.rank(rank).regions.len() as u64;
    let bound = |part: u32| (u64::from(part) * regions / u64::from(parts)) as u32;
    let rows = expect::RowCache::default();
    let mut resident = Vec::new();
    let key = |region| RegionKey { side: Side::Decode, rank, region };
    // The part's resident regions in one ordered walk of the map, not a lookup a region.
    let mut resident_part = observation.resident.range(key(bound(part))..key(bound(part + 1))).peekable();
    for index in bound(part)..bound(part + 1) {
        let key = key(index);
        if let Some((key, region)) = resident_part.next_if(|(found, _)| **found == key) {
            resident.push((*key, region));
            continue;
        }
        let bytes = match (observation.images.get(&key), observation.sparse.get(&key)) {
            (Some(bytes), _) => Image::Dense(bytes),
            (None, Some(image)) => Image::Sparse(Chunks::new(image)),
            (None, None) => panic!("observation lacks decode region {key:?}"),
        };
        let region = RegionCheck { problem, sources, key, bytes, verdicts, rows: &rows };
        region.run(&mut violations);
    }
    judge_resident(problem, sources, &rows, &resident, verdicts, &mut violations);
    violations
}

/// The resident regions of one rank (one judge, the fabric's), judged in rounds (`resident.rs`): walked with every
/// unknown answer assumed yes, the recorded queries answered in one call, walked again only while an answer was no.
fn judge_resident(
    problem: &Problem,
    sources: &Sources<'_>,
    rows: &expect::RowCache,
    regions: &[(RegionKey, &ResidentRegion)],
    verdicts: &Verdicts,
    violations: &mut Vec<Violation>,
) {
    let Some((first_key, first)) = regions.first() else { return };
    let mut asker = Asker::default();
    loop {
        let mut round = Vec::new();
        for (key, region) in regions {
            let bytes = Image::Resident(region, &asker);
            RegionCheck { problem, sources, key: *key, bytes, verdicts, rows }.run(&mut round);
        }
        let settled = if asker.pending() { asker.answer(first.judge.as_ref()) } else { Ok(true) };
        let errors = std::mem::take(asker.errors.get_mut());
        let error = settled.as_ref().err().cloned().or_else(|| errors.first().cloned());
        if let Some(why) = error {
            let region = &problem.decode.rank(first_key.rank).regions[first_key.region as usize];
            violations.push(Violation {
                rank: first_key.rank,
                region: format!("layer {} {}", region.layer, tensor_name(problem, region)),
                place: format!("device memory ({})", first.judge.name()),
                at: Located { region: first_key.region, offset: 0, length: first.len },
                kind: ViolationKind::Unjudged { why },
            });
            return;
        }
        if settled == Ok(true) {
            violations.extend(round);
            return;
        }
    }
}

/// Judges resident decode region `key` twice, through its judge and through a host read-back of every byte, and
/// says how the two verdicts differ (`None`: identical). The `cuda` fabric's cross-check of its device oracle.
pub fn cross_check_region(
    problem: &Problem,
    observation: &Observation,
    key: RegionKey,
    verdicts: &Verdicts,
) -> Option<String> {
    let region = observation.resident.get(&key)?;
    let sources = Sources::new(problem);
    let rows = expect::RowCache::default();
    let mut on_device = Vec::new();
    judge_resident(problem, &sources, &rows, &[(key, region)], verdicts, &mut on_device);
    let bytes = match region.read_all() {
        Ok(bytes) => bytes,
        Err(error) => return Some(format!("decode {} region {}: read-back failed: {error}", key.rank, key.region)),
    };
    let mut on_host = Vec::new();
    RegionCheck { problem, sources: &sources, key, bytes: Image::Dense(&bytes), verdicts, rows: &rows }
        .run(&mut on_host);
    (on_device != on_host).then(|| {
        let show = |list: &[Violation]| list.iter().take(2).map(ToString::to_string).collect::<Vec<_>>().join("; ");
        format!(
            "decode {} region {}: the device oracle found {} violations ({}), the host read-back {} ({})",
            key.rank,
            key.region,
            on_device.len(),
            show(&on_device),
            on_host.len(),
            show(&on_host)
        )
    })
}

/// One decode region under judgement.
struct RegionCheck<'a> {
    problem: &'a Problem,
    sources: &'a Sources<'a>,
    key: RegionKey,
    bytes: Image<'a>,
    verdicts: &'a Verdicts,
    /// The rank's token rows, enumerated once for all its regions.
    rows: &'a expect::RowCache,
}

impl RegionCheck<'_> {
    fn region(&self) -> &Region {
        &self.problem.decode.rank(self.key.rank).regions[self.key.region as usize]
    }

    fn label(&self) -> String {
        format!("layer {} {}", self.region().layer, tensor_name(self.problem, self.region()))
    }

    fn violation(&self, place: String, offset: u64, length: u64, kind: ViolationKind) -> Violation {
        let at = Located { region: self.key.region, offset, length };
        Violation { rank: self.key.rank, region: self.label(), place, at, kind }
    }

    /// `row 197`, or `row 35 bytes 256..512` for part of a row.
    fn place(&self, offset: u64, length: u64) -> String {
        let row_len = self.region().row_len();
        let (row, within) = (offset / row_len, offset % row_len);
        let noun = item_noun(self.problem, self.region());
        if within == 0 && length == row_len {
            format!("{noun} {row}")
        } else {
            format!("{noun} {row} bytes {within}..{}", within + length)
        }
    }

    /// The pieces succeeded requests must hold, sorted, and the byte ranges failed requests may have touched.
    fn expectations(&self, violations: &mut Vec<Violation>) -> (Vec<expect::Piece>, Vec<(u64, u64)>) {
        if self.verdicts.nothing_sent {
            return (Vec::new(), Vec::new());
        }
        let mut notes = Vec::new();
        let mut pieces = expect::pieces(self.problem, self.key.rank, self.key.region, self.rows, &mut notes);
        // A problem of the problem itself matters only for requests that claim success.
        let all_failed = self.problem.requests.iter().all(|request| self.verdicts.failed.contains(&request.id));
        for (row, kind) in notes {
            let moot = match &kind {
                ViolationKind::Unplaceable { request, .. } | ViolationKind::IndexLengths { request, .. } => {
                    self.verdicts.failed.contains(request)
                }
                _ => all_failed,
            };
            if !moot {
                let row_len = self.region().row_len();
                violations.push(self.violation(format!("row {row}"), row * row_len, row_len, kind));
            }
        }
        pieces.retain(|piece| !self.verdicts.failed.contains(&piece.request));
        // Unstable is deterministic here: the key is every field.
        pieces.sort_unstable_by_key(|piece| {
            (
                piece.target_offset,
                piece.length,
                piece.count,
                piece.request,
                piece.source,
                piece.source_region,
                piece.source_offset,
                piece.source_stride,
            )
        });
        let mut free = Vec::new();
        for request in self.problem.requests.iter().filter(|request| self.verdicts.failed.contains(&request.id)) {
            free.extend(expect::territory(self.problem, self.key.rank, self.key.region, request));
        }
        free.sort_unstable();
        (pieces, free)
    }

    fn run(&self, violations: &mut Vec<Violation>) {
        if self.held_whole() {
            return;
        }
        let (mut pieces, free) = self.expectations(violations);
        let region_len = self.bytes.len();
        if let Some(piece) = pieces.iter().find(|piece| piece.target_offset + piece.span() > region_len) {
            let (start, end) = (piece.target_offset, piece.target_offset + piece.span());
            violations.push(self.violation(
                format!("bytes {start}..{end}"),
                start,
                end - start,
                ViolationKind::OutsideRegion { end, region_len },
            ));
            pieces.retain(|piece| piece.target_offset + piece.span() <= region_len);
        }
        let mut cursor = 0u64;
        let mut last = None;
        for piece in &pieces {
            assert!(
                piece.target_offset >= cursor,
                "oracle expects two sources for byte {} of {:?}",
                piece.target_offset,
                self.key
            );
            self.check_gap(cursor, piece.target_offset, &free, violations);
            // Consecutive pieces mostly share their source region: looked up once for them.
            let number = match last {
                Some((source, region, number)) if (source, region) == (piece.source, piece.source_region) => number,
                _ => self.sources.number(piece.source, piece.source_region),
            };
            last = Some((piece.source, piece.source_region, number));
            // A run is asked whole; only where it fails, element by element (each reported as the row it is).
            if piece.count == 1 || !self.bytes.holds_run(piece, number) {
                for element in (0..piece.count).map(|k| piece.element(k)) {
                    let (start, end) = (element.target_offset, element.target_offset + element.length);
                    if !self.bytes.holds_source(start, end, number, element.source_offset) {
                        let expected =
                            Content::From(self.sources.describe(number, element.source_offset, element.length));
                        self.report(element.target_offset, element.length, expected, violations);
                    }
                }
            }
            cursor = piece.target_offset + piece.span();
        }
        self.check_gap(cursor, region_len, &free, violations);
    }

    /// Whether a resident region of whole rows holds all it must, asked whole: one question per request and one for
    /// the rows between (tables of runs shared by the rank's layers), when every request succeeded and the region is
    /// that simple (`expect::row_layout`). `false` (a no, or not that simple): the region is walked piece by piece,
    /// which asks again only where bytes differ and names them.
    fn held_whole(&self) -> bool {
        let Image::Resident(region, asker) = &self.bytes else { return false };
        if self.verdicts.nothing_sent || !self.verdicts.failed.is_empty() {
            return false;
        }
        let Some(layout) = expect::row_layout(self.problem, self.key.rank, self.key.region, region.len, self.rows)
        else {
            return false;
        };
        let row = layout.row;
        let ask = |table: &std::rc::Rc<Vec<resident::RowRun>>, expect: &dyn Fn(u32) -> resident::Expect| {
            let start = table.iter().map(|run| run.target).min().unwrap_or(0) * row;
            let end = table.iter().map(|run| run.target + run.count).max().unwrap_or(0) * row;
            table.is_empty()
                || asker.ask(region.handle, resident::Query { start, end, expect: expect(asker.table(table)) })
        };
        // Every question is asked (not stopped at the first no): the first round assumes yes and records them all.
        let mut holds = ask(&layout.gaps, &|table| resident::Expect::SentinelRows { table, row });
        if let Some(((source, source_region), requests)) = &layout.source {
            let number = self.sources.number(*source, *source_region);
            for table in requests {
                holds &= ask(table, &|table| resident::Expect::Rows { table, number, row, source_row: row });
            }
        }
        holds
    }

    /// Bytes `[start, end)` outside every failed request's items must be sentinel.
    fn check_gap(&self, start: u64, end: u64, free: &[(u64, u64)], violations: &mut Vec<Violation>) {
        let mut cursor = start;
        for (free_start, free_end) in free.iter().filter(|(a, b)| *b > start && *a < end) {
            if *free_start > cursor {
                self.check_sentinel(cursor, *free_start, violations);
            }
            cursor = cursor.max(*free_end);
        }
        if cursor < end {
            self.check_sentinel(cursor, end, violations);
        }
    }

    /// Bytes `[start, end)` must be sentinel: checked where memory was materialised (an absent chunk of a sparse
    /// image is untouched, so it holds the sentinel without being read).
    fn check_sentinel(&self, start: u64, end: u64, violations: &mut Vec<Violation>) {
        let row_len = self.region().row_len();
        if let Image::Resident(region, asker) = &self.bytes {
            // The whole range first; only where it fails, row by row (as the dense walk reports), each failing row
            // read back.
            let sentinel = |start, end| {
                asker.ask(region.handle, resident::Query { start, end, expect: resident::Expect::Sentinel })
            };
            if sentinel(start, end) {
                return;
            }
            let mut offset = start;
            while offset < end {
                let row_end = ((offset / row_len + 1) * row_len).min(end);
                if !sentinel(offset, row_end) {
                    self.report(offset, row_end - offset, Content::Sentinel, violations);
                }
                offset = row_end;
            }
            return;
        }
        let mut done = start;
        for (from, to) in self.bytes.materialised(start, end) {
            // Whole rows where the materialised part starts or ends inside one, as a dense image reports them,
            // each row once.
            let from = done.max(from / row_len * row_len);
            let to = end.min(to.div_ceil(row_len) * row_len);
            if from >= to {
                continue;
            }
            done = to;
            let bytes = self.bytes.slice(from, to);
            check_sentinel_rows(&bytes, from, from, to, row_len, &mut |offset, length, expected| {
                self.report(offset, length, expected, violations);
            });
        }
    }

    fn report(&self, offset: u64, length: u64, expected: Content, violations: &mut Vec<Violation>) {
        let aligned = offset / 8 * 8;
        let end = ((offset + length).div_ceil(8) * 8).min(self.bytes.len());
        let bytes = self.bytes.slice(aligned, end);
        let found = found_content_at(self.sources, &bytes, aligned, offset, length);
        let place = self.place(offset, length);
        violations.push(self.violation(place, offset, length, ViolationKind::Wrong { expected, found }));
    }
}

/// Bytes `[start, end)` must be sentinel (`bytes` holds the region from byte `base` on); mismatches are reported
/// one row at a time.
fn check_sentinel_rows(
    bytes: &[u8],
    base: u64,
    start: u64,
    end: u64,
    row_len: u64,
    report: &mut impl FnMut(u64, u64, Content),
) {
    let mut offset = start;
    while offset < end {
        let row_end = ((offset / row_len + 1) * row_len).min(end);
        if !pattern::matches_sentinel(offset, &bytes[(offset - base) as usize..(row_end - base) as usize]) {
            report(offset, row_end - offset, Content::Sentinel);
        }
        offset = row_end;
    }
}

/// Decodes what `[offset, offset + length)` actually holds.
fn found_content(sources: &Sources<'_>, bytes: &[u8], offset: u64, length: u64) -> Content {
    let aligned = offset / 8 * 8;
    let end = (offset + length).div_ceil(8) * 8;
    found_content_at(sources, &bytes[aligned as usize..(end as usize).min(bytes.len())], aligned, offset, length)
}

/// [`found_content`] from `window`, the region's bytes from the word-aligned `aligned` on, covering the range.
fn found_content_at(sources: &Sources<'_>, window: &[u8], aligned: u64, offset: u64, length: u64) -> Content {
    let runs = sources.runs(aligned, window);
    match runs.as_slice() {
        [Run::Sentinel { .. }] => Content::Sentinel,
        [Run::Source { number, source_offset, .. }] => {
            Content::From(sources.describe(*number, source_offset + (offset - aligned), length))
        }
        _ => {
            // The longest source run is what the range was meant to hold; a byte differs when it is not that run's
            // pattern continued (a flipped byte can decode as another source's word, so runs alone undercount).
            let longest = runs.iter().filter(|run| matches!(run, Run::Source { .. })).max_by_key(|run| run.length());
            let Some(&Run::Source { offset: start, number, source_offset, length: run_len }) = longest else {
                let differing = runs.iter().filter(|run| !matches!(run, Run::Source { .. })).map(Run::length).sum();
                return Content::Damaged { differing_bytes: differing, near: None };
            };
            let differing = (offset..offset + length)
                .filter(|&at| {
                    let expected =
                        (source_offset + at).checked_sub(start).map(|from| pattern::source_byte(number, from));
                    window.get((at - aligned) as usize).copied() != expected
                })
                .count() as u64;
            Content::Damaged {
                differing_bytes: differing,
                near: Some(sources.describe(number, source_offset, run_len)),
            }
        }
    }
}

/// Every written byte of `rank` was written once, except inside failed requests' own items (a retry may rewrite
/// them): overlapping writes are violations (domain.md §12.2).
fn check_writes(
    problem: &Problem,
    observation: &Observation,
    rank: RankId,
    verdicts: &Verdicts,
    violations: &mut Vec<Violation>,
) {
    // The rank's writes in a list a region (a wave's records number thousands a rank: one sort of them all, or a
    // map of lists, costs more than the check itself); a record reaching outside the rank's decode regions is a
    // violation of its own.
    let regions = &problem.decode.rank(rank).regions;
    let mut by_region: Vec<Vec<(u64, u64)>> = vec![Vec::new(); regions.len()];
    let decode_writes =
        observation.writes.iter().filter(|write| write.target.rank == rank && write.target.side == Side::Decode);
    for write in decode_writes {
        let index = write.target.region;
        let (offset, length) = (write.offset, write.length);
        let region = regions.get(index as usize);
        let region_len = region.map(Region::len_bytes);
        if region_len.is_none_or(|len| offset.checked_add(length).is_none_or(|end| end > len)) {
            violations.push(Violation {
                rank,
                region: region.map_or_else(
                    || format!("region {index} (the rank has {})", regions.len()),
                    |region| format!("layer {} {}", region.layer, tensor_name(problem, region)),
                ),
                place: format!("bytes {offset}..{}", offset.saturating_add(length)),
                at: Located { region: index, offset, length },
                kind: ViolationKind::StrayWrite { offset, length, region_len },
            });
            continue;
        }
        by_region[index as usize].push((offset, length));
    }
    let failed_requests: Vec<&crate::model::Request> =
        problem.requests.iter().filter(|request| verdicts.failed.contains(&request.id)).collect();
    for (index, mut writes) in by_region.into_iter().enumerate().filter(|(_, writes)| !writes.is_empty()) {
        let index = index as u32;
        let failed: Vec<(u64, u64)> =
            failed_requests.iter().flat_map(|request| expect::territory(problem, rank, index, request)).collect();
        writes.retain(|(offset, length)| !failed.iter().any(|(a, b)| *a <= *offset && offset + length <= *b));
        writes.sort_unstable();
        let region = &regions[index as usize];
        let mut end = 0;
        for (offset, length) in writes {
            if offset < end {
                let overlap = end.min(offset + length) - offset;
                violations.push(Violation {
                    rank,
                    region: format!("layer {} {}", region.layer, tensor_name(problem, region)),
                    place: format!("row {}", offset / region.row_len()),
                    at: Located { region: index, offset, length: overlap },
                    kind: ViolationKind::Overwritten { offset, length: overlap },
                });
            }
            end = end.max(offset + length);
        }
    }
}

/// One row (or item) whose bytes differ between two runs of the same problem, decoded on both sides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub rank: RankId,
    /// `layer 83 kv`, as in [`Violation::region`].
    pub region: String,
    /// `row 197`.
    pub place: String,
    /// What the reference run left there.
    pub reference: Content,
    /// What the other run left there.
    pub other: Content,
    /// Bytes of the row that differ.
    pub differing_bytes: u64,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "decode {}, {}, {}: {} bytes differ; reference holds {}, other holds {}",
            self.rank, self.region, self.place, self.differing_bytes, self.reference, self.other
        )
    }
}

/// Compares every decode image of `other` with `reference` byte for byte, row by row, and decodes each differing
/// row on both sides into coordinates. A region present in one observation only is reported as wholly different.
pub fn compare_images(problem: &Problem, reference: &Observation, other: &Observation) -> Vec<Difference> {
    let sources = Sources::new(problem);
    let mut differences = Vec::new();
    let keys: BTreeSet<RegionKey> = reference.images.keys().chain(other.images.keys()).copied().collect();
    for key in keys {
        let region = &problem.decode.rank(key.rank).regions[key.region as usize];
        let label = format!("layer {} {}", region.layer, tensor_name(problem, region));
        let empty = Vec::new();
        let (left, right) = (reference.images.get(&key).unwrap_or(&empty), other.images.get(&key).unwrap_or(&empty));
        let row_len = region.row_len().max(1) as usize;
        let rows = left.len().max(right.len()).div_ceil(row_len);
        for row in 0..rows {
            let (a, b) = (row_bytes(left, row, row_len), row_bytes(right, row, row_len));
            if a == b {
                continue;
            }
            let differing = a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
            let offset = (row * row_len) as u64;
            let decode = |bytes: &[u8], part: &[u8]| match part.len() {
                0 => Content::Damaged { differing_bytes: row_len as u64, near: None },
                len => found_content(&sources, bytes, offset, len as u64),
            };
            differences.push(Difference {
                rank: key.rank,
                region: label.clone(),
                place: format!("{} {row}", item_noun(problem, region)),
                reference: decode(left, a),
                other: decode(right, b),
                differing_bytes: differing as u64,
            });
        }
    }
    differences
}

/// Row `row` of `bytes` (shorter at the end, empty past it).
fn row_bytes(bytes: &[u8], row: usize, row_len: usize) -> &[u8] {
    let start = (row * row_len).min(bytes.len());
    &bytes[start..((row + 1) * row_len).min(bytes.len())]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A sparse image of 4 KiB cut at `cuts` into chunks, those marked absent left as holes, each present one holding
    /// source region 3's bytes from `shift` on, with the byte at `flip` (if materialised) inverted.
    fn image(cuts: &[u64], absent: &[bool], shift: u64, flip: u64) -> SparseImage {
        let mut bounds: Vec<u64> = cuts.iter().map(|cut| cut % 4096).chain([0, 4096]).collect();
        bounds.sort_unstable();
        bounds.dedup();
        let mut chunks: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for (index, pair) in bounds.windows(2).enumerate() {
            if absent.get(index).copied().unwrap_or(false) {
                continue;
            }
            let mut bytes = vec![0u8; (pair[1] - pair[0]) as usize];
            pattern::fill_source_at(3, pair[0] + shift, &mut bytes);
            if (pair[0]..pair[1]).contains(&flip) {
                bytes[(flip - pair[0]) as usize] ^= 0xFF;
            }
            chunks.insert(pair[0], bytes);
        }
        SparseImage { len: 4096, chunks }
    }

    proptest! {
        /// A sparse image's slice is the bytes of the image laid out whole (chunks over the sentinel), and comparing
        /// in place, chunk by chunk and hole by hole, answers exactly as comparing those bytes.
        #[test]
        fn holds_source_answers_as_the_copied_slice(
            cuts in proptest::collection::vec(0u64..4096, 0..8),
            absent in proptest::collection::vec(proptest::bool::weighted(0.2), 0..9),
            shift in prop_oneof![Just(0u64), 0u64..64],
            flip in prop_oneof![Just(u64::MAX), 0u64..4096],
            range in (0u64..4096, 0u64..4096),
            source_offset in prop_oneof![3 => Just(None), 1 => (0u64..8192).prop_map(Some)],
        ) {
            let sparse = image(&cuts, &absent, shift, flip);
            let image = Image::Sparse(Chunks::new(&sparse));
            let (start, end) = (range.0.min(range.1), range.0.max(range.1));
            let source_offset = source_offset.unwrap_or(start + shift);
            // The reference: every byte laid out (the sentinel, each chunk copied over it).
            let mut whole = vec![0u8; 4096];
            pattern::fill_sentinel(&mut whole);
            for (chunk_start, bytes) in &sparse.chunks {
                whole[*chunk_start as usize..*chunk_start as usize + bytes.len()].copy_from_slice(bytes);
            }
            prop_assert_eq!(&image.slice(start, end)[..], &whole[start as usize..end as usize]);
            let copied = pattern::matches_source(3, source_offset, &whole[start as usize..end as usize]);
            prop_assert_eq!(image.holds_source(start, end, 3, source_offset), copied);
        }
    }
}
