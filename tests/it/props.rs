//! Planner and oracle invariants over random topologies (domain.md §12), via proptest.
//!
//! Cases default to 48 per property; `PROPTEST_CASES=1000 cargo test --test it props` runs a deeper sweep.

use std::collections::BTreeMap;

use kvrelay::harness;
use kvrelay::model::{RankId, Side};
use kvrelay::model::{RegionKind, StateKind};
use kvrelay::plan::{self, TransferKind};
use kvrelay::verify::{Origin, RegionKey, Run, Sources};
use proptest::prelude::*;

use crate::support::scenario;

/// A random but valid transfer problem, rendered as scenario YAML so the loader is exercised too.
#[derive(Debug, Clone)]
struct Shape {
    prefill_tp: u32,
    prefill_pp: u32,
    decode_tp: u32,
    decode_dcp: u32,
    /// Decode PP equals prefill PP (otherwise 1).
    decode_pp_matches: bool,
    /// Prefill uses the decode's DCP size (plain page copy); only applied when the TP sizes are equal.
    mirror_dcp: bool,
    page_size: u32,
    layers: u32,
    mla_mask: u32,
    dtype_bytes: u32,
    seed: u64,
    requests: Vec<RequestShape>,
    /// `Some(kv_heads)`: head-sharded MHA/GQA instead of the MLA latent (forces decode DCP 1).
    mha_heads: Option<u32>,
    /// A Mamba component (grouped conv with `outer` rows, temporal heads) over the non-KV layers.
    mamba_outer: Option<u32>,
    aux: bool,
    /// One draft entry on the last stage (MLA only).
    draft: bool,
    /// A paged state component (DSA over the KV layers for MLA, SWA for MHA) where the topology allows one.
    paged: bool,
    /// Neither side advertises KV layer ids (only applied with prefill PP1, where positional pairing is allowed).
    no_ids: bool,
}

#[derive(Debug, Clone)]
struct RequestShape {
    prefix_pages: u32,
    send_len: u32,
    cuts: Vec<u32>,
}

impl Shape {
    fn prefill_dcp(&self) -> u32 {
        if self.mirror_dcp && self.prefill_tp == self.decode_tp {
            self.decode_dcp()
        } else {
            1
        }
    }

    /// Paged state needs equal DCP sizes, and for non-MLA models equal TP sizes (domain.md §3.4).
    fn paged_state(&self) -> bool {
        self.paged
            && self.prefill_dcp() == self.decode_dcp()
            && (self.mha_heads.is_none() || self.prefill_tp == self.decode_tp)
    }

