//! The pure planner: `plan(&Problem) -> Result<Plan, PlanError>`.
//!
//! Start at [`plan`]. It validates topologies (ranks.rs), pairs entries by global layer id (pairing.rs) and
//! computes per-chunk token-row runs (rows.rs); the result is a canonical [`Plan`] that expands into byte
//! [`Copy`]s. No IO, clock or randomness here (ARCHITECTURE.md).

mod error;
mod pairing;
mod ranks;
mod rows;

pub use error::PlanError;
pub use rows::RowRun;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::model::{LayerId, Problem, RankId, Request};
use ranks::{Mode, Role};
use rows::ChunkView;

/// Which source entry feeds which target entry, and which bytes of each token row move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryPair {
    /// Region index on the source rank.
    pub source_region: u32,
    /// Region index on the target rank.
    pub target_region: u32,
    /// Global layer id both entries carry.
    pub layer: LayerId,
    /// Bytes per token row on each side.
    pub source_row_len: u64,
    pub target_row_len: u64,
    /// Byte offset inside a row and length moved per row (full rows for replicated latent KV).
    pub source_column: u64,
    pub target_column: u64,
    pub length: u64,
}

impl EntryPair {
    fn full_rows(&self) -> bool {
        self.source_column == 0
            && self.target_column == 0
            && self.length == self.source_row_len
            && self.length == self.target_row_len
    }
}

/// All bytes one source rank sends one target rank for one chunk of one request.
///
/// Every entry pair moves the same row runs; copies are `entries × runs` (full rows) or one per row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferGroup {
    pub request: u32,
    pub chunk: u32,
    pub source: RankId,
    pub target: RankId,
    pub entries: Arc<[EntryPair]>,
    pub runs: Arc<[RowRun]>,
}

/// One byte move between registered regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub request: u32,
    pub chunk: u32,
    pub source: RankId,
    pub source_region: u32,
    pub source_offset: u64,
    pub target: RankId,
    pub target_region: u32,
    pub target_offset: u64,
    pub length: u64,
}

/// A canonical transfer plan: groups sorted by (request, chunk, source, target), plus why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub groups: Vec<TransferGroup>,
    /// Decisions in the order they were taken, rendered into golden files.
    pub explain: Vec<String>,
}

impl Plan {
    /// Every copy, coalesced into maximal contiguous runs within a group, in canonical order.
    pub fn copies(&self) -> impl Iterator<Item = Copy> + '_ {
        self.groups.iter().flat_map(|group| {
            group.entries.iter().flat_map(move |entry| {
                group.runs.iter().flat_map(move |run| {
                    let (count, rows_per_copy) = if entry.full_rows() { (1, run.rows) } else { (run.rows, 1) };
                    (0..count).map(move |k| Copy {
                        request: group.request,
                        chunk: group.chunk,
                        source: group.source,
                        source_region: entry.source_region,
                        source_offset: (run.source_row + k) * entry.source_row_len + entry.source_column,
                        target: group.target,
                        target_region: entry.target_region,
                        target_offset: (run.target_row + k) * entry.target_row_len + entry.target_column,
                        length: entry.length * rows_per_copy,
                    })
                })
            })
        })
    }

    /// Number of copies [`Plan::copies`] yields, without expanding them.
    pub fn copy_count(&self) -> u64 {
        self.groups
            .iter()
            .map(|group| {
                let rows: u64 = group.runs.iter().map(|run| run.rows).sum();
                let runs = group.runs.len() as u64;
                group.entries.iter().map(|entry| if entry.full_rows() { runs } else { rows }).sum::<u64>()
            })
            .sum()
    }

    /// Total bytes moved.
    pub fn bytes_total(&self) -> u64 {
        self.groups
            .iter()
            .map(|group| {
                let rows: u64 = group.runs.iter().map(|run| run.rows).sum();
                group.entries.iter().map(|entry| entry.length * rows).sum::<u64>()
            })
            .sum()
    }
}

