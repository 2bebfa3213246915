//! The mutation self-test (`kvrelay selftest`): every planted layout bug is caught by the oracle on a named scenario
//! of the corpus, kvrelay's own plans in the same seat raise no false alarm, a mutant that cannot apply is `n/a`
//! and never counted as caught, and the command fails when a mutant goes uncaught.

use std::path::Path;

use kvrelay::harness::Budget;
use kvrelay::scenario::{self, Scenario};
use kvrelay::selftest::{self, Mutant, Verdict};
use rstest::rstest;

use crate::support::{kvrelay, text};

fn corpus(file: &str) -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(file);
    scenario::load(&path).unwrap_or_else(|error| panic!("{error}"))
}

fn budget() -> Budget {
    Budget::bytes(1 << 30)
}

#[rstest]
#[case::local_layer_ordinal_under_dcp_relayout(
    Mutant::LocalLayerOrdinal,
    "engines/dcp-relayout-two-stages.yaml",
    "kv-relayout"
)]
#[case::local_layer_ordinal_with_paged_state(Mutant::LocalLayerOrdinal, "state/dsa-pp2-to-pp1.yaml", "kv-mla")]
#[case::decode_pages_per_chunk_page_copy(Mutant::DecodePagesPerChunk, "basic/baseline-tp1-to-tp1.yaml", "kv-mla")]
#[case::decode_pages_per_chunk_relayout(
    Mutant::DecodePagesPerChunk,
    "engines/dcp-relayout-two-stages.yaml",
    "kv-relayout"
)]
#[case::final_page_off_by_one_mla(Mutant::FinalPageOffByOne, "basic/baseline-tp1-to-tp1.yaml", "kv-mla")]
#[case::final_page_off_by_one_relayout(Mutant::FinalPageOffByOne, "probes/odd-page-table-dcp2.yaml", "kv-relayout")]
#[case::final_page_off_by_one_mha(Mutant::FinalPageOffByOne, "mha/gqa-replication-tp1-to-tp16.yaml", "kv-mha")]
#[case::gqa_replication_formula(Mutant::GqaReplicationFormula, "mha/gqa-replication-tp1-to-tp16.yaml", "kv-mha")]
#[case::flat_conv_split(Mutant::FlatConvSplit, "state/older-peer-metadata-defaults.yaml", "mamba-state")]
#[case::destination_by_source_index(Mutant::DestinationBySourceIndex, "state/dsa-pp2-to-pp1.yaml", "paged-state")]
#[case::odd_list_last_entry_kv(Mutant::OddListLastEntry, "basic/baseline-tp1-to-tp1.yaml", "kv-mla")]
#[case::odd_list_last_entry_aux(Mutant::OddListLastEntry, "probes/aggregation-mha-tp4-to-tp1-aux.yaml", "aux")]
#[case::odd_list_last_entry_paged_state(
    Mutant::OddListLastEntry,
    "state/dsa-index-keys-tp2-to-tp4.yaml",
    "paged-state"
)]
#[case::swapped_head_slice_aggregation(
    Mutant::SwappedHeadSlice,
    "probes/aggregation-mha-tp4-to-tp1-aux.yaml",
    "kv-mha"
)]
#[case::swa_swapped_head_slice_scatter(
    Mutant::SwaSwappedHeadSlice,
    "state/swa-head-slice-tp2-to-tp4.yaml",
    "paged-state"
)]
#[case::swa_swapped_head_slice_aggregation(
    Mutant::SwaSwappedHeadSlice,
    "state/swa-head-slice-tp4-to-tp1.yaml",
    "paged-state"
)]
#[case::aux_from_wrong_stage(Mutant::AuxFromWrongStage, "draft/kimi-k3-draft-dcp8.yaml", "aux")]
#[case::state_block_wrong_rank(Mutant::StateBlockWrongRank, "state/older-peer-metadata-defaults.yaml", "mamba-state")]
fn the_oracle_catches_the_mutant(#[case] mutant: Mutant, #[case] file: &str, #[case] kind: &str) {
    let case = selftest::run_case(&corpus(file), &budget(), Some(mutant)).expect("within the budget");
    // Caught by the oracle's byte checks (not merely a room ending badly), with the first violation in
    // coordinates: the decode rank, the region and the place.
    let Verdict::Caught { example, by_oracle } = &case.verdict else {
        panic!("{} on {file}: expected caught, got {:?}", mutant.name(), case.verdict)
    };
    assert!(*by_oracle, "{} on {file}: caught by room outcomes only: {example}", mutant.name());
    assert!(example.starts_with("decode pp"), "{} on {file}: {example}", mutant.name());
    // The bug moved bytes of the transfer kind the case is about, so the catch is about that kind.
    assert!(case.kinds.contains(kind), "{} on {file}: changed {:?}, not {kind}", mutant.name(), case.kinds);
}

