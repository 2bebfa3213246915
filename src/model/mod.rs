//! Vocabulary of a transfer problem: ranks, topologies, model geometry, registered regions and requests.
//!
//! Everything here is plain data (no IO, no clock, no randomness); see ARCHITECTURE.md.
//! Terms follow domain.md: an *entry* is one registered buffer, an *item* one page of one layer of it,
//! a *token row* one token's bytes inside an item.

mod layout;

pub use layout::{build_side_layout, stage_layers, SideOptions};

use std::fmt;

/// Global model layer id (0-based), as carried in `kv_layer_ids` (domain.md §4.2).
pub type LayerId = u32;

/// Which end of the handoff a rank or region belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Side {
    Prefill,
    Decode,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        })
    }
}

/// One process of one side, addressed by pipeline stage and attention-TP rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankId {
    pub pp: u32,
    pub tp: u32,
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pp{}/tp{}", self.pp, self.tp)
    }
}

/// Parallel layout of one side (domain.md §2.2, §3.1, §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Attention tensor-parallel size.
    pub tp: u32,
    /// Pipeline-parallel size.
    pub pp: u32,
    /// Decode context-parallel size, carved out of the TP group (`tp % dcp == 0`).
    pub dcp: u32,
    /// Physical page size `P` of the KV pool, in tokens.
    pub page_size: u32,
}

impl Topology {
    /// DCP rank of an attention-TP rank: consecutive blocks of `dcp` ranks (domain.md §2.2).
    pub fn dcp_rank(&self, tp: u32) -> u32 {
        tp % self.dcp
    }

    /// Allocator page size `V = P * dcp` (domain.md §2.1); equals `P` without DCP.
    pub fn virtual_page_size(&self) -> u32 {
        self.page_size * self.dcp
    }

    /// All ranks in canonical order (stage-major, then TP rank).
    pub fn ranks(&self) -> impl Iterator<Item = RankId> + '_ {
        (0..self.pp).flat_map(move |pp| (0..self.tp).map(move |tp| RankId { pp, tp }))
    }

    /// Position of `rank` in [`Topology::ranks`].
    pub fn rank_index(&self, rank: RankId) -> usize {
        (rank.pp * self.tp + rank.tp) as usize
    }
}

/// Attention geometry of the model: which global layers carry MLA latent KV and how wide a token row is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelGeometry {
    pub name: String,
    /// Number of decoder layers (all kinds).
    pub layer_count: u32,
    /// Sorted global ids of the layers with an MLA KV entry (domain.md §1.3, §1.4).
    pub mla_layers: Vec<LayerId>,
    pub kv_lora_rank: u32,
    pub qk_rope_head_dim: u32,
    pub dtype_bytes: u32,
}

impl ModelGeometry {
    /// Bytes of one token row of one layer: `(kv_lora_rank + rope) * dtype` (domain.md §1.3).
    pub fn token_len(&self) -> u64 {
        u64::from(self.kv_lora_rank + self.qk_rope_head_dim) * u64::from(self.dtype_bytes)
    }

    /// Hybrid pools register KV entries for a compact subset of layers (domain.md §1.4).
    pub fn pool_kind(&self) -> PoolKind {
        if self.mla_layers.len() as u32 == self.layer_count {
            PoolKind::Mla
        } else {
            PoolKind::HybridMla
        }
    }
}

/// KV pool family; decides the DCP gate and the TP-mismatch sender roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    Mla,
    HybridMla,
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolKind::Mla => "MLA",
            PoolKind::HybridMla => "hybrid-MLA",
        })
    }
}

/// What a registered region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RegionKind {
    /// One KV entry: `page_count` items of `item_len` bytes, one page of one layer each.
    Kv,
}

impl fmt::Display for RegionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegionKind::Kv => "kv",
        })
    }
}

/// One registered entry on one rank (domain.md §1.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub kind: RegionKind,
    pub layer: LayerId,
    /// Bytes of one item (one page of one layer).
    pub item_len: u64,
    /// Items in the region, including the never-used padding page 0.
    pub page_count: u32,
    /// Tokens per item (the physical page size `P`).
    pub page_size: u32,
}

impl Region {
    pub fn len_bytes(&self) -> u64 {
        self.item_len * u64::from(self.page_count)
    }

    /// Bytes of one token row: `item_len / P` (domain.md §1.1).
    pub fn token_len(&self) -> u64 {
        self.item_len / u64::from(self.page_size)
    }

    pub fn row_count(&self) -> u64 {
        u64::from(self.page_count) * u64::from(self.page_size)
    }
}

/// What one rank registers and advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLayout {
    pub rank: RankId,
    pub regions: Vec<Region>,
    /// The `kv_layer_ids` this rank advertises; `None` when it sends no layer metadata.
    pub advertised_layer_ids: Option<Vec<LayerId>>,
}

/// Topology plus every rank's registrations, for one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideLayout {
    pub side: Side,
    pub topology: Topology,
    /// Indexed by [`Topology::rank_index`].
    pub ranks: Vec<RankLayout>,
}

impl SideLayout {
    pub fn rank(&self, rank: RankId) -> &RankLayout {
        &self.ranks[self.topology.rank_index(rank)]
    }
}

/// One request's handoff: its length, what decode already holds, how prefill chunks it, and its pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: u32,
    /// Prompt length in tokens.
    pub tokens: u32,
    /// Tokens decode already holds (`decode_prefix_len`); the send range is `[decode_prefix, tokens)`.
    pub decode_prefix: u32,
    /// Token counts of the prefill chunks over the send range, in order (domain.md §2.3).
    pub chunks: Vec<u32>,
    /// Prefill allocator pages of the whole sequence (page `k` holds positions `[kV, (k+1)V)`).
    pub prefill_pages: Vec<u32>,
    /// Decode allocator pages of the send range (`dst_kv_indices`, domain.md §2.3).
    pub decode_pages: Vec<u32>,
}

impl Request {
    pub fn send_len(&self) -> u32 {
        self.tokens.saturating_sub(self.decode_prefix)
    }
}

/// Everything the planner and the oracle need: model, both sides' layouts and the requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub name: String,
    pub model: ModelGeometry,
    pub prefill: SideLayout,
    pub decode: SideLayout,
    pub requests: Vec<Request>,
}
