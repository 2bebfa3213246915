//! Vocabulary of a transfer problem: ranks, topologies, model geometry, registered regions and requests.
//!
//! Everything here is plain data (no IO, no clock, no randomness); see ARCHITECTURE.md.
//! Terms follow domain.md: an *entry* is one registered buffer, an *item* one page of one layer of it,
//! a *token row* one token's bytes inside an item.

mod layout;
mod staging;

pub use layout::{build_side_layout, partition_layers, stage_layers, MetadataOverride, SideOptions};
pub use staging::StagingShape;

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

/// One process of one side, addressed by attention-DP group, attention-CP rank, pipeline stage and attention-TP rank
/// (the rank inside its group: SGLang's `attn_tp_rank`; layout (dp, cp, tp), `runtime_context.py:79-91`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankId {
    /// Attention-DP group (`attn_dp_rank`); 0 without DP attention.
    pub dp: u32,
    /// Attention-CP rank (`attn_cp_rank`, prefill only); 0 without context parallelism.
    pub cp: u32,
    pub pp: u32,
    pub tp: u32,
}

impl RankId {
    /// The rank of DP group 0 and CP rank 0 (a side without DP attention or CP).
    pub const fn new(pp: u32, tp: u32) -> RankId {
        RankId { dp: 0, cp: 0, pp, tp }
    }
}

/// `pp1/tp3`; `dp2/cp1/pp1/tp3` for CP rank 1 of DP group 2: a group or CP rank is named only when it is not 0, so
/// every scenario without DP attention or CP reads as before.
impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dp > 0 {
            write!(f, "dp{}/", self.dp)?;
        }
        if self.cp > 0 {
            write!(f, "cp{}/", self.cp)?;
        }
        write!(f, "pp{}/tp{}", self.pp, self.tp)
    }
}

/// Parallel layout of one side (domain.md §2.2, §3.1, §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Attention tensor-parallel size: ranks per DP group (SGLang's `attn_tp_size = tp_size / attn_dp_size`).
    pub tp: u32,
    /// Attention data-parallel groups (`--attn-dp-size`, or `--dp` with `--enable-dp-attention`), each `cp` by `tp`
    /// ranks by `pp` stages with its own KV pool; 1 without DP attention.
    pub dp: u32,
    /// Attention context-parallel size (`--attn-cp-size`, prefill only): every CP rank holds the whole KV.
    pub cp: u32,
    /// Every CP rank sends its block of each request's pages (`enable_all_cp_ranks_for_transfer`, SGLang
    /// `common/conn.py:373-394`); otherwise only CP rank 0 sends (the others are dummies). Decode: it pulls from every
    /// prefill CP rank.
    pub all_cp: bool,
    /// Pipeline-parallel size.
    pub pp: u32,
    /// Decode context-parallel size, carved out of the TP group (`tp % dcp == 0`).
    pub dcp: u32,
    /// Physical page size `P` of the KV pool, in tokens.
    pub page_size: u32,
    /// Prefill with `SGLANG_DISAGG_STAGING_BUFFER`: pages of one staging grid chunk (`chunked_prefill_size / P`);
    /// 0 without staging (and always 0 on decode, whose ring is a region of its own).
    pub staging_chunk_pages: u32,
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

    /// All ranks in canonical order (DP group, then stage, then TP rank).
    pub fn ranks(&self) -> impl Iterator<Item = RankId> + '_ {
        (0..self.dp).flat_map(move |dp| self.group(dp))
    }

    /// The ranks of DP group `dp` in canonical order (CP rank, then stage, then TP rank).
    pub fn group(&self, dp: u32) -> impl Iterator<Item = RankId> + '_ {
        (0..self.cp)
            .flat_map(move |cp| (0..self.pp).flat_map(move |pp| (0..self.tp).map(move |tp| RankId { dp, cp, pp, tp })))
    }

    /// Position of `rank` in [`Topology::ranks`].
    pub fn rank_index(&self, rank: RankId) -> usize {
        (((rank.dp * self.cp + rank.cp) * self.pp + rank.pp) * self.tp + rank.tp) as usize
    }

    /// Ranks of one side, every group and CP rank counted.
    pub fn rank_count(&self) -> usize {
        (self.dp * self.cp * self.pp * self.tp) as usize
    }

    /// The CP ranks that send a request's KV, and how many: all of them with all-CP transfer, else CP rank 0 alone.
    pub fn sending_cp_ranks(&self) -> u32 {
        if self.all_cp {
            self.cp
        } else {
            1
        }
    }
}