    fn ids(&self) -> &'static str {
        if self.no_ids && self.prefill_pp == 1 {
            ", layer_ids: false"
        } else {
            ""
        }
    }

    fn decode_dcp(&self) -> u32 {
        if self.mha_heads.is_some() {
            1
        } else {
            self.decode_dcp
        }
    }

    fn model_yaml(&self) -> String {
        let attention = match self.mha_heads {
            Some(heads) => format!("kv_heads: {heads}, head_dim: 4"),
            None => "kv_lora_rank: 4, qk_rope_head_dim: 4".to_owned(),
        };
        let mut extra = String::new();
        if let Some(outer) = self.mamba_outer {
            extra.push_str(&format!(
                ", state: [{{kind: mamba, tensors: [{{name: conv, dim: 32, unit_bytes: 8, outer: {outer}, groups: [8, 8, 16]}}, {{name: temporal, dim: 8, unit_bytes: 16}}]}}]"
            ));
        }
        if self.aux {
            extra.push_str(", aux: [8, 24]");
        }
        if self.paged_state() {
            let kind = if self.mha_heads.is_some() { "swa, window_pages: 2" } else { "dsa" };
            let state =
                format!("{{kind: {kind}, layers: {:?}, tensors: [{{name: p, item_len: 64}}]}}", self.mla_layers());
            match extra.find("state: [") {
                Some(at) => extra.insert_str(at + "state: [".len(), &format!("{state}, ")),
                None => extra.push_str(&format!(", state: [{state}]")),
            }
        }
        if self.draft && self.mha_heads.is_none() {
            extra.push_str(", draft: {entries: 1, token_len: 16}");
        }
        let dtype = if self.mha_heads.is_some() { 2 } else { self.dtype_bytes };
        format!(
            "model: {{layers: {}, kv_layers: {:?}, {attention}, dtype_bytes: {dtype}{extra}}}\n",
            self.layers,
            self.mla_layers()
        )
    }

    fn mla_layers(&self) -> Vec<u32> {
        let res: Vec<u32> = (0..self.layers).filter(|layer| self.mla_mask >> layer & 1 == 1).collect();
        if res.is_empty() {
            vec![self.layers - 1]
        } else {
            res
        }
    }

    /// Chunk sizes of a send range cut at prefill-page-aligned points derived from raw draws `cuts`.
    fn chunks(&self, send_len: u32, cuts: &[u32]) -> Vec<u32> {
        let unit = self.page_size * self.prefill_dcp();
        let mut ends: Vec<u32> = cuts
            .iter()
            .map(|cut| cut % (send_len / unit + 1) * unit)
            .filter(|cut| *cut > 0 && *cut < send_len)
            .collect();
        ends.sort_unstable();
        ends.dedup();
        ends.push(send_len);
        let mut start = 0;
        ends.into_iter().map(|end| end - std::mem::replace(&mut start, end)).collect()
    }

    fn yaml_with(&self, cuts_of: impl Fn(usize) -> Vec<u32>) -> String {
        let virtual_page = self.page_size * self.decode_dcp();
        let mut yaml = format!(
            "{}prefill: {{tp: {}, pp: {}, dcp: {}, page_size: {}{ids}}}\n\
             decode: {{tp: {}, pp: {}, dcp: {}, page_size: {}{ids}}}\n\
             seed: {}\nrequests:\n",
            self.model_yaml(),
            self.prefill_tp,
            self.prefill_pp,
            self.prefill_dcp(),
            self.page_size,
            self.decode_tp,
            if self.decode_pp_matches { self.prefill_pp } else { 1 },
            self.decode_dcp(),
            self.page_size,
            self.seed,
            ids = self.ids(),
        );
        for (index, request) in self.requests.iter().enumerate() {
            let prefix = request.prefix_pages * virtual_page;
            let chunks = self.chunks(request.send_len, &cuts_of(index));
            yaml.push_str(&format!(
                "  - {{tokens: {}, decode_prefix: {prefix}, chunks: {chunks:?}}}\n",
                prefix + request.send_len
            ));
        }
        yaml.push_str("expect: ok\n");
        yaml
    }

    fn yaml(&self) -> String {
        self.yaml_with(|index| self.requests[index].cuts.clone())
    }
}

/// MLA-only shapes (issue 2's invariants), or every transfer kind when `kinds` is set.
fn shapes_of(kinds: bool) -> impl Strategy<Value = Shape> {
    let tps = (prop::sample::select(vec![1u32, 2, 4]), prop::sample::select(vec![1u32, 2, 4, 8]));
    let extras = if kinds {
        (
            prop::option::of(prop::sample::select(vec![1u32, 2, 4, 8])),
            prop::option::of(prop::sample::select(vec![1u32, 3])),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .boxed()
    } else {
        Just((None, None, false, false, false, false)).boxed()
    };
    (
        tps,
        1u32..=3,
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec![1u32, 2, 4, 8]),
        0u32..=4,
        any::<u32>(),
        1u32..=2,
        any::<u64>(),
        extras,
    )
        .prop_flat_map(
            |(
                (prefill_tp, decode_tp),
                prefill_pp,
                decode_pp_matches,
                mirror_dcp,
                page_size,
                extra_layers,
                mla_mask,
                dtype_bytes,
                seed,
                extras,
            )| {
                let (mha_heads, mamba_outer, aux, draft, paged, no_ids) = extras;
                let dcps: Vec<u32> = [1u32, 2, 4, 8].into_iter().filter(|dcp| decode_tp % dcp == 0).collect();
                let request = (0u32..=2, 1u32..=150, prop::collection::vec(any::<u32>(), 0..4))
                    .prop_map(|(prefix_pages, send_len, cuts)| RequestShape { prefix_pages, send_len, cuts });
                (prop::sample::select(dcps), prop::collection::vec(request, 1..=3)).prop_map(
                    move |(decode_dcp, requests)| Shape {
                        prefill_tp,
                        prefill_pp,
                        decode_tp,
                        decode_dcp,
                        decode_pp_matches,
                        mirror_dcp,
                        page_size,
                        layers: prefill_pp + extra_layers,
                        mla_mask,
                        dtype_bytes,
                        seed,
                        requests,
                        mha_heads,
                        mamba_outer,
                        aux,
                        draft,
                        paged,
                        no_ids,
                    },
                )
            },
        )
}

