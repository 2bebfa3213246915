//! The registration boundary (domain.md §6.2, §6.3): what a decode rank advertises, and the [`Peer`] a prefill
//! rank reconstructs from the decoded message. The planner's links see nothing else of the decode side.
//!
//! [I] What the wire does not carry, the prefill rank takes from its own model: entry kinds (latent, K then V,
//! trailing draft entries), conv sub-block widths of each state tensor, its outer counts where the peer sent none
//! (frame 19 is kvrelay's; SGLang sends none), aux row lengths and the page size (both sides checked it at
//! bootstrap).

use super::{Local, Peer, PlanError};
use crate::model::{
    draft_layer_id, Attention, KvPart, Problem, RankId, RankLayout, Region, RegionKind, StateMetadata, TensorShape,
};
use crate::wire::{DcpFields, EngineDesc, MemoryDesc, Registration};

/// The registration decode rank `rank` sends: its regions as `descs` (one per region, in region order), its item
/// lengths, dims and layer ids, shaped by the problem's [`crate::model::Advertise`] options (a legacy or lying peer).
pub fn advertise(problem: &Problem, rank: RankId, descs: &[MemoryDesc]) -> Registration {
    let layout = problem.decode.rank(rank);
    let topology = &problem.decode.topology;
    let options = problem.advertise.for_rank(topology.rank_index(rank) as u32);
    let item_len = |index: u32| layout.regions[index as usize].item_len;
    let desc = |index: &u32| descs[*index as usize];
    let kv_descs = layout.kv_entries.iter().map(desc).collect();
    let state_descs = layout.state.regions.iter().map(|list| list.iter().map(desc).collect());
    // A legacy peer predates every optional frame, and the PR #37358 wire carries only entry 0's length.
    let per_entry = !options.legacy && !options.entry0_item_len_only;
    let kv_item_lens =
        if per_entry { layout.kv_entries.iter().map(|index| item_len(*index)).collect() } else { Vec::new() };
    let state_item_lens = layout.state.regions.iter().map(|list| list.iter().map(|index| item_len(*index) as u32));
    let kv_item_len = layout.kv_entries.first().map_or(0, |index| item_len(*index));
    let dcp = (!options.legacy).then(|| DcpFields {
        dcp_size: topology.dcp,
        dcp_rank: topology.dcp_rank(rank.tp),
        state_layer_ids: layout.state.layer_ids.clone(),
        kv_layer_ids: layout.advertised_layer_ids.clone().unwrap_or_default(),
    });
    Registration {
        ip: "127.0.0.1".to_owned(),
        port: 17000 + topology.rank_index(rank) as u16 % 1000,
        engine: EngineDesc {
            key: engine_key(rank),
            gpu_id: rank.tp,
            host: "127.0.0.1".to_owned(),
            port: 1,
            address: Vec::new(),
        },
        kv_descs,
        aux_descs: layout.aux_entries.iter().map(desc).collect(),
        state_descs: state_descs.collect(),
        gpu_id: rank.tp,
        attn_tp_size: topology.tp,
        tp_rank: rank.tp,
        kv_item_len: options.kv_item_len.unwrap_or(kv_item_len),
        state_item_lens: state_item_lens.map(Iterator::collect).collect(),
        state_dims: layout.state.dims.clone(),
        dcp,
        kv_item_lens,
        // Frame 19 rides after frame 18, so only where the per-entry lengths do.
        state_outer_counts: if per_entry { layout.state.outer_counts.clone() } else { Vec::new() },
        // Frame 20 rides after frames 18 and 19: a legacy peer advertises no ring.
        staging_descs: if options.legacy { Vec::new() } else { layout.staging_entry.iter().map(desc).collect() },
    }
}

/// The engine key a decode rank registers under: `decode-pp<s>-tp<r>`, or `decode-dp<g>-pp<s>-tp<r>` in DP group
/// `g > 0` (the prefill rank recovers the stage and the group, which the Mori wire does not carry, from it; SGLang's
/// key is the decode engine's session, unique per rank).
pub fn engine_key(rank: RankId) -> String {
    match rank.dp {
        0 => format!("decode-pp{}-tp{}", rank.pp, rank.tp),
        dp => format!("decode-dp{dp}-pp{}-tp{}", rank.pp, rank.tp),
    }
}

/// The decode rank an engine key names.
pub fn rank_of_key(key: &str) -> Option<RankId> {
    let rest = key.strip_prefix("decode-")?;
    let (dp, rest) = match rest.strip_prefix("dp") {
        Some(grouped) => {
            let (dp, rest) = grouped.split_once('-')?;
            (dp.parse().ok()?, rest)
        }
        None => (0, rest),
    };
    let (pp, rest) = rest.strip_prefix("pp")?.split_once("-tp")?;
    let tp = rest.split('-').next()?;
    Some(RankId { dp, cp: 0, pp: pp.parse().ok()?, tp: tp.parse().ok()? })
}

