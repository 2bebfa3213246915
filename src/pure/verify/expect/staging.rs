//! The decode's staging ring, as the oracle expects it (SGLang 0.5.23 `common/staging_buffer.py`; kvrelay's rules in
//! `src/pure/plan/SGLANG.md` "Staging buffer"), restated without the planner: which prefill ranks write a decode
//! rank's image, which heads each puts per token (domain.md §3.1, §3.2), and where: writer `w`, slot `s` (the decode's
//! K buffers, then its V buffers), chunk token `t` at `off + w*(T*nh*b*2L) + s*(T*nh*b) + t*(nh*b)`, `T` the chunk's
//! whole pages, `off` the decode's allocation for the chunk.

use super::{holder, prefill_groups, rank_heads, received_from, Piece};
use crate::model::{Attention, Problem, RankId, Region, Request};

/// Whether the transfer goes through the staging ring: the prefill runs with staging, the decode registered a ring,
/// the pool is MHA/GQA and the attention-TP sizes differ. The decode's pool then receives nothing from the transfer:
/// filling it from the ring is the decode's own scatter after the transfer (not a transfer, not run by kvrelay).
pub(super) fn in_use(problem: &Problem) -> bool {
    let (prefill, decode) = (&problem.prefill.topology, &problem.decode.topology);
    prefill.staging_chunk_pages > 0
        && matches!(problem.model.attention, Attention::Mha { .. })
        && prefill.tp != decode.tp
        && problem.decode.ranks.iter().all(|layout| layout.staging_entry.is_some())
}

/// Each writer of `target`'s image: its prefill TP rank, and the first global head and head count it puts per token.
fn writers(problem: &Problem, target: RankId, kv_heads: u32) -> Vec<(u32, u32, u32)> {
    let (prefill_tp, decode_tp) = (problem.prefill.topology.tp, problem.decode.topology.tp);
    if prefill_tp > decode_tp {
        // Every prefill rank the decode rank contacts writes all the heads it holds, replicas included.
        let contacted = prefill_tp / decode_tp;
        (0..contacted)
            .map(|w| {
                let rank = target.tp * contacted + w;
                let (first, count) = rank_heads(kv_heads, prefill_tp, rank);
                (rank, first, count)
            })
            .collect()
    } else {
        // The one prefill rank it contacts writes the decode rank's heads.
        let (first, count) = rank_heads(kv_heads, decode_tp, target.tp);
        vec![(target.tp / (decode_tp / prefill_tp), first, count)]
    }
}

/// Bytes of each chunk image of `request` on `target`, chunk by chunk: `(offset, length)` in the ring.
fn images(problem: &Problem, target: RankId, request: &Request) -> Vec<(u64, u64)> {
    let Attention::Mha { kv_heads, .. } = problem.model.attention else { return Vec::new() };
    let found = writers(problem, target, kv_heads);
    let row = u64::from(found.first().map_or(0, |writer| writer.2)) * problem.model.head_len();
    let slots = problem.decode.rank(target).kv_entries.len() as u64;
    let page = problem.prefill.topology.page_size;
    (request.chunks.iter().zip(&request.staging_offsets))
        .map(|(tokens, offset)| {
            let tokens = u64::from(tokens.div_ceil(page) * page);
            (*offset, found.len() as u64 * tokens * row * slots)
        })
        .collect()
}

/// The ring bytes a request's images span (a failed request may leave bytes there).
pub(super) fn territory(problem: &Problem, target: RankId, request: &Request) -> Vec<(u64, u64)> {
    images(problem, target, request).into_iter().map(|(offset, length)| (offset, offset + length)).collect()
}

/// Every piece of `target`'s ring: per request, chunk, writer, slot and page, the page's rows of the writer's heads.
pub(super) fn pieces(problem: &Problem, target: RankId) -> Vec<Piece> {
    let Attention::Mha { kv_heads, .. } = problem.model.attention else { return Vec::new() };
    if !in_use(problem) {
        return Vec::new();
    }
    let head_len = problem.model.head_len();
    let prefill_tp = problem.prefill.topology.tp;
    let found = writers(problem, target, kv_heads);
    let row = u64::from(found.first().map_or(0, |writer| writer.2)) * head_len;
    let layout = problem.decode.rank(target);
    let slots: Vec<&Region> = layout.kv_entries.iter().map(|index| &layout.regions[*index as usize]).collect();
    let page = problem.prefill.topology.page_size;
    let mut res = Vec::new();
    for group in prefill_groups(problem, target) {
        for request in received_from(problem, target, group) {
            let first_page = (request.decode_prefix / page) as usize;
            let mut start = first_page;
            for (tokens, (offset, _)) in request.chunks.iter().zip(images(problem, target, request)) {
                let pages = tokens.div_ceil(page) as usize;
                let slot_len = u64::from(page) * pages as u64 * row;
                for (w, (writer, first, _)) in found.iter().enumerate() {
                    let column = u64::from(first - rank_heads(kv_heads, prefill_tp, *writer).0) * head_len;
                    for (s, slot) in slots.iter().enumerate() {
                        let Some((source, source_region)) =
                            holder(problem, (group, 0, *writer), target, slot.kind, slot.layer, None)
                        else {
                            continue;
                        };
                        let source_len = problem.prefill.rank(source).regions[source_region as usize].row_len();
                        let image = offset + (w * slots.len() + s) as u64 * slot_len;
                        for ordinal in 0..pages {
                            let Some(source_page) = request.prefill_pages.get(start + ordinal) else { continue };
                            res.push(Piece {
                                request: request.id,
                                target_offset: image + (ordinal as u64) * u64::from(page) * row,
                                length: row,
                                source,
                                source_region,
                                source_offset: u64::from(*source_page) * u64::from(page) * source_len + column,
                                count: u64::from(page),
                                source_stride: source_len,
                            });
                        }
                    }
                }
                start += pages;
            }
        }
    }
    res
}
