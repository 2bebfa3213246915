//! Serde DTOs of the scenario YAML; the schema is documented here, once.
//!
//! Unknown fields are rejected everywhere.
//!
//! | field | type | default | meaning |
//! |---|---|---|---|
//! | `name` | string | file stem | scenario name (golden file name) |
//! | `seed` | u64 | 1 | seed of the allocators (streams `pages.prefill`, `slots.decode`, ...) |
//! | `model.preset` | string | none | `kimi-k3`, `kimi-linear`, `deepseek-v3`, `deepseek-v3.2`, `deepseek-v2-lite`, `qwen3-next`, `llama-3-8b`, `llama-3-70b`; other `model` fields override it |
//! | `model.layers` | u32 | preset | decoder layer count |
//! | `model.kv_layers` | [u32] | all layers | 0-based global ids of the full-attention layers (KV entries) |
//! | `model.kv_lora_rank`, `model.qk_rope_head_dim` | u32 | preset | MLA latent and rope widths |
//! | `model.kv_heads`, `model.head_dim` | u32 | none | MHA/GQA: total KV heads and head width (given instead of the MLA fields) |
//! | `model.dtype_bytes` | u32 | preset | bytes per KV element (2 bf16, 1 fp8) |
//! | `model.state[]` | list | preset or none | state components: `kind` (`mamba`, `swa`, `dsa`, `swa_ring`), `layers` (default: every non-KV layer), `window_pages` (swa kinds), `layer_ids` (default true; false: the pool publishes no state layer ids, as SGLang's SWA pools), `tensors` |
//! | `model.state[].tensors[]` | list | required | `name`, and either `dim` (full sliced axis), `unit_bytes`, `outer` (default 1), `groups` (full sub-block widths), or `item_len` (not sliceable) |
//! | `model.aux` | [u64] | none | bytes per row of each aux buffer |
//! | `model.draft` | `{entries, token_len}` or `{entries, heads, head_dim, dtype_bytes?}` | none | draft KV entries on the last stage: replicated rows of `token_len` bytes (MLA/MTP draft), or an MHA/GQA draft of `heads` KV heads sharded over attention TP like the target's (`max(1, heads / tp)` heads of `head_dim x dtype_bytes` per rank; `dtype_bytes` defaults to the model's) |
//! | `prefill.tp` / `decode.tp` | u32 | 1 | TP size (`--tp-size`); with `dp`, the attention TP size of each DP group is `tp / dp` |
//! | `prefill.dp` / `decode.dp` | u32 | 1 | attention DP size (`--attn-dp-size`, or `--dp` with `--enable-dp-attention`): `dp` groups of `tp / dp` attention-TP ranks, each with its own KV pool (divides tp) |
//! | `prefill.cp` | u32 | 1 | attention CP size (`--attn-cp-size`): each DP group holds `cp` CP ranks of `tp / dp / cp` attention-TP ranks, every CP rank the whole KV (decode: 1 only) |
//! | `prefill.all_cp_ranks_transfer` / `decode.all_cp_ranks_transfer` | bool | false | `SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`: every prefill CP rank sends its contiguous block of each request's pages (always on for hybrid-MLA with CP, and for a hybrid-MLA decode); otherwise CP rank 0 sends everything; both sides must agree |
//! | `prefill.pp` / `decode.pp` | u32 | 1 | PP size (decode: 1 or the prefill PP) |
//! | `prefill.dcp` / `decode.dcp` | u32 | 1 | DCP size (divides tp) |
//! | `prefill.page_size` / `decode.page_size` | u32 | required | physical page size `P` |
//! | `*.layer_ids` | bool | true | whether ranks advertise `kv_layer_ids` |
//! | `*.missing_layers` | [u32] | [] | layers whose KV entry this side does not register |
//! | `*.pool_pages` | u32 | 2 × pages needed + 1 | KV pool capacity in pages, including padding page 0 |
//! | `*.slots` | u32 | requests + 1 | Mamba slots and aux rows, including unused index 0 |
//! | `*.metadata_components` | usize | all | an older peer: per-component state metadata lists cover only this many components |
//! | `*.metadata_overrides[]` | list | [] | `{component, entry, groups?, dim?}`: advertise other conv groups or dim for one state entry |
//! | `*.state_item_lens[]` | list | [] | `{component, tensor, item_len}`: register a state tensor with another item length |
//! | `*.state_layouts[]` | list | [] | `{component, tensor, outer}`: this side holds a Mamba tensor transposed, `outer` rows before the channel axis and the same bytes per channel (`outer: 1` channel-major `[dim, taps]`, as GDN's conv; `outer: taps` window-major `[taps, dim]`, as KDA's); the decode advertises its outers (frame 19) |
//! | `*.draft_paged_physically` | bool | false | register the draft pool paged by `P` rather than `V` (version-1 layout) |
//! | `*.kv_token_len` | u64 | model | register KV token rows of this many bytes (a peer with another KV layout) |
//! | `decode.registration` | `legacy` or a mapping | faithful | what decode ranks advertise; the word `legacy` is `{legacy: true}` |
//! | `decode.registration.legacy` | bool | false | omit PR #37358's DCP size/rank and layer-id frames (prefill applies the defaults) |
//! | `decode.registration.item_lens` | `per_entry` or `entry0` | `per_entry` | advertise every KV entry's item length, or only entry 0's (the PR #37358 Mori wire) |
//! | `decode.registration.kv_item_len` | u64 | truth | advertise this entry-0 item length (a lying peer) |
//! | `decode.registration.ranks` | [u32] | all | decode ranks (stage-major index) the registration options apply to |
//! | `requests[].tokens` | u32 | required | prompt length |
//! | `requests[].decode_prefix` | u32 | 0 | tokens decode already holds |
//! | `requests[].chunks` | [u32] | one chunk | token counts of the prefill chunks over the send range |
//! | `requests[].prefill_pages` | [u32] | seeded allocator | allocator pages of the whole sequence |
//! | `requests[].decode_pages` | [u32] | seeded allocator | allocator pages of the send range |
//! | `requests[].decode_page_count` | u32 | enough | how many decode pages the allocator hands out |
//! | `decode.hisparse` | `{host_pages}` | none | `--enable-hisparse` (SGLang 0.5.23, DSA models): the decode registers its pinned-host MLA pool of `host_pages` pages as the KV destination and sends host pages as `kv_indices`; its draft stays in device memory at the logical `decode_pages` (sent as `device_kv_indices`), its DSA indexer keys at their state pages |
//! | `prefill.staging` / `decode.staging` | `{chunk_pages?}` / `{ring_bytes}` | none | `SGLANG_DISAGG_STAGING_BUFFER` on that side. Prefill: MHA/GQA KV under an attention-TP change is written into the decode's staging ring instead of its pool, one grid chunk of `chunk_pages` pages (`chunked_prefill_size / page_size`, default `8192 / page_size`) at a time; every chunk of a request but the last must be that long. Decode: a staging ring of `ring_bytes` per decode rank (`SGLANG_DISAGG_STAGING_POOL_SIZE_MB`) holding each chunk's image, which the decode scatters into its pool after the transfer |
//! | `requests[].decode_host_pages` | [u32] | FIFO from 0 | HiSparse decode: the request's host pages (page 0 is a real host page), one per decode page of the send range |
//! | `prefill.early_send` | bool | false | send each request's page-aligned cached prefix as an early chunk, unless a peer needs DCP relayout (domain.md §7) |
//! | `requests[].prefill_dp` | u32 | id mod prefill dp | the prefill DP group that computes the request (SGLang's `bootstrap_room % dp`, the room being the request's index) |
//! | `requests[].decode_dp` | u32 | id mod decode dp | the decode DP group the request is dispatched to; only its ranks receive it |
//! | `requests[].cached_prefix` | u32 | 0 | tokens of the prompt cached on the prefill device (the early chunk ends at it, rounded down to the page) |
//! | `requests[].state_pages[]` | list | window / all pages | `{component, prefill, decode}`: state page counts of a paged component |
//! | `events` | bool | false | the golden file also records the engines' events: messages by kind, and how each request ended on each decode rank |
//! | `faults` | list | none | seeded faults (`fabric::faults`): `{kind: torn_write, probability: 0.01}`; kinds `wr_error_remote_access`, `wr_error_retry_exceeded`, `torn_write`, `corrupt`, `drop_completion`, `duplicate_completion`, `drop_message`, `duplicate_message`, `crash_prefill` (a prefill rank dies before a work request, no restart), `notify_before_data` (a write completes before its bytes land); drawn from the scenario's seed; the run is then judged by the guarantee (each request Success byte-exact or Failed with a reason) |
//! | `expect` | `ok` or `{error: kind}` | required | the verdict: a clean transfer, or a planner rejection of this kind (`plan::PlanErrorKind`: `geometry_mismatch`, `too_few_pages`, ...) |
//! | `expect.text` | string | any | the rejection's exact message (domain.md's wording where it documents one) |
//! | `expect.ranks`, `expect.requests` | [u32] | all | only these decode ranks (stage-major) and requests fail, with `error`; every other request succeeds byte-exact |

