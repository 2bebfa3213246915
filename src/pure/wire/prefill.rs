//! `PrefillInfo`: what a prefill rank publishes to the bootstrap server (domain.md §6.1 step 1), as frames so
//! engines can exchange it directly.
//!
//! Upstream PUTs this as JSON over HTTP (`/route`); the frame layout is kvrelay's own, tagged so it can share a
//! socket with the registration and metadata messages without being mistaken for either.

use super::codec::{ascii, field, literal, text, Field, Reader};
use super::error::{MessageKind, WireError};
use super::GUARD;
use crate::limits::{MAX_PAGE_SIZE, MAX_PP, MAX_TP};

/// Frame 1 of a prefill info message.
pub const PREFILL_INFO_TAG: &str = "PrefillInfo";

const TAG: Field = field(1, "tag");
const IP: Field = field(2, "ip");
const PORT: Field = field(3, "port");
const ATTN_TP_SIZE: Field = field(4, "attn_tp_size");
const ATTN_TP_RANK: Field = field(5, "attn_tp_rank");
const DCP_SIZE: Field = field(6, "dcp_size");
const DCP_RANK: Field = field(7, "dcp_rank");
const PP_SIZE: Field = field(8, "pp_size");
const PP_RANK: Field = field(9, "pp_rank");
const PAGE_SIZE: Field = field(10, "page_size");
const KV_CACHE_DTYPE: Field = field(11, "kv_cache_dtype");
const ATTN_DP_SIZE: Field = field(12, "attn_dp_size");
const ATTN_DP_RANK: Field = field(13, "attn_dp_rank");
const ATTN_CP_SIZE: Field = field(14, "attn_cp_size");
const ATTN_CP_RANK: Field = field(15, "attn_cp_rank");

/// Frames of a prefill info message, the guard included.
pub const PREFILL_INFO_FRAMES: usize = 16;

/// One prefill rank's parallel layout and endpoint (domain.md §6.1 step 1). Decode validates page size, dtype and
/// the DCP gates against it (§2.5) and maps ranks with it (§3.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillInfo {
    /// Frame 2: `rank_ip` (text).
    pub ip: String,
    /// Frame 3: `rank_port`, the rank's ZMQ PULL socket, 1..=65535.
    pub port: u16,
    /// Frame 4: attention TP size, 1..=`MAX_TP`.
    pub attn_tp_size: u32,
    /// Frame 5: attention TP rank, below `attn_tp_size`.
    pub attn_tp_rank: u32,
    /// Frame 6: DCP size, 1..=`MAX_TP`.
    pub dcp_size: u32,
    /// Frame 7: DCP rank, below `dcp_size`.
    pub dcp_rank: u32,
    /// Frame 8: pipeline stages, 1..=`MAX_PP`.
    pub pp_size: u32,
    /// Frame 9: pipeline stage, below `pp_size`.
    pub pp_rank: u32,
    /// Frame 10: physical page size in tokens, 1..=`MAX_PAGE_SIZE`.
    pub page_size: u32,
    /// Frame 11: the KV cache dtype as the server argument spells it (text, e.g. `auto`, `fp8_e4m3`).
    pub kv_cache_dtype: String,
    /// Frame 12: attention DP size (`attn_dp_size` of SGLang's `/route`, `common/conn.py:1562-1633`), 1..=`MAX_TP`.
    pub attn_dp_size: u32,
    /// Frame 13: attention DP rank (the rank's DP group), below `attn_dp_size`.
    pub attn_dp_rank: u32,
    /// Frame 14: attention CP size (`attn_cp_size` of `/route`), 1..=`MAX_TP`.
    pub attn_cp_size: u32,
    /// Frame 15: attention CP rank, below `attn_cp_size`.
    pub attn_cp_rank: u32,
}

impl PrefillInfo {
    /// The 16 frames, guard first.
    pub fn encode(&self) -> Vec<Vec<u8>> {
        vec![
            GUARD.to_vec(),
            PREFILL_INFO_TAG.as_bytes().to_vec(),
            self.ip.as_bytes().to_vec(),
            ascii(self.port),
            ascii(self.attn_tp_size),
            ascii(self.attn_tp_rank),
            ascii(self.dcp_size),
            ascii(self.dcp_rank),
            ascii(self.pp_size),
            ascii(self.pp_rank),
            ascii(self.page_size),
            self.kv_cache_dtype.as_bytes().to_vec(),
            ascii(self.attn_dp_size),
            ascii(self.attn_dp_rank),
            ascii(self.attn_cp_size),
            ascii(self.attn_cp_rank),
        ]
    }

    /// Parses exactly 16 frames; fields are checked in frame order and the first error is returned.
    pub fn decode(frames: &[Vec<u8>]) -> Result<Self, WireError> {
        let reader = Reader::new(MessageKind::PrefillInfo, frames, PREFILL_INFO_FRAMES)?;
        reader.read(TAG, |bytes| literal(bytes, PREFILL_INFO_TAG))?;
        let ip = reader.read(IP, text)?;
        let port = reader.int(PORT, 1..=u16::MAX.into())?;
        let (attn_tp_size, attn_tp_rank) = size_and_rank(&reader, ATTN_TP_SIZE, ATTN_TP_RANK, MAX_TP)?;
        let (dcp_size, dcp_rank) = size_and_rank(&reader, DCP_SIZE, DCP_RANK, MAX_TP)?;
        let (pp_size, pp_rank) = size_and_rank(&reader, PP_SIZE, PP_RANK, MAX_PP)?;
        let page_size = reader.int(PAGE_SIZE, 1..=MAX_PAGE_SIZE.into())?;
        let kv_cache_dtype = reader.read(KV_CACHE_DTYPE, text)?;
        let (attn_dp_size, attn_dp_rank) = size_and_rank(&reader, ATTN_DP_SIZE, ATTN_DP_RANK, MAX_TP)?;
        let (attn_cp_size, attn_cp_rank) = size_and_rank(&reader, ATTN_CP_SIZE, ATTN_CP_RANK, MAX_TP)?;
        Ok(Self {
            ip,
            port,
            attn_tp_size,
            attn_tp_rank,
            dcp_size,
            dcp_rank,
            pp_size,
            pp_rank,
            page_size,
            kv_cache_dtype,
            attn_dp_size,
            attn_dp_rank,
            attn_cp_size,
            attn_cp_rank,
        })
    }
}

/// A size in `1..=max` and a rank below it.
fn size_and_rank(reader: &Reader<'_>, size: Field, rank: Field, max: u32) -> Result<(u32, u32), WireError> {
    let size_value: u32 = reader.int(size, 1..=max.into())?;
    let rank_value = reader.int(rank, 0..=i128::from(size_value) - 1)?;
    Ok((size_value, rank_value))
}