/// Plans every request of `problem`; any rejection is returned before a single copy exists.
pub fn plan(problem: &Problem) -> Result<Plan, PlanError> {
    let prefill = &problem.prefill.topology;
    let decode = &problem.decode.topology;
    let pool = problem.model.pool_kind();
    ranks::check_topologies(prefill, decode)?;

    let mut explain = vec![
        format!(
            "pool: {pool}, {} KV entries of {} B per token row",
            problem.model.mla_layers.len(),
            problem.model.token_len()
        ),
        ranks::describe_mapping(prefill, decode, pool),
    ];

    // Registration-time work, once per connection (domain.md §6.3): mode, geometry and entry pairing.
    let mut links = Vec::new();
    let mut modes = BTreeMap::new();
    let mut pairings: BTreeMap<(RankId, String), Vec<RankId>> = BTreeMap::new();
    let mut dummies = 0;
    for connection in ranks::connections(prefill, decode, pool) {
        // Every registered peer passes the DCP gate, writers or not (domain.md §6.3).
        let mode = ranks::transfer_mode(prefill, connection.prefill, decode, connection.decode)?;
        if connection.role != Role::Writer {
            dummies += 1;
            continue;
        }
        let entries = pair_connection(problem, connection.prefill, connection.decode, mode)?;
        let text = describe_pairing(&entries);
        pairings.entry((connection.prefill, text)).or_default().push(connection.decode);
        modes.insert(describe_mode(mode, pool), ());
        links.push((connection, mode, Arc::<[EntryPair]>::from(entries)));
    }
    explain.extend(modes.into_keys());
    if dummies > 0 {
        explain.push(format!("{dummies} connections carry no KV (dummy or state-only prefill ranks)"));
    }
    for ((source, text), targets) in pairings {
        explain.push(format!("pairing by global layer id {source} -> decode {}: {text}", rank_list(&targets)));
    }

    let mut groups = Vec::new();
    for request in &problem.requests {
        explain.push(describe_request(request));
        let virtual_page = decode.virtual_page_size();
        if request.decode_prefix % virtual_page != 0 {
            return Err(PlanError::UnalignedDecodePrefix {
                virtual_page_size: virtual_page,
                decode_prefix: request.decode_prefix,
            });
        }
        // Runs depend only on (chunk, mode), not on the layer or the stage: compute each once.
        let mut cache: BTreeMap<(u32, Mode), Arc<[RowRun]>> = BTreeMap::new();
        for (chunk_index, chunk) in
            chunks(request, prefill.virtual_page_size(), u64::from(prefill.page_size)).enumerate()
        {
            for (connection, mode, entries) in &links {
                let key = (chunk_index as u32, *mode);
                let runs = match cache.get(&key) {
                    Some(runs) => runs.clone(),
                    None => {
                        let runs: Arc<[RowRun]> = match *mode {
                            Mode::PageCopy => rows::page_copy(&chunk)?,
                            Mode::Relayout { dcp, dcp_rank } => rows::relayout(&chunk, dcp, dcp_rank)?,
                        }
                        .into();
                        cache.insert(key, runs.clone());
                        runs
                    }
                };
                if runs.is_empty() || entries.is_empty() {
                    continue;
                }
                groups.push(TransferGroup {
                    request: request.id,
                    chunk: chunk_index as u32,
                    source: connection.prefill,
                    target: connection.decode,
                    entries: entries.clone(),
                    runs,
                });
            }
        }
    }
    groups.sort_by_key(|group| (group.request, group.chunk, group.source, group.target));
    Ok(Plan { groups, explain })
}

/// Splits a request's send range into the chunks prefill sends (domain.md §2.3).
fn chunks(request: &Request, prefill_page: u32, page_size: u64) -> impl Iterator<Item = ChunkView<'_>> + '_ {
    let first_page = (request.decode_prefix / prefill_page) as usize;
    let mut start = 0u32;
    request.chunks.iter().map(move |tokens| {
        let pages = tokens.div_ceil(prefill_page) as usize;
        let offset = (start / prefill_page) as usize;
        start += tokens;
        let begin = (first_page + offset).min(request.prefill_pages.len());
        let end = (begin + pages).min(request.prefill_pages.len());
        ChunkView {
            source_pages: &request.prefill_pages[begin..end],
            target_pages: &request.decode_pages,
            source_page_offset: offset as u64,
            decode_prefix: u64::from(request.decode_prefix),
            tokens: u64::from(*tokens),
            page_size,
        }
    })
}

