//! The planted layout bugs: each [`Mutant`] rewrites kvrelay's own transfer groups for one chunk the way a connector
//! once got them wrong, in domain.md's terms, and says from a [`Problem`] alone whether the bug can show there.
//!
//! Mutants rewrite the planner's output (entry pairs and row runs); they never reach into the planner or the
//! oracle. Where a rule must be restated to be broken (head slices of §3.2, Mamba blocks of §5.3), it is restated
//! here from domain.md.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::engine::seat::SeatQuery;
use crate::model::{
    Attention, ModelGeometry, Problem, RankLayout, RegionKind, Request, StateKind, StateMetadata, TensorShape,
};
use crate::plan::{EntryPair, Link, Peer, PlanError, RowRun, TransferGroup, TransferKind};

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mutant {
    /// PP: KV entry `k` of a stage pairs with decode entry `k`, not the entry of its global layer id (§4.3, §4.4).
    LocalLayerOrdinal,
    /// The decode page list restarts at index 0 every chunk instead of continuing at the chunk's offset (§2.3, §2.4).
    DecodePagesPerChunk,
    /// The last chunk counts `n div P` pages: the final partial page of the send range is never sent (§2.3).
    FinalPageOffByOne,
    /// GQA replication on decode takes Mori's `(ld * hd) mod hs` instead of `((ld div rep) * hd) mod hs` (§3.2).
    GqaReplicationFormula,
    /// Grouped Mamba conv state (q|k|v) sliced as one flat channel axis (§5.3, §5.4).
    FlatConvSplit,
    /// State entry paired `i -> j` but its destination looked up with `i` (§5.5, §8 "dst lookups must use j").
    DestinationBySourceIndex,
    /// An odd-length entry list split into halves (`n // 2`) loses its last entry (§4.5).
    OddListLastEntry,
    /// Two neighbouring ranks' head slices exchanged: rank `r` gets or places the heads of rank `r xor 1` (§3.2).
    SwappedHeadSlice,
    /// Aux rows sent by the first PP stage instead of the last (§1.6).
    AuxFromWrongStage,
    /// Mamba state blocks cut for the wrong TP rank: the prefill rank where the decode rank belongs, and back (§5.3).
    StateBlockWrongRank,
    /// A replicated state tensor under decode TP < prefill TP written by the group's second prefill rank instead of
    /// the first (`should_send_replicated_state` elects `lp % k == 0`, SGLang 0.5.23 `utils.py:872-904`).
    ReplicatedStateWrongWriter,
    /// SWA pages head-sliced under a TP change (SGLang 0.5.23 `_send_swa_state_slice`) with two neighbouring ranks'
    /// head slices exchanged, token by token (§3.2 applied to SWA state, `src/pure/plan/SGLANG.md`).
    SwaSwappedHeadSlice,
    /// DP attention: each request is dispatched to the next decode DP group, `(decode_dp + 1) mod dp`, so its KV lands
    /// in another group's ranks (a DP rank offset off by one; `src/pure/plan/SGLANG.md`). A routing bug: it changes
    /// which ranks see a request ([`Mutant::route`]), not the plan of a chunk.
    DecodeDpOffByOne,
    /// Prefill CP with all-CP transfer: every CP rank sends the whole chunk instead of its contiguous block of the
    /// request's pages (`filter_kv_indices_for_cp_rank` left out; `src/pure/plan/SGLANG.md`).
    CpWholeChunk,
    /// A decode holding a conv tensor transposed (`[taps, dim]` against the prefill's `[dim, taps]`) sliced with the
    /// prefill's outer count for both sides, as SGLang 0.5.23 does (`utils.py:979-1042`): the decode's advertised rows
    /// ignored (`src/pure/plan/SGLANG.md`, "Per-side conv layout").
    ConvUntransposed,
    /// A head-sharded draft under a TP change copied as whole rows, every head slice at column 0 (the draft treated as
    /// replicated, as kvrelay's draft rows were before drafts could be sharded; `src/pure/plan/SGLANG.md`).
    DraftWholeRows,
    /// A HiSparse decode's latent written at its logical (device) pages instead of the host pages it sent as
    /// `kv_indices`: the connector ignores that the KV destination is the host pool (`src/pure/plan/SGLANG.md`,
    /// "HiSparse").
    HiSparseDeviceDest,
    /// The staging ring's slots laid out layer by layer (K0, V0, K1, V1, the order of the pool's data pointers)
    /// instead of every K buffer, then every V buffer (SGLang's `k_buffers` then `v_buffers`,
    /// `staging_buffer.py:62-97`): a head slice lands in another slot of the image (`src/pure/plan/SGLANG.md`).
    StagingSlotOrder,
}

