//! Mamba/KDA/GDN state slicing: dim-unit blocks (domain.md §5.3) and byte blocks (domain.md §5.4).

use super::PlanError;

/// One state tensor entry as one side advertises it (metadata read at that side's own entry index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorMeta {
    pub(crate) item_len: u64,
    /// `state_dim_per_tensor`: local size of the sliced axis; `None` when the peer sent no dims; `Some(0)` = replicated.
    pub(crate) dim: Option<u32>,
    /// Full widths of independently sharded sub-blocks (`state_conv_shard_groups`).
    pub(crate) groups: Option<Vec<u32>>,
    /// `state_slice_outer_counts`: rows before the sliced axis.
    pub(crate) outer_count: u32,
}

/// A byte range of one item copied to a byte offset of another item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    pub(crate) source: u64,
    pub(crate) target: u64,
    pub(crate) length: u64,
}

/// Ranks and sizes of one prefill → decode state connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shard {
    pub(crate) prefill_tp: u32,
    pub(crate) decode_tp: u32,
    /// `lp`, the prefill attention-TP rank.
    pub(crate) prefill_rank: u32,
    /// `ld`, the decode attention-TP rank.
    pub(crate) decode_rank: u32,
}

/// Byte blocks moving one Mamba state item from a prefill slot to a decode slot (domain.md §5.5 rules).
pub(crate) fn mamba_blocks(
    component: usize,
    entry: usize,
    source: &TensorMeta,
    target: &TensorMeta,
    shard: Shard,
) -> Result<Vec<Block>, PlanError> {
    let invalid = |reason: String| PlanError::StateMetadata { component, entry, reason };
    if source.outer_count != target.outer_count {
        return transposed_blocks(component, entry, source, target, shard);
    }
    if shard.prefill_tp == shard.decode_tp {
        // Same TP: whole item, and the slot sizes must agree (Mooncake's check; Mori WIP skipped it).
        if source.item_len != target.item_len {
            return Err(PlanError::MambaSlotSize { prefill: source.item_len, decode: target.item_len });
        }
        return Ok(vec![Block { source: 0, target: 0, length: source.item_len }]);
    }
    let (Some(source_dim), Some(target_dim)) = (source.dim, target.dim) else {
        // No dims from an older peer: only a layout-preserving whole copy is possible.
        if source.item_len != target.item_len {
            return Err(PlanError::MambaLayouts { prefill: source.item_len, decode: target.item_len });
        }
        return Ok(vec![Block { source: 0, target: 0, length: source.item_len }]);
    };
    if (source_dim == 0) != (target_dim == 0) {
        return Err(PlanError::ReplicationMetadata { component, entry, prefill: source_dim, decode: target_dim });
    }
    if source_dim == 0 {
        // A replicated tensor under a TP change (SGLang 0.5.23 `compute_mamba_state_slice_byte_blocks`,
        // `disaggregation/utils.py:1004-1016`): the whole slot, equal on both sides. Its one writer per decode rank
        // (`should_send_replicated_state`, `utils.py:872-904`) is the link's choice (only the group's first prefill
        // rank keeps whole-item entries when prefill TP is larger).
        if source.item_len != target.item_len {
            return Err(PlanError::ReplicatedItemLength { prefill: source.item_len, decode: target.item_len });
        }
        return Ok(vec![Block { source: 0, target: 0, length: source.item_len }]);
    }
    let (source_dim, target_dim) = (u64::from(source_dim), u64::from(target_dim));
    check_dims((source_dim, target_dim), shard).map_err(invalid)?;
    let outer = u64::from(source.outer_count);
    if outer == 0 || source.item_len % outer != 0 || target.item_len % outer != 0 {
        return Err(invalid(format!(
            "outer count {outer} does not divide item lengths {} and {}",
            source.item_len, target.item_len
        )));
    }
    let (source_row, target_row) = (source.item_len / outer, target.item_len / outer);
    if source_row % source_dim != 0
        || target_row % target_dim != 0
        || source_row / source_dim != target_row / target_dim
    {
        return Err(invalid(format!(
            "rows of {source_row} B / dim {source_dim} and {target_row} B / dim {target_dim} give different unit sizes"
        )));
    }
    let unit = source_row / source_dim;
    check_groups(source.groups.as_deref(), source_dim, shard).map_err(invalid)?;
    let units = dim_blocks(source_dim, source.groups.as_deref(), shard);
    let mut res = Vec::with_capacity(units.len() * outer as usize);
    for row in 0..outer {
        for (source_unit, target_unit, count) in &units {
            res.push(Block {
                source: row * source_row + source_unit * unit,
                target: row * target_row + target_unit * unit,
                length: count * unit,
            });
        }
    }
    Ok(res)
}

