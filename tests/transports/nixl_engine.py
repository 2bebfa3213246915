"""NIXL 1.5.1 (its Python API) behind the transport protocol kvrelay-transport-1 (src/fabric/child/README.md):

    . target/engines/env.sh
    kvrelay certify --fabric "child:$KVRELAY_MOONCAKE_PYTHON tests/transports/nixl_engine.py"

The Python twin of kvrelay's own `--fabric nixl` (src/fabric/nixl.rs), for children that need NIXL's Python objects
in their process (tests/connectors/sglang/'s NIXL connector). Needs numpy and the pinned nixl-cu12 wheel unzipped
at target/engines/nixl by ci/engines.sh (put on sys.path here; `--nixl DIR` names another copy), and UCX's
environment from target/engines/env.sh (set here where unset: UCX_MODULES=^ib, UCX_NET_DEVICES=lo, UCX_TLS=cma,tcp).

How the seam maps onto NIXL, as in src/fabric/nixl.rs:
- one `nixl_agent` per kvrelay engine (node), named `kvrelay-<pid>-<n>-node<k>`, UCX backend, no listener thread
  (metadata travels over kvrelay's own bootstrap) and no progress thread (polling makes the progress);
- `register` maps kvrelay's file and registers the mapping as DRAM;
- `open` answers `kvrelay-nixl/1\\0`, the end's number (u32le) and the agent's metadata (fetched then, so it holds
  every registration made before), as `address_b64`; `connect` loads the peer's metadata (`add_remote_agent`);
- a batch is one NIXL WRITE request, one descriptor per entry on each side, created (NIXL checks every descriptor
  against the registrations it knows and refuses the whole request, writing nothing: refused with `engine`),
  posted, and polled with `check_xfer_state`; its notification is NIXL's own (`kvrelay:<target end>:<tag>`), which
  the target sees with `get_new_notifs` after the data; a batch without entries sends only the notification;
- cancel cannot stop a posted request: a batch in flight answers `draining` and completes `aborted` with every byte
  landed.
"""

import argparse
import base64
import os
import struct
import sys
import time

for name, value in [("UCX_MODULES", "^ib"), ("UCX_NET_DEVICES", "lo"), ("UCX_TLS", "cma,tcp")]:
    os.environ.setdefault(name, value)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_NIXL = os.path.join(HERE, "..", "..", "target", "engines", "nixl")
ADDRESS_MAGIC = b"kvrelay-nixl/1\0"
NOTIFY_PREFIX = "kvrelay:"

import kvrelay_child  # noqa: E402
from kvrelay_child import PROTOCOL, VERSION, Children, Refusal, Region, serve  # noqa: E402

nixl_api = None  # nixl_cu12._api, imported by load()


def keep_stdout_for_the_protocol():
    """NIXL's Python logger writes to the sys.stdout of its import (nixl_cu12/logging.py:53), and C code may print
    too: file descriptor 1 becomes stderr for all of them, and the protocol gets a copy of the real stdout, which
    becomes sys.stdout once NIXL is imported (returned)."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return protocol


def load(directory):
    """Imports NIXL's Python API from the unzipped wheel."""
    global nixl_api
    if nixl_api is None:
        protocol = keep_stdout_for_the_protocol()
        sys.path.insert(0, os.path.abspath(directory))
        try:
            import nixl_cu12._api as api  # noqa: PLC0415
        except ImportError as error:
            raise SystemExit(f"nixl_engine: NIXL's Python API is not in {directory} ({error}); fetch it: "
                             f"bash ci/engines.sh") from error
        nixl_api = api
        sys.stdout = protocol
    return nixl_api


def wheel_version(directory):
    names = sorted(name for name in os.listdir(directory) if name.startswith("nixl_cu") and name.endswith(".dist-info"))
    return names[-1][: -len(".dist-info")].split("-", 1)[1] if names else "unknown"


def parse_address(data):
    """The end number and the metadata of a peer's `open` answer, or a refusal."""
    if not data.startswith(ADDRESS_MAGIC) or len(data) < len(ADDRESS_MAGIC) + 4:
        raise Refusal("bad_address", "not a kvrelay NIXL address (both sides must run a NIXL child)")
    (end,) = struct.unpack_from("<I", data, len(ADDRESS_MAGIC))
    return end, data[len(ADDRESS_MAGIC) + 4:]


