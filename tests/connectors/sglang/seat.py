"""What SGLang's connectors share in kvrelay's connector seat (mooncake_connector.py, nixl_connector.py): the query
in SGLang's kv_args terms on the node's real registrations, the scheduler's chunks, decode's dummy choice, and the
connector's logged errors.
"""

import logging
import os
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "transports"))
sys.path.insert(0, HERE)

import sglang_modules  # noqa: E402,F401  (puts tests/planners/sglang on sys.path)
import adapter  # noqa: E402  (tests/planners/sglang: the query in SGLang's kv_args terms, the dummy rule)
import load_helpers  # noqa: E402
from kvrelay_child import Refusal  # noqa: E402


class Errors(logging.Handler):
    """SGLang's logged errors and warnings while a seat op runs (the cause of a failed room is logged, mostly)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        logging.getLogger("sglang.srt.disaggregation").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("sglang.srt.disaggregation").removeHandler(self)
        for record in self.records:
            print(f"sglang {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)
            if record.exc_info:
                traceback.print_exception(*record.exc_info, file=sys.stderr)

    def causes(self, skip=()):
        """The errors logged, in order, without the bookkeeping lines that follow a cause."""
        return [record.getMessage() for record in self.records if record.levelno >= logging.ERROR
                and not any(record.getMessage().startswith(prefix) for prefix in skip)]


def registrations(engine, q):
    """The node's live registrations, checked against the query's `local.regions` (the same count, in `register`
    order, each the size the query describes)."""
    regions = [entry[0] if isinstance(entry, tuple) else entry for entry in engine.regions.values()]
    if len(regions) != len(q["local"]["regions"]):
        raise Refusal("engine", f"node {engine.node} has {len(regions)} registrations, the query lists "
                                f"{len(q['local']['regions'])} regions")
    for region, described in zip(regions, q["local"]["regions"]):
        if region.len != described["item_len"] * described["item_count"]:
            raise Refusal("engine", f"a registration of {region.len} bytes stands for a region of "
                                    f"{described['item_count']} x {described['item_len']} bytes")
    return regions


def kv_args(sgl, q, regions):
    """SGLang's KVArgs (base/conn.py:57) of the query's prefill rank, on the node's real addresses: adapter.Local reads
    the query (the same reading the planner adapter uses)."""
    local = adapter.Local(q)
    model = q["local"]["model"]
    addr = [region.addr for region in regions]
    size = [region.len for region in regions]
    args = sgl.base.KVArgs()
    args.engine_rank = local.tp_rank
    args.kv_data_ptrs = [addr[i] for i in local.kv]
    args.kv_data_lens = [size[i] for i in local.kv]
    args.kv_item_lens = list(local.kv_item_lens)
    args.kv_layer_ids = list(local.kv_layer_ids)
    args.num_draft_entries = local.num_draft
    args.aux_data_ptrs = [addr[i] for i in local.aux]
    args.aux_data_lens = [size[i] for i in local.aux]
    args.aux_item_lens = list(local.aux_item_lens)
    args.state_types = [sgl.base.StateType(kind) for kind in local.state_types]
    args.state_data_ptrs = [[addr[i] for i in comp] for comp in local.state]
    args.state_data_lens = [[size[i] for i in comp] for comp in local.state]
    args.state_item_lens = [list(lens) for lens in local.state_item_lens]
    args.state_layer_ids = [list(ids) for ids in local.state_layer_ids]
    args.state_dim_per_tensor = [list(dims) for dims in local.state_dims]
    args.state_slice_outer_counts = [list(counts) for counts in local.state_outer]
    args.state_conv_shard_groups = [list(groups) for groups in local.state_groups]
    args.page_size = local.page_size
    args.total_kv_head_num = local.total_kv_heads
    args.kv_head_num = max(1, local.total_kv_heads // local.tp)
    args.is_hybrid_mla_backend = local.is_hybrid_mla
    args.pp_rank = local.pp_rank
    args.prefill_start_layer = local.start_layer
    # The stage's layers as adapter.Local reads them (get_pp_indices or SGLANG_PP_LAYER_PARTITION, domain.md 4.1).
    args.prefill_end_layer = local.end_layer
    args.mla_compression_ratios = None
    args.system_dp_rank = 0
    args.swa_kv_cache_layout = "nhd"
    args.kv_layout = None
    args.kv_cache_dtype_str = f"{model['dtype_bytes']}-byte"
    args.gpu_id = 0
    args.ib_device = ""
    return local, args


def chunk_requests(np, local, request, decode_prefix_len, utils=None):
    """The scheduler's chunks of the request (prefill.py:1731-1779): each chunk's pages after the decode's prefix, its
    index_slice counted from there (common/conn.py:2270); the last carries the aux index and the state indices. With
    all-CP transfer, each chunk as the sender's _prepare_send_indices (common/conn.py:2282-2291) hands it to the
    worker: this CP rank's block, through `utils` (the wheel's disaggregation/utils.py)."""
    P = local.page_size
    pages = request["prefill_pages"]
    first = (decode_prefix_len or 0) // P
    done = 0
    chunks = request["chunks"]
    total = sum(-(-tokens // P) for tokens in chunks)
    cp_view = types.SimpleNamespace(attn_cp_rank=local.cp_rank, attn_cp_size=local.cp)
    for index, tokens in enumerate(chunks):
        count = -(-tokens // P)
        kv_indices = np.asarray(pages[first + done: first + done + count], dtype=np.int32)
        last = index + 1 == len(chunks)
        index_slice = slice(done, done + count)
        if local.all_cp:
            kv_indices, index_slice = utils.filter_kv_indices_for_cp_rank(cp_view, kv_indices, index_slice,
                                                                          total_pages=total)
        state = (adapter.Adapter.prefill_state_indices(None, local, request) or None) if last else None
        yield dict(kv_indices=kv_indices, index_slice=index_slice, is_last_chunk=last,
                   aux_index=request["prefill_state"]["aux"] if last else None, state_indices=state,
                   num_kv_tokens=tokens)
        done += count


class DummyRule:
    """Decode's choice of dummy prefill ranks (common/conn.py:1432-1530 then 2635-2640): adapter.py's `is_dummy` with
    the wheel's real CommonKVManager methods in place of the planner's extracted copies
    (load_helpers.make_manager_view reads only `manager_view_class`)."""

    def __init__(self, common):
        methods = {name: getattr(common.CommonKVManager, name) for name in (
            "_resolve_rank_mapping", "get_mha_kv_ptrs_with_pp", "get_mla_kv_ptrs_with_pp", "requires_dcp_relayout")}
        helpers = types.SimpleNamespace(manager_view_class=type("CommonKVManagerView", (), methods))
        self.adapter = adapter.Adapter(helpers, load_helpers)

    def is_dummy(self, local, tp, tp_rank):
        return self.adapter.is_dummy(local, types.SimpleNamespace(tp=tp, tp_rank=tp_rank))


def common_manager_state(sgl, mgr, local):
    """The attributes CommonKVManager.__init__ (common/conn.py:323-475) sets for a prefill rank with no KV sharding and
    no deferred bootstrap (CP as kvrelay's topology says, without CP-TP group sharing)."""
    mgr.is_mla_backend = local.is_mla
    mgr.is_hybrid_mla_backend = local.is_hybrid_mla
    mgr.disaggregation_mode = sgl.utils.DisaggregationMode.PREFILL
    mgr.enable_deferred_decode_kv_release = (
        sgl.common.envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
        and type(mgr).supports_deferred_decode_kv_release)
    mgr._dcp_pack_buffers = None
    mgr.bootstrap_port = 0  # only named in a dying transfer thread's message
    mgr.attn_tp_size, mgr.attn_tp_rank = local.tp, local.tp_rank
    mgr.attn_cp_size, mgr.attn_cp_rank = local.cp, local.cp_rank
    mgr.state_tp_size = local.tp  # linear_attn_tp_size() without CP/TP group sharing
    mgr.dcp_size, mgr.dcp_rank = local.dcp, local.dcp_rank
    mgr.attn_dp_size, mgr.attn_dp_rank = 1, 0
    mgr.pp_size, mgr.pp_rank = local.pp, local.pp_rank
    mgr.enable_all_cp_ranks_for_transfer = local.all_cp
    mgr.is_dummy_cp_rank = not local.all_cp and local.cp > 1 and local.cp_rank != 0
    # A PP>1 prefill keeps request_status in a PPConsensusStore (common/conn.py:459) that agrees across stages over
    # torch.distributed; one stage's own view of its room is what its transfer worker reads.
    mgr.request_status = {}
    mgr._socket_cache, mgr._monitor_cache = {}, {}
    mgr.failure_records = {}
    mgr.failure_lock = sgl.common.threading.Lock()
    mgr._staging_outstanding = sgl.common.defaultdict(int)
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr.deferred_bootstrap = None
    mgr.transfer_infos = {}
    mgr.req_to_decode_prefix_len = {}
    mgr.decode_kv_args_table = {}
    mgr.enable_staging = False
    mgr._staging_ctx = None


class SeatOps:
    """The connector seat's ops (src/fabric/child/README.md, "Connector seat") for a child whose `make_seat(engine)`
    builds a node's seat (with `link(query)` and `send(query)` -> rejection text or None); mixed in before the
    engine child's class. `seats` maps an engine id to its seat."""

    def seat(self, msg):
        node = msg["node"]
        matches = [ident for ident, engine in self.engines.items() if engine.node == node]
        if len(matches) != 1:
            raise Refusal("engine", f"{len(matches)} open engines of node {node}")
        ident = matches[0]
        if ident not in self.seats:
            self.seats[ident] = self.make_seat(self.engines[ident])
        return self.seats[ident]

    def op_seat_link(self, msg):
        seat = self.seat(msg)
        try:
            with Errors():
                seat.link(msg["query"])
        except Refusal:
            raise
        except Exception as error:  # noqa: BLE001 - it would kill the connector's bootstrap thread; the peer is refused
            return {"rejected": str(error) or type(error).__name__}
        return {}

    def op_seat_send(self, msg):
        seat = self.seat(msg)
        started = time.monotonic()
        try:
            text = seat.send(msg["query"])
        except Refusal:
            raise
        except Exception as error:  # noqa: BLE001 - a failure outside the transfer worker (registration, decoding)
            text = f"{type(error).__name__}: {error}"
        seconds = time.monotonic() - started
        room = f"seat_send {msg['query'].get('case')} room {msg['query']['meta']['room']}"
        if seconds > 5:
            print(f"{room}: {seconds:.1f} s", file=sys.stderr)
        if text is not None:
            print(f"{room} node {msg['node']}: rejected: {text}", file=sys.stderr)
        return {} if text is None else {"rejected": text}