/// How full-attention layers store KV (domain.md §1.2, §1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// One latent entry per layer, replicated on every TP rank.
    Mla { kv_lora_rank: u32, qk_rope_head_dim: u32 },
    /// K and V entries per layer, heads sharded over TP (replicated when TP exceeds the head count).
    Mha { kv_heads: u32, head_dim: u32 },
}

/// Which state tensors a component holds and how its indices behave (domain.md §5, §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StateKind {
    /// Mamba / KDA / GDN: one slot per request, sliced over TP (domain.md §5).
    Mamba,
    /// Sliding-window KV pages (paged: a length drift truncates, domain.md §8).
    Swa,
    /// DSA indexer keys, one page per KV page (paged).
    Dsa,
    /// A position-indexed ring: lengths must match exactly (domain.md §8).
    SwaRing,
}

impl StateKind {
    /// Paged kinds tolerate a length drift by truncating; position-indexed kinds reject it (domain.md §8).
    pub fn is_paged(self) -> bool {
        matches!(self, StateKind::Swa | StateKind::Dsa)
    }

    pub fn name(self) -> &'static str {
        match self {
            StateKind::Mamba => "mamba",
            StateKind::Swa => "swa",
            StateKind::Dsa => "dsa",
            StateKind::SwaRing => "swa_ring",
        }
    }
}

impl fmt::Display for StateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Byte shape of one state tensor of one layer, for one request slot or one page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorShape {
    /// `outer_count` rows, each `full_dim / tp` units of `unit_bytes` on a rank (domain.md §5.2).
    /// `groups` are the full widths of independently sharded sub-blocks (conv `q|k|v`), in units.
    Sliced { full_dim: u32, unit_bytes: u64, outer_count: u32, groups: Option<Vec<u32>> },
    /// Not sliceable: the same `item_len` bytes on every rank (advertised dim 0).
    Replicated { item_len: u64 },
}

/// One state tensor kind of a component (e.g. `conv`, `temporal`, `k`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateTensor {
    pub name: String,
    pub shape: TensorShape,
}

impl StateTensor {
    /// Bytes of one item on a rank of attention-TP size `tp`.
    pub fn item_len(&self, tp: u32) -> u64 {
        match &self.shape {
            TensorShape::Sliced { full_dim, unit_bytes, outer_count, .. } => {
                u64::from(*outer_count) * u64::from(full_dim / tp) * unit_bytes
            }
            TensorShape::Replicated { item_len } => *item_len,
        }
    }

    /// The sliced axis on a rank (`state_dim_per_tensor`): `full_dim / tp`, or 0 when replicated.
    pub fn local_dim(&self, tp: u32) -> u32 {
        match &self.shape {
            TensorShape::Sliced { full_dim, .. } => full_dim / tp,
            TensorShape::Replicated { .. } => 0,
        }
    }
}

/// A state component (one `state_types` entry): its kind, the layers that carry it and its tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateComponent {
    pub kind: StateKind,
    /// Sorted global layer ids.
    pub layers: Vec<LayerId>,
    pub tensors: Vec<StateTensor>,
    /// Paged kinds: pages a request keeps (the sliding window); `None` keeps every page of the request.
    pub window_pages: Option<u32>,
    /// Whether both sides' pools publish the component's layer ids in the registration (SGLang's SWA pools publish
    /// none: `disaggregation/utils.py:1548-1550`); entries then pair by position.
    pub publishes_layer_ids: bool,
}

/// Speculative draft KV entries appended after the target entries (domain.md §2.4 draft rows, §2.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftGeometry {
    pub entries: u32,
    pub rows: DraftRows,
}

/// What one draft token row holds on a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftRows {
    /// The same `token_len` bytes on every rank (an MLA/MTP draft, or one kvrelay models as replicated).
    Replicated { token_len: u64 },
    /// An MHA/GQA draft (EAGLE, EAGLE3, DFLASH) sharded by heads like the target's KV: `max(1, heads / tp)` heads of
    /// `head_len` bytes on a rank of attention-TP size `tp` (SGLang 0.5.23 `get_num_kv_heads`,
    /// `configs/model_config.py:1700-1711`; a draft ignores DCP).
    Sharded { heads: u32, head_len: u64 },
}

