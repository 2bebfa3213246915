//! `kvrelay scenario from-config`: real models' config.json (tests/configs/, their geometry fields) and SGLang
//! server flags imported as scenarios that lower to exactly kvrelay's preset of the same model and run clean; what
//! cannot be imported is an error naming the field and the fix.

use std::path::Path;

use kvrelay::from_config::{import, parse_flags};
use kvrelay::harness;
use kvrelay::scenario;

use crate::support::{kvrelay, text};

fn config(file: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/configs").join(file)).unwrap()
}

fn imported(file: &str, prefill: &str, decode: &str) -> String {
    let (prefill, decode) = (parse_flags("prefill", prefill).unwrap(), parse_flags("decode", decode).unwrap());
    import(file, &config(file), &prefill, &decode, 256, "test").unwrap_or_else(|error| panic!("{file}: {error}"))
}

#[rstest::rstest]
#[case::deepseek_v3("deepseek-v3.json", "deepseek-v3", "--tp 2", "--tp 4")]
#[case::llama_3_8b("llama-3-8b.json", "llama-3-8b", "--tp 8 --page-size 16", "--tp 2 --page-size 16")]
#[case::llama_3_70b("llama-3-70b.json", "llama-3-70b", "--tp-size=4", "--tp 8")]
#[case::qwen3_next("qwen3-next-80b-a3b.json", "qwen3-next", "--tp 1", "--tp 4")]
#[case::kimi_linear("kimi-linear-48b-a3b.json", "kimi-linear", "--tp 4 --page-size 16", "--tp 2 --page-size 16")]
fn a_real_config_imports_as_its_preset_and_runs_clean(
    #[case] file: &str,
    #[case] preset: &str,
    #[case] prefill: &str,
    #[case] decode: &str,
) {
    let text = imported(file, prefill, decode);
    let scenario = scenario::parse(&text, file, "imported").unwrap_or_else(|error| panic!("{error}\n{text}"));
    // The same scenario with the preset's model section instead.
    let model_start = text.find("model:\n").unwrap();
    let model_end = text.find("prefill:").unwrap();
    let with_preset = format!("{}model: {{preset: {preset}}}\n{}", &text[..model_start], &text[model_end..]);
    let reference = scenario::parse(&with_preset, preset, "preset").unwrap();
    let (mut got, want) = (scenario.problem.model.clone(), reference.problem.model.clone());
    got.name.clone_from(&want.name);
    assert_eq!(got, want, "{file} imported as another model than the {preset} preset:\n{text}");
    let outcome = harness::run(&scenario).expect("runs");
    assert!(outcome.passed(), "{file}: {}", outcome.failure_text("; "));
}

#[rstest::rstest]
#[case::unknown_architecture(
    r#"{"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 12}"#,
    "",
    "architectures: GPT2LMHeadModel is not an architecture kvrelay imports"
)]
#[case::missing_field(
    r#"{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "kv_lora_rank": 512}"#,
    "",
    "qk_rope_head_dim: missing"
)]
#[case::not_json("{", "", "not JSON")]
#[case::no_architectures(r#"{"num_hidden_layers": 2}"#, "", "architectures: missing")]
#[case::negative(
    r#"{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": -1}"#,
    "",
    "num_hidden_layers: -1 is not a non-negative integer"
)]
#[case::qwen_window(r#"{"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024, "use_sliding_window": true, "sliding_window": 4096}"#, "", "sliding_window: windowed attention (SWA) is not imported")]
#[case::mistral_window(r#"{"architectures": ["MistralForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024, "sliding_window": 4096}"#, "", "sliding_window: windowed attention")]
#[case::dsa(
    r#"{"architectures": ["DeepseekV32ForCausalLM"], "num_hidden_layers": 61}"#,
    "",
    "fix: model: {preset: deepseek-v3.2}"
)]
#[case::no_mtp_layers(
    r#"{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64}"#,
    "--speculative-algorithm NEXTN",
    "num_nextn_predict_layers: 0: the checkpoint has no MTP layers"
)]
#[case::gqa_draft(
    r#"{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024}"#,
    "--speculative-algorithm EAGLE",
    "LlamaForCausalLM has no multi-token-prediction layers"
)]
#[case::dtypes_differ(
    r#"{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024}"#,
    "--kv-cache-dtype fp8_e4m3",
    "the sides hold KV in 1- and 2-byte elements"
)]
fn a_config_that_cannot_be_imported_is_refused_by_field(
    #[case] json: &str,
    #[case] prefill: &str,
    #[case] words: &str,
) {
    let (prefill, decode) = (parse_flags("prefill", prefill).unwrap(), parse_flags("decode", "").unwrap());
    let error = import("c.json", json, &prefill, &decode, 16, "test").expect_err("refused");
    assert!(error.to_string().contains(words), "{error}");
}

