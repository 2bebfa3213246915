"""Call each SGLang 0.5.23 PD planning helper once with small realistic inputs.

Run:  venv/bin/python demo.py   (venv has numpy only; no torch, no sglang deps)
"""

import sys
import types

import numpy as np

import load_helpers

H = load_helpers.load()
print(f"sglang {H.version} helpers loaded from wheel; torch in sys.modules: {'torch' in sys.modules}")


def hdr(t):
    print("\n" + "=" * 78 + f"\n{t}\n" + "=" * 78)


# ---------------------------------------------------------------------------
hdr("1. group_concurrent_contiguous (page-index runs, as used by send_kvcache)")
src = np.array([3, 4, 5, 9, 10, 20], dtype=np.int32)
dst = np.array([7, 8, 9, 10, 11, 30], dtype=np.int32)
sg, dg = H.group_concurrent_contiguous(src, dst)
print("src", src.tolist(), "dst", dst.tolist())
print("-> src groups", sg, "\n-> dst groups", dg)
item_len = 16 * 8 * 128 * 2  # one page of one K layer: page 16, 8 heads, hd 128, bf16
print("byte copies for one layer entry (src_off, dst_off, len), item_len =", item_len)
for s, d in zip(sg, dg):
    print("  ", (s[0] * item_len, d[0] * item_len, len(s) * item_len))
print("empty side ->", H.group_concurrent_contiguous(np.array([1, 2]), np.array([], dtype=np.int32)))
try:
    H.group_concurrent_contiguous(np.array([1, 2]), np.array([1]))
except ValueError as e:
    print("unequal sizes ->", type(e).__name__, e)