impl DraftGeometry {
    /// Bytes of one draft token row on a rank of attention-TP size `tp`.
    pub fn token_len(&self, tp: u32) -> u64 {
        match self.rows {
            DraftRows::Replicated { token_len } => token_len,
            DraftRows::Sharded { heads, head_len } => u64::from((heads / tp.max(1)).max(1)) * head_len,
        }
    }

    /// `(heads, head_len)` of a head-sharded draft.
    pub fn sharded(&self) -> Option<(u32, u64)> {
        match self.rows {
            DraftRows::Sharded { heads, head_len } => Some((heads, head_len)),
            DraftRows::Replicated { .. } => None,
        }
    }
}

/// Layer id of draft entry `index` on the wire (domain.md §4.2).
pub fn draft_layer_id(index: u32) -> LayerId {
    1_000_000 + index
}

/// The model's true geometry: what every byte means. Peers advertise metadata derived from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelGeometry {
    pub name: String,
    /// Number of decoder layers (all kinds).
    pub layer_count: u32,
    pub attention: Attention,
    /// Sorted global ids of the full-attention layers, which have KV entries (domain.md §1.4).
    pub kv_layers: Vec<LayerId>,
    pub dtype_bytes: u32,
    pub state: Vec<StateComponent>,
    /// Bytes of one row of each aux buffer (domain.md §1.6).
    pub aux_item_lens: Vec<u64>,
    pub draft: Option<DraftGeometry>,
}

impl ModelGeometry {
    /// KV heads held by a rank of TP size `tp`: `max(1, H / tp)` (domain.md §1.2); 1 for MLA.
    pub fn kv_heads_local(&self, tp: u32) -> u32 {
        match self.attention {
            Attention::Mla { .. } => 1,
            Attention::Mha { kv_heads, .. } => (kv_heads / tp).max(1),
        }
    }

    /// Bytes of one head of one token (the whole latent row for MLA).
    pub fn head_len(&self) -> u64 {
        match self.attention {
            Attention::Mla { kv_lora_rank, qk_rope_head_dim } => {
                u64::from(kv_lora_rank + qk_rope_head_dim) * u64::from(self.dtype_bytes)
            }
            Attention::Mha { head_dim, .. } => u64::from(head_dim) * u64::from(self.dtype_bytes),
        }
    }

    /// Bytes of one token row of one K, V or latent entry on a rank of TP size `tp`.
    pub fn token_len(&self, tp: u32) -> u64 {
        u64::from(self.kv_heads_local(tp)) * self.head_len()
    }

    /// Whether a region of `kind` holds a replicated Mamba tensor (no TP axis, advertised dim 0, domain.md §5.2).
    pub fn is_replicated_mamba(&self, kind: RegionKind) -> bool {
        let RegionKind::State { component, tensor } = kind else { return false };
        self.state.get(component as usize).is_some_and(|state| {
            state.kind == StateKind::Mamba
                && matches!(
                    state.tensors.get(tensor as usize).map(|it| &it.shape),
                    Some(TensorShape::Replicated { .. })
                )
        })
    }

    pub fn is_mla(&self) -> bool {
        matches!(self.attention, Attention::Mla { .. })
    }

    /// Hybrid pools register KV entries for a compact subset of layers or carry state (domain.md §1.4).
    pub fn pool_kind(&self) -> PoolKind {
        let hybrid = self.kv_layers.len() as u32 != self.layer_count || !self.state.is_empty();
        match (self.is_mla(), hybrid) {
            (true, false) => PoolKind::Mla,
            (true, true) => PoolKind::HybridMla,
            (false, false) => PoolKind::Mha,
            (false, true) => PoolKind::HybridMha,
        }
    }
}

/// KV pool family; decides the DCP gate and the TP-mismatch sender roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    Mla,
    HybridMla,
    Mha,
    HybridMha,
}

impl PoolKind {
    /// MLA and hybrid-MLA pools replicate the latent over TP (domain.md §1.3).
    pub fn replicated_latent(self) -> bool {
        matches!(self, PoolKind::Mla | PoolKind::HybridMla)
    }
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolKind::Mla => "MLA",
            PoolKind::HybridMla => "hybrid-MLA",
            PoolKind::Mha => "MHA",
            PoolKind::HybridMha => "hybrid-MHA",
        })
    }
}

/// Which half of an MHA layer an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KvPart {
    Latent,
    Key,
    Value,
}