#[rstest::rstest]
#[case::dp_not_dividing("--tp 8 --enable-dp-attention --dp 3", "--prefill --dp: 3 does not divide --tp 8")]
#[case::draft_model("--speculative-algorithm EAGLE --speculative-draft-model-path x", "a separate draft model")]
#[case::unknown_algorithm("--speculative-algorithm LOOKAHEAD", "LOOKAHEAD: kvrelay imports the draft KV of")]
#[case::unknown("--mem-fraction-static 0.8", "not a flag that shapes the KV layout")]
#[case::no_value("--tp", "--prefill --tp: needs a value")]
#[case::dcp_not_dividing("--tp 6 --dcp-size 4", "4 does not divide --tp 6")]
fn server_flags_kvrelay_cannot_express_are_refused_by_name(#[case] flags: &str, #[case] words: &str) {
    let error = parse_flags("prefill", flags).expect_err("refused");
    assert!(error.to_string().contains(words), "{error}");
}

#[test]
fn from_config_writes_a_file_that_run_passes() {
    let out = std::env::temp_dir().join(format!("kvrelay-imported-{}.yaml", std::process::id()));
    let out_text = out.display().to_string();
    let written = kvrelay(&[
        "scenario",
        "from-config",
        "tests/configs/deepseek-v3.json",
        "--prefill",
        "--tp 1 --pp-size 2 --page-size 64",
        "--decode",
        "--tp 2 --dcp-size 2 --page-size 64",
        "--tokens",
        "300",
        "--out",
        &out_text,
    ]);
    assert!(written.status.success(), "{}", text(&written.stderr));
    let file = std::fs::read_to_string(&out).unwrap();
    assert!(file.starts_with("# Imported by `kvrelay scenario from-config deepseek-v3.json"), "{file}");
    let run = kvrelay(&["run", &out_text]);
    let _ = std::fs::remove_file(&out);
    assert!(run.status.success(), "{}{}", text(&run.stdout), text(&run.stderr));
    assert!(text(&run.stdout).contains("verdict: pass"), "{}", text(&run.stdout));
}

/// `--speculative-algorithm NEXTN` on both sides, or on the decode only: DeepSeek-V3's MTP layer
/// (`num_nextn_predict_layers`: 1) becomes one draft entry of its latent row, and the run passes byte-exact.
#[rstest::rstest]
#[case::both(
    "--tp 2 --speculative-algorithm NEXTN --speculative-num-steps 3",
    "--tp 4 --speculative-algorithm NEXTN",
    ""
)]
#[case::decode_only(
    "--tp 2",
    "--tp 2 --speculative-algorithm EAGLE --speculative-eagle-topk 1",
    "prefill: {tp: 2, pp: 1, dcp: 1, page_size: 1, draft: false}"
)]
fn speculative_flags_import_the_checkpoints_mtp_layers_as_draft_kv(
    #[case] prefill: &str,
    #[case] decode: &str,
    #[case] side_line: &str,
) {
    let text = imported("deepseek-v3.json", prefill, decode);
    assert!(text.contains("draft: {entries: 1, token_len: 1152}"), "{text}");
    assert!(text.contains(side_line), "{text}");
    let scenario =
        scenario::parse(&text, "deepseek-v3.json", "imported").unwrap_or_else(|error| panic!("{error}\n{text}"));
    let draft = scenario.problem.model.draft.expect("draft entries");
    assert_eq!(draft.entries, 1);
    let outcome = harness::run(&scenario).expect("runs");
    assert!(outcome.passed(), "{}\n{text}", outcome.failure_text("; "));
}

