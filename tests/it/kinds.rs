//! Error kinds: scenarios and tests match on a rejection's kind, not on its wording.

use std::path::Path;

use kvrelay::control::{self, ControlErrorKind};
use kvrelay::external::protocol::{self, ProtocolErrorKind};
use kvrelay::plan::{self, PlanErrorKind};
use kvrelay::scenario::{self, Expectation, ScenarioErrorKind};
use kvrelay::{harness, wire};
use rstest::rstest;

use crate::support::scenario;

/// Each rejection scenario of the corpus is refused with the kind its file names.
#[rstest]
#[case::conv_groups_aggregation("probes/conv-groups-aggregation.yaml", PlanErrorKind::StateMetadata)]
#[case::no_layer_ids_mla_pp2("probes/no-layer-ids-mla-pp2.yaml", PlanErrorKind::LayerMetadata)]
#[case::too_few_pages_page_copy("probes/too-few-decode-pages-page-copy.yaml", PlanErrorKind::TooFewPages)]
#[case::mha_pp_partition_no_layer_ids("probes/mha-pp-partition-no-layer-ids.yaml", PlanErrorKind::LayerMetadata)]
#[case::prefill_only_draft_no_layer_ids("probes/prefill-only-draft-no-layer-ids.yaml", PlanErrorKind::LayerMetadata)]
#[case::prefill_only_draft("rejections/prefill-only-draft.yaml", PlanErrorKind::MissingLayer)]
#[case::conv_groups_out_of_range("rejections/conv-groups-out-of-range.yaml", PlanErrorKind::StateMetadata)]
#[case::dcp_2_to_8("rejections/dcp-2-to-8.yaml", PlanErrorKind::DcpUnsupported)]
#[case::decode_dcp_with_prefill_cp("rejections/decode-dcp-with-prefill-cp.yaml", PlanErrorKind::DcpUnsupported)]
#[case::dcp_kv_geometry_differs("rejections/dcp-kv-geometry-differs.yaml", PlanErrorKind::GeometryMismatch)]
#[case::decode_missing_layer("rejections/decode-missing-layer.yaml", PlanErrorKind::MissingLayer)]
#[case::draft_geometry_v1("rejections/draft-geometry-v1.yaml", PlanErrorKind::GeometryMismatch)]
#[case::layer_ids_one_side("rejections/layer-ids-one-side.yaml", PlanErrorKind::LayerMetadata)]
#[case::mamba_slot_size_mismatch("rejections/mamba-slot-size-mismatch.yaml", PlanErrorKind::StateLayout)]
#[case::mha_decode_dcp("rejections/mha-decode-dcp.yaml", PlanErrorKind::DcpUnsupported)]
#[case::replicated_mamba_one_side("rejections/replicated-mamba-one-side.yaml", PlanErrorKind::StateMetadata)]
#[case::mla_tp_mismatch_item_length("rejections/mla-tp-mismatch-item-length.yaml", PlanErrorKind::GeometryMismatch)]
#[case::swa_ring_length_mismatch("rejections/swa-ring-length-mismatch.yaml", PlanErrorKind::StateIndices)]
#[case::swa_head_slice_under_pp("rejections/swa-head-slice-under-pp.yaml", PlanErrorKind::TpMismatch)]
#[case::swa_head_slice_item_split("rejections/swa-head-slice-item-split.yaml", PlanErrorKind::StateLayout)]
#[case::dsa_mha_tp_mismatch("rejections/dsa-mha-tp-mismatch.yaml", PlanErrorKind::TpMismatch)]
#[case::too_few_decode_pages("rejections/too-few-decode-pages.yaml", PlanErrorKind::TooFewPages)]
#[case::sharded_draft_under_dcp("rejections/sharded-draft-under-dcp.yaml", PlanErrorKind::GeometryMismatch)]
#[case::unaligned_decode_prefix("rejections/unaligned-decode-prefix.yaml", PlanErrorKind::UnalignedPrefix)]
#[case::registration_error_on_one_rank(
    "engines/k3-registration-error-on-one-rank.yaml",
    PlanErrorKind::GeometryMismatch
)]
#[case::one_request_fails_beside_one("engines/one-request-fails-beside-one.yaml", PlanErrorKind::UnalignedPrefix)]
fn each_rejection_scenario_yields_its_kind(#[case] file: &str, #[case] kind: PlanErrorKind) {
    let loaded = scenario::load(&Path::new("scenarios").join(file)).unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(loaded.expect.error().map(|expected| expected.kind), Some(kind), "{file}");
    let error = plan::plan(&loaded.problem).expect_err("the planner rejects");
    assert_eq!(error.kind(), kind, "{file}: {error}");
}

