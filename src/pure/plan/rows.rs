//! Token-row index pairs of one chunk for one decode rank, coalesced into runs (domain.md §2.4, §2.5 case 1).
//!
//! Rows are token indices inside a KV entry (`page * P + slot`), identical for every layer, so one run list
//! serves every entry pair of a connection.

use super::PlanError;

/// `rows` consecutive token rows from `source_row` to `target_row`; both sides advance by one per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRun {
    pub source_row: u64,
    pub target_row: u64,
    pub rows: u64,
}

/// One chunk as the sender sees it (domain.md §2.3).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkView<'a> {
    /// This chunk's prefill allocator pages.
    pub(crate) source_pages: &'a [u32],
    /// The decode allocator pages of the whole send range (never sliced under DCP).
    pub(crate) target_pages: &'a [u32],
    /// `index_slice.start`: prefill pages of the send range before this chunk.
    pub(crate) source_page_offset: u64,
    pub(crate) decode_prefix: u64,
    /// `num_kv_tokens`: valid tokens in this chunk.
    pub(crate) tokens: u64,
    /// Physical page size `P`.
    pub(crate) page_size: u64,
}

/// Appends a pair of rows, extending the last run when both sides are contiguous (`group_concurrent_contiguous`).
fn push(runs: &mut Vec<RowRun>, source_row: u64, target_row: u64, rows: u64) {
    if let Some(last) = runs.last_mut() {
        if last.source_row + last.rows == source_row && last.target_row + last.rows == target_row {
            last.rows += rows;
            return;
        }
    }
    runs.push(RowRun { source_row, target_row, rows });
}

/// The part of `chunk` prefill CP rank `rank` of `size` sends (`filter_kv_indices_for_cp_rank`, SGLang 0.5.23
/// `disaggregation/utils.py:803-857`): over the send range's `total` pages, rank `r` owns the contiguous block
/// starting at `r * (total / size) + min(r, total % size)`, one page longer for the first `total % size` ranks; the
/// chunk is clipped to it (possibly to nothing).
pub(crate) fn cp_block<'a>(chunk: &ChunkView<'a>, total: u64, rank: u32, size: u32) -> ChunkView<'a> {
    let (rank, size) = (u64::from(rank), u64::from(size));
    let (base, rem) = (total / size, total % size);
    let start = rank * base + rank.min(rem);
    let end = start + base + u64::from(rank < rem);
    let chunk_start = chunk.source_page_offset;
    let chunk_end = chunk_start + chunk.source_pages.len() as u64;
    // The block's ends as page offsets inside the chunk (an empty range when they miss it).
    let inside = |page: u64| page.clamp(chunk_start, chunk_end) - chunk_start;
    let (first, last) = (inside(start), inside(end));
    let skipped = first * chunk.page_size;
    ChunkView {
        source_pages: &chunk.source_pages[first as usize..last as usize],
        source_page_offset: chunk_start + first,
        tokens: chunk.tokens.saturating_sub(skipped).min((last - first) * chunk.page_size),
        ..*chunk
    }
}

/// `build_dcp_token_transfer_plan`, target rows (domain.md §2.4): tokens at positions `p ≡ dcp_rank (mod dcp)`.
pub(crate) fn relayout(chunk: &ChunkView<'_>, dcp: u32, dcp_rank: u32) -> Result<Vec<RowRun>, PlanError> {
    let page = chunk.page_size;
    let dcp = u64::from(dcp);
    let chunk_start = chunk.decode_prefix + chunk.source_page_offset * page;
    let first = (u64::from(dcp_rank) + dcp - chunk_start % dcp) % dcp;
    if first >= chunk.tokens {
        // This rank owns no token of the chunk: an empty plan, the chunk still counts (domain.md §2.4).
        return Ok(Vec::new());
    }
    let last = first + (chunk.tokens - 1 - first) / dcp * dcp;
    let required = (chunk.source_page_offset * page + last) / dcp / page + 1;
    if required > chunk.target_pages.len() as u64 {
        return Err(PlanError::InsufficientDcpPages {
            required,
            provided: chunk.target_pages.len() as u64,
            src_page_offset: chunk.source_page_offset,
            dcp_rank,
        });
    }
    let mut runs = Vec::with_capacity(((chunk.tokens - first) / dcp + 1) as usize);
    let mut offset = first;
    while offset < chunk.tokens {
        let source_row = u64::from(chunk.source_pages[(offset / page) as usize]) * page + offset % page;
        let local = (chunk.source_page_offset * page + offset) / dcp;
        let target_row = u64::from(chunk.target_pages[(local / page) as usize]) * page + local % page;
        push(&mut runs, source_row, target_row, 1);
        offset += dcp;
    }
    Ok(runs)
}

