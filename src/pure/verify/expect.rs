//! The rules, restated from domain.md without the planner: where every decode byte must come from.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

use super::decode::rank_heads;
use super::resident::RowRun;
use super::ViolationKind;
use crate::model::{Attention, KvPart, LayerId, Problem, RankId, Region, RegionKind, Request, StateKind, TensorShape};

mod staging;

/// `count` elements of `length` bytes, back to back from `target_offset` of a decode region: element `k` must equal
/// the source region's bytes at `source_offset + k * source_stride` (one element: a plain piece). A run of token rows
/// is one piece, so that the oracle's enumeration and its questions to device memory cost per run, not per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The request whose bytes these are.
    pub(crate) request: u32,
    pub(crate) target_offset: u64,
    pub(crate) length: u64,
    pub(crate) source: RankId,
    pub(crate) source_region: u32,
    pub(crate) source_offset: u64,
    pub(crate) count: u64,
    pub(crate) source_stride: u64,
}

impl Piece {
    /// One element: `length` bytes at `target_offset` from `source_offset`.
    fn single(request: u32, target_offset: u64, length: u64, source: (RankId, u32), source_offset: u64) -> Piece {
        let (source, source_region) = source;
        Piece { request, target_offset, length, source, source_region, source_offset, count: 1, source_stride: length }
    }

    /// The decode bytes the piece covers, element after element.
    pub(crate) fn span(&self) -> u64 {
        self.count * self.length
    }

    /// Element `k` alone.
    pub(crate) fn element(&self, k: u64) -> Piece {
        Piece {
            target_offset: self.target_offset + k * self.length,
            source_offset: self.source_offset + k * self.source_stride,
            count: 1,
            source_stride: self.length,
            ..*self
        }
    }
}

/// `count` token rows: decode rows `target`, `target + 1`, ... hold prefill rows `source`, `source + step`, ...
type Rows = RowRun;

/// Every token-row run a decode rank receives, by request (token rows or draft rows), with the notes their
/// enumeration made, sorted by decode row: enumerated once and shared by every region of the rank (its layers all
/// receive the same rows of a request).
#[derive(Debug, Default)]
pub(crate) struct RowCache {
    target: Cell<Option<RankId>>,
    known: RefCell<BTreeMap<(u32, bool), Rc<Enumerated>>>,
    /// The rows no request's runs cover, by (draft, rows of the region), while every request's are placeable.
    gaps: RefCell<BTreeMap<(bool, u64), Option<Table>>>,
}

/// Runs shared as one table of the oracle's questions.
pub(crate) type Table = Rc<Vec<Rows>>;

/// A request's runs on one rank (shared: they are a run table of the oracle's questions) and the notes their
/// enumeration made.
type Enumerated = (Table, Vec<(u64, ViolationKind)>);

impl RowCache {
    /// `request`'s rows on `target` (draft rows when `draft`), its notes appended to `notes` on every call.
    fn rows(
        &self,
        problem: &Problem,
        target: RankId,
        request: &Request,
        draft: bool,
        notes: &mut Vec<(u64, ViolationKind)>,
    ) -> Rc<Enumerated> {
        if self.target.get() != Some(target) {
            self.known.borrow_mut().clear();
            self.gaps.borrow_mut().clear();
            self.target.set(Some(target));
        }
        let known = self.known.borrow().get(&(request.id, draft)).cloned();
        let enumerated = known.unwrap_or_else(|| {
            let mut made = Vec::new();
            let mut rows = if draft {
                draft_rows(problem, request, &mut made)
            } else {
                token_rows(problem, target, request, &mut made)
            };
            rows.sort_unstable_by_key(|run| (run.target, run.source, run.count, run.step));
            let enumerated = Rc::new((Rc::new(rows), made));
            self.known.borrow_mut().insert((request.id, draft), enumerated.clone());
            enumerated
        });
        notes.extend(enumerated.1.iter().cloned());
        enumerated
    }
}

impl RowCache {
    /// The rows of a `rows`-row region that no request's runs (draft runs when `draft`) cover, as runs (step 0):
    /// `None` where a request's rows are not all placeable (a note), a run leaves the region or two runs share a row.
    fn gaps(&self, problem: &Problem, target: RankId, draft: bool, rows: u64) -> Option<Table> {
        if let Some(known) = self.gaps.borrow().get(&(draft, rows)) {
            return known.clone();
        }
        let mut covered = Vec::new();
        let mut notes = Vec::new();
        for request in received(problem, target) {
            covered.extend(self.rows(problem, target, request, draft, &mut notes).0.iter().copied());
        }
        covered.sort_unstable_by_key(|run| run.target);
        let mut gaps = Vec::new();
        let mut cursor = 0u64;
        let mut placeable = notes.is_empty();
        for run in &covered {
            let end = run.target.checked_add(run.count);
            if run.target < cursor || end.is_none_or(|end| end > rows) {
                placeable = false;
                break;
            }
            if run.target > cursor {
                gaps.push(Rows { target: cursor, source: 0, count: run.target - cursor, step: 0 });
            }
            cursor = run.target + run.count;
        }
        if cursor < rows {
            gaps.push(Rows { target: cursor, source: 0, count: rows - cursor, step: 0 });
        }
        let gaps = placeable.then(|| Rc::new(gaps));
        self.gaps.borrow_mut().insert((draft, rows), gaps.clone());
        gaps
    }
}