/// Every mutant, in table order.
pub const ALL: [Mutant; 18] = [
    Mutant::LocalLayerOrdinal,
    Mutant::DecodePagesPerChunk,
    Mutant::FinalPageOffByOne,
    Mutant::GqaReplicationFormula,
    Mutant::FlatConvSplit,
    Mutant::DestinationBySourceIndex,
    Mutant::OddListLastEntry,
    Mutant::SwappedHeadSlice,
    Mutant::AuxFromWrongStage,
    Mutant::StateBlockWrongRank,
    Mutant::ReplicatedStateWrongWriter,
    Mutant::SwaSwappedHeadSlice,
    Mutant::DecodeDpOffByOne,
    Mutant::CpWholeChunk,
    Mutant::ConvUntransposed,
    Mutant::DraftWholeRows,
    Mutant::HiSparseDeviceDest,
    Mutant::StagingSlotOrder,
];

/// What one prefill rank knows while one chunk of one room is planned for one peer.
pub struct Site<'a> {
    pub query: &'a SeatQuery<'a>,
    pub peer: &'a Peer,
    pub link: &'a Link,
    pub chunk: u32,
}

impl Mutant {
    /// The mutant's name in the table and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::LocalLayerOrdinal => "local-layer-ordinal",
            Mutant::DecodePagesPerChunk => "decode-pages-per-chunk",
            Mutant::FinalPageOffByOne => "final-page-off-by-one",
            Mutant::GqaReplicationFormula => "gqa-replication-formula",
            Mutant::FlatConvSplit => "flat-conv-split",
            Mutant::DestinationBySourceIndex => "destination-by-source-index",
            Mutant::OddListLastEntry => "odd-list-last-entry",
            Mutant::SwappedHeadSlice => "swapped-head-slice",
            Mutant::AuxFromWrongStage => "aux-from-wrong-stage",
            Mutant::StateBlockWrongRank => "state-block-wrong-rank",
            Mutant::ReplicatedStateWrongWriter => "replicated-state-wrong-writer",
            Mutant::SwaSwappedHeadSlice => "swa-swapped-head-slice",
            Mutant::DecodeDpOffByOne => "decode-dp-off-by-one",
            Mutant::CpWholeChunk => "cp-whole-chunk",
            Mutant::ConvUntransposed => "conv-untransposed",
            Mutant::DraftWholeRows => "draft-whole-rows",
            Mutant::HiSparseDeviceDest => "hisparse-device-dest",
            Mutant::StagingSlotOrder => "staging-slot-order",
        }
    }

    /// The mutant named `name`, if any.
    pub fn from_name(name: &str) -> Option<Mutant> {
        ALL.into_iter().find(|mutant| mutant.name() == name)
    }

    /// The domain.md section whose rule the mutant breaks.
    pub fn section(self) -> &'static str {
        match self {
            Mutant::LocalLayerOrdinal => "§4.3",
            Mutant::DecodePagesPerChunk => "§2.3",
            Mutant::FinalPageOffByOne => "§2.3",
            Mutant::GqaReplicationFormula | Mutant::SwappedHeadSlice | Mutant::SwaSwappedHeadSlice => "§3.2",
            Mutant::FlatConvSplit | Mutant::StateBlockWrongRank | Mutant::ReplicatedStateWrongWriter => "§5.3",
            Mutant::DestinationBySourceIndex => "§8",
            Mutant::OddListLastEntry => "§4.5",
            Mutant::AuxFromWrongStage => "§1.6",
            Mutant::DecodeDpOffByOne => "SGLANG.md DP",
            Mutant::CpWholeChunk => "SGLANG.md CP",
            Mutant::ConvUntransposed => "SGLANG.md conv",
            Mutant::DraftWholeRows => "SGLANG.md draft",
            Mutant::HiSparseDeviceDest => "SGLANG.md HiSparse",
            Mutant::StagingSlotOrder => "SGLANG.md staging",
        }
    }

    /// Whether the bug can change bytes in `problem`; otherwise why not (the table's `n/a`).
    pub fn applies(self, problem: &Problem) -> Result<(), &'static str> {
        let (prefill, decode) = (&problem.prefill.topology, &problem.decode.topology);
        let mamba = problem.model.state.iter().any(|component| component.kind == StateKind::Mamba);
        let require = |holds: bool, otherwise: &'static str| if holds { Ok(()) } else { Err(otherwise) };
        match self {
            Mutant::LocalLayerOrdinal => {
                require(prefill.pp > 1, "prefill PP1: ordinals are layer ids")?;
                require(decode.pp == 1, "decode stages hold the same layers: ordinals pair by id")
            }
            Mutant::DecodePagesPerChunk => {
                require(problem.requests.iter().any(|request| request.chunks.len() > 1), "every request is one chunk")
            }
            Mutant::FinalPageOffByOne => {
                let page = prefill.virtual_page_size();
                let partial = problem.requests.iter().any(|request| request.send_len() % page != 0);
                require(partial, "every send range ends on a page boundary")
            }
            Mutant::GqaReplicationFormula => {
                let Attention::Mha { kv_heads, .. } = problem.model.attention else { return Err("no head-sharded KV") };
                require(!staging_in_use(problem), "staging: head slices go to the ring (staging-slot-order)")?;
                require(decode.tp > kv_heads && decode.tp > prefill.tp, "no KV head replicated on decode")?;
                // Equivalent otherwise: with one head per prefill rank every formula `mod hs` picks head 0.
                require(kv_heads / prefill.tp > 1, "one KV head per prefill rank: every formula picks it")
            }
            Mutant::SwappedHeadSlice => {
                let Attention::Mha { kv_heads, .. } = problem.model.attention else { return Err("no head-sharded KV") };
                require(prefill.tp != decode.tp, "equal TP: whole rows")?;
                require(!staging_in_use(problem), "staging: head slices go to the ring (staging-slot-order)")?;
                require(prefill.tp.max(decode.tp) <= kv_heads, "neighbouring ranks are replicas of the same heads")
            }
            Mutant::FlatConvSplit => {
                require(mamba && prefill.tp != decode.tp, "no Mamba state sliced across TP")?;
                require(grouped_conv(problem), "no grouped conv tensor advertised with dims")
            }
            Mutant::StateBlockWrongRank => {
                require(mamba && prefill.tp != decode.tp, "no Mamba state sliced across TP")?;
                require(dims_advertised(problem), "no dims advertised: whole items")
            }
            Mutant::DestinationBySourceIndex => {
                require(!problem.model.state.is_empty(), "no state components")?;
                require(prefill.pp > 1 && decode.pp == 1, "state entries pair i -> i")
            }
            Mutant::OddListLastEntry => {
                require(problem.prefill.ranks.iter().any(has_odd_list), "every entry list has even length")
            }
            Mutant::AuxFromWrongStage => {
                require(!problem.model.aux_item_lens.is_empty(), "no aux buffers")?;
                require(prefill.pp > 1, "one prefill stage")
            }
            Mutant::SwaSwappedHeadSlice => {
                let Attention::Mha { kv_heads, .. } = problem.model.attention else { return Err("no head-sharded KV") };
                let swa = problem.model.state.iter().any(|component| component.kind == StateKind::Swa);
                require(swa && prefill.tp != decode.tp, "no SWA state head-sliced across TP")?;
                require(prefill.tp.max(decode.tp) <= kv_heads, "neighbouring ranks are replicas of the same heads")
            }
            Mutant::DecodeDpOffByOne => require(decode.dp > 1, "decode DP1: one group receives every request"),
            Mutant::CpWholeChunk => require(prefill.cp > 1 && prefill.all_cp, "CP rank 0 sends every page"),
            Mutant::ConvUntransposed => {
                let model = &problem.model;
                let transposed = model.state.iter().enumerate().any(|(component, it)| {
                    (0..it.tensors.len() as u32).any(|tensor| {
                        let held =
                            |side: &crate::model::SideLayout| side.sliced_layout(model, component as u32, tensor);
                        held(&problem.prefill).map(|it| it.0) != held(&problem.decode).map(|it| it.0)
                    })
                });
                require(transposed, "both sides hold every tensor in one order")
            }
            Mutant::DraftWholeRows => {
                let sharded = problem.model.draft.is_some_and(|draft| draft.sharded().is_some());
                require(sharded, "no head-sharded draft")?;
                require(prefill.tp != decode.tp, "equal TP: draft rows move whole")
            }
            Mutant::StagingSlotOrder => {
                require(staging_in_use(problem), "no staging ring in use")?;
                let slots = problem.decode.ranks.first().map_or(0, |layout| layout.kv_entries.len());
                require(slots > 2, "one layer: K0, V0 is both orders")
            }
            Mutant::HiSparseDeviceDest => require(
                problem.requests.iter().any(|request| !request.decode_host_pages.is_empty()),
                "no HiSparse decode: KV lands at the allocator's pages",
            ),
            Mutant::ReplicatedStateWrongWriter => {
                let replicated = problem.model.state.iter().any(|component| {
                    component.kind == StateKind::Mamba
                        && component.tensors.iter().any(|tensor| matches!(tensor.shape, TensorShape::Replicated { .. }))
                });
                require(replicated, "no replicated Mamba tensor")?;
                require(prefill.tp > decode.tp, "decode TP >= prefill TP: every decode rank has one writer")?;
                require(dims_advertised(problem), "no dims advertised: whole items")
            }
        }
    }

    /// The groups of one chunk as the bug plans them (a rejection when replanning under the bug fails).
    pub fn mutate(self, site: &Site<'_>, groups: Vec<TransferGroup>) -> Result<Vec<TransferGroup>, PlanError> {
        Ok(match self {
            Mutant::LocalLayerOrdinal => local_layer_ordinal(site, groups),
            Mutant::DecodePagesPerChunk => decode_pages_per_chunk(site, groups)?,
            Mutant::FinalPageOffByOne => final_page_off_by_one(site, groups),
            Mutant::GqaReplicationFormula => head_slices(site, groups, HeadBug::Formula),
            Mutant::SwappedHeadSlice => head_slices(site, groups, HeadBug::Neighbour),
            Mutant::FlatConvSplit => mamba_blocks(site, groups, BlockBug::Flat),
            Mutant::StateBlockWrongRank => mamba_blocks(site, groups, BlockBug::WrongRank),
            Mutant::DestinationBySourceIndex => destination_by_source_index(site, groups),
            Mutant::OddListLastEntry => odd_list_last_entry(groups),
            Mutant::AuxFromWrongStage => aux_from_wrong_stage(site, groups),
            Mutant::ReplicatedStateWrongWriter => replicated_state_wrong_writer(site, groups),
            Mutant::SwaSwappedHeadSlice => swa_swapped_head_slice(site, groups),
            Mutant::DecodeDpOffByOne => groups,
            Mutant::CpWholeChunk => site.link.without_cp_block().chunk_groups(site.query.request, site.chunk)?,
            Mutant::StagingSlotOrder => staging_slot_order(groups),
            Mutant::HiSparseDeviceDest => {
                let request = site.query.request;
                let device = Request { decode_host_pages: Vec::new(), ..request.clone() };
                let replanned = site.link.chunk_groups(&device, site.chunk)?;
                let kv = |group: &TransferGroup| group.kind == TransferKind::Kv;
                let mut res: Vec<TransferGroup> = groups.into_iter().filter(|group| !kv(group)).collect();
                res.extend(replanned.into_iter().filter(kv));
                res
            }
            Mutant::ConvUntransposed => mamba_blocks(site, groups, BlockBug::Untransposed),
            Mutant::DraftWholeRows => map_entries(
                groups,
                |group| group.kind == TransferKind::Draft,
                |_, entry| {
                    let length = entry.length.max(entry.source_row_len.min(entry.target_row_len));
                    Some(EntryPair { source_column: 0, target_column: 0, length, ..entry.clone() })
                },
            ),
        })
    }

    /// The problem the engines run under a routing bug (the oracle keeps the true one); `None` for a bug in the plan.
    pub fn route(self, problem: &Problem) -> Option<Problem> {
        match self {
            Mutant::DecodeDpOffByOne => {
                let dp = problem.decode.topology.dp;
                let mut routed = problem.clone();
                for request in &mut routed.requests {
                    request.decode_dp = (request.decode_dp + 1) % dp;
                }
                Some(routed)
            }
            _ => None,
        }
    }
}

