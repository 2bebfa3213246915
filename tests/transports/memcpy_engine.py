"""The reference child of the transport protocol kvrelay-transport-1 (src/fabric/child/README.md): plain memory
copies between the files kvrelay maps, no external engine, standard library only.

kvrelay runs it as `--fabric child:python3 tests/transports/memcpy_engine.py` and talks JSON lines on its stdin and
stdout, one request, one response. It is the template a vendor copies for a Python-first engine: keep `main`, the
op table and the checks in `submit`, and replace the copies in `Engine.progress` (and `settle`) with the engine's
calls. A peer address names the process and the engine (`memcpy/1 pid=<pid> engine=<n>`). An engine of this
process is written directly; one of another child (ranks as processes, `kvrelay launch`) through the files it
shares: each engine lists its registrations (address, length, file) in `kvrelay-memcpy-<pid>-<n>.json` beside
kvrelay's files (`$KVRELAY_SHM_DIR`, else /dev/shm), a writer maps the peer's file named there, and notifications
for it are lines appended to `kvrelay-memcpy-<pid>-<n>.notify`.

`--plant-dropped-tail` plants a silent bug: a batch of more than 32 entries skips its last one and still completes
`success` with every entry landed. Only the oracle can see it.
"""

import ctypes
import json
import mmap
import os
import sys

from kvrelay_child import PROTOCOL, VERSION, Children, Refusal, Region, serve

SHARED = os.environ.get("KVRELAY_SHM_DIR") or "/dev/shm"


def shared(pid, engine, suffix):
    """The file an engine shares with other processes."""
    return os.path.join(SHARED, f"kvrelay-memcpy-{pid}-{engine}.{suffix}")


def write_atomically(path, text):
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)

LIMITS = {"max_entries": 4096, "max_batch_bytes": 1 << 30, "batches_in_flight": 8}
PLANT_FROM = 32
ADDRESS = "memcpy/1 pid={pid} engine={engine}"


class Engine:
    def __init__(self, ident, node):
        self.id, self.node = ident, node
        self.regions = {}  # kvrelay's memory id -> Region
        self.paths = {}  # kvrelay's memory id -> its file
        self.conns = []  # per conn: None (open) or (peer, [remote dicts]); peer: an engine id or (pid, engine id)
        self.notes_read = 0  # bytes of the notification file taken in
        self.queued = []  # submitted batches waiting for progress
        self.events = []  # events ready for poll
        self.next_batch = 0

    def find(self, addr, length):
        return next((r for r in self.regions.values() if r.contains(addr, length)), None)

    def share(self):
        """Lists this engine's registrations for writers in other processes."""
        listed = [[self.regions[m].addr, self.regions[m].len, self.paths[m]] for m in self.regions]
        write_atomically(shared(os.getpid(), self.id, "json"), json.dumps(listed))

    def unshare(self):
        for suffix in ("json", "notify"):
            try:
                os.remove(shared(os.getpid(), self.id, suffix))
            except FileNotFoundError:
                pass


class Remote:
    """A peer engine of another process, reached through the files it lists."""

    def __init__(self, pid, engine):
        self.pid, self.engine = pid, engine
        self.maps = {}  # path -> mmap

    def target(self, addr, length):
        """This process's address of the peer's `addr`..`addr + length`, or None."""
        try:
            with open(shared(self.pid, self.engine, "json")) as handle:
                listed = json.load(handle)
        except (OSError, ValueError):
            return None
        for start, size, path in listed:
            if start <= addr and addr + length <= start + size:
                if path not in self.maps:
                    try:
                        with open(path, "r+b") as handle:
                            self.maps[path] = mmap.mmap(handle.fileno(), max(size, 1))
                    except OSError:
                        return None
                anchor = ctypes.c_char.from_buffer(self.maps[path])
                base = ctypes.addressof(anchor)
                del anchor
                return base + (addr - start)
        return None

    def notify(self, sender, tag):
        with open(shared(self.pid, self.engine, "notify"), "a") as handle:
            handle.write(f"{os.getpid()} {sender} {tag}\n")


