//! DTO → model: validation with field paths, presets, and the seeded page allocator.

use std::collections::{BTreeMap, BTreeSet};

use super::raw::{RawComponent, RawExpect, RawModel, RawRequest, RawScenario, RawSide};
use super::{Diagnostic, Expectation, ExpectedError, ScenarioErrorKind};
use crate::limits::{
    MAX_AUX_BUFFERS, MAX_CHUNKS, MAX_COMPONENTS, MAX_DIAGNOSTICS, MAX_DRAFT_ENTRIES, MAX_DTYPE_BYTES, MAX_GROUPS,
    MAX_ITEM_BYTES, MAX_KV_HEADS, MAX_LAYERS, MAX_PAGE_SIZE, MAX_POOL_ITEMS, MAX_PP, MAX_RANKS, MAX_REGIONS,
    MAX_REQUESTS, MAX_TENSORS, MAX_TP, MAX_WIDTH,
};
use crate::model::{
    build_side_layout, partition_layers, Advertise, Attention, DraftGeometry, DraftRows, MetadataOverride,
    ModelGeometry, PoolKind, Problem, Request, Side, SideOptions, StateComponent, StateIndices, StateKind, StateTensor,
    TensorShape, Topology,
};
use crate::plan::PlanErrorKind;
use crate::seed::Seed;
use rand::seq::SliceRandom as _;

mod hisparse;
mod staging;

/// The first [`MAX_DIAGNOSTICS`] diagnostics, and a count of the rest (an aliased list can repeat one mistake
/// half a million times).
struct Diagnostics {
    kept: Vec<Diagnostic>,
    omitted: usize,
}

impl Diagnostics {
    /// A value the loader refuses.
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.push_kind(ScenarioErrorKind::InvalidValue, path, message);
    }

    /// A count or size past a limit of `src/pure/limits.rs`.
    fn push_limit(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.push_kind(ScenarioErrorKind::TooLarge, path, message);
    }

    fn push_kind(&mut self, kind: ScenarioErrorKind, path: impl Into<String>, message: impl Into<String>) {
        if self.kept.len() < MAX_DIAGNOSTICS {
            let (path, message) = (path.into(), message.into());
            self.kept.push(Diagnostic { line: None, column: None, path, message, kind });
        } else {
            self.omitted += 1;
        }
    }

    fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// Diagnostics so far, kept or not: compare two counts to see whether a check found anything.
    fn count(&self) -> usize {
        self.kept.len() + self.omitted
    }

    fn into_error(self) -> (Vec<Diagnostic>, usize) {
        (self.kept, self.omitted)
    }
}

/// The `expect` section: `ok`, or a rejection whose kind must be one of [`PlanErrorKind`]'s names.
fn lower_expect(raw: RawExpect, diagnostics: &mut Diagnostics) -> Expectation {
    let (error, text, ranks, requests) = match raw {
        RawExpect::Word(word) if word == "ok" => return Expectation::Ok,
        RawExpect::Word(word) => {
            let fix = "fix: write `ok` or `{error: KIND}`, optionally with `text: \"message\"`";
            diagnostics.push("expect", format!("unknown verdict `{word}` ({fix})"));
            return Expectation::Ok;
        }
        RawExpect::Error { error, text, ranks, requests } => (error, text, ranks, requests),
    };
    let Some(kind) = PlanErrorKind::parse(&error) else {
        let hint = if error.contains(' ') { "; the exact message goes in `text:`" } else { "" };
        // Each name in backticks, so that clipping long echoed text never cuts the list.
        let kinds: Vec<String> = PlanErrorKind::ALL.iter().map(|kind| format!("`{kind}`")).collect();
        let message = format!("unknown error kind `{error}` (fix: one of {}{hint})", kinds.join(", "));
        diagnostics.push_kind(ScenarioErrorKind::UnknownErrorKind, "expect.error", message);
        return Expectation::Ok;
    };
    let error = ExpectedError { kind, text };
    match (ranks, requests) {
        (None, None) => Expectation::Error(error),
        (ranks, requests) => Expectation::Partial { error, ranks, requests },
    }
}

/// Why lowering failed: the kept diagnostics and how many more there were.
pub(super) type Failure = (Vec<Diagnostic>, usize);

pub(super) fn lower(raw: RawScenario, default_name: &str) -> Result<(Problem, Expectation), Failure> {
    let mut diagnostics = Diagnostics { kept: Vec::new(), omitted: 0 };
    let model = lower_model(&raw.model, &mut diagnostics);
    let prefill = lower_topology("prefill", &raw.prefill, &mut diagnostics);
    let decode = lower_topology("decode", &raw.decode, &mut diagnostics);
    let expect = lower_expect(raw.expect, &mut diagnostics);
    if !check_request_count(&raw.requests, &mut diagnostics) {
        return Err(diagnostics.into_error());
    }
    let (Some(model), Some(mut prefill), Some(mut decode)) = (model, prefill, decode) else {
        return Err(diagnostics.into_error());
    };
    all_cp_ranks_transfer(&model, &mut prefill, &mut decode, &mut diagnostics);
    check_missing_layers(&raw.prefill, &raw.decode, &model, &mut diagnostics);
    // The layer partition decides every stage's regions: nothing below is checked against a bad one.
    let before = diagnostics.count();
    for (side, raw_side, topology) in [("prefill", &raw.prefill, &prefill), ("decode", &raw.decode, &decode)] {
        check_partition(side, raw_side, topology, model.layer_count, &mut diagnostics);
    }
    if diagnostics.count() == before && prefill.pp == decode.pp {
        check_same_stages(&raw.prefill, &raw.decode, prefill.pp, model.layer_count, &mut diagnostics);
    }
    if diagnostics.count() != before {
        return Err(diagnostics.into_error());
    }
    check_divisibility(&model, &prefill, &decode, &mut diagnostics);
    if !check_regions(&raw.prefill, &raw.decode, &model, (&prefill, &decode), &mut diagnostics) {
        return Err(diagnostics.into_error());
    }
    for (side, raw_side) in [("prefill", &raw.prefill), ("decode", &raw.decode)] {
        check_side_references(side, raw_side, &model, &mut diagnostics);
    }
    check_state_layouts(&raw.prefill, &raw.decode, &model, &mut diagnostics);
    hisparse::check((&raw.prefill, &raw.decode), &raw.requests, &model, &decode, &mut diagnostics);
    let ring = staging::check((&raw.prefill, &raw.decode), &model, (&mut prefill, &decode), &mut diagnostics);
    let mut requests = lower_requests(&raw.requests, &model, &prefill, &decode, &mut diagnostics);
    staging::check_grid(&prefill, &requests, &mut diagnostics);
    if !diagnostics.is_empty() {
        return Err(diagnostics.into_error());
    }
    let seed = Seed(raw.seed.unwrap_or(1));
    let mut build = |side, raw_side: &RawSide, topology| {
        let mut options = side_options(side, raw_side, &model, &raw.requests, &mut requests, seed, &mut diagnostics);
        if side == Side::Decode {
            options.staging_ring = ring;
        }
        build_side_layout(side, topology, &model, &options)
    };
    let prefill_layout = build(Side::Prefill, &raw.prefill, prefill);
    let decode_layout = build(Side::Decode, &raw.decode, decode);
    if let Some((rows, row)) = ring {
        let sides = (&prefill_layout.topology, &decode_layout);
        staging::allocate(&model, sides, rows * row, &mut requests, &mut diagnostics);
    }
    if !diagnostics.is_empty() {
        return Err(diagnostics.into_error());
    }
    let advertise = lower_advertise(&raw.prefill, &raw.decode, &mut diagnostics);
    if !diagnostics.is_empty() {
        return Err(diagnostics.into_error());
    }
    let problem = Problem {
        name: raw.name.unwrap_or_else(|| default_name.to_owned()),
        prefill: prefill_layout,
        decode: decode_layout,
        model,
        requests,
        advertise,
        early_send: raw.prefill.early_send,
    };
    Ok((problem, expect))
}

