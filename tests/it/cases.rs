//! Named cases: rejections not covered by the corpus, sender roles, and the oracle catching planted faults.

use std::sync::Arc;

use kvrelay::exec::{self, ExecError};
use kvrelay::exec::{CompletionStatus, SimFabric, Transport as _};
use kvrelay::model::{RankId, Side};
use kvrelay::plan::{self, PlanError, PlanErrorKind, RowRun};
use kvrelay::verify::{self, RegionKey};
use rstest::rstest;

use crate::support::{check_run, scenario};

const SMALL_DCP: &str = "
model: {layers: 3, kv_lora_rank: 12, qk_rope_head_dim: 4, dtype_bytes: 2}
prefill: {page_size: 4}
decode: {tp: 4, dcp: 4, page_size: 4}
requests:
  - {tokens: 50, decode_prefix: 16, chunks: [16, 18]}
expect: ok
";

#[rstest]
#[case::decode_dcp_into_prefill_dcp(
    "prefill: {tp: 4, dcp: 4, page_size: 4}\ndecode: {tp: 4, dcp: 1, page_size: 4}",
    PlanError::UnsupportedDcpTopology { prefill: 4, decode: 1 }
)]
#[case::page_sizes_must_match(
    "prefill: {page_size: 4}\ndecode: {page_size: 8}",
    PlanError::PageSizeMismatch { prefill: 4, decode: 8 }
)]
#[case::no_layer_ids_under_pp(
    "prefill: {pp: 3, page_size: 4, layer_ids: false}\ndecode: {page_size: 4, layer_ids: false}",
    PlanError::PositionalPairing { prefill: 1, decode: 3 }
)]
#[case::decode_pp_must_be_one_or_prefill_pp(
    "prefill: {pp: 3, page_size: 4}\ndecode: {pp: 2, page_size: 4}",
    PlanError::UnsupportedTopology { reason: "decode pp 2 must be 1 or equal prefill pp 3".to_owned() }
)]
fn planner_rejects_before_any_write(#[case] sides: &str, #[case] expected: PlanError) {
    let yaml = format!(
        "model: {{layers: 3, kv_lora_rank: 12, qk_rope_head_dim: 4, dtype_bytes: 2}}\n{sides}\nrequests: [{{tokens: 20}}]\nexpect: {{error: {}}}\n",
        expected.kind()
    );
    assert_eq!(plan::plan(&scenario(&yaml).problem), Err(expected));
    // Every decode rank fails its requests and no byte moves: every decode byte is still the sentinel.
    let outcome = check_run(&yaml);
    assert_all_sentinel(&outcome);
}

/// domain.md §2.5 case 1 is a per-peer rule: prefill TP2/DCP2 -> decode TP4/DCP2 maps decode ranks 1 and 2 onto
/// prefill ranks of the other DCP rank, so exactly those fail (their bytes stay sentinel) and ranks 0 and 3 pass.
#[test]
fn mismatched_dcp_ranks_fail_only_their_peers() {
    let expected = PlanError::MismatchedDcpRanks { prefill: 0, decode: 1 };
    let yaml = format!(
        "model: {{layers: 3, kv_lora_rank: 12, qk_rope_head_dim: 4, dtype_bytes: 2}}\nprefill: {{tp: 2, dcp: 2, page_size: 4}}\ndecode: {{tp: 4, dcp: 2, page_size: 4}}\nrequests: [{{tokens: 20}}]\nexpect: {{error: {}, ranks: [1]}}\n",
        expected.kind()
    );
    assert_eq!(plan::plan(&scenario(&yaml).problem), Err(expected));
    let outcome = kvrelay::harness::run(&scenario(&yaml)).unwrap();
    let failed: Vec<String> =
        outcome.engine.unwrap().failures().into_iter().map(|(rank, _, reason)| format!("{rank}: {reason}")).collect();
    assert_eq!(
        failed,
        [
            "pp0/tp1: PD peers must connect matching DCP ranks, got prefill=0, decode=1",
            "pp0/tp2: PD peers must connect matching DCP ranks, got prefill=1, decode=0"
        ]
    );
}

/// Every decode byte still holds the sentinel: read from the bytes, not from the (empty) write log.
#[track_caller]
fn assert_all_sentinel(outcome: &kvrelay::harness::Outcome) {
    assert!(!outcome.observation.images.is_empty());
    for (key, bytes) in &outcome.observation.images {
        assert!(kvrelay::verify::pattern::matches_sentinel(0, bytes), "decode region {key:?} was written");
    }
}

