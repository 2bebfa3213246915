//! Scenario loader diagnostics: every error names the file, the line and the field path, and says how to fix it.

use kvrelay::scenario::{self, ScenarioError};

#[track_caller]
fn error(yaml: &str) -> String {
    match scenario::parse(yaml, "scenarios/bad.yaml", "bad") {
        Ok(scenario) => panic!("expected an error, loaded {}", scenario.name),
        Err(ScenarioError { .. }) => scenario::parse(yaml, "scenarios/bad.yaml", "bad").unwrap_err().to_string(),
    }
}

const GOOD_TAIL: &str = "decode: {page_size: 4}\nrequests:\n  - tokens: 20\nexpect: ok\n";

#[test]
fn unknown_field_is_named_with_line_and_path() {
    let res = error(&format!("model: {{preset: kimi-k3}}\nprefill:\n  page_size: 4\n  tp_size: 2\n{GOOD_TAIL}"));
    assert!(res.starts_with("scenarios/bad.yaml:4:"), "{res}");
    assert!(res.contains("prefill.tp_size: unknown field `tp_size`, expected one of `tp`"), "{res}");
}

#[test]
fn wrong_type_is_named_with_line_and_path() {
    let res = error("model: {preset: kimi-k3}\nprefill: {page_size: 4}\ndecode: {page_size: 4}\nrequests:\n  - tokens: many\nexpect: ok\n");
    assert!(res.starts_with("scenarios/bad.yaml:5:"), "{res}");
    assert!(res.contains("requests[0].tokens"), "{res}");
}

#[test]
fn misaligned_chunk_points_at_the_request_line() {
    let res = error(
        "model: {preset: kimi-k3}\nprefill: {pp: 8, page_size: 64}\ndecode: {page_size: 64}\nrequests:\n  - tokens: 100\n  - tokens: 300\n    chunks: [100, 200]\nexpect: ok\n",
    );
    assert_eq!(
        res,
        "scenarios/bad.yaml:7: requests[1].chunks: non-last chunk of 100 tokens is not a multiple of the prefill allocator page V = page_size x dcp = 64 tokens (domain.md §2.3)"
    );
}

#[test]
fn every_diagnostic_is_reported_at_once() {
    let res = error(
        "model: {preset: kimi-k9}\nprefill: {page_size: 0}\ndecode: {page_size: 4}\nrequests: []\nexpect: maybe\n",
    );
    let lines: Vec<&str> = res.lines().collect();
    assert_eq!(lines.len(), 4, "{res}");
    assert!(lines[0].contains("model.preset: unknown preset `kimi-k9`"), "{res}");
    assert!(
        lines.iter().any(|line| line.starts_with("scenarios/bad.yaml:2: prefill.page_size: must be at least 1")),
        "{res}"
    );
    assert!(lines.iter().any(|line| line.contains("expect: unknown verdict `maybe`")), "{res}");
    assert!(lines.iter().any(|line| line.contains("requests: no requests")), "{res}");
}

#[test]
fn explicit_page_zero_and_duplicates_are_rejected() {
    let res = error(
        "model: {layers: 1, kv_lora_rank: 4, qk_rope_head_dim: 4, dtype_bytes: 1}\nprefill: {page_size: 4}\ndecode: {page_size: 4}\nrequests:\n  - {tokens: 8, prefill_pages: [0, 3]}\n  - {tokens: 4, prefill_pages: [3]}\nexpect: ok\n",
    );
    assert!(res.contains("requests[0].prefill_pages[0]: page 0 is the padding page"), "{res}");
    assert!(res.contains("requests[1].prefill_pages[0]: page 3 is used twice on the prefill side"), "{res}");
}

#[test]
fn seeded_allocator_never_hands_out_page_zero_or_contiguous_lists() {
    let scenario = scenario::parse(
        "model: {layers: 1, kv_lora_rank: 4, qk_rope_head_dim: 4, dtype_bytes: 1}\nprefill: {page_size: 4}\ndecode: {page_size: 4}\nrequests:\n  - {tokens: 200}\n  - {tokens: 120}\nexpect: ok\n",
        "inline",
        "inline",
    )
    .unwrap();
    let pages: Vec<u32> = scenario.problem.requests.iter().flat_map(|request| request.prefill_pages.clone()).collect();
    assert!(!pages.contains(&0));
    let mut unique = pages.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), pages.len(), "pages are handed out once");
    let contiguous = pages.windows(2).filter(|pair| pair[1] == pair[0] + 1).count();
    assert!(contiguous < pages.len() / 4, "{contiguous} contiguous neighbours in {pages:?}");
}

