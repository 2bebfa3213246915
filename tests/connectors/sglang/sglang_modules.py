"""SGLang's connector modules imported from the wheel itself, with stand-ins for the server around them.

`load(wheel)` imports, from the SGLang wheel (a zip, never installed; the wheel checked against its pinned sha256 and
every source file against the wheel's RECORD by tests/planners/sglang/load_helpers.py's `WheelSource`):

- `sglang/srt/disaggregation/mooncake/conn.py` (MooncakeKVManager, its KVArgsRegisterInfo and TransferInfo),
- `sglang/srt/disaggregation/mori/conn.py` (the Mori wire decoders kvrelay's frames follow),
- `sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py` (SGLang's Mooncake engine wrapper),

and, for real, everything they import from SGLang (common/conn.py, common/utils.py, disaggregation/utils.py,
base/conn.py, environ.py, runtime_context.py, utils/common.py, utils/network.py, platforms/, observability/, ...).

Stand-ins replace what a send path on host memory never runs: torch, triton, PIL, starlette, the model configs, the
memory-pool kernels' module, the distributed runtime, the server's argument class, and Mori's C++ engine. Each
stand-in is a module holding only the names the import reads (listed in STAND_INS); a stand-in function raises when
called, so a send path that reached one would fail loudly instead of running fake code. No stand-in computes an
address or moves a byte. The few that answer (torch's "is a GPU available": no) answer what is true here.

Two packages are entered without running their `__init__.py` (BARE): `sglang` (the public API: it imports the
language frontend and patches transformers) and `sglang.srt.distributed` (its `__init__` imports the collective
communication ops, torch through and through); their submodules are imported normally.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import importlib.machinery
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
PLANNER = os.path.join(HERE, "..", "..", "planners", "sglang")
if PLANNER not in sys.path:
    sys.path.insert(0, PLANNER)

import load_helpers  # noqa: E402  (tests/planners/sglang: the wheel's sha256 and RECORD checks)

BARE = {"sglang", "sglang.srt.distributed"}


class StandInCalled(RuntimeError):
    """SGLang code called a stand-in: the harness does not provide what that path needs."""


def _absent(qualname):
    def absent(*args, **kwargs):
        raise StandInCalled(f"kvrelay stand-in: SGLang called {qualname}, which this harness does not provide")

    absent.__qualname__ = absent.__name__ = qualname.rsplit(".", 1)[-1]
    return absent


def _class(qualname, base=object):
    """An empty class: the name is read (a base class, an annotation, an isinstance check), never used for work."""
    return type(qualname.rsplit(".", 1)[-1], (base,), {"__module__": qualname.rsplit(".", 1)[0],
                                                     "__init__": lambda self, *args, **kwargs: None})


def _jit(fn=None, **options):
    if fn is None:
        return _jit
    return _absent(f"the triton kernel {fn.__module__}.{fn.__qualname__}")


def _false(*args, **kwargs):
    return False


def _mori_stand_ins():
    """Mori's engine types. Only EngineDesc.unpack and MemoryDesc.unpack are called (by mori/conn.py's decoders
    through the patched `_unpack_mem_desc_list(s)`, see wire.py): registration frames 4-7 carry kvrelay's own
    encoding of Mori's descriptors (src/pure/wire/desc.rs), not Mori's C++ msgpack, by design."""
    import wire  # noqa: PLC0415  (this folder)

    return {
        "EngineDesc": wire.EngineDesc,
        "MemoryDesc": wire.MemoryDesc,
        **{name: _class(f"mori.io.{name}") for name in ("BackendType", "IOEngine", "IOEngineConfig",
                                                        "MemoryLocationType", "PollCqMode", "RdmaBackendConfig",
                                                        "StatusCode")},
    }


# Module name -> (what it stands in for, names it holds). Names are what the import reads (found by importing with a
# stand-in that logs every read); anything else read from a stand-in raises AttributeError naming it.
STAND_INS = {
    "torch": ("torch 2.14.1 (the wheel's pin): tensors never reach a host-memory send path", lambda: {
        "__version__": "2.14.1",  # utils/common.py parses it at import
        "Tensor": _class("torch.Tensor"),  # transfer_worker's isinstance check (mooncake/conn.py:2552)
        "cuda": _module("torch.cuda", {"is_available": _false}),
        "mps": _module("torch.mps", {"is_available": _false}),
        "xpu": _module("torch.xpu", {"is_available": _false}),
        "cpu": _module("torch.cpu", {"_is_amx_tile_supported": _false}),
        "version": _module("torch.version", {"hip": None, "musa": None, "cuda": None}),
        "profiler": _module("torch.profiler", {"ProfilerActivity": _class("torch.profiler.ProfilerActivity")}),
        "nn": _module("torch.nn", {}),
        # utils/common.py:149 reads FP8_E4M3_MAX at import: the format's largest finite value.
        "float8_e4m3fn": "torch.float8_e4m3fn",
        "finfo": lambda dtype: types.SimpleNamespace(max={"torch.float8_e4m3fn": 448.0}[dtype]),
    }),
    "torch.distributed": ("torch.distributed: no process group exists here", dict),
    "torch.library": ("torch.library: utils/common.py creates a custom-op Library at import",
                      lambda: {"Library": _class("torch.library.Library")}),
    "torch.utils": ("torch.utils", dict),
    "torch.utils._contextlib": ("torch.utils._contextlib", lambda: {
        "_DecoratorContextManager": _class("torch.utils._contextlib._DecoratorContextManager")}),
    "triton": ("triton: no kernel runs; a kernel defined at import (common/staging_buffer.py:62, 100) is a stand-in "
               "that raises when launched", lambda: {"jit": _jit}),
    "triton.language": ("triton.language: read only inside kernel bodies", dict),
    "sglang.kernels": ("SGLang's kernels", dict),
    "sglang.kernels.ops": ("SGLang's kernels", dict),
    "sglang.kernels.ops.memory": ("SGLang's kernels", dict),
    "sglang.kernels.ops.memory.ptr_table": ("the staging buffer's pointer-table kernel", lambda: {
        "make_ptr_table": _absent("sglang.kernels.ops.memory.ptr_table.make_ptr_table")}),
    "PIL": ("pillow: utils/common.py's image helpers", lambda: {
        "Image": _module("PIL.Image", {}), "ImageOps": _module("PIL.ImageOps", {}),
        "UnidentifiedImageError": _class("PIL.UnidentifiedImageError", Exception)}),
    "starlette": ("starlette: the HTTP server", dict),
    "starlette.routing": ("starlette.routing", lambda: {"Mount": _class("starlette.routing.Mount")}),
    "sglang.srt.configs": ("the model configs (transformers)", dict),
    "sglang.srt.configs.model_config": ("the model config: disaggregation/utils.py imports two DSA predicates", lambda: {
        "get_dsa_mtp_topk_width": _absent("sglang.srt.configs.model_config.get_dsa_mtp_topk_width"),
        "is_deepseek_dsa": _absent("sglang.srt.configs.model_config.is_deepseek_dsa")}),
    "sglang.srt.distributed.parallel_state": ("the distributed runtime: the engine is set on the manager instead", lambda: {
        "GroupCoordinator": _class("sglang.srt.distributed.parallel_state.GroupCoordinator"),
        "get_mooncake_transfer_engine": _absent("sglang.srt.distributed.parallel_state.get_mooncake_transfer_engine")}),
    "sglang.srt.distributed.communication_tags": ("the distributed runtime's message tags", lambda: {
        "P2PTag": _class("sglang.srt.distributed.communication_tags.P2PTag")}),
    "sglang.srt.mem_cache.page_interleave": ("the page-interleaved memory pool (kernels): KV cache sharding is off", lambda: {
        "get_kv_shard_group": _absent("sglang.srt.mem_cache.page_interleave.get_kv_shard_group")}),
    "sglang.srt.model_executor": ("the model runner", dict),
    "sglang.srt.model_executor.forward_batch_info": ("the model runner's batch info", lambda: {
        "ForwardMode": _class("sglang.srt.model_executor.forward_batch_info.ForwardMode")}),
    "sglang.srt.server_args": ("the server's arguments: an annotation in the connector modules", lambda: {
        "ServerArgs": _class("sglang.srt.server_args.ServerArgs")}),
    "mori": ("Mori's engine (C++)", dict),
    "mori.cpp": ("Mori's engine (C++)", lambda: {"TransferStatus": _class("mori.cpp.TransferStatus")}),
    "mori.io": ("Mori's engine (C++); its descriptors decode kvrelay's encoding", _mori_stand_ins),
}


class StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"kvrelay stand-in {self.__name__} has no {name!r} (SGLang reads more than it did)")


def _module(name, names):
    module = StandIn(name)
    module.__dict__.update(names)
    return module


class WheelImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `sglang.*` from the wheel (sources checked against RECORD) and the stand-ins above."""

    def __init__(self, source):
        self.source = source
        self.files = set(source._zip.namelist()) if source._zip is not None else None
        self.stand_ins_used = []

    def _has(self, rel):
        if self.files is not None:
            return rel in self.files
        return os.path.exists(os.path.join(self.source.path, rel))

    def _is_dir(self, rel):
        if self.files is not None:
            return any(name.startswith(rel + "/") for name in self.files)
        return os.path.isdir(os.path.join(self.source.path, rel))

    def find_spec(self, name, path=None, target=None):
        if name in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name.split(".")[0] != "sglang":
            return None
        rel = name.replace(".", "/")
        if name in BARE or (not self._has(rel + "/__init__.py") and not self._has(rel + ".py") and self._is_dir(rel)):
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.loader_state = None
            return spec
        for candidate, package in ((rel + "/__init__.py", True), (rel + ".py", False)):
            if self._has(candidate):
                spec = importlib.machinery.ModuleSpec(name, self, is_package=package, origin=candidate)
                spec.loader_state = candidate
                return spec
        return None

    def create_module(self, spec):
        if spec.name in STAND_INS:
            self.stand_ins_used.append(spec.name)
            module = _module(spec.name, STAND_INS[spec.name][1]())
            module.__path__ = []
            return module
        return None

    def exec_module(self, module):
        spec = module.__spec__
        if spec.name in STAND_INS:
            return
        if spec.submodule_search_locations is not None:
            module.__path__ = []
        rel = spec.loader_state
        if rel is None:  # a bare or namespace package: no code of its own runs
            return
        module.__file__ = rel
        code = compile(self.source.read(rel), rel, "exec", dont_inherit=True)
        exec(code, module.__dict__)


