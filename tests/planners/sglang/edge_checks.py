"""Probe edge behaviour of the loaded helpers (inputs outside the happy path)."""
import numpy as np
import load_helpers
H = load_helpers.load()

def run(label, f):
    try:
        r = f()
        print(f"{label}: OK -> {r}")
    except Exception as e:
        print(f"{label}: {type(e).__name__}: {e}")

P, D = 16, 2
sp = np.array([10, 11], dtype=np.int32)
run("dcp: dcp_rank=3 >= dcp_size=2 (no validation)", lambda: H.build_dcp_token_transfer_plan(
    sp, np.array([5]), physical_page_size=P, dcp_size=D, dcp_rank=3, num_kv_tokens=4).target_dst_token_indices.tolist())
run("dcp: dst pages too short (32 tokens need 1 virtual page; give 0)", lambda: H.build_dcp_token_transfer_plan(
    sp, np.array([], dtype=np.int32), physical_page_size=P, dcp_size=D, dcp_rank=0, num_kv_tokens=32))
run("dcp: num_kv_tokens=40 > 2 src pages*16", lambda: H.build_dcp_token_transfer_plan(
    sp, np.array([5, 6]), physical_page_size=P, dcp_size=D, dcp_rank=0, num_kv_tokens=40))
run("dcp: num_kv_tokens=None -> assumes full pages (size of target rows)", lambda: H.build_dcp_token_transfer_plan(
    sp, np.array([5]), physical_page_size=P, dcp_size=D, dcp_rank=0).target_src_token_indices.size)
run("dcp: src_page_offset=1 with 1 dst page (needs rows past page 0?)", lambda: H.build_dcp_token_transfer_plan(
    sp, np.array([5]), physical_page_size=P, dcp_size=D, dcp_rank=0, src_page_offset=1, num_kv_tokens=32).target_dst_token_indices.tolist())
run("dcp: dcp_size=1 (degenerate) equals identity page mapping", lambda: H.build_dcp_token_transfer_plan(
    sp, np.array([5, 6]), physical_page_size=4, dcp_size=1, dcp_rank=0, num_kv_tokens=6).target_dst_token_indices.tolist())
run("group: python lists instead of ndarrays", lambda: H.group_concurrent_contiguous([1, 2], [3, 4]))
run("group: descending runs are not merged", lambda: H.group_concurrent_contiguous(np.array([5, 4, 3]), np.array([1, 2, 3])))
run("pairs: dst has an extra entry for layer 1 (silently unused)", lambda: H.build_transfer_entry_pairs([0, 1], [0, 1, 1], 2, 3))
run("pairs: n_src=0 with inconsistent metadata", lambda: H.build_transfer_entry_pairs([7], [], 0, 5))
run("pairs: positional fallback with n_dst > n_src (MHA K/V halves!)", lambda: H.build_transfer_entry_pairs([], [], 4, 6, allow_positional_fallback=True))
run("pairs: layer ids present but lengths mismatch", lambda: H.build_transfer_entry_pairs([0, 1], [0, 1], 2, 3))
run("resolve_dcp: one-sided ids", lambda: H.resolve_dcp_dst_entry_indices([0, 1], [], 2, 2))
run("mamba: src/dst bytes-per-dim differ (fp32 src, bf16 dst), TP1->TP2", lambda: H.compute_mamba_state_slice_byte_blocks(
    src_item_len=32 * 4, dst_item_len=16 * 2, src_dim=32, dst_dim=16, outer_count=1,
    src_attn_tp_size=1, dst_attn_tp_size=2, dst_tp_rank_in_group=1, local_tp_rank_in_group=0))
run("mamba: item_len not divisible by dim (truncating //)", lambda: H.compute_mamba_state_slice_byte_blocks(
    src_item_len=100, dst_item_len=50, src_dim=3, dst_dim=2, outer_count=1,
    src_attn_tp_size=1, dst_attn_tp_size=2, dst_tp_rank_in_group=1, local_tp_rank_in_group=0))
run("mamba: conv_shard_groups sum mismatch silently falls back to contiguous", lambda: H.compute_mamba_state_slice_byte_blocks(
    src_item_len=8192 * 6, dst_item_len=4096 * 6, src_dim=8192, dst_dim=4096, outer_count=1,
    src_attn_tp_size=1, dst_attn_tp_size=2, dst_tp_rank_in_group=1, local_tp_rank_in_group=0,
    conv_shard_groups=[2048, 2048, 4000]))
run("mamba: aggregation with dst_dim != src_dim*writers (not validated)", lambda: H.compute_mamba_state_slice_byte_blocks(
    src_item_len=16 * 2, dst_item_len=16 * 2, src_dim=16, dst_dim=16, outer_count=1,
    src_attn_tp_size=2, dst_attn_tp_size=1, dst_tp_rank_in_group=0, local_tp_rank_in_group=1))
run("mamba: equal TP (1->1) contiguous whole item", lambda: H.compute_mamba_state_slice_byte_blocks(
    src_item_len=64, dst_item_len=64, src_dim=8, dst_dim=8, outer_count=1,
    src_attn_tp_size=2, dst_attn_tp_size=2, dst_tp_rank_in_group=1, local_tp_rank_in_group=1))
run("head: total_kv_heads=6 P TP4 -> D TP2 (non-divisible)", lambda: [H.compute_head_slice_params(4, 2, p, 0, 6) for p in range(2)])
run("head: src_tp_rank given as global engine rank 5 with attn_tp 4 (mod applied)", lambda: H.compute_head_slice_params(4, 8, 5, 3, 8))