/// A scenario too big for the in-memory fabric is refused at load time instead of stalling the allocator.
#[test]
fn oversized_pools_are_refused_not_allocated() {
    let res = error("model: {preset: deepseek-v2-lite}\nprefill: {page_size: 4}\ndecode: {page_size: 4}\nrequests:\n  - tokens: 3000000000\nexpect: ok\n");
    assert!(
        res.contains("requests[0].tokens: needs 750000000 prefill pages, more than the limit of 16777216"),
        "{res}"
    );
}

/// `decode.registration` takes the word `legacy` or a mapping; anything else names the field and the choices.
#[test]
fn registration_shorthand_and_its_errors() {
    let base = "model: {preset: deepseek-v2-lite, layers: 2}\nprefill: {page_size: 16}\n";
    let legacy = scenario::parse(
        &format!("{base}decode: {{page_size: 16, registration: legacy}}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"),
        "x.yaml",
        "x",
    )
    .unwrap();
    assert!(legacy.problem.advertise.legacy);
    let res = error(&format!(
        "{base}decode: {{page_size: 16, registration: modern}}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"
    ));
    assert!(
        res.contains("decode.registration: invalid value: string \"modern\", expected `legacy` or a mapping"),
        "{res}"
    );
    let res = error(&format!("{base}prefill_extra: 1\ndecode: {{page_size: 16, registration: {{ranks: [9]}}}}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"));
    assert!(res.contains("prefill_extra"), "{res}");
    let res = error(&format!(
        "{base}decode: {{page_size: 16, registration: {{ranks: [9]}}}}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"
    ));
    assert!(res.contains("decode.registration.ranks: decode rank 9 does not exist: decode has 1 ranks"), "{res}");
}

/// `pp_layer_partition` (SGLANG_PP_LAYER_PARTITION): SGLang's own checks in its words, plus kvrelay's refusal of an
/// empty stage, each naming the field and the fix.
#[rstest::rstest]
#[case::wrong_length(
    "[32]",
    "prefill.pp_layer_partition: 1 entries for pp 2 (SGLang: len(partitions)=1 does not match pp_size=2"
)]
#[case::wrong_sum("[12, 16]", "prefill.pp_layer_partition: sums to 28, not the model's 32 layers (SGLang: sum(partitions)=28 does not match num_hidden_layers=32")]
#[case::empty_stage("[0, 32]", "prefill.pp_layer_partition[0]: a stage of 0 layers (SGLang accepts it and builds an empty stage; fix: at least 1 layer per stage)")]
fn a_bad_layer_partition_names_the_field_and_the_fix(#[case] partition: &str, #[case] wanted: &str) {
    let res = error(&format!(
        "model: {{preset: llama-3-8b}}\nprefill: {{pp: 2, page_size: 16, pp_layer_partition: {partition}}}\ndecode: {{page_size: 16}}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"
    ));
    assert!(res.starts_with("scenarios/bad.yaml:2: "), "{res}");
    assert!(res.contains(wanted), "{res}");
}

/// A valid partition moves the stage boundary of every rank's registered layers.
#[test]
fn a_layer_partition_moves_the_stage_boundary() {
    let scenario = scenario::parse(
        "model: {preset: llama-3-8b}\nprefill: {pp: 2, page_size: 16, pp_layer_partition: [12, 20]}\ndecode: {page_size: 16}\nrequests: [{tokens: 20}]\nexpect: ok\n",
        "x.yaml",
        "x",
    )
    .unwrap();
    let layers = |stage: usize| -> Vec<u32> {
        let rank = &scenario.problem.prefill.ranks[stage];
        rank.kv_entries.iter().map(|index| rank.regions[*index as usize].layer).collect()
    };
    assert_eq!(layers(0), [(0..12).collect::<Vec<_>>(), (0..12).collect()].concat());
    assert_eq!(layers(1), [(12..32).collect::<Vec<_>>(), (12..32).collect()].concat());
}

