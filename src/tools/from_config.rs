//! `kvrelay scenario from-config`: a scenario from a Hugging Face `config.json` and each side's SGLang server flags,
//! written as a commented scenario file. Only the geometry fields of the config are read; every value the scenario
//! takes from it is named in the file's header, and an architecture or flag kvrelay cannot express is an error
//! naming the field and the fix. No IO here: the CLI reads the files.
//!
//! Architectures: MLA (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`, which Kimi-K2 uses), MHA/GQA (`Llama`,
//! `Mistral`, `Mixtral`, `Qwen2`, `Qwen3`, `Qwen3Moe`), hybrid Gated DeltaNet (`Qwen3NextForCausalLM`), hybrid
//! KDA + MLA (`KimiLinearForCausalLM`, the Kimi-K3 family's layout) and GQA + sliding window (`Gemma2ForCausalLM`,
//! `Gemma3ForCausalLM`: the SWA layers as SGLang's SWA pool).

use std::fmt::Write as _;

use serde_json::Value;

/// Why a config or a flag set cannot be imported: the field (or flag) and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ImportError {
    pub field: String,
    pub message: String,
}

fn error(field: impl Into<String>, message: impl Into<String>) -> ImportError {
    ImportError { field: field.into(), message: message.into() }
}

/// One side's SGLang server flags, as far as they shape the KV layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    pub tp: u32,
    pub pp: u32,
    pub dcp: u32,
    pub page_size: u32,
    /// `--kv-cache-dtype` (`auto`: the config's `torch_dtype`).
    pub kv_cache_dtype: String,
    /// `--speculative-algorithm NEXTN|EAGLE`: this side registers the draft KV of the checkpoint's own
    /// multi-token-prediction layers.
    pub speculative: bool,
    /// `--dp` (data-parallel replicas or, with `--enable-dp-attention`, attention DP groups; `--attn-dp-size` the
    /// latter) and whether attention is data parallel; `tp` is then the attention TP size of one group
    /// (`tp_size / dp_size / attn_cp_size`).
    pub dp: u32,
    pub dp_attention: bool,
    /// `--attn-cp-size`: attention context-parallel ranks of each group.
    pub cp: u32,
}