class Settings:
    """What the send path reads from SGLang's runtime configuration (`get_memory()`, `get_spec()`,
    `get_parallel()`, `get_observability()`), answered with the server's defaults: unified memory, speculative
    decoding, KV cache sharding, DSA layer split, CP/TP group sharing and tracing are all off. A read of anything
    else raises, naming it."""

    def __init__(self, name, **values):
        self.__dict__["_name"] = name
        self.__dict__.update(values)

    def __getattr__(self, attr):
        raise AttributeError(f"kvrelay: SGLang read {self._name}.{attr}, which the harness does not set")


def load(wheel, nixl=False):
    """Imports the connector modules from `wheel` (with `nixl`, also disaggregation/nixl/conn.py: NIXL's Python API
    must be importable as `nixl_cu12` by then); returns a namespace of them."""
    source = load_helpers.WheelSource(wheel)
    importer = WheelImporter(source)
    sys.meta_path.insert(0, importer)
    # A platform plug-in would be searched in installed distributions; SGLang then picks its CPU platform
    # (platforms/__init__.py:152): this process has no GPU.
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang.srt.disaggregation.mooncake.conn as mooncake  # noqa: PLC0415
    import sglang.srt.disaggregation.mori.conn as mori  # noqa: PLC0415
    import sglang.srt.disaggregation.common.conn as common  # noqa: PLC0415
    import sglang.srt.disaggregation.common.utils as common_utils  # noqa: PLC0415
    import sglang.srt.disaggregation.base.conn as base  # noqa: PLC0415
    import sglang.srt.disaggregation.utils as disagg_utils  # noqa: PLC0415
    import sglang.srt.distributed.device_communicators.mooncake_transfer_engine as engine_wrapper  # noqa: PLC0415

    nixl_conn = None
    if nixl:
        # SGLang imports `nixl` (the meta package that picks nixl_cu12 or nixl_cu13 and re-exports it); here the
        # pinned nixl_cu12 wheel is that package.
        import nixl_cu12  # noqa: PLC0415
        import nixl_cu12._api  # noqa: PLC0415
        import nixl_cu12._bindings  # noqa: PLC0415

        sys.modules.setdefault("nixl", nixl_cu12)
        sys.modules.setdefault("nixl._api", nixl_cu12._api)
        sys.modules.setdefault("nixl._bindings", nixl_cu12._bindings)
        import sglang.srt.disaggregation.nixl.conn as nixl_conn  # noqa: PLC0415

    # `logger.warning_once` (mooncake/conn.py:2364, 2456) is not the standard library's: transformers adds it to
    # logging.Logger when imported (transformers/utils/logging.py), which every SGLang server does. The same here:
    # each text once.
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = functools.lru_cache(None)(lambda self, *args, **kwargs: self.warning(*args,
                                                                                                        **kwargs))
    memory = Settings("get_memory()", enable_unified_memory=False)
    spec = Settings("get_spec()", speculative_algorithm=None)
    parallel = Settings("get_parallel()", enable_kv_cache_sharding=False, enable_dsa_cache_layer_split=False,
                        enable_cp_tp_group_sharing=False)
    observability = Settings("get_observability()", enable_trace=False)
    # The device: this process has no GPU (NIXL's prepared state transfers need "cuda", nixl/conn.py:693).
    device = Settings("get_device()", device="cpu")
    for module in (mooncake, common, disagg_utils) + ((nixl_conn,) if nixl_conn else ()):
        for name, value in (("get_memory", memory), ("get_spec", spec), ("get_parallel", parallel),
                            ("get_observability", observability), ("get_device", device)):
            if name in module.__dict__:
                module.__dict__[name] = lambda value=value: value
    return types.SimpleNamespace(mooncake=mooncake, mori=mori, common=common, common_utils=common_utils, base=base,
                                 utils=disagg_utils, engine_wrapper=engine_wrapper, nixl=nixl_conn,
                                 version=source.version(),
                                 stand_ins=list(importer.stand_ins_used))
