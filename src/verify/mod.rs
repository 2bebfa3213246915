//! The oracle: from the rules of domain.md alone, where every decode byte must come from, checked byte by byte.
//!
//! Start at [`check`]. The oracle never calls the planner: `expect.rs` enumerates, token by token and channel by
//! channel, which prefill bytes must land where (domain.md §1–§8, §12), and [`check`] compares every decode byte
//! against that, reading the fabric's write log for double writes. `decode.rs` turns bytes back into coordinates
//! through the self-describing source pattern (`pattern.rs`).

mod decode;
mod expect;
pub mod pattern;

pub use decode::{item_noun, rank_heads, tensor_name, Described, Origin, Run, Sources};

use std::collections::BTreeMap;
use std::fmt;

use crate::model::{Problem, RankId, Side};

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
    pub writes: Vec<WriteRecord>,
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

impl fmt::Display for Content {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Content::Sentinel => f.write_str("sentinel (never written)"),
            Content::From(described) => write!(f, "{described}"),
            Content::Damaged { differing_bytes, near: Some(near) } => {
                write!(f, "a damaged range ({differing_bytes} bytes differ) around {near}")
            }
            Content::Damaged { differing_bytes, near: None } => {
                write!(f, "bytes of no known origin ({differing_bytes} bytes differ)")
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
    pub kind: ViolationKind,
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
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "decode {}, {}, {}: ", self.rank, self.region, self.place)?;
        match &self.kind {
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
        }
    }
}

/// Checks a completed transfer: every decode byte against the rules, and every write happened once.
pub fn check(problem: &Problem, observation: &Observation) -> Vec<Violation> {
    check_with(problem, observation, true)
}

/// Checks a rejected transfer: nothing was written and every decode byte is still the sentinel.
pub fn check_untouched(problem: &Problem, observation: &Observation) -> Vec<Violation> {
    check_with(problem, observation, false)
}

fn check_with(problem: &Problem, observation: &Observation, transferred: bool) -> Vec<Violation> {
    let sources = Sources::new(problem);
    let mut violations = Vec::new();
    for layout in &problem.decode.ranks {
        for (index, region) in layout.regions.iter().enumerate() {
            let key = RegionKey { side: Side::Decode, rank: layout.rank, region: index as u32 };
            let label = format!("layer {} {}", region.layer, tensor_name(problem, region));
            let mut notes = Vec::new();
            let mut pieces =
                if transferred { expect::pieces(problem, layout.rank, index as u32, &mut notes) } else { Vec::new() };
            for (row, kind) in notes {
                violations.push(Violation {
                    rank: layout.rank,
                    region: label.clone(),
                    place: format!("row {row}"),
                    kind,
                });
            }
            pieces.sort_by_key(|piece| piece.target_offset);
            let Some(bytes) = observation.images.get(&key) else {
                panic!("observation lacks decode region {key:?}");
            };
            let region_len = bytes.len() as u64;
            if let Some(piece) = pieces.iter().find(|piece| piece.target_offset + piece.length > region_len) {
                let (start, end) = (piece.target_offset, piece.target_offset + piece.length);
                violations.push(Violation {
                    rank: layout.rank,
                    region: label.clone(),
                    place: format!("bytes {start}..{end}"),
                    kind: ViolationKind::OutsideRegion { end, region_len },
                });
                pieces.retain(|piece| piece.target_offset + piece.length <= region_len);
            }
            let row_len = region.row_len();
            let place = |offset: u64, length: u64| {
                let (row, within) = (offset / row_len, offset % row_len);
                let noun = item_noun(problem, region);
                if within == 0 && length == row_len {
                    format!("{noun} {row}")
                } else {
                    format!("{noun} {row} bytes {within}..{}", within + length)
                }
            };
            let mut report = |offset: u64, length: u64, expected: Content| {
                let found = found_content(&sources, bytes, offset, length);
                violations.push(Violation {
                    rank: layout.rank,
                    region: label.clone(),
                    place: place(offset, length),
                    kind: ViolationKind::Wrong { expected, found },
                });
            };
            let mut cursor = 0u64;
            for piece in &pieces {
                assert!(
                    piece.target_offset >= cursor,
                    "oracle expects two sources for byte {} of {key:?}",
                    piece.target_offset
                );
                check_gap(bytes, cursor, piece.target_offset, row_len, &mut report);
                let range = piece.target_offset as usize..(piece.target_offset + piece.length) as usize;
                let number = sources.number(piece.source, piece.source_region);
                if !pattern::matches_source(number, piece.source_offset, &bytes[range]) {
                    let expected = Content::From(sources.describe(number, piece.source_offset, piece.length));
                    report(piece.target_offset, piece.length, expected);
                }
                cursor = piece.target_offset + piece.length;
            }
            check_gap(bytes, cursor, bytes.len() as u64, row_len, &mut report);
        }
    }
    check_writes(problem, observation, &mut violations);
    violations
}

/// Bytes `[start, end)` must be sentinel; mismatches are reported one row at a time.
fn check_gap(bytes: &[u8], start: u64, end: u64, row_len: u64, report: &mut impl FnMut(u64, u64, Content)) {
    let mut offset = start;
    while offset < end {
        let row_end = ((offset / row_len + 1) * row_len).min(end);
        if !pattern::matches_sentinel(offset, &bytes[offset as usize..row_end as usize]) {
            report(offset, row_end - offset, Content::Sentinel);
        }
        offset = row_end;
    }
}

/// Decodes what `[offset, offset + length)` actually holds.
fn found_content(sources: &Sources<'_>, bytes: &[u8], offset: u64, length: u64) -> Content {
    let aligned = offset / 8 * 8;
    let end = (offset + length).div_ceil(8) * 8;
    let runs = sources.runs(aligned, &bytes[aligned as usize..(end as usize).min(bytes.len())]);
    match runs.as_slice() {
        [Run::Sentinel { .. }] => Content::Sentinel,
        [Run::Source { number, source_offset, .. }] => {
            Content::From(sources.describe(*number, source_offset + (offset - aligned), length))
        }
        _ => {
            let near = runs.iter().find_map(|run| match run {
                Run::Source { number, source_offset, length, .. } => {
                    Some(sources.describe(*number, *source_offset, *length))
                }
                _ => None,
            });
            let differing = runs.iter().filter(|run| !matches!(run, Run::Source { .. })).map(Run::length).sum();
            Content::Damaged { differing_bytes: differing, near }
        }
    }
}

/// Every written byte was written once: overlapping writes to one region are violations (domain.md §12.2).
fn check_writes(problem: &Problem, observation: &Observation, violations: &mut Vec<Violation>) {
    let mut by_region: BTreeMap<RegionKey, Vec<(u64, u64)>> = BTreeMap::new();
    for write in &observation.writes {
        by_region.entry(write.target).or_default().push((write.offset, write.length));
    }
    for (key, mut writes) in by_region {
        writes.sort_unstable();
        let region = &problem.decode.rank(key.rank).regions[key.region as usize];
        let label = format!("layer {} {}", region.layer, tensor_name(problem, region));
        let mut end = 0;
        for (offset, length) in writes {
            if offset < end {
                let overlap = end.min(offset + length) - offset;
                violations.push(Violation {
                    rank: key.rank,
                    region: label.clone(),
                    place: format!("row {}", offset / region.row_len()),
                    kind: ViolationKind::Overwritten { offset, length: overlap },
                });
            }
            end = end.max(offset + length);
        }
    }
}