/// Draft (replicated) rows (domain.md §2.4): every token of the chunk, into the draft pool paged by `V`.
pub(crate) fn draft(chunk: &ChunkView<'_>, virtual_page: u64) -> Result<Vec<RowRun>, PlanError> {
    if chunk.tokens == 0 {
        return Ok(Vec::new());
    }
    let page = chunk.page_size;
    let last = chunk.source_page_offset * page + chunk.tokens - 1;
    let required = last / virtual_page + 1;
    if required > chunk.target_pages.len() as u64 {
        return Err(PlanError::InsufficientPages {
            required,
            provided: chunk.target_pages.len() as u64,
            src_page_offset: chunk.source_page_offset,
        });
    }
    let mut runs = Vec::new();
    for offset in 0..chunk.tokens {
        let source_row = u64::from(chunk.source_pages[(offset / page) as usize]) * page + offset % page;
        let position = chunk.source_page_offset * page + offset;
        let target_row =
            u64::from(chunk.target_pages[(position / virtual_page) as usize]) * virtual_page + position % virtual_page;
        push(&mut runs, source_row, target_row, 1);
    }
    Ok(runs)
}

/// Contiguous runs of paired item indices (`group_concurrent_contiguous`, domain.md §2.4, §8).
pub(crate) fn index_runs(source: &[u32], target: &[u32]) -> Vec<RowRun> {
    let mut runs = Vec::new();
    for (source, target) in source.iter().zip(target) {
        push(&mut runs, u64::from(*source), u64::from(*target), 1);
    }
    runs
}

