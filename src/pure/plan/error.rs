//! `PlanError`: every rejection the planner raises, worded as domain.md words it.
//!
//! Messages keep upstream's spelling (capitalised, as in domain.md) because scenarios and users match on them.

use std::fmt;

use crate::model::{LayerId, StateKind};

/// A topology, geometry or request the planner refuses; raised before any byte moves (domain.md §12.6).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// [I] a registration whose fields contradict each other (domain.md §6.2); the peer's requests fail.
    #[error("Invalid registration from decode peer: {reason}")]
    Registration { reason: String },
    /// domain.md §2.5 case 3.
    #[error("Unsupported PD DCP topology: {prefill} -> {decode}")]
    UnsupportedDcpTopology { prefill: u32, decode: u32 },
    /// domain.md §2.5 case 1.
    #[error("PD peers must connect matching DCP ranks, got prefill={prefill}, decode={decode}")]
    MismatchedDcpRanks { prefill: u32, decode: u32 },
    /// domain.md §2.5 decode-side gate.
    #[error("Page size mismatch: prefill={prefill}, decode={decode}")]
    PageSizeMismatch { prefill: u32, decode: u32 },
    /// domain.md §2.2 / §3.1: sizes that cannot be mapped onto each other.
    #[error("Unsupported PD topology: {reason}")]
    UnsupportedTopology { reason: String },
    /// domain.md §2.4 validation 1. [I] also applied without DCP, where `V = P`.
    #[error("PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size (V={virtual_page_size}), got {decode_prefix}")]
    UnalignedDecodePrefix { virtual_page_size: u32, decode_prefix: u32 },
    /// domain.md §2.4 validation 4.
    #[error("Insufficient destination DCP pages: required={required}, provided={provided}, src_page_offset={src_page_offset}, dcp_rank={dcp_rank}")]
    InsufficientDcpPages { required: u64, provided: u64, src_page_offset: u64, dcp_rank: u32 },
    /// [I] the non-DCP counterpart of §2.4 validation 4: a chunk's page slice runs past `dst_kv_indices`.
    #[error(
        "Insufficient destination pages: required={required}, provided={provided}, src_page_offset={src_page_offset}"
    )]
    InsufficientPages { required: u64, provided: u64, src_page_offset: u64 },
    /// domain.md §4.3 step 3.
    #[error("Decode peer is missing a transfer entry for model layer {layer}")]
    MissingLayer { layer: LayerId },
    /// domain.md §4.3 step 2 (no positional fallback).
    #[error("Layer metadata must be provided by both PD peers or neither")]
    OneSidedLayerMetadata,
    /// domain.md §4.3 step 3 (id list length differs from the entry count).
    #[error("Layer metadata length must match transfer entries: src ids={source_ids} entries={source_entries}, dst ids={target_ids} entries={target_entries}")]
    LayerMetadataLength { source_ids: usize, source_entries: usize, target_ids: usize, target_entries: usize },
    /// domain.md §4.3 step 4.
    #[error("PP-heterogeneous transfer requires layer ids on both peers; got src={prefill} dst={decode} entries")]
    PositionalPairing { prefill: usize, decode: usize },
    /// domain.md §2.6 version 1 (per paired entry).
    #[error("PD DCP source/destination KV geometry differs: src=[{}], dst=[{}]", RunLengths(.prefill), RunLengths(.decode))]
    DcpGeometry { prefill: Vec<u64>, decode: Vec<u64> },
    /// domain.md §2.6 version 2: per entry, targets equal, drafts `c` times larger on decode.
    #[error("PD DCP source/destination KV geometry differs at entry {entry}: src={prefill}, dst={decode}, expected dst={expected}")]
    DcpGeometryAt { entry: usize, prefill: u64, decode: u64, expected: u64 },
    /// [I] replicated latent copied page for page needs equal item lengths (domain.md §3.3).
    #[error("KV item length mismatch for model layer {layer}: src={prefill}, dst={decode}")]
    ItemLength { layer: LayerId, prefill: u64, decode: u64 },
    /// domain.md §2.5 decode-side gate.
    #[error("PD decode DCP requires an MLA or hybrid-MLA KV pool.")]
    DcpNeedsMla,
    /// SGLang 0.5.23 decode-side gate (`common/conn.py:1416-1420`): a DCP decode relays out tokens of one prefill
    /// rank's whole KV, which prefill CP splits between its CP ranks.
    #[error("PD decode DCP currently requires prefill attention CP=1, got {cp}.")]
    DcpNeedsPrefillCp1 { cp: u32 },
    /// domain.md §3.4: non-MLA paged state other than SWA under a TP change (SGLang 0.5.23 `mooncake/conn.py:2089-2092`
    /// names the kind in upper case).
    #[error("PD Disaggregation does NOT support PD different TP sizes for non-MLA {} hybrid models yet.", kind.name().to_uppercase())]
    PagedStateTpMismatch { kind: StateKind },
    /// SWA head slicing with prefill PP > 1 (SGLang 0.5.23 `common/conn.py:1764-1768`): SWA entries carry no layer
    /// ids and every stage's pool starts at layer 0.
    #[error("PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid models with pipeline parallelism yet.")]
    SwaSliceUnderPp,
    /// SWA head slicing: a page item that is not `page_size` tokens of whole heads on both sides (SGLang 0.5.23
    /// `common/conn.py:1820-1830`).
    #[error("KV item lengths (prefill={prefill}, decode={decode}) do not split into {prefill_heads} and {decode_heads} heads of {total_heads} total with page_size={page_size}")]
    SwaHeadSplit { prefill: u64, decode: u64, prefill_heads: u32, decode_heads: u32, total_heads: u32, page_size: u32 },
    /// [I] paged state is not token-sharded; relaying it into a DCP decode is not modelled (dsa_dcp.py aside).
    #[error("PD DCP relayout does not support paged state component {kind}")]
    PagedStateUnderDcp { kind: StateKind },
    /// domain.md §3.2 sanity check.
    #[error("Slice size exceeds destination token capacity (slice={slice}, dst_token_len={target_token_len})")]
    SliceTooLarge { slice: u64, target_token_len: u64 },
    /// domain.md §3.4 / §5.5, same TP.
    #[error("Prefill/Decode Mamba slot size mismatch (src={prefill}, dst={decode})")]
    MambaSlotSize { prefill: u64, decode: u64 },
    /// domain.md §3.4, dims missing and item lengths differ.
    #[error("Mamba state layouts differ between prefill and decode (src item {prefill}, dst item {decode}) and no slice dims were advertised")]
    MambaLayouts { prefill: u64, decode: u64 },
    /// SGLang 0.5.23 `disaggregation/utils.py:1000-1003`: one side advertises a replicated tensor (dim 0), the other
    /// a sliced one.
    #[error("Mamba state replication metadata differs between prefill and decode for component {component} entry {entry} (src dim={prefill}, dst dim={decode}; 0 = replicated)")]
    ReplicationMetadata { component: usize, entry: usize, prefill: u32, decode: u32 },
    /// SGLang 0.5.23 `disaggregation/utils.py:1004-1010`: a replicated tensor is copied whole, so both slots agree.
    #[error("Replicated Mamba state item lengths differ (src={prefill}, dst={decode})")]
    ReplicatedItemLength { prefill: u64, decode: u64 },
    /// [I] out-of-range or inconsistent per-entry state metadata; never an index panic (domain.md §5.5, §12.5).
    #[error("invalid state metadata for component {component} entry {entry}: {reason}")]
    StateMetadata { component: usize, entry: usize, reason: String },
    /// [I] paged state copies whole items, so both sides' items must agree (domain.md §8, "checked equal").
    #[error("{kind} state item length mismatch for model layer {layer}: src={prefill}, dst={decode}")]
    StateItemLength { kind: StateKind, layer: LayerId, prefill: u64, decode: u64 },
    /// domain.md §8 step 2.
    #[error("No overlapping state indices for state_type={kind}")]
    NoOverlappingState { kind: StateKind },
    /// domain.md §8 step 2, position-indexed kinds.
    #[error("{kind} state index length mismatch: src={prefill}, dst={decode}")]
    StateIndexLength { kind: StateKind, prefill: usize, decode: usize },
    /// [I] aux buffers pair positionally and must have equal rows (domain.md §1.6).
    #[error("aux buffers differ: src={prefill:?}, dst={decode:?}")]
    AuxGeometry { prefill: Vec<u64>, decode: Vec<u64> },
    /// [I] the decode's staging ring has no room where the prefill must write a chunk's image (SGLang's
    /// `ALLOC_OVERSIZED`, `common/staging_buffer.py:300-319`, or offsets that do not fit the image).
    #[error("staging: {reason}")]
    StagingSpace { reason: String },
    /// [I] both sides must register the same state components in the same order.
    #[error("state components differ: src={prefill:?}, dst={decode:?}")]
    StateComponents { prefill: Vec<StateKind>, decode: Vec<StateKind> },
}