/// Whether every prefill CP rank sends its block of pages (SGLang `common/conn.py:373-394`): the env, or prefill CP > 1
/// on a hybrid-MLA pool; the decode pulls from every CP rank with the env or a hybrid-MLA pool (`1496-1513`). [I] The
/// two must agree when prefill CP > 1: neither side publishes its choice, and SGLang then either never asks CP ranks
/// 1.. for their pages (the decode reports Success with those pages never written) or waits for statuses the dummy
/// CP ranks never send (src/pure/plan/SGLANG.md).
fn all_cp_ranks_transfer(
    model: &ModelGeometry,
    prefill: &mut Topology,
    decode: &mut Topology,
    diagnostics: &mut Diagnostics,
) {
    let hybrid_mla = model.pool_kind() == PoolKind::HybridMla;
    prefill.all_cp = prefill.all_cp || (prefill.cp > 1 && hybrid_mla);
    decode.all_cp = decode.all_cp || hybrid_mla;
    if prefill.cp > 1 && prefill.all_cp != decode.all_cp {
        let (sends, pulls) = (
            if prefill.all_cp {
                "every prefill CP rank sends its block of pages"
            } else {
                "only prefill CP rank 0 sends pages"
            },
            if decode.all_cp { "every CP rank" } else { "CP rank 0 only" },
        );
        let field = if prefill.all_cp { "decode" } else { "prefill" };
        diagnostics.push(
            format!("{field}.all_cp_ranks_transfer"),
            format!(
                "prefill CP{}: {sends}, but decode pulls from {pulls} (SGLang then \
                 loses pages or waits forever, neither side publishes the setting; fix: the same \
                 SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER on both sides)",
                prefill.cp
            ),
        );
    }
}

/// At least one request, and at most [`MAX_REQUESTS`]; `false` when there are too many to look at further.
fn check_request_count(requests: &[RawRequest], diagnostics: &mut Diagnostics) -> bool {
    if requests.is_empty() {
        diagnostics.push("requests", "no requests (fix: add at least one request)");
    }
    if requests.len() > MAX_REQUESTS {
        diagnostics.push_limit(
            "requests",
            format!("{} requests, more than the limit of {MAX_REQUESTS} (fix: fewer requests)", requests.len()),
        );
        return false;
    }
    true
}

/// Every `missing_layers` entry names a KV layer of the model.
fn check_missing_layers(prefill: &RawSide, decode: &RawSide, model: &ModelGeometry, diagnostics: &mut Diagnostics) {
    for (side, raw_side) in [("prefill", prefill), ("decode", decode)] {
        for (index, layer) in raw_side.missing_layers.iter().enumerate() {
            if !model.kv_layers.contains(layer) {
                diagnostics.push(
                    format!("{side}.missing_layers[{index}]"),
                    format!("layer {layer} has no KV entry in this model (fix: name one of model.kv_layers)"),
                );
            }
        }
    }
}

/// Both sides' sizes, and their region count within [`MAX_REGIONS`]; `false` when the count is over it.
fn check_regions(
    prefill: &RawSide,
    decode: &RawSide,
    model: &ModelGeometry,
    topologies: (&Topology, &Topology),
    diagnostics: &mut Diagnostics,
) -> bool {
    let mut regions = 0u64;
    for (side, raw_side, topology) in [("prefill", prefill, topologies.0), ("decode", decode, topologies.1)] {
        check_side_sizes(side, raw_side, model, topology, diagnostics);
        regions += region_count(model, topology, raw_side.pp_layer_partition.as_deref());
    }
    if regions > MAX_REGIONS {
        diagnostics.push_limit(
            "model",
            format!("both sides register {regions} regions (one per rank, layer and tensor), more than the limit of {MAX_REGIONS} (fix: fewer ranks or layers)"),
        );
        return false;
    }
    true
}

/// Overrides must name an existing component and an entry or tensor it can have; otherwise they would be silently
/// ignored.
fn check_side_references(side: &str, raw_side: &RawSide, model: &ModelGeometry, diagnostics: &mut Diagnostics) {
    if !raw_side.draft && model.draft.is_none() {
        diagnostics.push(
            format!("{side}.draft"),
            "the model has no draft entries to leave out (fix: drop `draft: false`, or give model.draft)",
        );
    }
    for (index, item) in raw_side.metadata_overrides.iter().enumerate() {
        let path = format!("{side}.metadata_overrides[{index}]");
        let Some(component) = state_component(model, item.component, &path, diagnostics) else { continue };
        let most = component.tensors.len() * component.layers.len();
        if item.entry as usize >= most {
            diagnostics.push(
                format!("{path}.entry"),
                format!(
                    "entry {} does not exist: component {} has at most {most} entries on a rank",
                    item.entry, item.component
                ),
            );
        }
    }
    for (index, item) in raw_side.state_item_lens.iter().enumerate() {
        let path = format!("{side}.state_item_lens[{index}]");
        // The length itself is checked with every other item length (`check_side_sizes`).
        let _ = state_tensor(model, (item.component, item.tensor), &path, diagnostics);
    }
}

/// `state_layouts` (both sides): each names a sliced Mamba tensor once per side, with an `outer` that transposes
/// the model's layout: the same bytes per channel (`outer x unit_bytes`), split into `outer` rows. [I] Only a
/// transposition is a layout kvrelay can judge element by element: across the model and both sides, the outer counts
/// above 1 must be one window (`[dim, taps]` with outer 1 against `[taps, dim]` with outer `taps`); a longer window
/// on one side changes the item length, which the planner refuses as differing unit sizes.
fn check_state_layouts(prefill: &RawSide, decode: &RawSide, model: &ModelGeometry, diagnostics: &mut Diagnostics) {
    let mut windows: BTreeMap<(u32, u32), Vec<(String, u32)>> = BTreeMap::new();
    for (side, raw_side) in [("prefill", prefill), ("decode", decode)] {
        for (index, item) in raw_side.state_layouts.iter().enumerate() {
            let path = format!("{side}.state_layouts[{index}]");
            let Some((component, tensor)) = state_tensor(model, (item.component, item.tensor), &path, diagnostics)
            else {
                continue;
            };
            let TensorShape::Sliced { unit_bytes, outer_count, .. } = &tensor.shape else {
                diagnostics.push(
                    format!("{path}.tensor"),
                    format!("tensor `{}` is not sliced (`item_len` alone): it has no channel axis to hold transposed (fix: name a tensor given with `dim` and `unit_bytes`)", tensor.name),
                );
                continue;
            };
            if component.kind != StateKind::Mamba {
                diagnostics.push(
                    format!("{path}.component"),
                    format!("component {} is {} state: only Mamba tensors have a conv layout to transpose (fix: a mamba component)", item.component, component.kind),
                );
                continue;
            }
            let channel = u64::from(*outer_count) * unit_bytes;
            if item.outer == 0 || item.outer > MAX_WIDTH || channel % u64::from(item.outer) != 0 {
                diagnostics.push(
                    format!("{path}.outer"),
                    format!("outer {} does not split the {channel} B each channel holds ({outer_count} x {unit_bytes} B) into equal rows (fix: 1 for channel-major, or the tap count for window-major)", item.outer),
                );
                continue;
            }
            let seen = windows.entry((item.component, item.tensor)).or_default();
            if seen.iter().any(|(other, _)| other.starts_with(side)) {
                diagnostics.push(
                    path.clone(),
                    format!(
                        "component {} tensor {} is named twice on the {side} side (fix: one entry per tensor)",
                        item.component, item.tensor
                    ),
                );
                continue;
            }
            if *outer_count > 1 && seen.is_empty() {
                seen.push(("model.state".to_owned(), *outer_count));
            }
            seen.push((format!("{path}.outer"), item.outer));
        }
    }
    for list in windows.values() {
        let mut windows = list.iter().filter(|(_, outer)| *outer > 1);
        let Some((first_path, first)) = windows.next() else { continue };
        if let Some((path, outer)) = windows.find(|(_, outer)| outer != first) {
            diagnostics.push(
                path.clone(),
                format!("outer {outer} and {first} ({first_path}) are not one layout transposed: a transposed tensor has rows of one window, or none (fix: 1 for channel-major, or {first})"),
            );
        }
    }
}