/// domain.md §3.1: with decode TP < prefill TP on a pure MLA pool only the first prefill rank of each group writes.
#[test]
fn tp_shrink_has_one_real_sender_per_decode_rank() {
    let outcome = check_run(
        "model: {layers: 2, kv_lora_rank: 12, qk_rope_head_dim: 4, dtype_bytes: 2}\nprefill: {tp: 8, page_size: 4}\ndecode: {tp: 2, page_size: 4}\nrequests: [{tokens: 30}]\nexpect: ok\n",
    );
    let plan = outcome.plan.unwrap();
    let senders: Vec<(RankId, RankId)> = plan.groups.iter().map(|group| (group.source, group.target)).collect();
    assert_eq!(senders, vec![(RankId::new(0, 0), RankId::new(0, 0)), (RankId::new(0, 4), RankId::new(0, 1))]);
}

/// domain.md §3.3: hybrid-MLA with decode TP < prefill TP still has one KV writer (the others send state only).
#[test]
fn hybrid_tp_shrink_writes_kv_once() {
    check_run(
        "model: {layers: 4, kv_layers: [1, 3], kv_lora_rank: 12, qk_rope_head_dim: 4, dtype_bytes: 2}\nprefill: {tp: 4, page_size: 4}\ndecode: {tp: 1, page_size: 4}\nrequests: [{tokens: 30}]\nexpect: ok\n",
    );
}

/// Runs `SMALL_DCP` with the plan altered by `mutate` and returns the oracle's rendered violations.
fn violations_after(mutate: impl FnOnce(&mut plan::Plan)) -> Vec<String> {
    let problem = scenario(SMALL_DCP).problem;
    let mut plan = plan::plan(&problem).unwrap();
    mutate(&mut plan);
    let mut fabric = SimFabric::new();
    exec::stage(&problem, &mut fabric).unwrap();
    let writes = exec::execute(&plan, &mut fabric).unwrap();
    let observation = exec::observe(&problem, &mut fabric, writes).unwrap();
    verify::check(&problem, &observation).iter().map(ToString::to_string).collect()
}

#[test]
fn unaltered_plan_has_no_violations() {
    assert_eq!(violations_after(|_| {}), Vec::<String>::new());
}

/// A planner that drops one run leaves rows missing: the oracle names rank, layer, row and the missing token.
#[test]
fn oracle_reports_a_dropped_run_as_missing_tokens() {
    let violations = violations_after(|plan| {
        let group = &mut plan.groups[0];
        group.runs = Arc::from(&group.runs[1..]);
    });
    assert!(!violations.is_empty());
    assert!(
        violations[0].contains("expected token") && violations[0].contains("found sentinel (never written)"),
        "{violations:?}"
    );
}

/// Swapping two target rows (a relayout off by one) is reported with both tokens decoded.
#[test]
fn oracle_decodes_misplaced_rows_into_tokens() {
    let violations = violations_after(|plan| {
        let group = &mut plan.groups[0];
        let mut runs: Vec<RowRun> = group.runs.to_vec();
        let (first, second) = (runs[0].target_row, runs[1].target_row);
        runs[0].target_row = second;
        runs[1].target_row = first;
        group.runs = Arc::from(runs);
    });
    let rendered = violations.join("\n");
    assert_eq!(violations.len(), 2 * 3, "two rows in each of three layers:\n{rendered}");
    assert!(
        rendered.contains("layer 0 kv, row 12: expected token 16 of request 0 from prefill pp0/tp0 layer 0 kv, found token 20 of request 0"),
        "{rendered}"
    );
}

/// A copy sent twice is caught from the fabric's write log even though the bytes are right.
#[test]
fn oracle_reports_bytes_written_twice() {
    let violations = violations_after(|plan| {
        let first = plan.groups[0].clone();
        plan.groups.push(first);
    });
    assert!(!violations.is_empty());
    assert!(violations.iter().all(|violation| violation.contains("written more than once")), "{violations:?}");
}