class Engine:
    """One node: a NIXL agent, its registrations, ends and requests in flight."""

    def __init__(self, ident, node, count):
        self.id, self.node = ident, node
        self.name = f"kvrelay-{os.getpid()}-{count}-node{node}"
        config = nixl_api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self.agent = nixl_api.nixl_agent(self.name, config)
        self.regions = {}  # memory -> (Region, NIXL's registration descriptors)
        self.conns = []  # None, or (peer agent name, peer end, remote list)
        self.next_batch = 0
        self.posted = []  # [batch, conn, handle or None, cancelled]
        self.events = []

    def advance(self):
        still = []
        for batch, conn, handle, cancelled in self.posted:
            state = "DONE" if handle is None else self.state(handle)
            if state == "PROC":
                still.append([batch, conn, handle, cancelled])
                continue
            event = {"event": "completed", "conn": conn, "batch": batch, "status": "success", "landed": "all",
                     "detail": ""}
            if state != "DONE":
                event.update(status="unreachable", landed="unknown", detail=f"check_xfer_state: {state}")
            elif cancelled:
                event.update(status="aborted", detail="cancelled; NIXL had finished it (every byte landed)")
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.events.append(event)
        self.posted = still
        notes = self.agent.get_new_notifs()
        for initiator in sorted(notes):
            for message in notes[initiator]:
                text = message.decode(errors="replace") if isinstance(message, bytes) else str(message)
                if not text.startswith(NOTIFY_PREFIX):
                    continue  # not kvrelay's
                conn, _, tag = text[len(NOTIFY_PREFIX):].partition(":")
                if conn.isdigit() and tag.isdigit() and int(conn) < len(self.conns):
                    self.events.append({"event": "notified", "conn": int(conn), "tag": int(tag)})

    def state(self, handle):
        """`check_xfer_state`, with NIXL's exceptions (a peer that went away: NIXL_ERR_REMOTE_DISCONNECT) as the
        error state they are."""
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as error:  # nixl_cu12._bindings.nixl*Error: the request ended in error
            return f"ERR ({type(error).__name__}: {error})"

    def close(self):
        for handle in [posted[2] for posted in self.posted if posted[2] is not None]:
            deadline = time.monotonic() + 5
            while self.state(handle) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
        for region, descs in self.regions.values():
            self.agent.deregister_memory(descs)
            region.close()
        self.regions.clear()
        for conn in self.conns:
            if conn is not None:
                try:
                    self.agent.remove_remote_agent(conn[0])
                except Exception:  # noqa: BLE001 - a peer already gone
                    pass


