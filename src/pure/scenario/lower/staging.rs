//! `prefill.staging` and `decode.staging` (SGLang 0.5.23 `SGLANG_DISAGG_STAGING_BUFFER`; research notes in
//! `tests/connectors/sglang/reading-0.5.23-staging.md`, rules in `src/pure/plan/SGLANG.md` "Staging buffer"): which
//! deployments may use it, the decode's ring, and each chunk's allocation in it.

use super::Diagnostics;
use crate::limits::{MAX_ITEM_BYTES, MAX_POOL_ITEMS};
use crate::model::{Attention, ModelGeometry, Request, SideLayout, StagingShape, Topology};
use crate::scenario::raw::RawSide;

/// `chunked_prefill_size` when the prefill names none (SGLang's default, `staging_buffer.py:860-864`).
const DEFAULT_CHUNKED_PREFILL: u32 = 8192;

/// Whether the staging path is in use: both sides set it, the pool is MHA/GQA and the attention-TP sizes differ
/// (`mooncake/conn.py:2707-2727`, `nixl/conn.py:1722-1733`; the decode registers a ring only then,
/// `common/conn.py:2557-2561`).
fn active(prefill_side: &RawSide, decode_side: &RawSide, model: &ModelGeometry, tps: (u32, u32)) -> bool {
    prefill_side.staging.is_some()
        && decode_side.staging.is_some()
        && matches!(model.attention, Attention::Mha { .. })
        && tps.0 != tps.1
}

/// Checks the fields, and sets the prefill's grid chunk when staging is in use. Returns the decode's ring as
/// `(rows, bytes per row)` when it registers one.
pub(super) fn check(
    (prefill_side, decode_side): (&RawSide, &RawSide),
    model: &ModelGeometry,
    (prefill, decode): (&mut Topology, &Topology),
    diagnostics: &mut Diagnostics,
) -> Option<(u64, u64)> {
    if prefill_side.staging.is_some_and(|staging| staging.ring_bytes.is_some()) {
        diagnostics.push(
            "prefill.staging.ring_bytes",
            "the staging ring is the decode's (fix: give ring_bytes under decode.staging)",
        );
    }
    if decode_side.staging.is_some_and(|staging| staging.chunk_pages.is_some()) {
        diagnostics.push(
            "decode.staging.chunk_pages",
            "the grid chunk is the prefill's (fix: give chunk_pages under prefill.staging)",
        );
    }
    let Some(decode_staging) = decode_side.staging else {
        if prefill_side.staging.is_some() {
            // [I] SGLang's Mooncake prefill then asks a decode without a staging handler for ring space, which kills
            // the decode's listener thread (`mooncake/conn.py:659-671`, `common/staging_handler.py:933-936`).
            diagnostics.push("prefill.staging", "the decode sets no staging: SGLang's Mooncake prefill would still ask it for ring space and kill its listener thread (fix: decode.staging: {ring_bytes: N}, or remove prefill.staging)");
        }
        return None;
    };
    let Some(ring_bytes) = decode_staging.ring_bytes else {
        diagnostics
            .push("decode.staging.ring_bytes", "missing: the bytes of each decode rank's ring (fix: ring_bytes: N)");
        return None;
    };
    if prefill_side.staging.is_some() && matches!(model.attention, Attention::Mla { .. }) {
        // prefill.py:218-223, decode.py:452-456.
        diagnostics.push(
            "prefill.staging",
            "SGLang refuses the staging buffer for MLA (fix: remove staging, or an MHA/GQA model)",
        );
        return None;
    }
    let Attention::Mha { kv_heads, .. } = model.attention else { return None };
    if prefill.tp == decode.tp {
        // No ring: the decode registers one only under an attention-TP change.
        return None;
    }
    let shape = StagingShape::new(kv_heads, model.head_len(), prefill.tp, decode.tp);
    let row = shape.row_len();
    if row == 0 {
        return None; // zero-width heads are refused with the model
    }
    if ring_bytes == 0 || ring_bytes > MAX_ITEM_BYTES || ring_bytes % row != 0 || ring_bytes / row > MAX_POOL_ITEMS {
        diagnostics.push_limit(
            "decode.staging.ring_bytes",
            format!("{ring_bytes} bytes: a whole number of {row}-byte ring rows (one writer's heads of one token), at most {MAX_ITEM_BYTES} bytes and {MAX_POOL_ITEMS} rows (fix: a multiple of {row})"),
        );
        return None;
    }
    let ring = Some((ring_bytes / row, row));
    let Some(prefill_staging) = prefill_side.staging else { return ring };
    if !active(prefill_side, decode_side, model, (prefill.tp, decode.tp)) {
        return ring;
    }
    let chunk_pages =
        prefill_staging.chunk_pages.unwrap_or((DEFAULT_CHUNKED_PREFILL / prefill.page_size.max(1)).max(1));
    if chunk_pages == 0 || u64::from(chunk_pages) > MAX_POOL_ITEMS {
        diagnostics.push("prefill.staging.chunk_pages", format!("{chunk_pages} pages: from 1 to {MAX_POOL_ITEMS}"));
    }
    // [I] What SGLang 0.5.23 does wrong or kvrelay does not model, refused by field (SGLANG.md "Staging buffer").
    if prefill.pp > 1 {
        diagnostics.push("prefill.staging", "staging under prefill PP pairs ring slots by layer id, which plain MHA pools do not publish (the Mooncake worker dies; not modelled; fix: prefill.pp 1)");
    }
    if prefill.cp > 1 && prefill.all_cp {
        diagnostics.push("prefill.staging", "with all-CP transfer every CP rank writes the same image region and later CP blocks are never scattered (SGLang 0.5.23, silent; fix: all_cp_ranks_transfer false)");
    }
    if model.draft.is_some() && (prefill_side.draft || decode_side.draft) {
        diagnostics.push("model.draft", "staging with draft KV is not modelled (SGLang lays the image out with each side's own buffer count and entry 0's head geometry; fix: draft: false on both sides)");
    }
    if !prefill_side.missing_layers.is_empty() || !decode_side.missing_layers.is_empty() {
        diagnostics.push("decode.staging", "staging with missing layers is not modelled: the two sides would count different slots (fix: no missing_layers)");
    }
    prefill.staging_chunk_pages = chunk_pages;
    ring
}

