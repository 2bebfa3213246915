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

/// Fills a whole source region.
pub fn fill_source(region: u32, bytes: &mut [u8]) {
    let mut chunks = bytes.chunks_exact_mut(8);
    for (word, chunk) in (&mut chunks).enumerate() {
        chunk.copy_from_slice(&source_word(region, word as u64).to_le_bytes());
    }
    let tail_start = bytes.len() / 8 * 8;
    for (index, byte) in bytes[tail_start..].iter_mut().enumerate() {
        *byte = source_byte(region, (tail_start + index) as u64);
    }
}

/// Fills a whole target region with the sentinel.
pub fn fill_sentinel(bytes: &mut [u8]) {
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = SENTINEL_WORD.to_le_bytes()[index % 8];
    }
}

/// Whether `found` equals source region `region` from byte `offset` on.
pub fn matches_source(region: u32, offset: u64, found: &[u8]) -> bool {
    if offset % 8 == 0 && found.len() % 8 == 0 {
        let first = offset / 8;
        return found
            .chunks_exact(8)
            .enumerate()
            .all(|(index, chunk)| chunk == source_word(region, first + index as u64).to_le_bytes());
    }
    found.iter().enumerate().all(|(index, byte)| *byte == source_byte(region, offset + index as u64))
}

/// Whether `found` is untouched sentinel memory starting at byte `offset` of its region.
pub fn matches_sentinel(offset: u64, found: &[u8]) -> bool {
    let sentinel = SENTINEL_WORD.to_le_bytes();
    if offset % 8 == 0 && found.len() % 8 == 0 {
        return found.chunks_exact(8).all(|chunk| chunk == sentinel);
    }
    found.iter().enumerate().all(|(index, byte)| *byte == sentinel[(offset as usize + index) % 8])
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
}