/// One side's layout options: runs its page, slot and state page allocators over `requests`, and carries the
/// file's advertising and override fields.
fn side_options(
    side: Side,
    raw_side: &RawSide,
    model: &ModelGeometry,
    raw_requests: &[RawRequest],
    requests: &mut [Request],
    seed: Seed,
    diagnostics: &mut Diagnostics,
) -> SideOptions {
    let page_count = allocate(side, raw_side, raw_requests, requests, seed, diagnostics);
    let slot_count = raw_side.slots.unwrap_or(requests.len() as u32 + 1);
    allocate_slots(side, slot_count, raw_requests, requests, seed, diagnostics);
    let state_page_counts = allocate_state_pages(side, model, requests, seed, diagnostics);
    let host_kv_pages = match side {
        Side::Decode => {
            hisparse::allocate(raw_side.hisparse.map(|h| h.host_pages), raw_requests, requests, diagnostics)
        }
        Side::Prefill => None,
    };
    let overrides = raw_side
        .metadata_overrides
        .iter()
        .map(|item| MetadataOverride {
            component: item.component,
            entry: item.entry,
            conv_groups: item.groups.clone().map(Some),
            dim: item.dim,
        })
        .collect();
    SideOptions {
        advertise_layer_ids: raw_side.layer_ids,
        missing_layers: raw_side.missing_layers.clone(),
        page_count,
        slot_count,
        state_page_counts,
        metadata_components: raw_side.metadata_components,
        overrides,
        item_len_overrides: raw_side
            .state_item_lens
            .iter()
            .map(|item| (item.component, item.tensor, item.item_len))
            .collect(),
        draft_paged_physically: raw_side.draft_paged_physically,
        state_outers: raw_side.state_layouts.iter().map(|item| (item.component, item.tensor, item.outer)).collect(),
        kv_token_len: raw_side.kv_token_len,
        layer_partition: raw_side.pp_layer_partition.clone(),
        register_draft: raw_side.draft,
        host_kv_pages,
        staging_ring: None,
    }
}

/// [I] Equal PP sizes pair decode stage s with prefill stage s (domain.md §3.1), so both must hold the same layers.
/// Neither peer can see the other's partition on the wire (SGLang never publishes it): upstream, a decode stage
/// holding layers its prefill stage lacks reports success with those layers never written. kvrelay refuses the
/// scenario instead of modelling a deployment that cannot be right.
fn check_same_stages(prefill: &RawSide, decode: &RawSide, pp: u32, layers: u32, diagnostics: &mut Diagnostics) {
    let (source, target) = (prefill.pp_layer_partition.as_deref(), decode.pp_layer_partition.as_deref());
    let stages = (0..pp)
        .map(|stage| (stage, partition_layers(layers, pp, source, stage), partition_layers(layers, pp, target, stage)));
    if let Some((stage, held, wanted)) = stages.into_iter().find(|(_, held, wanted)| held != wanted) {
        diagnostics.push(
            "decode.pp_layer_partition",
            format!(
                "decode stage {stage} holds layers {}..{} but prefill stage {stage} holds {}..{}: unwritten layers (fix: the same SGLANG_PP_LAYER_PARTITION on both sides)",
                wanted.start, wanted.end, held.start, held.end
            ),
        );
    }
}

/// `pp_layer_partition` (`SGLANG_PP_LAYER_PARTITION`, SGLang 0.5.23 `distributed/utils.py:110-148`): one layer count
/// per stage, summing to the model's layers. [I] A stage of 0 layers, which SGLang accepts without a word, is refused:
/// such a stage registers nothing and its ranks would serve no layer.
fn check_partition(side: &str, raw: &RawSide, topology: &Topology, layers: u32, diagnostics: &mut Diagnostics) {
    let Some(partition) = &raw.pp_layer_partition else { return };
    let path = format!("{side}.pp_layer_partition");
    if partition.len() != topology.pp as usize {
        diagnostics.push(
            path,
            format!(
                "{} entries for pp {} (SGLang: len(partitions)={} does not match pp_size={}; fix: one layer count per stage)",
                partition.len(),
                topology.pp,
                partition.len(),
                topology.pp
            ),
        );
        return;
    }
    if let Some(stage) = partition.iter().position(|count| *count == 0) {
        diagnostics.push(
            format!("{path}[{stage}]"),
            "a stage of 0 layers (SGLang accepts it and builds an empty stage; fix: at least 1 layer per stage)",
        );
        return;
    }
    let sum: u64 = partition.iter().map(|count| u64::from(*count)).sum();
    if sum != u64::from(layers) {
        diagnostics.push(
            path,
            format!(
                "sums to {sum}, not the model's {layers} layers (SGLang: sum(partitions)={sum} does not match num_hidden_layers={layers}; fix: counts summing to {layers})"
            ),
        );
    }
}

/// Byte sizes one side registers: every KV, draft and state item within [`MAX_ITEM_BYTES`], `kv_token_len` able
/// to hold the model's token row (domain.md §1.1; a narrower row cannot hold a token), override widths bounded.
fn check_side_sizes(
    side: &str,
    raw: &RawSide,
    model: &ModelGeometry,
    topology: &Topology,
    diagnostics: &mut Diagnostics,
) {
    let own_row = model.token_len(topology.tp);
    let token_len = match raw.kv_token_len {
        Some(len) if len > MAX_ITEM_BYTES => {
            diagnostics.push_limit(
                format!("{side}.kv_token_len"),
                format!("{len} B is more than the limit of {MAX_ITEM_BYTES} B per item (fix: the real size of one row or item)"),
            );
            return;
        }
        Some(len) if len < own_row || len % 8 != 0 => {
            diagnostics.push(
                format!("{side}.kv_token_len"),
                format!(
                    "{len} B cannot hold the model's token row of {own_row} B on a {side} rank (fix: a multiple of 8 of at least {own_row}, or change the model's widths)"
                ),
            );
            return;
        }
        Some(len) => len,
        None => own_row,
    };
    // Saturating: a product past u64 is over the limit all the same.
    let page = u64::from(topology.page_size);
    let mut items = vec![("kv_token_len", page.saturating_mul(token_len), "page_size x token row")];
    if let Some(draft) = model.draft {
        let rows = u64::from(topology.virtual_page_size());
        items.push((
            "page_size",
            rows.saturating_mul(draft.token_len(topology.tp)),
            "page_size x dcp x draft token_len",
        ));
    }
    for (field, bytes, what) in items {
        if bytes > MAX_ITEM_BYTES {
            diagnostics.push_limit(
                format!("{side}.{field}"),
                format!("a page of {bytes} B ({what}) is more than the limit of {MAX_ITEM_BYTES} B per item (fix: a smaller page_size or narrower rows)"),
            );
        }
    }
    for (index, item) in raw.state_item_lens.iter().enumerate() {
        check_item_len(&format!("{side}.state_item_lens[{index}].item_len"), item.item_len, diagnostics);
    }
    for (index, item) in raw.metadata_overrides.iter().enumerate() {
        if item.groups.as_ref().is_some_and(|groups| groups.len() > MAX_GROUPS) {
            diagnostics.push_limit(
                format!("{side}.metadata_overrides[{index}].groups"),
                format!("more than the limit of {MAX_GROUPS} sub-blocks (fix: at most {MAX_GROUPS})"),
            );
        }
    }
}

/// Regions one side registers: per stage, its TP ranks times the KV, draft, state and aux entries of its layers.
fn region_count(model: &ModelGeometry, topology: &Topology, partition: Option<&[u32]>) -> u64 {
    let parts = if model.is_mla() { 1 } else { 2 };
    (0..topology.pp)
        .map(|stage| {
            let layers = partition_layers(model.layer_count, topology.pp, partition, stage);
            let in_stage = |ids: &[u32]| ids.iter().filter(|id| layers.contains(id)).count() as u64;
            let kv = parts * in_stage(&model.kv_layers);
            let draft =
                if stage == topology.pp - 1 { model.draft.map_or(0, |draft| u64::from(draft.entries)) } else { 0 };
            let state: u64 =
                model.state.iter().map(|component| component.tensors.len() as u64 * in_stage(&component.layers)).sum();
            u64::from(topology.tp) * (kv + draft + state + model.aux_item_lens.len() as u64)
        })
        .sum()
}