/// Each request's chunks must be grid chunks: `F` pages each but the last, which holds at most `F`
/// (`prefill.py:1544-1556` cuts sends on that grid; `compute_grid_segments`, `staging_buffer.py:867-883`).
pub(super) fn check_grid(prefill: &Topology, requests: &[Request], diagnostics: &mut Diagnostics) {
    let grid = prefill.staging_chunk_pages;
    if grid == 0 {
        return;
    }
    let page = u64::from(prefill.page_size.max(1));
    let grid_tokens = u64::from(grid) * page;
    for request in requests {
        let Some((last, rest)) = request.chunks.split_last() else { continue };
        if rest.iter().any(|tokens| u64::from(*tokens) != grid_tokens)
            || u64::from(*last).div_ceil(page) > u64::from(grid)
        {
            diagnostics.push(
                format!("requests[{}].chunks", request.id),
                format!("{:?}: with staging every chunk but the last is one grid chunk of {grid} pages ({grid_tokens} tokens), the last at most that (fix: chunks of {grid_tokens} tokens, or prefill.staging.chunk_pages)", request.chunks),
            );
        }
    }
}

/// Allocates every chunk's image in the rings of the decode DP group the request goes to, in request order: each
/// image right after the previous one, as SGLang's allocator does while nothing is freed (`staging_buffer.py:300-319`).
/// [I] kvrelay does not model the ring's wrap-around and watermarks: every image must fit at once.
pub(super) fn allocate(
    model: &ModelGeometry,
    (prefill, decode): (&Topology, &SideLayout),
    ring_bytes: u64,
    requests: &mut [Request],
    diagnostics: &mut Diagnostics,
) {
    let Attention::Mha { kv_heads, .. } = model.attention else { return };
    if prefill.staging_chunk_pages == 0 {
        return;
    }
    let shape = StagingShape::new(kv_heads, model.head_len(), prefill.tp, decode.topology.tp);
    let slots = decode.ranks.first().map_or(0, |layout| layout.kv_entries.len()) as u64;
    let page = u64::from(prefill.page_size);
    let mut heads = vec![0u64; decode.topology.dp as usize];
    for request in requests.iter_mut() {
        let Some(head) = heads.get_mut(request.decode_dp as usize) else { continue };
        request.staging_offsets = request
            .chunks
            .iter()
            .map(|tokens| {
                let offset = *head;
                *head = head.saturating_add(shape.image_len(u64::from(*tokens).div_ceil(page) * page, slots));
                offset
            })
            .collect();
    }
    if let Some(needed) = heads.into_iter().max().filter(|needed| *needed > ring_bytes) {
        diagnostics.push(
            "decode.staging.ring_bytes",
            format!("{ring_bytes} bytes cannot hold every chunk image at once ({needed} bytes); kvrelay does not model the ring's wrap-around and watermarks (fix: ring_bytes: {needed} or more)"),
        );
    }
}