# ---------------------------------------------------------------------------
hdr("2. build_dcp_token_transfer_plan: prefill DCP1 page 16 -> decode DCP2")
P, D = 16, 2
decode_prefix_len = 32  # must be a multiple of P*D = 32
req_len = 102  # tokens [32, 102) are transferred (70 tokens)
# decode's page table after the prefix (one entry per virtual page of P*D tokens,
# = one physical page of P rows on every DCP rank)
dst_pages = np.array([7, 8, 12], dtype=np.int32)
# prefill sends in two chunks (non-last chunks end on a page boundary)
chunks = [
    dict(src_pages=np.array([100, 101, 102], dtype=np.int32), tok=(32, 80)),
    dict(src_pages=np.array([40, 41], dtype=np.int32), tok=(80, 102)),
]
seen = {}
for ci, c in enumerate(chunks):
    t0, t1 = c["tok"]
    src_page_offset = (t0 - decode_prefix_len) // P  # == kv_chunk.index_slice.start
    for rank in range(D):
        plan = H.build_dcp_token_transfer_plan(
            c["src_pages"], dst_pages,
            physical_page_size=P, dcp_size=D, dcp_rank=rank,
            src_page_offset=src_page_offset, decode_prefix_len=decode_prefix_len,
            num_kv_tokens=t1 - t0,
        )
        ts, td = plan.target_src_token_indices, plan.target_dst_token_indices
        print(f"chunk {ci} tokens [{t0},{t1}) src_page_offset={src_page_offset} -> decode dcp_rank {rank}:")
        print(f"   target src rows ({ts.size}) {ts[:6].tolist()} ... {ts[-3:].tolist()}")
        print(f"   target dst rows ({td.size}) {td[:6].tolist()} ... {td[-3:].tolist()}")
        g = H.group_concurrent_contiguous(ts, td)
        print(f"   grouped runs: {len(g[0])} (src stride is D, so runs are 1 token long)")
        if ci == 1 and rank == 0:
            print(f"   draft src rows ({plan.draft_src_token_indices.size}) {plan.draft_src_token_indices[:4].tolist()} ...")
            print(f"   draft dst rows {plan.draft_dst_token_indices[:4].tolist()} ... (draft page size P*D={P*D})")
            gd = H.group_concurrent_contiguous(plan.draft_src_token_indices, plan.draft_dst_token_indices)
            print(f"   draft runs: {[(s[0], d[0], len(s)) for s, d in zip(*gd)]}")
        # independent check: token t (absolute) lives on rank t % D at local
        # row (t - prefix)//D of the post-prefix page list
        t_abs = t0 + (np.arange(t1 - t0))
        mine = t_abs[t_abs % D == rank]
        local = (mine - decode_prefix_len) // D
        exp_dst = dst_pages[local // P].astype(np.int64) * P + local % P
        rel = mine - t0
        exp_src = c["src_pages"][rel // P].astype(np.int64) * P + rel % P
        assert np.array_equal(exp_dst, td) and np.array_equal(exp_src, ts), "mismatch"
        for t, d in zip(mine.tolist(), td.tolist()):
            seen[(rank, d)] = seen.get((rank, d), []) + [t]
print("independent check passed: every token in [32,102) written once to (rank t%2,"
      f" row); distinct (rank,row) slots = {len(seen)}, duplicates = {sum(len(v) > 1 for v in seen.values())}")
tok_bytes = 576 * 2  # MLA kv_lora_rank 512 + rope 64, bf16 -> item_len // page_size
print(f"byte copy example, MLA layer entry, token_item_len={tok_bytes}: first 3 copies of chunk 1 / rank 1:")
plan = H.build_dcp_token_transfer_plan(chunks[1]["src_pages"], dst_pages, physical_page_size=P, dcp_size=D,
                                       dcp_rank=1, src_page_offset=3, decode_prefix_len=32, num_kv_tokens=22)
for s, d in list(zip(*H.group_concurrent_contiguous(plan.target_src_token_indices, plan.target_dst_token_indices)))[:3]:
    print("   (src_off, dst_off, len) =", (s[0] * tok_bytes, d[0] * tok_bytes, len(s) * tok_bytes))
try:
    H.build_dcp_token_transfer_plan(dst_pages, dst_pages, physical_page_size=16, dcp_size=2, dcp_rank=0,
                                    decode_prefix_len=16, num_kv_tokens=10)
except ValueError as e:
    print("misaligned decode_prefix_len ->", e)

# ---------------------------------------------------------------------------
hdr("3. build_transfer_entry_pairs (prefill entry i -> decode entry j)")
# prefill PP stage 1 of 2 owns layers 2,3 and registers [K2,K3,V2,V3];
# decode (PP1) registers [K0..K3, V0..V3]
src_ids, dst_ids = [2, 3, 2, 3], [0, 1, 2, 3, 0, 1, 2, 3]
print("src ids", src_ids, "dst ids", dst_ids, "->", H.build_transfer_entry_pairs(src_ids, dst_ids, 4, 8))
print("no ids, equal counts ->", H.build_transfer_entry_pairs([], [], 4, 4))
print("one side ids + positional fallback ->",
      H.build_transfer_entry_pairs([0, 1], [], 2, 3, allow_positional_fallback=True))
for args in (([], [], 4, 8), ([0, 1], [], 2, 2), ([5], [0, 1], 1, 2)):
    try:
        H.build_transfer_entry_pairs(*args)
    except RuntimeError as e:
        print(f"  {args} -> RuntimeError: {e}")

# ---------------------------------------------------------------------------
hdr("4. resolve_dcp_dst_entry_indices (decode entry index per prefill entry)")
print("no ids, n_src=4 n_dst=5 (decode has a draft entry) ->", H.resolve_dcp_dst_entry_indices([], [], 4, 5))
# MLA target layers 0..3 + one draft entry remapped to band id 4 (num_hidden_layers=4)
print("ids ->", H.resolve_dcp_dst_entry_indices([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 5, 5))
print("PP stage [2,3] into full decode ->", H.resolve_dcp_dst_entry_indices([2, 3], [0, 1, 2, 3], 2, 4))

# ---------------------------------------------------------------------------
hdr("5. compute_mamba_state_slice_byte_blocks (per state slot, bytes)")
# Qwen3-Next-like GDN: key_dim = 16*128, value_dim = 32*128, conv kernel 4, bf16
key_dim, value_dim, K, bf16 = 2048, 2048 * 2, 4, 2
conv_groups = [key_dim, key_dim, value_dim]
conv_dim = sum(conv_groups)


def conv_item(tp):  # conv_state slot [conv_dim/tp, K-1]
    return conv_dim // tp * (K - 1) * bf16


print(f"conv_state: conv_dim={conv_dim} groups={conv_groups}; item_len TP1={conv_item(1)} TP2={conv_item(2)}")
for dst_rank in range(2):
    b = H.compute_mamba_state_slice_byte_blocks(
        src_item_len=conv_item(1), dst_item_len=conv_item(2), src_dim=conv_dim, dst_dim=conv_dim // 2,
        outer_count=1, src_attn_tp_size=1, dst_attn_tp_size=2, dst_tp_rank_in_group=dst_rank,
        local_tp_rank_in_group=0, conv_shard_groups=conv_groups)
    print(f"  scatter TP1->TP2, decode rank {dst_rank}: (src_off, dst_off, len) = {b}")
for writer in range(2):
    b = H.compute_mamba_state_slice_byte_blocks(
        src_item_len=conv_item(2), dst_item_len=conv_item(1), src_dim=conv_dim // 2, dst_dim=conv_dim,
        outer_count=1, src_attn_tp_size=2, dst_attn_tp_size=1, dst_tp_rank_in_group=0,
        local_tp_rank_in_group=writer, conv_shard_groups=conv_groups)
    print(f"  aggregate TP2->TP1, prefill writer {writer}: {b}")
b = H.compute_mamba_state_slice_byte_blocks(
    src_item_len=conv_item(1), dst_item_len=conv_item(2), src_dim=conv_dim, dst_dim=conv_dim // 2,
    outer_count=1, src_attn_tp_size=1, dst_attn_tp_size=2, dst_tp_rank_in_group=1,
    local_tp_rank_in_group=0, conv_shard_groups=None)
print(f"  same, conv_shard_groups=None (legacy contiguous slice), decode rank 1: {b}")
# temporal state slot [num_v_heads/tp, head_k_dim, head_v_dim] fp32
tmp = lambda tp: 32 // tp * 128 * 128 * 4
b = H.compute_mamba_state_slice_byte_blocks(
    src_item_len=tmp(1), dst_item_len=tmp(2), src_dim=32, dst_dim=16, outer_count=1,
    src_attn_tp_size=1, dst_attn_tp_size=2, dst_tp_rank_in_group=1, local_tp_rank_in_group=0)
print(f"  temporal TP1->TP2 decode rank 1: {b}")
# Kimi-style conv [K-1, slice_dim]: one block per conv row (outer_count = K-1)
b = H.compute_mamba_state_slice_byte_blocks(
    src_item_len=3 * 1024 * 2, dst_item_len=3 * 512 * 2, src_dim=1024, dst_dim=512, outer_count=3,
    src_attn_tp_size=1, dst_attn_tp_size=2, dst_tp_rank_in_group=1, local_tp_rank_in_group=0)
print(f"  Kimi-style outer_count=3, TP1->TP2 decode rank 1: {b}")
for r in range(4):
    b = H.compute_mamba_state_slice_byte_blocks(
        src_item_len=256, dst_item_len=256, src_dim=0, dst_dim=0, outer_count=1,
        src_attn_tp_size=4, dst_attn_tp_size=2, dst_tp_rank_in_group=0, local_tp_rank_in_group=r)
    print(f"  replicated item (dim 0) TP4->TP2, prefill rank {r}: {b}")

# ---------------------------------------------------------------------------
hdr("6. head-slice rule: compute_head_slice_params (common/staging_buffer.py:773)")
print("returns (src_head_start, num_heads_to_send, dst_head_start, num_heads_to_send)")
def global_heads(rank, tp, total):
    """Global KV heads held by attn-TP rank `rank` (SGLang: rank // replicas when total < tp)."""
    if total >= tp:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total)]


for total, ptp, dtp in ((8, 2, 4), (8, 4, 2), (2, 1, 4), (4, 8, 2), (2, 4, 8)):
    print(f" total_kv_heads={total} prefill TP{ptp} -> decode TP{dtp}")
    for d in range(dtp):
        # which prefill rank(s) this decode rank pulls from (decode side, common/conn.py:1432)
        dec = load_helpers.make_manager_view(H, attn_tp_size=dtp, engine_rank=d)
        info = types.SimpleNamespace(attn_tp_size=ptp, attn_cp_size=1, pp_size=1,
                                     enable_kv_cache_sharding=False, enable_dsa_cache_layer_split=False)
        dec._resolve_rank_mapping(info)
        parts, ok = [], True
        want = global_heads(d, dtp, total)
        got = [None] * len(want)
        for p in info.target_tp_ranks:
            sh, n, dh, _ = H.compute_head_slice_params(ptp, dtp, p, d, total)
            sent = global_heads(p, ptp, total)[sh:sh + n]
            for k, g in enumerate(sent):
                if got[dh + k] is not None and got[dh + k] != g:
                    ok = False
                got[dh + k] = g
            parts.append(f"P{p}: src_head_start={sh} n={n} dst_head_start={dh} (global {sent})")
        ok = ok and got == want
        print(f"   D{d} (needs {want}) <- " + "; ".join(parts) + ("  OK" if ok else "  MISMATCH"))

print("\n Mooncake send_kvcache_slice byte math (mooncake/conn.py:1681-1753) for total=8, P TP2 -> D TP4,"
      " prefill rank 1 -> decode rank 3, page_size=16, head_dim=128, bf16:")
total, ptp, dtp, ps, hd = 8, 2, 4, 16, 128
src_item = ps * (total // ptp) * hd * 2
dst_item = ps * (total // dtp) * hd * 2
sh, n, dh, _ = H.compute_head_slice_params(ptp, dtp, 1, 3, total)
bph = dst_item // ps // max(1, total // dtp)
print(f"   src_item_len={src_item} dst_item_len={dst_item} bytes/head={bph} "
      f"src_off_in_token={sh * bph} dst_off_in_token={dh * bph} len/token={n * bph}")
print(f"   copy for src page p, dst page q, token slot t: src = K_l + p*{src_item} + t*{src_item // ps} + {sh * bph};"
      f" dst = K_l' + q*{dst_item} + t*{dst_item // ps} + {dh * bph}; len {n * bph}")

print("\n common/conn.py:_get_mha_head_slice_blocks via a CommonKVManager stand-in"
      " (2 layers, pages [5] -> [9], page_size 2, 8 heads total, P TP2 -> D TP4, P rank 1 -> D rank 3):")
ps2, hd2 = 2, 4  # tiny: head_len = 4 bytes
mgr = load_helpers.make_manager_view(H, attn_tp_size=2, engine_rank=1, page_size=ps2, total_kv_head_num=8)
src_len, dst_len = ps2 * 4 * hd2, ps2 * 2 * hd2
blocks = mgr._get_mha_head_slice_blocks(
    src_ptrs=[0x1000, 0x2000, 0x3000, 0x4000], src_item_lens=[src_len] * 4,
    dst_ptrs=[0x10000, 0x20000, 0x30000, 0x40000], dst_item_lens=[dst_len] * 4,
    src_page_indices=np.array([5]), dst_page_indices=np.array([9]), dst_attn_tp_size=4, dst_tp_rank=3)
for s, d, L in blocks:
    print("   src", [hex(x) for x in s.tolist()], "dst", [hex(x) for x in d.tolist()], "len", L)

print("\n DCP per-token item lens check (common/conn.py:551), MLA 4 layers + 1 draft entry, P=16 D=2:")
m = load_helpers.make_manager_view(H, attn_tp_size=1, is_mla_backend=True, page_size=16,
                                   kv_item_lens=[16 * 1152] * 5, num_draft_entries=1)
print("   requires_dcp_relayout(2, 1) ->", m.requires_dcp_relayout(2, 1))
print("   prepare_dcp_token_item_lens ->", m.prepare_dcp_token_item_lens([16 * 1152] * 4 + [32 * 1152], 2))
print("\nall demo sections ran; torch in sys.modules:", "torch" in sys.modules)