/// `decode.registration`: what decode ranks advertise; prefill ranks do not register.
fn lower_advertise(prefill: &RawSide, decode: &RawSide, diagnostics: &mut Diagnostics) -> Advertise {
    if decode.early_send {
        diagnostics.push("decode.early_send", "early send is a prefill option (fix: move it to prefill)");
    }
    if prefill.registration.is_some() {
        diagnostics.push("prefill.registration", "prefill ranks do not register with decode (fix: move it to decode)");
    }
    let Some(raw) = &decode.registration else { return Advertise::default() };
    let entry0_item_len_only = match raw.item_lens.as_deref() {
        None | Some("per_entry") => false,
        Some("entry0") => true,
        Some(other) => {
            diagnostics.push("decode.registration.item_lens", format!("unknown `{other}` (fix: per_entry or entry0)"));
            false
        }
    };
    let ranks = u64::from(decode.tp) * u64::from(decode.pp);
    if let Some(rank) = raw.ranks.iter().flatten().find(|rank| u64::from(**rank) >= ranks) {
        diagnostics.push(
            "decode.registration.ranks",
            format!(
                "decode rank {rank} does not exist: decode has {ranks} ranks (fix: stage-major indices below {ranks})"
            ),
        );
    }
    if raw.kv_item_len.is_some_and(|len| len > MAX_ITEM_BYTES) {
        diagnostics.push_limit(
            "decode.registration.kv_item_len",
            format!("more than the limit of {MAX_ITEM_BYTES} B per item"),
        );
    }
    Advertise { legacy: raw.legacy, entry0_item_len_only, kv_item_len: raw.kv_item_len, ranks: raw.ranks.clone() }
}

/// The state component `index` names, or a diagnostic at `path.component` saying it does not exist.
fn state_component<'a>(
    model: &'a ModelGeometry,
    index: u32,
    path: &str,
    diagnostics: &mut Diagnostics,
) -> Option<&'a StateComponent> {
    let component = model.state.get(index as usize);
    if component.is_none() {
        diagnostics.push(
            format!("{path}.component"),
            format!("component {index} does not exist: the model has {} state components", model.state.len()),
        );
    }
    component
}

/// Tensor `tensor` of state component `component`, or a diagnostic at `{path}.component` or `{path}.tensor`.
fn state_tensor<'a>(
    model: &'a ModelGeometry,
    (component, tensor): (u32, u32),
    path: &str,
    diagnostics: &mut Diagnostics,
) -> Option<(&'a StateComponent, &'a StateTensor)> {
    let found = state_component(model, component, path, diagnostics)?;
    let Some(held) = found.tensors.get(tensor as usize) else {
        diagnostics.push(
            format!("{path}.tensor"),
            format!("tensor {tensor} does not exist: component {component} has {} tensors", found.tensors.len()),
        );
        return None;
    };
    Some((found, held))
}

/// Every sliced state axis and sub-block must split evenly over both sides' TP (impossible topologies otherwise).
fn check_divisibility(model: &ModelGeometry, prefill: &Topology, decode: &Topology, diagnostics: &mut Diagnostics) {
    for (component_index, component) in model.state.iter().enumerate() {
        for (tensor_index, tensor) in component.tensors.iter().enumerate() {
            let TensorShape::Sliced { full_dim, groups, .. } = &tensor.shape else { continue };
            let path = format!("model.state[{component_index}].tensors[{tensor_index}]");
            for (side, tp) in [("prefill", prefill.tp), ("decode", decode.tp)] {
                if full_dim % tp != 0 {
                    diagnostics.push(format!("{path}.dim"), format!("{full_dim} does not split over {side} tp {tp}"));
                }
                if let Some(group) = groups.iter().flatten().find(|group| *group % tp != 0) {
                    diagnostics.push(
                        format!("{path}.groups"),
                        format!("sub-block of {group} does not split over {side} tp {tp}"),
                    );
                }
            }
        }
    }
    if let Attention::Mha { kv_heads, .. } = model.attention {
        for (side, tp) in [("prefill", prefill.tp), ("decode", decode.tp)] {
            if kv_heads % tp != 0 && tp % kv_heads != 0 {
                diagnostics.push(
                    "model.kv_heads",
                    format!("{kv_heads} KV heads do not shard or replicate over {side} tp {tp}"),
                );
            }
        }
    }
    if let Some((heads, _)) = model.draft.and_then(|draft| draft.sharded()) {
        for (side, tp) in [("prefill", prefill.tp), ("decode", decode.tp)] {
            if heads % tp != 0 && tp % heads != 0 {
                diagnostics.push(
                    "model.draft.heads",
                    format!("{heads} draft KV heads do not shard or replicate over {side} tp {tp} (fix: a head count that divides tp or that tp divides)"),
                );
            }
        }
    }
}

/// A Mamba/KDA/GDN component over `layers` with a conv tensor and a temporal (SSM) tensor (domain.md §5.2, §10).
fn linear_attention(layers: Vec<u32>, conv: (u32, u64, u32, Vec<u32>), heads: u32, head_bytes: u64) -> StateComponent {
    let (dim, unit_bytes, outer_count, groups) = conv;
    StateComponent {
        kind: StateKind::Mamba,
        window_pages: None,
        publishes_layer_ids: true,
        layers,
        tensors: vec![
            StateTensor {
                name: "conv".to_owned(),
                shape: TensorShape::Sliced { full_dim: dim, unit_bytes, outer_count, groups: Some(groups) },
            },
            StateTensor {
                name: "temporal".to_owned(),
                shape: TensorShape::Sliced { full_dim: heads, unit_bytes: head_bytes, outer_count: 1, groups: None },
            },
        ],
    }
}

fn complement(layers: u32, kv_layers: &[u32]) -> Vec<u32> {
    (0..layers).filter(|layer| !kv_layers.contains(layer)).collect()
}

/// The names `model.preset` takes, each a shape of [`preset`] (the scenario schema lists them).
pub(super) const PRESET_NAMES: [&str; 8] = [
    "kimi-k3",
    "kimi-linear",
    "qwen3-next",
    "deepseek-v3",
    "deepseek-v3.2",
    "deepseek-v2-lite",
    "llama-3-8b",
    "llama-3-70b",
];

/// The names `model.state[].kind` takes, and what each means.
pub(super) const STATE_KINDS: [(&str, StateKind); 4] =
    [("mamba", StateKind::Mamba), ("swa", StateKind::Swa), ("dsa", StateKind::Dsa), ("swa_ring", StateKind::SwaRing)];

/// `a, b, c or d`.
fn one_of(names: impl IntoIterator<Item = &'static str>) -> String {
    let names: Vec<&str> = names.into_iter().collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Known model shapes (domain.md §10); 0-based layer ids.
pub(super) fn preset(name: &str) -> Option<ModelGeometry> {
    let mla = Attention::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 };
    let base = |layers: u32, attention, kv_layers: Vec<u32>, dtype_bytes| ModelGeometry {
        name: name.to_owned(),
        layer_count: layers,
        attention,
        kv_layers,
        dtype_bytes,
        state: Vec::new(),
        aux_item_lens: Vec::new(),
        draft: None,
    };
    let model = match name {
        // 24 MLA layers at 1-based 4, 8, ..., 92 and 93 (fp8 latent as in the K3 shape test); 69 KDA layers with
        // 96 heads x 128: conv q=k=v=12288 channels in [K-1, dim] layout (3 rows, bf16), temporal 64 KiB per head.
        "kimi-k3" => {
            let kv: Vec<u32> = (3..92).step_by(4).chain([92]).collect();
            let kda = complement(93, &kv);
            ModelGeometry {
                state: vec![linear_attention(kda, (36864, 2, 3, vec![12288; 3]), 96, 65536)],
                ..base(93, mla, kv, 1)
            }
        }
        "kimi-linear" => {
            let kv = vec![3, 7, 11, 15, 19, 23, 26];
            let kda = complement(27, &kv);
            ModelGeometry {
                state: vec![linear_attention(kda, (12288, 2, 3, vec![4096; 3]), 32, 65536)],
                ..base(27, mla, kv, 2)
            }
        }
        // Every fourth layer is full attention (GQA, 2 KV heads x 256); GDN conv [dim, K-1] (8192 channels of
        // 3 x bf16 = 6 B, groups [2048, 2048, 4096]), temporal 32 value heads x 128 x 128 fp32.
        "qwen3-next" => {
            let kv: Vec<u32> = (3..48).step_by(4).collect();
            let gdn = complement(48, &kv);
            ModelGeometry {
                state: vec![linear_attention(gdn, (8192, 6, 1, vec![2048, 2048, 4096]), 32, 65536)],
                ..base(48, Attention::Mha { kv_heads: 2, head_dim: 256 }, kv, 2)
            }
        }
        "deepseek-v3" => base(61, mla, (0..61).collect(), 2),
        // DSA indexer keys: one 64-token page of 64 x 128 fp8 keys + 64 x 4 B scales per layer (domain.md §1.4).
        "deepseek-v3.2" => ModelGeometry {
            state: vec![StateComponent {
                kind: StateKind::Dsa,
                window_pages: None,
                publishes_layer_ids: true,
                layers: (0..61).collect(),
                tensors: vec![StateTensor {
                    name: "index_k".to_owned(),
                    shape: TensorShape::Replicated { item_len: 8448 },
                }],
            }],
            ..base(61, mla, (0..61).collect(), 1)
        },
        "deepseek-v2-lite" => base(27, mla, (0..27).collect(), 2),
        "llama-3-8b" => base(32, Attention::Mha { kv_heads: 8, head_dim: 128 }, (0..32).collect(), 2),
        "llama-3-70b" => base(80, Attention::Mha { kv_heads: 8, head_dim: 128 }, (0..80).collect(), 2),
        _ => return None,
    };
    Some(model)
}

