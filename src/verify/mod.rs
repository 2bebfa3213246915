//! The oracle: from the rules of domain.md alone, where every decode byte must come from, checked byte by byte.
//!
//! Start at [`check`]. The oracle never calls the planner: it enumerates token by token which prefill row must
//! land in which decode row (domain.md §2.1, §2.4, §3.1, §4.3, §12) and compares against the [`Observation`].
//! Rows that differ are decoded back into coordinates through the self-describing source pattern (pattern.rs).

pub mod pattern;

use std::collections::BTreeMap;
use std::fmt;

use crate::model::{LayerId, Problem, RankId, Side};

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

/// What a decode token row holds, decoded from its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// Never written.
    Sentinel,
    /// A token row of a request, as prefill stored it.
    Token { request: u32, position: u32, source: RankId, layer: LayerId },
    /// A prefill row that holds no token of any request (unused slot of a page).
    Slot { source: RankId, layer: LayerId, row: u64 },
    /// Bytes that are neither a whole source row nor sentinel. `origin` is the source range the row's first
    /// decodable word points at, and `differing_bytes` how many bytes of the row differ from that range.
    Garbled { origin: Option<(RankId, LayerId, u64)>, differing_bytes: u64 },
}

impl fmt::Display for Content {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Content::Sentinel => f.write_str("sentinel (never written)"),
            Content::Token { request, position, source, layer } => {
                write!(f, "token {position} of request {request} from prefill {source} layer {layer}")
            }
            Content::Slot { source, layer, row } => write!(f, "unused slot row {row} of prefill {source} layer {layer}"),
            Content::Garbled { origin: Some((source, layer, offset)), differing_bytes } => write!(
                f,
                "a damaged row: {differing_bytes} bytes differ from the row at byte {offset} of prefill {source} layer {layer}"
            ),
            Content::Garbled { origin: None, .. } => f.write_str("bytes of no known origin"),
        }
    }
}

/// One broken promise, in decoded coordinates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rank: RankId,
    pub layer: LayerId,
    pub row: u64,
    pub kind: ViolationKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViolationKind {
    /// The row holds something other than what the rules place there.
    Wrong { expected: Content, found: Content },
    /// Bytes of this row were written more than once.
    Overwritten { offset: u64, length: u64 },
    /// The rules place a token here but the problem gives no decode page for it.
    Unplaceable { request: u32, position: u32 },
    /// Source and target token rows differ in length, so no byte-exact placement exists.
    Geometry { source_len: u64, target_len: u64 },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "decode {}, layer {}, row {}: ", self.rank, self.layer, self.row)?;
        match &self.kind {
            ViolationKind::Wrong { expected, found } => write!(f, "expected {expected}, found {found}"),
            ViolationKind::Overwritten { offset, length } => {
                write!(f, "bytes {offset}..{} written more than once", offset + length)
            }
            ViolationKind::Unplaceable { request, position } => {
                write!(f, "no decode page for token {position} of request {request}")
            }
            ViolationKind::Geometry { source_len, target_len } => {
                write!(f, "token rows differ: prefill {source_len} B, decode {target_len} B")
            }
        }
    }
}

/// Index of the problem's source side: global region numbers and page ownership.
pub struct Sources<'a> {
    problem: &'a Problem,
    /// Global source region number → (rank, region index).
    regions: Vec<(RankId, u32)>,
    numbers: BTreeMap<(RankId, u32), u32>,
    /// Prefill allocator page → (request index, page ordinal in the request).
    page_owner: BTreeMap<u32, (usize, u32)>,
}

