//! Which prefill ranks talk to which decode ranks (domain.md §3.1), and how KV moves (domain.md §2.5).

use std::fmt::Write as _;

use super::PlanError;
use crate::model::{PoolKind, RankId, Topology};

/// How KV bytes of one connection move (domain.md §2.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Mode {
    /// Equal DCP sizes: same layout on both sides, item for item.
    PageCopy,
    /// Prefill DCP 1 → decode DCP `dcp`: token rows owned by `dcp_rank` are re-laid out.
    Relayout { dcp: u32, dcp_rank: u32 },
}

/// One prefill rank a decode rank contacts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Connection {
    pub(crate) prefill: RankId,
    pub(crate) decode: RankId,
    /// Position among the `k` prefill ranks of the decode rank's group when decode TP < prefill TP, else 0.
    pub(crate) offset: u32,
}

/// Rejects sizes that cannot be mapped at all: DCP carved out of TP, integral TP ratio, decode PP ∈ {1, prefill PP}.
pub(crate) fn check_topologies(prefill: &Topology, decode: &Topology, pool: PoolKind) -> Result<(), PlanError> {
    let unsupported = |reason: String| Err(PlanError::UnsupportedTopology { reason });
    for (side, topology) in [("prefill", prefill), ("decode", decode)] {
        let sizes = [topology.tp, topology.dp, topology.cp, topology.pp, topology.dcp, topology.page_size];
        if sizes.contains(&0) {
            return unsupported(format!("{side} tp, dp, cp, pp, dcp and page_size must be at least 1"));
        }
        if topology.tp % topology.dcp != 0 {
            return unsupported(format!("{side} tp {} is not a multiple of dcp {}", topology.tp, topology.dcp));
        }
    }
    if prefill.page_size != decode.page_size {
        return Err(PlanError::PageSizeMismatch { prefill: prefill.page_size, decode: decode.page_size });
    }
    // Decode-side gate in try_ensure_parallel_info, before any registration (domain.md §2.5).
    if decode.dcp > 1 && !pool.replicated_latent() {
        return Err(PlanError::DcpNeedsMla);
    }
    if decode.dcp > 1 && prefill.cp != 1 {
        return Err(PlanError::DcpNeedsPrefillCp1 { cp: prefill.cp });
    }
    if decode.cp != 1 {
        return unsupported(format!("decode cp {} must be 1", decode.cp));
    }
    if decode.pp != 1 && decode.pp != prefill.pp {
        return unsupported(format!("decode pp {} must be 1 or equal prefill pp {}", decode.pp, prefill.pp));
    }
    if prefill.tp % decode.tp != 0 && decode.tp % prefill.tp != 0 {
        return unsupported(format!("prefill tp {} and decode tp {} do not divide", prefill.tp, decode.tp));
    }
    Ok(())
}

/// Every (prefill rank, decode rank) connection between prefill DP group `groups.0` and decode DP group `groups.1`
/// (domain.md §3.1 inside the groups: SGLang's `_resolve_rank_mapping` maps attention-TP ranks within one prefill DP
/// group, `common/conn.py:1432-1530`), for every prefill CP rank the decode pulls from (all of them when it pulls
/// from every CP rank, else CP rank 0, `1496-1513`).
pub(crate) fn connections(prefill: &Topology, decode: &Topology, groups: (u32, u32)) -> Vec<Connection> {
    let mut res = Vec::new();
    let cp_ranks = if decode.all_cp { prefill.cp } else { 1 };
    for target in decode.group(groups.1) {
        let stages = if decode.pp == prefill.pp { target.pp..target.pp + 1 } else { 0..prefill.pp };
        for (cp, pp) in (0..cp_ranks).flat_map(|cp| stages.clone().map(move |pp| (cp, pp))) {
            if decode.tp >= prefill.tp {
                let ratio = decode.tp / prefill.tp;
                let source = RankId { dp: groups.0, cp, pp, tp: target.tp / ratio };
                res.push(Connection { prefill: source, decode: target, offset: 0 });
            } else {
                let ratio = prefill.tp / decode.tp;
                for offset in 0..ratio {
                    let source = RankId { dp: groups.0, cp, pp, tp: target.tp * ratio + offset };
                    res.push(Connection { prefill: source, decode: target, offset });
                }
            }
        }
    }
    res
}

/// `requires_dcp_relayout` evaluated on the prefill side for one decode peer (domain.md §2.5).
pub(crate) fn transfer_mode(
    prefill: &Topology,
    source: RankId,
    decode: &Topology,
    decode_rank: u32,
) -> Result<Mode, PlanError> {
    if prefill.dcp == decode.dcp {
        let prefill_rank = prefill.dcp_rank(source.tp);
        if prefill_rank != decode_rank {
            return Err(PlanError::MismatchedDcpRanks { prefill: prefill_rank, decode: decode_rank });
        }
        return Ok(Mode::PageCopy);
    }
    // The pool gate (MLA or hybrid-MLA only) already ran in check_topologies.
    if prefill.dcp == 1 {
        return Ok(Mode::Relayout { dcp: decode.dcp, dcp_rank: decode_rank });
    }
    Err(PlanError::UnsupportedDcpTopology { prefill: prefill.dcp, decode: decode.dcp })
}

/// One explain line for the rank mapping.
pub(crate) fn describe_mapping(prefill: &Topology, decode: &Topology, pool: PoolKind, sharded_draft: bool) -> String {
    let mut res = String::new();
    if decode.tp == prefill.tp {
        let _ =
            write!(res, "rank mapping: decode TP{} = prefill TP{}: decode tp d <- prefill tp d", decode.tp, prefill.tp);
    } else if decode.tp > prefill.tp {
        let ratio = decode.tp / prefill.tp;
        let _ = write!(
            res,
            "rank mapping: decode TP{} > prefill TP{} (k={ratio}): decode tp d <- prefill tp d div {ratio}; each prefill rank serves {ratio} decode ranks",
            decode.tp, prefill.tp
        );
    } else {
        let ratio = prefill.tp / decode.tp;
        let others = match pool {
            PoolKind::Mla if sharded_draft => "the others send their heads of the head-sharded draft only (pure MLA)",
            PoolKind::Mla => "the others are dummies (pure MLA)",
            PoolKind::HybridMla => "the others send state only (hybrid-MLA)",
            PoolKind::Mha | PoolKind::HybridMha => "all send their KV heads (head-sharded)",
        };
        let _ = write!(
            res,
            "rank mapping: decode TP{} < prefill TP{} (k={ratio}): decode tp d <- prefill tp d*{ratio}..d*{ratio}+{}; the first writes latent KV, draft and aux, {others}",
            decode.tp,
            prefill.tp,
            ratio - 1
        );
    }
    if decode.pp == prefill.pp {
        let _ = write!(res, "; decode stage s <- prefill stage s");
    } else {
        let _ = write!(res, "; each decode rank contacts all {} prefill stages", prefill.pp);
    }
    if prefill.cp > 1 {
        let _ = match decode.all_cp {
            true => write!(
                res,
                "; prefill CP{}: every CP rank sends its contiguous block of each request's pages, CP rank 0 the state and aux",
                prefill.cp
            ),
            false => write!(res, "; prefill CP{}: CP rank 0 sends everything, the other CP ranks are dummies", prefill.cp),
        };
    }
    if prefill.dp > 1 || decode.dp > 1 {
        let _ = write!(
            res,
            "; inside the DP groups of each request (prefill DP{}, decode DP{}): its prefill group's ranks write only its decode group's ranks",
            prefill.dp, decode.dp
        );
    }
    res
}