fn lower_model(raw: &RawModel, diagnostics: &mut Diagnostics) -> Option<ModelGeometry> {
    let base = lower_preset(raw, diagnostics)?;
    let layers =
        bounded("model.layers", raw.layers.or(base.as_ref().map(|model| model.layer_count)), MAX_LAYERS, diagnostics);
    let dtype_bytes = bounded(
        "model.dtype_bytes",
        raw.dtype_bytes.or(base.as_ref().map(|model| model.dtype_bytes)),
        MAX_DTYPE_BYTES,
        diagnostics,
    );
    if !check_widths(raw, diagnostics) {
        return None;
    }
    let (Some(layers), Some(dtype_bytes)) = (layers, dtype_bytes) else { return None };
    let attention = lower_attention(raw, base.as_ref(), diagnostics)?;
    let kv_layers = match (&raw.kv_layers, &base) {
        (Some(ids), _) => ids.clone(),
        (None, Some(base)) if raw.layers.is_none() => base.kv_layers.clone(),
        (None, _) => (0..layers).collect(),
    };
    check_layer_list("model.kv_layers", &kv_layers, layers, diagnostics);
    if kv_layers.is_empty() {
        diagnostics.push("model.kv_layers", "no KV layers (fix: list at least one)");
    }
    let state = match (&raw.state, &base) {
        (Some(components), _) => lower_state(components, layers, &kv_layers, diagnostics),
        (None, Some(base)) if raw.layers.is_none() && raw.kv_layers.is_none() => base.state.clone(),
        (None, _) => Vec::new(),
    };
    let model = ModelGeometry {
        name: raw.preset.clone().unwrap_or_else(|| "custom".to_owned()),
        layer_count: layers,
        attention,
        kv_layers,
        dtype_bytes,
        state,
        aux_item_lens: lower_aux(raw, diagnostics),
        draft: lower_draft(raw, dtype_bytes, diagnostics),
    };
    if model.head_len() % 8 != 0 {
        diagnostics.push(
            "model",
            format!(
                "token rows of {} B per head are not a multiple of 8 (fix: adjust the widths or dtype_bytes)",
                model.head_len()
            ),
        );
    }
    Some(model)
}

/// The preset the model names, if any (`Some(None)`: none named); `None` after a diagnostic for an unknown one.
fn lower_preset(raw: &RawModel, diagnostics: &mut Diagnostics) -> Option<Option<ModelGeometry>> {
    let Some(name) = &raw.preset else { return Some(None) };
    let found = preset(name);
    if found.is_none() {
        diagnostics.push(
            "model.preset",
            format!("unknown preset `{name}` (fix: use {}, or give the dimensions)", one_of(PRESET_NAMES)),
        );
        return None;
    }
    Some(found)
}

/// The attention widths within their limits; `false` after the first one over.
fn check_widths(raw: &RawModel, diagnostics: &mut Diagnostics) -> bool {
    for (field, value, most) in [
        ("kv_heads", raw.kv_heads, MAX_KV_HEADS),
        ("head_dim", raw.head_dim, MAX_WIDTH),
        ("kv_lora_rank", raw.kv_lora_rank, MAX_WIDTH),
        ("qk_rope_head_dim", raw.qk_rope_head_dim, MAX_WIDTH),
    ] {
        if value.is_some_and(|value| value > most) {
            diagnostics.push_limit(
                format!("model.{field}"),
                format!("{} is more than the limit of {most} (fix: at most {most})", value.unwrap_or(0)),
            );
            return false;
        }
    }
    true
}

/// MHA or MLA from the widths given (or the preset's); `None` after a diagnostic when they mix or are missing.
fn lower_attention(raw: &RawModel, base: Option<&ModelGeometry>, diagnostics: &mut Diagnostics) -> Option<Attention> {
    let attention =
        match (raw.kv_heads, raw.head_dim, raw.kv_lora_rank, raw.qk_rope_head_dim, base.map(|model| model.attention)) {
            (Some(kv_heads), Some(head_dim), None, None, _) => Attention::Mha { kv_heads, head_dim },
            (None, None, Some(kv_lora_rank), Some(qk_rope_head_dim), _) => {
                Attention::Mla { kv_lora_rank, qk_rope_head_dim }
            }
            (None, None, None, None, Some(attention)) => attention,
            _ => {
                diagnostics.push(
                    "model",
                    "give either kv_heads and head_dim (MHA) or kv_lora_rank and qk_rope_head_dim (MLA), or a preset",
                );
                return None;
            }
        };
    match attention {
        Attention::Mha { kv_heads: 0, .. } | Attention::Mha { head_dim: 0, .. } => {
            diagnostics.push("model", "kv_heads and head_dim must be at least 1");
        }
        Attention::Mla { kv_lora_rank, qk_rope_head_dim } if kv_lora_rank + qk_rope_head_dim == 0 => {
            diagnostics.push("model", "an MLA token row needs kv_lora_rank + qk_rope_head_dim > 0");
        }
        _ => {}
    }
    Some(attention)
}

/// The draft geometry, checked against its limits: replicated rows (`token_len`) or a head-sharded draft (`heads`,
/// `head_dim`, `dtype_bytes` defaulting to the model's), never both.
fn lower_draft(raw: &RawModel, model_dtype: u32, diagnostics: &mut Diagnostics) -> Option<DraftGeometry> {
    let raw = raw.draft?;
    let rows = match (raw.token_len, raw.heads, raw.head_dim) {
        (Some(token_len), None, None) if raw.dtype_bytes.is_none() => {
            check_item_len("model.draft.token_len", token_len, diagnostics);
            DraftRows::Replicated { token_len }
        }
        (None, Some(heads), Some(head_dim)) => {
            let dtype = raw.dtype_bytes.unwrap_or(model_dtype);
            for (field, value, most) in [
                ("heads", heads, MAX_KV_HEADS),
                ("head_dim", head_dim, MAX_WIDTH),
                ("dtype_bytes", dtype, MAX_DTYPE_BYTES),
            ] {
                if value == 0 || value > most {
                    diagnostics.push_limit(
                        format!("model.draft.{field}"),
                        format!("{value} is outside 1..={most} (fix: the draft model's {field})"),
                    );
                    return None;
                }
            }
            let head_len = u64::from(head_dim) * u64::from(dtype);
            if head_len % 8 != 0 {
                diagnostics.push(
                    "model.draft.head_dim",
                    format!(
                        "draft heads of {head_len} B are not a multiple of 8 (fix: adjust head_dim or dtype_bytes)"
                    ),
                );
            }
            check_item_len("model.draft.heads", u64::from(heads) * head_len, diagnostics);
            DraftRows::Sharded { heads, head_len }
        }
        _ => {
            diagnostics.push(
                "model.draft",
                "give `token_len` alone (replicated rows: an MLA/MTP draft) or `heads` and `head_dim` (with optional `dtype_bytes`: an MHA/GQA draft sharded like the target's heads)",
            );
            return None;
        }
    };
    let draft = DraftGeometry { entries: raw.entries, rows };
    if draft.entries > MAX_DRAFT_ENTRIES {
        diagnostics.push_limit(
            "model.draft.entries",
            format!(
                "{} is more than the limit of {MAX_DRAFT_ENTRIES} (fix: at most {MAX_DRAFT_ENTRIES})",
                draft.entries
            ),
        );
    }
    Some(draft)
}

