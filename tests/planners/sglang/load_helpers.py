"""Load SGLang 0.5.23's pure PD-disaggregation planning helpers without torch.

Source of truth is the *wheel file itself* (a zip): nothing is installed, no
``sglang`` package ``__init__`` runs, and ``sys.modules`` gets no ``sglang``
entries.  Only the Python standard library and numpy are needed.

Two loading mechanisms, both driven by the upstream source text:

1. Whole-module exec (``sglang/srt/disaggregation/common/utils.py``).
   That module's only non-stdlib/non-numpy import is
   ``sglang.srt.observability.trace`` (TraceNullContext, TraceReqContext, used
   only as a dataclass field type/default).  It is executed as a fresh module
   whose private ``__builtins__.__import__`` hands out a two-class stub for that
   import and refuses every other ``sglang`` import.

2. Function extraction with ``ast`` for modules whose top level imports torch
   (``disaggregation/utils.py``, ``common/staging_buffer.py``) and for two
   methods of ``CommonKVManager`` (``common/conn.py``).  Each wanted
   ``def`` is cut out by its AST line span, compiled with
   ``from __future__ import annotations`` semantics (annotations stay strings,
   so names like ``KVArgs``/``Req`` used only in hints are never evaluated), and
   exec'd in a namespace holding just the names it needs.  Every global name
   the function body reads is checked with ``symtable`` *before* exec: if a
   future SGLang version makes a helper depend on something new, loading fails
   loudly instead of failing later at call time.

Each source file is verified against the sha256 in the wheel's RECORD, and the
wheel itself against a pinned sha256.
"""

from __future__ import annotations

import __future__
import ast
import base64
import builtins
import collections
import hashlib
import io
import os
import symtable
import sys
import types
import typing
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WHEEL = os.path.join(
    HERE, "wheels", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
)
# sha256 of the wheel downloaded with `pip download sglang==0.5.23 --no-deps`.
PINNED_WHEEL_SHA256 = {
    "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl":
        "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
}

P_COMMON_UTILS = "sglang/srt/disaggregation/common/utils.py"
P_UTILS = "sglang/srt/disaggregation/utils.py"
P_STAGING = "sglang/srt/disaggregation/common/staging_buffer.py"
P_COMMON_CONN = "sglang/srt/disaggregation/common/conn.py"

# Names a helper may read from its namespace, by what provides them.
_TYPING_NAMES = {
    n: getattr(typing, n)
    for n in ("List", "Optional", "Sequence", "Tuple", "Dict", "Iterable", "Union", "Any")
}
_BASE_NAMESPACE = {"np": np, "deque": collections.deque, **_TYPING_NAMES}


class WheelSource:
    """Read files from a wheel (.whl zip) or from an unpacked wheel directory."""

    def __init__(self, path: str = DEFAULT_WHEEL, verify: bool = True):
        self.path = path
        self._zip = zipfile.ZipFile(path) if os.path.isfile(path) else None
        self._record = self._load_record()
        if verify and self._zip is not None:
            name = os.path.basename(path)
            want = PINNED_WHEEL_SHA256.get(name)
            if want is not None:
                with open(path, "rb") as f:
                    got = hashlib.sha256(f.read()).hexdigest()
                if got != want:
                    raise RuntimeError(f"{name}: sha256 {got} != pinned {want}")
        self.verify = verify

    def _raw(self, rel: str) -> bytes:
        if self._zip is not None:
            return self._zip.read(rel)
        with open(os.path.join(self.path, rel), "rb") as f:
            return f.read()

    def _load_record(self) -> Dict[str, str]:
        names = (
            self._zip.namelist()
            if self._zip is not None
            else [
                os.path.relpath(os.path.join(d, f), self.path)
                for d, _, fs in os.walk(self.path)
                if d.endswith(".dist-info")
                for f in fs
            ]
        )
        rec = [n for n in names if n.endswith(".dist-info/RECORD")]
        if not rec:
            return {}
        out = {}
        for line in self._raw(rec[0]).decode().splitlines():
            parts = line.rsplit(",", 2)
            if len(parts) == 3 and parts[1].startswith("sha256="):
                out[parts[0]] = parts[1][len("sha256="):]
        return out

    def read(self, rel: str) -> str:
        data = self._raw(rel)
        if self.verify and rel in self._record:
            got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            if got.decode() != self._record[rel]:
                raise RuntimeError(f"{rel}: content does not match wheel RECORD")
        return data.decode("utf-8")

    def version(self) -> str:
        meta = [n for n in self._record if n.endswith(".dist-info/METADATA")]
        if not meta:
            return "?"
        for line in self._raw(meta[0]).decode().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        return "?"