/// Pairs the source rank's entries with the target rank's and checks their geometry.
fn pair_connection(problem: &Problem, source: RankId, target: RankId, mode: Mode) -> Result<Vec<EntryPair>, PlanError> {
    let source_layout = problem.prefill.rank(source);
    let target_layout = problem.decode.rank(target);
    let targets = pairing::pair_entries(
        source_layout.advertised_layer_ids.as_deref(),
        target_layout.advertised_layer_ids.as_deref(),
        source_layout.regions.len(),
        target_layout.regions.len(),
        problem.prefill.topology.pp == 1,
    )?;
    let pairs: Vec<EntryPair> = targets
        .iter()
        .enumerate()
        .map(|(source_index, target_index)| {
            let source_region = &source_layout.regions[source_index];
            let target_region = &target_layout.regions[*target_index];
            EntryPair {
                source_region: source_index as u32,
                target_region: *target_index as u32,
                layer: source_region.layer,
                source_row_len: source_region.token_len(),
                target_row_len: target_region.token_len(),
                source_column: 0,
                target_column: 0,
                length: source_region.token_len(),
            }
        })
        .collect();
    match mode {
        Mode::Relayout { .. } => {
            // prepare_dcp_token_item_lens (domain.md §2.6): token lengths must agree entry by entry.
            let source: Vec<u64> = pairs.iter().map(|pair| pair.source_row_len).collect();
            let target: Vec<u64> = pairs.iter().map(|pair| pair.target_row_len).collect();
            if source != target {
                return Err(PlanError::DcpGeometry { prefill: source, decode: target });
            }
        }
        Mode::PageCopy => {
            for (pair, target_index) in pairs.iter().zip(&targets) {
                let source = source_layout.regions[pair.source_region as usize].item_len;
                let target = target_layout.regions[*target_index].item_len;
                if source != target {
                    return Err(PlanError::ItemLength { layer: pair.layer, prefill: source, decode: target });
                }
            }
        }
    }
    Ok(pairs)
}

fn describe_mode(mode: Mode, pool: crate::model::PoolKind) -> String {
    match mode {
        Mode::PageCopy => "transfer mode: plain page copy, equal DCP sizes (domain.md §2.5 case 1)".to_owned(),
        Mode::Relayout { dcp, .. } => {
            format!(
                "transfer mode: token relayout, prefill DCP 1 -> decode DCP {dcp}, {pool} pool (domain.md §2.5 case 2)"
            )
        }
    }
}

fn describe_pairing(entries: &[EntryPair]) -> String {
    if entries.is_empty() {
        return "no KV entries on this stage".to_owned();
    }
    let parts: Vec<String> = entries
        .iter()
        .map(|entry| format!("L{} {}->{}", entry.layer, entry.source_region, entry.target_region))
        .collect();
    parts.join(", ")
}

fn describe_request(request: &Request) -> String {
    format!(
        "request {}: send range [{}, {}) in {} chunk(s) {:?}; decode pages {:?}",
        request.id,
        request.decode_prefix,
        request.tokens,
        request.chunks.len(),
        request.chunks,
        request.decode_pages
    )
}

/// `tp0..7` style list of ranks (all in one stage) or an explicit list.
fn rank_list(ranks: &[RankId]) -> String {
    let same_stage = ranks.iter().all(|rank| rank.pp == ranks[0].pp);
    let contiguous = ranks.windows(2).all(|pair| pair[1].tp == pair[0].tp + 1);
    if ranks.len() > 1 && same_stage && contiguous {
        format!("pp{}/tp{}..{}", ranks[0].pp, ranks[0].tp, ranks[ranks.len() - 1].tp)
    } else {
        let parts: Vec<String> = ranks.iter().map(ToString::to_string).collect();
        parts.join(", ")
    }
}
