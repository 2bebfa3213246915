//! kvrelay's encodings of Mori's `EngineDesc.pack()` and msgpack `MemoryDesc` lists (registration frames 4-7,
//! §6.2 idx 3-6).
//!
//! Mori's own bytes are library-internal (C++ `MSGPACK_DEFINE` structs inside a msgpack list) and kvrelay takes no
//! msgpack dependency, so these frames carry the same information in a fixed little-endian layout documented in
//! `src/pure/wire/README.md`. A kvrelay engine talks to a kvrelay engine; it does not parse a real Mori peer's frames.

use super::codec::{item_count, pack_buffers, text, unpack_buffers, Cursor};
use super::error::WireReason;
use crate::limits::{MAX_GPU_ID, MAX_PEER_ADDRESS_BYTES};

/// A peer's transfer engine: what a prefill rank needs to connect to it (Mori's `EngineDesc`: key, GPU, host, port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDesc {
    /// Unique engine name (Mori's `EngineKey`, e.g. `io-decode-dp0-tp3-pid42-10.0.0.2`); text, at most 255 bytes.
    pub key: String,
    /// The engine's GPU, at most [`MAX_GPU_ID`].
    pub gpu_id: u32,
    /// The engine's out-of-band host (Mori's TCP handle); text, at most 255 bytes.
    pub host: String,
    /// The engine's out-of-band port, 1..=65535.
    pub port: u16,
    /// How a peer's transfer engine reaches this one (the transfer-engine seam's opaque peer address: a queue pair's
    /// text for verbs, an agent's metadata for NIXL, a session id for Mooncake); at most
    /// [`MAX_PEER_ADDRESS_BYTES`]. Empty: none (then it is not on the wire).
    pub address: Vec<u8>,
}

impl EngineDesc {
    /// `u32le gpu_id | u16le port | u16le key_len | key | u16le host_len | host`, then, when there is an
    /// address, `u32le address_len | address`.
    pub fn pack(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(14 + self.key.len() + self.host.len() + self.address.len());
        out.extend_from_slice(&self.gpu_id.to_le_bytes());
        out.extend_from_slice(&self.port.to_le_bytes());
        put_text(&self.key, &mut out);
        put_text(&self.host, &mut out);
        if !self.address.is_empty() {
            // Longer than u32::MAX is outside the domain: u32::MAX makes the receiver refuse it.
            out.extend_from_slice(&u32::try_from(self.address.len()).unwrap_or(u32::MAX).to_le_bytes());
            out.extend_from_slice(&self.address);
        }
        out
    }

    /// The inverse of [`EngineDesc::pack`]; every byte must be used.
    pub fn unpack(bytes: &[u8]) -> Result<Self, WireReason> {
        let mut cursor = Cursor::new(bytes);
        let gpu_id = cursor.u32()?;
        if gpu_id > MAX_GPU_ID {
            return Err(WireReason::OutOfRange { value: gpu_id.into(), min: 0, max: MAX_GPU_ID.into() });
        }
        let port = cursor.u16()?;
        if port == 0 {
            return Err(WireReason::OutOfRange { value: 0, min: 1, max: u16::MAX.into() });
        }
        let key = take_text(&mut cursor)?;
        let host = take_text(&mut cursor)?;
        let mut address = Vec::new();
        if !cursor.at_end() {
            let length = cursor.u32()?;
            if length == 0 || length as usize > MAX_PEER_ADDRESS_BYTES {
                let max = MAX_PEER_ADDRESS_BYTES as i128;
                return Err(WireReason::OutOfRange { value: length.into(), min: 1, max });
            }
            address = cursor.take(length as usize)?.to_vec();
        }
        cursor.finish()?;
        Ok(Self { key, gpu_id, host, port, address })
    }
}

fn put_text(value: &str, out: &mut Vec<u8>) {
    // A text over u16::MAX bytes is outside the domain (255 bytes); u16::MAX makes the receiver refuse it.
    out.extend_from_slice(&u16::try_from(value.len()).unwrap_or(u16::MAX).to_le_bytes());
    out.extend_from_slice(value.as_bytes());
}

fn take_text(cursor: &mut Cursor<'_>) -> Result<String, WireReason> {
    let length = cursor.u16()?;
    text(cursor.take(length.into())?)
}

/// One registered memory region a peer may write (Mori's `MemoryDesc`, reduced to what RDMA WRITE needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryDesc {
    pub address: u64,
    pub length_bytes: u64,
    /// The remote key of the region's memory registration.
    pub rkey: u32,
}

/// Bytes of one packed [`MemoryDesc`]: `u64le address | u64le length_bytes | u32le rkey`.
pub const MEMORY_DESC_BYTES: usize = 20;

/// A list of memory descs: the 20-byte records back to back (no count; empty list = empty frame).
pub(crate) fn pack_memory_descs(descs: &[MemoryDesc]) -> Vec<u8> {
    let mut out = Vec::with_capacity(descs.len() * MEMORY_DESC_BYTES);
    for desc in descs {
        out.extend_from_slice(&desc.address.to_le_bytes());
        out.extend_from_slice(&desc.length_bytes.to_le_bytes());
        out.extend_from_slice(&desc.rkey.to_le_bytes());
    }
    out
}

/// The inverse of [`pack_memory_descs`]; `list` names the list in errors.
pub(crate) fn unpack_memory_descs(bytes: &[u8], list: usize) -> Result<Vec<MemoryDesc>, WireReason> {
    let count = item_count(bytes, MEMORY_DESC_BYTES, list)?;
    let mut cursor = Cursor::new(bytes);
    let mut out = Vec::with_capacity(count);
    for item in 0..count {
        let desc = MemoryDesc { address: cursor.u64()?, length_bytes: cursor.u64()?, rkey: cursor.u32()? };
        if desc.address.checked_add(desc.length_bytes).is_none() {
            return Err(WireReason::Wraps { list, item });
        }
        out.push(desc);
    }
    cursor.finish()?;
    Ok(out)
}

/// One memory-desc list per state component, framed like `pack_int_lists` (`u32le n`, `n × u32le byte_len`, the
/// lists); no components = empty frame.
pub(crate) fn pack_memory_desc_lists(lists: &[Vec<MemoryDesc>]) -> Vec<u8> {
    let buffers: Vec<Vec<u8>> = lists.iter().map(|list| pack_memory_descs(list)).collect();
    pack_buffers(&buffers)
}

/// The inverse of [`pack_memory_desc_lists`].
pub(crate) fn unpack_memory_desc_lists(bytes: &[u8]) -> Result<Vec<Vec<MemoryDesc>>, WireReason> {
    let buffers = unpack_buffers(bytes)?;
    buffers.into_iter().enumerate().map(|(list, buffer)| unpack_memory_descs(buffer, list)).collect()
}
