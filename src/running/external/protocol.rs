//! The plan protocol's messages (version [`VERSION`], spec in `src/running/external/README.md`, JSON Schemas in
//! `src/running/external/schema/`): the query rendered from a [`SeatQuery`] and the planner's answer parsed strictly. Pure:
//! no IO. Keys are sorted (serde_json's map), so a query's text is a deterministic function of the query.

use serde_json::{json, Value};

use crate::engine::seat::{LinkQuery, SeatCopy, SeatQuery};
use crate::model::{Region, Request, StateIndices};
use crate::plan::Local;
use crate::wire::{MemoryDesc, Registration, RequestMeta};

/// The protocol version kvrelay speaks.
pub const VERSION: u64 = 1;
/// The protocol's name, in both hellos.
pub const NAME: &str = "kvrelay-plan";
/// Most copies one answer may hold (the planner's whole room, every chunk).
pub const MAX_COPIES: usize = 1 << 24;

/// Why a planner's line is not a well-formed answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("the {what} is not JSON: {reason}")]
    NotJson { what: &'static str, reason: String },
    #[error("the first line is not a {NAME} hello: {line}")]
    NotHello { line: String },
    #[error("the planner speaks version {theirs}, kvrelay speaks {VERSION}")]
    Version { theirs: String },
    #[error("expected the answer to {kind} query {id}, got: {line}")]
    WrongAnswer { kind: String, id: u64, line: String },
    #[error("`error` is not a string")]
    ErrorNotText,
    #[error("the answer has neither `copies` nor `error`")]
    NoCopies,
    #[error("the answer holds {count} copies, more than the limit of {MAX_COPIES}")]
    TooManyCopies { count: usize },
    #[error("copy {index} is not six non-negative integers: {copy}")]
    BadCopy { index: usize, copy: String },
    #[error("copy {index} names region {region}")]
    BadRegion { index: usize, region: u64 },
    #[error("copy {index} is for chunk {chunk}, but the request has {chunks} chunks")]
    BadChunk { index: usize, chunk: u64, chunks: usize },
}

error_kinds! {
    /// The kind of a [`ProtocolError`].
    pub enum ProtocolErrorKind {
        /// A line that is not JSON.
        NotJson = "not_json",
        /// A first line that is not the protocol's hello.
        NotHello = "not_hello",
        /// A planner speaking another protocol version.
        Version = "version",
        /// An answer to another query (type or id).
        WrongAnswer = "wrong_answer",
        /// An answer whose fields are missing or malformed.
        Malformed = "malformed",
        /// An answer with more copies than the limit.
        TooManyCopies = "too_many_copies",
    }
}

impl ProtocolError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> ProtocolErrorKind {
        match self {
            ProtocolError::NotJson { .. } => ProtocolErrorKind::NotJson,
            ProtocolError::NotHello { .. } => ProtocolErrorKind::NotHello,
            ProtocolError::Version { .. } => ProtocolErrorKind::Version,
            ProtocolError::WrongAnswer { .. } => ProtocolErrorKind::WrongAnswer,
            ProtocolError::TooManyCopies { .. } => ProtocolErrorKind::TooManyCopies,
            ProtocolError::ErrorNotText
            | ProtocolError::NoCopies
            | ProtocolError::BadCopy { .. }
            | ProtocolError::BadRegion { .. }
            | ProtocolError::BadChunk { .. } => ProtocolErrorKind::Malformed,
        }
    }
}

/// kvrelay's hello: the first line a planner reads.
pub fn hello() -> Value {
    json!({ "type": "hello", "protocol": NAME, "version": VERSION })
}

/// The planner's hello: its name and version, or why it is not one.
pub fn parse_hello(line: &str) -> Result<String, ProtocolError> {
    let value: Value = serde_json::from_str(line)
        .map_err(|error| ProtocolError::NotJson { what: "hello", reason: error.to_string() })?;
    if value["type"] != "hello" || value["protocol"] != NAME {
        return Err(ProtocolError::NotHello { line: clip(line) });
    }
    if value["version"] != VERSION {
        return Err(ProtocolError::Version { theirs: value["version"].to_string() });
    }
    Ok(value["planner"].as_str().unwrap_or("unnamed planner").to_owned())
}

/// The query when a decode peer registers: may this prefill rank serve it at all?
pub fn link_query(id: u64, case: &str, query: &LinkQuery<'_>) -> Value {
    head("link", id, case, query)
}

/// The query for one room and peer: what the prefill rank knows, as JSON, with the wire messages both decoded
/// and as their frames (hex), so a planner may use either.
pub fn query(id: u64, case: &str, query: &SeatQuery<'_>) -> Value {
    let link = LinkQuery { rank: query.rank, local: query.local, registration: query.registration };
    let mut value = head("plan", id, case, &link);
    value["meta"] = meta(query.meta);
    value["meta_frames"] = json!(hex_frames(&query.meta.encode()));
    value["request"] = request(query.request);
    value
}