/// `--tp 8 --dcp-size 8 --page-size 64 ...` of side `side` (`prefill` or `decode`): SGLang's spellings (`--tp-size`,
/// `--pp-size`, `--dcp-size`, `--page-size`, `--kv-cache-dtype`, `--speculative-algorithm`, `--flag=value` too).
/// `--enable-dp-attention --dp D` makes `tp` one DP group's attention TP; a separate draft model is refused by name;
/// any other flag is an error.
pub fn parse_flags(side: &str, text: &str) -> Result<Side, ImportError> {
    let mut parsed = Side {
        tp: 1,
        pp: 1,
        dcp: 1,
        page_size: 1,
        kv_cache_dtype: "auto".to_owned(),
        speculative: false,
        dp: 1,
        dp_attention: false,
        cp: 1,
    };
    let mut words = text.split_whitespace().flat_map(|word| match word.split_once('=') {
        Some((flag, value)) if flag.starts_with("--") => vec![flag.to_owned(), value.to_owned()],
        _ => vec![word.to_owned()],
    });
    while let Some(flag) = words.next() {
        let field = format!("--{side} {flag}");
        let mut value = || words.next().ok_or_else(|| error(&field, "needs a value"));
        let count = |value: String| {
            value
                .parse::<u32>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| error(&field, format!("{value} is not a positive count")))
        };
        match flag.as_str() {
            "--tp" | "--tp-size" | "--tensor-parallel-size" => parsed.tp = count(value()?)?,
            "--pp" | "--pp-size" | "--pipeline-parallel-size" => parsed.pp = count(value()?)?,
            "--dcp" | "--dcp-size" | "--decode-context-parallel-size" => parsed.dcp = count(value()?)?,
            "--page-size" => parsed.page_size = count(value()?)?,
            "--kv-cache-dtype" => parsed.kv_cache_dtype = value()?,
            "--enable-dp-attention" => parsed.dp_attention = true,
            "--dp" | "--dp-size" | "--data-parallel-size" => parsed.dp = count(value()?)?,
            // 0.5.23's spelling of attention DP (`arg_groups/fields/parallel.py:73-89`).
            "--attn-dp-size" => {
                parsed.dp = count(value()?)?;
                parsed.dp_attention = true;
            }
            "--attn-cp-size" => parsed.cp = count(value()?)?,
            "--speculative-algorithm" => {
                let algorithm = value()?.to_ascii_uppercase();
                // NEXTN (which SGLang runs as EAGLE) and EAGLE draft with the checkpoint's own MTP layers; EAGLE3 and
                // the others need a draft model of their own.
                if !matches!(algorithm.as_str(), "NEXTN" | "EAGLE") {
                    return Err(error(
                        &field,
                        format!(
                            "{algorithm}: kvrelay imports the draft KV of NEXTN or EAGLE (the checkpoint's own MTP \
                             layers) (fix: import without it and add model.draft by hand)"
                        ),
                    ));
                }
                parsed.speculative = true;
            }
            "--speculative-draft-model-path" | "--speculative-draft" => {
                return Err(error(
                    &field,
                    "a separate draft model's KV geometry is not in this config (fix: import without it and add \
                     model.draft {entries, token_len} from the draft model's config by hand; README, Scenarios)",
                ))
            }
            // Step counts, top-k and draft-token budgets shape compute, not where KV bytes go.
            "--speculative-num-steps"
            | "--speculative-eagle-topk"
            | "--speculative-num-draft-tokens"
            | "--speculative-accept-threshold-single"
            | "--speculative-accept-threshold-acc" => {
                value()?;
            }
            _ => {
                return Err(error(
                    &field,
                    "not a flag that shapes the KV layout (known: --tp, --pp-size, --dcp-size, --page-size, \
                     --kv-cache-dtype, --speculative-algorithm, --dp with --enable-dp-attention, --attn-dp-size, \
                     --attn-cp-size)",
                ))
            }
        }
    }
    if parsed.dp_attention {
        // SGLang: attn_tp_size = tp_size // dp_size; each DP group is an attention-TP group of its own.
        if parsed.tp % parsed.dp != 0 {
            return Err(error(
                format!("--{side} --dp"),
                format!(
                    "{} does not divide --tp {} (DP attention splits the TP ranks into --dp groups)",
                    parsed.dp, parsed.tp
                ),
            ));
        }
        parsed.tp /= parsed.dp;
    }
    if parsed.tp % parsed.cp != 0 {
        return Err(error(
            format!("--{side} --attn-cp-size"),
            format!(
                "{} does not divide the attention TP {} (attn_tp_size = tp_size // dp // cp)",
                parsed.cp, parsed.tp
            ),
        ));
    }
    parsed.tp /= parsed.cp;
    if parsed.tp % parsed.dcp != 0 {
        return Err(error(
            format!("--{side} --dcp-size"),
            format!("{} does not divide --tp {}", parsed.dcp, parsed.tp),
        ));
    }
    Ok(parsed)
}

/// The model part of a scenario, as YAML lines (two-space indented under `model:`) and header notes.
struct Model {
    lines: Vec<String>,
    notes: Vec<String>,
    /// Bytes per KV element the config's `torch_dtype` implies.
    dtype_bytes: u32,
    /// A sliding-window model's SWA layers, window (tokens), KV heads and head width: its `swa` state component
    /// depends on the sides' page size, TP and the request ([`swa_component`]).
    swa: Option<Swa>,
}

/// What a Gemma-style config says about its sliding-window layers.
struct Swa {
    layers: Vec<u32>,
    window: u64,
    kv_heads: u64,
    head_dim: u64,
}