impl<'a> Sources<'a> {
    pub fn new(problem: &'a Problem) -> Sources<'a> {
        let mut regions = Vec::new();
        let mut numbers = BTreeMap::new();
        for layout in &problem.prefill.ranks {
            for index in 0..layout.regions.len() as u32 {
                numbers.insert((layout.rank, index), regions.len() as u32);
                regions.push((layout.rank, index));
            }
        }
        let mut page_owner = BTreeMap::new();
        for (request_index, request) in problem.requests.iter().enumerate() {
            for (ordinal, page) in request.prefill_pages.iter().enumerate() {
                page_owner.insert(*page, (request_index, ordinal as u32));
            }
        }
        Sources { problem, regions, numbers, page_owner }
    }

    /// Global number of a prefill region, used in the byte pattern.
    pub fn number(&self, rank: RankId, region: u32) -> u32 {
        self.numbers[&(rank, region)]
    }

    /// Decodes one decode token row from its bytes; `offset` is the row's byte offset in its region.
    pub fn classify(&self, offset: u64, found: &[u8]) -> Content {
        if pattern::matches_sentinel(offset, found) {
            return Content::Sentinel;
        }
        // The first word that decodes names where the row was meant to come from, even if others are damaged.
        let decoded = found.chunks_exact(8).enumerate().find_map(|(index, word)| {
            let word = u64::from_le_bytes(word.try_into().expect("chunks of 8 bytes"));
            let (number, offset) = pattern::decode_word(word)?;
            let (source, region) = self.regions.get(number as usize).copied()?;
            Some((number, source, region, offset.checked_sub(index as u64 * 8)?))
        });
        let Some((number, source, source_region, source_offset)) = decoded else {
            return Content::Garbled { origin: None, differing_bytes: found.len() as u64 };
        };
        let region = &self.problem.prefill.rank(source).regions[source_region as usize];
        let source_len = region.token_len();
        if source_offset % source_len != 0 || !pattern::matches_source(number, source_offset, found) {
            let differing_bytes = found
                .iter()
                .enumerate()
                .filter(|(index, byte)| **byte != pattern::source_byte(number, source_offset + *index as u64))
                .count() as u64;
            return Content::Garbled { origin: Some((source, region.layer, source_offset)), differing_bytes };
        }
        self.describe(source, source_region, source_offset / source_len)
    }

    /// Names prefill row `row` of region `region` on `source`: the token it holds, or an unused slot.
    pub fn describe(&self, source: RankId, region: u32, row: u64) -> Content {
        let layer = self.problem.prefill.rank(source).regions[region as usize].layer;
        let topology = &self.problem.prefill.topology;
        let page_size = u64::from(topology.page_size);
        let page = (row / page_size) as u32;
        let slot = (row % page_size) as u32;
        if let Some((request_index, ordinal)) = self.page_owner.get(&page) {
            let request = &self.problem.requests[*request_index];
            // A physical page row maps to a position through the side's own DCP layout (domain.md §2.1).
            let position = ordinal * topology.virtual_page_size() + slot * topology.dcp + topology.dcp_rank(source.tp);
            if position < request.tokens {
                return Content::Token { request: request.id, position, source, layer };
            }
        }
        Content::Slot { source, layer, row }
    }
}

/// Where one decode row's bytes must come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Expected {
    source: RankId,
    source_region: u32,
    source_row: u64,
}

/// Checks a completed transfer: every decode byte against the rules, and every write happened once.
pub fn check(problem: &Problem, observation: &Observation) -> Vec<Violation> {
    let sources = Sources::new(problem);
    let mut violations = Vec::new();
    for layout in &problem.decode.ranks {
        for (region_index, region) in layout.regions.iter().enumerate() {
            let key = RegionKey { side: Side::Decode, rank: layout.rank, region: region_index as u32 };
            let expected = expected_rows(problem, layout.rank, region.layer, region.row_count(), &mut violations);
            compare(&sources, key, &expected, observation, &mut violations);
        }
    }
    check_writes(problem, observation, &mut violations);
    violations
}

/// Checks a rejected transfer: nothing was written and every decode byte is still the sentinel.
pub fn check_untouched(problem: &Problem, observation: &Observation) -> Vec<Violation> {
    let sources = Sources::new(problem);
    let mut violations = Vec::new();
    for layout in &problem.decode.ranks {
        for (region_index, region) in layout.regions.iter().enumerate() {
            let key = RegionKey { side: Side::Decode, rank: layout.rank, region: region_index as u32 };
            let expected = vec![None; region.row_count() as usize];
            compare(&sources, key, &expected, observation, &mut violations);
        }
    }
    check_writes(problem, observation, &mut violations);
    violations
}

/// The prefill rank that writes layer `layer` into decode rank `target` (domain.md §3.1, §3.3).
///
/// The latent is replicated on every prefill TP rank, so exactly one of them is the real sender:
/// `d div k` when decode TP is larger, the first of `d*k .. d*k+k` when it is smaller.
fn sender(problem: &Problem, target: RankId, layer: LayerId) -> Option<(RankId, u32)> {
    let prefill = &problem.prefill.topology;
    let decode = &problem.decode.topology;
    let tp = if decode.tp >= prefill.tp {
        target.tp / (decode.tp / prefill.tp)
    } else {
        target.tp * (prefill.tp / decode.tp)
    };
    problem.prefill.ranks.iter().filter(|layout| layout.rank.tp == tp).find_map(|layout| {
        if decode.pp == prefill.pp && layout.rank.pp != target.pp {
            return None;
        }
        let index = layout.regions.iter().position(|region| region.layer == layer)?;
        Some((layout.rank, index as u32))
    })
}

