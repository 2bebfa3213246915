//! DTO → model: validation with field paths, presets, and the seeded page allocator.

use std::collections::BTreeSet;

use super::raw::{RawExpect, RawModel, RawRequest, RawScenario, RawSide};
use super::{Diagnostic, Expectation};
use crate::model::{build_side_layout, ModelGeometry, Problem, Request, Side, SideOptions, Topology};
use crate::seed::{Seed, SimRng};

struct Diagnostics(Vec<Diagnostic>);

impl Diagnostics {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Diagnostic { line: None, path: path.into(), message: message.into() });
    }
}

pub(super) fn lower(raw: RawScenario, default_name: &str) -> Result<(Problem, Expectation), Vec<Diagnostic>> {
    let mut diagnostics = Diagnostics(Vec::new());
    let model = lower_model(&raw.model, &mut diagnostics);
    let prefill = lower_topology("prefill", &raw.prefill, &mut diagnostics);
    let decode = lower_topology("decode", &raw.decode, &mut diagnostics);
    let expect = match raw.expect {
        RawExpect::Word(word) if word == "ok" => Expectation::Ok,
        RawExpect::Word(word) => {
            diagnostics
                .push("expect", format!("unknown verdict `{word}` (fix: write `ok` or `{{error: \"message\"}}`)"));
            Expectation::Ok
        }
        RawExpect::Error { error } => Expectation::Error(error),
    };
    if raw.requests.is_empty() {
        diagnostics.push("requests", "no requests (fix: add at least one request)");
    }
    let (Some(model), Some(prefill), Some(decode)) = (model, prefill, decode) else {
        return Err(diagnostics.0);
    };
    for (side, raw_side) in [("prefill", &raw.prefill), ("decode", &raw.decode)] {
        for (index, layer) in raw_side.missing_layers.iter().enumerate() {
            if !model.mla_layers.contains(layer) {
                diagnostics.push(
                    format!("{side}.missing_layers[{index}]"),
                    format!("layer {layer} has no KV entry in this model (fix: name one of model.mla_layers)"),
                );
            }
        }
    }
    let mut requests = lower_requests(&raw.requests, &prefill, &decode, &mut diagnostics);
    if !diagnostics.0.is_empty() {
        return Err(diagnostics.0);
    }
    let seed = Seed(raw.seed.unwrap_or(1));
    let prefill_pages = allocate(Side::Prefill, &raw.prefill, &raw.requests, &mut requests, seed, &mut diagnostics);
    let decode_pages = allocate(Side::Decode, &raw.decode, &raw.requests, &mut requests, seed, &mut diagnostics);
    if !diagnostics.0.is_empty() {
        return Err(diagnostics.0);
    }
    let side = |side, topology, raw: &RawSide, page_count| {
        let options =
            SideOptions { advertise_layer_ids: raw.layer_ids, missing_layers: raw.missing_layers.clone(), page_count };
        build_side_layout(side, topology, &model, &options)
    };
    let problem = Problem {
        name: raw.name.unwrap_or_else(|| default_name.to_owned()),
        prefill: side(Side::Prefill, prefill, &raw.prefill, prefill_pages),
        decode: side(Side::Decode, decode, &raw.decode, decode_pages),
        model,
        requests,
    };
    Ok((problem, expect))
}

/// Known model shapes (domain.md §10); 0-based MLA layer ids.
fn preset(name: &str) -> Option<ModelGeometry> {
    let (layers, mla_layers, dtype_bytes): (u32, Vec<u32>, u32) = match name {
        // 24 MLA layers at 1-based 4, 8, ..., 92 and 93; fp8 latent as in the K3 shape test.
        "kimi-k3" => (93, (3..92).step_by(4).chain([92]).collect(), 1),
        "kimi-linear" => (27, vec![3, 7, 11, 15, 19, 23, 26], 2),
        "deepseek-v3" => (61, (0..61).collect(), 2),
        "deepseek-v2-lite" => (27, (0..27).collect(), 2),
        _ => return None,
    };
    Some(ModelGeometry {
        name: name.to_owned(),
        layer_count: layers,
        mla_layers,
        kv_lora_rank: 512,
        qk_rope_head_dim: 64,
        dtype_bytes,
    })
}