/// Corrupting one landed byte after the transfer is found and located, to the byte (the count is exact, not the
/// decoder's 8-byte words).
#[test]
fn oracle_reports_a_corrupted_byte() {
    let problem = scenario(SMALL_DCP).problem;
    let plan = plan::plan(&problem).unwrap();
    let mut fabric = SimFabric::new();
    exec::stage(&problem, &mut fabric).unwrap();
    let writes = exec::execute(&plan, &mut fabric).unwrap();
    let mut observation = exec::observe(&problem, &mut fabric, writes).unwrap();
    let key = RegionKey { side: Side::Decode, rank: RankId::new(0, 1), region: 2 };
    let copy = plan.copies().find(|copy| copy.target == key.rank && copy.target_region == 2).unwrap();
    observation.images.get_mut(&key).unwrap()[copy.target_offset as usize + 5] ^= 0xFF;
    let violations: Vec<String> = verify::check(&problem, &observation).iter().map(ToString::to_string).collect();
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].starts_with("decode pp0/tp1, layer 2 kv, row "), "{violations:?}");
    assert!(violations[0].contains("found a damaged range (1 byte differs) around token"), "{violations:?}");
}

/// The fabric bounds-checks every copy: a target offset past the region completes in error, writing nothing.
#[test]
fn copy_outside_a_registered_region_is_a_completion_error() {
    let problem = scenario(SMALL_DCP).problem;
    let plan = plan::plan(&problem).unwrap();
    let image = |plan: &plan::Plan| {
        let mut fabric = SimFabric::new();
        exec::stage(&problem, &mut fabric).unwrap();
        let res = exec::execute(plan, &mut fabric);
        (res, fabric.read(RegionKey { side: Side::Decode, rank: plan.groups[0].target, region: 0 }).unwrap())
    };
    // The same plan twice: once with its first run aimed past the region, once without that run at all.
    let mut out_of_bounds = plan.clone();
    let mut runs: Vec<RowRun> = out_of_bounds.groups[0].runs.to_vec();
    runs[0].target_row = 1 << 30;
    out_of_bounds.groups[0].runs = Arc::from(runs);
    let mut without = plan.clone();
    without.groups[0].runs = Arc::from(&plan.groups[0].runs[1..]);
    let (res, after_bad) = image(&out_of_bounds);
    let (clean, after_without) = image(&without);
    assert!(matches!(res, Err(ExecError::Completion { status: CompletionStatus::RemoteAccess, .. })), "{res:?}");
    assert!(clean.is_ok());
    // Equal images prove the failed write changed no byte, and that every other copy still landed.
    assert!(after_bad == after_without, "the out-of-bounds write touched memory");
}

/// Worked example C (domain.md §2.4) end to end through the scenario loader: decode rank 5's bytes.
#[test]
fn worked_example_c_lands_on_rows_192_and_576() {
    let outcome = check_run(
        "model: {layers: 1, kv_lora_rank: 512, qk_rope_head_dim: 64, dtype_bytes: 1}\nprefill: {page_size: 64}\ndecode: {tp: 8, dcp: 8, page_size: 64}\nrequests:\n  - {tokens: 1000, prefill_pages: [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115], decode_pages: [3, 9]}\nexpect: ok\n",
    );
    let problem = scenario("model: {layers: 1, kv_lora_rank: 512, qk_rope_head_dim: 64, dtype_bytes: 1}\nprefill: {page_size: 64}\ndecode: {tp: 8, dcp: 8, page_size: 64}\nrequests:\n  - {tokens: 1000, prefill_pages: [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115], decode_pages: [3, 9]}\nexpect: ok\n").problem;
    let layout = kvrelay::render::layout(&problem, &outcome.observation, Some(RankId::new(0, 5)));
    assert!(layout.contains("rows 192..255 <- request 0 positions 5..509 step 8 from prefill pp0/tp0"), "{layout}");
    assert!(layout.contains("rows 576..636 <- request 0 positions 517..997 step 8 from prefill pp0/tp0"), "{layout}");
}

const HYBRID: &str = "model:\n  layers: 4\n  kv_layers: [1, 3]\n";

