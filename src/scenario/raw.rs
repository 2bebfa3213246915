//! Serde DTOs of the scenario YAML; the schema is documented here, once.
//!
//! Unknown fields are rejected everywhere.
//!
//! | field | type | default | meaning |
//! |---|---|---|---|
//! | `name` | string | file stem | scenario name (golden file name) |
//! | `seed` | u64 | 1 | seed of the page allocator (streams `pages.prefill`, `pages.decode`) |
//! | `model.preset` | string | none | `kimi-k3`, `kimi-linear`, `deepseek-v3`, `deepseek-v2-lite`; other `model` fields override it |
//! | `model.layers` | u32 | preset | decoder layer count |
//! | `model.mla_layers` | [u32] | all layers | 0-based global ids of the layers with an MLA KV entry |
//! | `model.kv_lora_rank` | u32 | preset | latent width |
//! | `model.qk_rope_head_dim` | u32 | preset | rope width |
//! | `model.dtype_bytes` | u32 | preset | bytes per element (2 bf16, 1 fp8) |
//! | `prefill.tp` / `decode.tp` | u32 | 1 | attention TP size |
//! | `prefill.pp` / `decode.pp` | u32 | 1 | PP size (decode: 1 or the prefill PP) |
//! | `prefill.dcp` / `decode.dcp` | u32 | 1 | DCP size (divides tp) |
//! | `prefill.page_size` / `decode.page_size` | u32 | required | physical page size `P` |
//! | `*.layer_ids` | bool | true | whether ranks advertise `kv_layer_ids` |
//! | `*.missing_layers` | [u32] | [] | layers whose KV entry this side does not register |
//! | `*.pool_pages` | u32 | 2 × pages needed + 1 | pool capacity in pages, including padding page 0 |
//! | `requests[].tokens` | u32 | required | prompt length |
//! | `requests[].decode_prefix` | u32 | 0 | tokens decode already holds |
//! | `requests[].chunks` | [u32] | one chunk | token counts of the prefill chunks over the send range |
//! | `requests[].prefill_pages` | [u32] | seeded allocator | allocator pages of the whole sequence |
//! | `requests[].decode_pages` | [u32] | seeded allocator | allocator pages of the send range |
//! | `requests[].decode_page_count` | u32 | enough | how many decode pages the allocator hands out |
//! | `expect` | `ok` or `{error: msg}` | required | the verdict: a clean transfer, or this exact planner error |

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawScenario {
    pub name: Option<String>,
    pub seed: Option<u64>,
    pub model: RawModel,
    pub prefill: RawSide,
    pub decode: RawSide,
    pub requests: Vec<RawRequest>,
    pub expect: RawExpect,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    pub preset: Option<String>,
    pub layers: Option<u32>,
    pub mla_layers: Option<Vec<u32>>,
    pub kv_lora_rank: Option<u32>,
    pub qk_rope_head_dim: Option<u32>,
    pub dtype_bytes: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSide {
    #[serde(default = "one")]
    pub tp: u32,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRequest {
    pub tokens: u32,
    #[serde(default)]
    pub decode_prefix: u32,
    pub chunks: Option<Vec<u32>>,
    pub prefill_pages: Option<Vec<u32>>,
    pub decode_pages: Option<Vec<u32>>,
    pub decode_page_count: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawExpect {
    /// `expect: ok`.
    Word(String),
    /// `expect: {error: "..."}`.
    Error { error: String },
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}