/// A region of whole token rows (latent KV, draft rows) whose every expected byte is said by tables of runs: every
/// request's runs from one source region, the rest of the region the sentinel (what [`pieces`] and the gaps between
/// them say run by run, when every request succeeded).
pub(crate) struct RowLayout {
    /// The source rank and region, and every request's runs (each a table shared by the rank's layers).
    pub(crate) source: Option<((RankId, u32), Vec<Table>)>,
    /// The rows no run covers: sentinel.
    pub(crate) gaps: Table,
    /// Bytes of a row, on both sides.
    pub(crate) row: u64,
}

/// Decode region `region` of `target` (`region_len` bytes) as a [`RowLayout`], when it is that simple: a latent KV
/// or draft region of whole rows, rows of one length on both sides, every request's rows placeable, inside the
/// region and on rows of their own. `None`: the region is walked piece by piece (which names what is wrong).
pub(crate) fn row_layout(
    problem: &Problem,
    target: RankId,
    region: u32,
    region_len: u64,
    cache: &RowCache,
) -> Option<RowLayout> {
    let decode_region = &problem.decode.rank(target).regions[region as usize];
    let draft = match decode_region.kind {
        RegionKind::Kv(KvPart::Latent) => false,
        RegionKind::Draft if sliced_draft(problem).is_none() => true,
        _ => return None,
    };
    let row = decode_region.row_len();
    if row == 0 || region_len % row != 0 {
        return None;
    }
    let rows = region_len / row;
    // One source region: requests computed by several prefill DP groups, or sent by several CP ranks, come from
    // several.
    let groups = prefill_groups(problem, target);
    let topology = &problem.prefill.topology;
    if groups.len() > 1 || (topology.cp > 1 && topology.all_cp) {
        return None;
    }
    let group = groups.first().copied().unwrap_or(0);
    let held =
        holder(problem, (group, 0, primary_tp(problem, target)), target, decode_region.kind, decode_region.layer, None);
    let Some((source, source_region)) = held else {
        // Nothing is sent to this region (as `row_pieces`): all of it is sentinel.
        let gaps = if rows == 0 { Vec::new() } else { vec![Rows { target: 0, source: 0, count: rows, step: 0 }] };
        return Some(RowLayout { source: None, gaps: Rc::new(gaps), row });
    };
    if problem.prefill.rank(source).regions[source_region as usize].row_len() != row {
        return None;
    }
    let gaps = cache.gaps(problem, target, draft, rows)?;
    let mut notes = Vec::new();
    let requests =
        received(problem, target).map(|request| cache.rows(problem, target, request, draft, &mut notes).0.clone());
    Some(RowLayout { source: Some(((source, source_region), requests.collect())), gaps, row })
}

/// Appends `rows`, extending the last run when it continues it on both sides (one step throughout).
fn push_rows(res: &mut Vec<Rows>, rows: Rows) {
    if let Some(last) = res.last_mut() {
        // The joined run's step: the last run's, or (a single row) the distance to the new one.
        let step = if last.count > 1 { Some(last.step) } else { rows.source.checked_sub(last.source) };
        let joins = step.filter(|step| {
            (rows.count == 1 || rows.step == *step)
                && last.target + last.count == rows.target
                && last.count.checked_mul(*step).and_then(|span| last.source.checked_add(span)) == Some(rows.source)
        });
        if let Some(step) = joins {
            last.step = step;
            last.count += rows.count;
            return;
        }
    }
    res.push(rows);
}

/// Every piece decode region `region` of rank `target` must hold; problems of the problem itself go to `notes`.
pub(crate) fn pieces(
    problem: &Problem,
    target: RankId,
    region: u32,
    rows: &RowCache,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    let decode_region = &problem.decode.rank(target).regions[region as usize];
    match decode_region.kind {
        RegionKind::Draft => match sliced_draft(problem) {
            Some(heads) => head_pieces(problem, target, decode_region, heads, rows, notes),
            None => row_pieces(problem, target, decode_region, rows, notes),
        },
        RegionKind::Kv(KvPart::Latent) => row_pieces(problem, target, decode_region, rows, notes),
        // Through the staging ring the transfer writes the ring, never the pool.
        RegionKind::Kv(_) if staging::in_use(problem) => Vec::new(),
        RegionKind::Staging => staging::pieces(problem, target),
        RegionKind::Kv(_) => match problem.model.attention {
            Attention::Mha { kv_heads, .. } => {
                head_pieces(problem, target, decode_region, (kv_heads, problem.model.head_len()), rows, notes)
            }
            Attention::Mla { .. } => Vec::new(),
        },
        RegionKind::State { component, tensor } => {
            state_pieces(problem, target, decode_region, component, tensor, notes)
        }
        RegionKind::Aux { .. } => aux_pieces(problem, target, decode_region, notes),
    }
}

/// `(heads, head_len)` of a head-sharded draft whose heads move between ranks (the TP sizes differ); `None` where
/// draft rows move whole.
fn sliced_draft(problem: &Problem) -> Option<(u32, u64)> {
    let sharded = problem.model.draft.and_then(|draft| draft.sharded())?;
    (problem.prefill.topology.tp != problem.decode.topology.tp).then_some(sharded)
}