/// Plain page copy (domain.md §2.5 case 1): the chunk's pages pair 1:1 with `dst_kv_indices[index_slice]`.
///
/// Whole items move, including the unused tail of a last partial page, as upstream's item-granular copy does.
pub(crate) fn page_copy(chunk: &ChunkView<'_>) -> Result<Vec<RowRun>, PlanError> {
    let start = chunk.source_page_offset as usize;
    let end = start + chunk.source_pages.len();
    if end > chunk.target_pages.len() {
        return Err(PlanError::InsufficientPages {
            required: end as u64,
            provided: chunk.target_pages.len() as u64,
            src_page_offset: chunk.source_page_offset,
        });
    }
    let page = chunk.page_size;
    let mut runs = Vec::new();
    for (source, target) in chunk.source_pages.iter().zip(&chunk.target_pages[start..end]) {
        push(&mut runs, u64::from(*source) * page, u64::from(*target) * page, page);
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SGLang's CP blocks (`_get_cp_rank_page_bounds`): 11 pages over CP4 are 3, 3, 3 and 2 pages; a chunk of pages
    /// 4..8 goes to CP rank 1 for pages 4..6 and CP rank 2 for 6..8, and CP rank 3 (pages 9..11) sends none of it.
    #[test]
    fn cp_blocks_give_the_first_ranks_the_remainder_and_clip_each_chunk() {
        let pages = [10, 11, 12, 13];
        let chunk = ChunkView {
            source_pages: &pages,
            target_pages: &[],
            source_page_offset: 4,
            decode_prefix: 0,
            tokens: 64,
            page_size: 16,
        };
        let block = |rank| {
            let view = cp_block(&chunk, 11, rank, 4);
            (view.source_pages.to_vec(), view.source_page_offset, view.tokens)
        };
        assert_eq!(block(0), (vec![], 4, 0));
        assert_eq!(block(1), (vec![10, 11], 4, 32));
        assert_eq!(block(2), (vec![12, 13], 6, 32));
        assert_eq!(block(3), (vec![], 8, 0));
    }

    /// domain.md §2.4 worked example A's chunk: P=2, src=[5,2,11,4], dst=[7], n=8.
    fn example_a() -> ChunkView<'static> {
        ChunkView {
            source_pages: &[5, 2, 11, 4],
            target_pages: &[7],
            source_page_offset: 0,
            decode_prefix: 0,
            tokens: 8,
            page_size: 2,
        }
    }

    /// domain.md §2.4 worked example B's second chunk: P=2, prefix 4, dst=[4,6], src=[9,3], offset 1, n=4.
    fn example_b() -> ChunkView<'static> {
        ChunkView {
            source_pages: &[9, 3],
            target_pages: &[4, 6],
            source_page_offset: 1,
            decode_prefix: 4,
            tokens: 4,
            page_size: 2,
        }
    }

    fn pairs(runs: &[RowRun]) -> (Vec<u64>, Vec<u64>) {
        let expanded = runs.iter().flat_map(|run| (0..run.rows).map(move |k| (run.source_row + k, run.target_row + k)));
        expanded.unzip()
    }

    /// domain.md §2.4 worked example A: P=2, c=4, src=[5,2,11,4], dst=[7], n=8.
    #[test]
    fn worked_example_a_every_rank_gets_its_two_rows() {
        let chunk = example_a();
        let expected = [
            (vec![10, 22], vec![14, 15]),
            (vec![11, 23], vec![14, 15]),
            (vec![4, 8], vec![14, 15]),
            (vec![5, 9], vec![14, 15]),
        ];
        for (rank, expected) in expected.into_iter().enumerate() {
            assert_eq!(pairs(&relayout(&chunk, 4, rank as u32).unwrap()), expected, "dcp rank {rank}");
        }
    }

    /// domain.md §2.4 worked example B: second chunk with offset 1 after a one-virtual-page prefix.
    #[test]
    fn worked_example_b_second_chunk_uses_full_decode_page_list() {
        let chunk = example_b();
        assert_eq!(pairs(&relayout(&chunk, 2, 0).unwrap()), (vec![18, 6], vec![9, 12]));
        assert_eq!(pairs(&relayout(&chunk, 2, 1).unwrap()), (vec![19, 7], vec![9, 12]));
    }

    /// domain.md §2.4 worked example C: K3-like, rank 5 of DCP8, 1000 tokens on pages 100..115 into [3, 9].
    #[test]
    fn worked_example_c_rank_five_spans_two_virtual_pages() {
        let source_pages: Vec<u32> = (100..116).collect();
        let chunk = ChunkView {
            source_pages: &source_pages,
            target_pages: &[3, 9],
            source_page_offset: 0,
            decode_prefix: 0,
            tokens: 1000,
            page_size: 64,
        };
        let (source, target) = pairs(&relayout(&chunk, 8, 5).unwrap());
        assert_eq!(source.len(), 125);
        assert_eq!((source[0], source[1]), (6405, 6413));
        assert_eq!(&target[..64], &(192..256).collect::<Vec<_>>()[..]);
        assert_eq!(&target[64..], &(576..637).collect::<Vec<_>>()[..]);
        assert_eq!((source[124], target[124]), (7397, 636));
    }

    /// domain.md §2.4 draft rows of worked examples A (dst 56..63) and B (dst 18, 19, 24, 25).
    #[test]
    fn draft_rows_are_replicated_at_virtual_page_addresses() {
        let example_a = example_a();
        assert_eq!(pairs(&draft(&example_a, 8).unwrap()), (vec![10, 11, 4, 5, 22, 23, 8, 9], (56..64).collect()));
        let example_b = example_b();
        assert_eq!(pairs(&draft(&example_b, 4).unwrap()), (vec![18, 19, 6, 7], vec![18, 19, 24, 25]));
    }

    #[test]
    fn rank_owning_no_token_gets_an_empty_plan() {
        let chunk = ChunkView {
            source_pages: &[3],
            target_pages: &[1],
            source_page_offset: 0,
            decode_prefix: 0,
            tokens: 5,
            page_size: 64,
        };
        assert_eq!(relayout(&chunk, 8, 6), Ok(Vec::new()));
        assert_eq!(relayout(&chunk, 8, 4).map(|runs| runs.len()), Ok(1));
    }

    #[test]
    fn too_few_decode_pages_names_offset_and_rank() {
        let chunk = ChunkView {
            source_pages: &[1, 2, 3, 4],
            target_pages: &[7],
            source_page_offset: 0,
            decode_prefix: 0,
            tokens: 8,
            page_size: 1,
        };
        // Rank 0 owns positions 0, 2, 4, 6 -> local rows 0..3, four one-token pages.
        let res = relayout(&chunk, 2, 0);
        assert_eq!(
            res,
            Err(PlanError::InsufficientDcpPages { required: 4, provided: 1, src_page_offset: 0, dcp_rank: 0 })
        );
    }
}