error_kinds! {
    /// The family of a [`PlanError`]: what scenarios (`expect: {error: KIND}`) and tests match on.
    pub enum PlanErrorKind {
        /// A decode peer's registration contradicts itself.
        InvalidRegistration = "invalid_registration",
        /// TP/PP/DCP sizes or ranks that cannot be mapped onto each other.
        RankMapping = "rank_mapping",
        /// A DCP setup the transfer does not support (topology, non-MLA pool, paged state).
        DcpUnsupported = "dcp_unsupported",
        /// Prefill and decode page sizes differ where they must agree.
        PageSizeMismatch = "page_size_mismatch",
        /// `decode_prefix_len` is not aligned to the (virtual) page size.
        UnalignedPrefix = "unaligned_prefix",
        /// The decode side provided fewer destination pages than a chunk needs.
        TooFewPages = "too_few_pages",
        /// The decode peer registers no entry for a model layer.
        MissingLayer = "missing_layer",
        /// Layer id metadata that is one-sided, of the wrong length, or missing where pairing needs it.
        LayerMetadata = "layer_metadata",
        /// KV or aux item geometry differs between the peers.
        GeometryMismatch = "geometry_mismatch",
        /// Different TP sizes for a hybrid model that needs them equal.
        TpMismatch = "tp_mismatch",
        /// A head slice larger than the destination token capacity.
        SliceTooLarge = "slice_too_large",
        /// State components, slots or items whose layouts differ between the peers.
        StateLayout = "state_layout",
        /// Per-entry state metadata out of range or inconsistent.
        StateMetadata = "state_metadata",
        /// State index lists that do not overlap or differ in length.
        StateIndices = "state_indices",
    }
}