/// Enumerates, for one decode region, the source of every row (`None` = must stay sentinel).
fn expected_rows(
    problem: &Problem,
    target: RankId,
    layer: LayerId,
    row_count: u64,
    violations: &mut Vec<Violation>,
) -> Vec<Option<Expected>> {
    let mut expected = vec![None; row_count as usize];
    let Some((source, source_region)) = sender(problem, target, layer) else {
        return expected;
    };
    let prefill = &problem.prefill.topology;
    let decode = &problem.decode.topology;
    let source_len = problem.prefill.rank(source).regions[source_region as usize].token_len();
    let target_region = problem.decode.rank(target).regions.iter().find(|region| region.layer == layer);
    let target_len = target_region.map_or(source_len, |region| region.token_len());
    if source_len != target_len {
        violations.push(Violation {
            rank: target,
            layer,
            row: 0,
            kind: ViolationKind::Geometry { source_len, target_len },
        });
        return expected;
    }
    let page = u64::from(decode.page_size);
    let mut place = |target_row: u64, source_row: u64| {
        expected[target_row as usize] = Some(Expected { source, source_region, source_row });
    };
    for request in &problem.requests {
        let prefix = request.decode_prefix;
        if prefill.dcp == decode.dcp {
            // Same layout on both sides: the send range's allocator pages are copied whole, page k to decode page k.
            let allocator_page = prefill.virtual_page_size();
            let first_page = (prefix / allocator_page) as usize;
            for (ordinal, target_page) in request.decode_pages.iter().enumerate() {
                let Some(source_page) = request.prefill_pages.get(first_page + ordinal) else { break };
                for slot in 0..page {
                    place(u64::from(*target_page) * page + slot, u64::from(*source_page) * page + slot);
                }
            }
        } else if prefill.dcp == 1 {
            // Token relayout (domain.md §2.1, §2.4): position p lives on DCP rank p mod c at local row (p - prefix) div c.
            let dcp = decode.dcp;
            let rank = decode.dcp_rank(target.tp);
            for position in prefix..request.tokens {
                if position % dcp != rank {
                    continue;
                }
                let local = u64::from((position - prefix) / dcp);
                let Some(target_page) = request.decode_pages.get((local / page) as usize) else {
                    violations.push(Violation {
                        rank: target,
                        layer,
                        row: local,
                        kind: ViolationKind::Unplaceable { request: request.id, position },
                    });
                    continue;
                };
                let source_page = request.prefill_pages[(u64::from(position) / page) as usize];
                place(
                    u64::from(*target_page) * page + local % page,
                    u64::from(source_page) * page + u64::from(position) % page,
                );
            }
        }
    }
    expected
}

fn compare(
    sources: &Sources<'_>,
    key: RegionKey,
    expected: &[Option<Expected>],
    observation: &Observation,
    violations: &mut Vec<Violation>,
) {
    let region = &sources.problem.decode.rank(key.rank).regions[key.region as usize];
    let Some(bytes) = observation.images.get(&key) else {
        panic!("observation lacks decode region {key:?}");
    };
    let row_len = region.token_len();
    for (row, want) in expected.iter().enumerate() {
        let offset = row as u64 * row_len;
        let found = &bytes[offset as usize..(offset + row_len) as usize];
        let ok = match want {
            None => pattern::matches_sentinel(offset, found),
            Some(want) => {
                let number = sources.number(want.source, want.source_region);
                pattern::matches_source(number, want.source_row * row_len, found)
            }
        };
        if ok {
            continue;
        }
        let expected = match want {
            None => Content::Sentinel,
            Some(want) => sources.describe(want.source, want.source_region, want.source_row),
        };
        let found = sources.classify(offset, found);
        violations.push(Violation {
            rank: key.rank,
            layer: region.layer,
            row: row as u64,
            kind: ViolationKind::Wrong { expected, found },
        });
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
        let mut end = 0;
        for (offset, length) in writes {
            if offset < end {
                let overlap = end.min(offset + length) - offset;
                violations.push(Violation {
                    rank: key.rank,
                    layer: region.layer,
                    row: offset / region.token_len(),
                    kind: ViolationKind::Overwritten { offset, length: overlap },
                });
            }
            end = end.max(offset + length);
        }
    }
}
