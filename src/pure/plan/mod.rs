//! The pure planner: `plan(&Problem) -> Result<Plan, PlanError>`.
//!
//! Start at [`plan`]. It validates topologies (ranks.rs), pairs entries by global layer id (pairing.rs) and
//! computes per-chunk token-row runs (rows.rs); the result is a canonical [`Plan`] that expands into byte
//! [`Copy`]s. No IO, clock or randomness here (ARCHITECTURE.md).

mod descriptor;
mod error;
mod heads;
mod lowering;
pub mod paged;
mod pairing;
pub mod peer;
mod ranks;
mod rows;
mod staging;
mod state;

pub use descriptor::Descriptor;
pub use error::{PlanError, PlanErrorKind};
pub use lowering::{lower, packed_work_request_count, Limits, Lowering, Shape, WorkRequest, WrRun};
pub use rows::RowRun;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::model::{
    Attention, KvPart, LayerId, ModelGeometry, PoolKind, Problem, RankId, RankLayout, RegionKind, Request, StateKind,
    Topology,
};
use ranks::{Connection, Mode};
use rows::ChunkView;

/// What a transfer group moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TransferKind {
    /// Target KV rows (latent, or K/V head slices).
    Kv,
    /// Draft KV rows, replicated to every DCP rank.
    Draft,
    /// State items of one component (last chunk only).
    State { component: u32 },
    /// Aux rows (last chunk, last stage only).
    Aux,
    /// KV head slices into slot `slot` (the decode's K buffers, then its V buffers) of the decode's staging ring.
    Staging { slot: u32 },
}

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
    pub kind: TransferKind,
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
    pub kind: TransferKind,
    pub source: RankId,
    pub source_region: u32,
    pub source_offset: u64,
    pub target: RankId,
    pub target_region: u32,
    pub target_offset: u64,
    pub length: u64,
}

/// A canonical transfer plan: groups sorted by (request, chunk, source, target, kind), plus why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub groups: Vec<TransferGroup>,
    /// Decisions in the order they were taken, rendered into golden files.
    pub explain: Vec<String>,
}

impl Plan {
    /// Every copy, coalesced into maximal contiguous runs within a group, in canonical order.
    pub fn copies(&self) -> Copies<'_> {
        Copies { plan: self, group: 0, entry: 0, run: 0, row: 0 }
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

/// Iterator over a plan's copies: groups, then entries, then runs (then rows for partial-row entries).
///
/// Hand-written rather than nested `flat_map`s: enumeration is on the hot path of every execution.
pub struct Copies<'a> {
    plan: &'a Plan,
    group: usize,
    entry: usize,
    run: usize,
    row: u64,
}

impl Iterator for Copies<'_> {
    type Item = Copy;

    fn next(&mut self) -> Option<Copy> {
        loop {
            let group = self.plan.groups.get(self.group)?;
            let Some(entry) = group.entries.get(self.entry) else {
                (self.group, self.entry, self.run, self.row) = (self.group + 1, 0, 0, 0);
                continue;
            };
            let Some(run) = group.runs.get(self.run) else {
                (self.entry, self.run, self.row) = (self.entry + 1, 0, 0);
                continue;
            };
            let (row, rows) = if entry.full_rows() {
                self.run += 1;
                (0, run.rows)
            } else {
                let row = self.row;
                self.row += 1;
                if self.row == run.rows {
                    (self.run, self.row) = (self.run + 1, 0);
                }
                (row, 1)
            };
            return Some(Copy {
                request: group.request,
                chunk: group.chunk,
                kind: group.kind,
                source: group.source,
                source_region: entry.source_region,
                source_offset: (run.source_row + row) * entry.source_row_len + entry.source_column,
                target: group.target,
                target_region: entry.target_region,
                target_offset: (run.target_row + row) * entry.target_row_len + entry.target_column,
                length: entry.length * rows,
            });
        }
    }
}

/// Plans every request of `problem`; any rejection is returned before a single copy exists.
pub fn plan(problem: &Problem) -> Result<Plan, PlanError> {
    let prefill = &problem.prefill.topology;
    let decode = &problem.decode.topology;
    let pool = problem.model.pool_kind();
    ranks::check_topologies(prefill, decode, pool)?;
    check_state_gates(problem, pool)?;

    let mut explain = vec![
        format!(
            "pool: {pool}, {} KV layers of {} B per token row on prefill, {} state component(s), {} aux buffer(s){}",
            problem.model.kv_layers.len(),
            problem.model.token_len(prefill.tp),
            problem.model.state.len(),
            problem.model.aux_item_lens.len(),
            problem.model.draft.map_or(String::new(), |draft| format!(", {} draft entries", draft.entries)),
        ),
        ranks::describe_mapping(prefill, decode, pool, problem.model.draft.is_some_and(|it| it.sharded().is_some())),
    ];

    // Registration-time work, once per connection (domain.md §6.3): mode, geometry and entry pairing.
    let mut links = Vec::new();
    let mut notes: BTreeMap<(RankId, String), Vec<RankId>> = BTreeMap::new();
    // Only the DP group pairs some request takes connect (SGLang's decode registers with a prefill DP group when a
    // request routed to it arrives).
    let groups: BTreeSet<(u32, u32)> =
        problem.requests.iter().map(|request| (request.prefill_dp, request.decode_dp)).collect();
    for connection in groups.into_iter().flat_map(|pair| ranks::connections(prefill, decode, pair)) {
        // Every registered peer passes the DCP gate, whatever it sends (domain.md §6.3).
        let local =
            Local { model: &problem.model, topology: prefill, layout: problem.prefill.rank(connection.prefill) };
        let link = link(local, &advertised_peer(problem, local, connection.decode)?)?;
        for note in &link.notes {
            notes.entry((connection.prefill, note.clone())).or_default().push(connection.decode);
        }
        links.push(link);
    }
    let mut modes: Vec<String> = links.iter().map(|link| describe_mode(link.mode, pool)).collect();
    modes.sort();
    modes.dedup();
    explain.extend(modes);
    for ((source, note), targets) in notes {
        explain.push(format!("{source} -> decode {}: {note}", rank_list(&targets)));
    }

    let mut groups = Vec::new();
    for request in &problem.requests {
        explain.push(describe_request(request));
        check_prefix(request, decode.virtual_page_size())?;
        // Row runs depend only on (chunk, mode), not on the layer or the stage: compute each once.
        let mut cache = RunCache::new();
        for (chunk_index, chunk) in
            chunks(request, prefill.virtual_page_size(), u64::from(prefill.page_size)).enumerate()
        {
            for link in links.iter().filter(|link| link.serves(request)) {
                link.push_groups(request, chunk_index as u32, &chunk, &mut cache, &mut groups)?;
            }
        }
    }
    groups.sort_by_key(|group| (group.request, group.chunk, group.source, group.target, group.kind));
    Ok(Plan { groups, explain })
}

