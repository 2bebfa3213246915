//! Every size, count and depth limit kvrelay enforces, in one place (README.md "Limits" lists them).
//!
//! The loader checks each one before it allocates the table the limit guards, and names the field, the value, the
//! limit and the fix when it refuses. Within these limits every byte size and offset the model, planner, fabric and
//! oracle compute fits in a `u64` (items are at most [`MAX_ITEM_BYTES`], pools at most [`MAX_POOL_ITEMS`] items), so
//! their arithmetic cannot overflow. Real deployments sit far below every limit (Kimi-K3: 93 layers, TP 8, PP 8).

/// Largest scenario file read, in bytes; a larger file is refused before it is read.
pub const MAX_SCENARIO_BYTES: u64 = 1 << 20;
/// Deepest nesting of YAML collections (block or flow); scenarios need about 6.
pub const MAX_NESTING: usize = 32;
/// Most YAML values a file may expand to, counting every alias as the nodes it repeats.
pub const MAX_YAML_VALUES: u64 = 1 << 20;
/// Diagnostics reported per file; the rest are counted.
pub const MAX_DIAGNOSTICS: usize = 20;
/// Longest user string echoed in a message (keys, names, verdicts); longer ones are cut.
pub const MAX_ECHO_CHARS: usize = 60;

/// Attention TP size of one side.
pub const MAX_TP: u32 = 1024;
/// Pipeline stages of one side.
pub const MAX_PP: u32 = 256;
/// Ranks of one side (`tp * pp`).
pub const MAX_RANKS: u32 = 4096;
/// Decoder layers of a model.
pub const MAX_LAYERS: u32 = 4096;
/// Physical page size `P`, in tokens.
pub const MAX_PAGE_SIZE: u32 = 1 << 16;
/// KV heads of an MHA/GQA model.
pub const MAX_KV_HEADS: u32 = 1 << 16;
/// Element counts of one row: `head_dim`, `kv_lora_rank`, `qk_rope_head_dim`, state `dim` and `outer`.
pub const MAX_WIDTH: u32 = 1 << 24;
/// Bytes per element (`dtype_bytes`).
pub const MAX_DTYPE_BYTES: u32 = 64;
/// Draft KV entries.
pub const MAX_DRAFT_ENTRIES: u32 = 64;
/// State components of a model, tensors per component, conv sub-blocks per tensor and aux buffers.
pub const MAX_COMPONENTS: usize = 16;
pub const MAX_TENSORS: usize = 16;
pub const MAX_GROUPS: usize = 64;
pub const MAX_AUX_BUFFERS: usize = 64;
/// Bytes of one item: a page of one layer, a state slot or page, an aux row.
pub const MAX_ITEM_BYTES: u64 = 1 << 32;
/// Registered regions over both sides (one per rank, layer and tensor).
pub const MAX_REGIONS: u64 = 1 << 20;

/// Requests of a scenario.
pub const MAX_REQUESTS: usize = 4096;
/// Prefill chunks over all requests.
pub const MAX_CHUNKS: u64 = 1 << 20;
/// Items of one pool (KV pages, state pages, Mamba slots, aux rows), and pages over all requests of one side.
pub const MAX_POOL_ITEMS: u64 = 1 << 24;

/// Default share of the machine's available memory a run may register as simulated memory.
pub const DEFAULT_MEMORY_SHARE: (u64, u64) = (1, 2);
/// Share of the available memory `kvrelay replay` may fill with decode bytes: its waves' footprint is measured (the
/// chunks a one-request probe materialises), not bounded from registered pools, so it may go closer to the limit.
pub const REPLAY_MEMORY_SHARE: (u64, u64) = (3, 4);
/// Simulated-memory budget when the machine's available memory cannot be read.
pub const FALLBACK_MEMORY_BUDGET: u64 = 4 << 30;
/// Environment variable that overrides the simulated-memory budget (bytes).
pub const MEMORY_BUDGET_ENV: &str = "KVRELAY_MAX_FABRIC_BYTES";

/// Bytes of one wire frame (domain.md §6.2, `src/pure/wire/README.md`); a larger frame is refused before it is parsed.
pub const MAX_FRAME_BYTES: u64 = 1 << 26;
/// Items of one list inside a frame (page or slot indices, layer ids, memory descs): as many as a pool has items.
pub const MAX_LIST_ITEMS: u64 = MAX_POOL_ITEMS;
/// Lists in one `pack_int_lists` frame (one per state component; models have at most [`MAX_COMPONENTS`]).
pub const MAX_PACKED_LISTS: u64 = 1024;
/// Bytes of an ASCII text field of a message (ip, engine key, kv-cache dtype); a DNS name has at most 253.
pub const MAX_TEXT_BYTES: usize = 255;
/// Bytes of a status message's failure reason (UTF-8).
pub const MAX_REASON_BYTES: usize = 1 << 16;
/// Bytes of an ASCII integer frame: a `u64` has 20 digits; a sign and leading zeros may use the rest.
pub const MAX_INT_TEXT_BYTES: usize = 32;
/// Largest peer address (the transfer engine's opaque address in an engine descriptor or a link answer): 1 MiB, room
/// for a NIXL agent's metadata.
pub const MAX_PEER_ADDRESS_BYTES: usize = 1 << 20;
/// Largest GPU id a registration or engine descriptor names.
pub const MAX_GPU_ID: u32 = 1023;
/// Candidate runs of one `kvrelay shrink` by default (`--max-runs`); a shrink stopped by it says so.
pub const SHRINK_MAX_RUNS: usize = 500;
