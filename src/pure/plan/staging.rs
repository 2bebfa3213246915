//! The staging-buffer path (SGLang 0.5.23 `SGLANG_DISAGG_STAGING_BUFFER`, `common/staging_buffer.py`; rules and
//! decisions in `SGLANG.md` "Staging buffer"): under an attention-TP change of an MHA/GQA pool, each prefill rank
//! writes its head slices of a chunk, token by token, into the image the decode allocated for that chunk in its
//! staging ring, instead of into the decode's pool.
//!
//! Image of one chunk (`staging_buffer.py:62-97`): writer `w`, slot `s` (the decode's K buffers, then its V buffers),
//! chunk token `t`, writer head `h`, byte `e` at `off + w*(T*nh*b*2L) + s*(T*nh*b) + t*(nh*b) + h*b + e`, where
//! `T` is the chunk's pages times `P` (the tail rows of the last page go too).

use std::sync::Arc;

use super::rows::{ChunkView, RowRun};
use super::{EntryPair, PlanError};
use crate::model::{Attention, ModelGeometry, RankLayout, StagingShape, Topology};

/// One slot's ring pair and its rows for one chunk.
pub(super) type SlotGroup = (u32, Arc<[EntryPair]>, Arc<[RowRun]>);

/// What one connection writes into the peer's ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StagingLink {
    shape: StagingShape,
    /// This prefill rank's writer index `w` (`lp mod W`).
    writer: u32,
    /// K and V buffers of the decode rank: `2L`.
    slots: u64,
    /// Per KV pair: the pair retargeted at the ring (rows of `nh * b` bytes, column 0), and its slot.
    entries: Arc<[(EntryPair, u64)]>,
}

/// The staging link of one connection on which `link_with` found staging in use (the prefill runs with staging, the
/// peer registered a ring, the pool is MHA/GQA and the attention-TP sizes differ: `mooncake/conn.py:2707-2727`,
/// `nixl/conn.py:1722-1733`). `targets` are the head-slice pairs the slice path would use.
pub(super) fn link(
    model: &ModelGeometry,
    (prefill, decode_tp): (&Topology, u32),
    (source_tp, target): (u32, &RankLayout),
    targets: &[EntryPair],
) -> Option<StagingLink> {
    let ring = target.staging_entry?;
    let Attention::Mha { kv_heads, .. } = model.attention else { return None };
    let shape = StagingShape::new(kv_heads, model.head_len(), prefill.tp, decode_tp);
    let entries = targets
        .iter()
        .filter_map(|pair| {
            let slot = target.kv_entries.iter().position(|entry| *entry == pair.target_region)?;
            let ring_pair =
                EntryPair { target_region: ring, target_row_len: shape.row_len(), target_column: 0, ..pair.clone() };
            Some((ring_pair, slot as u64))
        })
        .collect();
    Some(StagingLink {
        shape,
        writer: if prefill.tp > decode_tp { source_tp % shape.writers } else { 0 },
        slots: target.kv_entries.len() as u64,
        entries,
    })
}

impl StagingLink {
    /// For the explanation: `W`, this writer, `nh` and the slots.
    pub(super) fn describe(&self) -> String {
        format!(
            "staging: writer {} of {} into the decode's ring, {} head(s) of {} B per token, {} K/V slots",
            self.writer, self.shape.writers, self.shape.heads, self.shape.head_len, self.slots
        )
    }

    /// The ring pairs of one chunk and each one's rows: the chunk's pages, whole, into this writer's slot of the
    /// image at `offset` (the decode's allocation for the chunk).
    pub(super) fn chunk(&self, chunk: &ChunkView<'_>, offset: u64) -> Result<Vec<SlotGroup>, PlanError> {
        let page = chunk.page_size;
        let tokens = chunk.source_pages.len() as u64 * page;
        let row = self.shape.row_len().max(1);
        let slot_len = self.shape.slot_len(tokens);
        // The offset comes from the peer's metadata: an image past any address is refused, never wrapped.
        let base = slot_len
            .checked_mul(self.slots)
            .and_then(|writer_len| writer_len.checked_mul(u64::from(self.writer)))
            .and_then(|start| start.checked_add(offset))
            .filter(|base| base.checked_add(slot_len.saturating_mul(self.slots)).is_some());
        let Some(base) = base.filter(|base| base % row == 0) else {
            return Err(PlanError::StagingSpace {
                reason: format!("ring offset {offset} does not start an image of whole {row}-byte rows"),
            });
        };
        Ok(self
            .entries
            .iter()
            .map(|(pair, slot)| {
                let first = (base + slot * slot_len) / row;
                let runs: Arc<[RowRun]> = chunk
                    .source_pages
                    .iter()
                    .enumerate()
                    .map(|(ordinal, source)| RowRun {
                        source_row: u64::from(*source) * page,
                        target_row: first + ordinal as u64 * page,
                        rows: page,
                    })
                    .collect();
                (*slot as u32, Arc::from(vec![pair.clone()]), runs)
            })
            .collect())
    }
}