/// The peer decode rank `rank` as the prefill rank sees it: its registration encoded onto the wire and decoded
/// (memory addresses are placeholders; the engines advertise real ones).
///
/// Why the round trip (advertise → encode → decode → `from_registration`) inside the pure planner: a prefill rank
/// knows its peer only from the decoded registration, and the wire is lossy (a legacy or lying peer's
/// [`crate::model::Advertise`] options, only entry 0's length on the PR #37358 wire, empty and absent id lists
/// alike). The composed plan is the expected verdict the engines are held against, so it must see exactly what they
/// see: the same bytes through the same decoder. It needs only [`crate::wire`] (pure core: bytes in, bytes out),
/// never the fabric.
fn advertised_peer(problem: &Problem, local: Local<'_>, rank: RankId) -> Result<Peer, PlanError> {
    let descs: Vec<crate::wire::MemoryDesc> = problem
        .decode
        .rank(rank)
        .regions
        .iter()
        .map(|region| crate::wire::MemoryDesc { address: 0, length_bytes: region.len_bytes(), rkey: 0 })
        .collect();
    let frames = peer::advertise(problem, rank, &descs).encode();
    let registration = crate::wire::Registration::decode(&frames)
        .map_err(|error| PlanError::Registration { reason: error.to_string() })?;
    Ok(peer::from_registration(local, &registration)?.0)
}

/// Row runs computed once per (chunk, mode) and shared by every link (`None`: draft rows).
/// Row runs by (chunk, mode or draft, CP rank): they depend on nothing else.
type RunCache = BTreeMap<(u32, Option<Mode>, u32), Arc<[RowRun]>>;

/// The decode prefix must be a whole number of decode allocator pages (domain.md §2.1, §2.3).
fn check_prefix(request: &Request, virtual_page: u32) -> Result<(), PlanError> {
    if request.decode_prefix % virtual_page != 0 {
        return Err(PlanError::UnalignedDecodePrefix {
            virtual_page_size: virtual_page,
            decode_prefix: request.decode_prefix,
        });
    }
    Ok(())
}

impl Link {
    /// This link as a prefill CP rank that ignores its block and sends whole chunks (a connector without
    /// `filter_kv_indices_for_cp_rank`; the self-test's mutant).
    pub fn without_cp_block(&self) -> Link {
        Link { prefill: Topology { all_cp: false, ..self.prefill }, ..self.clone() }
    }

    /// The prefill CP size when every CP rank sends its block of each request's pages (this link's source is CP rank
    /// `source.cp`); `None` when CP rank 0 sends everything.
    fn cp_block(&self) -> Option<u32> {
        (self.prefill.all_cp && self.prefill.cp > 1).then_some(self.prefill.cp)
    }

    /// Whether this connection carries `request`: its prefill rank is in the request's prefill DP group and its decode
    /// rank in the request's decode DP group.
    pub fn serves(&self, request: &Request) -> bool {
        self.source.dp == request.prefill_dp && self.target.dp == request.decode_dp
    }

    /// Whether the peer needs token relayout (`requires_dcp_relayout`, domain.md §2.5): early send is skipped then.
    pub fn requires_relayout(&self) -> bool {
        matches!(self.mode, Mode::Relayout { .. })
    }

    /// Whether this prefill rank sends the peer anything at all (a pure-MLA dummy does not).
    pub fn sends_anything(&self) -> bool {
        self.kv.is_some() || self.draft.is_some() || !self.state.is_empty() || self.aux.is_some()
    }

    /// What this connection moves for chunk `chunk_index` of `request` (per chunk, domain.md §2.3-§2.5, §5, §8):
    /// `request` carries the prefill rank's own pages and indices and the decode peer's, from its metadata.
    pub fn chunk_groups(&self, request: &Request, chunk_index: u32) -> Result<Vec<TransferGroup>, PlanError> {
        check_prefix(request, self.decode_virtual_page)?;
        let Some(chunk) = chunks(request, self.prefill.virtual_page_size(), u64::from(self.prefill.page_size))
            .nth(chunk_index as usize)
        else {
            return Ok(Vec::new());
        };
        let mut groups = Vec::new();
        self.push_groups(request, chunk_index, &chunk, &mut RunCache::new(), &mut groups)?;
        Ok(groups)
    }

