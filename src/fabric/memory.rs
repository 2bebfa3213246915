//! One registered region's bytes in the in-memory fabric: dense (a `Vec` handed to `register`) or materialised
//! lazily per [`CHUNK_BYTES`] chunk (`register_filled`), where a chunk no write has reached is never allocated and
//! reads as the region's [`Fill`]. A lazily filled region costs memory for the chunks written to only.

use std::collections::BTreeMap;
use std::ops::Range;

use super::verbs::Fill;

/// Bytes per materialised chunk of a lazily filled region (chunks start at multiples of it).
pub(super) const CHUNK_BYTES: u64 = 64 << 10;

/// A region's bytes.
pub(super) enum Memory {
    Dense(Vec<u8>),
    Lazy { len: u64, fill: Fill, chunks: BTreeMap<u64, Box<[u8]>> },
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
    pub(super) fn len(&self) -> u64 {
        match self {
            Memory::Dense(bytes) => bytes.len() as u64,
            Memory::Lazy { len, .. } => *len,
        }
    }

    /// The chunks `[start, start + len)` covers, each as (chunk start, range within the chunk, range within the
    /// request). The range must lie inside the region.
    fn pieces(&self, start: u64, len: u64) -> impl Iterator<Item = (u64, Range<usize>, Range<usize>)> {
        let end = start + len;
        let mut at = start;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let chunk = at / CHUNK_BYTES * CHUNK_BYTES;
                let stop = end.min(chunk + CHUNK_BYTES);
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
            Memory::Lazy { fill, chunks, .. } => {
                for (chunk, within, part) in self.pieces(start, out.len() as u64) {
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
        let pieces: Vec<_> = self.pieces(start, len).collect();
        match self {
            Memory::Dense(bytes) => write(0, &mut bytes[start as usize..(start + len) as usize]),
            Memory::Lazy { len: region_len, fill, chunks } => {
                for (chunk, within, part) in pieces {
                    let bytes = chunks.entry(chunk).or_insert_with(|| {
                        let size = (*region_len - chunk).min(CHUNK_BYTES) as usize;
                        let mut bytes = vec![0u8; size].into_boxed_slice();
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
        let mut lazy = Memory::Lazy { len, fill: counting(), chunks: BTreeMap::new() };
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
        let source = Memory::Lazy { len, fill: counting(), chunks: BTreeMap::new() };
        let mut target = Memory::Lazy { len, fill: Arc::new(|_, out: &mut [u8]| out.fill(0)), chunks: BTreeMap::new() };
        target.copy_from(7, &source, 3, CHUNK_BYTES);
        let mut moved = vec![0u8; CHUNK_BYTES as usize];
        target.read(7, &mut moved);
        assert!(moved.iter().enumerate().all(|(index, byte)| *byte == (3 + index as u64) as u8 | 1));
        assert_eq!(target.resident(), 2 * CHUNK_BYTES);
        assert_eq!(source.resident(), 0);
    }

    fn lazy_bytes(memory: &Memory) -> Vec<u8> {
        let mut bytes = vec![0u8; memory.len() as usize];
        memory.read(0, &mut bytes);
        bytes
    }
}