/// The fields every query has: kind, id, case, this rank, its own side and the peer's registration.
fn head(kind: &str, id: u64, case: &str, query: &LinkQuery<'_>) -> Value {
    json!({
        "type": kind,
        "id": id,
        "case": case,
        "rank": { "dp": query.rank.dp, "cp": query.rank.cp, "pp": query.rank.pp, "tp": query.rank.tp },
        "local": local(query.local),
        "registration": registration(query.registration),
        "registration_frames": hex_frames(&query.registration.encode()),
    })
}

fn local(local: Local<'_>) -> Value {
    let model = local.model;
    let topology = local.topology;
    json!({
        "topology": {
            "tp": topology.tp,
            "dp": topology.dp,
            "cp": topology.cp,
            "all_cp_ranks_transfer": topology.all_cp,
            "pp": topology.pp,
            "dcp": topology.dcp,
            "page_size": topology.page_size,
            "staging_chunk_pages": topology.staging_chunk_pages,
        },
        "model": {
            "name": model.name,
            "layers": model.layer_count,
            "attention": format!("{:?}", model.attention),
            "kv_layers": model.kv_layers,
            "dtype_bytes": model.dtype_bytes,
            "state": model.state.iter().map(|component| json!({
                "kind": format!("{:?}", component.kind),
                "layers": component.layers,
                "tensors": component.tensors.iter()
                    .map(|tensor| json!({ "name": tensor.name, "shape": format!("{:?}", tensor.shape) }))
                    .collect::<Vec<_>>(),
                "window_pages": component.window_pages,
            })).collect::<Vec<_>>(),
            "aux_item_lens": model.aux_item_lens,
            "draft": model.draft.as_ref().map(|draft| json!({
                "entries": draft.entries,
                "token_len": draft.token_len(local.topology.tp),
                "heads": draft.sharded().map(|it| it.0),
                "head_len": draft.sharded().map(|it| it.1),
            })),
        },
        "regions": local.layout.regions.iter().map(region).collect::<Vec<_>>(),
        "stage_layers": [local.layout.stage_layers.start, local.layout.stage_layers.end],
        "advertised": advertised(local.layout),
    })
}

/// What this rank advertises of itself (its own `kv_args`): KV layer ids (`null` when it sends none) and, per state
/// component, the layer ids, sliced-axis dims, conv shard groups and outer counts, as they may differ from the
/// model's truth (an older or misconfigured rank).
fn advertised(layout: &crate::model::RankLayout) -> Value {
    let state = &layout.state;
    json!({
        "kv_layer_ids": layout.advertised_layer_ids,
        "state": (0..state.regions.len()).map(|component| json!({
            "layer_ids": state.layer_ids.get(component),
            "dims": state.dims.get(component),
            "conv_groups": state.conv_groups.get(component),
            "outer_counts": state.outer_counts.get(component),
        })).collect::<Vec<_>>(),
    })
}

fn region(region: &Region) -> Value {
    json!({
        "kind": format!("{:?}", region.kind),
        "layer": region.layer,
        "item_len": region.item_len,
        "item_count": region.item_count,
        "rows_per_item": region.rows_per_item,
    })
}

fn registration(registration: &Registration) -> Value {
    let descs = |descs: &[MemoryDesc]| {
        descs
            .iter()
            .map(|desc| json!({ "address": desc.address, "length": desc.length_bytes, "rkey": desc.rkey }))
            .collect::<Vec<_>>()
    };
    json!({
        "engine_key": registration.engine.key,
        "kv_descs": descs(&registration.kv_descs),
        "aux_descs": descs(&registration.aux_descs),
        "staging_descs": descs(&registration.staging_descs),
        "state_descs": registration.state_descs.iter().map(|list| descs(list)).collect::<Vec<_>>(),
        "attn_tp_size": registration.attn_tp_size,
        "tp_rank": registration.tp_rank,
        "kv_item_len": registration.kv_item_len,
        "kv_item_lens": registration.kv_item_lens,
        "state_item_lens": registration.state_item_lens,
        "state_dims": registration.state_dims,
        "dcp": registration.dcp.as_ref().map(|dcp| json!({
            "dcp_size": dcp.dcp_size,
            "dcp_rank": dcp.dcp_rank,
            "kv_layer_ids": dcp.kv_layer_ids,
            "state_layer_ids": dcp.state_layer_ids,
        })),
    })
}

fn meta(meta: &RequestMeta) -> Value {
    json!({
        "room": meta.room,
        "engine_key": meta.engine_key,
        "kv_indices": meta.kv_indices,
        "aux_index": meta.aux_index,
        "state_indices": meta.state_indices,
        "required_dst_info_num": meta.required_dst_info_num,
        "decode_prefix_len": meta.decode_prefix_len,
        "device_kv_indices": meta.device_kv_indices,
        "staging_offsets": meta.staging_offsets,
    })
}

fn request(request: &Request) -> Value {
    let state = |state: &StateIndices| json!({ "slot": state.slot, "aux": state.aux, "pages": state.pages });
    json!({
        "id": request.id,
        "tokens": request.tokens,
        "decode_prefix": request.decode_prefix,
        "chunks": request.chunks,
        "prefill_pages": request.prefill_pages,
        "decode_pages": request.decode_pages,
        "decode_host_pages": request.decode_host_pages,
        "prefill_state": state(&request.prefill_state),
        "decode_state": state(&request.decode_state),
        "cached_prefix": request.cached_prefix,
    })
}

