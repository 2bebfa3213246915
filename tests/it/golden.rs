//! Golden per-shard layouts: every scenario file, run on the in-memory fabric, rendered and snapshotted.

use kvrelay::{harness, render, scenario};

/// One snapshot per scenario in golden/, named `golden@<path under scenarios/ with / as __>.snap`.
#[test]
fn golden() {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../../golden");
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.bind(|| {
        insta::glob!("../../scenarios", "**/*.{yaml,yml}", |path| {
            let scenario = scenario::load(path).unwrap_or_else(|error| panic!("{error}"));
            let outcome = harness::run(&scenario).expect("within the memory budget");
            // The snapshot carries the verdict, so a failing scenario can never be accepted silently.
            assert!(
                outcome.passed(),
                "{}: {}\n{}reproduce: cargo run --release -- run {}",
                scenario.name,
                outcome.failure_text("; "),
                render::violations(&outcome.violations),
                path.display()
            );
            insta::assert_snapshot!(render::golden(&scenario, &outcome));
        });
    });
}
