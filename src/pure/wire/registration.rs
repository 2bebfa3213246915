//! `Registration`: what a decode rank sends once per connection to each target prefill rank (domain.md §6.1
//! step 3), in PR #37358's layout (§6.2): 13 fields after the guard, plus the four DCP and layer-id fields.

use super::codec::{
    ascii, field, literal, pack_int_list, pack_int_lists, text, unpack_int_list, unpack_int_lists, Field, Reader,
};
use super::desc::{
    pack_memory_desc_lists, pack_memory_descs, unpack_memory_desc_lists, unpack_memory_descs, EngineDesc, MemoryDesc,
};
use super::error::{MessageKind, WireError};
use super::GUARD;
use crate::limits::{MAX_GPU_ID, MAX_ITEM_BYTES, MAX_RANKS, MAX_TP};

/// The registration's room frame: upstream routes a message whose room is `"None"` to the register handler.
pub const REGISTRATION_ROOM: &str = "None";

const ROOM: Field = field(1, "room");
const IP: Field = field(2, "ip");
const PORT: Field = field(3, "port");
const ENGINE: Field = field(4, "engine");
const KV_DESCS: Field = field(5, "kv_descs");
const AUX_DESCS: Field = field(6, "aux_descs");
const STATE_DESCS: Field = field(7, "state_descs");
const GPU_ID: Field = field(8, "gpu_id");
const ATTN_TP_SIZE: Field = field(9, "attn_tp_size");
const TP_RANK: Field = field(10, "tp_rank");
const KV_ITEM_LEN: Field = field(11, "kv_item_len");
const STATE_ITEM_LENS: Field = field(12, "state_item_lens");
const STATE_DIMS: Field = field(13, "state_dims");
const DCP_SIZE: Field = field(14, "dcp_size");
const DCP_RANK: Field = field(15, "dcp_rank");
const STATE_LAYER_IDS: Field = field(16, "state_layer_ids");
const KV_LAYER_IDS: Field = field(17, "kv_layer_ids");
const KV_ITEM_LENS: Field = field(18, "kv_item_lens");
const STATE_OUTER_COUNTS: Field = field(19, "state_outer_counts");
const STAGING_DESCS: Field = field(20, "staging_descs");

/// Frames of a legacy (pre-PR #37358) registration: the guard and 13 fields.
pub const LEGACY_REGISTRATION_FRAMES: usize = 14;
/// Frames of a PR #37358 registration: the guard and 17 fields.
pub const REGISTRATION_FRAMES: usize = 18;
/// Frames with kvrelay's optional per-entry KV item lengths (frame 18, after PR #37358's fields).
pub const REGISTRATION_FRAMES_WITH_ITEM_LENS: usize = 19;
/// Frames with kvrelay's optional state outer counts too (frame 19, after frame 18).
pub const REGISTRATION_FRAMES_WITH_OUTER_COUNTS: usize = 20;
/// Frames with kvrelay's staging ring too (frame 20, after frames 18 and 19).
pub const REGISTRATION_FRAMES_WITH_STAGING: usize = 21;