/// What the prefill rank `local` knows of the peer that sent `registration`, and the memory desc of each of the
/// peer's regions (same order as `Peer::layout.regions`).
pub fn from_registration(local: Local<'_>, registration: &Registration) -> Result<(Peer, Vec<MemoryDesc>), PlanError> {
    let invalid = |reason: String| PlanError::Registration { reason };
    let rank = rank_of_key(&registration.engine.key)
        .ok_or_else(|| invalid(format!("engine key `{}` names no decode rank", registration.engine.key)))?;
    let tp = registration.attn_tp_size;
    if tp == 0 || registration.tp_rank % tp != rank.tp {
        return Err(invalid(format!("tp rank {} of {tp} disagrees with engine {}", registration.tp_rank, rank)));
    }
    let mut layout = RankLayout {
        rank,
        regions: Vec::new(),
        kv_entries: Vec::new(),
        // Empty ids and no ids look alike on the wire; a non-legacy peer without KV entries sent an empty list.
        advertised_layer_ids: match registration.kv_layer_ids() {
            Some(ids) => Some(ids.to_vec()),
            None if !registration.is_legacy() && registration.kv_descs.is_empty() => Some(Vec::new()),
            None => None,
        },
        state: StateMetadata::default(),
        aux_entries: Vec::new(),
        staging_entry: None,
        stage_layers: 0..0,
    };
    let mut descs = Vec::new();
    kv_regions(local, registration, &mut layout, &mut descs)?;
    state_regions(local, registration, &mut layout, &mut descs)?;
    for (buffer, desc) in registration.aux_descs.iter().enumerate() {
        let item_len = local.model.aux_item_lens.get(buffer).copied().unwrap_or(0);
        layout.aux_entries.push(layout.regions.len() as u32);
        layout.regions.push(region(RegionKind::Aux { buffer: buffer as u32 }, 0, item_len, 1, desc));
        descs.push(*desc);
    }
    if let [desc] = registration.staging_descs.as_slice() {
        // Ring rows are one writer's heads of one token, as the prefill computes them for this pair of TP sizes.
        let row_len = match local.model.attention {
            Attention::Mha { kv_heads, .. } => {
                crate::model::StagingShape::new(kv_heads, local.model.head_len(), local.topology.tp, tp).row_len()
            }
            Attention::Mla { .. } => desc.length_bytes.max(1),
        };
        layout.staging_entry = Some(layout.regions.len() as u32);
        layout.regions.push(region(RegionKind::Staging, 0, row_len, 1, desc));
        descs.push(*desc);
    } else if registration.staging_descs.len() > 1 {
        return Err(invalid(format!("{} staging rings advertised (at most one)", registration.staging_descs.len())));
    }
    let (dcp, dcp_rank) = (registration.dcp_size(), registration.dcp_rank());
    if dcp == 0 || dcp_rank >= dcp {
        return Err(invalid(format!("dcp rank {dcp_rank} of dcp size {dcp}")));
    }
    Ok((Peer { rank, tp, dcp, dcp_rank, layout }, descs))
}

fn region(kind: RegionKind, layer: u32, item_len: u64, rows_per_item: u32, desc: &MemoryDesc) -> Region {
    let item_count = desc.length_bytes.checked_div(item_len).map_or(0, |count| count.min(u64::from(u32::MAX)) as u32);
    Region { kind, layer, item_len, item_count, rows_per_item }
}

/// KV and draft entries: kinds from the local model, item lengths per entry when advertised, else entry 0's.
fn kv_regions(
    local: Local<'_>,
    registration: &Registration,
    layout: &mut RankLayout,
    descs: &mut Vec<MemoryDesc>,
) -> Result<(), PlanError> {
    let count = registration.kv_descs.len();
    let ids = registration.kv_layer_ids();
    if ids.is_some_and(|ids| ids.len() != count) {
        return Err(PlanError::Registration {
            reason: format!("{} kv layer ids for {count} kv entries", ids.map_or(0, <[u32]>::len)),
        });
    }
    let drafts = local.model.draft.map_or(0, |draft| draft.entries as usize);
    let is_draft = |entry: usize| match ids {
        Some(ids) => ids[entry] >= draft_layer_id(0),
        None => {
            drafts > 0 && entry + drafts >= count && local.layout.regions.iter().any(|r| r.kind == RegionKind::Draft)
        }
    };
    let targets = (0..count).filter(|entry| !is_draft(*entry)).count();
    let page = local.topology.page_size;
    if !registration.kv_item_lens.is_empty() && registration.kv_item_lens.len() != count {
        return Err(PlanError::Registration {
            reason: format!("{} kv item lengths for {count} kv entries", registration.kv_item_lens.len()),
        });
    }
    for (entry, desc) in registration.kv_descs.iter().enumerate() {
        // Without per-entry lengths every entry is taken to be entry 0's length (domain.md §2.6: callers that know
        // one decode item length pass `[dst_kv_item_len] * n_entries`).
        let item_len = registration.kv_item_lens.get(entry).copied().unwrap_or(registration.kv_item_len);
        let (kind, rows) = if is_draft(entry) {
            (RegionKind::Draft, page * registration.dcp_size())
        } else {
            let part = match local.model.attention {
                Attention::Mla { .. } => KvPart::Latent,
                Attention::Mha { .. } if entry < targets / 2 => KvPart::Key,
                Attention::Mha { .. } => KvPart::Value,
            };
            (RegionKind::Kv(part), page)
        };
        let layer = ids.map_or_else(|| guess_layer(local, entry), |ids| ids[entry]);
        layout.kv_entries.push(layout.regions.len() as u32);
        layout.regions.push(region(kind, layer, item_len, rows, desc));
        descs.push(*desc);
    }
    Ok(())
}