/// Latent KV and draft rows: whole rows, replicated, from the primary prefill rank (domain.md §2, §3.1).
fn row_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    cache: &RowCache,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    let mut res = Vec::new();
    for group in prefill_groups(problem, target) {
        let held = holder(
            problem,
            (group, 0, primary_tp(problem, target)),
            target,
            decode_region.kind,
            decode_region.layer,
            None,
        );
        let Some((source, source_region)) = held else { continue };
        let source_len = problem.prefill.rank(source).regions[source_region as usize].row_len();
        let target_len = decode_region.row_len();
        if source_len != target_len {
            notes.push((0, ViolationKind::Geometry { source_len, target_len }));
            continue;
        }
        // The same region on each other CP rank that sends (its block of every request's pages).
        let senders = cp_senders(problem, source);
        for request in received_from(problem, target, group) {
            let draft = decode_region.kind == RegionKind::Draft;
            let owners = cp_owners(problem, request);
            for run in cache.rows(problem, target, request, draft, notes).0.iter() {
                let rows_per_page = problem.prefill.rank(source).regions[source_region as usize].rows_per_item;
                for (run, cp) in by_cp(run, u64::from(rows_per_page), owners.as_ref()) {
                    res.push(Piece {
                        request: request.id,
                        target_offset: run.target * target_len,
                        length: target_len,
                        source: senders[cp as usize],
                        source_region,
                        source_offset: run.source * source_len,
                        count: run.count,
                        source_stride: run.step * source_len,
                    });
                }
            }
        }
    }
    res
}

/// `source` and the ranks that differ from it only by CP rank, by CP rank: every prefill CP rank holds the whole KV
/// in the same regions.
fn cp_senders(problem: &Problem, source: RankId) -> Vec<RankId> {
    (0..problem.prefill.topology.cp).map(|cp| RankId { cp, ..source }).collect()
}

/// The prefill CP rank that sends each page of `request`'s send range, by prefill page: SGLang 0.5.23
/// `filter_kv_indices_for_cp_rank` (`disaggregation/utils.py:803-857`), restated: of the send range's
/// `T = ceil(send tokens / P)` pages, CP rank `r` sends positions `[r*(T div cp) + min(r, T mod cp), +T div cp + [r <
/// T mod cp])`. `None` when CP rank 0 sends every page (no CP, or CP without all-CP transfer).
fn cp_owners(problem: &Problem, request: &Request) -> Option<BTreeMap<u32, u32>> {
    let topology = &problem.prefill.topology;
    if topology.cp <= 1 || !topology.all_cp {
        return None;
    }
    let page = topology.virtual_page_size();
    let (cp, first) = (topology.cp, (request.decode_prefix / page) as usize);
    let total = request.send_len().div_ceil(page);
    let (base, rem) = (total / cp, total % cp);
    let mut owners = BTreeMap::new();
    for rank in 0..cp {
        let start = rank * base + rank.min(rem);
        for position in start..start + base + u32::from(rank < rem) {
            if let Some(page) = request.prefill_pages.get(first + position as usize) {
                owners.insert(*page, rank);
            }
        }
    }
    Some(owners)
}

/// `run` cut where the CP rank owning its source rows changes (pages of `rows_per_page` rows; every row's page owner in
/// `owners`, CP rank 0 without them).
fn by_cp(run: &Rows, rows_per_page: u64, owners: Option<&BTreeMap<u32, u32>>) -> Vec<(Rows, u32)> {
    let Some(owners) = owners else { return vec![(*run, 0)] };
    let owner = |k: u64| {
        let page = (run.source + k * run.step) / rows_per_page.max(1);
        u32::try_from(page).ok().and_then(|page| owners.get(&page)).copied().unwrap_or(0)
    };
    let mut res: Vec<(Rows, u32)> = Vec::new();
    for k in 0..run.count {
        let cp = owner(k);
        match res.last_mut() {
            Some((last, last_cp)) if *last_cp == cp => last.count += 1,
            _ => res.push((
                Rows { target: run.target + k, source: run.source + k * run.step, count: 1, step: run.step },
                cp,
            )),
        }
    }
    res
}

/// MHA K or V rows: each of `target`'s heads from the prefill rank that holds it, at its local positions
/// (domain.md §3.1, §3.2).
fn head_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    (kv_heads, head_len): (u32, u64),
    cache: &RowCache,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    let mut res = Vec::new();
    let draft = decode_region.kind == RegionKind::Draft;
    let prefill_tp = problem.prefill.topology.tp;
    let (first_head, head_count) = rank_heads(kv_heads, problem.decode.topology.tp, target.tp);
    let target_len = decode_region.row_len();
    for (group, local) in
        prefill_groups(problem, target).into_iter().flat_map(|group| (0..head_count).map(move |local| (group, local)))
    {
        let head = first_head + local;
        let holder_tp = head_holder_tp(problem, target, kv_heads, head);
        let Some((source, source_region)) =
            holder(problem, (group, 0, holder_tp), target, decode_region.kind, decode_region.layer, None)
        else {
            continue;
        };
        let source_len = problem.prefill.rank(source).regions[source_region as usize].row_len();
        // Rows must hold the heads at their local positions (and the holder the head at all, which a head
        // count that does not divide the TP sizes can break); otherwise no byte-exact placement exists.
        let fits = |len: u64, heads: u32| u64::from(heads) * head_len <= len;
        let holder_local = head
            .checked_sub(rank_heads(kv_heads, prefill_tp, holder_tp).0)
            .filter(|local| fits(target_len, head_count) && fits(source_len, local + 1));
        let Some(holder_local) = holder_local else {
            notes.push((0, ViolationKind::Geometry { source_len, target_len }));
            continue;
        };
        let senders = cp_senders(problem, source);
        let rows_per_page = u64::from(problem.prefill.rank(source).regions[source_region as usize].rows_per_item);
        for request in received_from(problem, target, group) {
            // Heads of one row interleave with other holders' heads: one piece per row.
            let rows = cache.rows(problem, target, request, draft, notes);
            let owners = cp_owners(problem, request);
            for (run, cp) in rows.0.iter().flat_map(|run| by_cp(run, rows_per_page, owners.as_ref())) {
                for (target_row, source_row) in run.each() {
                    res.push(Piece::single(
                        request.id,
                        target_row * target_len + u64::from(local) * head_len,
                        head_len,
                        (senders[cp as usize], source_region),
                        source_row * source_len + u64::from(holder_local) * head_len,
                    ));
                }
            }
        }
    }
    res
}

