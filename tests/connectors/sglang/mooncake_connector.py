"""SGLang 0.5.23's own Mooncake connector send path in kvrelay's connector seat, on the real Mooncake Transfer Engine.

    . target/engines/env.sh
    target/release/kvrelay check scenarios \
        --connector "$KVRELAY_MOONCAKE_PYTHON tests/connectors/sglang/mooncake_connector.py" \
        --known tests/connectors/sglang/known-differences.yaml

A transport child (kvrelay-transport-1, src/fabric/child/README.md): every op of tests/transports/mooncake_engine.py
(imported, one Mooncake TransferEngine per node), plus the connector seat's two ops, which put SGLang's
`MooncakeKVManager` (sglang/srt/disaggregation/mooncake/conn.py of the wheel, imported by sglang_modules.py) in every
prefill rank's seat. Line numbers are the 0.5.23 wheel's.

- `seat_link` (a decode rank registers with prefill rank `node`): the registration's frames are decoded by Mori's
  `KVArgsRegisterInfo.from_zmq` (mori/conn.py:223) and become Mooncake's `KVArgsRegisterInfo` (mooncake/conn.py:154);
  then what Mooncake's bootstrap thread does with a registration (mooncake/conn.py:2978-3008):
  `requires_dcp_relayout`, `prepare_dcp_token_item_lens`, `_publish_peer_registration`. An exception there kills
  Mooncake's bootstrap thread; here it refuses the peer with its text (the plan protocol's link refusal).
- `seat_send` (one request to one decode peer): the metadata frames are decoded by Mori's `TransferInfo.from_zmq`
  (mori/conn.py:146) and become Mooncake's `TransferInfo` (mooncake/conn.py:104); the room's chunks go through
  `add_transfer_request` (mooncake/conn.py:3081) into a FastQueue, then the `None` sentinel, and SGLang's own
  `transfer_worker` (mooncake/conn.py:2488-2883) runs them on this thread: the dummy rule, `send_kvcache` /
  `send_kvcache_dcp` / `send_kvcache_slice`, `maybe_send_extra` on the last chunk, `send_aux`, each ending in
  `engine.batch_transfer_sync` (mooncake/conn.py:822, 1769) of SGLang's engine wrapper
  (distributed/device_communicators/mooncake_transfer_engine.py:255), whose inner engine is node `node`'s real
  TransferEngine: the bytes land in the decode rank's mapping before the answer.

What the harness sets instead of SGLang's server (each is read by the send path, none computes an address):
- the manager is built with `__new__` and the attributes `CommonKVManager.__init__` (common/conn.py:316-475) and
  `MooncakeKVManager.__init__` (mooncake/conn.py:262-380) would set for a prefill rank with no staging buffer, no
  custom memory pool, no CP, no KV sharding and tracing off; `kv_args` from the query's `local` (adapter.py's
  `Local`, shared with the planner adapter) with this node's real mapped addresses;
- the DCP pack buffer (a device-side gather, `_init_dcp_pack_buffers_once`, common/conn.py:586) is not created:
  with none, `send_kvcache_dcp` sends straight from the KV pool (mooncake/conn.py:1472, 1653-1664);
- the status message to decode (`send_kv_status_message`, common/conn.py:784: a ZMQ push) is recorded instead of
  sent: kvrelay's engines carry the control messages; the answer is the room's status;
- a room is asked about one peer at a time, so its TransferInfo says `required_dst_info_num = 1` (the room's
  conclusion over all its peers is kvrelay's to draw); the room's state (a failure) and the manager's (its blacklist
  of failed sessions, its registrations) persist across the node's calls as in SGLang;
- which decode peers are dummies (decode's choice, carried in Mooncake by empty index frames, mooncake/conn.py:125):
  decode's `_resolve_rank_mapping` (common/conn.py:1432) and the MLA rule (common/conn.py:2635-2640), via adapter.py.

Answers: `{"ok": true}` when SGLang's code concluded the room with success (every batch_transfer_sync returned 0);
`{"ok": true, "rejected": TEXT}` when it raised (the exception's text; the real transfer thread dies with it wrapped
in "Transfer thread failed because of ...", mooncake/conn.py:2877-2883) or failed the room (the first error it
logged, which is the cause, else the failure it recorded).
"""