fn shapes() -> impl Strategy<Value = Shape> {
    shapes_of(false)
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|it| it.parse().ok()).unwrap_or(48);
    ProptestConfig { cases, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// Zero-fault in-memory run + oracle ⇒ no violation, for every valid topology (domain.md §12.1–§12.4).
    #[test]
    fn random_topologies_transfer_without_violations(shape in shapes()) {
        transfers_cleanly(&shape)?;
    }

    /// Within each decode DCP group every send-range position of every layer lands exactly once (domain.md §12.2),
    /// read back from the bytes rather than from the plan.
    #[test]
    fn each_dcp_group_holds_every_sent_position_once(shape in shapes()) {
        let scenario = scenario(&shape.yaml());
        let problem = &scenario.problem;
        let outcome = harness::run(&scenario).expect("within the memory budget");
        let sources = Sources::new(problem);
        let dcp = problem.decode.topology.dcp;
        let mut seen: BTreeMap<(u32, u32, RankId), Vec<u32>> = BTreeMap::new();
        for layout in &problem.decode.ranks {
            let group = RankId { tp: layout.rank.tp / dcp, ..layout.rank };
            for (index, region) in layout.regions.iter().enumerate() {
                let bytes = &outcome.observation.images[&RegionKey { side: Side::Decode, rank: layout.rank, region: index as u32 }];
                let row_len = region.row_len();
                for run in sources.runs(0, bytes) {
                    let Run::Source { length, number, source_offset, .. } = run else { continue };
                    // Split the run into token rows and name each one's token.
                    for row in 0..length / row_len {
                        let described = sources.describe(number, source_offset + row * row_len, row_len);
                        if let Origin::Token { request, position, .. } = described.origin {
                            seen.entry((request, region.layer, group)).or_default().push(position);
                        }
                    }
                }
            }
        }
        // Every (request, layer, DCP group) must show up, or the loop below would check nothing.
        // Regions summed over all decode ranks, divided by the DCP size, is the number of (layer, group) pairs.
        let layer_groups = problem.decode.ranks.iter().map(|layout| layout.regions.len() as u32).sum::<u32>() / dcp;
        prop_assert_eq!(seen.len() as u32, problem.requests.len() as u32 * layer_groups);
        for ((request, layer, group), mut positions) in seen {
            let request = &problem.requests[request as usize];
            positions.sort_unstable();
            let expected: Vec<u32> = (request.decode_prefix..request.tokens).collect();
            prop_assert_eq!(positions, expected, "request {} layer {} decode group {}", request.id, layer, group);
        }
    }

    /// The plan is a pure function of the problem.
    #[test]
    fn plan_is_deterministic(shape in shapes()) {
        let problem = scenario(&shape.yaml()).problem;
        prop_assert_eq!(plan::plan(&problem), plan::plan(&problem));
    }

    /// Any page-aligned re-chunking of the send range yields the same final decode image (domain.md §7, §12.2).
    #[test]
    fn rechunking_yields_the_same_decode_image(shape in shapes(), other_cuts in prop::collection::vec(any::<u32>(), 0..5)) {
        rechunking_keeps_the_image(&shape, &other_cuts)?;
    }
}

/// Zero-fault run of the shape's scenario: the planner accepts and the oracle finds no violation.
fn transfers_cleanly(shape: &Shape) -> Result<(), TestCaseError> {
    let outcome = harness::run(&scenario(&shape.yaml())).expect("within the memory budget");
    prop_assert!(
        outcome.passed(),
        "{}\n{}\n{}",
        shape.yaml(),
        outcome.failure_text("; "),
        kvrelay::render::violations(&outcome.violations)
    );
    Ok(())
}