/// Equal PP with different partitions: no peer can see it on the wire, so the loader refuses it and says why.
#[test]
fn different_partitions_at_equal_pp_are_refused() {
    let res = error("model: {preset: deepseek-v2-lite, layers: 16}\nprefill: {pp: 2, page_size: 16, pp_layer_partition: [6, 10]}\ndecode: {pp: 2, page_size: 16, pp_layer_partition: [8, 8]}\nrequests: [{tokens: 20}]\nexpect: ok\n");
    assert!(
        res.contains("decode.pp_layer_partition: decode stage 0 holds layers 0..8 but prefill stage 0 holds 0..6"),
        "{res}"
    );
    assert!(res.contains("fix: the same SGLANG_PP_LAYER_PARTITION on both sides"), "{res}");
}

/// `draft: false` leaves out a side's draft entries; on a model without draft entries it names the field and the fix.
#[test]
fn a_side_without_draft_entries() {
    let base = "model: {preset: deepseek-v2-lite, layers: 2";
    let tail = "requests: [{tokens: 20}]\nexpect: ok\n";
    let loaded = scenario::parse(
        &format!("{base}, draft: {{entries: 1, token_len: 576}}}}\nprefill: {{page_size: 16, draft: false}}\ndecode: {{page_size: 16}}\n{tail}"),
        "x.yaml",
        "x",
    )
    .unwrap();
    let drafts = |side: &kvrelay::model::SideLayout| {
        side.ranks[0].regions.iter().filter(|region| region.kind == kvrelay::model::RegionKind::Draft).count()
    };
    assert_eq!((drafts(&loaded.problem.prefill), drafts(&loaded.problem.decode)), (0, 1));
    let res = error(&format!("{base}}}\nprefill: {{page_size: 16, draft: false}}\ndecode: {{page_size: 16}}\n{tail}"));
    assert!(
        res.contains("prefill.draft: the model has no draft entries to leave out (fix: drop `draft: false`"),
        "{res}"
    );
}

/// A request's own slot or aux index must lie in the side's pool, past the reserved index 0, and be named once.
#[rstest::rstest]
#[case::outside(
    "{slot: {decode: 9}}",
    "requests[0].slot.decode: slot 9 is outside 1..4 (fix: an index from 1, or raise decode.slots)"
)]
#[case::zero(
    "{aux: {prefill: 0}}",
    "requests[0].aux.prefill: aux 0 is outside 1..4 (fix: an index from 1, or raise prefill.slots)"
)]
#[case::twice(
    "{slot: {prefill: 2}}, {tokens: 9, slot: {prefill: 2}}",
    "requests[1].slot.prefill: slot 2 is named by two requests on the prefill side"
)]
fn a_bad_slot_or_aux_index_names_the_field_and_the_fix(#[case] request: &str, #[case] wanted: &str) {
    let request = request.replacen('{', "{tokens: 20, ", 1);
    let res = error(&format!(
        "model: {{preset: llama-3-8b, layers: 2, aux: [64]}}\nprefill: {{page_size: 16, slots: 4}}\ndecode: {{page_size: 16, slots: 4}}\nrequests: [{request}]\nexpect: ok\n"
    ));
    assert!(res.contains(wanted), "{res}");
}