/// State rejections of domain.md §3.4 and §8, each raised before any byte moves.
#[rstest]
#[case::non_mla_dsa_cannot_change_tp(
    "  kv_heads: 4\n  head_dim: 64\n  dtype_bytes: 2\n  state: [{kind: dsa, layers: [0, 2], tensors: [{name: k, item_len: 4096}]}]\nprefill: {tp: 2, page_size: 8}\ndecode: {tp: 4, page_size: 8}\nrequests: [{tokens: 30}]\n",
    PlanErrorKind::TpMismatch,
    "PD Disaggregation does NOT support PD different TP sizes for non-MLA DSA hybrid models yet."
)]
#[case::non_mla_swa_head_slices_need_one_prefill_stage(
    "  kv_heads: 4\n  head_dim: 64\n  dtype_bytes: 2\n  state: [{kind: swa, layers: [0, 2], tensors: [{name: k, item_len: 2048}]}]\nprefill: {tp: 2, pp: 2, page_size: 8}\ndecode: {tp: 4, page_size: 8}\nrequests: [{tokens: 30}]\n",
    PlanErrorKind::TpMismatch,
    "PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid models with pipeline parallelism yet."
)]
#[case::replicated_mamba_item_lengths_differ(
    "  kv_lora_rank: 12\n  qk_rope_head_dim: 4\n  dtype_bytes: 2\n  state: [{kind: mamba, tensors: [{name: gate, item_len: 64}]}]\nprefill: {tp: 1, page_size: 8}\ndecode: {tp: 2, page_size: 8, state_item_lens: [{component: 0, tensor: 0, item_len: 32}]}\nrequests: [{tokens: 30}]\n",
    PlanErrorKind::StateLayout,
    "Replicated Mamba state item lengths differ (src=64, dst=32)"
)]
#[case::mamba_without_dims_and_other_item_lengths(
    "  kv_lora_rank: 12\n  qk_rope_head_dim: 4\n  dtype_bytes: 2\n  state: [{kind: mamba, tensors: [{name: temporal, dim: 8, unit_bytes: 16}]}]\nprefill: {tp: 1, page_size: 8, metadata_components: 0}\ndecode: {tp: 2, page_size: 8}\nrequests: [{tokens: 30}]\n",
    PlanErrorKind::StateLayout,
    "Mamba state layouts differ between prefill and decode (src item 128, dst item 64) and no slice dims were advertised"
)]
#[case::paged_state_with_nothing_to_overlap(
    "  kv_lora_rank: 12\n  qk_rope_head_dim: 4\n  dtype_bytes: 2\n  state: [{kind: swa, layers: [0, 2], tensors: [{name: k, item_len: 64}]}]\nprefill: {page_size: 8}\ndecode: {page_size: 8}\nrequests: [{tokens: 30, state_pages: [{component: 0, prefill: 2, decode: 0}]}]\n",
    PlanErrorKind::StateIndices,
    "No overlapping state indices for state_type=swa"
)]
#[case::paged_state_into_a_dcp_decode(
    "  kv_lora_rank: 12\n  qk_rope_head_dim: 4\n  dtype_bytes: 2\n  state: [{kind: dsa, layers: [0, 2], tensors: [{name: index_k, item_len: 64}]}]\nprefill: {page_size: 8}\ndecode: {tp: 2, dcp: 2, page_size: 8}\nrequests: [{tokens: 30}]\n",
    PlanErrorKind::DcpUnsupported,
    "PD DCP relayout does not support paged state component dsa"
)]
fn state_rejections_name_the_rule(#[case] rest: &str, #[case] kind: PlanErrorKind, #[case] message: &str) {
    let yaml = format!("{HYBRID}{rest}expect: {{error: {kind}, text: \"{message}\"}}\n");
    let outcome = check_run(&yaml);
    let error = outcome.plan.as_ref().unwrap_err();
    assert_eq!(error.kind(), kind);
    // The wording is the claim here: each names the rule of domain.md §3.4 / §8 it enforces.
    assert_eq!(error.to_string(), message);
    assert_all_sentinel(&outcome);
}

/// Bad state metadata is an error, never an index panic: a dim that disagrees with the other side.
#[test]
fn inconsistent_state_dims_are_a_clear_error() {
    let yaml = format!(
        "{HYBRID}  kv_lora_rank: 12\n  qk_rope_head_dim: 4\n  dtype_bytes: 2\n  state: [{{kind: mamba, tensors: [{{name: temporal, dim: 8, unit_bytes: 16}}]}}]\nprefill: {{tp: 1, page_size: 8, metadata_overrides: [{{component: 0, entry: 1, dim: 5}}]}}\ndecode: {{tp: 2, page_size: 8}}\nrequests: [{{tokens: 30}}]\nexpect: ok\n"
    );
    let error = plan::plan(&scenario(&yaml).problem).unwrap_err();
    assert_eq!(error.kind(), PlanErrorKind::StateMetadata);
    // The claim is the clarity of the message: it names the component, the entry and both sides' dims.
    assert_eq!(
        error.to_string(),
        "invalid state metadata for component 0 entry 1: dims disagree: prefill 5 x tp 1 != decode 4 x tp 2"
    );
}

