//! Helpers every test goes through.

use kvrelay::harness::{self, Outcome};
use kvrelay::scenario::{self, Scenario};

/// Parses an inline scenario, panicking with its diagnostics.
#[track_caller]
pub(crate) fn scenario(yaml: &str) -> Scenario {
    scenario::parse(yaml, "<inline>", "inline").unwrap_or_else(|error| panic!("bad test scenario:\n{error}"))
}

/// Runs an inline scenario and asserts its own expectation holds.
#[track_caller]
pub(crate) fn check_run(yaml: &str) -> Outcome {
    let scenario = scenario(yaml);
    let outcome = harness::run(&scenario).expect("within the memory budget");
    assert!(
        outcome.passed(),
        "\n--- failures ---\n{}\n--- violations ---\n{}--- reproduce: save this scenario to a file, then `cargo run --release -- run <file>` ---\n{yaml}",
        outcome.failure_text("\n"),
        kvrelay::render::violations(&outcome.violations)
    );
    outcome
}

/// Runs the `kvrelay` binary from the repository root (without any `KVRELAY_SEED` of the caller's shell).
pub(crate) fn kvrelay(args: &[&str]) -> std::process::Output {
    kvrelay_with_env(args, &[])
}

/// [`kvrelay`] with these environment variables set.
pub(crate) fn kvrelay_with_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("KVRELAY_SEED")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// Output bytes as text.
pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