/// DP attention fields (`dp` on a side, `prefill_dp`/`decode_dp` on a request): SGLang's divisibility, the group
/// range, and DCP inside the attention-TP group, each naming the field and the fix.
#[rstest::rstest]
#[case::dp_does_not_divide_tp(
    "prefill: {tp: 4, dp: 3, page_size: 16}\ndecode: {page_size: 16}\nrequests: [{tokens: 20}]",
    "prefill.dp: 3 does not divide tp 4 (each attention DP group holds tp / dp attention-TP ranks"
)]
#[case::prefill_group_out_of_range(
    "prefill: {tp: 4, dp: 2, page_size: 16}\ndecode: {page_size: 16}\nrequests: [{tokens: 20, prefill_dp: 2}]",
    "requests[0].prefill_dp: 2 is not a DP group of prefill dp 2 (fix: a group below 2, or leave it out)"
)]
#[case::decode_group_without_dp(
    "prefill: {page_size: 16}\ndecode: {page_size: 16}\nrequests: [{tokens: 20, decode_dp: 1}]",
    "requests[0].decode_dp: 1 is not a DP group of decode dp 1 (fix: a group below 1, or leave it out)"
)]
#[case::dcp_outside_the_group(
    "prefill: {tp: 8, page_size: 16}\ndecode: {tp: 8, dp: 4, dcp: 4, page_size: 16}\nrequests: [{tokens: 20}]",
    "decode.dcp: 4 does not divide the attention TP size tp / dp = 2"
)]
#[case::dp_zero(
    "prefill: {tp: 4, dp: 0, page_size: 16}\ndecode: {page_size: 16}\nrequests: [{tokens: 20}]",
    "prefill.dp: must be at least 1"
)]
fn a_bad_dp_field_names_the_field_and_the_fix(#[case] sides: &str, #[case] wanted: &str) {
    let res = error(&format!("model: {{preset: deepseek-v2-lite, layers: 2}}\n{sides}\nexpect: ok\n"));
    assert!(res.contains(wanted), "{res}");
}

/// A request is computed by prefill group `room % dp` and dispatched to decode group `room % dp` unless it names its
/// groups (SGLang `decode.py:879-897`); the side's ranks are `dp` groups of `tp / dp` attention-TP ranks.
#[test]
fn dp_groups_default_to_the_room_and_split_the_tp_ranks() {
    let scenario = scenario::parse(
        "model: {preset: deepseek-v2-lite, layers: 2}\nprefill: {tp: 4, dp: 2, page_size: 16}\ndecode: {tp: 6, dp: 3, page_size: 16}\nrequests: [{tokens: 20}, {tokens: 20}, {tokens: 20}, {tokens: 20, prefill_dp: 0, decode_dp: 1}]\nexpect: ok\n",
        "x.yaml",
        "x",
    )
    .unwrap();
    let problem = &scenario.problem;
    let groups: Vec<(u32, u32)> = problem.requests.iter().map(|r| (r.prefill_dp, r.decode_dp)).collect();
    assert_eq!(groups, [(0, 0), (1, 1), (0, 2), (0, 1)]);
    assert_eq!((problem.prefill.topology.tp, problem.prefill.topology.dp), (2, 2));
    assert_eq!((problem.decode.topology.tp, problem.decode.topology.dp), (2, 3));
    let ranks: Vec<String> = problem.decode.ranks.iter().map(|layout| layout.rank.to_string()).collect();
    assert_eq!(ranks, ["pp0/tp0", "pp0/tp1", "dp1/pp0/tp0", "dp1/pp0/tp1", "dp2/pp0/tp0", "dp2/pp0/tp1"]);
}

/// Prefill CP fields: SGLang's divisibility and its decode-side assertion, DCP inside a CP rank, and all-CP settings
/// that disagree (neither side publishes its own, and SGLang then loses pages or waits forever), each naming the
/// field and the fix.
#[rstest::rstest]
#[case::cp_does_not_divide(
    "prefill: {tp: 4, cp: 3, page_size: 16}\ndecode: {page_size: 16}",
    "prefill.cp: 3 does not divide tp / dp = 4"
)]
#[case::decode_cp(
    "prefill: {tp: 2, page_size: 16}\ndecode: {tp: 2, cp: 2, page_size: 16}",
    "decode.cp: Decode cp size (2) should be equal to 1"
)]
#[case::prefill_only_env(
    "prefill: {tp: 2, cp: 2, page_size: 16, all_cp_ranks_transfer: true}\ndecode: {page_size: 16}",
    "decode.all_cp_ranks_transfer: prefill CP2: every prefill CP rank sends its block of pages, but decode pulls from CP rank 0 only"
)]
#[case::decode_only_env(
    "prefill: {tp: 2, cp: 2, page_size: 16}\ndecode: {page_size: 16, all_cp_ranks_transfer: true}",
    "prefill.all_cp_ranks_transfer: prefill CP2: only prefill CP rank 0 sends pages, but decode pulls from every CP rank"
)]
fn a_bad_cp_field_names_the_field_and_the_fix(#[case] sides: &str, #[case] wanted: &str) {
    let res = error(&format!(
        "model: {{preset: deepseek-v2-lite, layers: 2}}\n{sides}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"
    ));
    assert!(res.contains(wanted), "{res}");
}