/// The name of a transfer kind in the table.
pub fn kind_name(kind: TransferKind, model: &ModelGeometry, relayout: bool) -> &'static str {
    match kind {
        TransferKind::Kv if relayout => "kv-relayout",
        TransferKind::Kv if model.is_mla() => "kv-mla",
        TransferKind::Kv => "kv-mha",
        TransferKind::Draft => "draft",
        TransferKind::Aux => "aux",
        TransferKind::Staging { .. } => "staging",
        TransferKind::State { component } => {
            match model.state.get(component as usize).map(|component| component.kind) {
                Some(StateKind::Mamba) => "mamba-state",
                Some(_) => "paged-state",
                None => "state",
            }
        }
    }
}

fn grouped_conv(problem: &Problem) -> bool {
    let grouped = |meta: &StateMetadata| meta.conv_groups.iter().flatten().flatten().any(|groups| groups.len() > 1);
    problem.prefill.ranks.iter().any(|rank| grouped(&rank.state)) && dims_advertised(problem)
}

fn dims_advertised(problem: &Problem) -> bool {
    let dims = |rank: &RankLayout| rank.state.dims.iter().flatten().any(|dim| *dim > 0);
    problem.prefill.ranks.iter().any(dims) && problem.decode.ranks.iter().any(dims)
}

