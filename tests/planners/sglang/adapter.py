"""SGLang's own disaggregation helpers in kvrelay's planner seat (plan protocol v1, src/running/external/README.md).

One long-lived process: JSON lines in on stdin, exactly one JSON line out per line in, diagnostics on stderr.
Every copy is computed by calling SGLang's helpers, loaded from the wheel by load_helpers.py (no torch, no
``import sglang``), the way the Mooncake connector calls them (``sglang/srt/disaggregation/mooncake/conn.py``
of the wheel; Mori and NIXL call the same helpers, FINDINGS.md section 2). Line numbers below are the 0.5.23
wheel's.

    python3 adapter.py [--version 0.5.23] [--wheel PATH]

How the protocol maps onto the connector:

* Addresses. Every region (local and the peer's) gets a synthetic base address ``index * REGION_STRIDE``; the
  connector's own pointer arithmetic (``ptr + index * item_len + offset``) then runs unchanged, and each address it
  produces is split back into (region, offset) for the answer.
* ``link`` = Mooncake's bootstrap thread on a registration (mooncake/conn.py:2978-2998): ``requires_dcp_relayout``
  and, when it is true, ``prepare_dcp_token_item_lens`` with ``[dst_kv_item_len] * targets + [None] * drafts``.
  Mooncake raises these in its bootstrap thread (which then dies, domain.md section 2.6); the adapter refuses
  the peer with the exception's text instead, which is the Mori behaviour the protocol's link models.
* ``plan`` = the transfer worker (mooncake/conn.py:2488-2830) for every chunk of the request: the dummy rule of
  the decode side, the DCP / page-copy / head-slice dispatch, ``maybe_send_extra`` for state on the last chunk,
  then ``send_aux``. A connector that raises or returns non-zero fails the room; the adapter answers a rejection
  with the exception's (or the logged) text. Where Mooncake's transfer thread would die on an exception
  (mooncake/conn.py:2877-2883) the room fails here instead.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VERSION = "0.5.23"
REGION_STRIDE = 1 << 40
LOGGED: set = set()


def die(message: str) -> None:
    print(f"sglang adapter: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def warn(message: str) -> None:
    """The connector's logger.warning, once per text."""
    if message not in LOGGED:
        LOGGED.add(message)
        print(f"warning: {message}", file=sys.stderr)


def find_wheel(version: str, wheel: str | None) -> str:
    if wheel is not None:
        if not os.path.exists(wheel):
            die(f"no wheel at {wheel}; fetch one: python3 -m pip download sglang=={version} --no-deps -d "
                f"{os.path.dirname(wheel) or '.'}")
        return wheel
    wheels = sorted(glob.glob(os.path.join(HERE, "wheels", f"sglang-{version}-*.whl")))
    if not wheels:
        die(f"no SGLang {version} wheel in {os.path.join(HERE, 'wheels')}; fetch it: "
            f"python3 -m pip download sglang=={version} --no-deps -d {os.path.join(HERE, 'wheels')}")
    return wheels[0]


# --------------------------------------------------------------------------------------------------------------
# What the query says, in SGLang's kv_args terms
# --------------------------------------------------------------------------------------------------------------
STATE_KINDS = {"Mamba": "mamba", "Swa": "swa", "Dsa": "dsa", "SwaRing": "swa_ring"}
_SLICED = re.compile(
    r"Sliced \{ full_dim: (\d+), unit_bytes: (\d+), outer_count: (\d+), groups: (None|Some\(\[([\d, ]*)\]\))"
)
_STATE_REGION = re.compile(r"State \{ component: (\d+), tensor: (\d+) \}")
_MHA = re.compile(r"Mha \{ kv_heads: (\d+), head_dim: (\d+) \}")


class QueryError(Exception):
    """The query cannot be read as the protocol describes it."""


