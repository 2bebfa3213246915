"""Sweep compute_head_slice_params + decode rank mapping over TP/head combos and
check every decode rank receives exactly the global KV heads it owns."""
import types
import load_helpers
H = load_helpers.load()

def global_heads(rank, tp, total):
    if total >= tp:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total)]

bad = 0; n = 0
for total in (1, 2, 4, 8, 16):
    for ptp in (1, 2, 4, 8, 16):
        for dtp in (1, 2, 4, 8, 16):
            if ptp == dtp:
                continue
            for d in range(dtp):
                dec = load_helpers.make_manager_view(H, attn_tp_size=dtp, engine_rank=d)
                info = types.SimpleNamespace(attn_tp_size=ptp, attn_cp_size=1, pp_size=1,
                                             enable_kv_cache_sharding=False, enable_dsa_cache_layer_split=False)
                dec._resolve_rank_mapping(info)
                want = global_heads(d, dtp, total)
                got = [None] * len(want)
                err = None
                for p in info.target_tp_ranks:
                    sh, k, dh, _ = H.compute_head_slice_params(ptp, dtp, p, d, total)
                    src = global_heads(p, ptp, total)
                    if sh + k > len(src) or dh + k > len(want):
                        err = f"out of range: P{p} sh={sh} n={k} dh={dh} src_heads={len(src)} dst_heads={len(want)}"
                        break
                    for i in range(k):
                        if got[dh + i] not in (None, src[sh + i]):
                            err = f"conflict at dst head slot {dh+i}"
                        got[dh + i] = src[sh + i]
                n += 1
                if err or got != want:
                    bad += 1
                    if bad <= 15:
                        print(f"total={total} P TP{ptp} -> D TP{dtp} D{d}: want {want} got {got} {err or ''}")
print(f"checked {n} (config, decode rank) cases, {bad} mismatches")