/// The aux buffers' row lengths, checked against their limits.
fn lower_aux(raw: &RawModel, diagnostics: &mut Diagnostics) -> Vec<u64> {
    let aux_item_lens = raw.aux.clone().unwrap_or_default();
    if aux_item_lens.len() > MAX_AUX_BUFFERS {
        diagnostics.push_limit(
            "model.aux",
            format!(
                "{} aux buffers, more than the limit of {MAX_AUX_BUFFERS} (fix: at most {MAX_AUX_BUFFERS})",
                aux_item_lens.len()
            ),
        );
    }
    for (index, len) in aux_item_lens.iter().enumerate().take(MAX_AUX_BUFFERS) {
        check_item_len(&format!("model.aux[{index}]"), *len, diagnostics);
    }
    aux_item_lens
}

/// `value` when it is given and within `1..=most`; `None` after a diagnostic.
fn bounded(path: &str, value: Option<u32>, most: u32, diagnostics: &mut Diagnostics) -> Option<u32> {
    match value {
        None => diagnostics.push(path, "missing (fix: give it or use a model.preset)"),
        Some(0) => diagnostics.push(path, "must be at least 1"),
        Some(value) if value > most => {
            diagnostics.push_limit(path, format!("{value} is more than the limit of {most} (fix: at most {most})"))
        }
        Some(value) => return Some(value),
    }
    None
}

/// An item or row length: a positive multiple of 8 (the pattern's word) and at most [`MAX_ITEM_BYTES`].
fn check_item_len(path: &str, len: u64, diagnostics: &mut Diagnostics) -> bool {
    if len == 0 || len % 8 != 0 {
        diagnostics.push(path, format!("{len} B is not a positive multiple of 8"));
    } else if len > MAX_ITEM_BYTES {
        diagnostics.push_limit(
            path,
            format!(
                "{len} B is more than the limit of {MAX_ITEM_BYTES} B per item (fix: the real size of one row or item)"
            ),
        );
    } else {
        return true;
    }
    false
}

fn check_layer_list(path: &str, ids: &[u32], layers: u32, diagnostics: &mut Diagnostics) {
    let unique: BTreeSet<u32> = ids.iter().copied().collect();
    if unique.len() != ids.len() || ids.windows(2).any(|pair| pair[0] > pair[1]) {
        diagnostics.push(path, "layer ids must be strictly increasing (fix: sort and deduplicate them)");
    }
    if let Some(layer) = ids.iter().find(|layer| **layer >= layers) {
        diagnostics.push(path, format!("layer {layer} is not below model.layers = {layers}"));
    }
}

fn lower_state(
    components: &[RawComponent],
    layers: u32,
    kv_layers: &[u32],
    diagnostics: &mut Diagnostics,
) -> Vec<StateComponent> {
    let mut res = Vec::new();
    if components.len() > MAX_COMPONENTS {
        diagnostics.push_limit(
            "model.state",
            format!(
                "{} state components, more than the limit of {MAX_COMPONENTS} (fix: at most {MAX_COMPONENTS})",
                components.len()
            ),
        );
        return res;
    }
    for (index, raw) in components.iter().enumerate() {
        let path = format!("model.state[{index}]");
        if raw.tensors.len() > MAX_TENSORS {
            diagnostics.push_limit(
                format!("{path}.tensors"),
                format!(
                    "{} tensors, more than the limit of {MAX_TENSORS} (fix: at most {MAX_TENSORS})",
                    raw.tensors.len()
                ),
            );
            continue;
        }
        let Some(kind) = STATE_KINDS.iter().find(|(name, _)| *name == raw.kind).map(|(_, kind)| *kind) else {
            let names = one_of(STATE_KINDS.map(|(name, _)| name));
            diagnostics.push(format!("{path}.kind"), format!("unknown state kind `{}` (fix: {names})", raw.kind));
            continue;
        };
        let component_layers = raw.layers.clone().unwrap_or_else(|| complement(layers, kv_layers));
        check_layer_list(&format!("{path}.layers"), &component_layers, layers, diagnostics);
        if raw.tensors.is_empty() {
            diagnostics.push(format!("{path}.tensors"), "a component needs at least one tensor");
        }
        let mut tensors = Vec::new();
        for (tensor_index, tensor) in raw.tensors.iter().enumerate() {
            let path = format!("{path}.tensors[{tensor_index}]");
            let shape = match (tensor.item_len, tensor.dim, tensor.unit_bytes) {
                (Some(item_len), None, None) if tensor.groups.is_none() && tensor.outer.is_none() => {
                    TensorShape::Replicated { item_len }
                }
                (None, Some(full_dim), Some(unit_bytes)) if kind == StateKind::Mamba => {
                    let outer_count = tensor.outer.unwrap_or(1);
                    if !check_sliced(&path, tensor.groups.as_deref(), (full_dim, unit_bytes, outer_count), diagnostics)
                    {
                        continue;
                    }
                    TensorShape::Sliced { full_dim, unit_bytes, outer_count, groups: tensor.groups.clone() }
                }
                _ => {
                    diagnostics.push(
                        path.clone(),
                        "give `item_len` alone (not sliceable) or, for mamba, `dim` and `unit_bytes` (with optional `outer`, `groups`)",
                    );
                    continue;
                }
            };
            let tensor = StateTensor { name: tensor.name.clone(), shape };
            // Within the limits checked above, the item on one rank (the largest) fits in u64.
            if check_item_len(&path, tensor.item_len(1), diagnostics) {
                tensors.push(tensor);
            }
        }
        if kind != StateKind::Mamba && raw.window_pages == Some(0) {
            diagnostics.push(format!("{path}.window_pages"), "must be at least 1");
        }
        res.push(StateComponent {
            kind,
            layers: component_layers,
            tensors,
            window_pages: raw.window_pages,
            publishes_layer_ids: raw.layer_ids,
        });
    }
    res
}

/// Bounds of a sliced Mamba tensor: widths, sub-blocks and the byte size of a whole item, checked before use.
fn check_sliced(path: &str, groups: Option<&[u32]>, shape: (u32, u64, u32), diagnostics: &mut Diagnostics) -> bool {
    let (full_dim, unit_bytes, outer_count) = shape;
    if full_dim == 0 || unit_bytes == 0 || outer_count == 0 {
        diagnostics.push(path, "dim, unit_bytes and outer must be at least 1");
        return false;
    }
    let item = u64::from(outer_count).checked_mul(u64::from(full_dim)).and_then(|units| units.checked_mul(unit_bytes));
    if full_dim > MAX_WIDTH || outer_count > MAX_WIDTH || item.is_none_or(|item| item > MAX_ITEM_BYTES) {
        diagnostics.push_limit(
            path,
            format!(
                "outer {outer_count} x dim {full_dim} x unit_bytes {unit_bytes} is more than the limit of {MAX_ITEM_BYTES} B per item (fix: the real shape of one request's state)"
            ),
        );
        return false;
    }
    let Some(groups) = groups else { return true };
    if groups.len() > MAX_GROUPS {
        diagnostics.push_limit(
            format!("{path}.groups"),
            format!("{} sub-blocks, more than the limit of {MAX_GROUPS} (fix: at most {MAX_GROUPS})", groups.len()),
        );
        return false;
    }
    let total: u64 = groups.iter().map(|group| u64::from(*group)).sum();
    if total != u64::from(full_dim) || groups.contains(&0) {
        diagnostics.push(
            format!("{path}.groups"),
            format!("sub-blocks sum to {total}, not dim {full_dim} (fix: positive widths that add up to dim)"),
        );
        return false;
    }
    true
}