/// The cases above are every scenario of the corpus that expects a rejection.
#[test]
fn every_scenario_expecting_a_rejection_is_listed() {
    let mut expecting = 0;
    for entry in walk(Path::new("scenarios")) {
        let loaded = scenario::load(&entry).unwrap_or_else(|error| panic!("{error}"));
        if loaded.expect != Expectation::Ok {
            expecting += 1;
        }
    }
    assert_eq!(expecting, 26);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else if path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml") {
            files.push(path);
        }
    }
    files
}

const DCP_2_TO_8: &str =
    "model: {preset: kimi-k3, state: [], layers: 2}\nprefill: {tp: 2, dcp: 2, page_size: 4}\ndecode: {tp: 8, dcp: 8, page_size: 4}\nrequests: [{tokens: 40}]\n";

/// An unknown kind (or the old exact-text form) is a load error naming the file, the field and every valid kind.
#[rstest]
#[case::a_made_up_kind("{error: nope}", "unknown error kind `nope`")]
#[case::the_old_exact_text_form(
    "{error: \"Unsupported PD DCP topology: 2 -> 8\"}",
    "the exact message goes in `text:`"
)]
fn an_unknown_kind_in_expect_is_refused_naming_the_valid_kinds(#[case] expect: &str, #[case] says: &str) {
    let yaml = format!("{DCP_2_TO_8}expect: {expect}\n");
    let error = scenario::parse(&yaml, "bad-expect.yaml", "bad-expect").expect_err("refused");
    assert_eq!(error.kind(), ScenarioErrorKind::UnknownErrorKind);
    let message = error.to_string();
    assert!(message.starts_with("bad-expect.yaml:5: expect.error: "), "{message}");
    assert!(message.contains(says), "{message}");
    for kind in PlanErrorKind::ALL {
        assert!(message.contains(&format!("`{kind}`")), "{message} does not name {kind}");
    }
}

/// The kind decides; the text, when given, must be exact; a wrong kind or text fails the run.
#[rstest]
#[case::the_kind("{error: dcp_unsupported}", true)]
#[case::the_kind_and_its_text("{error: dcp_unsupported, text: \"Unsupported PD DCP topology: 2 -> 8\"}", true)]
#[case::another_kind("{error: rank_mapping}", false)]
#[case::the_kind_and_other_text("{error: dcp_unsupported, text: \"Unsupported PD DCP topology\"}", false)]
#[case::a_clean_transfer("ok", false)]
fn the_expectation_holds_the_kind_and_any_text(#[case] expect: &str, #[case] passes: bool) {
    let loaded = scenario(&format!("{DCP_2_TO_8}expect: {expect}\n"));
    let outcome = harness::run(&loaded).expect("within the memory budget");
    assert_eq!(outcome.passed(), passes, "{:?}", outcome.failures);
    if !passes {
        let failure = outcome.failure_text("; ");
        assert!(failure.contains("dcp_unsupported") || failure.contains("planner rejected"), "{failure}");
    }
}

/// Every kind enum round-trips through its name, and names are unique snake_case.
#[test]
fn kind_names_round_trip() {
    fn check<K: Copy + PartialEq + std::fmt::Debug>(
        all: &[K],
        name: impl Fn(&K) -> &'static str,
        parse: impl Fn(&str) -> Option<K>,
    ) {
        let mut seen = std::collections::BTreeSet::new();
        for kind in all {
            let text = name(kind);
            assert!(text.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'), "{text}");
            assert!(seen.insert(text), "{text} twice");
            assert_eq!(parse(text), Some(*kind));
        }
    }
    check(PlanErrorKind::ALL, PlanErrorKind::name, PlanErrorKind::parse);
    check(ScenarioErrorKind::ALL, ScenarioErrorKind::name, ScenarioErrorKind::parse);
    check(wire::WireErrorKind::ALL, wire::WireErrorKind::name, wire::WireErrorKind::parse);
    check(ControlErrorKind::ALL, ControlErrorKind::name, ControlErrorKind::parse);
    check(ProtocolErrorKind::ALL, ProtocolErrorKind::name, ProtocolErrorKind::parse);
}

/// Loader diagnostics carry the kind of what stopped the file.
#[rstest]
#[case::not_utf8(b"model: \xff\n".as_slice(), ScenarioErrorKind::NotText)]
#[case::yaml_syntax(b"model: {preset: kimi-k3\n".as_slice(), ScenarioErrorKind::Syntax)]
#[case::unknown_field(b"model: {preset: kimi-k3}\nprefil: {}\n".as_slice(), ScenarioErrorKind::Schema)]
#[case::invalid_value(
    b"model: {preset: kimi-k9}\nprefill: {page_size: 4}\ndecode: {page_size: 4}\nrequests: [{tokens: 8}]\nexpect: ok\n".as_slice(),
    ScenarioErrorKind::InvalidValue
)]
#[case::over_a_limit(
    b"model: {preset: kimi-k3, layers: 100000}\nprefill: {page_size: 4}\ndecode: {page_size: 4}\nrequests: [{tokens: 8}]\nexpect: ok\n".as_slice(),
    ScenarioErrorKind::TooLarge
)]
fn loader_diagnostics_have_kinds(#[case] bytes: &[u8], #[case] kind: ScenarioErrorKind) {
    let error = scenario::parse_bytes(bytes, "kinds.yaml", "kinds", None).expect_err("refused");
    assert_eq!(error.kind(), kind, "{error}");
}