impl PlanError {
    /// The rejection's family (stable across rewording).
    pub fn kind(&self) -> PlanErrorKind {
        use PlanErrorKind as K;
        match self {
            PlanError::Registration { .. } => K::InvalidRegistration,
            PlanError::UnsupportedTopology { .. } | PlanError::MismatchedDcpRanks { .. } => K::RankMapping,
            PlanError::UnsupportedDcpTopology { .. }
            | PlanError::DcpNeedsMla
            | PlanError::DcpNeedsPrefillCp1 { .. }
            | PlanError::PagedStateUnderDcp { .. } => K::DcpUnsupported,
            PlanError::PageSizeMismatch { .. } => K::PageSizeMismatch,
            PlanError::UnalignedDecodePrefix { .. } => K::UnalignedPrefix,
            PlanError::InsufficientDcpPages { .. }
            | PlanError::InsufficientPages { .. }
            | PlanError::StagingSpace { .. } => K::TooFewPages,
            PlanError::MissingLayer { .. } => K::MissingLayer,
            PlanError::OneSidedLayerMetadata
            | PlanError::LayerMetadataLength { .. }
            | PlanError::PositionalPairing { .. } => K::LayerMetadata,
            PlanError::DcpGeometry { .. }
            | PlanError::DcpGeometryAt { .. }
            | PlanError::ItemLength { .. }
            | PlanError::AuxGeometry { .. } => K::GeometryMismatch,
            PlanError::PagedStateTpMismatch { .. } | PlanError::SwaSliceUnderPp => K::TpMismatch,
            PlanError::SwaHeadSplit { .. } => K::StateLayout,
            PlanError::SliceTooLarge { .. } => K::SliceTooLarge,
            PlanError::MambaSlotSize { .. }
            | PlanError::MambaLayouts { .. }
            | PlanError::StateItemLength { .. }
            | PlanError::ReplicatedItemLength { .. }
            | PlanError::StateComponents { .. } => K::StateLayout,
            PlanError::StateMetadata { .. } | PlanError::ReplicationMetadata { .. } => K::StateMetadata,
            PlanError::NoOverlappingState { .. } | PlanError::StateIndexLength { .. } => K::StateIndices,
        }
    }
}

/// Renders `[576, 576, 256]` as `576 x2, 256` like domain.md's geometry message.
struct RunLengths<'a>(&'a [u64]);

impl fmt::Display for RunLengths<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut index = 0;
        while index < self.0.len() {
            let value = self.0[index];
            let count = self.0[index..].iter().take_while(|it| **it == value).count();
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            if count == 1 {
                write!(f, "{value}")?;
            } else {
                write!(f, "{value} x{count}")?;
            }
            index += count;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// domain.md §2.6: the K3 DSPARK failure message, run-length encoded as upstream prints it.
    #[test]
    fn kind_names_round_trip() {
        for kind in PlanErrorKind::ALL {
            assert_eq!(PlanErrorKind::parse(kind.name()), Some(*kind));
        }
        assert_eq!(PlanErrorKind::parse("no_such_kind"), None);
        assert!(PlanErrorKind::names().contains("geometry_mismatch"));
    }

    #[test]
    fn geometry_message_run_length_encodes_item_lengths() {
        let error =
            PlanError::DcpGeometry { prefill: [vec![1152; 24], vec![256; 10]].concat(), decode: vec![1152; 34] };
        assert_eq!(
            error.to_string(),
            "PD DCP source/destination KV geometry differs: src=[1152 x24, 256 x10], dst=[1152 x34]"
        );
    }
}