/// The prefill TP rank that sends global KV head `head` to `target` (domain.md §3.1, §3.2): with decode TP >= prefill
/// TP the one prefill rank the decode rank connects to (it holds the head, maybe as one of several replicas);
/// otherwise the head's shard, or the first replica the decode rank contacts when prefill TP exceeds the head count
/// ([I]).
fn head_holder_tp(problem: &Problem, target: RankId, kv_heads: u32, head: u32) -> u32 {
    let (prefill_tp, decode_tp) = (problem.prefill.topology.tp, problem.decode.topology.tp);
    if decode_tp >= prefill_tp {
        primary_tp(problem, target)
    } else if prefill_tp <= kv_heads {
        head / (kv_heads / prefill_tp)
    } else {
        // Replicas of the head are prefill ranks [head*rep, (head+1)*rep); the decode rank contacts
        // [d*k, (d+1)*k) (domain.md §3.1); the first replica it contacts writes.
        (head * (prefill_tp / kv_heads)).max(target.tp * (prefill_tp / decode_tp))
    }
}

/// State tensor `tensor` of component `component` (domain.md §5, §8): Mamba by channel or replicated by slot, other
/// kinds by page.
fn state_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    component: u32,
    tensor: u32,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    let state = &problem.model.state[component as usize];
    let shape = &state.tensors[tensor as usize].shape;
    match (state.kind, shape) {
        (crate::model::StateKind::Mamba, TensorShape::Sliced { full_dim, unit_bytes, outer_count, groups }) => {
            // How each side holds it: the model's rows, or a transposition (`state_layouts`).
            let channel = u64::from(*outer_count) * unit_bytes;
            let held = |side: &crate::model::SideLayout| {
                let (outer, unit) = side.sliced_layout(&problem.model, component, tensor).unwrap_or((1, channel));
                Order { outer: u64::from(outer.max(1)), unit }
            };
            let sliced = Sliced {
                full_dim: *full_dim,
                channel,
                prefill: held(&problem.prefill),
                decode: held(&problem.decode),
                groups: groups.as_deref(),
            };
            let mut res = Vec::new();
            mamba_pieces(problem, target, decode_region, &sliced, &mut res, notes);
            res
        }
        (crate::model::StateKind::Mamba, TensorShape::Replicated { item_len }) => {
            slot_pieces(problem, target, decode_region, *item_len, notes)
        }
        (kind, _) => page_pieces(problem, target, decode_region, kind, component, notes),
    }
}

/// Replicated Mamba state: one item per request, from the prefill slot to the decode slot.
fn slot_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    item_len: u64,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    one_item_pieces(problem, target, decode_region, (item_len, None), |indices| indices.slot, notes)
}

/// One item per request, of `item_len` bytes, from the prefill side's `index` item to the decode side's (from `stage`
/// when given).
fn one_item_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    (item_len, stage): (u64, Option<u32>),
    index: fn(&crate::model::StateIndices) -> u32,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    let mut res = Vec::new();
    for (source, requests) in whole_item_sources(problem, target, decode_region, (item_len, stage), notes) {
        for request in requests {
            res.push(Piece::single(
                request.id,
                u64::from(index(&request.decode_state)) * item_len,
                item_len,
                source,
                u64::from(index(&request.prefill_state)) * item_len,
            ));
        }
    }
    res
}

/// Paged (and other page-indexed) state: one item per page index pair of component `component` (domain.md §8).
fn page_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    kind: StateKind,
    component: u32,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    let mut res = Vec::new();
    let item_len = decode_region.item_len;
    if let (StateKind::Swa, Attention::Mha { kv_heads, .. }) = (kind, problem.model.attention) {
        if problem.prefill.topology.tp != problem.decode.topology.tp {
            swa_head_pieces(problem, target, decode_region, component, kv_heads, &mut res, notes);
            return res;
        }
    }
    for (source, requests) in whole_item_sources(problem, target, decode_region, (item_len, None), notes) {
        for request in requests {
            let (source_pages, target_pages) =
                (&request.prefill_state.pages[component as usize], &request.decode_state.pages[component as usize]);
            if source_pages.len() != target_pages.len() && !kind.is_paged() {
                notes.push((
                    0,
                    ViolationKind::IndexLengths {
                        request: request.id,
                        prefill: source_pages.len(),
                        decode: target_pages.len(),
                    },
                ));
                continue;
            }
            // Paged kinds pair the common prefix of both index lists (domain.md §8: truncate to m).
            for (source_page, target_page) in source_pages.iter().zip(target_pages) {
                res.push(Piece::single(
                    request.id,
                    u64::from(*target_page) * item_len,
                    item_len,
                    source,
                    u64::from(*source_page) * item_len,
                ));
            }
        }
    }
    res
}

