"""kvrelay's wire frames read with SGLang 0.5.23's own Mori decoders (sglang/srt/disaggregation/mori/conn.py).

kvrelay's registration and metadata frames follow Mori's layout field for field (domain.md section 6.2), except
registration frames 4-7 (the engine and the memory descriptors), which carry kvrelay's own fixed little-endian
encoding of Mori's `EngineDesc` and `MemoryDesc` lists by design (src/pure/wire/desc.rs): Mori's own bytes are its
C++ library's msgpack. So `EngineDesc` and `MemoryDesc` here are the stand-ins for `mori.io`'s classes, and
`install` points mori/conn.py's `_unpack_mem_desc_list(s)` (l.101, l.119: `msgspec.msgpack.decode` then
`MemoryDesc.unpack`) at kvrelay's list framing; every other field is decoded by Mori's
`KVArgsRegisterInfo.from_zmq` (l.223) and `TransferInfo.from_zmq` (l.146) themselves.
"""

import struct

GUARD = b"MoriMsgGuard"  # mori/conn.py:64 MORI_GUARD, frame 0 of every message


class EngineDesc:
    """kvrelay's `EngineDesc.pack()`: `u32le gpu_id | u16le port | u16le key_len | key | u16le host_len | host`,
    then, when there is one, `u32le address_len | address` (the transfer engine's peer address: here the decode
    engine's Mooncake session id)."""

    def __init__(self, key, gpu_id, host, port, address):
        self.key, self.gpu_id, self.host, self.port, self.address = key, gpu_id, host, port, address

    @staticmethod
    def unpack(data):
        gpu_id, port = struct.unpack_from("<IH", data, 0)
        at = 6
        (length,) = struct.unpack_from("<H", data, at)
        key = data[at + 2: at + 2 + length].decode()
        at += 2 + length
        (length,) = struct.unpack_from("<H", data, at)
        host = data[at + 2: at + 2 + length].decode()
        at += 2 + length
        address = b""
        if at < len(data):
            (length,) = struct.unpack_from("<I", data, at)
            address = data[at + 4: at + 4 + length]
            at += 4 + length
        if at != len(data):
            raise ValueError(f"engine descriptor: {len(data) - at} bytes left over")
        return EngineDesc(key, gpu_id, host, port, address)


class MemoryDesc:
    """kvrelay's packed memory descriptor: `u64le address | u64le length | u32le rkey` (20 bytes)."""

    SIZE = 20

    def __init__(self, addr, size, rkey):
        self.addr, self.size, self.rkey = addr, size, rkey

    @staticmethod
    def unpack(data):
        return MemoryDesc(*struct.unpack("<QQI", data))


def unpack_mem_desc_list(blob):
    """kvrelay's list: the 20-byte records back to back (stands in for mori/conn.py:101)."""
    if len(blob) % MemoryDesc.SIZE:
        raise ValueError(f"memory descriptor list of {len(blob)} bytes")
    return [MemoryDesc.unpack(blob[at: at + MemoryDesc.SIZE]) for at in range(0, len(blob), MemoryDesc.SIZE)]


def unpack_buffers(blob):
    """`u32le n | n x u32le length | the buffers` (SGLang's own pack_list_of_buffers framing, common/utils.py:40)."""
    if not blob:
        return []
    (count,) = struct.unpack_from("<I", blob, 0)
    lengths = struct.unpack_from(f"<{count}I", blob, 4)
    at, out = 4 + 4 * count, []
    for length in lengths:
        out.append(blob[at: at + length])
        at += length
    return out


def unpack_mem_desc_lists(blob):
    """One list per state component (stands in for mori/conn.py:119)."""
    return [unpack_mem_desc_list(buffer) for buffer in unpack_buffers(blob)]


def install(mori):
    mori._unpack_mem_desc_list = unpack_mem_desc_list
    mori._unpack_mem_desc_lists = unpack_mem_desc_lists


def frames(hex_frames):
    """The query's hex frames as bytes, the guard checked and dropped (Mori's decoders take what follows it)."""
    raw = [bytes.fromhex(frame) for frame in hex_frames]
    if not raw or raw[0] != GUARD:
        raise ValueError("the frames do not start with Mori's guard")
    return raw[1:]


def kv_item_lens(registration_payload):
    """kvrelay's registration frame 18 (payload index 17), per-entry KV item lengths as u64le: it has no Mori
    counterpart (Mori's decoder stops at frame 17); Mooncake's own registration carries the same list at its
    msg[19] (mooncake/conn.py:243-247), so it becomes Mooncake's `dst_kv_item_lens`."""
    if len(registration_payload) <= 17 or not registration_payload[17]:
        return []
    blob = registration_payload[17]
    return list(struct.unpack(f"<{len(blob) // 8}Q", blob))
