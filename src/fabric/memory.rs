//! One registered region's bytes in the in-memory fabric: dense (a `Vec` handed to `register`) or materialised
//! lazily per chunk (`register_filled`; [`chunk_bytes`] of the region's item length), where a chunk no write has
//! reached is never allocated and reads as the region's [`Fill`]. A lazily filled region costs memory for the chunks
//! written to only.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::verbs::Fill;

/// Bytes per materialised chunk of a lazily filled region without an item length (chunks start at multiples of
/// the chunk size). Measured with `kvrelay bench` on the Kimi-K3 scenario: 16 KiB chunks spent a third of the verify
/// phase on per-chunk lookups and scattered memory (end to end 0.155 s), 128 KiB took 0.099 s, 256 KiB 0.101 s, and
/// 512 KiB and larger slowed the flush (sentinel fills of partly written chunks, allocator churn) and raised peak
/// memory.
pub const CHUNK_BYTES: u64 = 128 << 10;

/// Chunks are at least this large when items are small (many items per chunk)...
const MIN_ITEM_CHUNK: u64 = 32 << 10;
/// ...and at most this large when items are large (an item spans chunks).
const MAX_ITEM_CHUNK: u64 = 1 << 20;

/// The chunk size of a lazily filled region used in items of `item_len` bytes: the smallest whole number of items
/// of at least 32 KiB, or 1 MiB for items larger than that ([`CHUNK_BYTES`] when `item_len` is 0). A chunk then holds
/// whole items, so an item written to (a page of a layer, a state slot) materialises few neighbours. Measured on the
/// Kimi-K3 shape (36 KiB KV pages, 27 KiB and 768 KiB KDA slots): with 128 KiB chunks the replay's request
/// materialised 1.35 GB of decode memory for 0.90 GB moved (pages straddling chunks), with whole items of at least
/// 64 KiB 1.14 GB, at least 32 KiB 0.92 GB; `kvrelay bench` end to end went from about 0.085 s to 0.07 s.
pub fn chunk_bytes(item_len: u64) -> u64 {
    match item_len {
        0 => CHUNK_BYTES,
        len if len >= MAX_ITEM_CHUNK => MAX_ITEM_CHUNK,
        len => MIN_ITEM_CHUNK.div_ceil(len) * len,
    }
}

/// A region's bytes.
pub(super) enum Memory {
    Dense(Vec<u8>),
    /// `chunk`: bytes per chunk (chunks start at its multiples).
    Lazy {
        len: u64,
        chunk: u64,
        fill: Fill,
        chunks: BTreeMap<u64, Box<[u8]>>,
        pool: Option<ChunkPool>,
    },
}

/// Whole chunks handed back after a run, reused by the next lazily filled regions instead of fresh pages: a decode
/// server registers its pools once and reuses them, and a replay or a bench should not pay the kernel's page faults
/// for every request. A reused chunk's old bytes are never seen: a chunk is filled, or wholly written, before use.
///
/// Cloning gives another handle onto the same pool.
#[derive(Debug, Clone, Default)]
pub struct ChunkPool {
    free: Arc<Mutex<Free>>,
    /// Bytes kept at most (more are freed).
    limit: u64,
}

/// Chunks held for reuse, by size, and their total bytes.
#[derive(Debug, Default)]
struct Free {
    by_size: BTreeMap<usize, Vec<Box<[u8]>>>,
    bytes: u64,
}

/// Chunks smaller than this are not kept (a region's short tail, tiny regions): the allocator serves them well.
const MIN_POOLED: usize = 4 << 10;

impl ChunkPool {
    /// A pool keeping at most `limit_bytes` of chunks.
    pub fn new(limit_bytes: u64) -> ChunkPool {
        ChunkPool { free: Arc::default(), limit: limit_bytes }
    }

    /// Takes back the chunks of `chunks` while the pool holds less than its limit (chunks under 4 KiB are freed).
    pub fn recycle(&self, chunks: impl IntoIterator<Item = Vec<u8>>) {
        let mut free = self.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for chunk in chunks.into_iter().filter(|chunk| chunk.len() >= MIN_POOLED) {
            let size = chunk.len() as u64;
            if free.bytes + size > self.limit {
                break;
            }
            free.bytes += size;
            free.by_size.entry(chunk.len()).or_default().push(chunk.into_boxed_slice());
        }
    }

    /// Bytes held for reuse.
    pub fn held_bytes(&self) -> u64 {
        self.free.lock().map_or(0, |free| free.bytes)
    }

    /// A chunk of `size` bytes with unspecified contents (a reused one when the pool holds one of that size).
    fn take(&self, size: usize) -> Box<[u8]> {
        let reused = self.free.lock().ok().and_then(|mut free| {
            let chunk = free.by_size.get_mut(&size)?.pop()?;
            free.bytes -= size as u64;
            Some(chunk)
        });
        reused.unwrap_or_else(|| vec![0u8; size].into_boxed_slice())
    }
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Memory::Dense(bytes) => write!(f, "Dense({} bytes)", bytes.len()),
            Memory::Lazy { len, chunks, .. } => write!(f, "Lazy({len} bytes, {} chunks materialised)", chunks.len()),
        }
    }
}

