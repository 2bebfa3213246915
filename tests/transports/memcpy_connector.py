"""The reference connector of kvrelay's connector seat (src/fabric/child/README.md, "Connector seat"): the memcpy
child (memcpy_engine.py) that also sits in every prefill rank's seat and moves each room's bytes itself.

    kvrelay check scenarios --connector 'python3 tests/transports/memcpy_connector.py --kvrelay target/release/kvrelay'

Its planning is a plan-protocol planner it runs as a subprocess: kvrelay's own reference planner (`PATH planner`,
with `--kvrelay PATH`, default `kvrelay`), or `sh -c $KVRELAY_SEAT_PLANNER` when that is set; so that what this file adds is exactly what a connector adds to a planner:
`seat_link` is the planner's link answer; `seat_send` asks the planner for every chunk's copies, turns each copy into
addresses the way a connector does (the source region is the node's engine's registration of that index, the target
region the peer's advertised descriptor of that index, as the registration lists them), and copies the bytes into
the decode rank's mapping in this process before answering.

`--plant-lost-copy` plants a silent bug: every room's last copy is not made and the send still answers success. Only
the oracle can see it. `--plant-malformed-verdict` answers a verdict that is not a text (kvrelay names the field).
"""

import ctypes
import json
import os
import subprocess
import sys

from kvrelay_child import Refusal
from memcpy_engine import Child as MemcpyChild, run


class Planner:
    """A plan-protocol planner process: one query line in, one answer line out."""

    def __init__(self, command):
        self.process = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, start_new_session=True)
        hello = self.ask({"type": "hello", "protocol": "kvrelay-plan", "version": 1})
        if hello.get("type") != "hello":
            raise Refusal("engine", f"the planner `{command}` answered {hello} to hello")

    def ask(self, query):
        self.process.stdin.write(json.dumps(query) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise Refusal("engine", "the planner exited")
        return json.loads(line)


class Child(MemcpyChild):
    def __init__(self, planner, plant, malformed):
        super().__init__(False)
        self.planner = Planner(planner)
        self.plant_lost_copy, self.malformed = plant, malformed

    def op_hello(self, msg):
        hello = super().op_hello(msg)
        hello["engine"] = "memcpy-connector"
        hello["facts"] = {"seat": "copies planned by a plan-protocol planner, made with ctypes.memmove",
                          "planted-lost-copy": str(self.plant_lost_copy).lower()}
        return hello

    def node_engine(self, node):
        engine = next((e for e in self.engines.values() if e.node == node), None)
        if engine is None:
            raise Refusal("engine", f"no engine for node {node} in this child")
        return engine

    def op_seat_link(self, msg):
        self.node_engine(msg["node"])
        answer = self.planner.ask(msg["query"])
        return {"rejected": answer["error"]} if "error" in answer else {}

    def op_seat_send(self, msg):
        engine = self.node_engine(msg["node"])
        if self.malformed:
            return {"rejected": 7}
        query = msg["query"]
        answer = self.planner.ask(query)
        if "error" in answer:
            return {"rejected": answer["error"]}
        sources = [region.addr for region in engine.regions.values()]
        registration = query["registration"]
        descs = registration["kv_descs"] + [d for component in registration["state_descs"] for d in component]
        # The peer's regions as the plan protocol numbers them: KV, state, aux, then the staging ring (frame 20).
        descs += registration["aux_descs"] + registration.get("staging_descs", [])
        targets = [desc["address"] for desc in descs]
        copies = answer["copies"]  # [chunk, source_region, source_offset, target_region, target_offset, length]
        if self.plant_lost_copy and copies:
            copies = copies[:-1]
        for _chunk, source, source_offset, target, target_offset, length in copies:
            src, dst = sources[source] + source_offset, targets[target] + target_offset
            owner = next((e for e in self.engines.values() if e.find(dst, length)), None)
            if engine.find(src, length) is None or owner is None:
                return {"rejected": f"copy of {length} bytes from {src:#x} to {dst:#x} leaves registered memory"}
            ctypes.memmove(dst, src, length)
        return {}


def main():
    args = sys.argv[1:]
    program = args[args.index("--kvrelay") + 1] if "--kvrelay" in args else "kvrelay"
    planner = os.environ.get("KVRELAY_SEAT_PLANNER") or f"{program} planner"
    run(Child(planner, "--plant-lost-copy" in args, "--plant-malformed-verdict" in args))


if __name__ == "__main__":
    main()