    fn push_groups(
        &self,
        request: &Request,
        chunk_index: u32,
        chunk: &ChunkView<'_>,
        cache: &mut RunCache,
        groups: &mut Vec<TransferGroup>,
    ) -> Result<(), PlanError> {
        let virtual_page = u64::from(self.decode_virtual_page);
        let clipped;
        let (chunk, cp_rank) = match self.cp_block() {
            Some(size) => {
                clipped =
                    rows::cp_block(chunk, send_pages(request, self.prefill.virtual_page_size()), self.source.cp, size);
                (&clipped, self.source.cp)
            }
            None => (chunk, 0),
        };
        let mut push = |kind, entries: &Arc<[EntryPair]>, runs: Arc<[RowRun]>| {
            if !runs.is_empty() && !entries.is_empty() {
                groups.push(TransferGroup {
                    request: request.id,
                    chunk: chunk_index,
                    kind,
                    source: self.source,
                    target: self.target,
                    entries: entries.clone(),
                    runs,
                });
            }
        };
        if let (Some(_), Some(staging)) = (&self.kv, &self.staging) {
            let offset = request.staging_offsets.get(chunk_index as usize).copied().ok_or_else(|| {
                let reason = format!(
                    "the decode gave {} ring offsets for the request's {} chunks",
                    request.staging_offsets.len(),
                    request.chunks.len()
                );
                PlanError::StagingSpace { reason }
            })?;
            for (slot, entries, runs) in staging.chunk(chunk, offset)? {
                push(TransferKind::Staging { slot }, &entries, runs);
            }
        } else if let Some(entries) = &self.kv {
            let runs = cached(cache, (chunk_index, Some(self.mode), cp_rank), || match self.mode {
                Mode::PageCopy => rows::page_copy(chunk),
                Mode::Relayout { dcp, dcp_rank } => rows::relayout(chunk, dcp, dcp_rank),
            })?;
            push(TransferKind::Kv, entries, runs);
        }
        if let Some(entries) = &self.draft {
            // Draft pools are paged by the allocator page V on both sides (domain.md §2.4 draft rows), at the decode's
            // allocator pages even where its KV lands at host pages (HiSparse, `mooncake/conn.py:1372-1381`).
            let runs = cached(cache, (chunk_index, None, cp_rank), || match self.mode {
                Mode::PageCopy => rows::page_copy(&ChunkView {
                    page_size: virtual_page,
                    target_pages: &request.decode_pages,
                    ..*chunk
                }),
                Mode::Relayout { .. } => rows::draft(chunk, virtual_page),
            })?;
            push(TransferKind::Draft, entries, runs);
        }
        // State and aux travel with the last chunk only (domain.md §2.3, §1.6, §5.1), from CP rank 0 only: state as
        // SGLang skips it on the others (`_should_skip_cp_replicated_state_transfer`, `common/conn.py:513-529`); [I]
        // aux too, which SGLang sends from every CP rank, the same bytes (src/pure/plan/SGLANG.md).
        if chunk_index as usize + 1 != request.chunks.len() || self.source.cp != 0 {
            return Ok(());
        }
        for (component, kind, entries) in &self.state {
            let runs = state_runs(request, *component, *kind)?;
            push(TransferKind::State { component: *component as u32 }, entries, runs);
        }
        if let Some(entries) = &self.aux {
            let runs = rows::index_runs(&[request.prefill_state.aux], &[request.decode_state.aux]);
            push(TransferKind::Aux, entries, runs.into());
        }
        Ok(())
    }
}

/// Prefill pages of a request's send range (`num_kv_indices`): the chunks' pages together.
fn send_pages(request: &Request, prefill_page: u32) -> u64 {
    chunks(request, prefill_page, u64::from(prefill_page)).map(|chunk| chunk.source_pages.len() as u64).sum()
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
            target_pages: request.decode_kv_pages(),
            source_page_offset: offset as u64,
            decode_prefix: u64::from(request.decode_prefix),
            tokens: u64::from(*tokens),
            page_size,
        }
    })
}

fn cached(
    cache: &mut RunCache,
    key: (u32, Option<Mode>, u32),
    compute: impl FnOnce() -> Result<Vec<RowRun>, PlanError>,
) -> Result<Arc<[RowRun]>, PlanError> {
    if let Some(runs) = cache.get(&key) {
        return Ok(runs.clone());
    }
    let runs: Arc<[RowRun]> = compute()?.into();
    cache.insert(key, runs.clone());
    Ok(runs)
}

/// The decode side's gates before it registers anywhere (`try_ensure_parallel_info`, domain.md §2.5, §3.4): the
/// topologies can be mapped, page sizes agree, DCP needs an MLA pool, paged state allows the TP and DCP sizes.
pub fn decode_gates(model: &ModelGeometry, prefill: &Topology, decode: &Topology) -> Result<(), PlanError> {
    let pool = model.pool_kind();
    ranks::check_topologies(prefill, decode, pool)?;
    model_state_gates(model, prefill, decode, pool)
}