import argparse
import concurrent.futures
import glob
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import seat as shared  # noqa: E402  (also puts tests/transports and tests/planners/sglang on sys.path)
import mooncake_engine  # noqa: E402  (tests/transports: the Mooncake child this one extends)
import kvrelay_child  # noqa: E402
from kvrelay_child import serve  # noqa: E402
import sglang_modules  # noqa: E402
import wire  # noqa: E402

DEFAULT_VERSION = "0.5.23"


class Seat:
    """One prefill rank (node): SGLang's MooncakeKVManager on the node's TransferEngine, kept while its engine lives."""

    def __init__(self, sgl, engine):
        self.sgl, self.node_engine = sgl, engine
        mc = sgl.mooncake
        self.mgr = mc.MooncakeKVManager.__new__(mc.MooncakeKVManager)
        self.executor = None
        self.statuses = []
        self.configured = None

    def configure(self, q):
        """kv_args and the rank's attributes from the query (the same for every query of a case)."""
        sgl, mc, mgr = self.sgl, self.sgl.mooncake, self.mgr
        regions = shared.registrations(self.node_engine, q)
        local, args = shared.kv_args(sgl, q, regions)
        key = (tuple(region.addr for region in regions), local.tp, local.tp_rank, local.pp, local.pp_rank)
        if self.configured == key:
            return local
        mgr.kv_args = args
        shared.common_manager_state(sgl, mgr, local)
        # MooncakeKVManager.__init__ (mooncake/conn.py:277-353), a prefill rank.
        mgr.engine = self.wrapper()
        mgr.max_transfer_batch_indices = sgl.mooncake.envs.SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES.get()
        mgr.enable_trace = False
        mgr._stopped = False
        mgr.enable_failed_session_probe = False
        mgr.session_failures = sgl.common.defaultdict(int)
        mgr.failed_sessions = set()
        mgr.failed_session_probes = {}
        mgr.state_layout_rejections = {}
        mgr.state_strides_validated = set()
        mgr.session_lock = sgl.common.threading.Lock()
        mgr.enable_custom_mem_pool, mgr.custom_mem_pool_type = False, None
        pool = sgl.mooncake.envs.SGLANG_DISAGGREGATION_THREAD_POOL_SIZE.get()
        queues = sgl.mooncake.envs.SGLANG_DISAGGREGATION_QUEUE_SIZE.get()
        if pool is None:
            pool = min(max(4, int(0.5 * os.cpu_count()) // 8), 12)
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        self.executor = concurrent.futures.ThreadPoolExecutor(max(1, pool // queues))
        mgr.send_kv_status_message = self.record_status
        self.local = local
        self.configured = key
        return local

    def wrapper(self):
        """SGLang's engine wrapper (mooncake_transfer_engine.py:110) around the node's TransferEngine: its __init__
        (l.113-140) without initialize(), which the child already did (loopback, P2P handshake, TCP)."""
        wrapper = self.sgl.engine_wrapper.MooncakeTransferEngine.__new__(self.sgl.engine_wrapper.MooncakeTransferEngine)
        wrapper.engine = self.node_engine.te
        wrapper.hostname = self.node_engine.session.rpartition(":")[0]
        wrapper.gpu_id, wrapper.ib_device = 0, ""
        wrapper.session_id = self.node_engine.session
        return wrapper

    def record_status(self, *, targets, bootstrap_room, status, failure_reason=None):
        """Stands in for the ZMQ status push to decode (common/conn.py:784)."""
        self.statuses.append((bootstrap_room, status, failure_reason))

    # ------------------------------------------------------------------------------------------------------------
    def registration(self, q):
        """Mooncake's KVArgsRegisterInfo (mooncake/conn.py:154) from Mori's decoding of kvrelay's frames."""
        mc, mori = self.sgl.mooncake, self.sgl.mori
        payload = wire.frames(q["registration_frames"])
        reg = mori.KVArgsRegisterInfo.from_zmq(payload)
        session = reg.engine_desc.address.decode()
        info = mc.KVArgsRegisterInfo(
            room="None",  # a registration's room frame (mooncake/conn.py:2978)
            endpoint=reg.endpoint,
            dst_port=reg.dst_port,
            # Mooncake's msg[3] is the decode engine's session id; kvrelay's engine descriptor carries it as the
            # engine's peer address (Mori's descriptor has the key, GPU, host and port instead).
            mooncake_session_id=session,
            dst_kv_ptrs=[desc.addr for desc in reg.dst_kv_mem_descs],
            dst_aux_ptrs=[desc.addr for desc in reg.dst_aux_mem_descs],
            dst_state_data_ptrs=[[desc.addr for desc in comp] for comp in reg.dst_state_mem_descs],
            dst_tp_rank=reg.decode_tp_rank,
            dst_attn_tp_size=reg.decode_tp_size,
            dst_kv_item_len=reg.dst_kv_item_len,
            dst_state_item_lens=reg.dst_state_item_lens,
            dst_state_dim_per_tensor=reg.dst_state_dim_per_tensor,
            dst_kv_layer_ids=reg.dst_kv_layer_ids,
            dst_state_layer_ids=reg.dst_state_layer_ids,
            dst_dcp_size=reg.dst_dcp_size,
            dst_dcp_rank=reg.dst_dcp_rank,
            dst_kv_item_lens=wire.kv_item_lens(payload),
            # No counterpart: Mori's gpu_id and engine key (Mooncake names the peer by its session id), the memory
            # descriptors' lengths and rkeys (Mooncake's TCP transport addresses the peer's registered memory by
            # session and address), and Mooncake's staging fields (no staging buffer: they keep their defaults).
        )
        return info, reg

    def link(self, q):
        """What Mooncake's bootstrap thread does with a registration (mooncake/conn.py:2978-3008)."""
        local = self.configure(q)
        mgr = self.mgr
        info, _ = self.registration(q)
        info.requires_dcp_relayout = mgr.requires_dcp_relayout(info.dst_dcp_size, info.dst_dcp_rank)
        if info.requires_dcp_relayout:
            entries, draft = len(mgr.kv_args.kv_item_lens), mgr.kv_args.num_draft_entries
            info.dcp_token_item_lens = mgr.prepare_dcp_token_item_lens(
                [info.dst_kv_item_len] * (entries - draft) + [None] * draft, info.dst_dcp_size)
            # _init_dcp_pack_buffers_once (l.2997) is not run: see the module's docstring.
        mgr._publish_peer_registration(info.mooncake_session_id, info)
        return local, info

    def is_dummy(self, local, reg):
        return self.sgl.dummy_rule.is_dummy(local, reg.decode_tp_size, reg.decode_tp_rank)

    def send(self, q):
        """The room's chunks through SGLang's transfer worker; returns None (success) or the rejection text."""
        mc, mgr = self.sgl.mooncake, self.mgr
        local = self.configure(q)
        info, reg = self.registration(q)
        if info.mooncake_session_id not in mgr.decode_kv_args_table:
            self.link(q)  # the peer registered before kvrelay's seat existed for it: register it now
        meta_frames = wire.frames(q["meta_frames"])
        meta = self.sgl.mori.TransferInfo.from_zmq(meta_frames)
        # kvrelay's frame 10 (after the guard: msg[9]) is Mooncake's device_kv_indices, which Mori's decoder ignores:
        # read as mooncake/conn.py:142-146 reads it.
        device = (self.sgl.np.frombuffer(meta_frames[9], dtype=self.sgl.np.int32)
                  if len(meta_frames) > 9 and meta_frames[9] != b"" else None)
        room = meta.room
        if mgr.request_status.get(room) == self.sgl.base.KVPoll.Failed:
            return mgr.failure_records.get(room, "the room already failed on this prefill rank")
        if not q["request"]["chunks"]:
            return None  # nothing of this room is this rank's to send (as the planner adapter answers no copies)
        request = q["request"]
        dummy = self.is_dummy(local, reg)
        transfer = mc.TransferInfo(
            room=room,
            endpoint=meta.endpoint,
            dst_port=meta.dst_port,
            # Mori's metadata names the decode engine by key (msg[3]); Mooncake's by session id: the registration's.
            mooncake_session_id=info.mooncake_session_id,
            dst_kv_indices=meta.dst_kv_indices if not dummy else self.sgl.np.array([], dtype=self.sgl.np.int32),
            # Mori decodes an absent aux index as -1 (mori/conn.py:166); Mooncake as None only for a dummy.
            dst_aux_index=None if dummy else meta.dst_aux_index,
            dst_state_indices=[] if dummy else [[int(x) for x in comp] for comp in meta.dst_state_indices],
            required_dst_info_num=1,  # see the module's docstring
            is_dummy=dummy,
            decode_prefix_len=meta.decode_prefix_len,
            dst_device_kv_indices=None if dummy else device,
        )
        mgr.transfer_infos[room] = {info.mooncake_session_id: transfer}
        mgr.request_status[room] = self.sgl.base.KVPoll.WaitingForInput
        mgr.req_to_decode_prefix_len[room] = meta.decode_prefix_len or 0
        queue = self.sgl.common_utils.FastQueue()
        mgr.transfer_queues = [queue]
        for chunk in shared.chunk_requests(self.sgl.np, local, request, meta.decode_prefix_len, self.sgl.utils):
            mgr.add_transfer_request(room, chunk["kv_indices"], chunk["index_slice"], chunk["is_last_chunk"],
                                     aux_index=chunk["aux_index"], state_indices=chunk["state_indices"],
                                     num_kv_tokens=chunk["num_kv_tokens"])
        queue.put(None)
        self.statuses.clear()
        with shared.Errors() as errors:
            try:
                mgr.transfer_worker(queue, self.executor, None, 0)
            except Exception as error:  # noqa: BLE001 - the transfer thread dies with it (mooncake/conn.py:2877-2883)
                cause = error.__context__ or error
                mgr.request_status[room] = self.sgl.base.KVPoll.Failed
                mgr.failure_records.setdefault(room, str(cause))
                return str(cause) or type(cause).__name__
        status = mgr.request_status.get(room)
        if status == self.sgl.base.KVPoll.Success:
            return None
        if status == self.sgl.base.KVPoll.Failed:
            causes = errors.causes(skip=("Session ",))
            return causes[0] if causes else mgr.failure_records.get(room, "failed")
        return f"SGLang's transfer worker left room {room} {status!r} after its last chunk"


class Child(shared.SeatOps, mooncake_engine.Child):
    def __init__(self, limits, sgl):
        super().__init__(limits)
        self.sgl = sgl
        self.seats = {}  # engine id -> Seat

    def op_hello(self, msg):
        hello = super().op_hello(msg)
        hello["engine"] = "sglang-mooncake-connector"
        hello["facts"].update({
            "connector": f"SGLang {self.sgl.version} MooncakeKVManager (disaggregation/mooncake/conn.py)",
            "stand-ins": ", ".join(self.sgl.stand_ins),
        })
        return hello

    def op_close(self, msg):
        seat = self.seats.pop(msg["engine"], None)
        if seat is not None and seat.executor is not None:
            seat.executor.shutdown(wait=True)
        return super().op_close(msg)

    def make_seat(self, engine):
        return Seat(self.sgl, engine)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="SGLang version whose wheel to load")
    parser.add_argument("--wheel", default=None, help="the wheel (default: tests/planners/sglang/wheels/sglang-VERSION-*)")
    kvrelay_child.add_limit_arguments(parser, 1024, 1 << 30, 8)
    args = parser.parse_args()
    wheel = args.wheel or next(iter(sorted(glob.glob(os.path.join(
        HERE, "..", "..", "planners", "sglang", "wheels", f"sglang-{args.version}-*.whl")))), None)
    if wheel is None or not os.path.exists(wheel):
        print(f"mooncake_connector: no SGLang {args.version} wheel; fetch it: bash ci/sglang.sh (or pip download "
              f"sglang=={args.version} --no-deps -d tests/planners/sglang/wheels)", file=sys.stderr)
        sys.exit(2)
    sgl = sglang_modules.load(wheel)
    import numpy  # noqa: PLC0415

    sgl.np = numpy
    wire.install(sgl.mori)
    sgl.dummy_rule = shared.DummyRule(sgl.common)
    logging.getLogger("sglang").setLevel(logging.WARNING)
    limits = kvrelay_child.limits_of(args)
    serve(Child(limits, sgl), errors=(KeyError, TypeError, ValueError, OSError, RuntimeError))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