/// A hybrid-MLA pool turns all-CP transfer on for both sides by itself (SGLang `common/conn.py:373-394`): CP ranks
/// are their own ranks, laid out (dp, cp, pp, tp), and the decode waits for every CP rank's status.
#[test]
fn a_hybrid_mla_cp_prefill_sends_from_every_cp_rank() {
    let scenario = scenario::load(std::path::Path::new("scenarios/cp/kimi-k3-cp4-to-tp4.yaml")).unwrap();
    let problem = &scenario.problem;
    let (prefill, decode) = (&problem.prefill.topology, &problem.decode.topology);
    assert!(prefill.all_cp && decode.all_cp);
    assert_eq!((prefill.tp, prefill.cp), (1, 4));
    let ranks: Vec<String> = problem.prefill.ranks.iter().map(|layout| layout.rank.to_string()).collect();
    assert_eq!(ranks, ["pp0/tp0", "cp1/pp0/tp0", "cp2/pp0/tp0", "cp3/pp0/tp0"]);
    assert_eq!(kvrelay::plan::expected_responses(&problem.model, prefill, decode), 4);
}

/// `state_layouts`: a transposition of a sliced Mamba tensor, named once per side; anything else names the field and
/// the fix (an outer that does not split a channel's bytes, two windows that are not one layout transposed, a tensor
/// without a channel axis, a component that is not Mamba).
#[rstest::rstest]
#[case::outer_does_not_split_a_channel(
    "decode: {tp: 2, page_size: 16, state_layouts: [{component: 0, tensor: 0, outer: 4}]}",
    "decode.state_layouts[0].outer: outer 4 does not split the 6 B each channel holds"
)]
#[case::two_windows(
    "decode: {tp: 2, page_size: 16, state_layouts: [{component: 0, tensor: 0, outer: 6}]}\nprefill: {page_size: 16, state_layouts: [{component: 0, tensor: 0, outer: 3}]}",
    "outer 6 and 3 (prefill.state_layouts[0].outer) are not one layout transposed"
)]
#[case::named_twice(
    "decode: {tp: 2, page_size: 16, state_layouts: [{component: 0, tensor: 0, outer: 3}, {component: 0, tensor: 0, outer: 1}]}",
    "decode.state_layouts[1]: component 0 tensor 0 is named twice on the decode side"
)]
#[case::no_such_tensor(
    "decode: {tp: 2, page_size: 16, state_layouts: [{component: 0, tensor: 5, outer: 3}]}",
    "decode.state_layouts[0].tensor: tensor 5 does not exist"
)]
#[case::no_such_component(
    "decode: {tp: 2, page_size: 16, state_layouts: [{component: 3, tensor: 0, outer: 3}]}",
    "decode.state_layouts[0].component: component 3 does not exist"
)]
fn a_bad_state_layout_names_the_field_and_the_fix(#[case] sides: &str, #[case] wanted: &str) {
    let sides =
        if sides.contains("prefill:") { sides.to_owned() } else { format!("prefill: {{page_size: 16}}\n{sides}") };
    let res = error(&format!("model: {{preset: qwen3-next}}\n{sides}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"));
    assert!(res.contains(wanted), "{res}");
}

/// A decode holding the conv tensor transposed advertises its rows (frame 19) and keeps the model's item length.
#[test]
fn a_transposed_decode_advertises_its_rows_with_the_same_item_length() {
    let path = std::path::Path::new("scenarios/state/gdn-conv-transposed-decode-tp1-to-tp4.yaml");
    let problem = scenario::load(path).unwrap().problem;
    assert_eq!(problem.decode.sliced_layout(&problem.model, 0, 0), Some((3, 2)));
    assert_eq!(problem.prefill.sliced_layout(&problem.model, 0, 0), Some((1, 6)));
    let (prefill, decode) = (&problem.prefill.ranks[0].state, &problem.decode.ranks[1].state);
    assert!(decode.outer_counts[0][..36].iter().all(|outer| *outer == 3));
    assert!(prefill.outer_counts[0][..36].iter().all(|outer| *outer == 1));
    let conv = |layout: &kvrelay::model::RankLayout| layout.regions[layout.state.regions[0][0] as usize].item_len;
    assert_eq!(conv(&problem.prefill.ranks[0]), 4 * conv(&problem.decode.ranks[1]));
}