class Child(Children):
    def __init__(self, plant):
        super().__init__()
        self.plant = plant

    # ---- ops ----

    def op_hello(self, msg):
        self.check_hello(msg)
        facts = {"copies": "ctypes.memmove between mappings of kvrelay's files, in one process",
                 "planted-dropped-tail": str(self.plant).lower()}
        return {"protocol": PROTOCOL, "version": VERSION, "engine": "memcpy-sample", "engine_version": "1",
                "facts": facts, "limits": LIMITS}

    def op_engine(self, msg):
        ident = self.next_engine
        self.next_engine += 1
        self.engines[ident] = Engine(ident, msg["node"])
        self.engines[ident].share()
        return {"engine": ident}

    def op_close(self, msg):
        engine = self.engines.pop(msg["engine"], None)
        for region in (engine.regions.values() if engine else []):
            region.close()
        if engine is not None:
            engine.unshare()
        return {}

    def op_register(self, msg):
        engine = self.engine(msg)
        if msg["kind"] != "host":
            raise Refusal("engine", f"the sample registers host memory only, not {msg['kind']}")
        if msg["memory"] in engine.regions:
            raise Refusal("engine", f"memory {msg['memory']} is already registered")
        region = Region(msg["path"], msg["len"])
        engine.regions[msg["memory"]] = region
        engine.paths[msg["memory"]] = msg["path"]
        engine.share()
        return {"addr": region.addr, "key": 0}

    def op_release(self, msg):
        engine = self.engine(msg)
        region = engine.regions.pop(msg["memory"], None)
        if region is None:
            raise Refusal("unknown_memory", f"memory {msg['memory']} is not registered")
        region.close()
        engine.paths.pop(msg["memory"], None)
        engine.share()
        return {}

    def op_open(self, msg):
        engine = self.engine(msg)
        engine.conns.append(None)
        return {"conn": len(engine.conns) - 1, "address": ADDRESS.format(pid=os.getpid(), engine=engine.id)}

    def op_connect(self, msg):
        engine = self.engine(msg)
        conn = self.conn(engine, msg)
        if engine.conns[conn] is not None:
            raise Refusal("already_connected", f"connection {conn} is already connected")
        address = msg.get("address", "")
        fields = dict(part.split("=", 1) for part in address.split(" ")[1:] if "=" in part)
        if not address.startswith("memcpy/1 ") or "pid" not in fields or "engine" not in fields:
            raise Refusal("bad_address", "expected `memcpy/1 pid=<pid> engine=<n>`")
        if not fields["pid"].isdigit() or not fields["engine"].isdigit():
            raise Refusal("bad_address", "expected `memcpy/1 pid=<pid> engine=<n>`")
        pid, peer = int(fields["pid"]), int(fields["engine"])
        if pid == os.getpid():
            if peer not in self.engines:
                raise Refusal("bad_address", f"no engine {peer} in this process")
        elif not os.path.exists(shared(pid, peer, "json")):
            raise Refusal("bad_address", f"engine {peer} of process {pid} shares no {shared(pid, peer, 'json')}")
        else:
            peer = Remote(pid, peer)
        engine.conns[conn] = (peer, msg["remote"])
        return {}

    def op_submit(self, msg):
        engine = self.engine(msg)
        conn = self.conn(engine, msg)
        if engine.conns[conn] is None:
            raise Refusal("not_connected", f"connection {conn} is not connected")
        peer, remote = engine.conns[conn]
        entries = msg["entries"]
        total = sum(entry[4] for entry in entries)
        if len(entries) > LIMITS["max_entries"] or total > LIMITS["max_batch_bytes"]:
            raise Refusal("over_limits", f"{len(entries)} entries, {total} bytes")
        if sum(1 for batch in engine.queued if batch["conn"] == conn) >= LIMITS["batches_in_flight"]:
            raise Refusal("over_limits", f"{LIMITS['batches_in_flight']} batches already in flight")
        copies = []
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
            target = remote[index]
            if remote_offset + length > target["len"]:
                raise Refusal("out_of_range", "the remote range is outside the peer's advertised memory",
                              offset=remote_offset, len=length, region_len=target["len"])
            copies.append((region.addr + local_offset, target["addr"] + remote_offset, length))
        batch = {"id": engine.next_batch, "conn": conn, "peer": peer, "copies": copies, "notify": msg.get("notify")}
        engine.next_batch += 1
        engine.queued.append(batch)
        return {"batch": batch["id"]}

    def op_cancel(self, msg):
        engine = self.engine(msg)
        before = len(engine.queued)
        engine.queued = [batch for batch in engine.queued if batch["id"] != msg["batch"]]
        return {"cancelled": "whole" if len(engine.queued) < before else "ended"}

    def op_poll(self, msg):
        engine = self.engine(msg)
        self.progress(engine)
        self.take_notes(engine)
        count = min(msg["max"], len(engine.events))
        events, engine.events = engine.events[:count], engine.events[count:]
        return {"events": events}

    def op_settle(self, msg):
        for engine in list(self.engines.values()):
            self.progress(engine)
        return {"idle": True}

    def op_reset(self, msg):
        for ident in list(self.engines):
            self.op_close({"engine": ident})
        self.next_engine = 0
        return {}

    def take_notes(self, engine):
        """Notifications other processes appended for this engine, on the end connected to their sender."""
        try:
            with open(shared(os.getpid(), engine.id, "notify")) as handle:
                handle.seek(engine.notes_read)
                text = handle.read()
        except FileNotFoundError:
            return
        complete = text[: text.rfind("\n") + 1]
        engine.notes_read += len(complete.encode())
        for line in complete.splitlines():
            pid, sender, tag = (int(part) for part in line.split())
            for conn, end in enumerate(engine.conns):
                if end is not None and isinstance(end[0], Remote) and (end[0].pid, end[0].engine) == (pid, sender):
                    engine.events.append({"event": "notified", "conn": conn, "tag": tag})
                    break

    # ---- progress: where an engine's own calls go ----

    def progress(self, engine):
        """Runs every queued batch: its bytes, then its notification, then its completion."""
        queued, engine.queued = engine.queued, []
        for batch in queued:
            copies = batch["copies"]
            if self.plant and len(copies) > PLANT_FROM:
                copies = copies[:-1]
            remote = isinstance(batch["peer"], Remote)
            peer = batch["peer"] if remote else self.engines.get(batch["peer"])
            landed = 0
            for source, target, length in copies:
                if remote and peer is not None:
                    target = peer.target(target, length)
                elif peer is not None and peer.find(target, length) is None:
                    target = None
                if peer is None or target is None or engine.find(source, length) is None:
                    break  # released since the submit
                ctypes.memmove(target, source, length)
                landed += 1
            event = {"event": "completed", "conn": batch["conn"], "batch": batch["id"], "status": "success",
                     "landed": "all", "detail": ""}
            if landed < len(copies):
                event.update(status="remote_access", landed=[[0, landed]] if landed else [],
                             detail=f"entry {landed}: memory released before the copy")
            elif batch["notify"] is not None and remote:
                peer.notify(engine.id, batch["notify"])
            elif batch["notify"] is not None:
                for conn, end in enumerate(peer.conns):
                    if end is not None and end[0] == engine.id:
                        peer.events.append({"event": "notified", "conn": conn, "tag": batch["notify"]})
                        break
            engine.events.append(event)


def sweep():
    """Removes the shared files of children that are gone (killed, so they could not remove their own)."""
    for name in os.listdir(SHARED):
        parts = name.split("-")
        if not name.startswith("kvrelay-memcpy-") or len(parts) < 4 or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            try:
                os.remove(os.path.join(SHARED, name))
            except OSError:
                pass
        except OSError:
            pass


def run(child):
    """Serves kvrelay with `child` (this file's `Child` or a subclass), then withdraws every engine's shared list."""
    sweep()
    try:
        serve(child)
    finally:
        for engine in child.engines.values():
            engine.unshare()


def main():
    run(Child("--plant-dropped-tail" in sys.argv[1:]))


if __name__ == "__main__":
    main()