/// What a registered region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RegionKind {
    /// One KV entry: items are pages of one layer, rows are tokens.
    Kv(KvPart),
    /// One draft KV entry (paged by `V` on a DCP decode).
    Draft,
    /// One state tensor of one layer: items are request slots (Mamba) or state pages (paged kinds).
    State { component: u32, tensor: u32 },
    /// One aux buffer: items are request aux rows.
    Aux { buffer: u32 },
    /// The decode's staging ring (`SGLANG_DISAGG_STAGING_BUFFER`): one item; rows are one writer's heads of one token
    /// (`nh * head_dim * dtype_bytes` bytes).
    Staging,
}

impl fmt::Display for RegionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegionKind::Kv(KvPart::Latent) => f.write_str("kv"),
            RegionKind::Kv(KvPart::Key) => f.write_str("k"),
            RegionKind::Kv(KvPart::Value) => f.write_str("v"),
            RegionKind::Draft => f.write_str("draft"),
            RegionKind::State { component, tensor } => write!(f, "state{component}.{tensor}"),
            RegionKind::Aux { buffer } => write!(f, "aux{buffer}"),
            RegionKind::Staging => f.write_str("staging"),
        }
    }
}

/// One registered entry on one rank (domain.md §1.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub kind: RegionKind,
    /// Global layer id (draft entries: `1_000_000 + index`; aux: 0).
    pub layer: LayerId,
    /// Bytes of one item.
    pub item_len: u64,
    /// Items in the region (pages, slots or aux rows), including never-used index 0.
    pub item_count: u32,
    /// Token rows per item: the page size for KV, `V` for a decode draft entry, 1 for state and aux.
    pub rows_per_item: u32,
}

impl Region {
    pub fn len_bytes(&self) -> u64 {
        self.item_len * u64::from(self.item_count)
    }

    /// Bytes of one row: a token row for KV (`item_len / P`, domain.md §1.1), the whole item otherwise.
    pub fn row_len(&self) -> u64 {
        self.item_len / u64::from(self.rows_per_item)
    }
}

/// Per-entry state metadata a rank advertises, per component (domain.md §1.1, §5.2).
///
/// Older peers send lists shorter than the component list; readers apply the defaults of domain.md §5.5.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateMetadata {
    /// `state_types`.
    pub kinds: Vec<StateKind>,
    /// Region index (into `RankLayout::regions`) of each entry of each component.
    pub regions: Vec<Vec<u32>>,
    /// `state_layer_ids[c][i]`.
    pub layer_ids: Vec<Vec<LayerId>>,
    /// `state_dim_per_tensor[c][i]`: sliced axis size on this rank, 0 = not sliceable.
    pub dims: Vec<Vec<u32>>,
    /// `state_conv_shard_groups[c][i]`: full sub-block widths, `None` for ungrouped tensors.
    pub conv_groups: Vec<Vec<Option<Vec<u32>>>>,
    /// `state_slice_outer_counts[c][i]`.
    pub outer_counts: Vec<Vec<u32>>,
}

/// What one rank registers and advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLayout {
    pub rank: RankId,
    pub regions: Vec<Region>,
    /// Region indices of the KV entries in wire order (target entries, then draft entries).
    pub kv_entries: Vec<u32>,
    /// The `kv_layer_ids` this rank advertises; `None` when it sends no layer metadata.
    pub advertised_layer_ids: Option<Vec<LayerId>>,
    pub state: StateMetadata,
    /// Region indices of the aux buffers.
    pub aux_entries: Vec<u32>,
    /// Region index of the staging ring (decode with staging), registered in frame 20.
    pub staging_entry: Option<u32>,
    /// Model layers of this rank's pipeline stage (its pool's `start_layer..end_layer`, domain.md §4.1, or the
    /// side's `SGLANG_PP_LAYER_PARTITION`). Not on the wire: a layout rebuilt from a registration reads `0..0`.
    pub stage_layers: std::ops::Range<u32>,
}

/// Topology plus every rank's registrations, for one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideLayout {
    pub side: Side,
    pub topology: Topology,
    /// Indexed by [`Topology::rank_index`].
    pub ranks: Vec<RankLayout>,
    /// `(component, tensor, outer)`: Mamba tensors this side holds transposed, `outer` rows before the channel axis
    /// (scenario `state_layouts`); every other tensor as the model gives it.
    pub state_outers: Vec<(u32, u32, u32)>,
}

