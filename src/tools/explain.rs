//! `kvrelay explain`: which of SGLang 0.5.23's transfer code paths a scenario's transfers take (MLA page copy, DCP
//! relayout, head slice, Mamba state slice, replicated state, paged SWA/DSA state, SWA head slice, aux), with the wheel's file:line
//! for each, so a user sees which parts of upstream their deployment exercises.
//!
//! Each path is read off kvrelay's own plan (what moves, between which ranks, how many bytes); the citations are
//! where SGLang 0.5.23 does the same thing (paths under `sglang/srt/`, `disaggregation/` unless named). Pure: no IO.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::model::{PoolKind, Problem, StateKind};
use crate::plan::{self, PlanError, TransferKind};

/// One SGLang code path a scenario exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// Which prefill ranks each decode rank contacts.
    RankMapping,
    /// DP attention: each request moves from its prefill DP group to its decode DP group.
    DpRouting,
    /// Prefill CP with all-CP transfer: each CP rank sends its contiguous block of a request's pages.
    CpBlocks,
    /// Prefill CP without it: CP rank 0 sends everything, the others are dummies.
    CpRankZero,
    /// KV entries paired across pipeline stages by global layer id.
    LayerIdPairing,
    /// KV entries paired by position (no layer ids from a peer).
    PositionalPairing,
    /// Whole KV pages, item for item (MLA latent, or MHA at equal TP).
    PageCopy,
    /// Whole MLA latent pages into a HiSparse decode's host pool, at its host pages.
    HiSparseHost,
    /// Prefill DCP1 → decode DCP c: token rows re-laid out by owner.
    DcpRelayout,
    /// MHA/GQA under a TP change: per-token head slices.
    HeadSlice,
    /// MHA/GQA under a TP change with staging: per-token head slices into the decode's staging ring.
    Staging,
    /// Speculative draft KV rows.
    Draft,
    /// A head-sharded (MHA/GQA) draft under a TP change: per-token head slices with the draft's own widths.
    DraftHeadSlice,
    /// Mamba/KDA/GDN state at equal TP: the whole slot.
    MambaSlot,
    /// Mamba/KDA/GDN state under a TP change: channel slices.
    MambaSlice,
    /// Mamba state the decode holds in another element order (`[taps, dim]` against `[dim, taps]`): every (channel,
    /// tap) element moved to the decode's order.
    MambaTransposed,
    /// A replicated (dim 0) Mamba tensor under a TP change: the whole slot from one elected writer.
    ReplicatedState,
    /// Paged state (SWA window, DSA index keys) and position rings.
    PagedState,
    /// SWA pages of a non-MLA model under a TP change: per-token head slices.
    SwaHeadSlice,
    /// Aux (metadata) rows.
    Aux,
}

