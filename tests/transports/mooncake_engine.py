"""Mooncake's Transfer Engine behind the transport protocol kvrelay-transport-1 (src/fabric/child/README.md):
`kvrelay certify --fabric mooncake` runs this file as its child.

Needs the pinned wheel (`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy`; its engine.so needs
Debian's libibverbs1, libnl-3-200 and libnl-route-3-200) and runs with the interpreter kvrelay is told of
(`KVRELAY_MOONCAKE_PYTHON`, else `KVRELAY_PYTHON`, else python3).

How the seam maps onto the engine (0.3.13.post1, TCP transport, P2P handshake, no etcd):
- one `TransferEngine` per kvrelay engine (node), `initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`: always
  loopback, since its RPC and data ports listen on every interface;
- the peer address is the session id `127.0.0.1:<rpc port>`, which works across processes (`kvrelay launch`);
- `register` maps kvrelay's file and `register_memory(addr, len)` on the mapping;
- `submit` checks what Mooncake does not (connection, limits, the local memory and range: Mooncake would send
  from any address) and calls `batch_transfer_async_write`; the remote ranges go to Mooncake unchecked, so the
  target's own check is what certification sees;
- `get_batch_transfer_status` blocks until the batch ends (and frees its id: never ask twice), so one waiter
  thread per engine waits for each batch in submit order, the GIL released; `poll` never blocks;
- a failed batch is reported with `landed: "unknown"`: Mooncake writes the good entries of a failed batch;
- a notification is sent after the batch ended successfully, as a zero-length `transfer_sync` write carrying
  `TransferNotify(<own session>, "kvrelay:<tag>")`; the target's `get_notifies()` gives it to the end connected
  to that session (the wheel has no notification on the async calls);
- cancel cannot stop a Mooncake batch: a batch in flight answers `draining`;
- destroying a TransferEngine takes about a second, so a closed engine's TransferEngine is deregistered, drained of
  notifications and reused by the next `engine` (keeping its session id).

Flags: `--max-entries N`, `--max-batch-bytes N`, `--batches-in-flight N` (the limits declared in `hello`).
Environment: MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER default to 65535
here (with Mooncake's defaults a batch of more than about 2-4 K entries is refused as "TCP lane queue-full"), and
GLOG_minloglevel to 1 (Mooncake logs every batch at INFO).
"""

import argparse
import ctypes
import json
import mmap
import os
import queue
import sys
import threading
import time

