//! `decode.hisparse` (SGLang 0.5.23 `--enable-hisparse` under PD disaggregation; research notes in
//! `tests/connectors/sglang/reading-0.5.23-hisparse.md`, rules in `src/pure/plan/SGLANG.md` "HiSparse"): which
//! deployments may use it, and the host page allocator.
//!
//! A HiSparse decode registers its pinned-host MLA pool as the KV destination (`decode.py:620-632`) and sends host
//! pages as `kv_indices` (`decode.py:1643-1658`); its draft entries stay device buffers at the logical pages
//! (`device_kv_indices`, `decode.py:1787-1806`); its DSA indexer keys keep their own state pages.

use super::Diagnostics;
use crate::limits::MAX_POOL_ITEMS;
use crate::model::{Attention, ModelGeometry, Request, StateKind, Topology};
use crate::scenario::raw::{RawRequest, RawSide};

/// The deployments SGLang starts HiSparse with, each refusal naming its field and SGLang's reason.
pub(super) fn check(
    (prefill, decode_side): (&RawSide, &RawSide),
    raw_requests: &[RawRequest],
    model: &ModelGeometry,
    decode: &Topology,
    diagnostics: &mut Diagnostics,
) {
    if prefill.hisparse.is_some() {
        // [I] SGLang does not refuse it, but such a prefill sends logical pages of a pool indexed by HiSparse device
        // ids (prefill.py:1733-1744, hisparse_memory_pool.py:110-130): another request's latent once the two
        // allocators diverge. kvrelay refuses what cannot be right.
        diagnostics.push(
            "prefill.hisparse",
            "HiSparse runs on the decode side only: a HiSparse prefill sends logical page ids of a pool indexed by HiSparse device ids (fix: remove prefill.hisparse)",
        );
    }
    for (index, request) in raw_requests.iter().enumerate() {
        if request.decode_host_pages.is_some() && decode_side.hisparse.is_none() {
            diagnostics.push(
                format!("requests[{index}].decode_host_pages"),
                "host pages are the destination of a HiSparse decode only (fix: add decode.hisparse: {host_pages: N}, or remove the list)",
            );
        }
    }
    let Some(hisparse) = decode_side.hisparse else { return };
    let dsa = model.state.iter().any(|component| component.kind == StateKind::Dsa);
    if !matches!(model.attention, Attention::Mla { .. }) || !dsa {
        // arg_groups/hisparse_hook.py:100-107: DSA models (and DeepSeek-V4, MiniMax M3, not modelled here).
        diagnostics.push(
            "decode.hisparse",
            "HiSparse needs an MLA model with a DSA indexer (SGLang: DeepSeek-V3.2, GLM-5; fix: model.preset deepseek-v3.2, or remove decode.hisparse)",
        );
    }
    if decode.dcp > 1 {
        // arg_groups/hicache_hook.py:152-156.
        diagnostics
            .push("decode.hisparse", "SGLang refuses HiSparse with decode context parallelism (fix: decode.dcp 1)");
    }
    if hisparse.host_pages == 0 || u64::from(hisparse.host_pages) > MAX_POOL_ITEMS {
        diagnostics.push_limit(
            "decode.hisparse.host_pages",
            format!(
                "{} host pages: from 1 to {MAX_POOL_ITEMS} (fix: the pages the requests need, or a few more)",
                hisparse.host_pages
            ),
        );
    }
    for (index, request) in raw_requests.iter().enumerate() {
        if request.decode_prefix != 0 {
            // decode.py:2321-2323 asserts prefix_len == 0 (HiSparse needs --disable-radix-cache on the decode).
            diagnostics.push(
                format!("requests[{index}].decode_prefix"),
                "a HiSparse decode holds no prefix (SGLang asserts prefix_len == 0; fix: decode_prefix 0)",
            );
        }
    }
}

/// Hands every request of a HiSparse decode its host pages: its own `decode_host_pages`, else the lowest free ones
/// in request order (the host pool's free list is `arange(size)`, taken from the front, `pool_host/base.py:503-577`;
/// page 0 is a real page). Returns the pool's page count; `None` without `decode.hisparse`.
pub(super) fn allocate(
    host_pages: Option<u32>,
    raw_requests: &[RawRequest],
    requests: &mut [Request],
    diagnostics: &mut Diagnostics,
) -> Option<u32> {
    let capacity = host_pages?;
    if capacity == 0 || u64::from(capacity) > MAX_POOL_ITEMS {
        return Some(capacity); // refused by `check`
    }
    let mut taken = vec![false; capacity as usize];
    for (index, request) in requests.iter_mut().enumerate() {
        let Some(pages) = &raw_requests[index].decode_host_pages else { continue };
        let field = format!("requests[{index}].decode_host_pages");
        if pages.len() != request.decode_pages.len() {
            diagnostics.push(
                field.clone(),
                format!(
                    "{} host pages given, the send range needs {} (fix: one host page per decode page)",
                    pages.len(),
                    request.decode_pages.len()
                ),
            );
        }
        for (position, page) in pages.iter().enumerate() {
            match taken.get_mut(*page as usize) {
                None => diagnostics.push(
                    format!("{field}[{position}]"),
                    format!("host page {page} is outside the {capacity}-page host pool (fix: raise decode.hisparse.host_pages)"),
                ),
                Some(true) => {
                    diagnostics.push(format!("{field}[{position}]"), format!("host page {page} is used twice"))
                }
                Some(slot) => *slot = true,
            }
        }
        request.decode_host_pages = pages.clone();
    }
    let mut free = (0..capacity).filter(|page| !taken[*page as usize]);
    for (index, request) in requests.iter_mut().enumerate() {
        if raw_requests[index].decode_host_pages.is_some() {
            continue;
        }
        let wanted = request.decode_pages.len();
        request.decode_host_pages = free.by_ref().take(wanted).collect();
        if request.decode_host_pages.len() < wanted {
            diagnostics.push(
                "decode.hisparse.host_pages",
                format!("{capacity} host pages are too few for the requests (fix: raise host_pages)"),
            );
            break;
        }
    }
    Some(capacity)
}