fn has_odd_list(rank: &RankLayout) -> bool {
    let count = |draft: bool| {
        let kinds = rank.kv_entries.iter().filter_map(|index| rank.regions.get(*index as usize));
        kinds.filter(|region| (region.kind == RegionKind::Draft) == draft).count()
    };
    let state = rank.state.regions.iter().map(Vec::len);
    [count(false), count(true), rank.aux_entries.len()].into_iter().chain(state).any(|len| len % 2 == 1)
}

fn with_entries(group: &TransferGroup, entries: Vec<EntryPair>) -> TransferGroup {
    TransferGroup { entries: entries.into(), ..group.clone() }
}

fn with_runs(group: &TransferGroup, runs: Vec<RowRun>) -> TransferGroup {
    TransferGroup { runs: runs.into(), ..group.clone() }
}

/// Rewrites each entry of the groups `select` picks; `rewrite` returns `None` to keep an entry as it is.
fn map_entries(
    groups: Vec<TransferGroup>,
    select: impl Fn(&TransferGroup) -> bool,
    rewrite: impl Fn(&TransferGroup, &EntryPair) -> Option<EntryPair>,
) -> Vec<TransferGroup> {
    let map = |group: TransferGroup| {
        if !select(&group) {
            return group;
        }
        let entries = group.entries.iter().map(|entry| rewrite(&group, entry).unwrap_or_else(|| entry.clone()));
        with_entries(&group, entries.collect())
    };
    groups.into_iter().map(map).collect()
}

/// Whether the prefill writes KV into the decode's staging ring (so slice-path mutants have nothing to rewrite).
fn staging_in_use(problem: &Problem) -> bool {
    let (prefill, decode) = (&problem.prefill.topology, &problem.decode.topology);
    prefill.staging_chunk_pages > 0
        && prefill.tp != decode.tp
        && matches!(problem.model.attention, Attention::Mha { .. })
        && problem.decode.ranks.iter().all(|layout| layout.staging_entry.is_some())
}