/// Re-chunking the send range at other page-aligned points leaves the final decode image unchanged.
fn rechunking_keeps_the_image(shape: &Shape, other_cuts: &[u32]) -> Result<(), TestCaseError> {
    let first = harness::run(&scenario(&shape.yaml())).expect("within the memory budget");
    let second = harness::run(&scenario(&shape.yaml_with(|_| other_cuts.to_vec()))).expect("within the memory budget");
    prop_assert!(first.passed() && second.passed());
    prop_assert!(first.observation.images == second.observation.images, "decode images differ between chunkings");
    Ok(())
}

/// Byte ranges `(start, length)` that must tile `[0, total)` exactly once.
fn tiles(mut ranges: Vec<(u64, u64)>, total: u64) -> Result<(), String> {
    ranges.sort_unstable();
    let mut cursor = 0;
    for (start, length) in ranges {
        if start != cursor {
            return Err(format!("gap or overlap at byte {cursor}: next range starts at {start}"));
        }
        cursor += length;
    }
    if cursor == total {
        Ok(())
    } else {
        Err(format!("ranges end at {cursor}, not {total}"))
    }
}

proptest! {
    #![proptest_config(config())]

    /// Every transfer kind (MHA heads, Mamba state, aux, draft) on random topologies: no oracle violation.
    #[test]
    fn every_kind_transfers_without_violations(shape in shapes_of(true)) {
        transfers_cleanly(&shape)?;
    }

    /// domain.md §12.4: the head slices written into each destination token row tile it exactly once.
    #[test]
    fn head_slices_tile_each_destination_token_once(
        shape in shapes_of(true).prop_map(|mut shape| { shape.mha_heads.get_or_insert(2); shape })
    ) {
        let problem = scenario(&shape.yaml()).problem;
        let plan = plan::plan(&problem).unwrap();
        let mut rows: BTreeMap<(RankId, u32, u64), Vec<(u64, u64)>> = BTreeMap::new();
        for copy in plan.copies().filter(|copy| copy.kind == TransferKind::Kv) {
            let region = &problem.decode.rank(copy.target).regions[copy.target_region as usize];
            let row_len = region.row_len();
            // Head-sliced copies are one row each; full-row copies may span several rows.
            let mut offset = copy.target_offset;
            while offset < copy.target_offset + copy.length {
                let take = (row_len - offset % row_len).min(copy.target_offset + copy.length - offset);
                rows.entry((copy.target, copy.target_region, offset / row_len)).or_default().push((offset % row_len, take));
                offset += take;
            }
        }
        // Whole pages move (domain.md §3.2), so each K or V region of each decode rank gets every send page's rows.
        let page = u64::from(problem.decode.topology.page_size);
        let rows_per_region: u64 = problem.requests.iter().map(|request| u64::from(request.send_len()).div_ceil(page) * page).sum();
        let kv_regions: u64 = problem
            .decode
            .ranks
            .iter()
            .map(|layout| layout.regions.iter().filter(|region| matches!(region.kind, RegionKind::Kv(_))).count() as u64)
            .sum();
        prop_assert_eq!(rows.len() as u64, kv_regions * rows_per_region);
        for ((rank, region, row), ranges) in rows {
            let row_len = problem.decode.rank(rank).regions[region as usize].row_len();
            prop_assert_eq!(tiles(ranges, row_len), Ok(()), "decode {} region {} row {}", rank, region, row);
        }
    }

    /// domain.md §12.5: Mamba blocks cover each source item once across decode ranks (scatter) and each
    /// destination item once across prefill ranks (aggregation).
    #[test]
    fn state_blocks_cover_source_once_when_scattering_and_target_once_when_aggregating(
        shape in shapes_of(true).prop_map(|mut shape| { shape.mamba_outer.get_or_insert(3); shape })
    ) {
        let problem = scenario(&shape.yaml()).problem;
        let plan = plan::plan(&problem).unwrap();
        let (prefill_tp, decode_tp) = (problem.prefill.topology.tp, problem.decode.topology.tp);
        let mut sources: BTreeMap<(RankId, u32, u64), Vec<(u64, u64)>> = BTreeMap::new();
        let mut targets: BTreeMap<(RankId, u32, u64), Vec<(u64, u64)>> = BTreeMap::new();
        // Only Mamba components slice; paged state (also `TransferKind::State`) is replicated whole.
        let mamba = |kind: TransferKind| matches!(kind, TransferKind::State { component } if problem.model.state[component as usize].kind == StateKind::Mamba);
        for copy in plan.copies().filter(|copy| mamba(copy.kind)) {
            let source_item = problem.prefill.rank(copy.source).regions[copy.source_region as usize].item_len;
            let target_item = problem.decode.rank(copy.target).regions[copy.target_region as usize].item_len;
            // Scatter: one source item feeds exactly the k decode ranks that contact its prefill rank.
            sources
                .entry((copy.source, copy.source_region, copy.source_offset / source_item))
                .or_default()
                .push((copy.source_offset % source_item, copy.length));
            targets.entry((copy.target, copy.target_region, copy.target_offset / target_item)).or_default().push((copy.target_offset % target_item, copy.length));
        }
        let mamba_layers = problem.model.state.iter().filter(|component| component.kind == StateKind::Mamba).map(|component| component.layers.len()).sum::<usize>();
        prop_assert!(!targets.is_empty() || mamba_layers == 0);
        if decode_tp >= prefill_tp {
            for (key, ranges) in sources {
                let total = problem.prefill.rank(key.0).regions[key.1 as usize].item_len;
                prop_assert_eq!(tiles(ranges, total), Ok(()), "source {:?}", key);
            }
        }
        if prefill_tp >= decode_tp {
            for (key, ranges) in targets {
                let total = problem.decode.rank(key.0).regions[key.1 as usize].item_len;
                prop_assert_eq!(tiles(ranges, total), Ok(()), "target {:?}", key);
            }
        }
    }

    /// domain.md §12.3: in every transfer group each source entry of the kind is paired with exactly one target
    /// entry of the same layer and tensor, and every such source entry takes part.
    #[test]
    fn every_source_entry_of_every_kind_is_paired_once(shape in shapes_of(true)) {
        let problem = scenario(&shape.yaml()).problem;
        let plan = plan::plan(&problem).unwrap();
        for group in &plan.groups {
            let source_layout = problem.prefill.rank(group.source);
            let target_layout = problem.decode.rank(group.target);
            let mut pairs: Vec<(u32, u32)> = group.entries.iter().map(|entry| (entry.source_region, entry.target_region)).collect();
            pairs.sort_unstable();
            pairs.dedup();
            let sources: Vec<u32> = pairs.iter().map(|pair| pair.0).collect();
            let mut unique = sources.clone();
            unique.dedup();
            prop_assert_eq!(&unique, &sources, "a source entry has two partners in {:?}", group.kind);
            for (source, target) in &pairs {
                let (source, target) = (&source_layout.regions[*source as usize], &target_layout.regions[*target as usize]);
                prop_assert_eq!((source.layer, source.kind), (target.layer, target.kind));
            }
            let expected: Vec<u32> = source_layout
                .regions
                .iter()
                .enumerate()
                .filter(|(_, region)| match (group.kind, region.kind) {
                    (TransferKind::Kv, RegionKind::Kv(_)) => true,
                    (TransferKind::Draft, RegionKind::Draft) => true,
                    (TransferKind::State { component }, RegionKind::State { component: other, .. }) => component == other,
                    (TransferKind::Aux, RegionKind::Aux { .. }) => true,
                    _ => false,
                })
                .map(|(index, _)| index as u32)
                .collect();
            prop_assert_eq!(sources, expected, "group {:?} {} -> {}", group.kind, group.source, group.target);
        }
    }

    /// Re-chunking invariance holds with every kind present (state and aux travel with the last chunk).
    #[test]
    fn rechunking_every_kind_yields_the_same_decode_image(shape in shapes_of(true), other_cuts in prop::collection::vec(any::<u32>(), 0..5)) {
        rechunking_keeps_the_image(&shape, &other_cuts)?;
    }

    /// The cached-prefix early send of domain.md §7 (an early chunk up to the page-aligned cached end, skipped when
    /// a peer needs DCP relayout) leaves the final decode image unchanged, whatever part of the prompt is cached.
    #[test]
    fn early_send_yields_the_same_decode_image(shape in shapes_of(true), cached in prop::collection::vec(0u32..=100, 1..4)) {
        let plain = shape.yaml();
        let early = with_early_send(&plain, &cached);
        let first = harness::run(&scenario(&plain)).expect("within the memory budget");
        let second = harness::run(&scenario(&early)).expect("within the memory budget");
        prop_assert!(first.passed() && second.passed(), "{early}\n{}", second.failure_text("; "));
        prop_assert!(first.observation.images == second.observation.images, "decode images differ with early send:\n{early}");
    }
}