fn lower_topology(side: &str, raw: &RawSide, diagnostics: &mut Diagnostics) -> Option<Topology> {
    let before = diagnostics.count();
    let bounds = [
        ("tp", raw.tp, MAX_TP),
        ("dp", raw.dp, MAX_TP),
        ("cp", raw.cp, MAX_TP),
        ("pp", raw.pp, MAX_PP),
        ("dcp", raw.dcp, MAX_TP),
        ("page_size", raw.page_size, MAX_PAGE_SIZE),
    ];
    for (field, value, most) in bounds {
        if value == 0 {
            diagnostics.push(format!("{side}.{field}"), "must be at least 1");
        } else if value > most {
            diagnostics.push_limit(
                format!("{side}.{field}"),
                format!("{value} is more than the limit of {most} (fix: at most {most})"),
            );
        }
    }
    // SGLang: `attn_tp_size = tp_size // attn_dp_size // attn_cp_size` (`runtime_context.py:73-76`).
    if raw.tp > 0 && raw.dp > 0 && raw.tp % raw.dp != 0 {
        diagnostics.push(
            format!("{side}.dp"),
            format!(
                "{} does not divide tp {} (each attention DP group holds tp / dp attention-TP ranks, SGLang \
                 runtime_context.py:73-76; fix: a divisor of tp)",
                raw.dp, raw.tp
            ),
        );
    }
    let dp_tp = if raw.dp > 0 && raw.tp % raw.dp == 0 { raw.tp / raw.dp } else { raw.tp };
    if dp_tp > 0 && raw.cp > 0 && dp_tp % raw.cp != 0 {
        diagnostics.push(
            format!("{side}.cp"),
            format!(
                "{} does not divide tp / dp = {dp_tp} (SGLang: attn_tp_size = tp_size // attn_dp_size // attn_cp_size, \
                 runtime_context.py:73-76; fix: a divisor of {dp_tp})",
                raw.cp
            ),
        );
    }
    // SGLang asserts it on the decode side (`common/conn.py:1493-1495`).
    if side == "decode" && raw.cp > 1 {
        diagnostics.push(
            format!("{side}.cp"),
            format!("Decode cp size ({}) should be equal to 1 (SGLang common/conn.py:1493; fix: leave it out)", raw.cp),
        );
    }
    if raw.cp > 1 && raw.dcp > 1 {
        diagnostics.push(
            format!("{side}.dcp"),
            "[I] DCP inside a CP rank is not modelled (fix: dcp 1 with cp > 1)".to_owned(),
        );
    }
    let attn_tp = if raw.cp > 0 && dp_tp % raw.cp == 0 { dp_tp / raw.cp } else { dp_tp };
    if attn_tp > 0 && raw.dcp > 0 && attn_tp % raw.dcp != 0 {
        let group =
            if raw.dp > 1 { format!("the attention TP size tp / dp = {attn_tp}") } else { format!("tp {attn_tp}") };
        diagnostics.push(
            format!("{side}.dcp"),
            format!(
                "{} does not divide {group} (DCP ranks are carved out of the TP group, domain.md §2.2; fix: a divisor of tp)",
                raw.dcp
            ),
        );
    }
    let ranks = u64::from(raw.tp) * u64::from(raw.pp);
    if raw.tp <= MAX_TP && raw.pp <= MAX_PP && ranks > u64::from(MAX_RANKS) {
        diagnostics.push_limit(
            format!("{side}.pp"),
            format!(
                "tp {} x pp {} = {ranks} ranks, more than the limit of {MAX_RANKS} (fix: fewer stages or a smaller tp)",
                raw.tp, raw.pp
            ),
        );
    }
    let ok = diagnostics.count() == before;
    let topology = Topology {
        tp: attn_tp,
        dp: raw.dp,
        cp: raw.cp,
        all_cp: raw.all_cp_ranks_transfer,
        pp: raw.pp,
        dcp: raw.dcp,
        page_size: raw.page_size,
        staging_chunk_pages: 0,
    };
    ok.then_some(topology)
}