/// A scenario file from config `config` (named `config_name` in the header), the two sides' flags and one request
/// of `tokens` tokens; `command` is the command line recorded in the header.
pub fn import(
    config_name: &str,
    config: &str,
    prefill: &Side,
    decode: &Side,
    tokens: u32,
    command: &str,
) -> Result<String, ImportError> {
    if config.len() as u64 > crate::limits::MAX_SCENARIO_BYTES * 8 {
        return Err(error(config_name, format!("{} bytes: not a config.json (at most 8 MiB)", config.len())));
    }
    let json: Value = serde_json::from_str(config).map_err(|why| error(config_name, format!("not JSON: {why}")))?;
    if !json.is_object() {
        return Err(error(config_name, "not a config.json: expected a JSON object"));
    }
    let architecture = match json.get("architectures").and_then(Value::as_array).and_then(|list| list.first()) {
        Some(Value::String(name)) => name.clone(),
        _ => {
            return Err(error(
                "architectures",
                "missing (a config.json names its architecture: [\"LlamaForCausalLM\"])",
            ))
        }
    };
    let mut model = model(&json, &architecture)?;
    let dtype = |side: &Side, name: &str| kv_dtype_bytes(&side.kv_cache_dtype, model.dtype_bytes, name);
    let (prefill_bytes, decode_bytes) = (dtype(prefill, "prefill")?, dtype(decode, "decode")?);
    if prefill_bytes != decode_bytes {
        return Err(error(
            "--kv-cache-dtype",
            format!(
                "the sides hold KV in {prefill_bytes}- and {decode_bytes}-byte elements: a scenario has one KV dtype \
                 (fix: the same --kv-cache-dtype on both sides)"
            ),
        ));
    }
    model.lines.push(format!("dtype_bytes: {prefill_bytes}"));
    let mut decode_extra = String::new();
    if let Some(swa) = &model.swa {
        let (lines, note, extra) = swa_component(swa, prefill, decode, prefill_bytes, tokens)?;
        model.lines.extend(lines);
        model.notes.push(note);
        decode_extra = extra;
    }
    let speculative = prefill.speculative || decode.speculative;
    if speculative {
        let (line, note) = draft(&json, &architecture, prefill_bytes)?;
        model.lines.push(line);
        model.notes.push(note);
    }
    if tokens == 0 {
        return Err(error("--tokens", "a request needs at least one token"));
    }
    let mut out = String::new();
    let _ = writeln!(out, "# Imported by `{command}`");
    let _ = writeln!(out, "# from {config_name} ({architecture}):");
    for note in &model.notes {
        let _ = writeln!(out, "#   {note}");
    }
    for (name, side) in [("prefill", prefill), ("decode", decode)] {
        if side.dp_attention && side.dp > 1 {
            let _ = writeln!(
                out,
                "#   {name}: DP attention, {} groups of attention TP {} (attn_tp_size = tp_size / dp_size): a request \
                 goes to group `room mod {}` (requests[].{name}_dp names another; src/pure/plan/SGLANG.md).",
                side.dp, side.tp, side.dp
            );
        } else if side.dp > 1 {
            let _ = writeln!(
                out,
                "#   {name}: --dp {} without DP attention: {} independent replicas of TP {}; this scenario is one.",
                side.dp, side.dp, side.tp
            );
        }
    }
    let _ = writeln!(
        out,
        "#   KV elements of {prefill_bytes} bytes (--kv-cache-dtype {} / {}, torch_dtype {}).",
        prefill.kv_cache_dtype,
        decode.kv_cache_dtype,
        json.get("torch_dtype").and_then(Value::as_str).unwrap_or("unset")
    );
    let _ =
        writeln!(out, "# Run it with `kvrelay run <this file>`; `kvrelay explain` names the SGLang paths it takes.");
    let _ = writeln!(out, "model:");
    for line in &model.lines {
        let _ = writeln!(out, "  {line}");
    }
    for (name, side) in [("prefill", prefill), ("decode", decode)] {
        // A side started without --speculative-algorithm registers no draft entries (`draft: false`).
        let draft = if speculative && !side.speculative { ", draft: false" } else { "" };
        let extra = if name == "decode" { decode_extra.as_str() } else { "" };
        // `tp` is SGLang's whole TP size; `dp` and `cp` split it into attention-TP groups.
        let dp = if side.dp_attention { side.dp } else { 1 };
        let groups = match (dp, side.cp) {
            (1, 1) => String::new(),
            (dp, 1) => format!(", dp: {dp}"),
            (1, cp) => format!(", cp: {cp}"),
            (dp, cp) => format!(", dp: {dp}, cp: {cp}"),
        };
        let _ = writeln!(
            out,
            "{name}: {{tp: {}{groups}, pp: {}, dcp: {}, page_size: {}{draft}{extra}}}",
            side.tp * dp * side.cp,
            side.pp,
            side.dcp,
            side.page_size
        );
    }
    let _ = writeln!(out, "requests:\n  - tokens: {tokens}\nexpect: ok");
    Ok(out)
}