fn lower_model(raw: &RawModel, diagnostics: &mut Diagnostics) -> Option<ModelGeometry> {
    let base = match &raw.preset {
        Some(name) => match preset(name) {
            Some(model) => Some(model),
            None => {
                diagnostics.push(
                    "model.preset",
                    format!("unknown preset `{name}` (fix: use kimi-k3, kimi-linear, deepseek-v3 or deepseek-v2-lite, or give the dimensions)"),
                );
                return None;
            }
        },
        None => None,
    };
    let pick = |field: &str, value: Option<u32>, from_base: Option<u32>, diagnostics: &mut Diagnostics| {
        let res = value.or(from_base);
        match res {
            None => diagnostics.push(format!("model.{field}"), "missing (fix: give it or use a model.preset)"),
            Some(0) => diagnostics.push(format!("model.{field}"), "must be at least 1"),
            Some(_) => {}
        }
        res
    };
    let layers = pick("layers", raw.layers, base.as_ref().map(|model| model.layer_count), diagnostics);
    let kv_lora_rank =
        pick("kv_lora_rank", raw.kv_lora_rank, base.as_ref().map(|model| model.kv_lora_rank), diagnostics);
    let rope =
        pick("qk_rope_head_dim", raw.qk_rope_head_dim, base.as_ref().map(|model| model.qk_rope_head_dim), diagnostics);
    let dtype_bytes = pick("dtype_bytes", raw.dtype_bytes, base.as_ref().map(|model| model.dtype_bytes), diagnostics);
    let layers = layers?;
    let mla_layers = match (&raw.mla_layers, &base) {
        (Some(ids), _) => ids.clone(),
        (None, Some(base)) if raw.layers.is_none() => base.mla_layers.clone(),
        (None, _) => (0..layers).collect(),
    };
    let unique: BTreeSet<u32> = mla_layers.iter().copied().collect();
    if unique.len() != mla_layers.len() || mla_layers.windows(2).any(|pair| pair[0] > pair[1]) {
        diagnostics.push("model.mla_layers", "layer ids must be strictly increasing (fix: sort and deduplicate them)");
    }
    if let Some(layer) = mla_layers.iter().find(|layer| **layer >= layers) {
        diagnostics.push("model.mla_layers", format!("layer {layer} is not below model.layers = {layers}"));
    }
    if mla_layers.is_empty() {
        diagnostics.push("model.mla_layers", "no MLA layers (fix: list at least one)");
    }
    let token_len = u64::from(kv_lora_rank? + rope?) * u64::from(dtype_bytes?);
    if token_len % 8 != 0 {
        diagnostics.push("model", format!("token row of {token_len} B is not a multiple of 8 (fix: adjust kv_lora_rank, qk_rope_head_dim or dtype_bytes)"));
    }
    Some(ModelGeometry {
        name: raw.preset.clone().unwrap_or_else(|| "custom".to_owned()),
        layer_count: layers,
        mla_layers,
        kv_lora_rank: kv_lora_rank?,
        qk_rope_head_dim: rope?,
        dtype_bytes: dtype_bytes?,
    })
}

fn lower_topology(side: &str, raw: &RawSide, diagnostics: &mut Diagnostics) -> Option<Topology> {
    let mut ok = true;
    for (field, value) in [("tp", raw.tp), ("pp", raw.pp), ("dcp", raw.dcp), ("page_size", raw.page_size)] {
        if value == 0 {
            diagnostics.push(format!("{side}.{field}"), "must be at least 1");
            ok = false;
        }
    }
    ok.then_some(Topology { tp: raw.tp, pp: raw.pp, dcp: raw.dcp, page_size: raw.page_size })
}

fn lower_requests(
    raw: &[RawRequest],
    prefill: &Topology,
    decode: &Topology,
    diagnostics: &mut Diagnostics,
) -> Vec<Request> {
    let chunk_page = prefill.virtual_page_size();
    let mut requests = Vec::new();
    for (index, request) in raw.iter().enumerate() {
        let path = |field: &str| format!("requests[{index}].{field}");
        if request.tokens == 0 {
            diagnostics.push(path("tokens"), "must be at least 1");
            continue;
        }
        if request.decode_prefix >= request.tokens {
            diagnostics.push(
                path("decode_prefix"),
                format!(
                    "{} leaves nothing to send of {} tokens (fix: make it smaller than tokens)",
                    request.decode_prefix, request.tokens
                ),
            );
            continue;
        }
        let send_len = request.tokens - request.decode_prefix;
        let chunks = request.chunks.clone().unwrap_or_else(|| vec![send_len]);
        let total: u64 = chunks.iter().map(|it| u64::from(*it)).sum();
        if total != u64::from(send_len) {
            diagnostics.push(
                path("chunks"),
                format!(
                    "chunks sum to {total} but the send range holds {send_len} tokens (fix: tokens - decode_prefix)"
                ),
            );
        }
        if chunks.contains(&0) {
            diagnostics.push(path("chunks"), "empty chunk (fix: drop chunks of 0 tokens)");
        }
        if let Some(chunk) = chunks[..chunks.len().saturating_sub(1)].iter().find(|it| **it % chunk_page != 0) {
            diagnostics.push(
                path("chunks"),
                format!("non-last chunk of {chunk} tokens is not a multiple of the prefill page size {chunk_page} (domain.md §2.3)"),
            );
        }
        let prefill_count = request.tokens.div_ceil(chunk_page) as usize;
        if let Some(pages) = &request.prefill_pages {
            if pages.len() != prefill_count {
                diagnostics.push(
                    path("prefill_pages"),
                    format!("{} pages given, the {} tokens need {prefill_count} (fix: list one page per {chunk_page} tokens)", pages.len(), request.tokens),
                );
            }
        }
        let decode_count = request
            .decode_pages
            .as_ref()
            .map(Vec::len)
            .or(request.decode_page_count.map(|count| count as usize))
            .unwrap_or(send_len.div_ceil(decode.virtual_page_size()) as usize);
        requests.push(Request {
            id: index as u32,
            tokens: request.tokens,
            decode_prefix: request.decode_prefix,
            chunks,
            prefill_pages: request.prefill_pages.clone().unwrap_or_else(|| vec![0; prefill_count]),
            decode_pages: request.decode_pages.clone().unwrap_or_else(|| vec![0; decode_count]),
        });
    }
    requests
}