class Child(Children):
    def __init__(self, limits, directory):
        super().__init__()
        self.limits, self.directory = limits, directory
        self.count = 0

    def op_hello(self, msg):
        self.check_hello(msg)
        facts = {
            "backend": "UCX",
            "memory": "DRAM",
            "metadata": "kvrelay's bootstrap (no listener thread)",
            "progress": "polling (no progress thread)",
            "python": sys.version.split()[0],
            "notification": "NIXL's own notif_msg, after the data",
        }
        for name in ("UCX_MODULES", "UCX_NET_DEVICES", "UCX_TLS"):
            facts[name] = os.environ.get(name, "")
        return {"protocol": PROTOCOL, "version": VERSION, "engine": "nixl",
                "engine_version": wheel_version(self.directory), "facts": facts, "limits": self.limits}

    def op_engine(self, msg):
        ident = self.next_engine
        self.count += 1
        self.engines[ident] = Engine(ident, msg["node"], self.count)
        self.next_engine += 1
        return {"engine": ident}

    def op_close(self, msg):
        engine = self.engines.pop(msg["engine"], None)
        if engine is not None:
            engine.close()
        return {}

    def op_register(self, msg):
        engine = self.engine(msg)
        if msg["kind"] != "host":
            raise Refusal("engine", f"host memory only, not {msg['kind']}")
        region = Region(msg["path"], msg["len"])
        try:
            descs = engine.agent.register_memory([(region.addr, max(region.len, 1), 0, "")], "DRAM")
        except Exception as error:  # noqa: BLE001
            region.close()
            raise Refusal("engine", f"register_memory: {error}") from error
        if descs is None:
            region.close()
            raise Refusal("engine", "register_memory refused the mapping")
        engine.regions[msg["memory"]] = (region, descs)
        return {"addr": region.addr, "key": 0}

    def op_release(self, msg):
        engine = self.engine(msg)
        entry = engine.regions.pop(msg["memory"], None)
        if entry is None:
            raise Refusal("unknown_memory", f"memory {msg['memory']} is not registered")
        region, descs = entry
        engine.agent.deregister_memory(descs)
        region.close()
        return {}

    def op_open(self, msg):
        engine = self.engine(msg)
        engine.conns.append(None)
        conn = len(engine.conns) - 1
        address = ADDRESS_MAGIC + struct.pack("<I", conn) + engine.agent.get_agent_metadata()
        return {"conn": conn, "address_b64": base64.b64encode(address).decode()}

    def op_connect(self, msg):
        engine = self.engine(msg)
        conn = self.conn(engine, msg)
        if engine.conns[conn] is not None:
            raise Refusal("already_connected", f"connection {conn} is already connected")
        if "address_b64" not in msg:
            raise Refusal("bad_address", "a NIXL address is binary (address_b64)")
        end, metadata = parse_address(base64.b64decode(msg["address_b64"]))
        try:
            name = engine.agent.add_remote_agent(metadata)
        except Exception as error:  # noqa: BLE001
            raise Refusal("bad_address", f"NIXL's add_remote_agent refused the metadata: {error}") from error
        name = name.decode() if isinstance(name, bytes) else name
        engine.conns[conn] = (name, end, msg["remote"])
        return {}

    def op_submit(self, msg):
        engine = self.engine(msg)
        conn = self.conn(engine, msg)
        if engine.conns[conn] is None:
            raise Refusal("not_connected", f"connection {conn} is not connected")
        peer, peer_end, remote = engine.conns[conn]
        entries = msg["entries"]
        total = sum(entry[4] for entry in entries)
        if len(entries) > self.limits["max_entries"] or total > self.limits["max_batch_bytes"]:
            raise Refusal("over_limits", f"{len(entries)} entries, {total} bytes")
        if sum(1 for posted in engine.posted if posted[1] == conn) >= self.limits["batches_in_flight"]:
            raise Refusal("over_limits", f"{self.limits['batches_in_flight']} batches already in flight on "
                                         f"connection {conn}")
        local_rows, remote_rows = [], []
        for local, local_offset, index, remote_offset, length in entries:
            entry = engine.regions.get(local)
            if entry is None:
                raise Refusal("unknown_memory", f"memory {local} is not registered", memory=local)
            region = entry[0]
            if local_offset + length > region.len:
                raise Refusal("out_of_range", "the local range is outside its memory",
                              offset=local_offset, len=length, region_len=region.len)
            if index >= len(remote) or remote_offset + length > remote[index]["len"]:
                region_len = remote[index]["len"] if index < len(remote) else 0
                raise Refusal("out_of_range", "the remote range is outside the memory the peer advertised",
                              offset=remote_offset, len=length, region_len=region_len)
            local_rows.append((region.addr + local_offset, length, 0))
            remote_rows.append((remote[index]["addr"] + remote_offset, length, 0))
        notify = msg.get("notify")
        text = f"{NOTIFY_PREFIX}{peer_end}:{notify}".encode() if notify is not None else b""
        handle = None
        if entries:
            import numpy  # noqa: PLC0415

            local_descs = engine.agent.get_xfer_descs(numpy.array(local_rows, dtype=numpy.uint64), "DRAM")
            remote_descs = engine.agent.get_xfer_descs(numpy.array(remote_rows, dtype=numpy.uint64), "DRAM")
            try:
                handle = engine.agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, text)
            except Exception as error:  # noqa: BLE001
                raise Refusal("engine", f"initialize_xfer: {error}: NIXL refused the request, writing nothing (a "
                                        f"descriptor outside the memory {peer} registered, or stale metadata)") from error
            try:
                state = engine.agent.transfer(handle)
            except Exception as error:  # noqa: BLE001 (nixl*Error: e.g. NIXL_ERR_REMOTE_DISCONNECT, a peer gone)
                state = f"ERR ({type(error).__name__}: {error})"
            if state != "DONE" and state != "PROC":
                engine.agent.release_xfer_handle(handle)
                raise Refusal("engine", f"NIXL's transfer refused to post the request: {state}")
        elif notify is not None:
            try:
                engine.agent.send_notif(peer, text)
            except Exception as error:  # noqa: BLE001
                raise Refusal("engine", f"NIXL's send_notif: {type(error).__name__}: {error}") from error
        batch = engine.next_batch
        engine.next_batch += 1
        engine.posted.append([batch, conn, handle, False])
        return {"batch": batch}

    def op_cancel(self, msg):
        engine = self.engine(msg)
        for posted in engine.posted:
            if posted[0] == msg["batch"]:
                posted[3] = True
                return {"cancelled": "draining"}
        return {"cancelled": "ended"}

    def op_poll(self, msg):
        engine = self.engine(msg)
        if len(engine.events) < msg["max"]:
            engine.advance()
        count = min(msg["max"], len(engine.events))
        events, engine.events = engine.events[:count], engine.events[count:]
        return {"events": events}

    def op_settle(self, msg):
        deadline = time.monotonic() + msg["timeout_ms"] / 1000
        while True:
            for engine in self.engines.values():
                engine.advance()
            if not any(engine.posted for engine in self.engines.values()) or time.monotonic() >= deadline:
                break
            time.sleep(0.0005)
        return {"idle": not any(engine.posted for engine in self.engines.values())}



def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nixl", default=DEFAULT_NIXL, help="the unzipped nixl-cu12 wheel (ci/engines.sh)")
    kvrelay_child.add_limit_arguments(parser, 1 << 20, 1 << 40, 64)
    args = parser.parse_args()
    load(args.nixl)
    limits = kvrelay_child.limits_of(args)
    serve(Child(limits, args.nixl), errors=(KeyError, TypeError, ValueError, OSError, RuntimeError))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
