//! The staging-buffer geometry of SGLang 0.5.23 (`disaggregation/common/staging_buffer.py`), shared by the loader
//! (ring sizes) and the planner (where a writer's image goes). The oracle restates the head rule on its own
//! (`verify/expect.rs`); rules and decisions in `src/pure/plan/SGLANG.md` "Staging buffer".

/// One (prefill attention TP, decode attention TP) pair's staging image shape (`compute_head_slice_params`,
/// `compute_staging_layout`, `staging_buffer.py:773-839`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingShape {
    /// `W`: prefill ranks writing one decode rank's image (`Tp / Td` when prefill TP is larger, else 1).
    pub writers: u32,
    /// `nh`: heads each writer puts per token (`hs` when prefill TP is larger, else `hd`).
    pub heads: u32,
    /// `b`: bytes of one head of one token.
    pub head_len: u64,
}

impl StagingShape {
    pub fn new(kv_heads: u32, head_len: u64, prefill_tp: u32, decode_tp: u32) -> StagingShape {
        let (heads_prefill, heads_decode) =
            ((kv_heads / prefill_tp.max(1)).max(1), (kv_heads / decode_tp.max(1)).max(1));
        if prefill_tp > decode_tp {
            StagingShape { writers: prefill_tp / decode_tp.max(1), heads: heads_prefill, head_len }
        } else {
            StagingShape { writers: 1, heads: heads_decode, head_len }
        }
    }

    /// Bytes of one token of one writer in one slot: a ring row.
    pub fn row_len(&self) -> u64 {
        u64::from(self.heads).saturating_mul(self.head_len)
    }

    /// Bytes of one slot (one K or V buffer) of one writer's image of `tokens` tokens: `S = T * nh * b`.
    pub fn slot_len(&self, tokens: u64) -> u64 {
        tokens.saturating_mul(self.row_len())
    }

    /// Bytes of one decode rank's image of a chunk of `tokens` tokens over `slots` K and V buffers: the allocation
    /// (`W * T * nh * b * 2L`).
    /// Saturates instead of overflowing (a size past the ring is refused by its caller).
    pub fn image_len(&self, tokens: u64, slots: u64) -> u64 {
        u64::from(self.writers).saturating_mul(self.slot_len(tokens)).saturating_mul(slots)
    }
}