/// Whether a decode rank treats the prefill rank `offset` places into its group (decode TP < prefill TP) as a
/// pure-MLA dummy (domain.md §3.1: metadata without indices, a status that does not count). [I] Not a prefill rank
/// that holds draft heads a head-sharded draft needs (one replica of each): it sends its draft heads and nothing else
/// (SGLang 0.5.23 keeps every non-first rank a dummy and never sends those heads, `src/pure/plan/SGLANG.md`).
pub fn mla_dummy(model: &ModelGeometry, prefill: &Topology, decode: &Topology, offset: u32) -> bool {
    let draft_heads = model.draft.and_then(|draft| draft.sharded());
    let draft_writer = draft_heads.is_some_and(|(heads, _)| offset % (prefill.tp / heads.max(1)).max(1) == 0);
    model.pool_kind() == PoolKind::Mla && decode.tp < prefill.tp && offset > 0 && !draft_writer
}

/// The prefill ranks of DP group `prefill_dp` decode rank `rank` contacts for a request that group computes, in
/// order: the first is the group's primary (domain.md §3.1).
pub fn prefill_targets(prefill: &Topology, decode: &Topology, rank: RankId, prefill_dp: u32) -> Vec<RankId> {
    let connections = ranks::connections(prefill, decode, (prefill_dp, rank.dp));
    connections.into_iter().filter(|it| it.decode == rank).map(|it| it.prefill).collect()
}

/// How many decode ranks send a prefill rank metadata for one request (`required_dst_info_num`, domain.md §3.1).
pub fn required_dst_info_num(prefill: &Topology, decode: &Topology) -> u32 {
    (decode.tp / prefill.tp).max(1)
}

/// How many Success statuses a decode rank waits for per request (domain.md §3.1): the TP factor (with decode TP <
/// prefill TP, the group's prefill ranks that are no pure-MLA dummies: all of them, or for pure MLA the primary and
/// the holders of a head-sharded draft's heads, [`mla_dummy`]) times the PP factor, times the prefill CP size when
/// the decode pulls from every CP rank.
pub fn expected_responses(model: &ModelGeometry, prefill: &Topology, decode: &Topology) -> u32 {
    let tp = if decode.tp < prefill.tp {
        let group = prefill.tp / decode.tp;
        (0..group).filter(|offset| !mla_dummy(model, prefill, decode, *offset)).count() as u32
    } else {
        1
    };
    let pp = if decode.pp == prefill.pp { 1 } else { prefill.pp };
    // `required_prefill_response_num *= cp` when pulling from every CP rank (`common/conn.py:1496-1513`).
    let cp = if decode.all_cp { prefill.cp } else { 1 };
    tp * pp * cp
}

/// Rejections that depend on the state components (domain.md §3.4, §8).
fn check_state_gates(problem: &Problem, pool: PoolKind) -> Result<(), PlanError> {
    model_state_gates(&problem.model, &problem.prefill.topology, &problem.decode.topology, pool)?;
    let kinds =
        |side: &crate::model::SideLayout| side.ranks.first().map(|rank| rank.state.kinds.clone()).unwrap_or_default();
    let (source, target) = (kinds(&problem.prefill), kinds(&problem.decode));
    if source != target {
        return Err(PlanError::StateComponents { prefill: source, decode: target });
    }
    Ok(())
}

fn model_state_gates(
    model: &ModelGeometry,
    prefill: &Topology,
    decode: &Topology,
    pool: PoolKind,
) -> Result<(), PlanError> {
    for component in &model.state {
        // domain.md §3.4 rejects non-MLA SWA/DSA state under a TP change; SGLang 0.5.23 Mooncake head-slices SWA pages
        // (`mooncake/conn.py:2081-2092`, `_send_swa_state_slice`), except with prefill PP > 1 (`common/conn.py:1764`).
        // [I] kvrelay follows 0.5.23 (src/pure/plan/SGLANG.md); Mamba state slices by channel instead.
        if component.kind != StateKind::Mamba && !pool.replicated_latent() && prefill.tp != decode.tp {
            if component.kind != StateKind::Swa {
                return Err(PlanError::PagedStateTpMismatch { kind: component.kind });
            }
            if prefill.pp > 1 {
                return Err(PlanError::SwaSliceUnderPp);
            }
        }
        if component.kind != StateKind::Mamba && prefill.dcp != decode.dcp {
            return Err(PlanError::PagedStateUnderDcp { kind: component.kind });
        }
    }
    Ok(())
}

/// State item index pairs of one request for one component (domain.md §5.1, §8 step 2).
fn state_runs(request: &Request, component: usize, kind: StateKind) -> Result<Arc<[RowRun]>, PlanError> {
    if kind == StateKind::Mamba {
        return Ok(rows::index_runs(&[request.prefill_state.slot], &[request.decode_state.slot]).into());
    }
    let source = &request.prefill_state.pages[component];
    let target = &request.decode_state.pages[component];
    let overlap = source.len().min(target.len());
    if source.is_empty() && target.is_empty() {
        return Ok(Vec::new().into());
    }
    if overlap == 0 {
        return Err(PlanError::NoOverlappingState { kind });
    }
    if source.len() != target.len() && !kind.is_paged() {
        return Err(PlanError::StateIndexLength { kind, prefill: source.len(), decode: target.len() });
    }
    // Paged kinds tolerate a drift: both lists are truncated to their common length (domain.md §8).
    Ok(rows::index_runs(&source[..overlap], &target[..overlap]).into())
}