/// Both sides' local dims must make one full dim.
fn check_dims((source_dim, target_dim): (u64, u64), shard: Shard) -> Result<(), String> {
    let (prefill_tp, decode_tp) = (u64::from(shard.prefill_tp), u64::from(shard.decode_tp));
    if source_dim * prefill_tp != target_dim * decode_tp {
        return Err(format!(
            "dims disagree: prefill {source_dim} x tp {prefill_tp} != decode {target_dim} x tp {decode_tp}"
        ));
    }
    Ok(())
}

/// The conv sub-blocks must cover the full dim and split over both sides' TP.
fn check_groups(groups: Option<&[u32]>, source_dim: u64, shard: Shard) -> Result<(), String> {
    let (prefill_tp, decode_tp) = (u64::from(shard.prefill_tp), u64::from(shard.decode_tp));
    let full = source_dim * prefill_tp;
    let Some(groups) = groups else { return Ok(()) };
    let total: u64 = groups.iter().map(|group| u64::from(*group)).sum();
    if total != full {
        return Err(format!("conv shard groups {groups:?} sum to {total}, not the full dim {full}"));
    }
    if let Some(group) =
        groups.iter().find(|group| u64::from(**group) % prefill_tp != 0 || u64::from(**group) % decode_tp != 0)
    {
        return Err(format!("conv shard group {group} does not split over tp {prefill_tp} and {decode_tp}"));
    }
    Ok(())
}

/// A tensor the two sides hold in different element orders (kvrelay's frame 19 told the prefill the decode's outer
/// count; `src/pure/plan/SGLANG.md`, "Per-side conv layout"): channel-major `[dim, taps]` (outer 1) on one side,
/// window-major `[taps, dim]` (outer `taps`) on the other, the same bytes per channel. Every (channel, tap) element
/// moves on its own, to the place the target's order gives it; the channels each decode rank takes are
/// [`dim_blocks`]' as for any slice. SGLang 0.5.23 cannot express it: it slices with the prefill's outer count on
/// both sides (`compute_mamba_state_slice_byte_blocks`, `disaggregation/utils.py:979-1042`).
fn transposed_blocks(
    component: usize,
    entry: usize,
    source: &TensorMeta,
    target: &TensorMeta,
    shard: Shard,
) -> Result<Vec<Block>, PlanError> {
    let invalid = |reason: String| PlanError::StateMetadata { component, entry, reason };
    let (source_outer, target_outer) = (u64::from(source.outer_count), u64::from(target.outer_count));
    let (Some(source_dim), Some(target_dim)) = (source.dim.filter(|dim| *dim > 0), target.dim.filter(|dim| *dim > 0))
    else {
        return Err(invalid(format!(
            "outer counts differ (prefill {source_outer}, decode {target_outer}) on a tensor without sliced dims: no channel axis to transpose"
        )));
    };
    let (source_dim, target_dim) = (u64::from(source_dim), u64::from(target_dim));
    check_dims((source_dim, target_dim), shard).map_err(invalid)?;
    let taps = source_outer.max(target_outer);
    if source_outer.min(target_outer) != 1 {
        return Err(invalid(format!(
            "outer counts {source_outer} (prefill) and {target_outer} (decode) are not one layout transposed: one side must be channel-major (outer 1)"
        )));
    }
    let channel = source.item_len / source_dim;
    if source.item_len % source_dim != 0
        || target.item_len % target_dim != 0
        || target.item_len / target_dim != channel
        || channel % taps != 0
    {
        return Err(invalid(format!(
            "items of {} B / dim {source_dim} and {} B / dim {target_dim} do not hold {taps} equal taps per channel on both sides",
            source.item_len, target.item_len
        )));
    }
    check_groups(source.groups.as_deref(), source_dim, shard).map_err(invalid)?;
    let element = channel / taps;
    // Byte offset of (channel, tap) in one side's item.
    let place = |outer: u64, dim: u64, channel: u64, tap: u64| match outer {
        1 => (channel * taps + tap) * element,
        _ => (tap * dim + channel) * element,
    };
    let units = dim_blocks(source_dim, source.groups.as_deref(), shard);
    let mut res: Vec<Block> = Vec::new();
    for tap in 0..taps {
        for (source_unit, target_unit, count) in &units {
            for index in 0..*count {
                let block = Block {
                    source: place(source_outer, source_dim, source_unit + index, tap),
                    target: place(target_outer, target_dim, target_unit + index, tap),
                    length: element,
                };
                match res.last_mut() {
                    Some(last)
                        if last.source + last.length == block.source && last.target + last.length == block.target =>
                    {
                        last.length += element;
                    }
                    _ => res.push(block),
                }
            }
        }
    }
    Ok(res)
}