/// KV heads (`num_key_value_heads`, else `num_attention_heads`) and head width (`head_dim`, else `hidden_size /
/// num_attention_heads`) of an MHA/GQA config.
fn gqa_dims(json: &Value) -> Result<(u64, u64), ImportError> {
    let heads = number(json, "num_attention_heads")?;
    let kv_heads = optional(json, "num_key_value_heads")?.unwrap_or(heads);
    let head_dim = match optional(json, "head_dim")? {
        Some(dim) => dim,
        None => number(json, "hidden_size")?.checked_div(heads).ok_or_else(|| error("num_attention_heads", "is 0"))?,
    };
    Ok((kv_heads, head_dim))
}

/// The `swa` state component of a sliding-window model, its header note, and the decode side's `state_item_lens`
/// when its SWA pages differ in length (another TP): an item is one page of one layer's K (or V) for the rank's own
/// KV heads (`page_size` x heads x head_dim x dtype, NHD; heads replicated when TP exceeds them). The window sends
/// the pages holding the request's last `window` tokens (SGLang's prefill takes `req_to_token[seq_len - window:
/// seq_len]` and pages it): for the one request of `tokens` tokens, `ceil(T / P) - floor((T - W) / P)` pages.
fn swa_component(
    swa: &Swa,
    prefill: &Side,
    decode: &Side,
    dtype_bytes: u32,
    tokens: u32,
) -> Result<(Vec<String>, String, String), ImportError> {
    if prefill.page_size != decode.page_size {
        return Err(error(
            "--page-size",
            "a sliding-window model's SWA pages are one size on both sides (fix: the same --page-size)",
        ));
    }
    let page = u64::from(prefill.page_size);
    let item = |side: &Side| {
        let heads = (swa.kv_heads / u64::from(side.tp)).max(1);
        page.checked_mul(heads)
            .and_then(|bytes| bytes.checked_mul(swa.head_dim))
            .and_then(|bytes| bytes.checked_mul(u64::from(dtype_bytes)))
            .ok_or_else(|| error("head_dim", "an SWA page of this many bytes does not fit 64 bits"))
    };
    let (prefill_item, decode_item) = (item(prefill)?, item(decode)?);
    let tokens = u64::from(tokens);
    let window_pages = tokens.div_ceil(page) - tokens.saturating_sub(swa.window) / page;
    let lines = vec![
        "state:".to_owned(),
        "  - kind: swa".to_owned(),
        "    layer_ids: false".to_owned(),
        format!("    layers: {}", list(swa.layers.iter().copied())),
        format!("    window_pages: {window_pages}"),
        "    tensors:".to_owned(),
        format!("      - {{name: k, item_len: {prefill_item}}}"),
        format!("      - {{name: v, item_len: {prefill_item}}}"),
    ];
    let note = format!(
        "SWA pool: pages of {page} tokens x {} KV head(s) x {} (prefill TP{}: {prefill_item} B per K or V page); the \
         request's last {} tokens lie in its last {window_pages} page(s).",
        (swa.kv_heads / u64::from(prefill.tp)).max(1),
        swa.head_dim,
        prefill.tp,
        swa.window.min(tokens)
    );
    let extra = if decode_item == prefill_item {
        String::new()
    } else {
        format!(
            ", state_item_lens: [{{component: 0, tensor: 0, item_len: {decode_item}}}, \
             {{component: 0, tensor: 1, item_len: {decode_item}}}]"
        )
    };
    Ok((lines, note, extra))
}

