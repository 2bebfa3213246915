use kvrelay::explain::{explain, render, Path};
use kvrelay::scenario;
use rstest::rstest;

/// Each scenario's transfers take the SGLang paths named, and no path it does not use.
#[rstest]
#[case::dcp_relayout("scenarios/basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml", &[Path::DcpRelayout, Path::MambaSlice], &[Path::PageCopy, Path::HeadSlice])]
#[case::head_slice("scenarios/mha/llama-3-70b-tp4-to-tp8.yaml", &[Path::HeadSlice], &[Path::PageCopy, Path::DcpRelayout])]
#[case::mla_page_copy("scenarios/basic/mla-tp2-to-tp4.yaml", &[Path::PageCopy], &[Path::HeadSlice, Path::DcpRelayout])]
#[case::replicated_state("scenarios/state/replicated-mamba-tp4-to-tp2.yaml", &[Path::ReplicatedState, Path::MambaSlice], &[Path::MambaSlot])]
#[case::paged_state("scenarios/state/swa-one-page-drift.yaml", &[Path::PagedState], &[Path::MambaSlice, Path::SwaHeadSlice])]
#[case::swa_head_slice("scenarios/state/swa-head-slice-tp2-to-tp4.yaml", &[Path::SwaHeadSlice, Path::HeadSlice], &[Path::PagedState])]
#[case::positional("scenarios/probes/no-layer-ids-mha-tp2.yaml", &[Path::PositionalPairing, Path::PageCopy], &[Path::LayerIdPairing])]
#[case::hisparse_host("scenarios/state/deepseek-v3.2-hisparse-decode-mtp.yaml", &[Path::HiSparseHost, Path::Draft, Path::PagedState], &[Path::PageCopy])]
#[case::staging("scenarios/mha/gqa-staging-tp4-to-tp2.yaml", &[Path::Staging], &[Path::HeadSlice, Path::PageCopy])]
fn explain_names_the_paths_a_scenario_takes(#[case] file: &str, #[case] taken: &[Path], #[case] not_taken: &[Path]) {
    let loaded = scenario::load(std::path::Path::new(file)).unwrap();
    let res = explain(&loaded.problem);
    assert!(res.rejected.is_none(), "{res:?}");
    for path in taken {
        assert!(res.paths.get(path).is_some_and(|used| used.bytes > 0 || used.groups > 0), "{path:?} not in {res:?}");
    }
    for path in not_taken {
        assert!(!res.paths.contains_key(path), "{path:?} in {res:?}");
    }
    let text = render(&loaded.name, &res);
    for path in taken {
        assert!(text.contains(path.describe().1), "{text}");
    }
}

/// The replicated tensor's bytes are counted once per decode rank (one writer), not once per prefill rank.
#[test]
fn replicated_state_counts_one_writer_per_decode_rank() {
    let loaded = scenario::load(std::path::Path::new("scenarios/state/replicated-mamba-tp4-to-tp2.yaml")).unwrap();
    let used = &explain(&loaded.problem).paths[&Path::ReplicatedState];
    // 2 requests x 2 layers x 256-byte slot x 2 decode ranks.
    assert_eq!(used.bytes, 2 * 2 * 256 * 2);
}

/// A rejected scenario names its rejection and no path.
#[test]
fn a_rejection_is_explained_as_one() {
    let loaded = scenario::load(std::path::Path::new("scenarios/rejections/replicated-mamba-one-side.yaml")).unwrap();
    let res = explain(&loaded.problem);
    assert!(res.paths.is_empty());
    assert!(render(&loaded.name, &res).contains("rejected before any transfer (state_metadata)"));
}

/// Head-sliced SWA moves each decode rank's share of every window page once: 2 layers x 2 tensors x the request's
/// window pages x 8 tokens x one 128-byte head, on each of 4 decode ranks.
#[test]
fn swa_head_slices_count_one_head_per_token_per_decode_rank() {
    let loaded = scenario::load(std::path::Path::new("scenarios/state/swa-head-slice-tp2-to-tp4.yaml")).unwrap();
    let used = &explain(&loaded.problem).paths[&Path::SwaHeadSlice];
    let pages = loaded.problem.requests[0].decode_state.pages[0].len() as u64;
    assert_eq!(used.bytes, 2 * 2 * pages * 8 * 128 * 4);
}