fn hex_frames(frames: &[Vec<u8>]) -> Vec<String> {
    frames.iter().map(|frame| frame.iter().map(|byte| format!("{byte:02x}")).collect()).collect()
}

/// The bytes of hex frames (the inverse of the query's `*_frames`), or `None` if one is not hex.
pub fn unhex_frames(value: &Value) -> Option<Vec<Vec<u8>>> {
    let frames = value.as_array()?;
    let mut out = Vec::with_capacity(frames.len());
    for frame in frames {
        let text = frame.as_str()?;
        if text.len() % 2 != 0 {
            return None;
        }
        let bytes: Option<Vec<u8>> =
            (0..text.len()).step_by(2).map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok()).collect();
        out.push(bytes?);
    }
    Some(out)
}

/// What a planner answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A link query: the peer can be served.
    Linked,
    /// Copies per chunk.
    Copies(Vec<Vec<SeatCopy>>),
    /// The planner rejected the room, in its own words.
    Rejected(String),
}

/// Parses the answer to link query `id` strictly: `{"type":"link","id":N}` or with `"error":"..."`.
pub fn parse_link_answer(line: &str, id: u64) -> Result<Answer, ProtocolError> {
    let value = answer_to(line, "link", id)?;
    Ok(rejection(&value)?.unwrap_or(Answer::Linked))
}

/// The answer `line` to query `id` of `kind`, as JSON.
fn answer_to(line: &str, kind: &str, id: u64) -> Result<Value, ProtocolError> {
    let value: Value = serde_json::from_str(line)
        .map_err(|error| ProtocolError::NotJson { what: "answer", reason: error.to_string() })?;
    if value["type"] != kind || value["id"] != id {
        return Err(ProtocolError::WrongAnswer { kind: kind.to_owned(), id, line: clip(line) });
    }
    Ok(value)
}

/// The answer's `error`, if it has one.
fn rejection(value: &Value) -> Result<Option<Answer>, ProtocolError> {
    match value.get("error") {
        None => Ok(None),
        Some(error) => Ok(Some(Answer::Rejected(error.as_str().ok_or(ProtocolError::ErrorNotText)?.to_owned()))),
    }
}

/// Parses the answer to plan query `id` strictly: `{"type":"plan","id":N,"copies":[[chunk, source_region,
/// source_offset, target_region, target_offset, length], ...]}` or `{"type":"plan","id":N,"error":"..."}`.
pub fn parse_answer(line: &str, id: u64, chunks: usize) -> Result<Answer, ProtocolError> {
    let value = answer_to(line, "plan", id)?;
    if let Some(rejected) = rejection(&value)? {
        return Ok(rejected);
    }
    let copies = value.get("copies").and_then(Value::as_array).ok_or(ProtocolError::NoCopies)?;
    if copies.len() > MAX_COPIES {
        return Err(ProtocolError::TooManyCopies { count: copies.len() });
    }
    let mut planned = vec![Vec::new(); chunks];
    for (index, copy) in copies.iter().enumerate() {
        let fields: Option<Vec<u64>> = copy.as_array().and_then(|items| items.iter().map(Value::as_u64).collect());
        let Some([chunk, source_region, source_offset, target_region, target_offset, length]) = fields.as_deref()
        else {
            return Err(ProtocolError::BadCopy { index, copy: clip(&copy.to_string()) });
        };
        let region = |region: u64| u32::try_from(region).map_err(|_| ProtocolError::BadRegion { index, region });
        let list = planned.get_mut(*chunk as usize).ok_or(ProtocolError::BadChunk { index, chunk: *chunk, chunks })?;
        list.push(SeatCopy {
            source_region: region(*source_region)?,
            source_offset: *source_offset,
            target_region: region(*target_region)?,
            target_offset: *target_offset,
            length: *length,
        });
    }
    Ok(Answer::Copies(planned))
}

/// The planner's answer to query `id` of `kind` as a line (the inverse of [`parse_answer`] and
/// [`parse_link_answer`]).
pub fn answer_line(kind: &str, id: u64, answer: &Answer) -> String {
    let value = match answer {
        Answer::Linked => json!({ "type": kind, "id": id }),
        Answer::Rejected(error) => json!({ "type": kind, "id": id, "error": error }),
        Answer::Copies(chunks) => {
            let copies: Vec<Value> = chunks
                .iter()
                .enumerate()
                .flat_map(|(chunk, copies)| {
                    copies.iter().map(move |copy| {
                        json!([
                            chunk,
                            copy.source_region,
                            copy.source_offset,
                            copy.target_region,
                            copy.target_offset,
                            copy.length
                        ])
                    })
                })
                .collect();
            json!({ "type": "plan", "id": id, "copies": copies })
        }
    };
    value.to_string()
}

/// At most 120 characters of `text`, for error messages.
fn clip(text: &str) -> String {
    match text.char_indices().nth(120) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_owned(),
    }
}
