//! The example messages whose encodings `src/pure/wire/README.md` lists as golden vectors. The tests pin those bytes
//! and the fuzz target starts from them; keep them small and internally consistent.

use super::{DcpFields, EngineDesc, KvPoll, MemoryDesc, PrefillInfo, Registration, RequestMeta, Status};

/// The decode engine of the examples: rank 3 of a TP8/DCP8 decode side.
fn decode_engine() -> EngineDesc {
    EngineDesc { key: "io-decode-dp0-tp3".into(), gpu_id: 3, host: "10.0.0.2".into(), port: 41000, address: Vec::new() }
}

/// Decode TP8 rank 3 with DCP8 (rank 3) registering two MLA KV entries (global layers 17 and 23, the pair of
/// domain.md §4.5), one aux buffer and one Mamba-style state component with one tensor (layer 19).
pub fn registration() -> Registration {
    Registration {
        ip: "10.0.0.2".into(),
        port: 17000,
        engine: decode_engine(),
        kv_descs: vec![
            MemoryDesc { address: 0x7f00_0000_0000, length_bytes: 0x10000, rkey: 0x11 },
            MemoryDesc { address: 0x7f00_0001_0000, length_bytes: 0x10000, rkey: 0x12 },
        ],
        aux_descs: vec![MemoryDesc { address: 0x5500_0000, length_bytes: 0x1000, rkey: 0x21 }],
        state_descs: vec![vec![MemoryDesc { address: 0x7e00_0000_0000, length_bytes: 0x2000, rkey: 0x31 }]],
        gpu_id: 3,
        attn_tp_size: 8,
        tp_rank: 3,
        kv_item_len: 4096,
        state_item_lens: vec![vec![1024]],
        state_dims: vec![vec![16]],
        kv_item_lens: Vec::new(),
        state_outer_counts: Vec::new(),
        staging_descs: Vec::new(),
        dcp: Some(DcpFields { dcp_size: 8, dcp_rank: 3, state_layer_ids: vec![vec![19]], kv_layer_ids: vec![17, 23] }),
    }
}

/// A pre-PR #37358 peer (the shape of PR #37358's legacy test): TP2 rank 0, one KV entry, no aux or state, and
/// the message ends after frame 13.
pub fn legacy_registration() -> Registration {
    Registration {
        ip: "127.0.0.1".into(),
        port: 5000,
        engine: EngineDesc {
            key: "io-decode-dp0-tp0".into(),
            gpu_id: 0,
            host: "127.0.0.1".into(),
            port: 41000,
            address: Vec::new(),
        },
        kv_descs: vec![MemoryDesc { address: 0x1000, length_bytes: 0x400, rkey: 7 }],
        aux_descs: Vec::new(),
        state_descs: Vec::new(),
        gpu_id: 0,
        attn_tp_size: 2,
        tp_rank: 0,
        kv_item_len: 16,
        state_item_lens: Vec::new(),
        state_dims: Vec::new(),
        kv_item_lens: Vec::new(),
        state_outer_counts: Vec::new(),
        staging_descs: Vec::new(),
        dcp: None,
    }
}

/// Room 42 for the registration's decode rank: three pages, aux row 7, Mamba slot 2, no prefix.
pub fn request_meta() -> RequestMeta {
    RequestMeta {
        room: 42,
        ip: "10.0.0.2".into(),
        port: 17000,
        engine_key: decode_engine().key,
        kv_indices: vec![5, 6, 9],
        aux_index: Some(7),
        state_indices: vec![vec![2]],
        required_dst_info_num: 1,
        decode_prefix_len: 0,
        device_kv_indices: Vec::new(),
        staging_offsets: Vec::new(),
    }
}

/// The same room sent to a dummy prefill rank (domain.md §3.1, pure MLA with `Td < Tp`).
pub fn dummy_request_meta() -> RequestMeta {
    RequestMeta { kv_indices: Vec::new(), aux_index: None, state_indices: Vec::new(), ..request_meta() }
}

/// Prefill rank 0 reports success for room 42.
pub fn success_status() -> Status {
    Status { room: 42, status: KvPoll::Success, prefill_unique_rank: 0, reason: String::new() }
}

/// Prefill rank 5 reports room 42 failed, with domain.md §2.6's geometry error as the reason (§6.4).
pub fn failed_status() -> Status {
    Status {
        room: 42,
        status: KvPoll::Failed,
        prefill_unique_rank: 5,
        reason: "PD DCP source/destination KV geometry differs: src=[4096], dst=[2048]".into(),
    }
}

/// Prefill stage 2 of PP8 (TP1, DCP1), page size 64.
pub fn prefill_info() -> PrefillInfo {
    PrefillInfo {
        ip: "10.0.0.1".into(),
        port: 17100,
        attn_tp_size: 1,
        attn_tp_rank: 0,
        dcp_size: 1,
        dcp_rank: 0,
        pp_size: 8,
        pp_rank: 2,
        page_size: 64,
        kv_cache_dtype: "auto".into(),
        attn_dp_size: 1,
        attn_dp_rank: 0,
        attn_cp_size: 1,
        attn_cp_rank: 0,
    }
}