/// `yaml` with early send on and request `i` caching `percent[i % len]` % of its prompt.
fn with_early_send(yaml: &str, percent: &[u32]) -> String {
    let mut out = String::new();
    let mut index = 0;
    for line in yaml.lines() {
        if let Some(rest) = line.strip_prefix("prefill: {") {
            out.push_str(&format!("prefill: {{early_send: true, {rest}\n"));
        } else if let Some(rest) = line.strip_prefix("  - {tokens: ") {
            let tokens: u32 = rest.split(',').next().and_then(|it| it.trim().parse().ok()).unwrap_or(0);
            let cached = tokens * percent[index % percent.len()] / 100;
            out.push_str(&format!("  - {{cached_prefix: {cached}, tokens: {rest}\n"));
            index += 1;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

proptest! {
    #![proptest_config(config())]

    /// domain.md §4.1, restated: stages are contiguous, cover every layer once, differ by at most one layer, and
    /// the last `L mod pp` stages are the larger ones. Pins `stage_layers`, which planner and oracle both rely on.
    #[test]
    fn stage_partition_covers_layers_in_order_with_larger_last_stages(layers in 1u32..200, pp in 1u32..17) {
        prop_assume!(pp <= layers);
        let stages: Vec<_> = (0..pp).map(|stage| kvrelay::model::stage_layers(layers, pp, stage)).collect();
        prop_assert_eq!(stages[0].start, 0);
        prop_assert_eq!(stages[stages.len() - 1].end, layers);
        for pair in stages.windows(2) {
            prop_assert_eq!(pair[0].end, pair[1].start);
        }
        let sizes: Vec<u32> = stages.iter().map(|stage| stage.end - stage.start).collect();
        let base = layers / pp;
        let extra = (layers % pp) as usize;
        let expected: Vec<u32> = (0..pp as usize).map(|stage| if stage >= pp as usize - extra { base + 1 } else { base }).collect();
        prop_assert_eq!(sizes, expected);
    }
}

/// Byte moves `(source offset, target offset, length)` per key, sorted and coalesced wherever both sides
/// continue: equal maps move exactly the same bytes.
fn moves<K: Ord>(items: impl Iterator<Item = (K, u64, u64, u64)>) -> BTreeMap<K, Vec<(u64, u64, u64)>> {
    let mut res: BTreeMap<K, Vec<(u64, u64, u64)>> = BTreeMap::new();
    for (key, source, target, length) in items.filter(|item| item.3 > 0) {
        res.entry(key).or_default().push((source, target, length));
    }
    for ranges in res.values_mut() {
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64, u64)> = Vec::with_capacity(ranges.len());
        for &(source, target, length) in ranges.iter() {
            match merged.last_mut() {
                Some(last) if last.0 + last.2 == source && last.1 + last.2 == target => last.2 += length,
                _ => merged.push((source, target, length)),
            }
        }
        *ranges = merged;
    }
    res
}

/// A copy keyed by everything but its offsets and length.
#[allow(clippy::type_complexity)]
fn keyed(copy: plan::Copy) -> ((u32, u32, TransferKind, RankId, u32, RankId, u32), u64, u64, u64) {
    let key = (copy.request, copy.chunk, copy.kind, copy.source, copy.source_region, copy.target, copy.target_region);
    (key, copy.source_offset, copy.target_offset, copy.length)
}

/// Pages 1.. in request order on both sides (a fresh allocator's), so descriptors merge across pages.
fn contiguous_pages(problem: &mut kvrelay::model::Problem) {
    let (mut prefill, mut decode) = (1u32, 1u32);
    for request in &mut problem.requests {
        for page in &mut request.prefill_pages {
            (*page, prefill) = (prefill, prefill + 1);
        }
        for page in &mut request.decode_pages {
            (*page, decode) = (decode, decode + 1);
        }
    }
}

/// A plan's descriptors move exactly the bytes of its per-row expansion, and their lowering within `limits` moves
/// them again, every work request within the limits.
fn descriptors_match_copies(problem: &kvrelay::model::Problem, limits: plan::Limits) -> Result<(), TestCaseError> {
    let plan = plan::plan(problem).unwrap();
    let descriptors = plan.descriptors();
    let expected = moves(plan.copies().map(keyed));
    prop_assert_eq!(&moves(descriptors.iter().flat_map(plan::Descriptor::elements).map(keyed)), &expected);
    prop_assert!(descriptors.len() as u64 <= plan.copy_count());
    // A work request carries no request, chunk or kind: compare per region pair.
    let pairs = |copy: plan::Copy| {
        (
            (copy.source, copy.source_region, copy.target, copy.target_region),
            copy.source_offset,
            copy.target_offset,
            copy.length,
        )
    };
    let lowering = plan::lower(&descriptors, limits);
    let mut lowered = Vec::new();
    for request in lowering.work_requests(&descriptors) {
        prop_assert!(request.sges.len() <= limits.max_sge && !request.sges.is_empty(), "{:?}", request);
        prop_assert!(request.sges.iter().map(|sge| sge.1).sum::<u64>() <= limits.max_message, "{:?}", request);
        let mut target = request.target_offset;
        for (source, length) in &request.sges {
            let key = (request.source, request.source_region, request.target, request.target_region);
            lowered.push((key, *source, target, *length));
            target += length;
        }
    }
    prop_assert_eq!(lowering.work_request_count(), lowered_count(&lowering, &descriptors));
    prop_assert_eq!(moves(lowered.into_iter()), moves(plan.copies().map(pairs)));
    Ok(())
}

fn lowered_count(lowering: &plan::Lowering, descriptors: &[plan::Descriptor]) -> u64 {
    lowering.work_requests(descriptors).count() as u64
}

proptest! {
    #![proptest_config(config())]

    /// Every transfer kind on random topologies, on shuffled or contiguous pages: the plan's descriptors move
    /// exactly the bytes of the per-row expansion, and so does their lowering within random fabric limits.
    #[test]
    fn descriptors_move_exactly_the_bytes_of_the_per_row_copies(
        shape in shapes_of(true),
        contiguous in any::<bool>(),
        max_sge in 1usize..=8,
        max_message in prop::sample::select(vec![100u64, 1000, 4096, 1 << 30]),
    ) {
        let mut problem = scenario(&shape.yaml()).problem;
        if contiguous {
            contiguous_pages(&mut problem);
        }
        descriptors_match_copies(&problem, plan::Limits { max_sge, max_message, sq_depth: 4 })?;
    }
}

/// The paged form of a plan's descriptors moves exactly the bytes of its per-row expansion, and is never longer
/// than the descriptors it compacts.
fn paged_descriptors_match_copies(problem: &kvrelay::model::Problem) -> Result<(), TestCaseError> {
    let plan = plan::plan(problem).unwrap();
    let descriptors = plan.descriptors();
    let paged = plan::paged::compact(problem, &descriptors);
    prop_assert!(paged.len() <= descriptors.len(), "{} paged > {} descriptors", paged.len(), descriptors.len());
    let mut segments = Vec::new();
    for descriptor in &paged {
        let key = (
            descriptor.request,
            descriptor.chunk,
            descriptor.kind,
            descriptor.source,
            descriptor.source_region,
            descriptor.target,
            descriptor.target_region,
        );
        let Some(moved) = descriptor.segments(problem) else {
            return Err(TestCaseError::fail(format!("{descriptor:?} does not translate back")));
        };
        segments.extend(moved.into_iter().map(|segment| (key, segment.source, segment.target, segment.length)));
    }
    prop_assert_eq!(moves(segments.into_iter()), moves(plan.copies().map(keyed)));
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    /// Every transfer kind on random topologies, on shuffled or contiguous pages: descriptors addressed through
    /// the request's page tables (`plan::paged`) translate back to exactly the per-row expansion's bytes.
    #[test]
    fn paged_descriptors_move_exactly_the_bytes_of_the_per_row_copies(
        shape in shapes_of(true),
        contiguous in any::<bool>(),
    ) {
        let mut problem = scenario(&shape.yaml()).problem;
        if contiguous {
            contiguous_pages(&mut problem);
        }
        paged_descriptors_match_copies(&problem)?;
    }
}