/// Plan-protocol answers that are not answers are refused by kind.
#[rstest]
#[case::not_json("{", ProtocolErrorKind::NotJson)]
#[case::another_query(r#"{"type":"plan","id":8,"copies":[]}"#, ProtocolErrorKind::WrongAnswer)]
#[case::no_copies(r#"{"type":"plan","id":7}"#, ProtocolErrorKind::Malformed)]
#[case::a_short_copy(r#"{"type":"plan","id":7,"copies":[[0,1,2]]}"#, ProtocolErrorKind::Malformed)]
#[case::a_chunk_too_far(r#"{"type":"plan","id":7,"copies":[[3,0,0,0,0,8]]}"#, ProtocolErrorKind::Malformed)]
fn malformed_answers_have_kinds(#[case] line: &str, #[case] kind: ProtocolErrorKind) {
    assert_eq!(protocol::parse_answer(line, 7, 3).expect_err("refused").kind(), kind);
}

/// A control stream that ends, or holds no frame, is refused by kind.
#[rstest]
#[case::ended(Vec::new(), ControlErrorKind::Disconnected)]
#[case::mid_frame(vec![20, 0, 0, 0, 1], ControlErrorKind::Disconnected)]
#[case::too_large(u32::MAX.to_le_bytes().to_vec(), ControlErrorKind::BadFrame)]
fn control_read_errors_have_kinds(#[case] bytes: Vec<u8>, #[case] kind: ControlErrorKind) {
    let error = control::read_frame(&mut bytes.as_slice()).expect_err("refused");
    assert_eq!(error.kind(), kind, "{error}");
}

/// The fabric registry, the transports and the seam answer with kinds: an unknown `--fabric`, a verbs endpoint asked
/// of a transport that meets only the seam, a batch on a connection never opened.
#[test]
fn fabric_transport_and_seam_errors_have_kinds() {
    use kvrelay::certify::{SimTransport, Transport, TransportErrorKind};
    use kvrelay::fabric::registry::Fabric;
    use kvrelay::fabric::seam::{Batch, ConnId, SeamErrorKind};
    use kvrelay::fabric::verbs::NodeId;
    let unknown = Fabric::parse("carrier-pigeon", None).unwrap_err();
    assert_eq!(unknown.kind(), TransportErrorKind::UnknownFabric);
    let mut requests = crate::certify::requests::Requests::new(false);
    let caps = kvrelay::harness::RDMA_CAPS;
    assert_eq!(requests.open(NodeId(0), caps).err().map(|error| error.kind()), Some(TransportErrorKind::NotVerbs));
    let mut engine = SimTransport::eager().engine(NodeId(0), caps).unwrap();
    let error = engine.submit(ConnId(7), Batch::default()).unwrap_err();
    assert_eq!(error.kind(), SeamErrorKind::UnknownConnection);
}

/// A run's failures carry kinds: a planner in the seat that sends nothing fails by the oracle (and the rooms still
/// succeed); a scenario whose plan is rejected where a clean transfer is expected fails by its expectation.
#[test]
fn run_failures_have_kinds() {
    use kvrelay::engine::seat::{LinkQuery, Planner, SeatCopy, SeatError, SeatQuery, SharedPlanner};
    use kvrelay::harness::{Budget, FailureKind, Run};
    struct Nothing;
    impl Planner for Nothing {
        fn link(&mut self, _: &LinkQuery<'_>) -> Result<(), SeatError> {
            Ok(())
        }
        fn plan(&mut self, query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, SeatError> {
            Ok(vec![Vec::new(); query.request.chunks.len()])
        }
    }
    let clean = scenario(&std::fs::read_to_string("scenarios/basic/mla-tp2-to-tp4.yaml").unwrap());
    let seat = SharedPlanner(std::rc::Rc::new(std::cell::RefCell::new(Nothing)));
    let outcome = Run::new(&clean, &Budget::bytes(1 << 30)).planner(Some(seat)).execute().unwrap();
    assert!(outcome.failed_with(FailureKind::Oracle), "{}", outcome.failure_text("; "));
    assert!(!outcome.failed_with(FailureKind::Rooms), "{}", outcome.failure_text("; "));
    let rejected = std::fs::read_to_string("scenarios/rejections/dcp-2-to-8.yaml").unwrap();
    let (body, _) = rejected.split_once("expect:").unwrap();
    let expects_clean = scenario(&format!("{body}expect: ok\n"));
    let outcome = Run::new(&expects_clean, &Budget::bytes(1 << 30)).execute().unwrap();
    assert!(outcome.failed_with(FailureKind::Expectation), "{}", outcome.failure_text("; "));
}
