//! `RequestMeta`: Mori's per-request metadata, sent by a decode rank to every target prefill rank of a request
//! (domain.md §6.1 step 4, §6.2 "Mori per-request metadata").

use super::codec::{
    ascii, field, index_list, indices, pack_int_list, pack_int_lists, text, unpack_int_list, unpack_int_lists, Field,
    Reader,
};
use super::error::{MessageKind, WireError};
use super::GUARD;
use crate::limits::MAX_RANKS;

const ROOM: Field = field(1, "room");
const IP: Field = field(2, "ip");
const PORT: Field = field(3, "port");
const ENGINE_KEY: Field = field(4, "engine_key");
const KV_INDICES: Field = field(5, "kv_indices");
const AUX_INDEX: Field = field(6, "aux_index");
const STATE_INDICES: Field = field(7, "state_indices");
const REQUIRED_DST_INFO_NUM: Field = field(8, "required_dst_info_num");
const DECODE_PREFIX_LEN: Field = field(9, "decode_prefix_len");
const DEVICE_KV_INDICES: Field = field(10, "device_kv_indices");
const STAGING_OFFSETS: Field = field(11, "staging_offsets");

/// Frames of a request metadata message, the guard included.
pub const REQUEST_META_FRAMES: usize = 10;
/// Frames of a request metadata message that carries `device_kv_indices` (a HiSparse decode with a draft).
pub const REQUEST_META_FRAMES_WITH_DEVICE_INDICES: usize = 11;
/// Frames of a request metadata message that carries staging offsets (frame 10 then present, possibly empty).
pub const REQUEST_META_FRAMES_WITH_STAGING: usize = 12;

/// Largest page, slot or aux index: the wire carries them as int32.
const MAX_INDEX: i128 = i32::MAX as i128;

/// One request's metadata for one prefill rank (domain.md §6.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMeta {
    /// Frame 1: the bootstrap room (ASCII integer).
    pub room: u64,
    /// Frame 2: the decode rank's ip (text).
    pub ip: String,
    /// Frame 3: the decode rank's ZMQ port, 1..=65535.
    pub port: u16,
    /// Frame 4: the decode engine's key (text); prefill keys `transfer_infos[room]` by it.
    pub engine_key: String,
    /// Frame 5: decode pages of the send range (`dst_kv_indices`), raw int32 little-endian, each 0..=2^31-1.
    pub kv_indices: Vec<u32>,
    /// Frame 6: the decode aux row (ASCII), 0..=2^31-1; `None` is the empty frame (upstream's -1; "-1" decodes to
    /// `None` as well).
    pub aux_index: Option<u32>,
    /// Frame 7: per state component, the decode state indices (`pack_int_lists` "i"), each 0..=2^31-1.
    pub state_indices: Vec<Vec<u32>>,
    /// Frame 8: how many decode ranks send metadata for this room to this prefill rank, 1..=`MAX_RANKS`
    /// (domain.md §3.1).
    pub required_dst_info_num: u32,
    /// Frame 9: tokens decode already holds; 0 is the empty frame ("0" decodes to 0 as well).
    pub decode_prefix_len: u32,
    /// Frame 10, sent only when non-empty: a HiSparse decode's logical pages of the send range, where its
    /// device-resident draft entries land while `kv_indices` are host pages (SGLang Mooncake's metadata `msg[9]`,
    /// `mooncake/conn.py:3281-3307`; raw int32 like frame 5).
    pub device_kv_indices: Vec<u32>,
    /// Frame 11, sent only when non-empty (kvrelay's form of SGLang's STAGING_RSP offsets,
    /// `common/staging_handler.py:893-913`): the byte offset in the decode's staging ring of each chunk's image
    /// (`u64le` concatenated).
    pub staging_offsets: Vec<u64>,
}

impl RequestMeta {
    /// A dummy target (domain.md §3.1, pure MLA with `Td < Tp`): no kv indices, no aux row and no prefix. Such a
    /// rank only reports success.
    pub fn is_dummy(&self) -> bool {
        self.kv_indices.is_empty() && self.aux_index.is_none() && self.decode_prefix_len == 0
    }

    /// The 10 frames, guard first; 11 with `device_kv_indices`, 12 with `staging_offsets`.
    pub fn encode(&self) -> Vec<Vec<u8>> {
        let mut frames = vec![
            GUARD.to_vec(),
            ascii(self.room),
            self.ip.as_bytes().to_vec(),
            ascii(self.port),
            self.engine_key.as_bytes().to_vec(),
            pack_int_list(&self.kv_indices),
            self.aux_index.map_or_else(Vec::new, ascii),
            pack_int_lists(&self.state_indices),
            ascii(self.required_dst_info_num),
            if self.decode_prefix_len == 0 { Vec::new() } else { ascii(self.decode_prefix_len) },
        ];
        if !self.device_kv_indices.is_empty() || !self.staging_offsets.is_empty() {
            frames.push(pack_int_list(&self.device_kv_indices));
        }
        if !self.staging_offsets.is_empty() {
            frames.push(pack_int_list(&self.staging_offsets));
        }
        frames
    }

    /// Parses 10 frames, or 11 with `device_kv_indices` (an empty frame 10 is none); fields are checked in frame
    /// order and the first error is returned.
    pub fn decode(frames: &[Vec<u8>]) -> Result<Self, WireError> {
        let reader = Reader::new(MessageKind::RequestMeta, frames, REQUEST_META_FRAMES_WITH_STAGING)?;
        Ok(Self {
            room: reader.int(ROOM, 0..=u64::MAX.into())?,
            ip: reader.read(IP, text)?,
            port: reader.int(PORT, 1..=u16::MAX.into())?,
            engine_key: reader.read(ENGINE_KEY, text)?,
            kv_indices: reader.read(KV_INDICES, |bytes| index_list(&unpack_int_list::<i32>(bytes)?, 0))?,
            aux_index: decode_aux_index(&reader)?,
            state_indices: reader.read(STATE_INDICES, |bytes| indices(unpack_int_lists::<i32>(bytes)?))?,
            required_dst_info_num: reader.int(REQUIRED_DST_INFO_NUM, 1..=MAX_RANKS.into())?,
            decode_prefix_len: decode_prefix_len(&reader)?,
            device_kv_indices: if reader.frame_count() > DEVICE_KV_INDICES.frame {
                reader.read(DEVICE_KV_INDICES, |bytes| index_list(&unpack_int_list::<i32>(bytes)?, 0))?
            } else {
                Vec::new()
            },
            staging_offsets: reader.read_or(STAGING_OFFSETS, Vec::new(), unpack_int_list)?,
        })
    }
}

/// Frame 6: empty → none; otherwise -1 (none) or an index.
fn decode_aux_index(reader: &Reader<'_>) -> Result<Option<u32>, WireError> {
    reader.require(AUX_INDEX)?;
    let value: i64 = reader.int_or(AUX_INDEX, -1, -1..=MAX_INDEX)?;
    Ok(u32::try_from(value).ok())
}

/// Frame 9: required to be present, empty meaning 0.
fn decode_prefix_len(reader: &Reader<'_>) -> Result<u32, WireError> {
    reader.require(DECODE_PREFIX_LEN)?;
    reader.int_or(DECODE_PREFIX_LEN, 0, 0..=u32::MAX.into())
}