/// Hands out pages to every request that did not list its own: shuffled, so never contiguous by accident, and
/// never page 0 (the padding page, domain.md §1.2). Returns the pool capacity.
fn allocate(
    side: Side,
    raw: &RawSide,
    raw_requests: &[RawRequest],
    requests: &mut [Request],
    seed: Seed,
    diagnostics: &mut Diagnostics,
) -> u32 {
    let field = match side {
        Side::Prefill => "prefill_pages",
        Side::Decode => "decode_pages",
    };
    let explicit = |index: usize| match side {
        Side::Prefill => raw_requests[index].prefill_pages.is_some(),
        Side::Decode => raw_requests[index].decode_pages.is_some(),
    };
    fn pages_of(side: Side, request: &mut Request) -> &mut Vec<u32> {
        match side {
            Side::Prefill => &mut request.prefill_pages,
            Side::Decode => &mut request.decode_pages,
        }
    }
    let mut taken = BTreeSet::new();
    let mut needed = 0u64;
    for (index, request) in requests.iter_mut().enumerate() {
        let pages = pages_of(side, request);
        needed += pages.len() as u64;
        if !explicit(index) {
            continue;
        }
        for (position, page) in pages.iter().enumerate() {
            if *page == 0 {
                diagnostics.push(
                    format!("requests[{index}].{field}[{position}]"),
                    "page 0 is the padding page (fix: use pages from 1)",
                );
            } else if !taken.insert(*page) {
                diagnostics.push(
                    format!("requests[{index}].{field}[{position}]"),
                    format!("page {page} is used twice on the {side} side"),
                );
            }
        }
    }
    let highest = taken.last().copied().unwrap_or(0);
    let capacity = match raw.pool_pages {
        Some(pages) => pages,
        None => (2 * needed + 1).max(u64::from(highest) + 1).min(u64::from(u32::MAX)) as u32,
    };
    if highest >= capacity {
        diagnostics.push(
            format!("{side}.pool_pages"),
            format!("{capacity} pages cannot hold listed page {highest} (fix: raise pool_pages)"),
        );
        return capacity;
    }
    let mut free: Vec<u32> = (1..capacity).filter(|page| !taken.contains(page)).collect();
    SimRng::stream(seed, &format!("pages.{side}")).shuffle(&mut free);
    let mut free = free.into_iter();
    for (index, request) in requests.iter_mut().enumerate() {
        if explicit(index) {
            continue;
        }
        for page in pages_of(side, request).iter_mut() {
            match free.next() {
                Some(next) => *page = next,
                None => {
                    diagnostics.push(
                        format!("{side}.pool_pages"),
                        format!("{capacity} pages are too few for the requests (fix: raise pool_pages)"),
                    );
                    return capacity;
                }
            }
        }
    }
    capacity
}

/// Best-effort line of a field path like `requests[1].chunks` in the YAML text.
pub(super) fn locate(text: &str, path: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let mut start = 0;
    let mut found = None;
    for segment in path.split('.').filter(|it| !it.is_empty()) {
        let (key, indices) = match segment.find('[') {
            Some(at) => (&segment[..at], &segment[at..]),
            None => (segment, ""),
        };
        let Some(line) = (start..lines.len()).find(|index| {
            let trimmed = lines[*index].trim_start().trim_start_matches("- ");
            trimmed.starts_with(&format!("{key}:"))
        }) else {
            break;
        };
        found = Some(line);
        start = line + 1;
        for index in indices.split(']').filter_map(|it| it.strip_prefix('[')) {
            let Some(item) = nth_item(&lines, start, index.parse().ok()) else {
                return found.map(|line| line + 1);
            };
            found = Some(item);
            start = item;
        }
    }
    found.map(|line| line + 1)
}

/// The line of the `wanted`-th block-list item at or after `start` (inline `[..]` lists have none).
fn nth_item(lines: &[&str], start: usize, wanted: Option<usize>) -> Option<usize> {
    let indent = |line: &str| line.len() - line.trim_start().len();
    let items: Vec<usize> = (start..lines.len()).filter(|it| lines[*it].trim_start().starts_with("- ")).collect();
    let first = indent(lines[*items.first()?]);
    items.into_iter().filter(|it| indent(lines[*it]) == first).nth(wanted?)
}