/// `model.draft`: replicated rows or a head-sharded draft, never both; a sharded draft's heads shard or replicate
/// over both sides' TP; each names the field and the fix.
#[rstest::rstest]
#[case::both_shapes(
    "draft: {entries: 2, token_len: 512, heads: 8, head_dim: 128}",
    "model.draft: give `token_len` alone (replicated rows: an MLA/MTP draft) or `heads` and `head_dim`"
)]
#[case::heads_without_head_dim("draft: {entries: 2, heads: 8}", "model.draft: give `token_len` alone")]
#[case::heads_do_not_shard(
    "draft: {entries: 2, heads: 3, head_dim: 128}",
    "model.draft.heads: 3 draft KV heads do not shard or replicate over decode tp 4"
)]
#[case::zero_heads("draft: {entries: 2, heads: 0, head_dim: 128}", "model.draft.heads: 0 is outside 1..=")]
#[case::odd_head_bytes(
    "draft: {entries: 2, heads: 8, head_dim: 3, dtype_bytes: 1}",
    "model.draft.head_dim: draft heads of 3 B are not a multiple of 8"
)]
fn a_bad_draft_names_the_field_and_the_fix(#[case] draft: &str, #[case] wanted: &str) {
    let res = error(&format!(
        "model: {{preset: llama-3-8b, layers: 2, {draft}}}\nprefill: {{tp: 2, page_size: 16}}\ndecode: {{tp: 4, page_size: 16}}\nrequests: [{{tokens: 20}}]\nexpect: ok\n"
    ));
    assert!(res.contains(wanted), "{res}");
}

/// A head-sharded draft registers `max(1, heads / tp)` heads a row on each side, its own dtype.
#[test]
fn a_sharded_draft_row_holds_its_ranks_heads() {
    let path = std::path::Path::new("scenarios/probes/fp8-draft-slice-tp2-to-tp4.yaml");
    let problem = scenario::load(path).unwrap().problem;
    let draft_row = |side: &kvrelay::model::SideLayout| {
        let rank = &side.ranks[0];
        rank.regions.iter().find(|region| region.kind == kvrelay::model::RegionKind::Draft).map(|it| it.row_len())
    };
    // 8 fp8 heads of 128: 4 a prefill rank (TP2), 2 a decode rank (TP4).
    assert_eq!(draft_row(&problem.prefill), Some(512));
    assert_eq!(draft_row(&problem.decode), Some(256));
}

/// A pure-MLA decode waits for the status of every prefill rank holding heads of a head-sharded draft, not only the
/// primary's (the fault swarm found a decode reporting Success on the draft holder's status alone); without the
/// draft the second rank is a dummy again.
#[test]
fn a_pure_mla_decode_waits_for_every_draft_head_holder() {
    let path = std::path::Path::new("scenarios/probes/mla-gqa-draft-tp4-to-tp2.yaml");
    let problem = scenario::load(path).unwrap().problem;
    let (prefill, decode) = (&problem.prefill.topology, &problem.decode.topology);
    assert_eq!(kvrelay::plan::expected_responses(&problem.model, prefill, decode), 2);
    assert!(!kvrelay::plan::mla_dummy(&problem.model, prefill, decode, 1));
    let model = kvrelay::model::ModelGeometry { draft: None, ..problem.model.clone() };
    assert_eq!(kvrelay::plan::expected_responses(&model, prefill, decode), 1);
    assert!(kvrelay::plan::mla_dummy(&model, prefill, decode, 1));
}

