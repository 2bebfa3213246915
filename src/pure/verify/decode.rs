//! Reading bytes back into coordinates: which prefill region, offset, token, head, slot or channel they hold.

use std::collections::BTreeMap;
use std::fmt;

use super::pattern;
use crate::model::{Attention, KvPart, LayerId, Problem, RankId, Region, RegionKind, StateKind, TensorShape};

/// Index of the problem's source side: global region numbers and which request owns each page, slot and row.
pub struct Sources<'a> {
    pub(crate) problem: &'a Problem,
    /// Global source region number → (rank, region index).
    regions: Vec<(RankId, u32)>,
    numbers: BTreeMap<(RankId, u32), u32>,
    /// Prefill KV allocator page → (request index, page ordinal in the request).
    page_owner: BTreeMap<(u32, u32), (usize, u32)>,
    /// Prefill Mamba slot → request index.
    slot_owner: BTreeMap<(u32, u32), usize>,
    /// Prefill aux row → request index.
    aux_owner: BTreeMap<(u32, u32), usize>,
    /// Per component: prefill state page → (request index, ordinal).
    state_page_owner: Vec<BTreeMap<(u32, u32), (usize, u32)>>,
}

/// A maximal run of bytes with one origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Run {
    /// Never written.
    Sentinel { offset: u64, length: u64 },
    /// Consecutive bytes of one source region.
    Source { offset: u64, length: u64, number: u32, source_offset: u64 },
    /// Neither: corrupted or shifted bytes.
    Unknown { offset: u64, length: u64 },
}

impl Run {
    pub fn offset(&self) -> u64 {
        match *self {
            Run::Sentinel { offset, .. } | Run::Source { offset, .. } | Run::Unknown { offset, .. } => offset,
        }
    }

    pub fn length(&self) -> u64 {
        match *self {
            Run::Sentinel { length, .. } | Run::Source { length, .. } | Run::Unknown { length, .. } => length,
        }
    }
}

/// What a source byte range holds, in the coordinates of its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Token rows (or one token's head slice) of a KV or draft entry.
    Token { request: u32, position: u32, heads: Option<(u32, u32)> },
    /// A KV row that holds no token of any request (unused slot of a page), or a head slice of one.
    Slot { row: u64, heads: Option<(u32, u32)> },
    /// Bytes of one state item (a Mamba `slot` or a state `page`): its owner, index, and where inside it.
    State { request: Option<u32>, noun: &'static str, item: u64, within: String },
    /// One aux row.
    Aux { request: Option<u32>, row: u64 },
}

/// A decoded source range: rank, region label and origin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    pub source: RankId,
    pub layer: LayerId,
    /// `kv`, `k`, `v`, `draft`, the state tensor name, or `aux<b>`.
    pub tensor: String,
    pub origin: Origin,
}

impl fmt::Display for Described {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.origin {
            Origin::Token { request, position, heads } => {
                write!(f, "token {position} of request {request}")?;
                if let Some((first, count)) = heads {
                    write_heads(f, *first, *count)?;
                }
            }
            Origin::Slot { row, heads } => {
                write!(f, "unused slot row {row}")?;
                if let Some((first, count)) = heads {
                    write_heads(f, *first, *count)?;
                }
            }
            Origin::State { request, noun, item, within } => {
                match request {
                    Some(request) => write!(f, "request {request} {noun} {item}")?,
                    None => write!(f, "unowned {noun} {item}")?,
                }
                if !within.is_empty() {
                    write!(f, " {within}")?;
                }
            }
            Origin::Aux { request, row } => match request {
                Some(request) => write!(f, "aux row {row} of request {request}")?,
                None => write!(f, "unowned aux row {row}")?,
            },
        }
        write!(f, " from prefill {} layer {} {}", self.source, self.layer, self.tensor)
    }
}

fn write_heads(f: &mut fmt::Formatter<'_>, first: u32, count: u32) -> fmt::Result {
    if count == 1 {
        write!(f, " head {first}")
    } else {
        write!(f, " heads {first}..{}", first + count - 1)
    }
}

/// Name of a region's tensor for reports.
pub fn tensor_name(problem: &Problem, region: &Region) -> String {
    match region.kind {
        RegionKind::Kv(KvPart::Latent) => "kv".to_owned(),
        RegionKind::Kv(KvPart::Key) => "K".to_owned(),
        RegionKind::Kv(KvPart::Value) => "V".to_owned(),
        RegionKind::Draft => "draft".to_owned(),
        RegionKind::State { component, tensor } => {
            let component = &problem.model.state[component as usize];
            format!("{} ({} state {})", component.tensors[tensor as usize].name, component.kind, tensor)
        }
        RegionKind::Aux { buffer } => format!("aux{buffer}"),
        RegionKind::Staging => "staging ring".to_owned(),
    }
}