/// What a prefill rank knows about itself when a peer registers: the model, its side's topology, its own layout.
#[derive(Debug, Clone, Copy)]
pub struct Local<'a> {
    pub model: &'a ModelGeometry,
    pub topology: &'a Topology,
    pub layout: &'a RankLayout,
}

/// What a prefill rank knows about one decode peer: only its decoded registration (domain.md §6.2): its attention-TP
/// size and rank, its DCP size and rank, and the regions and metadata it advertised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub rank: RankId,
    pub tp: u32,
    pub dcp: u32,
    pub dcp_rank: u32,
    pub layout: RankLayout,
}

/// Both ends of one connection as the prefill rank sees them at registration.
struct Ends<'a> {
    model: &'a ModelGeometry,
    prefill: &'a Topology,
    /// The peer's side as far as it advertised it (TP and DCP sizes; page size and stages are the prefill's).
    decode: Topology,
    source_layout: &'a RankLayout,
    target_layout: &'a RankLayout,
    connection: Connection,
}

impl<'a> Ends<'a> {
    /// Both ends, or why this prefill rank does not serve the peer (a registration naming a decode rank that the
    /// rank mapping of domain.md §3.1 does not send here).
    fn new(local: Local<'a>, peer: &'a Peer) -> Result<Ends<'a>, PlanError> {
        let page_size = local.topology.page_size;
        let decode = Topology {
            tp: peer.tp,
            dp: 1,
            cp: 1,
            all_cp: false,
            pp: 1,
            dcp: peer.dcp,
            page_size,
            staging_chunk_pages: 0,
        };
        let (source, target) = (local.layout.rank, peer.rank);
        let prefill_tp = local.topology.tp;
        // Position among the k prefill ranks a decode rank contacts when decode TP < prefill TP.
        let offset = if peer.tp >= prefill_tp {
            (target.tp / (peer.tp / prefill_tp) == source.tp).then_some(0)
        } else {
            let ratio = prefill_tp / peer.tp;
            source.tp.checked_sub(target.tp * ratio).filter(|offset| *offset < ratio)
        };
        let Some(offset) = offset else {
            let reason = format!(
                "decode tp rank {} of TP{} is not a peer of prefill tp rank {} of TP{prefill_tp}",
                target.tp, peer.tp, source.tp
            );
            return Err(PlanError::Registration { reason });
        };
        Ok(Ends {
            model: local.model,
            prefill: local.topology,
            decode,
            source_layout: local.layout,
            target_layout: &peer.layout,
            connection: Connection { prefill: source, decode: target, offset },
        })
    }
}

/// What one connection sends, decided once at registration from the local layout and the peer's registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    source: RankId,
    target: RankId,
    /// The prefill side's topology (chunks are cut by its allocator page).
    prefill: Topology,
    /// The decode peer's allocator page `V = P * dcp` (domain.md §2.1).
    decode_virtual_page: u32,
    mode: Mode,
    /// Target KV entries, or `None` when this peer writes no KV.
    kv: Option<Arc<[EntryPair]>>,
    /// Draft entries (from the group's first prefill rank only).
    draft: Option<Arc<[EntryPair]>>,
    state: Vec<(usize, StateKind, Arc<[EntryPair]>)>,
    aux: Option<Arc<[EntryPair]>>,
    /// The staging path: KV goes into the peer's ring instead of its pool.
    staging: Option<staging::StagingLink>,
    notes: Vec<String>,
}

/// Registration-time work for one connection (domain.md §6.3): the transfer mode, then which kinds this prefill
/// rank sends the peer and how entries pair. Sees only the local layout and what the peer advertised.
pub fn link(local: Local<'_>, peer: &Peer) -> Result<Link, PlanError> {
    let ends = Ends::new(local, peer)?;
    let mode = ranks::transfer_mode(ends.prefill, ends.connection.prefill, &ends.decode, peer.dcp_rank)?;
    link_with(&ends, mode)
}