/// `decode.hisparse`: only where SGLang starts it (an MLA model with a DSA indexer, decode DCP 1, no decode prefix),
/// never on the prefill; `decode_host_pages` only beside it, one unique page inside the host pool per decode page.
/// Each refusal names the field and the fix.
#[rstest::rstest]
#[case::under_decode_dcp(
    "model: {preset: deepseek-v3.2}\nprefill: {page_size: 64}\ndecode: {tp: 2, dcp: 2, page_size: 64, hisparse: {host_pages: 16}}\nrequests: [{tokens: 100}]",
    "decode.hisparse: SGLang refuses HiSparse with decode context parallelism (fix: decode.dcp 1)"
)]
#[case::without_a_dsa_indexer(
    "model: {preset: deepseek-v3}\nprefill: {page_size: 64}\ndecode: {page_size: 64, hisparse: {host_pages: 16}}\nrequests: [{tokens: 100}]",
    "decode.hisparse: HiSparse needs an MLA model with a DSA indexer"
)]
#[case::on_the_prefill(
    "model: {preset: deepseek-v3.2}\nprefill: {page_size: 64, hisparse: {host_pages: 16}}\ndecode: {page_size: 64}\nrequests: [{tokens: 100}]",
    "prefill.hisparse: HiSparse runs on the decode side only"
)]
#[case::with_a_decode_prefix(
    "model: {preset: deepseek-v3.2}\nprefill: {page_size: 64}\ndecode: {page_size: 64, hisparse: {host_pages: 16}}\nrequests: [{tokens: 200, decode_prefix: 64}]",
    "requests[0].decode_prefix: a HiSparse decode holds no prefix"
)]
#[case::host_pages_without_hisparse(
    "model: {preset: deepseek-v3.2}\nprefill: {page_size: 64}\ndecode: {page_size: 64}\nrequests: [{tokens: 100, decode_host_pages: [0, 1]}]",
    "requests[0].decode_host_pages: host pages are the destination of a HiSparse decode only"
)]
#[case::host_page_outside_the_pool(
    "model: {preset: deepseek-v3.2}\nprefill: {page_size: 64}\ndecode: {page_size: 64, hisparse: {host_pages: 4}}\nrequests: [{tokens: 100, decode_host_pages: [0, 4]}]",
    "requests[0].decode_host_pages[1]: host page 4 is outside the 4-page host pool (fix: raise decode.hisparse.host_pages)"
)]
#[case::host_page_twice(
    "model: {preset: deepseek-v3.2}\nprefill: {page_size: 64}\ndecode: {page_size: 64, hisparse: {host_pages: 4}}\nrequests: [{tokens: 100, decode_host_pages: [2, 2]}]",
    "requests[0].decode_host_pages[1]: host page 2 is used twice"
)]
#[case::too_few_host_pages(
    "model: {preset: deepseek-v3.2}\nprefill: {page_size: 64}\ndecode: {page_size: 64, hisparse: {host_pages: 3}}\nrequests: [{tokens: 100}, {tokens: 100}]",
    "decode.hisparse.host_pages: 3 host pages are too few for the requests (fix: raise host_pages)"
)]
fn a_bad_hisparse_deployment_names_the_field_and_the_fix(#[case] text: &str, #[case] wanted: &str) {
    let res = error(&format!("{text}\nexpect: ok\n"));
    assert!(res.contains(wanted), "{res}");
}

/// A HiSparse decode's host pages come from the front of its host pool in request order, page 0 first (SGLang's
/// host free list is `arange(size)`); its logical pages stay the seeded allocator's, never page 0.
#[test]
fn hisparse_host_pages_are_handed_out_from_zero_in_request_order() {
    let path = std::path::Path::new("scenarios/state/deepseek-v3.2-hisparse-decode-mtp.yaml");
    let problem = scenario::load(path).unwrap().problem;
    let hosts: Vec<_> = problem.requests.iter().map(|request| request.decode_host_pages.clone()).collect();
    assert_eq!(hosts, [vec![0, 1, 2, 3], vec![4, 5]]);
    assert!(problem.requests.iter().all(|request| !request.decode_pages.contains(&0)));
    let layout = &problem.decode.ranks[0];
    let kv = &layout.regions[layout.kv_entries[0] as usize];
    assert_eq!(kv.item_count, 16, "the KV entries are the 16-page host pool");
}