impl SideLayout {
    pub fn rank(&self, rank: RankId) -> &RankLayout {
        &self.ranks[self.topology.rank_index(rank)]
    }

    /// How this side holds sliced tensor `tensor` of component `component`: `(outer rows, bytes per unit)`, the
    /// model's shape or its transposition (the same bytes per channel, `outer x unit`); `None` for a tensor that is
    /// not sliced.
    pub fn sliced_layout(&self, model: &ModelGeometry, component: u32, tensor: u32) -> Option<(u32, u64)> {
        let shape = &model.state.get(component as usize)?.tensors.get(tensor as usize)?.shape;
        let TensorShape::Sliced { unit_bytes, outer_count, .. } = shape else { return None };
        let channel = u64::from(*outer_count) * unit_bytes;
        let outer = self
            .state_outers
            .iter()
            .find(|(c, t, _)| (*c, *t) == (component, tensor))
            .map_or(*outer_count, |(_, _, outer)| *outer);
        Some((outer, channel / u64::from(outer.max(1))))
    }
}

/// Per-request state indices on one side (domain.md §1.6, §5.1, §8).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateIndices {
    /// The request's Mamba slot (shared by all Mamba components).
    pub slot: u32,
    /// The request's aux row.
    pub aux: u32,
    /// State pages per component (empty for non-paged components).
    pub pages: Vec<Vec<u32>>,
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
    /// Decode allocator pages of the send range (`dst_kv_indices`, domain.md §2.3). On a HiSparse decode: the
    /// logical pages, which only its device-resident draft entries use (`device_kv_indices`).
    pub decode_pages: Vec<u32>,
    /// HiSparse decode (`decode.hisparse`): the host pages of the send range, where the KV entries land (the wire's
    /// `kv_indices`); empty otherwise.
    pub decode_host_pages: Vec<u32>,
    /// Staging: the byte offset of each chunk's image in the decode's staging ring (the same on every decode rank of
    /// its DP group, whose rings fill alike); empty without staging.
    pub staging_offsets: Vec<u64>,
    pub prefill_state: StateIndices,
    pub decode_state: StateIndices,
    /// Tokens of the prompt resident in prefill's device cache (a radix hit): with early send enabled, prefill sends
    /// the page-aligned cached part of the send range before computing the rest (domain.md §7).
    pub cached_prefix: u32,
    /// The prefill DP group that computes the request (SGLang's `bootstrap_room % dp`, `decode.py:879-897`).
    pub prefill_dp: u32,
    /// The decode DP group the request is dispatched to; its pages are that group's.
    pub decode_dp: u32,
}

impl Request {
    pub fn send_len(&self) -> u32 {
        self.tokens.saturating_sub(self.decode_prefix)
    }

    /// The decode pages the KV entries land in: the host pages of a HiSparse decode, else `decode_pages`.
    pub fn decode_kv_pages(&self) -> &[u32] {
        if self.decode_host_pages.is_empty() {
            &self.decode_pages
        } else {
            &self.decode_host_pages
        }
    }
}

/// What decode ranks advertise in their registration beyond the truth of their memory (domain.md §6.2): a legacy
/// peer, a peer that sends only entry 0's item length (the PR #37358 Mori wire), or one that lies about it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Advertise {
    /// Omit PR #37358's four fields (DCP size and rank, state and KV layer ids): the prefill applies the defaults.
    pub legacy: bool,
    /// Send only `kv_item_len` (entry 0) instead of an item length per KV entry.
    pub entry0_item_len_only: bool,
    /// Advertise this `kv_item_len` instead of the true one.
    pub kv_item_len: Option<u64>,
    /// Decode ranks (stage-major index) these options apply to; `None` = every rank.
    pub ranks: Option<Vec<u32>>,
}

impl Advertise {
    /// The options in force for decode rank `index` (faithful when they do not apply to it).
    pub fn for_rank(&self, index: u32) -> Advertise {
        match &self.ranks {
            Some(ranks) if !ranks.contains(&index) => Advertise::default(),
            _ => self.clone(),
        }
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
    /// What decode ranks put in their registrations.
    pub advertise: Advertise,
    /// Prefill sends cached prefixes early (`SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX`, domain.md §7).
    pub early_send: bool,
}

impl Problem {
    /// The layout of one side.
    pub fn side(&self, side: Side) -> &SideLayout {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }
}