/// The outer count this rank holds tensor `tensor` of component `component` with: what a prefill assumes of a peer
/// that sent none (SGLang's prefill slices with its own `state_slice_outer_counts` for both sides).
fn own_outer(local: Local<'_>, component: usize, tensor: usize) -> u32 {
    let state = &local.layout.state;
    let tensors = local.model.state.get(component).map_or(1, |it| it.tensors.len().max(1));
    let outers = state.outer_counts.get(component);
    let per_tensor = outers.map_or(0, |outers| outers.len() / tensors);
    let held = outers.and_then(|outers| outers.get(tensor * per_tensor)).copied().filter(|_| per_tensor > 0);
    held.unwrap_or_else(|| match local.model.state.get(component).and_then(|it| it.tensors.get(tensor)) {
        Some(crate::model::StateTensor { shape: TensorShape::Sliced { outer_count, .. }, .. }) => *outer_count,
        _ => 1,
    })
}

/// Without ids, the layer of entry `i` is only a label: the local entry at the same position, if any.
fn guess_layer(local: Local<'_>, entry: usize) -> u32 {
    local.layout.kv_entries.get(entry).map_or(0, |index| local.layout.regions[*index as usize].layer)
}

/// State entries per component: item lengths, dims, layer ids and (frame 19) outer counts as advertised; kinds, conv
/// groups, and outer counts the peer did not send, from the local model (the Mori wire carries none of them).
fn state_regions(
    local: Local<'_>,
    registration: &Registration,
    layout: &mut RankLayout,
    descs: &mut Vec<MemoryDesc>,
) -> Result<(), PlanError> {
    let state = &mut layout.state;
    for (component, list) in registration.state_descs.iter().enumerate() {
        let Some(model_component) = local.model.state.get(component) else {
            return Err(PlanError::Registration {
                reason: format!(
                    "{} state components, the model has {}",
                    registration.state_descs.len(),
                    local.model.state.len()
                ),
            });
        };
        let lens = registration.state_item_lens.get(component);
        let advertised_outers =
            registration.state_outer_counts.get(component).filter(|outers| outers.len() == list.len());
        let ids = registration.state_layer_ids().get(component).filter(|ids| ids.len() == list.len());
        let per_tensor = list.len().div_ceil(model_component.tensors.len().max(1)).max(1);
        let mut regions = Vec::new();
        let (mut groups, mut outers) = (Vec::new(), Vec::new());
        for (entry, desc) in list.iter().enumerate() {
            let tensor_index = (entry / per_tensor).min(model_component.tensors.len().saturating_sub(1));
            let tensor = &model_component.tensors[tensor_index];
            let item_len = lens.and_then(|lens| lens.get(entry)).map_or(0, |len| u64::from(*len));
            let layer = ids.map_or(0, |ids| ids[entry]);
            let kind = RegionKind::State { component: component as u32, tensor: tensor_index as u32 };
            regions.push(layout.regions.len() as u32);
            layout.regions.push(region(kind, layer, item_len, 1, desc));
            descs.push(*desc);
            let group = match &tensor.shape {
                TensorShape::Sliced { groups, .. } => groups.clone(),
                TensorShape::Replicated { .. } => None,
            };
            groups.push(group);
            let own = || own_outer(local, component, tensor_index);
            outers.push(advertised_outers.map_or_else(own, |outers| outers[entry]));
        }
        state.kinds.push(model_component.kind);
        state.regions.push(regions);
        state.layer_ids.push(ids.cloned().unwrap_or_default());
        // An older peer's lists cover fewer components (domain.md §5.5): metadata exists where dims were sent.
        if let Some(dims) = registration.state_dims.get(component) {
            state.dims.push(dims.clone());
            state.conv_groups.push(groups);
            state.outer_counts.push(outers);
        }
    }
    Ok(())
}
