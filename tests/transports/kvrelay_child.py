"""What every child speaking kvrelay-transport-1 (src/fabric/child/README.md) needs besides its engine: the refusal
that becomes a response's error, a registration's shared file mapped into this process, and the request loop.

memcpy_engine.py (the template) and mooncake_engine.py import it; a vendor's child may too, or copy it.
"""

import ctypes
import json
import mmap
import os
import sys


class Refusal(Exception):
    """A refused call: the response's error kind and message (and optional fields)."""

    def __init__(self, kind, message, **fields):
        super().__init__(message)
        self.kind, self.message, self.fields = kind, message, fields


class Region:
    """A registration: kvrelay's file, mapped here; `addr` is this process's address of the mapping."""

    def __init__(self, path, length):
        with open(path, "r+b") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < max(length, 1):
                raise Refusal("engine", f"{path} holds {size} bytes, fewer than the {length} registered")
            self.map = mmap.mmap(handle.fileno(), max(length, 1))
        anchor = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(anchor)
        del anchor  # no export left, so the mapping can be closed at release
        self.len = length

    def contains(self, addr, length):
        return self.addr <= addr and addr + length <= self.addr + self.len

    def close(self):
        self.map.close()


PROTOCOL = "kvrelay-transport"
VERSION = 1


class Children:
    """The bookkeeping every child shares: its engines by id, looked up with a refusal kvrelay understands, and the
    `hello` check. A child subclasses it and adds `op_<op>` methods."""

    def __init__(self):
        self.engines = {}
        self.next_engine = 0

    def engine(self, msg):
        engine = self.engines.get(msg["engine"])
        if engine is None:
            raise Refusal("engine", f"no engine {msg['engine']} in this child")
        return engine

    def conn(self, engine, msg):
        conn = msg["conn"]
        if not 0 <= conn < len(engine.conns):
            raise Refusal("unknown_connection", f"connection {conn} was never opened")
        return conn

    def op_reset(self, msg):
        """Every engine closed (`op_close` of each): a certification case starts."""
        for ident in list(self.engines):
            self.op_close({"engine": ident})
        return {}

    @staticmethod
    def check_hello(msg):
        if msg.get("protocol") != PROTOCOL or msg.get("version") != VERSION:
            raise Refusal("engine", f"this child speaks {PROTOCOL} version {VERSION}")


def serve(child, errors=(KeyError, TypeError, ValueError, OSError)):
    """Answers kvrelay's requests on stdin with `child.op_<op>(msg)` until `bye` or the end of input: one JSON line
    out per line in, echoing `op` and `seq`; a `Refusal` or one of `errors` becomes `ok: false` with its kind."""
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.get("op")
        response = {"op": op, "seq": msg.get("seq")}
        try:
            if op == "bye":
                response["ok"] = True
                print(json.dumps(response), flush=True)
                return
            handler = getattr(child, f"op_{op}", None)
            if handler is None:
                raise Refusal("engine", f"unknown op {op!r}")
            response.update(handler(msg))
            response["ok"] = True
        except Refusal as refusal:
            response.update(ok=False, error={"kind": refusal.kind, "message": refusal.message, **refusal.fields})
        except errors as error:
            response.update(ok=False, error={"kind": "engine", "message": f"{type(error).__name__}: {error}"})
        print(json.dumps(response), flush=True)


def add_limit_arguments(parser, max_entries, max_batch_bytes, batches_in_flight):
    """`--max-entries`, `--max-batch-bytes`, `--batches-in-flight`: the limits a child declares in `hello`."""
    parser.add_argument("--max-entries", type=int, default=max_entries)
    parser.add_argument("--max-batch-bytes", type=int, default=max_batch_bytes)
    parser.add_argument("--batches-in-flight", type=int, default=batches_in_flight)


def limits_of(args):
    """The `hello` limits from the arguments `add_limit_arguments` added."""
    return {"max_entries": args.max_entries, "max_batch_bytes": args.max_batch_bytes,
            "batches_in_flight": args.batches_in_flight}
