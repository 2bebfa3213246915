//! Self-describing bytes: every prefill word names its region and offset; decode memory starts as a sentinel.
//!
//! Word `w` (8 bytes, little endian) of source region `g` is `1 << 63 | g << 40 | w`. Every source word in the
//! world is distinct, so any misplaced, shifted or stale byte is both detected and traceable to its origin.

/// The decode-side fill: top bit clear, so never equal to a source word.
pub const SENTINEL_WORD: u64 = 0x5E5E_5E5E_5E5E_5E5E;

const WORD_BITS: u32 = 40;

/// The source word at word index `word` of global source region `region`.
pub fn source_word(region: u32, word: u64) -> u64 {
    debug_assert!(word < 1 << WORD_BITS, "source regions are limited to 8 TiB");
    debug_assert!(region < 1 << 23, "at most 2^23 source regions");
    1 << 63 | u64::from(region) << WORD_BITS | word
}

/// Inverts [`source_word`]: `(region, byte offset)` of a word, or `None` for anything else.
pub fn decode_word(word: u64) -> Option<(u32, u64)> {
    (word >> 63 == 1).then(|| ((word >> WORD_BITS & ((1 << 23) - 1)) as u32, (word & ((1 << WORD_BITS) - 1)) * 8))
}

/// Byte `offset` of source region `region`.
pub fn source_byte(region: u32, offset: u64) -> u8 {
    source_word(region, offset / 8).to_le_bytes()[(offset % 8) as usize]
}

/// Bytes compared or generated per block: a stack buffer that stays in L1.
const BLOCK_BYTES: usize = 4096;

/// Fills a whole source region.
pub fn fill_source(region: u32, bytes: &mut [u8]) {
    fill_source_at(region, 0, bytes);
}

/// Writes source region `region`'s bytes from byte `offset` on into `out` (the pattern generated in place).
pub fn fill_source_at(region: u32, offset: u64, out: &mut [u8]) {
    // An unaligned head, byte by byte, up to the next word boundary.
    let head = (((8 - offset % 8) % 8) as usize).min(out.len());
    for (index, byte) in out[..head].iter_mut().enumerate() {
        *byte = source_byte(region, offset + index as u64);
    }
    let first = (offset + head as u64) / 8;
    let total = out.len();
    let body = &mut out[head..];
    let mut chunks = body.chunks_exact_mut(8);
    for (index, chunk) in (&mut chunks).enumerate() {
        chunk.copy_from_slice(&source_word(region, first + index as u64).to_le_bytes());
    }
    let tail = chunks.into_remainder();
    let tail_offset = offset + (total - tail.len()) as u64;
    for (index, byte) in tail.iter_mut().enumerate() {
        *byte = source_byte(region, tail_offset + index as u64);
    }
}

/// Fills a whole target region with the sentinel.
pub fn fill_sentinel(bytes: &mut [u8]) {
    fill_sentinel_at(0, bytes);
}

/// Writes the sentinel as it lies from byte `offset` of a region on into `out`.
pub fn fill_sentinel_at(offset: u64, out: &mut [u8]) {
    let sentinel = SENTINEL_WORD.to_le_bytes();
    if sentinel.iter().all(|byte| *byte == sentinel[0]) {
        out.fill(sentinel[0]);
        return;
    }
    for (index, byte) in out.iter_mut().enumerate() {
        *byte = sentinel[(offset as usize + index) % 8];
    }
}

/// Whether `found` equals source region `region` from byte `offset` on: the expected bytes are generated block by
/// block into a stack buffer and compared as slices (a vectorised memcmp); nothing is decoded.
pub fn matches_source(region: u32, offset: u64, found: &[u8]) -> bool {
    let mut expected = [0u8; BLOCK_BYTES];
    let mut at = offset;
    found.chunks(BLOCK_BYTES).all(|block| {
        let expected = &mut expected[..block.len()];
        fill_source_at(region, at, expected);
        at += block.len() as u64;
        block == &expected[..]
    })
}

/// Whether `found` is untouched sentinel memory starting at byte `offset` of its region.
pub fn matches_sentinel(offset: u64, found: &[u8]) -> bool {
    let mut expected = [0u8; BLOCK_BYTES];
    // Blocks are a multiple of 8 bytes long, so one block of the sentinel at `offset` serves every block.
    let expected = &mut expected[..found.len().min(BLOCK_BYTES)];
    fill_sentinel_at(offset, expected);
    found.chunks(BLOCK_BYTES).all(|block| block == &expected[..block.len()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_decode_to_their_origin() {
        let word = source_word(1234, 98765);
        assert_eq!(decode_word(word), Some((1234, 98765 * 8)));
        assert_eq!(decode_word(SENTINEL_WORD), None);
    }

    #[test]
    fn fill_and_match_agree_at_unaligned_offsets() {
        let mut bytes = vec![0u8; 37];
        fill_source(9, &mut bytes);
        assert!(matches_source(9, 3, &bytes[3..29]));
        assert!(!matches_source(9, 4, &bytes[3..29]));
        assert!(!matches_source(8, 3, &bytes[3..29]));
    }

    #[test]
    fn generating_at_an_offset_agrees_with_filling_the_whole_region() {
        let mut whole = vec![0u8; 3 * BLOCK_BYTES + 13];
        fill_source(7, &mut whole);
        for (start, end) in [(0, 5), (3, 29), (5, 8), (8, 16), (1, BLOCK_BYTES + 3), (9, whole.len())] {
            let mut part = vec![0u8; end - start];
            fill_source_at(7, start as u64, &mut part);
            assert_eq!(part, whole[start..end], "bytes {start}..{end}");
            assert!(matches_source(7, start as u64, &whole[start..end]));
        }
        let mut changed = whole.clone();
        changed[2 * BLOCK_BYTES + 1] ^= 1;
        assert!(!matches_source(7, 0, &changed));
        let mut sentinel = vec![0u8; 2 * BLOCK_BYTES + 5];
        fill_sentinel(&mut sentinel);
        assert!(matches_sentinel(3, &sentinel[3..]));
        sentinel[BLOCK_BYTES + 2] = 0;
        assert!(!matches_sentinel(0, &sentinel));
    }
}