/// SWA pages of an MHA model under a TP change: a page item is `page_size` tokens of the side's local KV heads (NHD,
/// SGLang 0.5.23 `_send_swa_state_slice`); each of `target`'s heads of each token from the prefill rank that holds
/// the head (as for KV rows, domain.md §3.2), over the truncated page index pairs (domain.md §8).
fn swa_head_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    component: u32,
    kv_heads: u32,
    res: &mut Vec<Piece>,
    notes: &mut Vec<(u64, ViolationKind)>,
) {
    let page_size = u64::from(problem.prefill.topology.page_size);
    let prefill_tp = problem.prefill.topology.tp;
    let (first_head, head_count) = rank_heads(kv_heads, problem.decode.topology.tp, target.tp);
    let target_item = decode_region.item_len;
    let head_len = target_item / (page_size * u64::from(head_count)).max(1);
    for (group, local) in
        prefill_groups(problem, target).into_iter().flat_map(|group| (0..head_count).map(move |local| (group, local)))
    {
        let head = first_head + local;
        let holder_tp = head_holder_tp(problem, target, kv_heads, head);
        let Some((source, source_region)) =
            holder(problem, (group, 0, holder_tp), target, decode_region.kind, decode_region.layer, None)
        else {
            continue;
        };
        let source_item = problem.prefill.rank(source).regions[source_region as usize].item_len;
        let (holder_first, holder_count) = rank_heads(kv_heads, prefill_tp, holder_tp);
        let whole = |heads: u32| head_len * u64::from(heads) * page_size;
        if head_len == 0 || whole(head_count) != target_item || whole(holder_count) != source_item {
            notes.push((0, ViolationKind::Geometry { source_len: source_item, target_len: target_item }));
            return;
        }
        let holder_local = u64::from(head - holder_first);
        for request in received_from(problem, target, group) {
            let (source_pages, target_pages) =
                (&request.prefill_state.pages[component as usize], &request.decode_state.pages[component as usize]);
            for (source_page, target_page) in source_pages.iter().zip(target_pages) {
                for token in 0..page_size {
                    res.push(Piece::single(
                        request.id,
                        u64::from(*target_page) * target_item
                            + (token * u64::from(head_count) + u64::from(local)) * head_len,
                        head_len,
                        (source, source_region),
                        u64::from(*source_page) * source_item
                            + (token * u64::from(holder_count) + holder_local) * head_len,
                    ));
                }
            }
        }
    }
}

/// The auxiliary item: one per request, from the last prefill stage.
fn aux_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Piece> {
    let last = problem.prefill.topology.pp - 1;
    let item_len = decode_region.item_len;
    one_item_pieces(problem, target, decode_region, (item_len, Some(last)), |indices| indices.aux, notes)
}

/// The requests `target` receives by prefill DP group, each group's with the region that sends whole items of
/// `decode_region` to `target` (replicated state, paged state, aux: the primary TP rank, CP rank 0, on `stage` when
/// given, domain.md §3.1), where items have `item_len` bytes on both sides; a group whose region is missing or of
/// another length is left out (with a note for the length).
fn whole_item_sources<'a>(
    problem: &'a Problem,
    target: RankId,
    decode_region: &Region,
    (item_len, stage): (u64, Option<u32>),
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<((RankId, u32), Vec<&'a Request>)> {
    let layer = if stage.is_some() { 0 } else { decode_region.layer };
    let mut res = Vec::new();
    for group in prefill_groups(problem, target) {
        let held = holder(problem, (group, 0, primary_tp(problem, target)), target, decode_region.kind, layer, stage);
        if let Some(source) = held.filter(|held| same_items(problem, *held, decode_region, item_len, item_len, notes)) {
            res.push((source, received_from(problem, target, group).collect()));
        }
    }
    res
}