# --------------------------------------------------------------------------
# import hook local to the exec'd namespaces (sys.modules is never touched
# for sglang names)
# --------------------------------------------------------------------------
_ALLOWED_REAL_IMPORTS = {
    "__future__", "ctypes", "dataclasses", "struct", "threading", "collections",
    "typing", "numpy", "numpy.typing", "logging", "math", "enum",
}


def _make_builtins(virtual_modules: Dict[str, object]) -> dict:
    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name in virtual_modules:
            if not fromlist:
                raise ImportError(f"'import {name}' (non-from) is not supported here")
            return virtual_modules[name]
        if level == 0 and name.split(".")[0] == "sglang":
            raise ImportError(
                f"helper tried to import {name!r}; not provided by load_helpers "
                "(upstream code changed?)"
            )
        if name not in _ALLOWED_REAL_IMPORTS and name.split(".")[0] not in _ALLOWED_REAL_IMPORTS:
            raise ImportError(f"import of {name!r} not on the allow-list")
        return real_import(name, globals, locals, fromlist, level)

    b = dict(builtins.__dict__)
    b["__import__"] = guarded_import
    return b


# --------------------------------------------------------------------------
# mechanism 1: exec a whole module
# --------------------------------------------------------------------------
def _trace_stub() -> types.SimpleNamespace:
    class TraceNullContext:  # upstream: sglang.srt.observability.trace
        pass

    class TraceReqContext:
        pass

    return types.SimpleNamespace(
        TraceNullContext=TraceNullContext, TraceReqContext=TraceReqContext
    )


def exec_module(src: WheelSource, rel: str, virtual_modules: Dict[str, object]) -> types.ModuleType:
    modname = "_kvrelay_sglang_" + rel[:-3].replace("/", "_")
    mod = types.ModuleType(modname)
    mod.__file__ = f"{src.path}!{rel}"
    mod.__dict__["__builtins__"] = _make_builtins(virtual_modules)
    code = compile(src.read(rel), mod.__file__, "exec", dont_inherit=True)
    # dataclasses looks its class's module up in sys.modules; register under a
    # private name only (never 'sglang...').
    sys.modules[modname] = mod
    exec(code, mod.__dict__)
    return mod


# --------------------------------------------------------------------------
# mechanism 2: extract functions / methods with ast
# --------------------------------------------------------------------------
@dataclass
class Extracted:
    qualname: str
    path: str
    lineno: int  # first line incl. decorators
    end_lineno: int
    source: str
    global_reads: List[str] = field(default_factory=list)


