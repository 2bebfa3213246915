"""SGLang 0.5.23's own NIXL connector send path in kvrelay's connector seat, on NIXL 1.5.1 (UCX, host memory).

    . target/engines/env.sh
    target/release/kvrelay check scenarios \
        --connector "$KVRELAY_MOONCAKE_PYTHON tests/connectors/sglang/nixl_connector.py" \
        --known tests/connectors/sglang/nixl-known-differences.yaml

A transport child (kvrelay-transport-1): every op of tests/transports/nixl_engine.py (imported: one nixl_agent per
node, DRAM, UCX), plus the connector seat's two ops, which put SGLang's `NixlKVManager`
(sglang/srt/disaggregation/nixl/conn.py of the wheel) in every prefill rank's seat, its `agent` the node's agent.
Line numbers are the 0.5.23 wheel's. As mooncake_connector.py, with NIXL's own steps:

- `seat_link`: Mori's `KVArgsRegisterInfo.from_zmq` (mori/conn.py:223) on kvrelay's frames becomes NIXL's
  `KVArgsRegisterInfo` (nixl/conn.py:342), and NIXL's bootstrap thread's registration step runs: `_add_remote_peer`
  (nixl/conn.py:2030: `requires_dcp_relayout`, `add_remote_agent`, `_prepare_payload_xfer` with its prepared dlists
  and `prepare_dcp_token_item_lens`, `_prepare_state_xfer`). An exception there kills NIXL's bootstrap thread
  (nixl/conn.py:3415-3424); here it refuses the peer with its text.
- `seat_send`: Mori's `TransferInfo.from_zmq` (mori/conn.py:146) becomes NIXL's `TransferInfo` (nixl/conn.py:285);
  the chunks go through `add_transfer_request` (nixl/conn.py:3261) and SGLang's `transfer_worker`
  (nixl/conn.py:1602-1970) runs them on a thread of its own, as in SGLang, while this thread keeps the other nodes'
  agents progressing (no agent has a progress thread); the worker has no stop sentinel (`kv_chunk.room` is read
  before its try, l.1609-1610), so the `None` queued after the last chunk ends it with an AttributeError there.

What the harness sets in SGLang's place, besides what mooncake_connector.py's docstring lists (the status message
recorded, one peer per room, the dummy rule, no DCP pack buffer):
- the node's memory is registered by the child, as DRAM (kvrelay's `register` op), so `register_buffer_to_engine`
  (nixl/conn.py:1972) is not run: it would register the same ranges again, and its state registration is VRAM
  (l.2023), which host memory cannot be; `kv_data_mem_kinds` are DRAM on both sides (Mori's descriptors carry a
  location, kvrelay's encoding of them does not: kvrelay's memory is host memory);
- the agent name NIXL's registration carries (msg[3]) is the decode agent's own name, found in this child (which made
  that agent) from the metadata kvrelay's engine descriptor carries as the peer address;
- `dst_num_slots` (NIXL's msg[16], no Mori counterpart) is `num_kv_slots` (nixl/conn.py:483) of the decode KV
  descriptors' lengths, as NIXL's decode computes it; `dst_state_data_lens` (msg[23]) the state descriptors' lengths.
"""

import argparse
import base64
import glob
import logging
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import seat as shared  # noqa: E402  (also puts tests/transports and tests/planners/sglang on sys.path)
import nixl_engine  # noqa: E402  (tests/transports: the NIXL child this one extends)
import kvrelay_child  # noqa: E402
from kvrelay_child import Refusal, serve  # noqa: E402
import sglang_modules  # noqa: E402
import wire  # noqa: E402

DEFAULT_VERSION = "0.5.23"