/// Staging groups of one chunk moved from slot `s` (all K, then all V) to slot `s'` of the layer-major order: K of
/// layer `i` to `2i`, V of layer `i` to `2i + 1`. Each slot's rows are the chunk's tokens, so a slot is that many rows.
fn staging_slot_order(groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let slots = groups.iter().filter(|group| matches!(group.kind, TransferKind::Staging { .. })).count() as u64;
    let layers = slots / 2;
    groups
        .into_iter()
        .map(|group| {
            let TransferKind::Staging { slot } = group.kind else { return group };
            let slot = u64::from(slot);
            let moved = if slot < layers { 2 * slot } else { 2 * (slot - layers) + 1 };
            let tokens: u64 = group.runs.iter().map(|run| run.rows).sum();
            let runs = group
                .runs
                .iter()
                .map(|run| RowRun {
                    target_row: (run.target_row + moved * tokens).saturating_sub(slot * tokens),
                    ..*run
                })
                .collect();
            TransferGroup { runs, ..group }
        })
        .collect()
}

/// The region at `ordinal` of `list` on `layout`, when its rows are `row_len` long (another length would be the
/// "length out of range" error of §8, not a silent misplacement).
fn same_shape_region(layout: &RankLayout, list: &[u32], ordinal: Option<usize>, row_len: u64) -> Option<u32> {
    let region = *list.get(ordinal?)?;
    (layout.regions.get(region as usize)?.row_len() == row_len).then_some(region)
}

fn local_layer_ordinal(site: &Site<'_>, groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let (source, target) = (site.query.local.layout, &site.peer.layout);
    let select = |group: &TransferGroup| matches!(group.kind, TransferKind::Kv | TransferKind::Draft);
    map_entries(groups, select, |_, entry| {
        let ordinal = source.kv_entries.iter().position(|region| *region == entry.source_region);
        let region = same_shape_region(target, &target.kv_entries, ordinal, entry.target_row_len)?;
        Some(EntryPair { target_region: region, ..entry.clone() })
    })
}

fn destination_by_source_index(site: &Site<'_>, groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let (source, target) = (site.query.local.layout, &site.peer.layout);
    let select = |group: &TransferGroup| matches!(group.kind, TransferKind::State { .. });
    map_entries(groups, select, |group, entry| {
        let TransferKind::State { component } = group.kind else { return None };
        let (sources, targets) =
            (source.state.regions.get(component as usize)?, target.state.regions.get(component as usize)?);
        let ordinal = sources.iter().position(|region| *region == entry.source_region);
        let region = same_shape_region(target, targets, ordinal, entry.target_row_len)?;
        Some(EntryPair { target_region: region, ..entry.clone() })
    })
}

/// The request as if chunk `index` were the first: its own prefill pages, the decode page list from index 0.
fn restarted(request: &Request, index: usize, prefill_page: u32) -> Option<Request> {
    let before: u32 = request.chunks.get(..index)?.iter().sum();
    let tokens = *request.chunks.get(index)?;
    let first_page = (request.decode_prefix / prefill_page) as usize;
    let offset = (before / prefill_page) as usize;
    let mut prefill_pages = request.prefill_pages.get(..first_page)?.to_vec();
    prefill_pages.extend_from_slice(request.prefill_pages.get(first_page + offset..)?);
    Some(Request {
        chunks: vec![tokens],
        tokens: request.decode_prefix.saturating_add(tokens),
        prefill_pages,
        ..request.clone()
    })
}

fn decode_pages_per_chunk(site: &Site<'_>, groups: Vec<TransferGroup>) -> Result<Vec<TransferGroup>, PlanError> {
    let request = site.query.request;
    let page = site.query.local.topology.virtual_page_size();
    let Some(view) = restarted(request, site.chunk as usize, page).filter(|_| site.chunk > 0) else {
        return Ok(groups);
    };
    let rows = |group: &TransferGroup| {
        matches!(group.kind, TransferKind::Kv | TransferKind::Draft | TransferKind::Staging { .. })
    };
    let replanned = site.link.chunk_groups(&view, 0)?;
    let mut res: Vec<TransferGroup> = groups.into_iter().filter(|group| !rows(group)).collect();
    res.extend(replanned.into_iter().filter(rows).map(|group| TransferGroup { chunk: site.chunk, ..group }));
    Ok(res)
}

fn final_page_off_by_one(site: &Site<'_>, groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let request = site.query.request;
    let topology = site.query.local.topology;
    let page = topology.virtual_page_size();
    let last_chunk = site.chunk as usize + 1 == request.chunks.len();
    let final_page = request.tokens.checked_sub(1).and_then(|last| request.prefill_pages.get((last / page) as usize));
    let (Some(final_page), true, true) = (final_page, last_chunk, request.send_len() % page != 0) else {
        return groups;
    };
    let rows_per_page = u64::from(topology.page_size);
    let dropped = u64::from(*final_page) * rows_per_page..(u64::from(*final_page) + 1) * rows_per_page;
    let cut = |group: TransferGroup| {
        if !matches!(group.kind, TransferKind::Kv | TransferKind::Draft | TransferKind::Staging { .. }) {
            return group;
        }
        let runs = group.runs.iter().flat_map(|run| without(run, &dropped)).collect();
        with_runs(&group, runs)
    };
    groups.into_iter().map(cut).collect()
}