for name, value in [("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535"),
                    ("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "65535"), ("GLOG_minloglevel", "1")]:
    os.environ.setdefault(name, value)

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode  # noqa: E402
import kvrelay_child  # noqa: E402
from kvrelay_child import PROTOCOL, VERSION, Children, Refusal, Region, serve  # noqa: E402

HOST = "127.0.0.1"
NOTIFY_PREFIX = "kvrelay:"


def wheel_version():
    try:
        from importlib.metadata import version
        return version("mooncake-transfer-engine-non-cuda")
    except Exception:  # another build of the engine
        try:
            from importlib.metadata import version
            return version("mooncake-transfer-engine")
        except Exception:
            return "unknown"


class Engine:
    """One node: a Mooncake TransferEngine, its registrations, ends and batches, and its waiter thread."""

    def __init__(self, ident, node, limits, pool):
        self.id, self.node, self.limits = ident, node, limits
        if pool:
            self.te, self.session = pool.pop()
            self.te.get_notifies()  # nothing of its last use reaches this one
        else:
            self.te = TransferEngine()
            code = self.te.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
            if code != 0:
                raise Refusal("engine", f"TransferEngine.initialize returned {code}")
            self.session = f"{HOST}:{self.te.get_rpc_port()}"
        self.regions = {}
        self.conns = []  # None, or (peer session, remote list)
        self.next_batch = 0
        self.in_flight = {}  # batch -> conn, while Mooncake has it
        self.events = []  # completions ready for poll (under lock)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.waiting = queue.Queue()
        self.thread = threading.Thread(target=self.wait_batches, daemon=True)
        self.thread.start()

    def wait_batches(self):
        while True:
            item = self.waiting.get()
            if item is None:
                return
            batch, conn, mc_id, peer, notify, first = item
            status = 0 if mc_id is None else self.te.get_batch_transfer_status([mc_id])
            event = {"event": "completed", "conn": conn, "batch": batch, "status": "success", "landed": "all",
                     "detail": ""}
            if status != 0:
                event.update(status="remote_access", landed="unknown",
                             detail=f"get_batch_transfer_status returned {status} (Mooncake writes the good "
                                    f"entries of a failed batch)")
            elif notify is not None:
                if first is None:
                    event.update(status="aborted", landed="all", detail="no address to carry the notification")
                else:
                    note = TransferNotify(self.session, f"{NOTIFY_PREFIX}{notify}")
                    code = self.te.transfer_sync(peer, first[0], first[1], 0, TransferOpcode.Write, note)
                    if code != 0:
                        event.update(status="unreachable", landed="all",
                                     detail=f"the notification's transfer_sync returned {code}")
            with self.lock:
                self.in_flight.pop(batch, None)
                self.events.append(event)
                self.idle.notify_all()

    def close(self, pool):
        """Waits for its batches, deregisters everything and leaves the TransferEngine to `pool`."""
        self.waiting.put(None)
        self.thread.join(timeout=30)
        for region in self.regions.values():
            self.te.unregister_memory(region.addr)
            region.map.close()
        self.regions.clear()
        if not self.thread.is_alive():
            self.te.get_notifies()
            pool.append((self.te, self.session))


class Child(Children):
    def __init__(self, limits):
        super().__init__()
        self.limits = limits
        # Destroying a TransferEngine takes a second (0.3.13.post1), so closed ones are reused, deregistered and
        # drained, under their session id (a new case's peers learn it anew from `open`).
        self.pool = []

    def op_hello(self, msg):
        self.check_hello(msg)
        facts = {
            "transport": "tcp",
            "metadata": "P2PHANDSHAKE (no etcd)",
            "host": HOST,
            "python": sys.version.split()[0],
            "notification": "zero-length transfer_sync with TransferNotify after the batch ended",
            "failed-batch-landed": "unknown (Mooncake writes the good entries of a failed batch)",
        }
        for name in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
            facts[name] = os.environ.get(name, "")
        return {"protocol": PROTOCOL, "version": VERSION, "engine": "mooncake-transfer-engine",
                "engine_version": wheel_version(), "facts": facts, "limits": self.limits}

    def op_engine(self, msg):
        ident = self.next_engine
        self.engines[ident] = Engine(ident, msg["node"], self.limits, self.pool)
        self.next_engine += 1
        return {"engine": ident}

    def op_close(self, msg):
        engine = self.engines.pop(msg["engine"], None)
        if engine is not None:
            engine.close(self.pool)
        return {}

    def op_register(self, msg):
        engine = self.engine(msg)
        if msg["kind"] != "host":
            raise Refusal("engine", f"host memory only, not {msg['kind']}")
        region = Region(msg["path"], msg["len"])
        code = engine.te.register_memory(region.addr, max(region.len, 1))
        if code != 0:
            region.map.close()
            raise Refusal("engine", f"register_memory returned {code}")
        engine.regions[msg["memory"]] = region
        return {"addr": region.addr, "key": 0}

    def op_release(self, msg):
        engine = self.engine(msg)
        region = engine.regions.pop(msg["memory"], None)
        if region is None:
            raise Refusal("unknown_memory", f"memory {msg['memory']} is not registered")
        code = engine.te.unregister_memory(region.addr)
        region.map.close()
        if code != 0:
            raise Refusal("engine", f"unregister_memory returned {code}")
        return {}

    def op_open(self, msg):
        engine = self.engine(msg)
        engine.conns.append(None)
        return {"conn": len(engine.conns) - 1, "address": engine.session}

    def op_connect(self, msg):
        engine = self.engine(msg)
        conn = self.conn(engine, msg)
        if engine.conns[conn] is not None:
            raise Refusal("already_connected", f"connection {conn} is already connected")
        address = msg.get("address", "")
        host, _, port = address.partition(":")
        if host != HOST or not port.isdigit():
            raise Refusal("bad_address", f"expected a Mooncake session id `{HOST}:<rpc port>`")
        engine.conns[conn] = (address, msg["remote"])
        return {}

    def op_submit(self, msg):
        engine = self.engine(msg)
        conn = self.conn(engine, msg)
        if engine.conns[conn] is None:
            raise Refusal("not_connected", f"connection {conn} is not connected")
        peer, remote = engine.conns[conn]
        entries = msg["entries"]
        total = sum(entry[4] for entry in entries)
        if len(entries) > self.limits["max_entries"] or total > self.limits["max_batch_bytes"]:
            raise Refusal("over_limits", f"{len(entries)} entries, {total} bytes")
        with engine.lock:
            busy = sum(1 for c in engine.in_flight.values() if c == conn)
        if busy >= self.limits["batches_in_flight"]:
            raise Refusal("over_limits", f"{busy} batches already in flight on connection {conn}")
        sources, targets, lengths = [], [], []
        for local, local_offset, index, remote_offset, length in entries:
            region = engine.regions.get(local)
            if region is None:
                raise Refusal("unknown_memory", f"memory {local} is not registered", memory=local)
            if local_offset + length > region.len:
                raise Refusal("out_of_range", "the local range is outside its memory",
                              offset=local_offset, len=length, region_len=region.len)
            if index >= len(remote):
                raise Refusal("out_of_range", f"the peer advertised no memory {index}",
                              offset=remote_offset, len=length, region_len=0)
            sources.append(region.addr + local_offset)
            targets.append(remote[index]["addr"] + remote_offset)
            lengths.append(length)
        mc_id = None
        if entries:
            mc_id = engine.te.batch_transfer_async_write(peer, sources, targets, lengths)
            if not mc_id or mc_id < 0:
                raise Refusal("engine", f"batch_transfer_async_write returned {mc_id} (the peer {peer} is unknown "
                                        f"or refused the session)")
        first = (sources[0], targets[0]) if entries else None
        if first is None and engine.regions and remote:
            first = (next(iter(engine.regions.values())).addr, remote[0]["addr"])
        batch = engine.next_batch
        engine.next_batch += 1
        with engine.lock:
            engine.in_flight[batch] = conn
        engine.waiting.put((batch, conn, mc_id, peer, msg.get("notify"), first))
        return {"batch": batch}

    def op_cancel(self, msg):
        engine = self.engine(msg)
        with engine.lock:
            return {"cancelled": "draining" if msg["batch"] in engine.in_flight else "ended"}

    def op_poll(self, msg):
        engine = self.engine(msg)
        with engine.lock:
            count = min(msg["max"], len(engine.events))
            events, engine.events = engine.events[:count], engine.events[count:]
        room = msg["max"] - len(events)
        if room > 0:
            for note in engine.te.get_notifies():
                if not note.msg.startswith(NOTIFY_PREFIX):
                    continue
                tag = int(note.msg[len(NOTIFY_PREFIX):])
                conn = next((c for c, end in enumerate(engine.conns) if end is not None and end[0] == note.name), None)
                if conn is not None:
                    events.append({"event": "notified", "conn": conn, "tag": tag})
        return {"events": events}

    def op_settle(self, msg):
        deadline = time.monotonic() + msg["timeout_ms"] / 1000
        for engine in list(self.engines.values()):
            with engine.lock:
                while engine.in_flight and time.monotonic() < deadline:
                    engine.idle.wait(timeout=max(0.0, deadline - time.monotonic()))
        return {"idle": all(not engine.in_flight for engine in self.engines.values())}



def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    kvrelay_child.add_limit_arguments(parser, 1024, 1 << 30, 8)
    args = parser.parse_args()
    limits = kvrelay_child.limits_of(args)
    serve(Child(limits), errors=(KeyError, TypeError, ValueError, OSError, RuntimeError))
    # Mooncake's threads may outlive the interpreter's teardown; leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