fn link_with(ends: &Ends<'_>, mode: Mode) -> Result<Link, PlanError> {
    let (prefill, decode, connection) = (ends.prefill, &ends.decode, &ends.connection);
    let (source_layout, target_layout) = (ends.source_layout, ends.target_layout);
    let primary = connection.offset == 0;
    // Replicated latent: one writer per decode rank. Head-sharded KV: every prefill rank of the group writes its
    // heads, except duplicates when prefill TP exceeds the head count ([I] only the first replica inside the
    // decode rank's group writes, so every decode byte is written exactly once).
    // With staging every prefill rank of the group writes its own region of the image, replicas included
    // (`compute_staging_layout`, `common/staging_buffer.py:809-839`).
    let staged = prefill.staging_chunk_pages > 0
        && target_layout.staging_entry.is_some()
        && matches!(ends.model.attention, Attention::Mha { .. })
        && prefill.tp != decode.tp;
    let kv_writer = match ends.model.attention {
        _ if decode.tp >= prefill.tp || staged => true,
        Attention::Mla { .. } => primary,
        Attention::Mha { kv_heads, .. } => connection.offset % (prefill.tp / kv_heads).max(1) == 0,
    };
    // A head-sharded draft (EAGLE-style, domain of `DraftRows::Sharded`) is written like head-sharded KV: every
    // prefill rank of the group its heads, one replica of each; a replicated draft by the group's first rank.
    let draft_writer = match ends.model.draft.and_then(|draft| draft.sharded()) {
        Some(_) if decode.tp >= prefill.tp => primary,
        Some((heads, _)) => connection.offset % (prefill.tp / heads).max(1) == 0,
        None => primary,
    };
    let mut res = Link {
        source: connection.prefill,
        target: connection.decode,
        prefill: *prefill,
        decode_virtual_page: decode.virtual_page_size(),
        mode,
        kv: None,
        draft: None,
        state: Vec::new(),
        aux: None,
        staging: None,
        notes: Vec::new(),
    };
    if kv_writer || primary || draft_writer {
        let (targets, drafts) = kv_pairs(ends, mode)?;
        let how = if kv_ids(source_layout).is_some() && kv_ids(target_layout).is_some() {
            "by global layer id"
        } else {
            "by position (no layer ids from one or both peers)"
        };
        if !targets.is_empty() {
            res.notes.push(format!("kv pairing {how}: {}", describe_pairing(&targets)));
        }
        if kv_writer {
            if staged {
                let ends_tp = (prefill, decode.tp);
                res.staging = staging::link(ends.model, ends_tp, (connection.prefill.tp, target_layout), &targets);
                res.notes.extend(res.staging.as_ref().map(staging::StagingLink::describe));
            }
            res.kv = Some(targets.into());
        }
        if draft_writer && !drafts.is_empty() {
            res.notes.push(format!("draft pairing {how}: {}", describe_pairing(&drafts)));
            res.draft = Some(drafts.into());
        }
    } else if ends.model.pool_kind() == PoolKind::Mla {
        res.notes.push("dummy: pure MLA, the group's first rank sends the latent".to_owned());
    }
    let shard = state::Shard {
        prefill_tp: prefill.tp,
        decode_tp: decode.tp,
        prefill_rank: connection.prefill.tp,
        decode_rank: connection.decode.tp,
    };
    for (component, kind) in source_layout.state.kinds.iter().enumerate() {
        // Mamba state is sliced per TP rank, so every prefill rank of the group sends; head-sliced SWA state comes from
        // the KV writers (one replica of each head); other paged state is replicated.
        let sends = match kind {
            StateKind::Mamba => true,
            _ if swa_head_slice(ends, *kind) => kv_writer,
            _ => primary,
        };
        if !sends {
            continue;
        }
        let (mut entries, by_id) = state_pairs(ends, component, *kind, shard)?;
        if prefill.tp > decode.tp && !primary {
            // A whole-item copy (no dims from an older peer, equal item lengths: a replicated tensor) must come from
            // one prefill rank of the group, or k ranks would write the same slot k times.
            entries.retain(|entry| !entry.full_rows());
        }
        if !entries.is_empty() {
            res.notes.push(format!("{kind} state component {component}: {}", describe_state(&entries, by_id)));
            res.state.push((component, *kind, entries.into()));
        }
    }
    if primary && connection.prefill.pp + 1 == prefill.pp && !source_layout.aux_entries.is_empty() {
        // Aux rows go with the last chunk from the last PP stage only (domain.md §1.6).
        let lens = |layout: &crate::model::RankLayout| -> Vec<u64> {
            layout.aux_entries.iter().map(|index| layout.regions[*index as usize].item_len).collect()
        };
        let (source_lens, target_lens) = (lens(source_layout), lens(target_layout));
        if source_lens != target_lens {
            return Err(PlanError::AuxGeometry { prefill: source_lens, decode: target_lens });
        }
        let entries: Vec<EntryPair> = (source_layout.aux_entries.iter().zip(&target_layout.aux_entries))
            .zip(&source_lens)
            .map(|((source, target), len)| full_row(*source, *target, 0, *len))
            .collect();
        res.aux = Some(entries.into());
    }
    Ok(res)
}

/// The KV layer ids a rank advertises (an empty list from a rank without KV entries is still a list).
fn kv_ids(layout: &RankLayout) -> Option<&[LayerId]> {
    layout.advertised_layer_ids.as_deref()
}

fn full_row(source_region: u32, target_region: u32, layer: LayerId, row_len: u64) -> EntryPair {
    EntryPair {
        source_region,
        target_region,
        layer,
        source_row_len: row_len,
        target_row_len: row_len,
        source_column: 0,
        target_column: 0,
        length: row_len,
    }
}