/// The parts of `run` whose source rows lie outside `dropped`.
fn without(run: &RowRun, dropped: &std::ops::Range<u64>) -> Vec<RowRun> {
    let end = run.source_row + run.rows;
    let piece = |from: u64, to: u64| RowRun {
        source_row: from,
        target_row: run.target_row + (from - run.source_row),
        rows: to - from,
    };
    let mut res = Vec::new();
    if run.source_row < dropped.start.min(end) {
        res.push(piece(run.source_row, dropped.start.min(end)));
    }
    if dropped.end.max(run.source_row) < end {
        res.push(piece(dropped.end.max(run.source_row), end));
    }
    res
}

#[derive(Clone, Copy)]
enum HeadBug {
    Formula,
    Neighbour,
}

/// MHA head slices (§3.2) recomputed with the bug: the source head start on scatter, the target's on aggregation.
fn head_slices(site: &Site<'_>, groups: Vec<TransferGroup>, bug: HeadBug) -> Vec<TransferGroup> {
    let Attention::Mha { kv_heads, .. } = site.query.local.model.attention else { return groups };
    let (heads, prefill_tp, decode_tp) = (kv_heads.max(1), site.query.local.topology.tp.max(1), site.peer.tp.max(1));
    let (source_heads, target_heads) = ((heads / prefill_tp).max(1), (heads / decode_tp).max(1));
    let (prefill_rank, decode_rank) = (site.query.local.layout.rank.tp, site.peer.rank.tp);
    let select = |group: &TransferGroup| group.kind == TransferKind::Kv && prefill_tp != decode_tp;
    map_entries(groups, select, |_, entry| {
        let head_len = entry.length / u64::from(if prefill_tp > decode_tp { source_heads } else { target_heads });
        let mut res = entry.clone();
        if prefill_tp > decode_tp {
            let replicas = (prefill_tp / heads).max(1);
            let rank = match bug {
                HeadBug::Neighbour => prefill_rank ^ 1,
                HeadBug::Formula => return None,
            };
            res.target_column = u64::from(((rank / replicas) * source_heads) % target_heads) * head_len;
        } else {
            let replicas = (decode_tp / heads).max(1);
            let head = match bug {
                HeadBug::Formula => (decode_rank * target_heads) % source_heads,
                HeadBug::Neighbour => (((decode_rank ^ 1) / replicas) * target_heads) % source_heads,
            };
            res.source_column = u64::from(head) * head_len;
        }
        Some(res)
    })
}