class Local:
    """The prefill rank's own kv_args, from the query's `local` and `rank`."""

    def __init__(self, q: dict):
        topo, model = q["local"]["topology"], q["local"]["model"]
        self.tp, self.pp, self.dcp, self.page_size = topo["tp"], topo["pp"], topo["dcp"], topo["page_size"]
        self.tp_rank, self.pp_rank = q["rank"]["tp"], q["rank"]["pp"]
        # Attention CP (prefill): this rank's CP rank and whether every CP rank sends its block of pages
        # (enable_all_cp_ranks_for_transfer, common/conn.py:373-394, as kvrelay's topology says).
        self.cp, self.cp_rank = topo.get("cp", 1), q["rank"].get("cp", 0)
        self.all_cp = bool(topo.get("all_cp_ranks_transfer", False)) and self.cp > 1
        self.dcp_rank = self.tp_rank % self.dcp
        # SGLANG_DISAGG_STAGING_BUFFER on this prefill (kvrelay's grid chunk in pages; 0 = off).
        self.staging = topo.get("staging_chunk_pages", 0) > 0
        attention = model["attention"]
        self.state_types = [STATE_KINDS.get(c["kind"], c["kind"].lower()) for c in model["state"]]
        mla = attention.startswith("Mla")
        # HybridLinearKVPool with an MLA full pool is the hybrid-MLA backend (domain.md section 1.4).
        self.is_hybrid_mla = mla and "mamba" in self.state_types
        self.is_mla = mla and not self.is_hybrid_mla
        mha = _MHA.match(attention)
        self.total_kv_heads = int(mha.group(1)) if mha else 1
        self.kv, self.kv_item_lens, self.kv_layer_ids, self.num_draft = [], [], [], 0
        ncomp = len(model["state"])
        self.state = [[] for _ in range(ncomp)]
        self.state_item_lens = [[] for _ in range(ncomp)]
        self.state_layer_ids = [[] for _ in range(ncomp)]
        self.state_dims = [[] for _ in range(ncomp)]
        self.state_groups = [[] for _ in range(ncomp)]
        self.state_outer = [[] for _ in range(ncomp)]
        self.aux, self.aux_item_lens = [], []
        for index, region in enumerate(q["local"]["regions"]):
            kind = region["kind"]
            if kind.startswith("Kv(") or kind == "Draft":
                self.kv.append(index)
                self.kv_item_lens.append(region["item_len"])
                self.kv_layer_ids.append(region["layer"])
                self.num_draft += kind == "Draft"
            elif kind.startswith("Aux"):
                self.aux.append(index)
                self.aux_item_lens.append(region["item_len"])
            else:
                m = _STATE_REGION.match(kind)
                if not m or int(m.group(1)) >= ncomp:
                    raise QueryError(f"unknown local region kind {kind!r}")
                c, t = int(m.group(1)), int(m.group(2))
                shape = model["state"][c]["tensors"][t]["shape"]
                self.state[c].append(index)
                self.state_item_lens[c].append(region["item_len"])
                self.state_layer_ids[c].append(region["layer"])
                sliced = _SLICED.match(shape)
                if sliced:
                    # state_dim_per_tensor is the local size of the sliced axis, conv groups the full widths
                    # (domain.md section 5.2).
                    self.state_dims[c].append(int(sliced.group(1)) // self.tp)
                    self.state_outer[c].append(int(sliced.group(3)))
                    groups = sliced.group(5)
                    self.state_groups[c].append([int(g) for g in groups.split(",")] if groups else None)
                else:
                    self.state_dims[c].append(0)
                    self.state_outer[c].append(1)
                    self.state_groups[c].append(None)
        # What this rank advertises of itself (its kv_args lists) wins over the model's truth: a rank may publish
        # no layer ids, or conv groups that do not add up, and SGLang's code then works from what it published.
        advertised = q["local"].get("advertised")
        if advertised is not None:
            self.kv_layer_ids = list(advertised["kv_layer_ids"] or [])
            for c, meta in enumerate(advertised["state"][:ncomp]):
                self.state_layer_ids[c] = list(meta["layer_ids"] or [])
                self.state_dims[c] = list(meta["dims"] or [])
                self.state_groups[c] = list(meta["conv_groups"] or [])
                self.state_outer[c] = list(meta["outer_counts"] or [])
        # Stage layer range (the pool's start_layer..end_layer: get_pp_indices, or SGLANG_PP_LAYER_PARTITION, domain.md
        # section 4.1); only the id-less legacy paths read it.
        self.start_layer, self.end_layer = q["local"]["stage_layers"]

    def ptr(self, region: int) -> int:
        return region * REGION_STRIDE


class Peer:
    """KVArgsRegisterInfo of the decode peer, from the query's decoded `registration`."""

    def __init__(self, reg: dict):
        self.tp, self.tp_rank = reg["attn_tp_size"], reg["tp_rank"]
        dcp = reg.get("dcp")
        # A legacy registration carries no DCP frames: DCP (1, 0) and no layer ids (domain.md section 6.2).
        self.dcp_size = dcp["dcp_size"] if dcp else 1
        self.dcp_rank = dcp["dcp_rank"] if dcp else 0
        self.kv_layer_ids = list(dcp["kv_layer_ids"]) if dcp else []
        self.state_layer_ids = [list(ids) for ids in dcp["state_layer_ids"]] if dcp else []
        n_kv = len(reg["kv_descs"])
        self.kv_ptrs = [j * REGION_STRIDE for j in range(n_kv)]
        self.kv_item_len = reg["kv_item_len"]
        self.kv_item_lens = list(reg["kv_item_lens"])
        at = n_kv
        self.state_ptrs = []
        for descs in reg["state_descs"]:
            self.state_ptrs.append([(at + k) * REGION_STRIDE for k in range(len(descs))])
            at += len(descs)
        self.aux_ptrs = [(at + k) * REGION_STRIDE for k in range(len(reg["aux_descs"]))]
        at += len(reg["aux_descs"])
        # The decode's staging ring (Mooncake's registration frames [14]/[15]: base pointer and total size).
        staging = reg.get("staging_descs") or []
        self.staging_ptr = at * REGION_STRIDE if staging else 0
        self.staging_size = staging[0]["length"] if staging else 0
        self.state_item_lens = [list(lens) for lens in reg["state_item_lens"]]
        self.state_dims = [list(dims) for dims in reg["state_dims"]]


class Copies:
    """Collects (src_addr, dst_addr, length) blocks per chunk and splits addresses into regions."""

    def __init__(self):
        self.rows = []

    def add(self, chunk: int, blocks) -> None:
        for src, dst, length in blocks:
            src, dst, length = int(src), int(dst), int(length)
            if src < 0 or dst < 0 or length < 0:
                raise RuntimeError(f"SGLang computed a negative address or length: ({src}, {dst}, {length})")
            if length:
                s, so = divmod(src, REGION_STRIDE)
                d, do = divmod(dst, REGION_STRIDE)
                self.rows.append([chunk, s, so, d, do, length])


class Adapter:
    def __init__(self, helpers, load_helpers):
        self.H = helpers
        self.lh = load_helpers

    # ----------------------------------------------------------------------------------------------------------
    def prefill_manager(self, local: Local):
        """A CommonKVManager stand-in for this prefill rank (the methods load_helpers extracts read only these)."""
        return self.lh.make_manager_view(
            self.H,
            attn_tp_size=local.tp,
            pp_size=local.pp,
            pp_rank=local.pp_rank,
            is_mla_backend=local.is_mla,
            is_hybrid_mla_backend=local.is_hybrid_mla,
            dcp_size=local.dcp,
            dcp_rank=local.dcp_rank,
            engine_rank=local.tp_rank,
            page_size=local.page_size,
            prefill_start_layer=local.start_layer,
            total_kv_head_num=local.total_kv_heads,
            kv_head_num=max(1, local.total_kv_heads // local.tp),
            kv_item_lens=local.kv_item_lens,
            kv_layer_ids=local.kv_layer_ids,
            num_draft_entries=local.num_draft,
            swa_kv_cache_layout="nhd",  # kvrelay's SWA pages are [page_size, heads, head_dim]
        )

    def link(self, q: dict):
        """Registration: mooncake/conn.py:2978-2998 (requires_dcp_relayout, prepare_dcp_token_item_lens)."""
        local, peer = Local(q), Peer(q["registration"])
        mgr = self.prefill_manager(local)
        relayout = mgr.requires_dcp_relayout(peer.dcp_size, peer.dcp_rank)
        token_lens = None
        if relayout:
            n, draft = len(local.kv_item_lens), local.num_draft
            dst_item_lens = [peer.kv_item_len] * (n - draft) + [None] * draft
            token_lens = mgr.prepare_dcp_token_item_lens(dst_item_lens, peer.dcp_size)
        return local, peer, mgr, relayout, token_lens

    # ----------------------------------------------------------------------------------------------------------
    def is_dummy(self, local: Local, peer: Peer) -> bool:
        """The decode side marks all but one target prefill rank as dummies for a pure-MLA pool: its rank
        mapping (_resolve_rank_mapping, common/conn.py:1432-1530, called here) then common/conn.py:2635-2640."""
        decode = self.lh.make_manager_view(
            self.H, attn_tp_size=peer.tp, is_mla_backend=local.is_mla,
            is_hybrid_mla_backend=local.is_hybrid_mla, engine_rank=peer.tp_rank, page_size=local.page_size,
        )
        info = types.SimpleNamespace(attn_tp_size=local.tp, attn_cp_size=1, pp_size=local.pp,
                                     enable_kv_cache_sharding=False, enable_dsa_cache_layer_split=False)
        decode._resolve_rank_mapping(info)
        if not local.is_mla:
            return False
        return not (local.tp_rank == info.target_tp_rank or info.target_tp_rank is None)

    def plan(self, q: dict) -> list:
        local, peer, mgr, relayout, token_lens = self.link(q)
        meta, request = q["meta"], q["request"]
        out = Copies()
        chunks = request["chunks"]
        if self.is_dummy(local, peer):
            # A dummy request only reports success (mooncake/conn.py:2819-2823).
            return out.rows
        np = self.H.np
        P = local.page_size
        prefill_pages = request["prefill_pages"]
        dst_kv_indices = np.asarray(meta["kv_indices"], dtype=np.int32)
        # A HiSparse decode's logical pages for its device-resident draft (metadata msg[9], mooncake/conn.py:142-146).
        device = meta.get("device_kv_indices") or []
        dst_device_kv_indices = np.asarray(device, dtype=np.int32) if device else None
        decode_prefix = meta["decode_prefix_len"] or 0
        # No SGLang helper: chunk pages as prefill.py:1731-1779 cuts them, each chunk's pages from the send range's
        # start, index_slice counted in prefill pages from decode_prefix_len (common/conn.py:2270).
        first_page = decode_prefix // P
        curr = 0
        # num_kv_indices: the send range's pages (common/conn.py:2270-2301 counts chunks against it).
        num_kv_indices = sum(-(-t // P) for t in chunks)
        cp_view = types.SimpleNamespace(attn_cp_rank=local.cp_rank, attn_cp_size=local.cp)
        # No SGLang helper: _get_dsa_cache_transfer_skip_flags (mooncake/conn.py:1873-1901), inlined: a method whose
        # only input beyond the ranks is CP state; hybrid-MLA KV is written by sub-rank 0 of an aggregation group.
        skip_kv = (local.is_hybrid_mla and local.tp > peer.tp
                   and (local.tp_rank % local.tp) % (local.tp // peer.tp) != 0)
        for ci, tokens in enumerate(chunks):
            npages = -(-tokens // P)
            src = np.asarray(prefill_pages[first_page + curr: first_page + curr + npages], dtype=np.int32)
            index_slice = slice(curr, curr + npages)
            curr += npages
            last = ci + 1 == len(chunks)
            if local.all_cp:
                # _prepare_send_indices (common/conn.py:2282-2291): this CP rank's block of the chunk.
                src, index_slice = self.H.filter_kv_indices_for_cp_rank(
                    cp_view, src, index_slice, total_pages=num_kv_indices)
            chunk_device = None
            if relayout:
                if dst_device_kv_indices is not None:  # mooncake/conn.py:2615-2619
                    raise RuntimeError("HiSparse destination device indices are not supported by PD DCP relayout")
                chunk_dst = dst_kv_indices
            else:
                chunk_dst = dst_kv_indices[index_slice]
                if dst_device_kv_indices is not None:
                    chunk_device = dst_device_kv_indices[index_slice]
                if len(chunk_dst) < len(src):  # mooncake/conn.py:2633-2643: warn and truncate
                    warn(f"len(chunked_dst_kv_indice) = {len(chunk_dst)}, "
                          f"len(kv_chunk.prefill_kv_indices) = {len(src)}")
                    src = src[: len(chunk_dst)]
                if chunk_device is not None:
                    chunk_device = chunk_device[: len(src)]
            if len(src) == 0 or not local.kv or skip_kv:
                pass
            elif relayout:
                self.send_kvcache_dcp(out, ci, local, peer, mgr, src, chunk_dst, token_lens,
                                      src_page_offset=index_slice.start, decode_prefix_len=decode_prefix,
                                      num_kv_tokens=tokens)
            elif local.is_mla or local.is_hybrid_mla or local.tp == peer.tp:
                device_ptrs = None
                if chunk_device is not None:
                    # send_kvcache, mooncake/conn.py:1358-1381: the draft suffix of the decode's entries is device
                    # memory at logical pages; the rest is host-backed.
                    if not 0 < local.num_draft < len(peer.kv_ptrs):
                        raise ValueError("HiSparse spec PD transfer requires an appended device-only draft KV buffer")
                    device_ptrs = set(peer.kv_ptrs[len(peer.kv_ptrs) - local.num_draft:])
                self.send_kvcache_generic(out, ci, local, mgr, [local.ptr(r) for r in local.kv], peer.kv_ptrs,
                                          local.kv_item_lens, src, chunk_dst, local.kv_layer_ids,
                                          peer.kv_layer_ids, device=(chunk_device, device_ptrs))
            elif local.staging and peer.staging_size:
                # mooncake/conn.py:2707-2727: staging when enabled here and the peer registered a ring.
                self.send_kvcache_staging(out, ci, local, peer, src, meta["staging_offsets"][ci])
            else:
                self.send_kvcache_slice(out, ci, local, peer, mgr, src, chunk_dst)
            if last:
                state_indices = self.prefill_state_indices(local, request)
                # _should_skip_cp_replicated_state_transfer (common/conn.py:513-529): state from CP rank 0 only.
                if local.cp > 1 and local.cp_rank != 0:
                    state_indices = None
                if state_indices:
                    self.maybe_send_extra(out, ci, local, peer, mgr, state_indices, meta["state_indices"])
                self.send_aux(out, ci, local, peer, request["prefill_state"]["aux"], meta["aux_index"])
        return out.rows

    # ----------------------------------------------------------------------------------------------------------
    def send_kvcache_staging(self, out, ci, local, peer, src, offset):
        """_do_staging_transfer, mooncake/conn.py:698-806 with PP 1: compute_head_slice_params and
        compute_staging_layout from the wheel; no SGLang helper for the gather kernel (staging_buffer.py:62-97, a
        Triton kernel: its index math restated here) or the bulk write of the gathered image to the ring at
        `offset + rank_offset` (the offset the decode's STAGING_RSP gives, kvrelay's metadata frame 11)."""
        H, P = self.H, local.page_size
        n = len(local.kv) - local.num_draft
        k_buffers, v_buffers = local.kv[: n // 2], local.kv[n // 2: n]
        heads = local.total_kv_heads
        hs = max(1, heads // local.tp)
        head_bytes = local.kv_item_lens[0] // P // hs  # k_buffers[0].shape[-1] * element_size()
        local_tp_rank = local.tp_rank % local.tp
        src_head_start, nh, _, _ = H.compute_head_slice_params(local.tp, peer.tp, local_tp_rank, peer.tp_rank, heads)
        num_tokens = len(src) * P
        num_writers, writer_bytes, total = H.compute_staging_layout(
            local.tp, peer.tp, peer.tp_rank, heads, num_tokens, head_bytes, len(k_buffers))
        writer_idx = local_tp_rank % num_writers if num_writers > 1 else 0
        rank_offset = sum(writer_bytes[:writer_idx])
        if peer.staging_size - offset < total:
            raise RuntimeError(f"Decode staging too small: need {total} bytes, have {peer.staging_size - offset}")
        row, stride = nh * head_bytes, hs * head_bytes
        base = peer.staging_ptr + offset + rank_offset
        blocks = []
        for s, buffer in enumerate(k_buffers + v_buffers):
            for i, page in enumerate(src):
                for j in range(P):
                    t = i * P + j
                    blocks.append((local.ptr(buffer) + (int(page) * P + j) * stride + src_head_start * head_bytes,
                                   base + s * num_tokens * row + t * row, row))
        out.add(ci, blocks)

    # ----------------------------------------------------------------------------------------------------------
    def send_kvcache_generic(self, out, ci, local, mgr, src_ptrs, dst_ptrs, item_lens, src_idx, dst_idx,
                             src_ids, dst_ids, state_type=None, dst_item_lens=None, device=(None, None)):
        """_send_kvcache_generic, mooncake/conn.py:1019-1170 (the page-copy path for KV and generic state);
        `device` = (logical pages, decode entry pointers they address): a HiSparse decode's device-resident draft."""
        H = self.H
        src_blocks, dst_blocks = H.group_concurrent_contiguous(src_idx, dst_idx)
        device_idx, device_ptrs = device
        if device_ptrs:
            device_blocks = H.group_concurrent_contiguous(src_idx, device_idx)
        if dst_item_lens is not None:
            mismatch = self.state_stride_mismatch(local, mgr, src_ptrs, dst_ptrs, item_lens, dst_item_lens,
                                                  state_type, src_ids, dst_ids)
            if mismatch is not None:
                raise RuntimeError(mismatch)
        has_layer_ids = bool(src_ids or dst_ids)
        if self.flat(local, has_layer_ids, state_type, len(src_ptrs), len(dst_ptrs)):
            if has_layer_ids:
                pairs = H.build_transfer_entry_pairs(src_ids, dst_ids, len(src_ptrs), len(dst_ptrs),
                                                     allow_positional_fallback=local.pp == 1)
                params = [(src_ptrs[i], dst_ptrs[j], item_lens[i]) for i, j in pairs
                          if not H.is_elided_entry(item_lens[i], dst_item_lens, j,
                                                   allow_dst_elision=state_type == "dsa")]
            else:
                s, d, n = mgr.get_mla_kv_ptrs_with_pp(src_ptrs, dst_ptrs, state_type)
                mapped = None
                if dst_item_lens is not None:
                    _, mapped, _ = mgr.get_mla_kv_ptrs_with_pp(item_lens, dst_item_lens, state_type)
                params = [(s[k], d[k], item_lens[k]) for k in range(n)
                          if not H.is_elided_entry(item_lens[k], mapped, k, allow_dst_elision=state_type == "dsa")]
        else:
            sk, sv, dk, dv, n = mgr.get_mha_kv_ptrs_with_pp(src_ptrs, dst_ptrs)
            if n > len(dk):
                raise RuntimeError("Prefill transfer kvcache error, layers_current_pp_stage is out of range: "
                                   f"layers_current_pp_stage={n}, len(dst_k_ptrs)={len(dk)}")
            params = [(sk[k], dk[k], item_lens[k]) for k in range(n)] + \
                     [(sv[k], dv[k], item_lens[n + k]) for k in range(n)]
        for src_ptr, dst_ptr, item_len in params:
            # set_transfer_blocks, mooncake/conn.py:1172-1193: the prefill item_len strides both sides.
            blocks = device_blocks if device_ptrs and int(dst_ptr) in device_ptrs else (src_blocks, dst_blocks)
            out.add(ci, [(src_ptr + int(p[0]) * item_len, dst_ptr + int(d[0]) * item_len, item_len * len(p))
                         for p, d in zip(*blocks)])

    def flat(self, local, has_layer_ids, state_type, n_src, n_dst) -> bool:
        """No SGLang helper: _uses_flat_entry_layout, mooncake/conn.py:232-251 (a connector function), inlined."""
        single_swa = state_type == "swa" and n_src == 1 and n_dst == 1
        return local.is_mla or local.is_hybrid_mla or has_layer_ids or single_swa

    def state_stride_mismatch(self, local, mgr, src_ptrs, dst_ptrs, item_lens, dst_item_lens, state_type,
                              src_ids, dst_ids):
        """No SGLang helper: _state_stride_mismatch, mooncake/conn.py:826-912 (a connector method), inlined."""
        H = self.H
        has_layer_ids = bool(src_ids or dst_ids)
        if not self.flat(local, has_layer_ids, state_type, len(src_ptrs), len(dst_ptrs)):
            return None
        if has_layer_ids:
            for i, j in H.build_transfer_entry_pairs(src_ids or [], dst_ids or [], len(src_ptrs), len(dst_ptrs),
                                                     allow_positional_fallback=local.pp == 1):
                if j >= len(dst_item_lens):
                    return f"{state_type} decode published {len(dst_item_lens)} item lengths but paired entry " \
                           f"dst[{j}] needs one"
                if H.is_elided_entry(item_lens[i], dst_item_lens, j, allow_dst_elision=state_type == "dsa"):
                    continue
                if item_lens[i] != dst_item_lens[j]:
                    return f"{state_type} item length mismatch for paired entries src[{i}]={item_lens[i]} " \
                           f"dst[{j}]={dst_item_lens[j]}"
            return None
        _, _, n = mgr.get_mla_kv_ptrs_with_pp(src_ptrs, dst_ptrs, state_type)
        _, mapped, _ = mgr.get_mla_kv_ptrs_with_pp(item_lens, dst_item_lens, state_type)
        if len(mapped) < n:
            return f"{state_type} decode published {len(mapped)} item lengths for this stage's {n} entries"
        for k in range(n):
            if H.is_elided_entry(item_lens[k], mapped, k, allow_dst_elision=state_type == "dsa"):
                continue
            if item_lens[k] != mapped[k]:
                return f"{state_type} item length mismatch for positional entry {k}: prefill={item_lens[k]} " \
                       f"decode={mapped[k]}"
        return None

    # ----------------------------------------------------------------------------------------------------------
    def send_kvcache_dcp(self, out, ci, local, peer, mgr, src, dst, token_lens, *, src_page_offset,
                         decode_prefix_len, num_kv_tokens):
        """send_kvcache_dcp, mooncake/conn.py:1397-1645, without the pack buffer (it only gathers the same rows
        into a contiguous source first, domain.md section 2.8)."""
        H, np = self.H, self.H.np
        P = local.page_size
        src_ptrs = [local.ptr(r) for r in local.kv]
        dst_ptrs = list(peer.kv_ptrs)
        dst_item_lens = list(peer.kv_item_lens) or None
        if dst_item_lens and len(dst_item_lens) != len(dst_ptrs):
            raise ValueError("PD DCP destination KV lengths must match its buffers")
        if local.kv_layer_ids or peer.kv_layer_ids:
            dst_indices = H.resolve_dcp_dst_entry_indices(local.kv_layer_ids, peer.kv_layer_ids, len(src_ptrs),
                                                          len(dst_ptrs))
            dst_ptrs = [dst_ptrs[j] for j in dst_indices]
            if dst_item_lens:
                dst_item_lens = [dst_item_lens[j] for j in dst_indices]
        else:
            src_ptrs, dst_ptrs, _ = mgr.get_mla_kv_ptrs_with_pp(src_ptrs, dst_ptrs)
            if dst_item_lens:
                _, dst_item_lens, _ = mgr.get_mla_kv_ptrs_with_pp(local.kv_item_lens, dst_item_lens)
        num_draft = local.num_draft
        num_target = len(src_ptrs) - num_draft
        plan = H.build_dcp_token_transfer_plan(
            src, dst, physical_page_size=P, dcp_size=peer.dcp_size, dcp_rank=peer.dcp_rank,
            src_page_offset=src_page_offset, decode_prefix_len=decode_prefix_len, num_kv_tokens=num_kv_tokens)
        if plan.empty():
            return
        layers = []
        if plan.target_src_token_indices.size:
            groups = H.group_concurrent_contiguous(plan.target_src_token_indices, plan.target_dst_token_indices)
            layers += [(src_ptrs[e], dst_ptrs[e], token_lens[e], groups) for e in range(num_target)]
        sliced = []
        if num_draft > 0 and plan.draft_src_token_indices.size:
            if not dst_item_lens and peer.tp not in (None, local.tp):
                raise ValueError("PD DCP with different draft TP sizes requires destination KV lengths")
            draft_groups = H.group_concurrent_contiguous(plan.draft_src_token_indices, plan.draft_dst_token_indices)
            for entry in range(num_target, num_target + num_draft):
                src_width = token_lens[entry]
                dst_width = src_width
                if dst_item_lens:
                    dst_width, remainder = divmod(dst_item_lens[entry], P * peer.dcp_size)
                    if remainder or dst_width <= 0:
                        raise ValueError("Invalid PD DCP draft destination token width")
                if src_width == dst_width:
                    layers.append((src_ptrs[entry], dst_ptrs[entry], src_width, draft_groups))
                    continue
                if local.is_mla:
                    raise ValueError("PD DCP draft head slicing is unsupported for pure MLA: "
                                     "dummy prefill senders may omit draft head shards")
                copy_width = min(src_width, dst_width)
                if max(src_width, dst_width) % copy_width:
                    raise ValueError("PD DCP draft KV head shards must divide evenly")
                src_span, dst_span = src_width * local.tp, dst_width * peer.tp
                src_rank = (local.tp_rank % local.tp) // max(1, src_span // dst_span)
                dst_rank = peer.tp_rank // max(1, dst_span // src_span)
                sliced.append((src_ptrs[entry] + (dst_rank * dst_width) % src_width,
                               dst_ptrs[entry] + (src_rank * src_width) % dst_width, src_width, dst_width,
                               copy_width))
        for src_ptr, dst_ptr, width, (sg, dg) in layers:
            out.add(ci, [(src_ptr + int(s[0]) * width, dst_ptr + int(d[0]) * width, len(s) * width)
                         for s, d in zip(sg, dg)])
        for src_ptr, dst_ptr, src_width, dst_width, copy_width in sliced:  # process_sliced_draft, 1583-1601
            out.add(ci, [(src_ptr + int(s) * src_width, dst_ptr + int(d) * dst_width, copy_width)
                         for s, d in zip(plan.draft_src_token_indices, plan.draft_dst_token_indices)])

    # ----------------------------------------------------------------------------------------------------------
    def send_kvcache_slice(self, out, ci, local, peer, mgr, src, dst):
        """send_kvcache_slice, mooncake/conn.py:1647-1778: head slices per token slot with
        compute_head_slice_params (common/staging_buffer.py:773-806)."""
        H, np = self.H, self.H.np
        P = local.page_size
        src_item_len = local.kv_item_lens[0]
        dst_item_len = peer.kv_item_len
        total = local.total_kv_heads
        dst_heads = max(1, total // peer.tp)
        bph = dst_item_len // P // dst_heads
        sh, n, dh, _ = H.compute_head_slice_params(local.tp, peer.tp, local.tp_rank, peer.tp_rank, total)
        src_ptrs = [local.ptr(r) for r in local.kv]
        if local.kv_layer_ids or peer.kv_layer_ids:
            if any(item_len != src_item_len for item_len in local.kv_item_lens):
                raise RuntimeError("head-sliced transfer assumes one item length for every KV entry, got "
                                   f"{set(local.kv_item_lens)}")
            pairs = [(src_ptrs[i], peer.kv_ptrs[j]) for i, j in H.build_transfer_entry_pairs(
                local.kv_layer_ids, peer.kv_layer_ids or [], len(src_ptrs), len(peer.kv_ptrs),
                allow_positional_fallback=local.pp == 1)]
        else:
            sk, sv, dk, dv, nl = mgr.get_mha_kv_ptrs_with_pp(src_ptrs, peer.kv_ptrs)
            pairs = [(sk[i], dk[i]) for i in range(nl)] + [(sv[i], dv[i]) for i in range(nl)]
        length = n * bph
        if length > dst_item_len // P:
            raise RuntimeError(f"slice size ({length}) exceeds target token slot size ({dst_item_len // P})")
        src_pages = src.reshape(-1, 1).astype(np.int64)
        dst_pages = dst.reshape(-1, 1).astype(np.int64)
        if src_pages.shape[0] != dst_pages.shape[0]:
            # numpy broadcasting in process_layer_tp_aware raises on unequal page lists (1744-1747).
            raise ValueError(f"operands could not be broadcast together with shapes ({src_pages.shape[0]},1) "
                             f"({dst_pages.shape[0]},1)")
        slots = np.arange(P, dtype=np.int64).reshape(1, -1)
        src_off = slots * (src_item_len // P) + sh * bph
        dst_off = slots * (dst_item_len // P) + dh * bph
        for src_ptr, dst_ptr in pairs:
            s = (src_ptr + src_pages * src_item_len + src_off).reshape(-1).tolist()
            d = (dst_ptr + dst_pages * dst_item_len + dst_off).reshape(-1).tolist()
            out.add(ci, [(a, b, length) for a, b in zip(s, d)])

    # ----------------------------------------------------------------------------------------------------------
    def prefill_state_indices(self, local, request) -> list:
        """No SGLang helper: state_indices per state type as prefill.py:1680-1711 builds them (the Mamba slot, or the
        pages)."""
        state = request["prefill_state"]
        return [[state["slot"]] if st == "mamba" else list(state["pages"][c]) if c < len(state["pages"]) else []
                for c, st in enumerate(local.state_types)]

    def maybe_send_extra(self, out, ci, local, peer, mgr, state_indices, dst_state_indices):
        """maybe_send_extra, mooncake/conn.py:1943-2250, for the state kinds kvrelay models."""
        H, np = self.H, self.H.np
        at = lambda lists, c: lists[c] if c < len(lists) else []  # noqa: E731  (the connector's bounds guards)
        for c, st in enumerate(local.state_types):
            indices = state_indices[c] if c < len(state_indices) else None
            if indices is None:
                continue
            src_ptrs = [local.ptr(r) for r in local.state[c]]
            src_lens, src_dims = local.state_item_lens[c], local.state_dims[c]
            groups, outer, src_ids = local.state_groups[c], local.state_outer[c], local.state_layer_ids[c]
            dst_ptrs, dst_lens = at(peer.state_ptrs, c), at(peer.state_item_lens, c)
            dst_dims, dst_ids = at(peer.state_dims, c), at(peer.state_layer_ids, c)
            dst_indices = at(dst_state_indices, c)
            if st == "mamba":
                if (not src_dims or not dst_dims) and list(src_lens) != list(dst_lens):
                    raise RuntimeError(
                        "Mamba state layouts differ between prefill and decode "
                        f"(src item_lens={src_lens}, dst item_lens={dst_lens}) and no per-tensor dim metadata is "
                        "available to reslice. With --enable-unified-memory, prefill and decode must both enable "
                        "it and use equal attention TP sizes.")
                if local.tp != peer.tp:  # state_tp_size == attn_tp_size without CP/TP sharing
                    self.send_mamba_state_slice(out, ci, local, peer, indices, src_ptrs, src_lens, src_dims,
                                                dst_ptrs, dst_indices, dst_lens, dst_dims, groups, outer, src_ids,
                                                dst_ids)
                else:
                    self.send_mamba_state(out, ci, local, indices, src_ptrs, src_lens, dst_ptrs, dst_indices,
                                          src_ids, dst_ids, dst_lens)
                continue
            # generic page-indexed kinds: swa, dsa, swa_ring (mooncake/conn.py:2081-2202)
            hetero = local.tp != peer.tp
            slice_heads = hetero and not local.is_mla and not local.is_hybrid_mla
            if slice_heads and st != "swa":
                raise RuntimeError(f"PD Disaggregation does NOT support PD different TP sizes for non-MLA "
                                   f"{st.upper()} hybrid models yet.")
            src_idx, dst_idx = list(indices), list(dst_indices)
            if len(src_idx) != len(dst_idx):
                if st == "swa_ring":  # _requires_exact_state_index_match, 1918-1926
                    raise RuntimeError(f"{st.upper()} state index length mismatch: prefill={len(src_idx)}, "
                                       f"dst={len(dst_idx)}")
                warn(f"len(prefill_state_indices) = {len(src_idx)}, len(dst_state_indices) = {len(dst_idx)}")
                m = min(len(src_idx), len(dst_idx))
                src_idx, dst_idx = src_idx[:m], dst_idx[:m]
            if slice_heads:
                # _send_swa_state_slice (mooncake/conn.py:2435-2476) through the wheel's _get_mha_head_slice_blocks
                # (common/conn.py:1751-1851): one block per token of every window page, per K/V entry.
                blocks = mgr._get_mha_head_slice_blocks(
                    src_ptrs=src_ptrs, src_item_lens=list(src_lens), dst_ptrs=list(dst_ptrs),
                    dst_item_lens=list(dst_lens), src_page_indices=np.asarray(src_idx),
                    dst_page_indices=np.asarray(dst_idx), dst_attn_tp_size=peer.tp, dst_tp_rank=peer.tp_rank)
                for src_addrs, dst_addrs, length in blocks:
                    out.add(ci, [(int(a), int(b), int(length)) for a, b in zip(src_addrs.tolist(),
                                                                              dst_addrs.tolist())])
                continue
            self.send_kvcache_generic(out, ci, local, mgr, src_ptrs, dst_ptrs, src_lens,
                                      np.array(src_idx, dtype=np.int32), np.array(dst_idx, dtype=np.int32),
                                      src_ids, dst_ids, state_type=st, dst_item_lens=dst_lens)

    def send_mamba_state(self, out, ci, local, src_index, src_ptrs, src_lens, dst_ptrs, dst_index, src_ids,
                         dst_ids, dst_lens):
        """_send_mamba_state, mooncake/conn.py:2289-2324: whole slots, pairs by layer id."""
        if len(src_index) != 1:
            raise AssertionError("Mamba should have single state index")
        pairs = self.H.build_transfer_entry_pairs(src_ids or [], dst_ids or [], len(src_ptrs), len(dst_ptrs),
                                                  allow_positional_fallback=local.pp == 1)
        blocks = []
        for i, j in pairs:
            length = src_lens[i]
            if dst_lens and length != dst_lens[j]:
                raise RuntimeError(f"Prefill/Decode Mamba slot size mismatch (src={length}, dst={dst_lens[j]}). "
                                   "Configure matching persistent state layouts on both peers.")
            blocks.append((src_ptrs[i] + length * int(src_index[0]), dst_ptrs[j] + length * int(dst_index[0]),
                           length))
        out.add(ci, blocks)

    def send_mamba_state_slice(self, out, ci, local, peer, src_index, src_ptrs, src_lens, src_dims, dst_ptrs,
                               dst_index, dst_lens, dst_dims, groups, outer, src_ids, dst_ids):
        """_send_mamba_state_slice, mooncake/conn.py:2326-2433, with compute_mamba_state_slice_byte_blocks
        (disaggregation/utils.py:979-1042)."""
        if len(src_index) != 1:
            raise AssertionError("Mamba should have single state index")
        if not src_dims or not dst_dims:
            return self.send_mamba_state(out, ci, local, src_index, src_ptrs, src_lens, dst_ptrs, dst_index,
                                         src_ids, dst_ids, dst_lens)
        pairs = self.H.build_transfer_entry_pairs(src_ids or [], dst_ids or [], len(src_ptrs), len(dst_ptrs),
                                                  allow_positional_fallback=local.pp == 1)
        blocks = []
        for i, j in pairs:
            src_item_len, dst_item_len = src_lens[i], dst_lens[j]
            conv = groups[i] if groups and i < len(groups) else None
            outer_count = outer[i] if outer and i < len(outer) else 1
            for s, d, n in self.H.compute_mamba_state_slice_byte_blocks(
                    src_item_len=src_item_len, dst_item_len=dst_item_len, src_dim=src_dims[i],
                    dst_dim=dst_dims[j], outer_count=outer_count, src_attn_tp_size=local.tp,
                    dst_attn_tp_size=peer.tp, dst_tp_rank_in_group=peer.tp_rank % peer.tp,
                    local_tp_rank_in_group=local.tp_rank % local.tp, conv_shard_groups=conv):
                blocks.append((src_ptrs[i] + src_item_len * int(src_index[0]) + s,
                               dst_ptrs[j] + dst_item_len * int(dst_index[0]) + d, n))
        out.add(ci, blocks)

    def send_aux(self, out, ci, local, peer, prefill_aux_index, dst_aux_index):
        """No SGLang helper: send_aux, mooncake/conn.py:1780-1803, inlined: the shorter list, the prefill item length on
        both sides, no PP-stage or TP-rank election."""
        if dst_aux_index is None:
            return
        blocks = []
        for i in range(min(len(local.aux), len(peer.aux_ptrs))):
            length = local.aux_item_lens[i]
            blocks.append((local.ptr(local.aux[i]) + length * prefill_aux_index,
                           peer.aux_ptrs[i] + length * dst_aux_index, length))
        out.add(ci, blocks)


# --------------------------------------------------------------------------------------------------------------
def answer(adapter: Adapter, q: dict) -> dict:
    kind, qid = q.get("type"), q.get("id")
    reply = {"type": kind, "id": qid}
    try:
        if kind == "link":
            adapter.link(q)
        else:
            rows = adapter.plan(q)
            chunks = len(q["request"]["chunks"])
            reply["copies"] = rows if chunks else []
    except (KeyError, TypeError, QueryError) as error:
        reply.pop("copies", None)
        reply["error"] = f"sglang adapter cannot read the query: {type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - any exception of SGLang's code fails the room with its text
        reply.pop("copies", None)
        reply["error"] = str(error) or type(error).__name__
        note = f"{q.get('case')}: {kind} rejected: {type(error).__name__}: {error}"
        if note not in LOGGED:  # once per case and text, not once per rank
            LOGGED.add(note)
            print(note, file=sys.stderr)
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="SGLang version whose wheel to load")
    parser.add_argument("--wheel", default=None, help="the wheel file (default: wheels/sglang-VERSION-*.whl here)")
    args = parser.parse_args()
    if sys.version_info < (3, 11):
        die(f"Python >= 3.11 is needed, this is {sys.version.split()[0]}")
    try:
        import numpy  # noqa: F401
    except ImportError:
        die(f"numpy is missing for {sys.executable}; install it: {sys.executable} -m pip install numpy")
    wheel = find_wheel(args.version, args.wheel)
    sys.path.insert(0, HERE)
    import load_helpers

    try:
        helpers = load_helpers.load(wheel)
    except Exception as error:  # noqa: BLE001
        die(f"cannot load SGLang's helpers from {wheel}: {type(error).__name__}: {error}")
    helpers.np = numpy
    adapter = Adapter(helpers, load_helpers)
    name = f"SGLang {helpers.version} helpers (Mooncake connector rules, {os.path.basename(wheel)})"
    print(f"loaded {name}", file=sys.stderr, flush=True)
    for line in sys.stdin:
        try:
            q = json.loads(line)
        except ValueError:
            reply = {"type": "error", "error": "not a plan-protocol message"}
        else:
            if not isinstance(q, dict):
                reply = {"type": "error", "error": "not a plan-protocol message"}
            elif q.get("type") == "hello":
                reply = {"type": "hello", "protocol": "kvrelay-plan", "version": 1, "planner": name}
            elif q.get("type") in ("link", "plan"):
                reply = answer(adapter, q)
            else:
                reply = {"type": "error", "error": "not a plan-protocol message"}
        sys.stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
