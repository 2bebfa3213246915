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

/// Words compared per block before an early exit: a branch-free inner loop the compiler vectorises.
const BLOCK_WORDS: usize = 256;

/// Whether `found` equals source region `region` from byte `offset` on: each word is compared with the word the
/// pattern puts there, XORs folded per block (no buffer, nothing decoded).
pub fn matches_source(region: u32, offset: u64, found: &[u8]) -> bool {
    let head = (((8 - offset % 8) % 8) as usize).min(found.len());
    let bytes_match = |start: usize, bytes: &[u8]| {
        bytes.iter().enumerate().all(|(index, byte)| *byte == source_byte(region, offset + (start + index) as u64))
    };
    if !bytes_match(0, &found[..head]) {
        return false;
    }
    let base = source_word(region, 0);
    let mut word = (offset + head as u64) / 8;
    let mut blocks = found[head..].chunks_exact(8 * BLOCK_WORDS);
    let block_matches = |block: &[u8], first: u64| {
        let words = block.chunks_exact(8).enumerate();
        words.fold(0u64, |diff, (k, bytes)| {
            let found = u64::from_le_bytes(bytes.try_into().expect("8-byte chunks"));
            diff | (found ^ (base | (first + k as u64)))
        }) == 0
    };
    for block in &mut blocks {
        if !block_matches(block, word) {
            return false;
        }
        word += BLOCK_WORDS as u64;
    }
    let rest = blocks.remainder();
    let whole = rest.len() / 8 * 8;
    block_matches(&rest[..whole], word) && bytes_match(found.len() - (rest.len() - whole), &rest[whole..])
}

/// Whether `found` is untouched sentinel memory starting at byte `offset` of its region.
pub fn matches_sentinel(offset: u64, found: &[u8]) -> bool {
    let sentinel = SENTINEL_WORD.to_le_bytes();
    if sentinel.iter().all(|byte| *byte == sentinel[0]) {
        return found
            .chunks(8 * BLOCK_WORDS)
            .all(|block| block.iter().fold(0u8, |diff, b| diff | (b ^ sentinel[0])) == 0);
    }
    found.iter().enumerate().all(|(index, byte)| *byte == sentinel[(offset as usize + index) % 8])
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK_BYTES: usize = 8 * BLOCK_WORDS;

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
        // One flipped byte anywhere (head, a whole block, the word remainder, the byte tail) is found.
        for (start, flip) in [(3, 4), (0, 2 * BLOCK_BYTES + 1), (0, 3 * BLOCK_BYTES + 2), (9, whole.len() - 1)] {
            let mut changed = whole.clone();
            changed[flip] ^= 1;
            assert!(!matches_source(7, start as u64, &changed[start..]), "byte {flip} flipped, from {start}");
        }
        let mut sentinel = vec![0u8; 2 * BLOCK_BYTES + 5];
        fill_sentinel(&mut sentinel);
        assert!(matches_sentinel(3, &sentinel[3..]));
        sentinel[BLOCK_BYTES + 2] = 0;
        assert!(!matches_sentinel(0, &sentinel));
    }
}