/// `prefill.staging` / `decode.staging`: each side its own field; staging where SGLang starts it (MHA/GQA) and
/// kvrelay models it (prefill PP1, no all-CP transfer, no draft, grid chunks, a ring that holds every image at
/// once); each refusal names the field and the fix.
#[rstest::rstest]
#[case::prefill_only(
    "prefill: {tp: 2, page_size: 16, staging: {chunk_pages: 2}}\ndecode: {tp: 4, page_size: 16}",
    &[], "prefill.staging: the decode sets no staging"
)]
#[case::ring_on_the_prefill(
    "prefill: {tp: 2, page_size: 16, staging: {ring_bytes: 4096}}\ndecode: {tp: 4, page_size: 16, staging: {ring_bytes: 262144}}",
    &[], "prefill.staging.ring_bytes: the staging ring is the decode's"
)]
#[case::no_ring_bytes(
    "prefill: {tp: 2, page_size: 16, staging: {chunk_pages: 2}}\ndecode: {tp: 4, page_size: 16, staging: {}}",
    &[], "decode.staging.ring_bytes: missing"
)]
#[case::ring_not_whole_rows(
    "prefill: {tp: 2, page_size: 16, staging: {chunk_pages: 2}}\ndecode: {tp: 4, page_size: 16, staging: {ring_bytes: 1000}}",
    &[], "decode.staging.ring_bytes: 1000 bytes: a whole number of 512-byte ring rows"
)]
#[case::ring_too_small(
    "prefill: {tp: 2, page_size: 16, staging: {chunk_pages: 2}}\ndecode: {tp: 4, page_size: 16, staging: {ring_bytes: 65536}}",
    &[], "decode.staging.ring_bytes: 65536 bytes cannot hold every chunk image at once (163840 bytes)"
)]
#[case::off_the_grid(
    "prefill: {tp: 2, page_size: 16, staging: {chunk_pages: 2}}\ndecode: {tp: 4, page_size: 16, staging: {ring_bytes: 262144}}",
    &["chunks: [16, 24]"], "requests[0].chunks: [16, 24]: with staging every chunk but the last is one grid chunk of 2 pages (32 tokens)"
)]
#[case::under_prefill_pp(
    "prefill: {tp: 2, pp: 2, page_size: 16, staging: {chunk_pages: 2}}\ndecode: {tp: 4, page_size: 16, staging: {ring_bytes: 262144}}",
    &[], "prefill.staging: staging under prefill PP pairs ring slots by layer id"
)]
fn a_bad_staging_deployment_names_the_field_and_the_fix(
    #[case] sides: &str,
    #[case] request: &[&str],
    #[case] wanted: &str,
) {
    let extra = if request.is_empty() { ", chunks: [32, 8]".to_owned() } else { format!(", {}", request.join(", ")) };
    let text = format!(
        "model: {{layers: 2, kv_heads: 8, head_dim: 128, dtype_bytes: 2}}\n{sides}\nrequests: [{{tokens: 40{extra}}}, {{tokens: 20}}]\nexpect: ok\n"
    );
    let res = error(&text);
    assert!(res.contains(wanted), "{res}");
}

/// With staging, each chunk's image follows the previous one in the ring of the request's decode DP group, and the
/// decode registers the ring after its aux buffers, in rows of one writer's heads of one token.
#[test]
fn staging_images_follow_each_other_in_the_ring() {
    let path = std::path::Path::new("scenarios/mha/gqa-staging-tp2-to-tp4.yaml");
    let problem = scenario::load(path).unwrap().problem;
    let offsets: Vec<_> = problem.requests.iter().map(|request| request.staging_offsets.clone()).collect();
    // W 1 x T x (2 heads x 256 B) x 4 slots: 65536 B for two pages, 32768 B for one.
    assert_eq!(offsets, [vec![0, 65536], vec![98304]]);
    let layout = &problem.decode.ranks[0];
    let ring = &layout.regions[layout.staging_entry.unwrap() as usize];
    assert_eq!((ring.row_len(), ring.len_bytes()), (512, 262144));
    assert_eq!(problem.prefill.topology.staging_chunk_pages, 2);
}