/// DeepSeek-V3 as SGLang's DP-attention decode (`--tp 8 --dp 8 --enable-dp-attention`, or 0.5.23's
/// `--attn-dp-size 8`: eight groups of attention TP 1) fed by a TP2 prefill: the scenario keeps the eight groups
/// (`dp: 8`), says so in its header, and runs byte-exact; `--attn-cp-size` becomes the prefill's `cp`.
#[test]
fn dp_attention_imports_the_groups_of_attention_tp() {
    let text = imported("deepseek-v3.json", "--tp 2", "--tp 8 --dp 8 --enable-dp-attention --dcp-size 1");
    assert!(text.contains("decode: {tp: 8, dp: 8, pp: 1, dcp: 1"), "{text}");
    assert!(text.contains("decode: DP attention, 8 groups of attention TP 1"), "{text}");
    let new_flags = imported("deepseek-v3.json", "--tp 4 --attn-cp-size 2", "--tp 8 --attn-dp-size 8");
    assert!(new_flags.contains("prefill: {tp: 4, cp: 2, pp: 1,"), "{new_flags}");
    assert!(new_flags.contains("decode: {tp: 8, dp: 8, pp: 1,"), "{new_flags}");
    let plain = imported("deepseek-v3.json", "--tp 2", "--tp 4 --dp 2");
    assert!(plain.contains("decode: {tp: 4,") && plain.contains("2 independent replicas of TP 4"), "{plain}");
    let scenario = scenario::parse(&text, "deepseek-v3.json", "imported").unwrap();
    let outcome = harness::run(&scenario).expect("runs");
    assert!(outcome.passed(), "{}", outcome.failure_text("; "));
}

/// Gemma 3 1B (Gemma-style SWA): layers 5, 11, 17 and 23 full attention, the other 22 a `swa` component without
/// layer ids whose K and V pages hold the one KV head; the request's last 512 tokens lie in its last 33 pages of 16
/// (1000 tokens: pages 30..62 of 63). TP1 -> TP2 replicates the head (same page length), and the run is byte-exact.
#[test]
fn a_gemma_style_sliding_window_model_imports_its_swa_pool() {
    let (prefill, decode) = (
        parse_flags("prefill", "--tp 1 --page-size 16").unwrap(),
        parse_flags("decode", "--tp 2 --page-size 16").unwrap(),
    );
    let text = import("gemma-3-1b.json", &config("gemma-3-1b.json"), &prefill, &decode, 1000, "test").unwrap();
    let scenario =
        scenario::parse(&text, "gemma-3-1b.json", "imported").unwrap_or_else(|error| panic!("{error}\n{text}"));
    let model = &scenario.problem.model;
    assert_eq!(model.kv_layers, vec![5, 11, 17, 23], "{text}");
    let swa = &model.state[0];
    assert_eq!(swa.layers.len(), 22, "{text}");
    assert!(text.contains("window_pages: 33") && text.contains("item_len: 8192"), "{text}");
    let outcome = harness::run(&scenario).expect("runs");
    assert!(outcome.passed(), "{}\n{text}", outcome.failure_text("; "));
    // Another page size on the decode side is refused by field.
    let other = parse_flags("decode", "--tp 2 --page-size 32").unwrap();
    let error = import("gemma-3-1b.json", &config("gemma-3-1b.json"), &prefill, &other, 1000, "test").unwrap_err();
    assert!(error.to_string().contains("--page-size"), "{error}");
}