fn lower_requests(
    raw: &[RawRequest],
    model: &ModelGeometry,
    prefill: &Topology,
    decode: &Topology,
    diagnostics: &mut Diagnostics,
) -> Vec<Request> {
    let chunk_page = prefill.virtual_page_size();
    let mut requests = Vec::new();
    let mut totals = Totals(vec![0; 3 + 2 * model.state.len()]);
    for (index, request) in raw.iter().enumerate() {
        let Some(send_len) = send_length(index, request, diagnostics) else { continue };
        let chunks = lower_chunks(index, request, send_len, chunk_page, diagnostics);
        let prefill_count = request.tokens.div_ceil(chunk_page) as usize;
        if let Some(pages) = &request.prefill_pages {
            if pages.len() != prefill_count {
                diagnostics.push(
                    format!("requests[{index}].prefill_pages"),
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
        let counts = state_page_counts(index, request, model, prefill, diagnostics);
        // Bound every list over all requests before allocating any (a typo must not allocate gigabytes).
        let mut wanted = vec![prefill_count as u64, decode_count as u64, chunks.len() as u64];
        wanted.extend(counts.iter().flat_map(|count| [u64::from(count.0), u64::from(count.1)]));
        if !totals.take(&wanted, index, diagnostics) {
            break;
        }
        let state = |side: usize| StateIndices {
            slot: 0,
            aux: 0,
            pages: counts.iter().map(|count| vec![0; if side == 0 { count.0 } else { count.1 } as usize]).collect(),
        };
        requests.push(Request {
            id: index as u32,
            tokens: request.tokens,
            decode_prefix: request.decode_prefix,
            chunks,
            prefill_pages: request.prefill_pages.clone().unwrap_or_else(|| vec![0; prefill_count]),
            decode_pages: request.decode_pages.clone().unwrap_or_else(|| vec![0; decode_count]),
            decode_host_pages: Vec::new(),
            staging_offsets: Vec::new(),
            prefill_state: state(0),
            decode_state: state(1),
            cached_prefix: request.cached_prefix.min(request.tokens),
            prefill_dp: dp_group(index, "prefill_dp", request.prefill_dp, prefill.dp, diagnostics),
            decode_dp: dp_group(index, "decode_dp", request.decode_dp, decode.dp, diagnostics),
        });
    }
    requests
}

/// The DP group of request `index` on one side: the given one, else SGLang's `bootstrap_room % dp` with the request's
/// index as its room (`decode.py:879-897`; [I] for decode, whose DP controller is a load balancer).
fn dp_group(index: usize, field: &str, given: Option<u32>, dp: u32, diagnostics: &mut Diagnostics) -> u32 {
    let Some(group) = given else { return index as u32 % dp };
    if group >= dp {
        let side = field.trim_end_matches("_dp");
        diagnostics.push(
            format!("requests[{index}].{field}"),
            format!("{group} is not a DP group of {side} dp {dp} (fix: a group below {dp}, or leave it out)"),
        );
        return 0;
    }
    group
}

/// The tokens request `index` sends (after its decode prefix); `None` after a diagnostic when there are none.
fn send_length(index: usize, request: &RawRequest, diagnostics: &mut Diagnostics) -> Option<u32> {
    if request.tokens == 0 {
        diagnostics.push(format!("requests[{index}].tokens"), "must be at least 1");
        return None;
    }
    if request.decode_prefix >= request.tokens {
        diagnostics.push(
            format!("requests[{index}].decode_prefix"),
            format!(
                "{} leaves nothing to send of {} tokens (fix: make it smaller than tokens)",
                request.decode_prefix, request.tokens
            ),
        );
        return None;
    }
    Some(request.tokens - request.decode_prefix)
}

/// The request's chunks (one of the whole send range by default): they cover the send range, none is empty, and
/// every one but the last is a whole number of prefill allocator pages.
fn lower_chunks(
    index: usize,
    request: &RawRequest,
    send_len: u32,
    chunk_page: u32,
    diagnostics: &mut Diagnostics,
) -> Vec<u32> {
    let path = format!("requests[{index}].chunks");
    let chunks = request.chunks.clone().unwrap_or_else(|| vec![send_len]);
    let total: u64 = chunks.iter().map(|it| u64::from(*it)).sum();
    if total != u64::from(send_len) {
        diagnostics.push(
            path.clone(),
            format!("chunks sum to {total} but the send range holds {send_len} tokens (fix: tokens - decode_prefix)"),
        );
    }
    if chunks.contains(&0) {
        diagnostics.push(path.clone(), "empty chunk (fix: drop chunks of 0 tokens)");
    }
    if let Some(chunk) = chunks[..chunks.len().saturating_sub(1)].iter().find(|it| **it % chunk_page != 0) {
        diagnostics.push(
            path,
            format!("non-last chunk of {chunk} tokens is not a multiple of the prefill allocator page V = page_size x dcp = {chunk_page} tokens (domain.md §2.3)"),
        );
    }
    chunks
}

/// Per state component, the (prefill, decode) page counts of request `index`: every page of the request, or only
/// its window (domain.md §8), unless the file skews them; Mamba keeps none.
fn state_page_counts(
    index: usize,
    request: &RawRequest,
    model: &ModelGeometry,
    prefill: &Topology,
    diagnostics: &mut Diagnostics,
) -> Vec<(u32, u32)> {
    let all_pages = request.tokens.div_ceil(prefill.page_size);
    let mut counts: Vec<(u32, u32)> = model
        .state
        .iter()
        .map(|component| match component.kind {
            StateKind::Mamba => (0, 0),
            _ => {
                let kept = component.window_pages.map_or(all_pages, |window| window.min(all_pages));
                (kept, kept)
            }
        })
        .collect();
    for (position, item) in request.state_pages.iter().enumerate() {
        match model.state.get(item.component as usize) {
            Some(component) if component.kind != StateKind::Mamba => {
                counts[item.component as usize] = (item.prefill, item.decode)
            }
            _ => diagnostics.push(
                format!("requests[{index}].state_pages[{position}].component"),
                format!(
                    "{} is not a paged state component (fix: name a swa, dsa or swa_ring component)",
                    item.component
                ),
            ),
        }
    }
    counts
}

/// Running totals over requests of: prefill pages, decode pages, chunks, then prefill and decode pages of each state
/// component.
struct Totals(Vec<u64>);

impl Totals {
    /// Adds one request's counts, or names the first list that would pass its limit and adds nothing.
    fn take(&mut self, wanted: &[u64], request: usize, diagnostics: &mut Diagnostics) -> bool {
        for (position, (total, count)) in self.0.iter().zip(wanted).enumerate() {
            let (most, what, field) = match position {
                0 => (MAX_POOL_ITEMS, "prefill pages", "tokens"),
                1 => (MAX_POOL_ITEMS, "decode pages", "decode_page_count"),
                2 => (MAX_CHUNKS, "chunks", "chunks"),
                _ => (MAX_POOL_ITEMS, "state pages", "state_pages"),
            };
            let sum = total + count;
            if sum > most {
                let who = match request {
                    0 => "needs".to_owned(),
                    1 => "with the request before it needs".to_owned(),
                    _ => format!("with the {request} requests before it needs"),
                };
                diagnostics.push_limit(
                    format!("requests[{request}].{field}"),
                    format!(
                        "{who} {sum} {what}, more than the limit of {most} (fix: fewer or shorter requests, or a larger page_size)"
                    ),
                );
                return false;
            }
        }
        for (total, count) in self.0.iter_mut().zip(wanted) {
            *total += count;
        }
        true
    }
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
        Some(pages) => u64::from(pages),
        None => (2 * needed + 1).max(u64::from(highest) + 1),
    };
    if capacity > MAX_POOL_ITEMS {
        diagnostics.push_limit(
            format!("{side}.pool_pages"),
            format!("a pool of {capacity} pages exceeds the in-memory fabric's limit of {MAX_POOL_ITEMS} (fix: fewer or shorter requests, or a smaller pool_pages)"),
        );
        return 0;
    }
    let capacity = capacity as u32;
    if highest >= capacity {
        diagnostics.push(
            format!("{side}.pool_pages"),
            format!("{capacity} pages cannot hold listed page {highest} (fix: raise pool_pages)"),
        );
        return capacity;
    }
    let mut free: Vec<u32> = (1..capacity).filter(|page| !taken.contains(page)).collect();
    free.shuffle(&mut seed.stream(&format!("pages.{side}")));
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

/// Hands every request a Mamba slot and an aux row on one side, shuffled from `1..slot_count`.
/// A request's own `slot` or `aux` index (`requests[i].slot.decode: 3`) replaces the allocator's; the allocator hands
/// the others what no request named, so that no two requests of a side share a slot or an aux row.
fn allocate_slots(
    side: Side,
    slot_count: u32,
    raw_requests: &[RawRequest],
    requests: &mut [Request],
    seed: Seed,
    diagnostics: &mut Diagnostics,
) {
    if slot_count <= requests.len() as u32 {
        diagnostics.push(
            format!("{side}.slots"),
            format!("{slot_count} slots cannot hold {} requests besides slot 0 (fix: raise slots)", requests.len()),
        );
        return;
    }
    if u64::from(slot_count) > MAX_POOL_ITEMS {
        diagnostics
            .push_limit(format!("{side}.slots"), format!("{slot_count} slots exceed the limit of {MAX_POOL_ITEMS}"));
        return;
    }
    for (stream, pick) in [("slots", 0), ("aux", 1)] {
        let field = if pick == 0 { "slot" } else { "aux" };
        let explicit: Vec<Option<u32>> = raw_requests
            .iter()
            .map(|raw| {
                let sides = if pick == 0 { raw.slot.as_ref() } else { raw.aux.as_ref() };
                sides.and_then(|sides| if side == Side::Prefill { sides.prefill } else { sides.decode })
            })
            .collect();
        let mut named = BTreeSet::new();
        for (index, given) in explicit.iter().enumerate() {
            let Some(given) = *given else { continue };
            let path = format!("requests[{index}].{field}.{side}");
            if given == 0 || given >= slot_count {
                diagnostics.push(
                    path,
                    format!("{field} {given} is outside 1..{slot_count} (fix: an index from 1, or raise {side}.slots)"),
                );
            } else if !named.insert(given) {
                diagnostics.push(path, format!("{field} {given} is named by two requests on the {side} side"));
            }
        }
        let mut free: Vec<u32> = (1..slot_count).filter(|index| !named.contains(index)).collect();
        free.shuffle(&mut seed.stream(&format!("{stream}.{side}")));
        let mut free = free.into_iter();
        let indices: Vec<u32> =
            explicit.iter().map(|given| given.unwrap_or_else(|| free.next().unwrap_or(0))).collect();
        for (request, index) in requests.iter_mut().zip(indices) {
            let state = match side {
                Side::Prefill => &mut request.prefill_state,
                Side::Decode => &mut request.decode_state,
            };
            if pick == 0 {
                state.slot = index;
            } else {
                state.aux = index;
            }
        }
    }
}

/// Hands out the state pages of every paged component on one side; returns each component's pool capacity.
fn allocate_state_pages(
    side: Side,
    model: &ModelGeometry,
    requests: &mut [Request],
    seed: Seed,
    diagnostics: &mut Diagnostics,
) -> Vec<u32> {
    let mut capacities = Vec::new();
    for (component, _) in model.state.iter().enumerate() {
        fn pages_of(side: Side, component: usize, request: &mut Request) -> &mut Vec<u32> {
            let state = match side {
                Side::Prefill => &mut request.prefill_state,
                Side::Decode => &mut request.decode_state,
            };
            &mut state.pages[component]
        }
        let needed: u64 = requests.iter_mut().map(|request| pages_of(side, component, request).len() as u64).sum();
        if 2 * needed + 1 > MAX_POOL_ITEMS {
            diagnostics.push_limit(
                format!("model.state[{component}]"),
                format!("the requests need {needed} {side} state pages, more than the limit of {MAX_POOL_ITEMS} (fix: fewer or smaller state_pages)"),
            );
            capacities.push(0);
            continue;
        }
        let capacity = (2 * needed + 1) as u32;
        let mut free: Vec<u32> = (1..capacity).collect();
        free.shuffle(&mut seed.stream(&format!("state{component}.{side}")));
        let mut free = free.into_iter();
        for request in requests.iter_mut() {
            for page in pages_of(side, component, request).iter_mut() {
                *page = free.next().expect("capacity is twice the need");
            }
        }
        capacities.push(capacity);
    }
    capacities
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