impl Path {
    /// What it is, and where SGLang 0.5.23 does it.
    pub fn describe(self) -> (&'static str, &'static str) {
        match self {
            Path::RankMapping => {
                ("rank mapping: which prefill ranks a decode rank contacts", "common/conn.py:1432-1530 _resolve_rank_mapping")
            }
            Path::DpRouting => (
                "DP attention: a request moves between its prefill and decode DP groups",
                "decode.py:879-897 _resolve_prefill_dp_rank; common/conn.py:3089-3186 bootstrap table by DP group",
            ),
            Path::CpBlocks => (
                "prefill CP: each CP rank sends its contiguous block of a request's pages, CP rank 0 the state",
                "utils.py:803-857 filter_kv_indices_for_cp_rank; common/conn.py:2282-2291, 513-529",
            ),
            Path::CpRankZero => (
                "prefill CP: CP rank 0 sends everything, the other CP ranks are dummies",
                "common/conn.py:435-440 is_dummy_cp_rank, 1496-1513",
            ),
            Path::LayerIdPairing => (
                "KV and state entries paired by global layer id",
                "utils.py:1067-1111 build_transfer_entry_pairs",
            ),
            Path::PositionalPairing => (
                "KV entries paired by position (no layer ids)",
                "common/conn.py:1718-1749 get_mha_kv_ptrs_with_pp, 1853-1888 get_mla_kv_ptrs_with_pp",
            ),
            Path::PageCopy => ("whole KV pages, item for item", "mooncake/conn.py:1346-1395 send_kvcache, 1019 _send_kvcache_generic"),
            Path::HiSparseHost => (
                "whole latent pages into the HiSparse decode's host pool, at host pages (the draft at logical pages)",
                "decode.py:620-632, 1643-1658, 1787-1806; mooncake/conn.py:1346-1396 send_kvcache, 1172-1193 set_transfer_blocks",
            ),
            Path::DcpRelayout => (
                "DCP relayout of token rows",
                "mooncake/conn.py:1397 send_kvcache_dcp; common/utils.py:153 build_dcp_token_transfer_plan",
            ),
            Path::HeadSlice => (
                "MHA head slices under a TP change, one descriptor per token",
                "mooncake/conn.py:1647 send_kvcache_slice; common/staging_buffer.py:773-806 compute_head_slice_params",
            ),
            Path::Staging => (
                "MHA head slices into the decode's staging ring, one image per chunk (the decode scatters it after the transfer)",
                "common/staging_buffer.py:62-97, 773-839 compute_head_slice_params, compute_staging_layout; mooncake/conn.py:2707-2727, 733-806; common/staging_handler.py",
            ),
            Path::Draft => ("draft KV rows (appended entries)", "prefill.py:300-317; mooncake/conn.py:1489-1552 (DCP)"),
            Path::DraftHeadSlice => (
                "head-sharded draft KV under a TP change: per-token head slices with the draft's own widths",
                "0.5.23 sizes them otherwise: with the target's entry-0 geometry on the MHA path (mooncake/conn.py:1647-1778), page copies with the prefill's item length and pure-MLA dummies on the MLA path (mooncake/conn.py:1172-1193, common/conn.py:435-440)",
            ),
            Path::MambaSlot => ("Mamba state, whole slot at equal TP", "mooncake/conn.py:2289-2324 _send_mamba_state"),
            Path::MambaSlice => (
                "Mamba state channel slices under a TP change",
                "mooncake/conn.py:2326 _send_mamba_state_slice; utils.py:979-1042 compute_mamba_state_slice_byte_blocks",
            ),
            Path::MambaTransposed => (
                "Mamba state held transposed on one side: every (channel, tap) element moved to the decode's order (kvrelay's frame 19)",
                "no such path: 0.5.23 publishes no outer count and slices with the prefill's on both sides (utils.py:979-1042; Mooncake/NIXL registrations, mooncake/conn.py:154-177): the elements land scrambled",
            ),
            Path::ReplicatedState => (
                "replicated state tensor under a TP change, one writer",
                "utils.py:872-904 should_send_replicated_state, 1004-1016",
            ),
            Path::PagedState => ("paged state (SWA window, DSA keys, rings)", "mooncake/conn.py:1943 maybe_send_extra"),
            Path::SwaHeadSlice => (
                "SWA pages head-sliced under a TP change, one descriptor per token",
                "mooncake/conn.py:2435-2476 _send_swa_state_slice; common/conn.py:1751-1851 _get_mha_head_slice_blocks",
            ),
            Path::Aux => ("aux rows with the last chunk", "mooncake/conn.py:1780-1803 send_aux"),
        }
    }
}

/// How much of the plan goes through one path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Use {
    /// Transfer groups (one source rank, one target rank, one chunk, one kind).
    pub groups: u64,
    pub bytes: u64,
}

/// The paths of one scenario, or the rejection that stops it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    pub paths: BTreeMap<Path, Use>,
    pub rejected: Option<PlanError>,
    pub notes: Vec<String>,
}

/// ` x DP<n>` after the attention-TP size of a side with DP attention.
fn dp_groups(topology: &crate::model::Topology) -> String {
    if topology.dp > 1 {
        format!(" x DP{}", topology.dp)
    } else {
        String::new()
    }
}