class Seat:
    """One prefill rank (node): SGLang's NixlKVManager on the node's NIXL agent, kept while its engine lives."""

    def __init__(self, sgl, engine, child):
        self.sgl, self.node_engine, self.child = sgl, engine, child
        self.mgr = sgl.nixl.NixlKVManager.__new__(sgl.nixl.NixlKVManager)
        self.statuses = []
        self.configured = None

    def configure(self, q):
        sgl, nx, mgr = self.sgl, self.sgl.nixl, self.mgr
        regions = shared.registrations(self.node_engine, q)
        local, args = shared.kv_args(sgl, q, regions)
        key = (tuple(region.addr for region in regions), local.tp, local.tp_rank, local.pp, local.pp_rank)
        if self.configured == key:
            return local
        args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
        mgr.kv_args = args
        shared.common_manager_state(sgl, mgr, local)
        # NixlKVManager.__init__ (nixl/conn.py:524-690), a prefill rank, without its agent and backend (the node's).
        mgr.src_mem_kind = nx._homogeneous_kv_mem_kind(args.kv_data_mem_kinds, "source") if args.kv_data_ptrs else None
        mgr.agent = self.node_engine.agent
        mgr._prepared_state_plans = {}
        mgr._state_layout_rejections = {}
        mgr.kv_buffer_tensors = None
        mgr.prep_handles = {}
        mgr.prep_handle_slice_src = None
        mgr.prep_handles_slice_dst = {}
        mgr.prep_handles_segment_src = {}
        mgr._num_slots_src = nx.num_kv_slots(args.kv_data_lens, args.kv_item_lens) if args.kv_item_lens else 0
        mgr._peer_reload_lock = threading.Lock()
        mgr._peer_reload_times = {}
        mgr._prepared_state_components = mgr._prepared_state_component_indices(
            sgl.nixl.envs.SGLANG_DISAGGREGATION_NIXL_BACKEND.get())
        # No DCP pack buffers (a device-side gather of torch tensors, common/conn.py:586-606): an empty list makes
        # _add_remote_peer's _init_dcp_pack_buffers_once (nixl/conn.py:2038) a no-op and gives the transfer worker
        # no pack buffer (nixl/conn.py:1733-1737), so send_kvcache_dcp sends straight from the KV pool.
        mgr._dcp_pack_buffers = []
        mgr.send_kv_status_message = self.record_status
        self.configured = key
        return local

    def record_status(self, *, targets, bootstrap_room, status, failure_reason=None):
        """Stands in for the ZMQ status push to decode (common/conn.py:784)."""
        self.statuses.append((bootstrap_room, status, failure_reason))

    def registration(self, q):
        """NIXL's KVArgsRegisterInfo (nixl/conn.py:342) from Mori's decoding of kvrelay's frames."""
        nx, mori = self.sgl.nixl, self.sgl.mori
        payload = wire.frames(q["registration_frames"])
        reg = mori.KVArgsRegisterInfo.from_zmq(payload)
        _, metadata = nixl_engine.parse_address(reg.engine_desc.address)
        name = self.child.agent_names.get(metadata)
        if name is None:
            raise Refusal("engine", "the registration names an agent this child did not make")
        kv_ptrs = [desc.addr for desc in reg.dst_kv_mem_descs]
        item_lens = wire.kv_item_lens(payload) or [reg.dst_kv_item_len] * len(kv_ptrs)  # as nixl/conn.py:383-387
        info = nx.KVArgsRegisterInfo(
            room="None",
            endpoint=reg.endpoint,
            dst_port=reg.dst_port,
            agent_name=name,
            agent_metadata=metadata,
            dst_kv_ptrs=kv_ptrs,
            dst_kv_mem_kinds=["DRAM"] * len(kv_ptrs),
            dst_aux_ptrs=[desc.addr for desc in reg.dst_aux_mem_descs],
            dst_state_data_ptrs=[[desc.addr for desc in comp] for comp in reg.dst_state_mem_descs],
            gpu_id=reg.gpu_id,
            decode_tp_size=reg.decode_tp_size,
            decode_tp_rank=reg.decode_tp_rank,
            dst_kv_item_len=reg.dst_kv_item_len,
            dst_kv_item_lens=item_lens,
            dst_kv_layer_ids=reg.dst_kv_layer_ids,
            dst_dcp_size=reg.dst_dcp_size,
            dst_dcp_rank=reg.dst_dcp_rank,
            dst_num_slots=nx.num_kv_slots([desc.size for desc in reg.dst_kv_mem_descs], item_lens) if kv_ptrs
            else None,
            dst_state_item_lens=reg.dst_state_item_lens,
            dst_state_dim_per_tensor=reg.dst_state_dim_per_tensor,
            dst_state_layer_ids=reg.dst_state_layer_ids,
            dst_state_data_lens=[[desc.size for desc in comp] for comp in reg.dst_state_mem_descs],
            # No counterpart: the staging fields (no staging buffer: they keep their defaults), the rkeys.
        )
        return info, reg

    def link(self, q):
        """NIXL's bootstrap thread on a registration (nixl/conn.py:3384-3389): _add_remote_peer."""
        self.configure(q)
        info, _ = self.registration(q)
        self.mgr._add_remote_peer(info)

    def send(self, q):
        sgl, nx, mgr = self.sgl, self.sgl.nixl, self.mgr
        local = self.configure(q)
        info, reg = self.registration(q)
        if info.agent_name not in mgr.decode_kv_args_table:
            self.link(q)
        meta = sgl.mori.TransferInfo.from_zmq(wire.frames(q["meta_frames"]))
        room = meta.room
        if mgr.request_status.get(room) == sgl.base.KVPoll.Failed:
            return mgr.failure_records.get(room, "the room already failed on this prefill rank")
        if not q["request"]["chunks"]:
            return None  # nothing of this room is this rank's to send (as the planner adapter answers no copies)
        dummy = sgl.dummy_rule.is_dummy(local, reg.decode_tp_size, reg.decode_tp_rank)
        # NIXL's decode sends no KV indices for a dummy rank (nixl/conn.py:3519) and its prefill skips the peer.
        transfer = nx.TransferInfo(
            room=room,
            endpoint=meta.endpoint,
            dst_port=meta.dst_port,
            agent_name=info.agent_name,
            dst_kv_indices=sgl.np.array([], dtype=sgl.np.int32) if dummy else meta.dst_kv_indices,
            dst_aux_index=meta.dst_aux_index,
            required_dst_info_num=1,  # one peer per room: mooncake_connector.py's docstring
            dst_state_indices=[] if dummy else [[int(x) for x in comp] for comp in meta.dst_state_indices],
            decode_prefix_len=meta.decode_prefix_len,
            is_dummy=dummy,
        )
        mgr.transfer_infos[room] = {info.agent_name: transfer}
        mgr.request_status[room] = sgl.base.KVPoll.WaitingForInput
        mgr.req_to_decode_prefix_len[room] = meta.decode_prefix_len or 0
        queue = sgl.common_utils.FastQueue()
        mgr.transfer_queues = [queue]
        for chunk in shared.chunk_requests(sgl.np, local, q["request"], meta.decode_prefix_len, sgl.utils):
            mgr.add_transfer_request(room, chunk["kv_indices"], chunk["index_slice"], chunk["is_last_chunk"],
                                     aux_index=chunk["aux_index"], state_indices=chunk["state_indices"],
                                     num_kv_tokens=chunk["num_kv_tokens"])
        queue.put(None)
        self.statuses.clear()
        ended = []

        def worker():
            try:
                mgr.transfer_worker(queue, None, 0)
            except AttributeError as error:  # the sentinel: 'NoneType' object has no attribute 'room'
                ended.append(error)

        with shared.Errors():
            thread = threading.Thread(target=worker, daemon=True)
            thread.start()
            others = [engine for engine in self.child.engines.values() if engine is not self.node_engine]
            while thread.is_alive():
                for engine in others:
                    engine.advance()  # their UCX workers progress; their events wait for kvrelay's polls
                thread.join(0.0005)
        if dummy:
            return None  # a dummy peer: NIXL's worker skips it and reports nothing for it (nixl/conn.py:1683-1684)
        status = mgr.request_status.get(room)
        if status == sgl.base.KVPoll.Success:
            return None
        if status == sgl.base.KVPoll.Failed:
            return mgr.failure_records.get(room, "failed")
        return f"SGLang's NIXL transfer worker left room {room} {status!r} after its last chunk"


