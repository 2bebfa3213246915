//! The transfer engines users ship in kvrelay's seat (issue 20): NIXL through its own bindings (feature `nixl`,
//! the pinned wheel's libraries from `ci/engines.sh`). Without the libraries the NIXL tests say so and skip; the
//! missing-library error is tested in every build.

use crate::support::{kvrelay_with_env, text};

/// `--fabric nixl` without NIXL's libraries (or without the feature) is a clear error naming the script that
/// fetches them, never a crash (NIXL's own stub aborts the process when it cannot load the library).
#[test]
fn nixl_without_its_libraries_is_a_clear_error_naming_the_script() {
    let env = [("KVRELAY_NIXL_LIB", "/nonexistent/libnixl_capi.so")];
    let out = kvrelay_with_env(&["run", "scenarios/basic/baseline-tp1-to-tp1.yaml", "--fabric", "nixl"], &env);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("ci/engines.sh"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[cfg(feature = "nixl")]
mod nixl {
    use std::path::Path;

    use kvrelay::certify::{self, CaseSet, Options, Transport, Verdict};
    use kvrelay::fabric::nixl::NixlTransport;
    use kvrelay::harness::{self, Budget, Fabric};

    use crate::support::{kvrelay, text};

    /// NIXL's transport, or `None` (with a line saying why) where its libraries are not there.
    fn nixl() -> Option<NixlTransport> {
        match NixlTransport::new() {
            Ok(transport) => Some(transport),
            Err(error) => {
                let line = format!("skipped: NIXL is not available here ({error})\n");
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
                None
            }
        }
    }

    /// Every seam case and the engine scenarios pass on NIXL, and the report names the engine.
    #[test]
    fn nixl_is_certified_on_the_seam_cases_and_the_engine_scenarios() {
        let Some(mut transport) = nixl() else { return };
        let set = CaseSet::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/engines")).unwrap();
        let options = Options::new(Budget::bytes(1 << 30), "kvrelay certify --fabric nixl");
        let report = certify::certify(&mut transport, &set, &options, &mut |_| {});
        let failed: Vec<_> = report.results.iter().filter(|result| !result.verdict.acceptable()).collect();
        assert!(failed.is_empty(), "{failed:#?}");
        let passed = |group: &str| {
            report.results.iter().filter(|result| result.group == group && result.verdict == Verdict::Pass).count()
        };
        assert_eq!(passed("seam"), certify::seam::cases().len());
        assert_eq!(passed("scenario"), 4);
        assert!(report.certified(), "{}", report.summary());
        assert_eq!(transport.identity().facts["backend"], "UCX");
    }

    /// The Kimi-K3 DCP relayout over NIXL lands byte for byte (the oracle judges every decode rank).
    #[test]
    fn the_kimi_k3_dcp_relayout_lands_byte_exact_over_nixl() {
        if nixl().is_none() {
            return;
        }
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml");
        let scenario = kvrelay::scenario::load(&path).unwrap();
        let outcome = harness::run_on(&scenario, &Budget::from_env().unwrap(), &Fabric::Nixl, false).unwrap();
        assert!(outcome.passed(), "{}", outcome.failure_text("\n"));
        assert!(outcome.violations.is_empty());
    }

    /// Ranks as processes: one NIXL agent per process, its metadata over the bootstrap, every decode rank's
    /// verdict gathered.
    #[test]
    fn ranks_as_processes_run_a_scenario_over_nixl() {
        if nixl().is_none() {
            return;
        }
        let out = kvrelay(&["launch", "scenarios/basic/mla-tp2-to-tp4.yaml", "--fabric", "nixl"]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        assert!(stdout.contains("pass mla-tp2-to-tp4 (6 processes, nixl)"), "{stdout}");
    }

    /// A rank process that never starts: the decode ranks that need it fail their requests within the deadline
    /// with the reason, nothing hangs, and no byte lands wrong (the fault guarantee, on a real engine).
    #[test]
    fn a_rank_that_never_connects_fails_its_requests_within_the_deadline_over_nixl() {
        if nixl().is_none() {
            return;
        }
        let out = kvrelay(&[
            "launch",
            "scenarios/engines/dcp-relayout-two-stages.yaml",
            "--fabric",
            "nixl",
            "--omit",
            "prefill:1",
            "--connect-timeout",
            "3",
            "--timeout",
            "6",
        ]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(!out.status.success(), "{stdout}");
        assert!(stdout.contains("hub: prefill pp1/tp0 never connected"), "{stdout}");
        for rank in ["decode 0 (pp0/tp0)", "decode 1 (pp0/tp1)"] {
            assert!(stdout.contains(&format!("{rank}: 0 of 2 requests succeeded, 0 violations")), "{stdout}");
        }
        assert!(stderr.contains("failed: timed out after 6000000000 ns waiting for the prefill side"), "{stderr}");
    }

    /// `launch --chaos` on NIXL: `kind` on the Kimi-K3 scenario's 16 processes keeps the fault guarantee (every
    /// surviving decode rank's requests Success byte-exact or Failed with a reason, within the deadlines), the
    /// output says what was injected, and the fault did happen (`happened` is in the output).
    fn chaos(kind: &str, injected: &str, happened: &str) {
        if nixl().is_none() {
            return;
        }
        let scenario = "scenarios/basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml";
        // The fault's moment counts from the hub's start. Seed 2 draws 810 ms: inside the transfer on a 2-core
        // machine, where the run ends about 1.2 s after the start and the scenario's own seed (3) draws 1,209 ms,
        // which a fast run ends before (seen once: "the run ended 1203 ms after the start, before the fault").
        let args = ["launch", scenario, "--fabric", "nixl", "--chaos", kind, "--timeout", "15", "--seed", "2"];
        let out = kvrelay(&args);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        assert!(stdout.contains(&format!("chaos {kind}: {injected}")), "{stdout}");
        assert!(
            stdout.contains(&format!("pass kimi-k3-pp8-tp1-to-tp8-dcp8 --chaos {kind} (16 processes, nixl)")),
            "{stdout}"
        );
        assert!(stdout.contains(happened), "the fault never happened:\n{stdout}");
    }

    #[test]
    fn a_prefill_process_killed_mid_transfer_keeps_the_fault_guarantee_over_nixl() {
        chaos("kill-prefill", "SIGKILL to prefill", "signal: 9 (SIGKILL)");
    }

    #[test]
    fn truncated_control_messages_keep_the_fault_guarantee_over_nixl() {
        chaos("truncate-messages", "100 per mille of routed messages cut short", "hub: truncated a message from");
    }
}