/// The SGLang paths `problem`'s transfers take, read off kvrelay's plan of it.
pub fn explain(problem: &Problem) -> Explanation {
    let (prefill, decode) = (&problem.prefill.topology, &problem.decode.topology);
    let mut notes = vec![format!(
        "pool {}, prefill TP{}{}{} PP{} DCP{} -> decode TP{}{} PP{} DCP{}, page size {}",
        problem.model.pool_kind(),
        prefill.tp,
        dp_groups(prefill),
        if prefill.cp > 1 { format!(" x CP{}", prefill.cp) } else { String::new() },
        prefill.pp,
        prefill.dcp,
        decode.tp,
        dp_groups(decode),
        decode.pp,
        decode.dcp,
        prefill.page_size
    )];
    let plan = match plan::plan(problem) {
        Ok(plan) => plan,
        Err(error) => return Explanation { paths: BTreeMap::new(), rejected: Some(error), notes },
    };
    let mut paths: BTreeMap<Path, Use> = BTreeMap::new();
    let mut add = |path: Path, bytes: u64| {
        let entry = paths.entry(path).or_default();
        entry.groups += 1;
        entry.bytes += bytes;
    };
    let with_ids = |side: &crate::model::SideLayout| side.ranks.iter().all(|rank| rank.advertised_layer_ids.is_some());
    let pairing = if with_ids(&problem.prefill) && with_ids(&problem.decode) {
        Path::LayerIdPairing
    } else {
        Path::PositionalPairing
    };
    for group in &plan.groups {
        let rows: u64 = group.runs.iter().map(|run| run.rows).sum();
        let bytes: u64 = group.entries.iter().map(|entry| entry.length * rows).sum();
        match group.kind {
            TransferKind::Kv => {
                add(pairing, 0);
                let sliced = group
                    .entries
                    .iter()
                    .any(|entry| entry.length < entry.target_row_len || entry.length < entry.source_row_len);
                let hosted = problem.requests.iter().any(|request| !request.decode_host_pages.is_empty());
                let path = if prefill.dcp != decode.dcp {
                    Path::DcpRelayout
                } else if hosted {
                    Path::HiSparseHost
                } else if sliced {
                    Path::HeadSlice
                } else {
                    Path::PageCopy
                };
                add(path, bytes);
            }
            TransferKind::Draft
                if problem.model.draft.is_some_and(|it| it.sharded().is_some()) && prefill.tp != decode.tp =>
            {
                add(Path::DraftHeadSlice, bytes)
            }
            TransferKind::Draft => add(Path::Draft, bytes),
            TransferKind::Aux => add(Path::Aux, bytes),
            TransferKind::Staging { .. } => add(Path::Staging, bytes),
            TransferKind::State { component } => {
                let state = &problem.model.state[component as usize];
                let target = problem.decode.rank(group.target);
                let mut by_path: BTreeMap<Path, u64> = BTreeMap::new();
                for entry in group.entries.iter() {
                    let kind = target.regions[entry.target_region as usize].kind;
                    let replicated = problem.model.is_replicated_mamba(kind);
                    let transposed = match kind {
                        crate::model::RegionKind::State { component, tensor } => {
                            let held =
                                |side: &crate::model::SideLayout| side.sliced_layout(&problem.model, component, tensor);
                            held(&problem.prefill).map(|it| it.0) != held(&problem.decode).map(|it| it.0)
                        }
                        _ => false,
                    };
                    let path = match state.kind {
                        StateKind::Mamba if transposed => Path::MambaTransposed,
                        StateKind::Mamba if prefill.tp == decode.tp => Path::MambaSlot,
                        StateKind::Mamba if replicated => Path::ReplicatedState,
                        StateKind::Mamba => Path::MambaSlice,
                        StateKind::Swa if prefill.tp != decode.tp && !problem.model.pool_kind().replicated_latent() => {
                            Path::SwaHeadSlice
                        }
                        StateKind::Swa | StateKind::Dsa | StateKind::SwaRing => Path::PagedState,
                    };
                    *by_path.entry(path).or_default() += entry.length * rows;
                }
                for (path, bytes) in by_path {
                    add(path, bytes);
                }
            }
        }
    }
    if !plan.groups.is_empty() {
        // The rank mapping's count is the prefill ranks decode rank 0 contacts, not a number of groups.
        let contacted = plan::prefill_targets(prefill, decode, crate::model::RankId::new(0, 0), 0).len() as u64;
        paths.insert(Path::RankMapping, Use { groups: contacted, bytes: 0 });
        if prefill.dp > 1 || decode.dp > 1 {
            let pairs: std::collections::BTreeSet<(u32, u32)> =
                problem.requests.iter().map(|request| (request.prefill_dp, request.decode_dp)).collect();
            paths.insert(Path::DpRouting, Use { groups: pairs.len() as u64, bytes: 0 });
        }
        if prefill.cp > 1 {
            paths.insert(if decode.all_cp { Path::CpBlocks } else { Path::CpRankZero }, Use::default());
        }
    }
    if problem.model.pool_kind() == PoolKind::HybridMla && decode.tp < prefill.tp {
        notes.push("hybrid-MLA with decode TP < prefill TP: only the first prefill rank of each group writes the latent (mooncake/conn.py:1873-1901 skip_kv)".to_owned());
    }
    Explanation { paths, rejected: None, notes }
}

/// The explanation as text: one line per path with its citation, groups and bytes.
pub fn render(name: &str, explanation: &Explanation) -> String {
    let mut res = format!("scenario: {name}\n");
    for note in &explanation.notes {
        let _ = writeln!(res, "  {note}");
    }
    if let Some(error) = &explanation.rejected {
        let _ = writeln!(res, "  rejected before any transfer ({}): {error}", error.kind());
        return res;
    }
    for (path, used) in &explanation.paths {
        let (what, code) = path.describe();
        if *path == Path::RankMapping {
            let _ =
                writeln!(res, "  {what}: decode rank 0 contacts {} prefill rank(s)\n      SGLang: {code}", used.groups);
        } else if *path == Path::DpRouting {
            let _ = writeln!(res, "  {what}: {} pair(s) of groups\n      SGLang: {code}", used.groups);
        } else if used.bytes == 0 {
            let _ = writeln!(res, "  {what}\n      SGLang: {code}");
        } else {
            let _ = writeln!(
                res,
                "  {what}: {} transfer group(s), {} bytes\n      SGLang: {code}",
                used.groups, used.bytes
            );
        }
    }
    res
}