impl Memory {
    /// A lazily filled region of `len` bytes, materialised in chunks of `chunk` bytes (taken from `pool` when given).
    pub(super) fn lazy(len: u64, chunk: u64, fill: Fill, pool: Option<ChunkPool>) -> Memory {
        Memory::Lazy { len, chunk, fill, chunks: BTreeMap::new(), pool }
    }

    pub(super) fn len(&self) -> u64 {
        match self {
            Memory::Dense(bytes) => bytes.len() as u64,
            Memory::Lazy { len, .. } => *len,
        }
    }

    /// The chunks `[start, start + len)` covers, each as (chunk start, range within the chunk, range within the
    /// request). The range must lie inside the region.
    fn pieces(size: u64, start: u64, len: u64) -> impl Iterator<Item = (u64, Range<usize>, Range<usize>)> {
        let end = start + len;
        let mut at = start;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let chunk = at / size * size;
                let stop = end.min(chunk + size);
                let piece = (
                    chunk,
                    (at - chunk) as usize..(stop - chunk) as usize,
                    (at - start) as usize..(stop - start) as usize,
                );
                at = stop;
                piece
            })
        })
    }

    /// Copies `out.len()` bytes from `start` into `out` (inside the region).
    pub(super) fn read(&self, start: u64, out: &mut [u8]) {
        match self {
            Memory::Dense(bytes) => out.copy_from_slice(&bytes[start as usize..start as usize + out.len()]),
            Memory::Lazy { chunk: size, fill, chunks, .. } => {
                for (chunk, within, part) in Self::pieces(*size, start, out.len() as u64) {
                    match chunks.get(&chunk) {
                        Some(bytes) => out[part].copy_from_slice(&bytes[within]),
                        None => fill(start + part.start as u64, &mut out[part]),
                    }
                }
            }
        }
    }

    /// Hands `write(offset within the request, bytes)` mutable slices covering `[start, start + len)` in order,
    /// materialising lazily filled chunks as they are reached (a chunk wholly covered is not filled first).
    pub(super) fn write_with(&mut self, start: u64, len: u64, mut write: impl FnMut(u64, &mut [u8])) {
        match self {
            Memory::Dense(bytes) => write(0, &mut bytes[start as usize..(start + len) as usize]),
            Memory::Lazy { len: region_len, chunk: chunk_len, fill, chunks, pool } => {
                for (chunk, within, part) in Self::pieces(*chunk_len, start, len) {
                    let bytes = chunks.entry(chunk).or_insert_with(|| {
                        let size = (*region_len - chunk).min(*chunk_len) as usize;
                        let mut bytes = match pool {
                            Some(pool) => pool.take(size),
                            None => vec![0u8; size].into_boxed_slice(),
                        };
                        // Filled unless this write covers it whole: a reused chunk's old bytes never show.
                        if within.len() < size {
                            fill(chunk, &mut bytes);
                        }
                        bytes
                    });
                    write(part.start as u64, &mut bytes[within]);
                }
            }
        }
    }

    /// Writes `bytes` at `start` (inside the region).
    pub(super) fn write(&mut self, start: u64, bytes: &[u8]) {
        self.write_with(start, bytes.len() as u64, |at, out| out.copy_from_slice(&bytes[at as usize..][..out.len()]));
    }

    /// Copies `len` bytes of `source` from `source_start` to `start` of this memory: a lazily filled source's
    /// untouched bytes are generated straight into the target, with no staging copy.
    pub(super) fn copy_from(&mut self, start: u64, source: &Memory, source_start: u64, len: u64) {
        self.write_with(start, len, |at, out| source.read(source_start + at, out));
    }

    /// Every byte, materialised.
    pub(super) fn into_vec(self) -> Vec<u8> {
        match self {
            Memory::Dense(bytes) => bytes,
            lazy => {
                let mut bytes = vec![0u8; lazy.len() as usize];
                lazy.read(0, &mut bytes);
                bytes
            }
        }
    }

    /// The materialised chunks by start offset (a dense region: one chunk of every byte, none when empty).
    pub(super) fn into_chunks(self) -> BTreeMap<u64, Vec<u8>> {
        match self {
            Memory::Dense(bytes) if bytes.is_empty() => BTreeMap::new(),
            Memory::Dense(bytes) => BTreeMap::from([(0, bytes)]),
            Memory::Lazy { chunks, .. } => chunks.into_iter().map(|(start, chunk)| (start, chunk.into_vec())).collect(),
        }
    }

    /// How many bytes are materialised (a dense region's whole length).
    #[cfg(test)]
    pub(super) fn resident(&self) -> u64 {
        match self {
            Memory::Dense(bytes) => bytes.len() as u64,
            Memory::Lazy { chunks, .. } => chunks.values().map(|chunk| chunk.len() as u64).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn counting() -> Fill {
        Arc::new(|offset, out: &mut [u8]| {
            for (index, byte) in out.iter_mut().enumerate() {
                *byte = (offset + index as u64) as u8 | 1;
            }
        })
    }

    #[test]
    fn lazy_memory_reads_its_fill_and_materialises_only_written_chunks() {
        let len = 3 * CHUNK_BYTES + 100;
        let mut lazy = Memory::lazy(len, CHUNK_BYTES, counting(), None);
        let mut dense = Memory::Dense(lazy_bytes(&lazy));
        assert_eq!(lazy.resident(), 0);
        let data: Vec<u8> = (0..CHUNK_BYTES + 10).map(|index| (index % 7) as u8 * 2).collect();
        for memory in [&mut lazy, &mut dense] {
            memory.write(CHUNK_BYTES - 5, &data);
            memory.write(len - 3, &[0, 0, 0]);
        }
        assert_eq!(lazy.resident(), 3 * CHUNK_BYTES + 100);
        assert_eq!(lazy_bytes(&lazy), lazy_bytes(&dense));
        let mut part = vec![0u8; 2 * CHUNK_BYTES as usize];
        let mut expected = part.clone();
        lazy.read(CHUNK_BYTES / 2, &mut part);
        dense.read(CHUNK_BYTES / 2, &mut expected);
        assert_eq!(part, expected);
        let source = Memory::lazy(len, CHUNK_BYTES, counting(), None);
        let zero: Fill = Arc::new(|_, out: &mut [u8]| out.fill(0));
        let mut target = Memory::lazy(len, CHUNK_BYTES, zero, None);
        target.copy_from(7, &source, 3, CHUNK_BYTES);
        let mut moved = vec![0u8; CHUNK_BYTES as usize];
        target.read(7, &mut moved);
        assert!(moved.iter().enumerate().all(|(index, byte)| *byte == (3 + index as u64) as u8 | 1));
        assert_eq!(target.resident(), 2 * CHUNK_BYTES);
        assert_eq!(source.resident(), 0);
    }

    /// Chunks handed back are reused, and what they held never shows through: a partly written chunk is filled,
    /// a wholly written one overwritten.
    #[test]
    fn reused_chunks_show_the_fill_or_the_write_never_their_old_bytes() {
        let pool = ChunkPool::new(4 * CHUNK_BYTES);
        pool.recycle([vec![0xAB; CHUNK_BYTES as usize], vec![0xCD; CHUNK_BYTES as usize], vec![1; 10]]);
        assert_eq!(pool.held_bytes(), 2 * CHUNK_BYTES);
        let len = 2 * CHUNK_BYTES;
        let mut memory = Memory::lazy(len, CHUNK_BYTES, counting(), Some(pool.clone()));
        memory.write(10, &[0, 0]);
        memory.write(CHUNK_BYTES, &vec![2; CHUNK_BYTES as usize]);
        assert_eq!(pool.held_bytes(), 0);
        let mut expected = Memory::Dense(vec![0; len as usize]);
        expected.write(0, &lazy_bytes(&Memory::lazy(len, CHUNK_BYTES, counting(), None)));
        expected.write(10, &[0, 0]);
        expected.write(CHUNK_BYTES, &vec![2; CHUNK_BYTES as usize]);
        assert_eq!(lazy_bytes(&memory), lazy_bytes(&expected));
        pool.recycle(memory.into_chunks().into_values());
        assert_eq!(pool.held_bytes(), 2 * CHUNK_BYTES);
    }

    /// Chunks hold whole items of at least 32 KiB (at most 1 MiB), so writing one item materialises that item
    /// and the few sharing its chunk, never a straddled neighbour.
    #[test]
    fn chunks_hold_whole_items() {
        assert_eq!(chunk_bytes(0), CHUNK_BYTES);
        assert_eq!(chunk_bytes(36_864), 36_864);
        assert_eq!(chunk_bytes(27_648), 2 * 27_648);
        assert_eq!(chunk_bytes(100), 328 * 100);
        assert_eq!(chunk_bytes(786_432), 786_432);
        assert_eq!(chunk_bytes(6 << 20), 1 << 20);
        let item = 36_864u64;
        let len = 10 * item;
        let mut memory = Memory::lazy(len, chunk_bytes(item), counting(), None);
        memory.write(3 * item + 5, &[0; 100]);
        assert_eq!(memory.resident(), item);
        assert_eq!(memory.into_chunks().into_keys().collect::<Vec<_>>(), [3 * item]);
    }

    fn lazy_bytes(memory: &Memory) -> Vec<u8> {
        let mut bytes = vec![0u8; memory.len() as usize];
        memory.read(0, &mut bytes);
        bytes
    }
}