/// The `model.draft` line and header note of a checkpoint's own MTP layers under `--speculative-algorithm`: one
/// draft KV entry per `num_nextn_predict_layers`, each of the target's MLA latent row (SGLang runs NEXTN as EAGLE
/// with the checkpoint's MTP layers as the draft model, their KV in the target's layout and dtype).
fn draft(json: &Value, architecture: &str, dtype_bytes: u32) -> Result<(String, String), ImportError> {
    if !matches!(architecture, "DeepseekV2ForCausalLM" | "DeepseekV3ForCausalLM") {
        return Err(error(
            "--speculative-algorithm",
            format!(
                "{architecture} has no multi-token-prediction layers kvrelay imports (fix: import without it and add \
                 model.draft {{entries, token_len}} from the draft model's config by hand)"
            ),
        ));
    }
    let layers = optional(json, "num_nextn_predict_layers")?.unwrap_or(0);
    if layers == 0 || layers > 16 {
        return Err(error(
            "num_nextn_predict_layers",
            format!("{layers}: the checkpoint has no MTP layers to draft with (fix: import without speculative flags)"),
        ));
    }
    let row = (number(json, "kv_lora_rank")? + number(json, "qk_rope_head_dim")?) * u64::from(dtype_bytes);
    let line = format!("draft: {{entries: {layers}, token_len: {row}}}");
    let note = format!("Draft KV: {layers} MTP layer(s) (num_nextn_predict_layers) of {row} B per token.");
    Ok((line, note))
}

/// A non-negative integer field of the config (`at`: a path inside it, e.g. `linear_attn_config.num_heads`).
fn number(json: &Value, path: &str) -> Result<u64, ImportError> {
    let mut value = json;
    for key in path.split('.') {
        value = value.get(key).ok_or_else(|| error(path, "missing"))?;
    }
    let number = value.as_u64().ok_or_else(|| error(path, format!("{value} is not a non-negative integer")))?;
    if number > u64::from(u32::MAX) {
        return Err(error(path, format!("{number} is absurdly large")));
    }
    Ok(number)
}

fn optional(json: &Value, path: &str) -> Result<Option<u64>, ImportError> {
    match json.get(path) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => number(json, path).map(Some),
    }
}

fn list(values: impl IntoIterator<Item = u32>) -> String {
    let items: Vec<String> = values.into_iter().map(|value| value.to_string()).collect();
    format!("[{}]", items.join(", "))
}