/// An older decode peer sends no dims for a replicated Mamba tensor while two prefill ranks aggregate into it:
/// only the group's first rank may write the whole item, or the slot would be written twice (found in review).
#[test]
fn replicated_state_without_dims_is_written_once_when_aggregating() {
    let outcome = check_run(&format!(
        "{HYBRID}  kv_lora_rank: 12\n  qk_rope_head_dim: 4\n  dtype_bytes: 2\n  state: [{{kind: mamba, layers: [0, 2], tensors: [{{name: gate, item_len: 64}}]}}]\nprefill: {{tp: 2, page_size: 8}}\ndecode: {{tp: 1, page_size: 8, metadata_components: 0}}\nrequests: [{{tokens: 30}}]\nexpect: ok\n"
    ));
    let state_sources: Vec<RankId> = outcome
        .plan
        .unwrap()
        .groups
        .iter()
        .filter(|group| matches!(group.kind, plan::TransferKind::State { .. }))
        .map(|group| group.source)
        .collect();
    assert_eq!(state_sources, vec![RankId::new(0, 0)]);
}

/// domain.md §2.7: under DCP relayout one-sided layer ids are an error even with prefill PP1 (found in review).
#[test]
fn dcp_relayout_rejects_one_sided_layer_ids() {
    let yaml = "model: {layers: 3, kv_lora_rank: 12, qk_rope_head_dim: 4, dtype_bytes: 2}\nprefill: {page_size: 4}\ndecode: {tp: 2, dcp: 2, page_size: 4, layer_ids: false}\nrequests: [{tokens: 20}]\nexpect: {error: layer_metadata}\n";
    let outcome = check_run(yaml);
    assert_eq!(outcome.plan.unwrap_err(), PlanError::OneSidedLayerMetadata);
}

/// domain.md §7 and PR #37358: with early send on, prefill sends the page-aligned cached prefix as an early chunk
/// to a peer with the same layout, and skips it when a peer needs DCP relayout; both transfers stay byte-exact.
#[rstest]
#[case::same_layout("decode: {tp: 2, page_size: 16}", "early send of cached positions 32..64, chunks [32, 16, 22]")]
#[case::dcp_relayout("decode: {tp: 2, dcp: 2, page_size: 16}", "early send skipped: a peer needs DCP relayout")]
fn early_send_follows_the_peers_layout(#[case] decode: &str, #[case] note: &str) {
    let yaml = format!(
        "model: {{preset: deepseek-v2-lite, layers: 2}}\nprefill: {{early_send: true, page_size: 16}}\n{decode}\nrequests:\n  - {{tokens: 102, decode_prefix: 32, cached_prefix: 70, chunks: [48, 22]}}\nexpect: ok\n"
    );
    let options = kvrelay::engine::sim::SimOptions { trace: true, ..Default::default() };
    let outcome =
        kvrelay::harness::run_with(&scenario(&yaml), &kvrelay::harness::Budget::bytes(1 << 30), &options).unwrap();
    assert!(outcome.passed(), "{}", outcome.failure_text("; "));
    let trace: Vec<String> = outcome.engine.unwrap().trace.iter().map(ToString::to_string).collect();
    let trace = trace.join("\n");
    assert!(trace.contains(note), "{trace}");
}

/// A decode DP group that no request is dispatched to is written nothing, and the run still ends: its ranks have
/// no rooms and contact no prefill rank (DP attention, src/pure/plan/SGLANG.md). The other group's ranks receive the
/// one request.
#[test]
fn a_decode_dp_group_without_requests_is_written_nothing() {
    let yaml = "model: {preset: deepseek-v2-lite, layers: 2}\nprefill: {tp: 2, dp: 2, page_size: 16}\n\
                decode: {tp: 4, dp: 2, page_size: 16}\nrequests:\n  - tokens: 40\nexpect: ok\n";
    let loaded = kvrelay::scenario::parse(yaml, "x.yaml", "x").unwrap();
    let outcome = kvrelay::harness::run(&loaded).unwrap();
    assert!(outcome.passed(), "{}", outcome.failure_text("; "));
    let written: std::collections::BTreeSet<u32> =
        outcome.observation.writes.iter().map(|write| write.target.rank.dp).collect();
    assert_eq!(written, [0].into());
    let rooms = &outcome.engine.as_ref().expect("engines ran").rooms;
    assert!(rooms.iter().filter(|(rank, _)| rank.dp == 1).all(|(_, rooms)| rooms.is_empty()), "{rooms:?}");
    assert!(rooms.iter().filter(|(rank, _)| rank.dp == 0).all(|(_, rooms)| rooms.len() == 1), "{rooms:?}");
}