/// SWA head slices recomputed for the neighbouring rank: a page item is `page_size` tokens of the side's heads (NHD);
/// the slice of token `t` keeps its token and takes the neighbour's head offset on the side that picks it (§3.2).
fn swa_swapped_head_slice(site: &Site<'_>, groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let model = site.query.local.model;
    let Attention::Mha { kv_heads, .. } = model.attention else { return groups };
    let (heads, prefill_tp, decode_tp) = (kv_heads.max(1), site.query.local.topology.tp.max(1), site.peer.tp.max(1));
    let (source_heads, target_heads) = ((heads / prefill_tp).max(1), (heads / decode_tp).max(1));
    let (prefill_rank, decode_rank) = (site.query.local.layout.rank.tp, site.peer.rank.tp);
    let page = u64::from(site.query.local.topology.page_size.max(1));
    let select = |group: &TransferGroup| {
        let TransferKind::State { component } = group.kind else { return false };
        prefill_tp != decode_tp && model.state.get(component as usize).is_some_and(|it| it.kind == StateKind::Swa)
    };
    map_entries(groups, select, |_, entry| {
        let head_len = entry.source_row_len / (page * u64::from(source_heads));
        let (source_token, target_token) = (head_len * u64::from(source_heads), head_len * u64::from(target_heads));
        if head_len == 0 {
            return None;
        }
        let mut res = entry.clone();
        if prefill_tp > decode_tp {
            let head = (((prefill_rank ^ 1) / (prefill_tp / heads).max(1)) * source_heads) % target_heads;
            res.target_column = entry.target_column / target_token * target_token + u64::from(head) * head_len;
        } else {
            let head = (((decode_rank ^ 1) / (decode_tp / heads).max(1)) * target_heads) % source_heads;
            res.source_column = entry.source_column / source_token * source_token + u64::from(head) * head_len;
        }
        Some(res)
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BlockBug {
    Flat,
    WrongRank,
    /// The right ranks and groups, the prefill's rows on both sides.
    Untransposed,
}

/// One side's metadata of one Mamba state entry.
struct Tensor {
    item_len: u64,
    dim: u64,
    outer: u64,
    groups: Option<Vec<u64>>,
}

fn tensor(layout: &RankLayout, component: usize, region: u32) -> Option<Tensor> {
    let meta = &layout.state;
    let entry = meta.regions.get(component)?.iter().position(|it| *it == region)?;
    let groups = meta.conv_groups.get(component).and_then(|groups| groups.get(entry)).cloned().flatten();
    Some(Tensor {
        item_len: layout.regions.get(region as usize)?.item_len,
        dim: u64::from(*meta.dims.get(component)?.get(entry)?),
        outer: u64::from(meta.outer_counts.get(component).and_then(|outer| outer.get(entry)).copied().unwrap_or(1)),
        groups: groups.map(|groups| groups.into_iter().map(u64::from).collect()),
    })
}

/// Mamba state byte blocks (§5.3 in dim units, §5.4 in bytes) recomputed with the bug, per entry pair.
fn mamba_blocks(site: &Site<'_>, groups: Vec<TransferGroup>, bug: BlockBug) -> Vec<TransferGroup> {
    let model = site.query.local.model;
    let mamba = |component: u32| model.state.get(component as usize).is_some_and(|it| it.kind == StateKind::Mamba);
    let sliced = site.query.local.topology.tp != site.peer.tp;
    let rewrite = |group: TransferGroup| {
        let TransferKind::State { component } = group.kind else { return group };
        if (!sliced && bug != BlockBug::Untransposed) || !mamba(component) {
            return group;
        }
        let mut pairs: Vec<(u32, u32)> = group.entries.iter().map(|it| (it.source_region, it.target_region)).collect();
        pairs.dedup();
        let mut entries = Vec::new();
        for (source_region, target_region) in pairs {
            let original = group
                .entries
                .iter()
                .filter(|it| (it.source_region, it.target_region) == (source_region, target_region));
            match blocks_for(site, component as usize, source_region, target_region, bug) {
                Some(blocks) => entries.extend(blocks),
                None => entries.extend(original.cloned()),
            }
        }
        with_entries(&group, entries)
    };
    groups.into_iter().map(rewrite).collect()
}

fn blocks_for(
    site: &Site<'_>,
    component: usize,
    source_region: u32,
    target_region: u32,
    bug: BlockBug,
) -> Option<Vec<EntryPair>> {
    let source = tensor(site.query.local.layout, component, source_region)?;
    let target = tensor(&site.peer.layout, component, target_region)?;
    if source.dim == 0 || target.dim == 0 || source.outer == 0 {
        return None;
    }
    let (prefill_tp, decode_tp) = (u64::from(site.query.local.topology.tp), u64::from(site.peer.tp));
    let (mut prefill_rank, mut decode_rank) =
        (u64::from(site.query.local.layout.rank.tp), u64::from(site.peer.rank.tp));
    if bug == BlockBug::WrongRank {
        (prefill_rank, decode_rank) = (decode_rank, prefill_rank);
    }
    let groups = match (&source.groups, bug) {
        (Some(groups), BlockBug::WrongRank | BlockBug::Untransposed) => groups.clone(),
        (Some(groups), BlockBug::Flat) if groups.len() > 1 => vec![source.dim * prefill_tp],
        _ if bug == BlockBug::Flat => return None,
        _ => vec![source.dim * prefill_tp],
    };
    let (source_row, target_row) = (source.item_len / source.outer, target.item_len / source.outer);
    let unit = source_row / source.dim;
    let layer = site.query.local.layout.regions.get(source_region as usize)?.layer;
    let units = dim_units(&groups, (prefill_tp, decode_tp), (prefill_rank, decode_rank));
    let mut res = Vec::with_capacity(units.len() * source.outer as usize);
    for row in 0..source.outer {
        for (source_unit, target_unit, count) in &units {
            res.push(EntryPair {
                source_region,
                target_region,
                layer,
                source_row_len: source.item_len,
                target_row_len: target.item_len,
                source_column: row * source_row + source_unit * unit,
                target_column: row * target_row + target_unit * unit,
                length: count * unit,
            });
        }
    }
    Some(res)
}

/// `compute_mamba_state_slice_blocks` restated (§5.3): `(source unit, target unit, count)` per group, for the
/// `(prefill, decode)` TP sizes and ranks given (a mutant passes the wrong ones).
fn dim_units(
    groups: &[u64],
    (prefill_tp, decode_tp): (u64, u64),
    (prefill_rank, decode_rank): (u64, u64),
) -> Vec<(u64, u64, u64)> {
    let mut res = Vec::with_capacity(groups.len());
    let (mut source_offset, mut target_offset) = (0, 0);
    for group in groups {
        let (source_width, target_width) = (group / prefill_tp.max(1), group / decode_tp.max(1));
        if prefill_tp > decode_tp {
            let position = prefill_rank % (prefill_tp / decode_tp.max(1));
            res.push((source_offset, target_offset + position * source_width, source_width));
        } else {
            let start = (decode_rank * target_width) % source_width.max(1);
            res.push((source_offset + start, target_offset, target_width));
        }
        (source_offset, target_offset) = (source_offset + source_width, target_offset + target_width);
    }
    res
}

fn odd_list_last_entry(groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let halve = |group: TransferGroup| {
        let regions: BTreeSet<u32> = group.entries.iter().map(|entry| entry.source_region).collect();
        let last = group.entries.last().map(|entry| entry.source_region);
        match last {
            Some(last) if regions.len() % 2 == 1 => {
                with_entries(&group, group.entries.iter().filter(|it| it.source_region != last).cloned().collect())
            }
            _ => group,
        }
    };
    groups.into_iter().map(halve).filter(|group| !group.entries.is_empty()).collect()
}

/// Aux rows (§1.6): the last stage sends none, the first stage sends its own rows instead, on the last chunk.
/// The group's first prefill rank drops its replicated whole-slot entries and the second sends them instead.
fn replicated_state_wrong_writer(site: &Site<'_>, groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let (model, local) = (site.query.local.model, site.query.local.layout);
    let ratio = site.query.local.topology.tp / site.peer.tp.max(1);
    let offset = local.rank.tp.wrapping_sub(site.peer.rank.tp * ratio);
    let replicated = |region: &crate::model::Region| model.is_replicated_mamba(region.kind);
    let rewrite = |group: TransferGroup| {
        let TransferKind::State { component } = group.kind else { return group };
        let mut entries: Vec<EntryPair> = group
            .entries
            .iter()
            .filter(|entry| local.regions.get(entry.source_region as usize).is_none_or(|region| !replicated(region)))
            .cloned()
            .collect();
        if offset == 1 {
            for (source_region, region) in local.regions.iter().enumerate() {
                let RegionKind::State { component: held, .. } = region.kind else { continue };
                if held != component || !replicated(region) {
                    continue;
                }
                let target =
                    site.peer.layout.regions.iter().position(|it| it.kind == region.kind && it.layer == region.layer);
                if let Some(target_region) = target {
                    entries.push(EntryPair {
                        source_region: source_region as u32,
                        target_region: target_region as u32,
                        layer: region.layer,
                        source_row_len: region.item_len,
                        target_row_len: region.item_len,
                        source_column: 0,
                        target_column: 0,
                        length: region.item_len,
                    });
                }
            }
        }
        with_entries(&group, entries)
    };
    groups.into_iter().map(rewrite).collect()
}

fn aux_from_wrong_stage(site: &Site<'_>, groups: Vec<TransferGroup>) -> Vec<TransferGroup> {
    let topology = site.query.local.topology;
    let rank = site.query.local.layout.rank;
    let mut res: Vec<TransferGroup> = groups.into_iter().filter(|group| group.kind != TransferKind::Aux).collect();
    let last_chunk = site.chunk as usize + 1 == site.query.request.chunks.len();
    let primary = site.peer.tp >= topology.tp || rank.tp == site.peer.rank.tp * (topology.tp / site.peer.tp.max(1));
    if rank.pp != 0 || !last_chunk || !primary || topology.pp < 2 {
        return res;
    }
    let (source, target) = (site.query.local.layout, &site.peer.layout);
    let entries: Vec<EntryPair> = source
        .aux_entries
        .iter()
        .zip(&target.aux_entries)
        .filter_map(|(source_region, target_region)| {
            let row_len = source.regions.get(*source_region as usize)?.item_len;
            Some(EntryPair {
                source_region: *source_region,
                target_region: *target_region,
                layer: 0,
                source_row_len: row_len,
                target_row_len: row_len,
                source_column: 0,
                target_column: 0,
                length: row_len,
            })
        })
        .collect();
    if entries.is_empty() {
        return res;
    }
    let request = site.query.request;
    let run = RowRun {
        source_row: u64::from(request.prefill_state.aux),
        target_row: u64::from(request.decode_state.aux),
        rows: 1,
    };
    res.push(TransferGroup {
        request: request.id,
        chunk: site.chunk,
        kind: TransferKind::Aux,
        source: rank,
        target: site.peer.rank,
        entries: entries.into(),
        runs: Arc::from(vec![run]),
    });
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    /// domain.md §5.4, PR #37358 test: TP1 -> TP8 decode rank 3, dims 24 -> 3, groups [8, 8, 8]: units 3, 11, 19
    /// (bytes 12, 44, 76 at 4 B per unit). The restated rule must agree before its mutants mean anything.
    #[test]
    fn restated_slice_rule_matches_the_worked_example() {
        assert_eq!(dim_units(&[8, 8, 8], (1, 8), (0, 3)), vec![(3, 0, 1), (11, 1, 1), (19, 2, 1)]);
    }

    /// The wrong-rank mutant swaps the ranks: decode rank 3 is cut as rank 0 (the prefill rank), one flat group is
    /// the flat-conv mutant; both differ from the rule.
    #[test]
    fn wrong_rank_and_flat_split_differ_from_the_rule() {
        assert_eq!(dim_units(&[8, 8, 8], (1, 8), (3, 0)), vec![(0, 0, 1), (8, 1, 1), (16, 2, 1)]);
        assert_eq!(dim_units(&[24], (1, 8), (0, 3)), vec![(9, 0, 3)]);
    }

    /// domain.md §5.4 aggregation: TP4 -> TP2, prefill rank 3, 8 local heads land in the second half (unit 8).
    #[test]
    fn aggregation_places_the_prefill_slice_at_its_position() {
        assert_eq!(dim_units(&[32], (4, 2), (3, 1)), vec![(0, 8, 8)]);
    }
}
