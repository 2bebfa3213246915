//! MHA/GQA head slicing under TP mismatch (domain.md §3.2, Mooncake `send_kvcache_slice`).

use super::PlanError;

/// Byte columns of one token row: where the slice starts on each side and how long it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeadSlice {
    pub(crate) source_offset: u64,
    pub(crate) target_offset: u64,
    pub(crate) length: u64,
}

/// The head slice prefill rank `prefill_rank` sends decode rank `decode_rank` for `total_heads` KV heads.
///
/// GQA replication on decode (`Td > H`) uses `ld div (Td / H)`, the rule QKVParallelLinear replicas follow;
/// Mori's `(ld * hd) mod hs` differs there (domain.md §3.2, "flag for review").
pub(crate) fn head_slice(
    total_heads: u32,
    prefill_tp: u32,
    decode_tp: u32,
    prefill_rank: u32,
    decode_rank: u32,
    head_len: u64,
) -> Result<HeadSlice, PlanError> {
    let source_heads = (total_heads / prefill_tp).max(1);
    let target_heads = (total_heads / decode_tp).max(1);
    let (source_head, target_head, count) = if prefill_tp > decode_tp {
        let replicas = (prefill_tp / total_heads).max(1);
        (0, ((prefill_rank / replicas) * source_heads) % target_heads, source_heads)
    } else {
        let replicas = (decode_tp / total_heads).max(1);
        (((decode_rank / replicas) * target_heads) % source_heads, 0, target_heads)
    };
    let length = u64::from(count) * head_len;
    let target_token_len = u64::from(target_heads) * head_len;
    if length > target_token_len {
        return Err(PlanError::SliceTooLarge { slice: length, target_token_len });
    }
    Ok(HeadSlice {
        source_offset: u64::from(source_head) * head_len,
        target_offset: u64::from(target_head) * head_len,
        length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// domain.md §3.2: Llama-3-70B TP4 -> TP8, decode rank 5 <- prefill rank 2, second head of its two.
    #[test]
    fn llama_70b_decode_rank_five_takes_prefill_head_one() {
        let slice = head_slice(8, 4, 8, 2, 5, 256).unwrap();
        assert_eq!(slice, HeadSlice { source_offset: 256, target_offset: 0, length: 256 });
    }

    /// domain.md §3.2: Llama-3-8B TP8 -> TP2, prefill rank 6 fills head 2 of decode rank 1.
    #[test]
    fn llama_8b_prefill_rank_six_lands_at_head_two() {
        let slice = head_slice(8, 8, 2, 6, 1, 256).unwrap();
        assert_eq!(slice, HeadSlice { source_offset: 0, target_offset: 512, length: 256 });
    }

    /// domain.md §3.2: H=8, TP1 -> TP16, decode rank 9 holds head 9 div 2 = 4 (Mori's formula would give 1).
    #[test]
    fn gqa_replication_uses_rank_div_replicas() {
        let slice = head_slice(8, 1, 16, 0, 9, 256).unwrap();
        assert_eq!(slice, HeadSlice { source_offset: 4 * 256, target_offset: 0, length: 256 });
    }
}
