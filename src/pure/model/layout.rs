//! Derivation of each rank's registered regions and advertised metadata from topology and model geometry.

use std::ops::Range;

use super::{
    draft_layer_id, Attention, KvPart, LayerId, ModelGeometry, RankId, RankLayout, Region, RegionKind, Side,
    SideLayout, StateComponent, StateKind, StateMetadata, TensorShape, Topology,
};

/// Layers held by pipeline stage `stage` of `pp` (domain.md §4.1): the last `L mod pp` stages get one extra.
pub fn stage_layers(layer_count: u32, pp: u32, stage: u32) -> Range<u32> {
    let base = layer_count / pp;
    let rem = layer_count % pp;
    if stage < pp - rem {
        stage * base..(stage + 1) * base
    } else {
        let start = stage * (base + 1) - (pp - rem);
        start..start + base + 1
    }
}

/// Layers held by stage `stage` under `partition` (`SGLANG_PP_LAYER_PARTITION`, one layer count per stage, summing
/// to the layer count; 0.5.23 `distributed/utils.py:110-148`), else the default partition of [`stage_layers`].
/// The lowering validates the partition; an entry past its end reads as an empty stage.
pub fn partition_layers(layer_count: u32, pp: u32, partition: Option<&[u32]>, stage: u32) -> Range<u32> {
    let Some(partition) = partition else { return stage_layers(layer_count, pp, stage) };
    let start: u32 = partition.iter().take(stage as usize).sum();
    start..start + partition.get(stage as usize).copied().unwrap_or(0)
}

/// Replaces what a side advertises for one state entry (models a buggy or mismatched peer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataOverride {
    pub component: u32,
    /// Entry index inside the component on the rank (tensor-major, then layer).
    pub entry: u32,
    pub conv_groups: Option<Option<Vec<u32>>>,
    pub dim: Option<u32>,
}

/// Registration choices of one side that scenarios may vary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideOptions {
    /// Whether ranks advertise `kv_layer_ids` (domain.md §4.2).
    pub advertise_layer_ids: bool,
    /// Layers whose KV entry this side fails to register (models a broken peer).
    pub missing_layers: Vec<LayerId>,
    /// KV pool capacity in pages, including padding page 0.
    pub page_count: u32,
    /// Mamba slots and aux rows, including index 0.
    pub slot_count: u32,
    /// Pool capacity in pages of each state component (unused for Mamba components).
    pub state_page_counts: Vec<u32>,
    /// An older peer whose per-component metadata lists cover only the first N components (domain.md §5.5).
    pub metadata_components: Option<usize>,
    pub overrides: Vec<MetadataOverride>,
    /// `(component, tensor, item_len)`: register this tensor with another item length (a peer with other dtypes).
    pub item_len_overrides: Vec<(u32, u32, u64)>,
    /// Register the draft pool paged by `P` instead of `V` (the version-1 layout of domain.md §2.6).
    pub draft_paged_physically: bool,
    /// Register KV token rows of this many bytes instead of the model's (a peer with another KV layout, e.g. an fp8
    /// FlashMLA row widened with scales, domain.md §1.3).
    pub kv_token_len: Option<u64>,
    /// `SGLANG_PP_LAYER_PARTITION` of this side: layers per stage; `None` = the default partition (domain.md §4.1).
    pub layer_partition: Option<Vec<u32>>,
    /// Register the model's draft KV entries; `false` for a side deployed without speculative decoding.
    pub register_draft: bool,
    /// `(component, tensor, outer)`: Mamba tensors held transposed (see [`SideLayout::state_outers`]).
    pub state_outers: Vec<(u32, u32, u32)>,
    /// HiSparse (decode): the KV entries are a host pool of this many pages (page 0 a real page), not `page_count`.
    pub host_kv_pages: Option<u32>,
    /// Staging (decode): the ring's rows and bytes per row, registered after the aux buffers.
    pub staging_ring: Option<(u64, u64)>,
}