fn model(json: &Value, architecture: &str) -> Result<Model, ImportError> {
    let dtype_bytes = match json.get("torch_dtype").and_then(Value::as_str) {
        Some("float32") => 4,
        Some("bfloat16" | "float16") | None => 2,
        Some(other) => return Err(error("torch_dtype", format!("{other} is not a KV dtype kvrelay knows"))),
    };
    let layers = number(json, "num_hidden_layers")? as u32;
    if layers == 0 || layers > crate::limits::MAX_LAYERS {
        return Err(error(
            "num_hidden_layers",
            format!("{layers}: kvrelay models 1..={} layers", crate::limits::MAX_LAYERS),
        ));
    }
    let mla = |notes: &mut Vec<String>| -> Result<Vec<String>, ImportError> {
        let (rank, rope) = (number(json, "kv_lora_rank")?, number(json, "qk_rope_head_dim")?);
        notes.push(format!("MLA: kv_lora_rank {rank}, qk_rope_head_dim {rope}."));
        Ok(vec![format!("kv_lora_rank: {rank}"), format!("qk_rope_head_dim: {rope}")])
    };
    let gqa = |notes: &mut Vec<String>| -> Result<Vec<String>, ImportError> {
        let (kv_heads, head_dim) = gqa_dims(json)?;
        notes.push(format!("GQA: {kv_heads} KV heads of {head_dim} (num_key_value_heads, head_dim)."));
        Ok(vec![format!("kv_heads: {kv_heads}"), format!("head_dim: {head_dim}")])
    };
    let mut notes = vec![format!("{layers} layers (num_hidden_layers).")];
    let mut swa = None;
    let mut lines = vec![format!("layers: {layers}")];
    match architecture {
        "DeepseekV2ForCausalLM" | "DeepseekV3ForCausalLM" => lines.extend(mla(&mut notes)?),
        "LlamaForCausalLM"
        | "MistralForCausalLM"
        | "MixtralForCausalLM"
        | "Qwen2ForCausalLM"
        | "Qwen3ForCausalLM"
        | "Qwen3MoeForCausalLM" => {
            // Qwen2/3 switch their window on with `use_sliding_window`; Mistral and Mixtral window whenever
            // `sliding_window` is set.
            let switched = json.get("use_sliding_window").and_then(Value::as_bool);
            let windowed =
                switched.unwrap_or(architecture.starts_with("Mistral") || architecture.starts_with("Mixtral"));
            if windowed && optional(json, "sliding_window")?.is_some() {
                return Err(error(
                    "sliding_window",
                    "windowed attention (SWA) is not imported (fix: write model.state with kind swa by hand)",
                ));
            }
            lines.extend(gqa(&mut notes)?);
        }
        "Gemma2ForCausalLM" | "Gemma3ForCausalLM" => {
            // Sliding layers: `layer_types` when the config lists them; else Gemma 3's pattern (every
            // `sliding_window_pattern`th layer global) or Gemma 2's alternation (even layers sliding).
            let (sliding, source): (Vec<u32>, &str) = match json.get("layer_types").and_then(Value::as_array) {
                Some(types) => {
                    if types.len() != layers as usize {
                        return Err(error("layer_types", format!("{} entries for {layers} layers", types.len())));
                    }
                    let kinds = types.iter().map(|kind| kind.as_str() == Some("sliding_attention"));
                    let sliding = kinds.enumerate().filter(|(_, sliding)| *sliding).map(|(layer, _)| layer as u32);
                    (sliding.collect(), "layer_types")
                }
                None if architecture == "Gemma3ForCausalLM" => {
                    let pattern = number(json, "sliding_window_pattern")? as u32;
                    if pattern == 0 {
                        return Err(error("sliding_window_pattern", "must be at least 1"));
                    }
                    let sliding = (0..layers).filter(|layer| (layer + 1) % pattern != 0);
                    (sliding.collect(), "every sliding_window_pattern-th layer global")
                }
                None => ((0..layers).filter(|layer| layer % 2 == 0).collect(), "Gemma 2: even layers sliding"),
            };
            let window = number(json, "sliding_window")?;
            if window == 0 {
                return Err(error("sliding_window", "must be at least 1 token"));
            }
            let kv: Vec<u32> = (0..layers).filter(|layer| !sliding.contains(layer)).collect();
            lines.extend(gqa(&mut notes)?);
            notes.push(format!(
                "Sliding-window attention (window {window} tokens, sliding_window) at layers {}; full attention at {} \
                 ({source}). The SWA layers' K and V pages are SGLang's SWA pool, a state component without layer \
                 ids.",
                list(sliding.iter().copied()),
                list(kv.iter().copied())
            ));
            lines.push(format!("kv_layers: {}", list(kv)));
            let (kv_heads, head_dim) = gqa_dims(json)?;
            swa = Some(Swa { layers: sliding, window, kv_heads, head_dim });
        }
        "Qwen3NextForCausalLM" => {
            let interval = number(json, "full_attention_interval")? as u32;
            if interval == 0 {
                return Err(error("full_attention_interval", "must be at least 1"));
            }
            let kv: Vec<u32> = (0..layers).filter(|layer| (layer + 1) % interval == 0).collect();
            let gdn: Vec<u32> = (0..layers).filter(|layer| (layer + 1) % interval != 0).collect();
            lines.extend(gqa(&mut notes)?);
            let (key_heads, key_dim) = (number(json, "linear_num_key_heads")?, number(json, "linear_key_head_dim")?);
            let (value_heads, value_dim) =
                (number(json, "linear_num_value_heads")?, number(json, "linear_value_head_dim")?);
            let kernel = number(json, "linear_conv_kernel_dim")?;
            let (q, v) = (key_heads * key_dim, value_heads * value_dim);
            notes.push(format!(
                "Full attention every {interval}th layer (full_attention_interval); Gated DeltaNet elsewhere: conv \
                 state [dim, K-1] of q|k|v = {q}|{q}|{v} channels (linear_num_key_heads x linear_key_head_dim, \
                 linear_num_value_heads x linear_value_head_dim) x {} bf16 (linear_conv_kernel_dim {kernel}), \
                 temporal state {value_heads} heads of {key_dim} x {value_dim} fp32.",
                kernel.saturating_sub(1)
            ));
            lines.push(format!("kv_layers: {}", list(kv)));
            lines.push("state:".to_owned());
            lines.extend([
                "  - kind: mamba".to_owned(),
                format!("    layers: {}", list(gdn)),
                "    tensors:".to_owned(),
            ]);
            lines.push(format!(
                "      - {{name: conv, dim: {}, unit_bytes: {}, groups: [{q}, {q}, {v}]}}",
                2 * q + v,
                kernel.saturating_sub(1) * 2
            ));
            lines.push(format!(
                "      - {{name: temporal, dim: {value_heads}, unit_bytes: {}}}",
                key_dim * value_dim * 4
            ));
        }
        "KimiLinearForCausalLM" => {
            lines.extend(mla(&mut notes)?);
            let config = json.get("linear_attn_config").ok_or_else(|| error("linear_attn_config", "missing"))?;
            let full = config.get("full_attn_layers").and_then(Value::as_array).ok_or_else(|| {
                error("linear_attn_config.full_attn_layers", "missing (1-based ids of the MLA layers)")
            })?;
            let mut kv = Vec::new();
            for id in full {
                let id = id.as_u64().filter(|id| (1..=u64::from(layers)).contains(id)).ok_or_else(|| {
                    error("linear_attn_config.full_attn_layers", format!("{id} is not a layer id 1..={layers}"))
                })?;
                kv.push(id as u32 - 1);
            }
            kv.sort_unstable();
            kv.dedup();
            let kda: Vec<u32> = (0..layers).filter(|layer| !kv.contains(layer)).collect();
            let heads =
                number(config, "num_heads").map_err(|e| error(format!("linear_attn_config.{}", e.field), e.message))?;
            let head_dim =
                number(config, "head_dim").map_err(|e| error(format!("linear_attn_config.{}", e.field), e.message))?;
            let kernel = number(config, "short_conv_kernel_size")
                .map_err(|e| error(format!("linear_attn_config.{}", e.field), e.message))?;
            let width = heads * head_dim;
            notes.push(format!(
                "MLA at 1-based layers {} (linear_attn_config.full_attn_layers); KDA elsewhere: conv state [K-1, dim] \
                 of q|k|v = {width} channels each (num_heads x head_dim) x {} rows bf16 (short_conv_kernel_size \
                 {kernel}), temporal state {heads} heads of {head_dim} x {head_dim} fp32.",
                list(kv.iter().map(|layer| layer + 1)),
                kernel.saturating_sub(1)
            ));
            lines.push(format!("kv_layers: {}", list(kv)));
            lines.push("state:".to_owned());
            lines.extend([
                "  - kind: mamba".to_owned(),
                format!("    layers: {}", list(kda)),
                "    tensors:".to_owned(),
            ]);
            lines.push(format!(
                "      - {{name: conv, dim: {}, unit_bytes: 2, outer: {}, groups: [{width}, {width}, {width}]}}",
                3 * width,
                kernel.saturating_sub(1)
            ));
            lines.push(format!("      - {{name: temporal, dim: {heads}, unit_bytes: {}}}", head_dim * head_dim * 4));
        }
        "DeepseekV32ForCausalLM" => return Err(error(
            "architectures",
            "DeepseekV32ForCausalLM: the DSA indexer keys are not imported yet (fix: model: {preset: deepseek-v3.2})",
        )),
        other => {
            return Err(error(
                "architectures",
                format!(
                    "{other} is not an architecture kvrelay imports (known: DeepseekV2/V3, Llama, Mistral, Mixtral, \
                     Qwen2, Qwen3, Qwen3Moe, Qwen3Next, KimiLinear, Gemma2, Gemma3 ForCausalLM) (fix: write the model \
                     section by hand: README, Scenarios)"
                ),
            ))
        }
    }
    Ok(Model { lines, notes, dtype_bytes, swa })
}

/// Bytes per KV element for `--kv-cache-dtype` `dtype` (`auto`: the config's `config_bytes`).
fn kv_dtype_bytes(dtype: &str, config_bytes: u32, side: &str) -> Result<u32, ImportError> {
    match dtype {
        "auto" => Ok(config_bytes),
        "fp8_e4m3" | "fp8_e5m2" | "fp8" | "fp8_e4m3fn" => Ok(1),
        "bf16" | "bfloat16" | "fp16" | "float16" | "half" => Ok(2),
        "fp32" | "float32" | "float" => Ok(4),
        other => Err(error(
            format!("--{side} --kv-cache-dtype"),
            format!("{other} is not a KV dtype kvrelay knows (auto, fp8_e4m3, fp8_e5m2, bf16, fp16, fp32)"),
        )),
    }
}