/// Whether the prefill region `held` and `decode_region` have the item lengths the rules assume (`source_item`,
/// `target_item`); otherwise no byte-exact placement exists and a geometry note says so.
fn same_items(
    problem: &Problem,
    held: (RankId, u32),
    decode_region: &Region,
    source_item: u64,
    target_item: u64,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> bool {
    let source_len = problem.prefill.rank(held.0).regions[held.1 as usize].item_len;
    let fits = source_len == source_item && decode_region.item_len == target_item;
    if !fits {
        notes.push((0, ViolationKind::Geometry { source_len, target_len: decode_region.item_len }));
    }
    fits
}

/// The prefill TP rank that sends replicated data (latent, draft, paged state, aux) to `target` (domain.md §3.1).
fn primary_tp(problem: &Problem, target: RankId) -> u32 {
    let (prefill, decode) = (problem.prefill.topology.tp, problem.decode.topology.tp);
    if decode >= prefill {
        target.tp / (decode / prefill)
    } else {
        target.tp * (prefill / decode)
    }
}

/// The prefill DP groups that compute a request `target` receives, in order. A request moves only from its prefill
/// DP group to its decode DP group (SGLang's rank mapping runs inside one prefill DP group, `common/conn.py:1432-1530`;
/// src/pure/plan/SGLANG.md).
fn prefill_groups(problem: &Problem, target: RankId) -> BTreeSet<u32> {
    received(problem, target).map(|request| request.prefill_dp).collect()
}

/// The requests `target` receives: those dispatched to its decode DP group.
fn received(problem: &Problem, target: RankId) -> impl Iterator<Item = &Request> {
    problem.requests.iter().filter(move |request| request.decode_dp == target.dp)
}

/// The requests `target` receives from prefill DP group `group`.
fn received_from(problem: &Problem, target: RankId, group: u32) -> impl Iterator<Item = &Request> {
    received(problem, target).filter(move |request| request.prefill_dp == group)
}

/// The prefill rank of DP group `group`, CP rank `cp` and TP rank `tp` that registers a region of `kind` for `layer`, on the stage
/// paired with `target`.
fn holder(
    problem: &Problem,
    (group, cp, tp): (u32, u32, u32),
    target: RankId,
    kind: RegionKind,
    layer: LayerId,
    stage: Option<u32>,
) -> Option<(RankId, u32)> {
    let same_stages = problem.decode.topology.pp == problem.prefill.topology.pp;
    let mut ranks = problem.prefill.ranks.iter().filter(|layout| {
        let rank = layout.rank;
        rank.dp == group && rank.cp == cp && rank.tp == tp
    });
    ranks.find_map(|layout| {
        if (same_stages && layout.rank.pp != target.pp) || stage.is_some_and(|stage| stage != layout.rank.pp) {
            return None;
        }
        let index = layout.regions.iter().position(|region| region.kind == kind && region.layer == layer)?;
        Some((layout.rank, index as u32))
    })
}

/// (decode row, prefill row) of every token row `target` receives for `request` (domain.md §2.1, §2.4, §2.5), as
/// runs.
fn token_rows(
    problem: &Problem,
    target: RankId,
    request: &Request,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Rows> {
    let prefill = &problem.prefill.topology;
    let decode = &problem.decode.topology;
    // A HiSparse decode receives its KV in its host pool, at the host pages it listed (SGLang 0.5.23
    // `disaggregation/decode.py:1643-1658`); only its draft stays at the allocator's pages.
    let hosted;
    let request = if request.decode_host_pages.is_empty() {
        request
    } else {
        hosted = Request { decode_pages: request.decode_host_pages.clone(), ..request.clone() };
        &hosted
    };
    if prefill.dcp == decode.dcp {
        // Same layout on both sides: the send range's allocator pages move whole, P rows each.
        whole_pages(problem, request, u64::from(decode.page_size), notes)
    } else if prefill.dcp == 1 {
        // Token relayout: position p lives on DCP rank p mod c at local row (p - prefix) div c, P rows per page.
        relaid_rows(
            problem,
            request,
            Some((decode.dcp, decode.dcp_rank(target.tp))),
            u64::from(decode.page_size),
            notes,
        )
    } else {
        Vec::new()
    }
}

/// Draft rows: pools paged by the allocator page `V`; under relayout every send-range token goes to every DCP rank
/// at its send-range-relative index (domain.md §2.4 draft rows).
fn draft_rows(problem: &Problem, request: &Request, notes: &mut Vec<(u64, ViolationKind)>) -> Vec<Rows> {
    let prefill = &problem.prefill.topology;
    let decode = &problem.decode.topology;
    let virtual_page = u64::from(decode.virtual_page_size());
    if prefill.dcp == decode.dcp {
        whole_pages(problem, request, virtual_page, notes)
    } else {
        relaid_rows(problem, request, None, virtual_page, notes)
    }
}

/// Send-range allocator page k moves whole (`rows` rows) from the prefill page to decode page k.
fn whole_pages(problem: &Problem, request: &Request, rows: u64, notes: &mut Vec<(u64, ViolationKind)>) -> Vec<Rows> {
    let allocator_page = problem.prefill.topology.virtual_page_size();
    let first_page = (request.decode_prefix / allocator_page) as usize;
    let mut res = Vec::new();
    for ordinal in 0..request.send_len().div_ceil(allocator_page) as usize {
        let (Some(target_page), Some(source_page)) =
            (request.decode_pages.get(ordinal), request.prefill_pages.get(first_page + ordinal))
        else {
            let position = request.decode_prefix + ordinal as u32 * allocator_page;
            notes.push((0, ViolationKind::Unplaceable { request: request.id, position }));
            break;
        };
        let (target, source) = (u64::from(*target_page) * rows, u64::from(*source_page) * rows);
        push_rows(&mut res, Rows { target, source, count: rows, step: 1 });
    }
    res
}

/// Token by token from a DCP-1 prefill: positions owned by `owner` = (c, r) (all when `None`) land at local index
/// `(p - prefix) div c` of decode pages of `rows` rows; the source row is the prefill's own page layout.
fn relaid_rows(
    problem: &Problem,
    request: &Request,
    owner: Option<(u32, u32)>,
    rows: u64,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Rows> {
    relaid_runs(request, owner.unwrap_or((1, 0)), rows, u64::from(problem.prefill.topology.page_size), notes)
}

/// [`relaid_rows`] for DCP rank `owner` = (c, r), prefill pages of `page` rows: one run per stretch of positions
/// that stays inside one decode page and one prefill page (consecutive decode rows, source rows `c` apart).
fn relaid_runs(
    request: &Request,
    (dcp, rank): (u32, u32),
    rows: u64,
    page: u64,
    notes: &mut Vec<(u64, ViolationKind)>,
) -> Vec<Rows> {
    let mut res = Vec::new();
    // The positions owned by `rank` (those with `position % dcp == rank`): from the first at or after the prefix,
    // every `dcp`-th; none for a rank outside the group.
    let first = (rank < dcp)
        .then(|| request.decode_prefix.checked_add((rank + dcp - request.decode_prefix % dcp) % dcp))
        .flatten()
        .unwrap_or(request.tokens);
    let (step, tokens) = (u64::from(dcp), u64::from(request.tokens));
    let mut position = u64::from(first);
    while position < tokens {
        let local = (position - u64::from(request.decode_prefix)) / step;
        let Some(target_page) = request.decode_pages.get((local / rows) as usize) else {
            notes.push((local, ViolationKind::Unplaceable { request: request.id, position: position as u32 }));
            position += step;
            continue;
        };
        let source_page = request.prefill_pages[(position / page) as usize];
        // The run goes on while the decode page, the prefill page and the request's positions do.
        let in_target = rows - local % rows;
        let in_source = (page - position % page).div_ceil(step);
        let count = in_target.min(in_source).min((tokens - position).div_ceil(step));
        let target = u64::from(*target_page) * rows + local % rows;
        let source = u64::from(source_page) * page + position % page;
        push_rows(&mut res, Rows { target, source, count, step });
        position += count * step;
    }
    res
}

struct Sliced<'a> {
    full_dim: u32,
    /// Bytes each channel holds, over all its rows.
    channel: u64,
    prefill: Order,
    decode: Order,
    groups: Option<&'a [u32]>,
}

/// How one side holds a sliced tensor (domain.md §5.2): `outer` rows of its local channels, `unit` bytes each; a side
/// may hold the model's `[dim, taps]` as `[taps, dim]` or back (scenario `state_layouts`).
#[derive(Clone, Copy)]
struct Order {
    outer: u64,
    unit: u64,
}

impl Order {
    /// Byte offset of local channel `channel`'s part `row` of `rows` (`rows`: the larger outer of the two sides):
    /// row `row` of a side holding `rows` rows, or the `row`-th slice of the channel's unit of a side holding one.
    fn at(self, dim: u64, rows: u64, channel: u64, row: u64) -> u64 {
        if self.outer == rows {
            row * dim * self.unit + channel * self.unit
        } else {
            channel * self.unit + row * (self.unit / rows)
        }
    }
}

/// Mamba state by global channel (domain.md §5.2): decode rank `d` holds channels `[d*g/Td, (d+1)*g/Td)` of every
/// sub-block `g`; each comes from the prefill rank holding that channel, at its local position.
fn mamba_pieces(
    problem: &Problem,
    target: RankId,
    decode_region: &Region,
    tensor: &Sliced<'_>,
    res: &mut Vec<Piece>,
    notes: &mut Vec<(u64, ViolationKind)>,
) {
    let (prefill_tp, decode_tp) = (problem.prefill.topology.tp, problem.decode.topology.tp);
    let groups: Vec<u32> = tensor.groups.map_or_else(|| vec![tensor.full_dim], <[u32]>::to_vec);
    // Both sides' rows (one side transposed: the taps) and each channel's part of one row.
    let rows = tensor.prefill.outer.max(tensor.decode.outer);
    let element = tensor.channel / rows.max(1);
    // Runs of channels stay contiguous on both sides only where both hold the same order.
    let same_order = tensor.prefill.outer == tensor.decode.outer;
    let (target_dim, source_dim) = (u64::from(tensor.full_dim / decode_tp), u64::from(tensor.full_dim / prefill_tp));
    let (target_item, source_item) = (target_dim * tensor.channel, source_dim * tensor.channel);
    // The holder depends only on the prefill TP rank: look each one up once; every holder's items must have the
    // model's length.
    for group in prefill_groups(problem, target) {
        let holders: Vec<Option<(RankId, u32)>> = (0..prefill_tp)
            .map(|tp| {
                holder(problem, (group, 0, tp), target, decode_region.kind, decode_region.layer, None)
                    .filter(|held| same_items(problem, *held, decode_region, source_item, target_item, notes))
            })
            .collect();
        for request in received_from(problem, target, group) {
            for row in 0..rows {
                let (mut target_start, mut source_start) = (0u64, 0u64);
                for group in &groups {
                    let (target_width, source_width) = (u64::from(group / decode_tp), u64::from(group / prefill_tp));
                    let mut index = 0;
                    while index < target_width {
                        let channel = u64::from(target.tp) * target_width + index;
                        let (holder_tp, within) = ((channel / source_width) as u32, channel % source_width);
                        // The channels up to the end of this group's share or of the holder's share come from one
                        // holder, consecutive on both sides when both hold one order: one piece for the run.
                        let run = (target_width - index).min(source_width - within);
                        let run = if same_order { run } else { 1 };
                        if let Some((source, source_region)) = holders[holder_tp as usize] {
                            let at_target = tensor.decode.at(target_dim, rows, target_start + index, row);
                            let at_source = tensor.prefill.at(source_dim, rows, source_start + within, row);
                            push_merged(
                                res,
                                Piece::single(
                                    request.id,
                                    u64::from(request.decode_state.slot) * target_item + at_target,
                                    run * element,
                                    (source, source_region),
                                    u64::from(request.prefill_state.slot) * source_item + at_source,
                                ),
                            );
                        }
                        index += run;
                    }
                    target_start += target_width;
                    source_start += source_width;
                }
            }
        }
    }
}

/// Appends `piece`, extending the last one when both sides continue it.
fn push_merged(res: &mut Vec<Piece>, piece: Piece) {
    if let Some(last) = res.last_mut() {
        let continues = last.request == piece.request
            && last.source == piece.source
            && last.source_region == piece.source_region
            && last.target_offset + last.length == piece.target_offset
            && last.source_offset + last.length == piece.source_offset;
        if continues {
            last.length += piece.length;
            last.source_stride = last.length;
            return;
        }
    }
    res.push(piece);
}

/// Byte ranges of decode region `region` on `target` that hold `request`'s destination items: its decode pages
/// (KV, draft), its Mamba slot or state pages, its aux row. A failed request may leave bytes only here.
pub(crate) fn territory(problem: &Problem, target: RankId, region: u32, request: &Request) -> Vec<(u64, u64)> {
    if request.decode_dp != target.dp {
        // Another decode DP group's request has no item here.
        return Vec::new();
    }
    let decode_region = &problem.decode.rank(target).regions[region as usize];
    if decode_region.kind == RegionKind::Staging {
        return staging::territory(problem, target, request);
    }
    let items: Vec<u32> = match decode_region.kind {
        RegionKind::Kv(_) if !request.decode_host_pages.is_empty() => request.decode_host_pages.clone(),
        RegionKind::Kv(_) | RegionKind::Draft => request.decode_pages.clone(),
        RegionKind::State { component, .. } => match problem.model.state[component as usize].kind {
            StateKind::Mamba => vec![request.decode_state.slot],
            _ => request.decode_state.pages[component as usize].clone(),
        },
        RegionKind::Aux { .. } => vec![request.decode_state.aux],
        RegionKind::Staging => Vec::new(),
    };
    let len = decode_region.item_len;
    items.iter().map(|item| (u64::from(*item) * len, (u64::from(*item) + 1) * len)).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::model::StateIndices;

    /// Position by position, as domain.md §2.4 states it: (decode row, prefill row) of every position `rank` owns.
    fn rows_one_by_one(request: &Request, (dcp, rank): (u32, u32), rows: u64, page: u64) -> Vec<(u64, u64)> {
        let start = request.decode_prefix;
        (start..request.tokens)
            .filter(|position| position % dcp == rank)
            .filter_map(|position| {
                let local = u64::from((position - start) / dcp);
                let target_page = request.decode_pages.get((local / rows) as usize)?;
                let source_page = request.prefill_pages[(u64::from(position) / page) as usize];
                Some((
                    u64::from(*target_page) * rows + local % rows,
                    u64::from(source_page) * page + u64::from(position) % page,
                ))
            })
            .collect()
    }

    proptest! {
        /// The runs, expanded row by row, are exactly the position-by-position enumeration, whatever the pages,
        /// prefix, page sizes and DCP rank: runs change the oracle's cost, never what it expects.
        #[test]
        fn runs_expand_to_the_rows_position_by_position(
            tokens in 1u32..300,
            prefix_share in 0u32..100,
            dcp in 1u32..9,
            rank_pick in 0u32..9,
            rows in 1u64..20,
            page in 1u64..20,
            shuffle in any::<u64>(),
            short in 0usize..3,
        ) {
            let rank = rank_pick % dcp;
            let decode_prefix = tokens * prefix_share / 100;
            let prefill_count = u64::from(tokens).div_ceil(page) as u32;
            let decode_count = (u64::from(tokens - decode_prefix).div_ceil(rows) as usize).saturating_sub(short);
            // Pages in a scrambled order, some consecutive, so that runs both break and join across pages.
            let scramble = |k: u32| if shuffle >> (k % 64) & 1 == 1 { k * 3 + 1 } else { k * 2 };
            let request = Request {
                id: 7,
                tokens,
                decode_prefix,
                chunks: vec![tokens - decode_prefix],
                prefill_pages: (0..prefill_count).map(scramble).collect(),
                decode_pages: (0..decode_count as u32).map(scramble).collect(),
                decode_host_pages: Vec::new(),
                staging_offsets: Vec::new(),
                prefill_state: StateIndices::default(),
                decode_state: StateIndices::default(),
                cached_prefix: 0,
                prefill_dp: 0,
                decode_dp: 0,
            };
            let mut notes = Vec::new();
            let runs = relaid_runs(&request, (dcp, rank), rows, page, &mut notes);
            let expanded: Vec<(u64, u64)> = runs.iter().flat_map(|run| run.each()).collect();
            prop_assert_eq!(expanded, rows_one_by_one(&request, (dcp, rank), rows, page));
            prop_assert!(runs.iter().all(|run| run.count >= 1));
            // A position without a decode page is a note, one per position.
            let placed = runs.iter().map(|run| run.count).sum::<u64>() as usize;
            let owned = (decode_prefix..tokens).filter(|position| position % dcp == rank).count();
            prop_assert_eq!(placed + notes.len(), owned);
        }
    }
}