#[rstest]
#[case::page_copy("basic/baseline-tp1-to-tp1.yaml")]
#[case::dcp_relayout_under_pp("engines/dcp-relayout-two-stages.yaml")]
#[case::gqa_replication("mha/gqa-replication-tp1-to-tp16.yaml")]
#[case::mamba_state("state/older-peer-metadata-defaults.yaml")]
#[case::paged_state_under_pp("state/dsa-pp2-to-pp1.yaml")]
#[case::swa_head_slices("state/swa-head-slice-tp4-to-tp1.yaml")]
#[case::a_failing_room_as_expected("engines/one-request-fails-beside-one.yaml")]
fn kvrelays_own_plans_in_the_mutant_seat_raise_no_false_alarm(#[case] file: &str) {
    let case = selftest::run_case(&corpus(file), &budget(), None).expect("within the budget");
    assert_eq!(case.verdict, Verdict::Survived { changed: false }, "{file}");
}

#[rstest]
#[case::layer_ordinal_without_pp(Mutant::LocalLayerOrdinal, "basic/baseline-tp1-to-tp1.yaml")]
#[case::gqa_formula_on_mla(Mutant::GqaReplicationFormula, "basic/mla-tp2-to-tp4.yaml")]
#[case::gqa_formula_with_one_head_per_prefill_rank(
    Mutant::GqaReplicationFormula,
    "probes/replicated-heads-tp2-to-tp8.yaml"
)]
#[case::swa_swap_between_replicas(Mutant::SwaSwappedHeadSlice, "state/swa-head-slice-gqa-tp1-to-tp4.yaml")]
#[case::aux_stage_without_pp(Mutant::AuxFromWrongStage, "probes/aggregation-mha-tp4-to-tp1-aux.yaml")]
fn a_mutant_that_cannot_change_a_byte_is_not_applicable(#[case] mutant: Mutant, #[case] file: &str) {
    let case = selftest::run_case(&corpus(file), &budget(), Some(mutant)).expect("within the budget");
    assert!(matches!(case.verdict, Verdict::NotApplicable(_)), "{} on {file}: {:?}", mutant.name(), case.verdict);
}

#[test]
fn selftest_prints_the_table_and_passes_when_every_mutant_is_caught() {
    let output = kvrelay(&[
        "selftest",
        "scenarios/mha",
        "--mutant",
        "gqa-replication-formula",
        "--mutant",
        "swapped-head-slice",
    ]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", text(&output.stderr));
    assert!(stdout.contains("gqa-replication-formula      §3.2  kv-mha"), "{stdout}");
    assert!(
        stdout.contains("    e.g. scenarios/mha/gqa-replication-tp1-to-tp16.yaml: decode pp0/tp1, layer 0 K, row "),
        "{stdout}"
    );
    assert!(stdout.contains("selftest passed: 2 mutants, "), "{stdout}");
    assert!(stdout.contains(" 0 survived, 0 never caught, 0 false alarms"), "{stdout}");
}

#[test]
fn selftest_fails_when_a_mutant_is_never_caught() {
    // The aux stage mutant applies to no scenario with one prefill stage: nothing catches it, so the run fails
    // instead of counting an n/a as a catch.
    let output = kvrelay(&["selftest", "scenarios/basic/baseline-tp1-to-tp1.yaml", "--mutant", "aux-from-wrong-stage"]);
    let stdout = text(&output.stdout);
    assert!(!output.status.success(), "{stdout}");
    assert!(stdout.contains("selftest FAILED: 1 mutants, 0 applicable cases"), "{stdout}");
    assert!(stdout.contains("1 never caught (aux-from-wrong-stage)"), "{stdout}");
}