/// A decode rank's registration with one prefill rank (domain.md §6.2, PR #37358 layout).
///
/// Field `idx k` of the §6.2 table is frame `k + 1` (frame 0 is the guard); `src/pure/wire/README.md` has the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// Frame 2: the decode rank's ip (text).
    pub ip: String,
    /// Frame 3: the decode rank's ZMQ port, 1..=65535.
    pub port: u16,
    /// Frame 4: the decode engine (kvrelay encoding, see [`EngineDesc::pack`]).
    pub engine: EngineDesc,
    /// Frame 5: one memory desc per KV entry, in wire order.
    pub kv_descs: Vec<MemoryDesc>,
    /// Frame 6: one memory desc per aux buffer.
    pub aux_descs: Vec<MemoryDesc>,
    /// Frame 7: per state component, one memory desc per tensor.
    pub state_descs: Vec<Vec<MemoryDesc>>,
    /// Frame 8: the decode GPU, at most `MAX_GPU_ID`.
    pub gpu_id: u32,
    /// Frame 9: decode attention TP size, 1..=`MAX_TP`.
    pub attn_tp_size: u32,
    /// Frame 10: the decode engine rank (`engine_rank`; domain.md §3.1 reduces it modulo `attn_tp_size`).
    pub tp_rank: u32,
    /// Frame 11: the item length of decode KV entry 0, in bytes, at most `MAX_ITEM_BYTES`.
    pub kv_item_len: u64,
    /// Frame 12: per state component, the item length of each tensor (`pack_int_lists` "I").
    pub state_item_lens: Vec<Vec<u32>>,
    /// Frame 13: per state component, the dim of each tensor (`pack_int_lists` "I").
    pub state_dims: Vec<Vec<u32>>,
    /// Frames 14-17, PR #37358's additions; `None` for a legacy registration that ends after frame 13.
    pub dcp: Option<DcpFields>,
    /// Frame 18 (kvrelay's extension, like the later Mori layout's per-entry list, §6.2): the item length of every
    /// KV entry (`u64le` concatenated); absent or empty = only `kv_item_len` is known. Sent only with frames 14-17.
    pub kv_item_lens: Vec<u64>,
    /// Frame 19 (kvrelay's extension; SGLang 0.5.23 publishes no such list): per state component, the rows before
    /// the sliced axis of each tensor (`state_slice_outer_counts`, `pack_int_lists` "I"), so that a prefill can tell
    /// a transposed conv layout from its own. Absent or empty = unknown: the prefill assumes its own layout, as
    /// SGLang does. Sent only with frame 18 (which may then be empty).
    pub state_outer_counts: Vec<Vec<u32>>,
    /// Frame 20 (kvrelay's form of SGLang's staging frames, Mooncake `[14]` base pointer and `[15]` total size,
    /// `common/staging_handler.py:581-606`): the decode's staging ring as at most one memory desc; absent or empty =
    /// no staging. Sent only with frames 18 and 19 (which may then be empty).
    pub staging_descs: Vec<MemoryDesc>,
}

/// The four fields PR #37358 appended to the registration (§6.2 idx 13-16).
///
/// Any of them may be absent (the message ends early) or empty; both mean the defaults of [`DcpFields::default`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpFields {
    /// Frame 14: decode DCP size, 1..=`MAX_TP`; absent or empty → 1.
    pub dcp_size: u32,
    /// Frame 15: decode DCP rank, below `dcp_size`; absent or empty → 0.
    pub dcp_rank: u32,
    /// Frame 16: per state component, the global layer id of each tensor (`pack_int_lists` "I"); absent → [].
    pub state_layer_ids: Vec<Vec<u32>>,
    /// Frame 17: the global layer id of each KV entry (concatenated u32le); absent or empty → [] (no ids).
    pub kv_layer_ids: Vec<u32>,
}

impl Default for DcpFields {
    /// DCP size 1, rank 0, no layer ids: what a legacy peer means (domain.md §6.2).
    fn default() -> Self {
        Self { dcp_size: 1, dcp_rank: 0, state_layer_ids: Vec::new(), kv_layer_ids: Vec::new() }
    }
}

impl Registration {
    /// True when the peer sent the legacy 13-field layout (no DCP or layer-id frames at all).
    pub fn is_legacy(&self) -> bool {
        self.dcp.is_none()
    }

    /// Decode DCP size; 1 for a legacy peer.
    pub fn dcp_size(&self) -> u32 {
        self.dcp.as_ref().map_or(1, |dcp| dcp.dcp_size)
    }

    /// Decode DCP rank; 0 for a legacy peer.
    pub fn dcp_rank(&self) -> u32 {
        self.dcp.as_ref().map_or(0, |dcp| dcp.dcp_rank)
    }

    /// The KV layer ids the peer advertises, `None` when it sends none (legacy or empty): the planner then pairs
    /// entries by position (domain.md §4.3 step 4, §4.4).
    pub fn kv_layer_ids(&self) -> Option<&[u32]> {
        self.dcp.as_ref().map(|dcp| dcp.kv_layer_ids.as_slice()).filter(|ids| !ids.is_empty())
    }

    /// The state layer ids per component; empty for a legacy peer.
    pub fn state_layer_ids(&self) -> &[Vec<u32>] {
        self.dcp.as_ref().map_or(&[], |dcp| dcp.state_layer_ids.as_slice())
    }