class Child(shared.SeatOps, nixl_engine.Child):
    def __init__(self, limits, directory, sgl):
        super().__init__(limits, directory)
        self.sgl = sgl
        self.seats = {}
        self.agent_names = {}  # an agent's metadata as `open` gave it -> the agent's name

    def op_hello(self, msg):
        hello = super().op_hello(msg)
        hello["engine"] = "sglang-nixl-connector"
        hello["facts"].update({
            "connector": f"SGLang {self.sgl.version} NixlKVManager (disaggregation/nixl/conn.py)",
            "stand-ins": ", ".join(self.sgl.stand_ins),
        })
        return hello

    def op_open(self, msg):
        answer = super().op_open(msg)
        _, metadata = nixl_engine.parse_address(base64.b64decode(answer["address_b64"]))
        self.agent_names[metadata] = self.engine(msg).name
        return answer

    def op_close(self, msg):
        self.seats.pop(msg["engine"], None)
        return super().op_close(msg)

    def make_seat(self, engine):
        return Seat(self.sgl, engine, self)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="SGLang version whose wheel to load")
    parser.add_argument("--wheel", default=None, help="the wheel (default: tests/planners/sglang/wheels/sglang-VERSION-*)")
    parser.add_argument("--nixl", default=nixl_engine.DEFAULT_NIXL, help="the unzipped nixl-cu12 wheel (ci/engines.sh)")
    kvrelay_child.add_limit_arguments(parser, 1 << 20, 1 << 40, 64)
    args = parser.parse_args()
    wheel = args.wheel or next(iter(sorted(glob.glob(os.path.join(
        HERE, "..", "..", "planners", "sglang", "wheels", f"sglang-{args.version}-*.whl")))), None)
    if wheel is None or not os.path.exists(wheel):
        print(f"nixl_connector: no SGLang {args.version} wheel; fetch it: bash ci/sglang.sh", file=sys.stderr)
        sys.exit(2)
    nixl_engine.load(args.nixl)
    sgl = sglang_modules.load(wheel, nixl=True)
    import numpy  # noqa: PLC0415

    sgl.np = numpy
    wire.install(sgl.mori)
    sgl.dummy_rule = shared.DummyRule(sgl.common)
    logging.getLogger("sglang").setLevel(logging.WARNING)
    limits = kvrelay_child.limits_of(args)
    serve(Child(limits, args.nixl, sgl), errors=(KeyError, TypeError, ValueError, OSError, RuntimeError))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