/// Builds the regions and metadata of every rank of one side.
///
/// Region order on a rank: KV entries (MLA latent per layer, or all K then all V, domain.md §1.2), draft entries
/// (last stage only), state entries (per component, tensor-kind-major then layer, domain.md §1.7), aux buffers.
pub fn build_side_layout(side: Side, topology: Topology, model: &ModelGeometry, options: &SideOptions) -> SideLayout {
    let ranks = topology.ranks().map(|rank| build_rank(&topology, rank, model, options)).collect();
    SideLayout { side, topology, ranks, state_outers: options.state_outers.clone() }
}

fn build_rank(topology: &Topology, rank: RankId, model: &ModelGeometry, options: &SideOptions) -> RankLayout {
    let stage = partition_layers(model.layer_count, topology.pp, options.layer_partition.as_deref(), rank.pp);
    let (mut regions, ids) = kv_regions(topology, rank, model, options, &stage);
    let kv_entries: Vec<u32> = (0..regions.len() as u32).collect();
    let mut state = StateMetadata::default();
    for (component_index, component) in model.state.iter().enumerate() {
        push_component(topology, options, &stage, component_index, component, &mut regions, &mut state);
    }
    override_metadata(&mut state, options);
    let aux_entries = aux_regions(model, options, &mut regions);
    let staging_entry = options.staging_ring.map(|(rows, row_len)| {
        regions.push(Region {
            kind: RegionKind::Staging,
            layer: 0,
            item_len: row_len,
            item_count: u32::try_from(rows).unwrap_or(u32::MAX),
            rows_per_item: 1,
        });
        regions.len() as u32 - 1
    });
    RankLayout {
        rank,
        regions,
        kv_entries,
        advertised_layer_ids: options.advertise_layer_ids.then_some(ids),
        state,
        aux_entries,
        staging_entry,
        stage_layers: stage.clone(),
    }
}

/// The KV entries of the stage's layers (MLA latent, or all K then all V) and, on the last stage, the draft entries;
/// with the layer id of each.
fn kv_regions(
    topology: &Topology,
    rank: RankId,
    model: &ModelGeometry,
    options: &SideOptions,
    stage: &Range<u32>,
) -> (Vec<Region>, Vec<LayerId>) {
    let page = topology.page_size;
    let mut regions = Vec::new();
    let mut ids = Vec::new();
    let kv_layers: Vec<LayerId> = model
        .kv_layers
        .iter()
        .copied()
        .filter(|layer| stage.contains(layer) && !options.missing_layers.contains(layer))
        .collect();
    let parts: &[KvPart] = match model.attention {
        Attention::Mla { .. } => &[KvPart::Latent],
        Attention::Mha { .. } => &[KvPart::Key, KvPart::Value],
    };
    let token_len = options.kv_token_len.unwrap_or_else(|| model.token_len(topology.tp));
    for part in parts {
        for layer in &kv_layers {
            regions.push(Region {
                kind: RegionKind::Kv(*part),
                layer: *layer,
                item_len: u64::from(page) * token_len,
                item_count: options.host_kv_pages.unwrap_or(options.page_count),
                rows_per_item: page,
            });
            ids.push(*layer);
        }
    }
    if let Some(draft) = model.draft.filter(|_| rank.pp == topology.pp - 1 && options.register_draft) {
        // The draft pool is paged by the allocator page V (domain.md §2.4 draft rows); V = P without DCP.
        let rows = if options.draft_paged_physically { page } else { topology.virtual_page_size() };
        for index in 0..draft.entries {
            regions.push(Region {
                kind: RegionKind::Draft,
                layer: draft_layer_id(index),
                item_len: u64::from(rows) * draft.token_len(topology.tp),
                item_count: options.page_count,
                rows_per_item: rows,
            });
            ids.push(draft_layer_id(index));
        }
    }
    (regions, ids)
}