/// What one item of a region is called in reports: `row` for KV, `slot`, `page` or `row` for state and aux.
pub fn item_noun(problem: &Problem, region: &Region) -> &'static str {
    match region.kind {
        RegionKind::State { component, .. } if problem.model.state[component as usize].kind == StateKind::Mamba => {
            "slot"
        }
        RegionKind::State { .. } => "page",
        _ => "row",
    }
}

/// First global KV head held by an attention-TP rank, and the heads it holds (domain.md §1.2, §3.2).
pub fn rank_heads(kv_heads: u32, tp: u32, rank: u32) -> (u32, u32) {
    if tp <= kv_heads {
        let local = kv_heads / tp;
        (rank * local, local)
    } else {
        (rank / (tp / kv_heads), 1)
    }
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
        let mut slot_owner = BTreeMap::new();
        let mut aux_owner = BTreeMap::new();
        let mut state_page_owner = vec![BTreeMap::new(); problem.model.state.len()];
        // Keyed by (prefill DP group, index): each group has its own pools.
        for (request_index, request) in problem.requests.iter().enumerate() {
            let group = request.prefill_dp;
            for (ordinal, page) in request.prefill_pages.iter().enumerate() {
                page_owner.insert((group, *page), (request_index, ordinal as u32));
            }
            slot_owner.insert((group, request.prefill_state.slot), request_index);
            aux_owner.insert((group, request.prefill_state.aux), request_index);
            for (component, pages) in request.prefill_state.pages.iter().enumerate() {
                for (ordinal, page) in pages.iter().enumerate() {
                    state_page_owner[component].insert((group, *page), (request_index, ordinal as u32));
                }
            }
        }
        Sources { problem, regions, numbers, page_owner, slot_owner, aux_owner, state_page_owner }
    }

    /// Global number of a prefill region, used in the byte pattern.
    pub fn number(&self, rank: RankId, region: u32) -> u32 {
        self.numbers[&(rank, region)]
    }

    /// Rank and region index of a global source region number.
    pub fn region(&self, number: u32) -> Option<(RankId, u32)> {
        self.regions.get(number as usize).copied()
    }

    /// Splits `bytes` (starting at 8-aligned byte `offset` of a decode region) into runs of one origin each.
    pub fn runs(&self, offset: u64, bytes: &[u8]) -> Vec<Run> {
        let mut res: Vec<Run> = Vec::new();
        for (index, word) in bytes.chunks(8).enumerate() {
            let at = offset + index as u64 * 8;
            let length = word.len() as u64;
            let run = if pattern::matches_sentinel(at, word) {
                Run::Sentinel { offset: at, length }
            } else {
                let mut full = [0u8; 8];
                full[..word.len()].copy_from_slice(word);
                match pattern::decode_word(u64::from_le_bytes(full)) {
                    Some((number, source_offset))
                        if self.region(number).is_some() && pattern::matches_source(number, source_offset, word) =>
                    {
                        Run::Source { offset: at, length, number, source_offset }
                    }
                    _ => Run::Unknown { offset: at, length },
                }
            };
            match (res.last_mut(), run) {
                (Some(Run::Sentinel { length: total, .. }), Run::Sentinel { .. })
                | (Some(Run::Unknown { length: total, .. }), Run::Unknown { .. }) => *total += length,
                (
                    Some(Run::Source { length: total, number: last_number, source_offset: last_offset, .. }),
                    Run::Source { number, source_offset, .. },
                ) if *last_number == number && *last_offset + *total == source_offset => *total += length,
                _ => res.push(run),
            }
        }
        res
    }

    /// Names the source bytes `[offset, offset + length)` of global source region `number`.
    pub fn describe(&self, number: u32, offset: u64, length: u64) -> Described {
        let (source, index) = self.region(number).expect("decoded numbers name registered regions");
        let problem = self.problem;
        let region = &problem.prefill.rank(source).regions[index as usize];
        let item = offset / region.item_len;
        let origin = match region.kind {
            RegionKind::Kv(_) | RegionKind::Draft => self.token_origin(source, region, offset, length),
            RegionKind::State { component, tensor } => {
                let kind = problem.model.state[component as usize].kind;
                let request = match kind {
                    StateKind::Mamba => self.slot_owner.get(&(source.dp, item as u32)).copied(),
                    _ => self.state_page_owner[component as usize].get(&(source.dp, item as u32)).map(|owner| owner.0),
                };
                let within =
                    self.state_within(component, tensor, offset % region.item_len, length, region.item_len, source.tp);
                let noun = if kind == StateKind::Mamba { "slot" } else { "page" };
                Origin::State { request: request.map(|index| problem.requests[index].id), noun, item, within }
            }
            RegionKind::Aux { .. } => Origin::Aux {
                request: self.aux_owner.get(&(source.dp, item as u32)).map(|index| problem.requests[*index].id),
                row: item,
            },
            // A prefill registers no ring; named by its row, should a source ever be one.
            RegionKind::Staging => Origin::Aux { request: None, row: item },
        };
        Described { source, layer: region.layer, tensor: tensor_name(problem, region), origin }
    }

    fn token_origin(&self, source: RankId, region: &Region, offset: u64, length: u64) -> Origin {
        let problem = self.problem;
        let topology = &problem.prefill.topology;
        let row_len = region.row_len();
        let row = offset / row_len;
        let within = offset % row_len;
        // Head-sharded rows (MHA KV, a head-sharded draft) name the global heads a part of a row holds.
        let sharded = match (problem.model.attention, region.kind) {
            (Attention::Mha { kv_heads, .. }, RegionKind::Kv(_)) => Some((kv_heads, problem.model.head_len())),
            (_, RegionKind::Draft) => problem.model.draft.and_then(|draft| draft.sharded()),
            _ => None,
        };
        let heads = match sharded {
            Some((kv_heads, head_len)) if (within != 0 || length < row_len) && head_len > 0 => {
                let (first, _) = rank_heads(kv_heads, topology.tp, source.tp);
                Some((first + (within / head_len) as u32, (length / head_len).max(1) as u32))
            }
            _ => None,
        };
        let rows = u64::from(region.rows_per_item);
        let page = (row / rows) as u32;
        let slot = (row % rows) as u32;
        if let Some((request_index, ordinal)) = self.page_owner.get(&(source.dp, page)) {
            let request = &problem.requests[*request_index];
            // A physical page row maps to a position through the side's own DCP layout (domain.md §2.1).
            let position = ordinal * topology.virtual_page_size() + slot * topology.dcp + topology.dcp_rank(source.tp);
            if position < request.tokens {
                return Origin::Token { request: request.id, position, heads };
            }
        }
        Origin::Slot { row, heads }
    }

    /// Where `[within, within + length)` of a state item sits: row, sub-block and global channels or heads.
    #[allow(clippy::too_many_arguments, reason = "a coordinate needs all of them")]
    fn state_within(&self, component: u32, tensor: u32, within: u64, length: u64, item_len: u64, rank: u32) -> String {
        let tensor_index = tensor;
        let tensor = &self.problem.model.state[component as usize].tensors[tensor as usize];
        let TensorShape::Sliced { full_dim, unit_bytes, outer_count, groups } = &tensor.shape else {
            return if within == 0 && length == item_len {
                String::new()
            } else {
                format!("bytes {within}..{}", within + length)
            };
        };
        let tp = self.problem.prefill.topology.tp;
        // The prefill's own order (scenario `state_layouts` may transpose the model's rows).
        let held = self.problem.prefill.sliced_layout(&self.problem.model, component, tensor_index);
        let (outer, unit_bytes) = held.unwrap_or((*outer_count, *unit_bytes));
        let outer = outer.max(1);
        let row_len = item_len / u64::from(outer);
        let (row, unit) = (within / row_len, (within % row_len) / unit_bytes);
        // A part of one unit (a damaged byte) still names the unit it lies in.
        let count = (length / unit_bytes).max(1);
        let groups: Vec<u32> = groups.clone().unwrap_or_else(|| vec![*full_dim]);
        let names: Vec<String> = if groups.len() == 3 {
            ["q", "k", "v"].iter().map(|name| (*name).to_owned()).collect()
        } else if groups.len() == 1 {
            vec![if tensor.name == "temporal" { "heads".to_owned() } else { "units".to_owned() }]
        } else {
            (0..groups.len()).map(|index| format!("group{index}")).collect()
        };
        // The rank's local units are its slice of each sub-block, back to back (domain.md §5.2).
        let mut start = 0u64;
        for (index, group) in groups.iter().enumerate() {
            let width = u64::from(group / tp);
            if unit >= start && unit + count <= start + width {
                // Global index = the rank's first unit of this sub-block + the offset inside it.
                let first = u64::from(rank) * width + unit - start;
                // Less than a unit (one tap of a channel-major conv channel, a damaged byte) names its bytes in it.
                let (skip, partial) = (within % unit_bytes, length < unit_bytes);
                if count == 1 && (skip > 0 || partial) {
                    let end = (skip + length).min(unit_bytes);
                    return format!("row {row} {} {first} bytes {skip}..{end} of {unit_bytes}", names[index]);
                }
                return format!("row {row} {} {first}..{}", names[index], first + count - 1);
            }
            start += width;
        }
        if within == 0 && length == item_len {
            return String::new();
        }
        format!("row {row} units {unit}..{}", unit + count - 1)
    }
}