def _find_defs(tree: ast.Module, wanted: Iterable[str], optional: Iterable[str] = ()) -> Dict[str, ast.AST]:
    """wanted: 'func' for top-level, 'Class.method' for a method."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                q = f"{node.name}.{sub.name}" if hasattr(sub, "name") else None
                if q in wanted:
                    found[q] = sub
    missing = set(wanted) - set(found) - set(optional)
    if missing:
        raise LookupError(f"not found: {sorted(missing)}")
    return found


def _global_reads(source: str, name: str) -> List[str]:
    top = symtable.symtable(source, "<extracted>", "exec")
    out = set()

    def walk(t):
        if t.get_type() == "function":
            out.update(t.get_globals())
        for c in t.get_children():
            walk(c)

    for child in top.get_children():
        walk(child)
    out.discard(name)
    return sorted(out)


def extract(src: WheelSource, rel: str, wanted: List[str], optional: Iterable[str] = ()) -> Dict[str, Extracted]:
    text = src.read(rel)
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    out = {}
    for q, node in _find_defs(tree, wanted, optional).items():
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        seg = "".join(lines[start - 1 : node.end_lineno])
        seg = _dedent(seg)
        out[q] = Extracted(q, rel, start, node.end_lineno, seg, _global_reads(seg, q.split(".")[-1]))
    return out


def _dedent(seg: str) -> str:
    import textwrap

    return textwrap.dedent(seg)


def exec_extracted(items: List[Extracted], namespace: dict, virtual_modules: Dict[str, object]) -> dict:
    ns = dict(namespace)
    ns["__builtins__"] = _make_builtins(virtual_modules)
    ns["__name__"] = "_kvrelay_sglang_extracted"
    defined = {it.qualname.split(".")[-1] for it in items}
    for it in items:
        missing = [
            n for n in it.global_reads
            if n not in ns and n not in defined and not hasattr(builtins, n)
        ]
        if missing:
            raise RuntimeError(
                f"{it.path}:{it.lineno} {it.qualname} reads globals {missing} "
                "that load_helpers does not provide (upstream changed?)"
            )
    for it in items:
        # shift line numbers so tracebacks point at the wheel file's lines
        tree = ast.increment_lineno(ast.parse(it.source), it.lineno - 1)
        code = compile(
            tree, it.path, "exec",
            flags=__future__.annotations.compiler_flag, dont_inherit=True,
        )
        exec(code, ns)
    return ns


# --------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------
@dataclass
class Helpers:
    version: str
    wheel: str
    # common/utils.py (whole module)
    group_concurrent_contiguous: Callable
    build_dcp_token_transfer_plan: Callable
    DCPTokenTransferPlan: type
    # disaggregation/utils.py (extracted)
    build_transfer_entry_pairs: Callable
    resolve_dcp_dst_entry_indices: Callable
    compute_mamba_state_slice_byte_blocks: Callable
    compute_mamba_state_slice_blocks: Callable
    should_send_replicated_state: Callable
    is_elided_entry: Callable
    filter_kv_indices_for_shard_rank: Callable
    filter_kv_indices_for_cp_rank: Callable
    # common/staging_buffer.py (extracted) -- the head-slice rule
    compute_head_slice_params: Callable
    resolve_total_kv_heads: Callable
    compute_staging_layout: Callable
    # common/conn.py CommonKVManager methods (extracted; call via make_manager_view)
    manager_view_class: type
    provenance: Dict[str, Extracted]


_UTILS_FUNCS = [
    "should_send_replicated_state",
    "compute_mamba_state_slice_blocks",
    "compute_mamba_state_slice_byte_blocks",
    "is_elided_entry",
    "build_transfer_entry_pairs",
    "resolve_dcp_dst_entry_indices",
    "_get_cp_rank_page_bounds",
    "filter_kv_indices_for_cp_rank",
    "filter_kv_indices_for_shard_rank",
]
_STAGING_FUNCS = ["compute_head_slice_params", "compute_staging_layout", "resolve_total_kv_heads"]
_CONN_METHODS = [
    "CommonKVManager.get_mha_kv_ptrs_with_pp",
    "CommonKVManager._get_mha_head_slice_blocks",
    "CommonKVManager.prepare_dcp_token_item_lens",
    "CommonKVManager.requires_dcp_relayout",
    "CommonKVManager._resolve_rank_mapping",
    "CommonKVManager.get_mla_kv_ptrs_with_pp",
    "CommonKVManager._mla_kv_entry_span_with_pp",
]


def load(wheel: str = DEFAULT_WHEEL, verify: bool = True) -> Helpers:
    src = WheelSource(wheel, verify=verify)

    # 1. common/utils.py as a whole module
    cu = exec_module(src, P_COMMON_UTILS, {"sglang.srt.observability.trace": _trace_stub()})

    # 2a. disaggregation/utils.py functions
    # filter_kv_indices_for_shard_rank is new in 0.5.23 (absent in 0.5.22)
    ex_utils = extract(src, P_UTILS, _UTILS_FUNCS, optional=["filter_kv_indices_for_shard_rank"])
    ns_utils = exec_extracted(list(ex_utils.values()), _BASE_NAMESPACE, {})

    # 2b. staging_buffer.py head-slice functions
    ex_stag = extract(src, P_STAGING, _STAGING_FUNCS)
    ns_stag = exec_extracted(list(ex_stag.values()), _BASE_NAMESPACE, {})
    staging_mod = types.SimpleNamespace(**{k: ns_stag[k] for k in _STAGING_FUNCS})

    # 2c. CommonKVManager methods; their function-local imports resolve to the
    # helpers above via the namespace-local import hook.
    ex_conn = extract(src, P_COMMON_CONN, _CONN_METHODS)

    class _Logger:
        def warning_once(self, *a, **k):
            pass

        warning = info = debug = error = warning_once

    ns_conn = exec_extracted(
        list(ex_conn.values()),
        {**_BASE_NAMESPACE, "npt": __import__("numpy.typing").typing, "logger": _Logger(),
         "PrefillServerInfo": object, "StateType": object},
        {"sglang.srt.disaggregation.common.staging_buffer": staging_mod},
    )
    view_cls = type(
        "CommonKVManagerView",
        (),
        {q.split(".")[-1]: ns_conn[q.split(".")[-1]] for q in _CONN_METHODS},
    )

    prov = {}
    for d in (ex_utils, ex_stag, ex_conn):
        prov.update(d)
    for name in ("group_concurrent_contiguous", "build_dcp_token_transfer_plan", "DCPTokenTransferPlan"):
        obj = getattr(cu, name)
        prov[name] = Extracted(name, P_COMMON_UTILS, 0, 0, "<whole module>", [])

    return Helpers(
        version=src.version(),
        wheel=wheel,
        group_concurrent_contiguous=cu.group_concurrent_contiguous,
        build_dcp_token_transfer_plan=cu.build_dcp_token_transfer_plan,
        DCPTokenTransferPlan=cu.DCPTokenTransferPlan,
        build_transfer_entry_pairs=ns_utils["build_transfer_entry_pairs"],
        resolve_dcp_dst_entry_indices=ns_utils["resolve_dcp_dst_entry_indices"],
        compute_mamba_state_slice_byte_blocks=ns_utils["compute_mamba_state_slice_byte_blocks"],
        compute_mamba_state_slice_blocks=ns_utils["compute_mamba_state_slice_blocks"],
        should_send_replicated_state=ns_utils["should_send_replicated_state"],
        is_elided_entry=ns_utils["is_elided_entry"],
        filter_kv_indices_for_shard_rank=ns_utils.get("filter_kv_indices_for_shard_rank"),
        filter_kv_indices_for_cp_rank=ns_utils["filter_kv_indices_for_cp_rank"],
        compute_head_slice_params=ns_stag["compute_head_slice_params"],
        resolve_total_kv_heads=ns_stag["resolve_total_kv_heads"],
        compute_staging_layout=ns_stag["compute_staging_layout"],
        manager_view_class=view_cls,
        provenance=prov,
    )


def make_manager_view(helpers: Helpers, *, attn_tp_size: int, pp_size: int = 1,
                      is_mla_backend: bool = False, is_hybrid_mla_backend: bool = False,
                      dcp_size: int = 1, dcp_rank: int = 0, attn_cp_size: int = 1,
                      attn_cp_rank: int = 0, pp_rank: int = 0,
                      enable_all_cp_ranks_for_transfer: bool = False, **kv_args):
    """An object standing in for CommonKVManager's ``self`` for the extracted
    methods.  kv_args: engine_rank, page_size, prefill_start_layer,
    total_kv_head_num / kv_head_num, kv_item_lens, num_draft_entries,
    swa_kv_cache_layout ..."""
    v = helpers.manager_view_class()
    v.attn_tp_size = attn_tp_size
    v.pp_size = pp_size
    v.pp_rank = pp_rank
    v.is_mla_backend = is_mla_backend
    v.is_hybrid_mla_backend = is_hybrid_mla_backend
    v.dcp_size = dcp_size
    v.dcp_rank = dcp_rank
    v.attn_cp_size = attn_cp_size
    v.attn_cp_rank = attn_cp_rank
    v.enable_all_cp_ranks_for_transfer = enable_all_cp_ranks_for_transfer
    kv_args.setdefault("prefill_start_layer", 0)
    kv_args.setdefault("num_draft_entries", 0)
    kv_args.setdefault("swa_kv_cache_layout", "nhd")
    v.kv_args = types.SimpleNamespace(**kv_args)
    return v


if __name__ == "__main__":
    h = load(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_WHEEL)
    print("loaded sglang", h.version, "from", h.wheel)
    print("torch imported:", "torch" in sys.modules,
          "| sglang in sys.modules:", any(k == "sglang" or k.startswith("sglang.") for k in sys.modules))
    for q, e in sorted(h.provenance.items(), key=lambda kv: (kv[1].path, kv[1].lineno)):
        span = f"{e.lineno}-{e.end_lineno}" if e.lineno else "module"
        print(f"  {e.path}:{span}  {q}  globals={e.global_reads}")