/// Appends the entries of state component `component_index` on the stage (tensor-major, then layer) to `regions`,
/// and its metadata lists to `state`.
fn push_component(
    topology: &Topology,
    options: &SideOptions,
    stage: &Range<u32>,
    component_index: usize,
    component: &StateComponent,
    regions: &mut Vec<Region>,
    state: &mut StateMetadata,
) {
    let layers: Vec<LayerId> = component.layers.iter().copied().filter(|layer| stage.contains(layer)).collect();
    let item_count = match component.kind {
        StateKind::Mamba => options.slot_count,
        _ => options.state_page_counts.get(component_index).copied().unwrap_or(1),
    };
    let (mut entry_regions, mut layer_ids, mut dims, mut groups, mut outers) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (tensor_index, tensor) in component.tensors.iter().enumerate() {
        let item_len = options
            .item_len_overrides
            .iter()
            .find(|(component, tensor, _)| *component as usize == component_index && *tensor as usize == tensor_index)
            .map_or(tensor.item_len(topology.tp), |item| item.2);
        for layer in &layers {
            entry_regions.push(regions.len() as u32);
            regions.push(Region {
                kind: RegionKind::State { component: component_index as u32, tensor: tensor_index as u32 },
                layer: *layer,
                item_len,
                item_count,
                rows_per_item: 1,
            });
            layer_ids.push(*layer);
            dims.push(tensor.local_dim(topology.tp));
            match &tensor.shape {
                TensorShape::Sliced { outer_count, groups: tensor_groups, .. } => {
                    groups.push(tensor_groups.clone());
                    let held = options
                        .state_outers
                        .iter()
                        .find(|(c, t, _)| (*c as usize, *t as usize) == (component_index, tensor_index));
                    outers.push(held.map_or(*outer_count, |(_, _, outer)| *outer));
                }
                TensorShape::Replicated { .. } => {
                    groups.push(None);
                    outers.push(1);
                }
            }
        }
    }
    state.kinds.push(component.kind);
    state.regions.push(entry_regions);
    state.layer_ids.push(if component.publishes_layer_ids { layer_ids } else { Vec::new() });
    state.dims.push(dims);
    state.conv_groups.push(groups);
    state.outer_counts.push(outers);
}

/// What the side advertises instead of the truth: per-entry metadata overrides, and an older peer's shorter
/// per-component lists (domain.md §5.5).
fn override_metadata(state: &mut StateMetadata, options: &SideOptions) {
    for item in &options.overrides {
        let (component, entry) = (item.component as usize, item.entry as usize);
        if let Some(groups) = &item.conv_groups {
            if let Some(slot) = state.conv_groups.get_mut(component).and_then(|list| list.get_mut(entry)) {
                *slot = groups.clone();
            }
        }
        if let Some(dim) = item.dim {
            if let Some(slot) = state.dims.get_mut(component).and_then(|list| list.get_mut(entry)) {
                *slot = dim;
            }
        }
    }
    if let Some(count) = options.metadata_components {
        state.layer_ids.truncate(count);
        state.dims.truncate(count);
        state.conv_groups.truncate(count);
        state.outer_counts.truncate(count);
    }
}

/// Appends one aux buffer region per aux item length to `regions`; their region indices.
fn aux_regions(model: &ModelGeometry, options: &SideOptions, regions: &mut Vec<Region>) -> Vec<u32> {
    let mut aux_entries = Vec::new();
    for (buffer, item_len) in model.aux_item_lens.iter().enumerate() {
        aux_entries.push(regions.len() as u32);
        regions.push(Region {
            kind: RegionKind::Aux { buffer: buffer as u32 },
            layer: 0,
            item_len: *item_len,
            item_count: options.slot_count,
            rows_per_item: 1,
        });
    }
    aux_entries
}

#[cfg(test)]
mod tests {
    use super::*;

    /// domain.md §4.1: K3's 93 layers over PP8.
    #[test]
    fn stage_partition_gives_last_stages_the_extra_layers() {
        let stages: Vec<_> = (0..8).map(|s| stage_layers(93, 8, s)).collect();
        assert_eq!(stages, vec![0..11, 11..22, 22..33, 33..45, 45..57, 57..69, 69..81, 81..93]);
    }

    /// `SGLANG_PP_LAYER_PARTITION="12,20"`: stage r starts at the sum of the counts before it.
    #[test]
    fn explicit_partition_replaces_the_default() {
        let stages: Vec<_> = (0..2).map(|s| partition_layers(32, 2, Some(&[12, 20]), s)).collect();
        assert_eq!(stages, vec![0..12, 12..32]);
        assert_eq!(partition_layers(93, 8, None, 3), stage_layers(93, 8, 3));
    }
}