/// `compute_mamba_state_slice_blocks` in dim units: `(source unit, target unit, count)` (domain.md §5.3).
fn dim_blocks(source_dim: u64, groups: Option<&[u32]>, shard: Shard) -> Vec<(u64, u64, u64)> {
    let (prefill_tp, decode_tp) = (u64::from(shard.prefill_tp), u64::from(shard.decode_tp));
    let (prefill_rank, decode_rank) = (u64::from(shard.prefill_rank), u64::from(shard.decode_rank));
    let groups: Vec<u64> = match groups {
        Some(groups) => groups.iter().map(|group| u64::from(*group)).collect(),
        None => vec![source_dim * prefill_tp],
    };
    let mut res = Vec::new();
    let (mut source_offset, mut target_offset) = (0, 0);
    for group in groups {
        let (source_width, target_width) = (group / prefill_tp, group / decode_tp);
        if prefill_tp > decode_tp {
            // Aggregation: this prefill rank's slice lands at its position among the decode rank's w senders.
            let position = prefill_rank % (prefill_tp / decode_tp);
            res.push((source_offset, target_offset + position * source_width, source_width));
        } else {
            // Scatter: the decode rank takes its slice of this prefill rank's sub-block.
            res.push((source_offset + (decode_rank * target_width) % source_width, target_offset, target_width));
        }
        source_offset += source_width;
        target_offset += target_width;
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(item_len: u64, dim: u32, groups: Option<Vec<u32>>, outer_count: u32) -> TensorMeta {
        TensorMeta { item_len, dim: Some(dim), groups, outer_count }
    }

    fn shard(prefill_tp: u32, decode_tp: u32, prefill_rank: u32, decode_rank: u32) -> Shard {
        Shard { prefill_tp, decode_tp, prefill_rank, decode_rank }
    }

    fn triples(blocks: &[Block]) -> Vec<(u64, u64, u64)> {
        blocks.iter().map(|block| (block.source, block.target, block.length)).collect()
    }

    /// domain.md §5.4, PR #37358 test: TP1 -> TP8 rank 3, item 96 B, dims 24 -> 3, groups [8, 8, 8].
    #[test]
    fn pr_test_grouped_conv_gives_three_four_byte_blocks() {
        let blocks =
            mamba_blocks(0, 0, &meta(96, 24, Some(vec![8, 8, 8]), 1), &meta(12, 3, None, 1), shard(1, 8, 0, 3));
        assert_eq!(triples(&blocks.unwrap()), vec![(12, 0, 4), (44, 4, 4), (76, 8, 4)]);
    }

    /// domain.md §5.4: K3 temporal TP1 -> TP8 rank 5, 96 heads of 64 KiB.
    #[test]
    fn k3_temporal_rank_five_takes_heads_60_to_71() {
        let blocks =
            mamba_blocks(0, 0, &meta(96 * 65536, 96, None, 1), &meta(12 * 65536, 12, None, 1), shard(1, 8, 0, 5));
        assert_eq!(triples(&blocks.unwrap()), vec![(3_932_160, 0, 786_432)]);
    }

    /// domain.md §5.4: K3 conv TP1 -> TP8 rank 5, q=k=v=12288, three rows, bf16: nine blocks.
    #[test]
    fn k3_conv_rank_five_slices_each_sub_block_per_row() {
        let source = meta(221_184, 36864, Some(vec![12288; 3]), 3);
        let blocks = mamba_blocks(0, 0, &source, &meta(27_648, 4608, None, 3), shard(1, 8, 0, 5)).unwrap();
        assert_eq!(blocks.len(), 9);
        assert_eq!(
            triples(&blocks[..4]),
            vec![(15360, 0, 3072), (39936, 3072, 3072), (64512, 6144, 3072), (89088, 9216, 3072)]
        );
    }

    /// domain.md §5.4: Qwen3-Next conv [dim, K-1], TP1 -> TP4 rank 1, groups [2048, 2048, 4096], 6 B per unit.
    #[test]
    fn qwen3_next_conv_rank_one_uses_uneven_groups() {
        let source = meta(8192 * 6, 8192, Some(vec![2048, 2048, 4096]), 1);
        let blocks = mamba_blocks(0, 0, &source, &meta(2048 * 6, 2048, None, 1), shard(1, 4, 0, 1)).unwrap();
        assert_eq!(triples(&blocks), vec![(3072, 0, 3072), (15360, 3072, 3072), (30720, 6144, 6144)]);
    }

    /// domain.md §5.4: aggregation TP4 -> TP2, prefill rank 3, temporal 8 local heads -> 16.
    #[test]
    fn aggregation_places_prefill_rank_three_in_the_second_half() {
        let blocks =
            mamba_blocks(0, 0, &meta(8 * 65536, 8, None, 1), &meta(16 * 65536, 16, None, 1), shard(4, 2, 3, 1));
        assert_eq!(triples(&blocks.unwrap()), vec![(0, 524_288, 524_288)]);
    }

    /// A channel-major conv `[4, 3]` of 2-byte taps on prefill TP1, window-major `[3, 2]` on decode TP2 rank 1:
    /// channels 2 and 3, every tap its own 2-byte element, in the decode's tap-major order.
    #[test]
    fn a_transposed_decode_takes_each_channel_tap_to_its_own_order() {
        let blocks = mamba_blocks(0, 0, &meta(24, 4, None, 1), &meta(12, 2, None, 3), shard(1, 2, 0, 1)).unwrap();
        assert_eq!(triples(&blocks), vec![(12, 0, 2), (18, 2, 2), (14, 4, 2), (20, 6, 2), (16, 8, 2), (22, 10, 2)]);
        // And back: window-major on prefill TP2 rank 1 into a channel-major decode TP1 (aggregation, channels 2, 3).
        let blocks = mamba_blocks(0, 0, &meta(12, 2, None, 3), &meta(24, 4, None, 1), shard(2, 1, 1, 0)).unwrap();
        assert_eq!(triples(&blocks), vec![(0, 12, 2), (2, 18, 2), (4, 14, 2), (6, 20, 2), (8, 16, 2), (10, 22, 2)]);
    }

    /// Equal TP, different orders: no whole-item copy (the bytes would land scrambled), every element transposed.
    #[test]
    fn equal_tp_with_another_order_is_transposed_not_copied_whole() {
        let blocks = mamba_blocks(0, 0, &meta(12, 2, None, 1), &meta(12, 2, None, 3), shard(2, 2, 1, 1)).unwrap();
        assert_eq!(triples(&blocks), vec![(0, 0, 2), (6, 2, 2), (2, 4, 2), (8, 6, 2), (4, 8, 2), (10, 10, 2)]);
    }

    #[test]
    fn outer_counts_that_are_not_one_layout_transposed_are_a_clear_error() {
        let error = mamba_blocks(0, 2, &meta(36, 2, None, 3), &meta(36, 2, None, 6), shard(1, 1, 0, 0)).unwrap_err();
        assert_eq!(error.kind(), crate::plan::PlanErrorKind::StateMetadata);
        assert!(error.to_string().contains("outer counts 3 (prefill) and 6 (decode) are not one layout transposed"));
    }

    #[test]
    fn groups_that_miss_the_full_dim_are_a_clear_error() {
        let res = mamba_blocks(1, 4, &meta(96, 24, Some(vec![8, 8, 16]), 1), &meta(12, 3, None, 1), shard(1, 8, 0, 3));
        let error = res.unwrap_err();
        assert_eq!(error.kind(), crate::plan::PlanErrorKind::StateMetadata);
        assert_eq!(
            error.to_string(),
            "invalid state metadata for component 1 entry 4: conv shard groups [8, 8, 16] sum to 32, not the full dim 24"
        );
    }

    #[test]
    fn same_tp_slot_sizes_must_match() {
        let res = mamba_blocks(0, 0, &meta(96, 24, None, 1), &meta(100, 24, None, 1), shard(2, 2, 1, 1));
        let error = res.unwrap_err();
        assert_eq!(error.kind(), crate::plan::PlanErrorKind::StateLayout);
        assert_eq!(error, PlanError::MambaSlotSize { prefill: 96, decode: 100 });
    }

    #[test]
    fn replicated_state_moves_whole_under_a_tp_change() {
        let res = mamba_blocks(0, 0, &meta(96, 0, None, 1), &meta(96, 0, None, 1), shard(1, 2, 0, 1));
        assert_eq!(res, Ok(vec![Block { source: 0, target: 0, length: 96 }]));
    }

    #[test]
    fn replicated_on_one_side_only_is_refused() {
        let res = mamba_blocks(0, 3, &meta(96, 0, None, 1), &meta(48, 24, None, 1), shard(1, 2, 0, 1));
        assert_eq!(res, Err(PlanError::ReplicationMetadata { component: 0, entry: 3, prefill: 0, decode: 24 }));
        let res = mamba_blocks(0, 0, &meta(96, 0, None, 1), &meta(64, 0, None, 1), shard(2, 1, 0, 0));
        assert_eq!(res, Err(PlanError::ReplicatedItemLength { prefill: 96, decode: 64 }));
    }
}