use std::borrow::Cow;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::Deserialize;

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a scenario: a mapping with model, prefill, decode, requests and expect")]
pub struct RawScenario {
    pub name: Option<String>,
    pub seed: Option<u64>,
    pub model: RawModel,
    pub prefill: RawSide,
    pub decode: RawSide,
    pub requests: Vec<RawRequest>,
    pub expect: RawExpect,
    #[serde(default)]
    pub events: bool,
    #[serde(default)]
    pub faults: Vec<RawFault>,
}

/// A `--faults FILE`: the `faults:` section of a scenario on its own.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with a faults list, such as faults: [{kind: torn_write, probability: 0.01}]"
)]
pub struct RawFaultFile {
    pub faults: Vec<RawFault>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a fault rule such as {kind: torn_write, probability: 0.01}")]
pub struct RawFault {
    pub kind: String,
    pub probability: f64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a model mapping such as {preset: kimi-k3}")]
pub struct RawModel {
    pub preset: Option<String>,
    pub layers: Option<u32>,
    pub kv_layers: Option<Vec<u32>>,
    pub kv_lora_rank: Option<u32>,
    pub qk_rope_head_dim: Option<u32>,
    pub kv_heads: Option<u32>,
    pub head_dim: Option<u32>,
    pub dtype_bytes: Option<u32>,
    pub state: Option<Vec<RawComponent>>,
    pub aux: Option<Vec<u64>>,
    pub draft: Option<RawDraft>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a state component mapping such as {kind: mamba, tensors: [...]}")]
pub struct RawComponent {
    pub kind: String,
    pub layers: Option<Vec<u32>>,
    pub window_pages: Option<u32>,
    /// Whether the pool publishes the component's global layer ids (`state_layer_ids`); SGLang's SWA pools do not.
    #[serde(default = "yes")]
    pub layer_ids: bool,
    pub tensors: Vec<RawTensor>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a state tensor mapping such as {name: conv, dim: 96, unit_bytes: 2}")]
pub struct RawTensor {
    pub name: String,
    pub dim: Option<u32>,
    pub unit_bytes: Option<u64>,
    pub outer: Option<u32>,
    pub groups: Option<Vec<u32>>,
    pub item_len: Option<u64>,
}

#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "a draft mapping {entries: N, token_len: B} (replicated rows) or {entries: N, heads: H, head_dim: D} (head-sharded)"
)]
pub struct RawDraft {
    pub entries: u32,
    /// Bytes of one replicated draft token row (an MLA/MTP draft).
    pub token_len: Option<u64>,
    /// KV heads of a head-sharded (MHA/GQA) draft.
    pub heads: Option<u32>,
    pub head_dim: Option<u32>,
    /// Bytes per draft KV element (`--speculative-draft-kv-cache-dtype`); default: the model's `dtype_bytes`.
    pub dtype_bytes: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a side mapping such as {tp: 2, page_size: 64}")]
pub struct RawSide {
    #[serde(default = "one")]
    pub tp: u32,
    /// Attention DP size: `dp` groups of `tp / dp` attention-TP ranks.
    #[serde(default = "one")]
    pub dp: u32,
    /// Attention CP size (prefill): `cp` ranks of `tp / dp / cp` attention-TP ranks each, every one holding the whole
    /// KV.
    #[serde(default = "one")]
    pub cp: u32,
    /// `SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER` on this side.
    #[serde(default)]
    pub all_cp_ranks_transfer: bool,
    #[serde(default = "one")]
    pub pp: u32,
    #[serde(default = "one")]
    pub dcp: u32,
    pub page_size: u32,
    #[serde(default = "yes")]
    pub layer_ids: bool,
    #[serde(default)]
    pub missing_layers: Vec<u32>,
    pub pool_pages: Option<u32>,
    pub slots: Option<u32>,
    pub metadata_components: Option<usize>,
    #[serde(default)]
    pub metadata_overrides: Vec<RawOverride>,
    #[serde(default)]
    pub state_item_lens: Vec<RawItemLen>,
    /// Mamba tensors this side holds transposed (another conv element order than the model's).
    #[serde(default)]
    pub state_layouts: Vec<RawStateLayout>,
    #[serde(default)]
    pub draft_paged_physically: bool,
    pub kv_token_len: Option<u64>,
    pub registration: Option<RawRegistration>,
    #[serde(default)]
    pub early_send: bool,
    /// `SGLANG_PP_LAYER_PARTITION`: layers per pipeline stage.
    pub pp_layer_partition: Option<Vec<u32>>,
    /// Whether this side registers the model's draft KV entries (`false`: deployed without speculative decoding).
    #[serde(default = "yes")]
    pub draft: bool,
    /// `--enable-hisparse` (decode): the KV entries are the host pool's, addressed by host pages.
    pub hisparse: Option<RawHiSparse>,
    /// `SGLANG_DISAGG_STAGING_BUFFER` on this side: MHA/GQA KV under a TP change goes through the decode's ring.
    pub staging: Option<RawStaging>,
}

/// `prefill.staging: {chunk_pages}` / `decode.staging: {ring_bytes}`: the staging-buffer path
/// (`common/staging_buffer.py`).
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {chunk_pages: F} (prefill) or {ring_bytes: N} (decode)")]
pub struct RawStaging {
    /// Prefill: pages of one staging grid chunk, `F = chunked_prefill_size / page_size` (default `8192 / P`).
    pub chunk_pages: Option<u32>,
    /// Decode: bytes of each decode rank's staging ring (`SGLANG_DISAGG_STAGING_POOL_SIZE_MB`, in bytes here).
    pub ring_bytes: Option<u64>,
}

/// `decode.hisparse`: a HiSparse decode registers its pinned-host MLA pool as the KV destination.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {host_pages: N}")]
pub struct RawHiSparse {
    /// Pages of the host MLA pool (`MLATokenToKVPoolHost`); page 0 is a real page there.
    pub host_pages: u32,
}

/// `decode.registration`: what decode ranks advertise (domain.md §6.2); default: the truth, per-entry item lengths.
/// The word `legacy` is short for `{legacy: true}`.
#[derive(Debug, Default)]
pub struct RawRegistration {
    pub legacy: bool,
    pub item_lens: Option<String>,
    pub kv_item_len: Option<u64>,
    pub ranks: Option<Vec<u32>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "`legacy` or a mapping such as {legacy: true, item_lens: entry0, kv_item_len: 1152, ranks: [3]}"
)]
struct RawRegistrationFields {
    #[serde(default)]
    legacy: bool,
    item_lens: Option<String>,
    kv_item_len: Option<u64>,
    ranks: Option<Vec<u32>>,
}

impl<'de> Deserialize<'de> for RawRegistration {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<RawRegistration, D::Error> {
        let expecting = "`legacy` or a mapping such as {legacy: true, item_lens: entry0, ranks: [3]}";
        let word =
            |word: &str| (word == "legacy").then(|| RawRegistration { legacy: true, ..RawRegistration::default() });
        let map = |fields: RawRegistrationFields| RawRegistration {
            legacy: fields.legacy,
            item_lens: fields.item_lens,
            kv_item_len: fields.kv_item_len,
            ranks: fields.ranks,
        };
        word_or_map(deserializer, expecting, word, map)
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {component: C, tensor: T, item_len: B}")]
pub struct RawItemLen {
    pub component: u32,
    pub tensor: u32,
    pub item_len: u64,
}

/// One Mamba tensor held with `outer` rows before its channel axis on this side (the same bytes per channel as the
/// model's layout, in another element order).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {component: C, tensor: T, outer: N}")]
pub struct RawStateLayout {
    pub component: u32,
    pub tensor: u32,
    pub outer: u32,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {component: C, entry: E, groups: [...], dim: D}")]
pub struct RawOverride {
    pub component: u32,
    pub entry: u32,
    pub groups: Option<Vec<u32>>,
    pub dim: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a request mapping such as {tokens: 1000}")]
pub struct RawRequest {
    pub tokens: u32,
    #[serde(default)]
    pub decode_prefix: u32,
    pub chunks: Option<Vec<u32>>,
    pub prefill_pages: Option<Vec<u32>>,
    pub decode_pages: Option<Vec<u32>>,
    pub decode_page_count: Option<u32>,
    /// HiSparse decode: the host pages of the send range (the wire's `kv_indices`), instead of the FIFO allocator's.
    pub decode_host_pages: Option<Vec<u32>>,
    #[serde(default)]
    pub state_pages: Vec<RawStatePages>,
    #[serde(default)]
    pub cached_prefix: u32,
    /// The request's Mamba slot (`req_to_mamba_index`) on each side, instead of the seeded allocator's.
    pub slot: Option<RawSides>,
    /// The request's aux row (`metadata_buffer_index`) on each side, instead of the seeded allocator's.
    pub aux: Option<RawSides>,
    /// The prefill DP group that computes the request (default: its index mod the prefill DP size).
    pub prefill_dp: Option<u32>,
    /// The decode DP group the request is dispatched to (default: its index mod the decode DP size).
    pub decode_dp: Option<u32>,
}

/// One index per side; a side left out keeps the allocator's.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {prefill: N, decode: N} (either may be left out)")]
pub struct RawSides {
    pub prefill: Option<u32>,
    pub decode: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {component: C, prefill: N, decode: N}")]
pub struct RawStatePages {
    pub component: u32,
    pub prefill: u32,
    pub decode: u32,
}

/// The verdict: `ok` or `{error: kind, text: "message"}`.
#[derive(Debug)]
pub enum RawExpect {
    /// `expect: ok` (any other word is reported by the loader).
    Word(String),
    /// `expect: {error: kind, text: "...", ranks: [..], requests: [..]}` (the kind is checked by the loader; the
    /// text is optional; the lists narrow which rooms fail).
    Error { error: String, text: Option<String>, ranks: Option<Vec<u32>>, requests: Option<Vec<u32>> },
}

impl<'de> Deserialize<'de> for RawExpect {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<RawExpect, D::Error> {
        let expecting = "`ok` or {error: kind} such as {error: geometry_mismatch, text: \"the planner's message\"}";
        let word = |word: &str| Some(RawExpect::Word(word.to_owned()));
        let map = |error: RawError| RawExpect::Error {
            error: error.error,
            text: error.text,
            ranks: error.ranks,
            requests: error.requests,
        };
        word_or_map(deserializer, expecting, word, map)
    }
}

/// A field written either as a word or as a mapping `M` (`expect: ok`, `registration: legacy`); `word` returns
/// `None` for a word it does not know, which is reported with `expecting`.
fn word_or_map<'de, D, M, T>(
    deserializer: D,
    expecting: &'static str,
    word: impl Fn(&str) -> Option<T>,
    map: impl Fn(M) -> T,
) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    M: Deserialize<'de>,
{
    struct WordOrMap<W, F, M> {
        expecting: &'static str,
        word: W,
        map: F,
        fields: std::marker::PhantomData<M>,
    }
    impl<'de, T, W: Fn(&str) -> Option<T>, F: Fn(M) -> T, M: Deserialize<'de>> serde::de::Visitor<'de>
        for WordOrMap<W, F, M>
    {
        type Value = T;

        fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            formatter.write_str(self.expecting)
        }

        fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<T, E> {
            (self.word)(text).ok_or_else(|| E::invalid_value(serde::de::Unexpected::Str(text), &self))
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, access: A) -> Result<T, A::Error> {
            M::deserialize(serde::de::value::MapAccessDeserializer::new(access)).map(&self.map)
        }
    }
    deserializer.deserialize_any(WordOrMap { expecting, word, map, fields: std::marker::PhantomData })
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, expecting = "a mapping {error: kind, text: \"the planner's message\"}")]
struct RawError {
    error: String,
    text: Option<String>,
    ranks: Option<Vec<u32>>,
    requests: Option<Vec<u32>>,
}

impl JsonSchema for RawRegistration {
    fn schema_name() -> Cow<'static, str> {
        "Registration".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        word_or_map_schema::<RawRegistrationFields>(generator, "legacy")
    }
}

impl JsonSchema for RawExpect {
    fn schema_name() -> Cow<'static, str> {
        "Expect".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        word_or_map_schema::<RawError>(generator, "ok")
    }
}

/// The schema of a field [`word_or_map`] reads: the one word `word`, or a mapping `M`.
fn word_or_map_schema<M: JsonSchema>(generator: &mut SchemaGenerator, word: &str) -> Schema {
    let map = generator.subschema_for::<M>();
    json_schema!({ "oneOf": [{ "const": word }, map] })
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}