/// KV entry pairs of one connection: target entries, then draft entries (domain.md §2.6, §2.7, §3.2, §4.3).
fn kv_pairs(ends: &Ends<'_>, mode: Mode) -> Result<(Vec<EntryPair>, Vec<EntryPair>), PlanError> {
    let (source_layout, target_layout) = (ends.source_layout, ends.target_layout);
    let (prefill, decode, connection) = (ends.prefill, &ends.decode, &ends.connection);
    // resolve_dcp_dst_entry_indices (domain.md §2.7) refuses one-sided ids even with prefill PP1.
    let one_sided = kv_ids(source_layout).is_some() != kv_ids(target_layout).is_some();
    if one_sided && matches!(mode, Mode::Relayout { .. }) {
        return Err(PlanError::OneSidedLayerMetadata);
    }
    let pairs = pairing::pair_entries(
        kv_ids(source_layout),
        kv_ids(target_layout),
        source_layout.kv_entries.len(),
        target_layout.kv_entries.len(),
        prefill.pp == 1,
    )?;
    let (mut targets, mut drafts) = (Vec::new(), Vec::new());
    let (mut source_lens, mut target_lens) = (Vec::new(), Vec::new());
    // [I] The draft's head count comes from the local model (the wire carries item lengths only, as SGLang's).
    let sharded_draft = ends.model.draft.and_then(|draft| draft.sharded());
    for (source_entry, target_entry) in pairs.iter().enumerate() {
        let source_index = source_layout.kv_entries[source_entry];
        let target_index = target_layout.kv_entries[*target_entry];
        let source = &source_layout.regions[source_index as usize];
        let target = &target_layout.regions[target_index as usize];
        let is_draft = source.kind == RegionKind::Draft;
        match mode {
            Mode::Relayout { dcp, .. } if is_draft => {
                // Version 2 (domain.md §2.6): the decode draft pool is paged by V, so its items are c times larger.
                let expected = source.item_len * u64::from(dcp);
                if target.item_len != expected {
                    return Err(PlanError::DcpGeometryAt {
                        entry: source_entry,
                        prefill: source.item_len,
                        decode: target.item_len,
                        expected,
                    });
                }
            }
            Mode::Relayout { .. } => {
                source_lens.push(source.row_len());
                target_lens.push(target.row_len());
            }
            // A head-sharded draft under a TP change is head-sliced below; its rows must hold its heads.
            Mode::PageCopy if is_draft && sharded_draft.is_some() && prefill.tp != decode.tp => {
                let (heads, head_len) = sharded_draft.unwrap_or_default();
                let holds = |tp: u32, region: &crate::model::Region| {
                    region.row_len() == u64::from((heads / tp).max(1)) * head_len
                };
                if !holds(prefill.tp, source) || !holds(decode.tp, target) {
                    return Err(PlanError::ItemLength {
                        layer: source.layer,
                        prefill: source.item_len,
                        decode: target.item_len,
                    });
                }
            }
            Mode::PageCopy if source.kind == RegionKind::Kv(KvPart::Latent) || is_draft => {
                if source.item_len != target.item_len {
                    return Err(PlanError::ItemLength {
                        layer: source.layer,
                        prefill: source.item_len,
                        decode: target.item_len,
                    });
                }
            }
            Mode::PageCopy => {}
        }
        let mut entry = full_row(source_index, target_index, source.layer, source.row_len());
        entry.target_row_len = target.row_len();
        // Head-sharded rows move as head slices: MHA KV, and a head-sharded draft between page copies under a TP
        // change (its own heads and widths).
        let sliced = match (ends.model.attention, is_draft, sharded_draft, mode) {
            (_, true, Some(draft), Mode::PageCopy) if prefill.tp != decode.tp => Some(draft),
            (Attention::Mha { kv_heads, .. }, false, _, _) => {
                Some((kv_heads, target.row_len() / u64::from(ends.model.kv_heads_local(decode.tp))))
            }
            _ => None,
        };
        if let Some((heads, head_len)) = sliced {
            let (lp, ld) = (connection.prefill.tp, connection.decode.tp);
            let slice = heads::head_slice(heads, prefill.tp, decode.tp, lp, ld, head_len)?;
            entry.source_column = slice.source_offset;
            entry.target_column = slice.target_offset;
            entry.length = slice.length;
        }
        if is_draft {
            drafts.push(entry);
        } else {
            targets.push(entry);
        }
    }
    // prepare_dcp_token_item_lens version 1 (domain.md §2.6): target token lengths must agree entry by entry.
    if source_lens != target_lens {
        return Err(PlanError::DcpGeometry { prefill: source_lens, decode: target_lens });
    }
    Ok((targets, drafts))
}

/// State entry pairs of one component: byte blocks for Mamba, whole items for paged kinds (domain.md §5.5, §8).
///
/// Source-side metadata is read at the source entry `i`, destination-side metadata at its partner `j`, and every
/// list read is bounds-guarded with the documented defaults (domain.md §5.5).
fn state_pairs(
    ends: &Ends<'_>,
    component: usize,
    kind: StateKind,
    shard: state::Shard,
) -> Result<(Vec<EntryPair>, bool), PlanError> {
    let (source_layout, target_layout) = (ends.source_layout, ends.target_layout);
    let (source_meta, target_meta) = (&source_layout.state, &target_layout.state);
    let ids = |meta: &crate::model::StateMetadata| meta.layer_ids.get(component).filter(|ids| !ids.is_empty()).cloned();
    let (source_regions, target_regions) = (&source_meta.regions[component], &target_meta.regions[component]);
    let (source_ids, target_ids) = (ids(source_meta), ids(target_meta));
    let by_id = source_ids.is_some() && target_ids.is_some();
    let pairs = pairing::pair_entries(
        source_ids.as_deref(),
        target_ids.as_deref(),
        source_regions.len(),
        target_regions.len(),
        ends.prefill.pp == 1,
    )?;
    let mut res = Vec::new();
    for (source_entry, target_entry) in pairs.iter().copied().enumerate() {
        let source_index = source_regions[source_entry];
        let target_index = target_regions[target_entry];
        let source = &source_layout.regions[source_index as usize];
        let target = &target_layout.regions[target_index as usize];
        if swa_head_slice(ends, kind) {
            res.extend(swa_blocks(ends, shard, source_index, target_index, source, target)?);
            continue;
        }
        if kind != StateKind::Mamba {
            if source.item_len != target.item_len {
                return Err(PlanError::StateItemLength {
                    kind,
                    layer: source.layer,
                    prefill: source.item_len,
                    decode: target.item_len,
                });
            }
            res.push(full_row(source_index, target_index, source.layer, source.item_len));
            continue;
        }
        let read = |meta: &crate::model::StateMetadata, entry: usize, item_len: u64| state::TensorMeta {
            item_len,
            dim: meta.dims.get(component).and_then(|dims| dims.get(entry)).copied(),
            groups: meta.conv_groups.get(component).and_then(|groups| groups.get(entry)).cloned().flatten(),
            outer_count: meta.outer_counts.get(component).and_then(|outer| outer.get(entry)).copied().unwrap_or(1),
        };
        let source_tensor = read(source_meta, source_entry, source.item_len);
        let target_tensor = read(target_meta, target_entry, target.item_len);
        for block in state::mamba_blocks(component, source_entry, &source_tensor, &target_tensor, shard)? {
            res.push(EntryPair {
                source_region: source_index,
                target_region: target_index,
                layer: source.layer,
                source_row_len: source.item_len,
                target_row_len: target.item_len,
                source_column: block.source,
                target_column: block.target,
                length: block.length,
            });
        }
    }
    Ok((res, by_id))
}