    /// The frames, guard first: 18 to 21, or 14 for a legacy registration.
    pub fn encode(&self) -> Vec<Vec<u8>> {
        let mut frames = vec![
            GUARD.to_vec(),
            REGISTRATION_ROOM.as_bytes().to_vec(),
            self.ip.as_bytes().to_vec(),
            ascii(self.port),
            self.engine.pack(),
            pack_memory_descs(&self.kv_descs),
            pack_memory_descs(&self.aux_descs),
            pack_memory_desc_lists(&self.state_descs),
            ascii(self.gpu_id),
            ascii(self.attn_tp_size),
            ascii(self.tp_rank),
            ascii(self.kv_item_len),
            pack_int_lists(&self.state_item_lens),
            pack_int_lists(&self.state_dims),
        ];
        if let Some(dcp) = &self.dcp {
            frames.push(ascii(dcp.dcp_size));
            frames.push(ascii(dcp.dcp_rank));
            frames.push(pack_int_lists(&dcp.state_layer_ids));
            frames.push(pack_int_list(&dcp.kv_layer_ids));
            let staging = !self.staging_descs.is_empty();
            if !self.kv_item_lens.is_empty() || !self.state_outer_counts.is_empty() || staging {
                frames.push(pack_int_list(&self.kv_item_lens));
            }
            if !self.state_outer_counts.is_empty() || staging {
                frames.push(pack_int_lists(&self.state_outer_counts));
            }
            if staging {
                frames.push(pack_memory_descs(&self.staging_descs));
            }
        }
        frames
    }

    /// Parses 14 to 21 frames; fields are checked in frame order and the first error is returned.
    pub fn decode(frames: &[Vec<u8>]) -> Result<Self, WireError> {
        let reader = Reader::new(MessageKind::Registration, frames, REGISTRATION_FRAMES_WITH_STAGING)?;
        reader.read(ROOM, |bytes| literal(bytes, REGISTRATION_ROOM))?;
        Ok(Self {
            ip: reader.read(IP, text)?,
            port: reader.int(PORT, 1..=u16::MAX.into())?,
            engine: reader.read(ENGINE, EngineDesc::unpack)?,
            kv_descs: reader.read(KV_DESCS, |bytes| unpack_memory_descs(bytes, 0))?,
            aux_descs: reader.read(AUX_DESCS, |bytes| unpack_memory_descs(bytes, 0))?,
            state_descs: reader.read(STATE_DESCS, unpack_memory_desc_lists)?,
            gpu_id: reader.int(GPU_ID, 0..=MAX_GPU_ID.into())?,
            attn_tp_size: reader.int(ATTN_TP_SIZE, 1..=MAX_TP.into())?,
            tp_rank: reader.int(TP_RANK, 0..=(MAX_RANKS - 1).into())?,
            kv_item_len: reader.int(KV_ITEM_LEN, 0..=MAX_ITEM_BYTES.into())?,
            state_item_lens: reader.read(STATE_ITEM_LENS, unpack_int_lists)?,
            state_dims: reader.read(STATE_DIMS, unpack_int_lists)?,
            dcp: decode_dcp(&reader)?,
            kv_item_lens: reader.read_or(KV_ITEM_LENS, Vec::new(), unpack_int_list)?,
            state_outer_counts: reader.read_or(STATE_OUTER_COUNTS, Vec::new(), unpack_int_lists)?,
            staging_descs: reader.read_or(STAGING_DESCS, Vec::new(), |bytes| unpack_memory_descs(bytes, 0))?,
        })
    }
}

/// Frames 14-17: `None` when the message ends after frame 13, else each field or its default.
fn decode_dcp(reader: &Reader<'_>) -> Result<Option<DcpFields>, WireError> {
    if reader.frame_count() <= LEGACY_REGISTRATION_FRAMES {
        return Ok(None);
    }
    let dcp_size: u32 = reader.int_or(DCP_SIZE, 1, 1..=MAX_TP.into())?;
    Ok(Some(DcpFields {
        dcp_size,
        dcp_rank: reader.int_or(DCP_RANK, 0, 0..=i128::from(dcp_size) - 1)?,
        state_layer_ids: reader.read_or(STATE_LAYER_IDS, Vec::new(), unpack_int_lists)?,
        kv_layer_ids: reader.read_or(KV_LAYER_IDS, Vec::new(), unpack_int_list)?,
    }))
}