/// Whether state of `kind` moves as head slices on this connection: SWA pages of a non-MLA model under a TP change
/// (SGLang 0.5.23 `slice_kv_heads`, `mooncake/conn.py:2081-2088`).
fn swa_head_slice(ends: &Ends<'_>, kind: StateKind) -> bool {
    kind == StateKind::Swa && !ends.model.pool_kind().replicated_latent() && ends.prefill.tp != ends.decode.tp
}

/// One SWA entry's head slices (SGLang 0.5.23 `_get_mha_head_slice_blocks`, `common/conn.py:1751-1851`): a page item
/// is `page_size` tokens of the side's local heads (NHD), and the connection's heads of each token move as one block.
fn swa_blocks(
    ends: &Ends<'_>,
    shard: state::Shard,
    source_index: u32,
    target_index: u32,
    source: &crate::model::Region,
    target: &crate::model::Region,
) -> Result<Vec<EntryPair>, PlanError> {
    let total_heads = match ends.model.attention {
        crate::model::Attention::Mha { kv_heads, .. } => kv_heads,
        _ => 1,
    };
    let page_size = ends.prefill.page_size;
    let (prefill_heads, decode_heads) =
        ((total_heads / shard.prefill_tp).max(1), (total_heads / shard.decode_tp).max(1));
    let head_len = source.item_len / (u64::from(page_size) * u64::from(prefill_heads));
    let token = |heads: u32| head_len * u64::from(heads);
    if token(prefill_heads) * u64::from(page_size) != source.item_len
        || token(decode_heads) * u64::from(page_size) != target.item_len
        || head_len == 0
    {
        return Err(PlanError::SwaHeadSplit {
            prefill: source.item_len,
            decode: target.item_len,
            prefill_heads,
            decode_heads,
            total_heads,
            page_size,
        });
    }
    let slice = heads::head_slice(
        total_heads,
        shard.prefill_tp,
        shard.decode_tp,
        shard.prefill_rank,
        shard.decode_rank,
        head_len,
    )?;
    Ok((0..u64::from(page_size))
        .map(|t| EntryPair {
            source_region: source_index,
            target_region: target_index,
            layer: source.layer,
            source_row_len: source.item_len,
            target_row_len: target.item_len,
            source_column: t * token(prefill_heads) + slice.source_offset,
            target_column: t * token(decode_heads) + slice.target_offset,
            length: slice.length,
        })
        .collect())
}

fn describe_mode(mode: Mode, pool: PoolKind) -> String {
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
    let parts: Vec<String> = entries
        .iter()
        .map(|entry| {
            let mut text = format!("L{} {}->{}", entry.layer, entry.source_region, entry.target_region);
            if !entry.full_rows() {
                text.push_str(&format!(
                    " bytes {}..{} of {} -> {}..{} of {}",
                    entry.source_column,
                    entry.source_column + entry.length,
                    entry.source_row_len,
                    entry.target_column,
                    entry.target_column + entry.length,
                    entry.target_row_len
                ));
            }
            text
        })
        .collect();
    parts.join(", ")
}

/// Entries paired and byte blocks of one state component (the blocks themselves show in the golden layout).
fn describe_state(entries: &[EntryPair], by_id: bool) -> String {
    let mut pairs: Vec<(u32, u32, LayerId)> =
        entries.iter().map(|entry| (entry.source_region, entry.target_region, entry.layer)).collect();
    pairs.dedup();
    let listed: Vec<String> =
        pairs.iter().take(4).map(|(source, target, layer)| format!("L{layer} {source}->{target}")).collect();
    format!(
        "{} entries paired by {} ({}{}), {} byte blocks",
        pairs.len(),
        if by_id { "layer id" } else { "position (no layer ids from one or both peers)" },
        listed.join(", "),
        if pairs.len() > 4 { ", ..." } else { "" },
        entries.len()
    )
}

fn describe_request(request: &Request) -> String {
    format!(
        "request {}: send range [{}, {}) in {} chunk(s) {:?}; decode pages {:?}{}",
        request.id,
        request.decode_prefix,
        request.tokens,
        request.chunks.len(),
        request.chunks,
        request.decode_pages,
        if request.decode_host_pages.is_empty() {
            String::new()
        } else {
            format!("; decode host pages {:?}", request.decode_host_pages)
        }
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
