#!/usr/bin/env bash
# The checks CI runs, in order; run it locally to get the same verdict.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "format"
cargo fmt --check

step "clippy (warnings denied)"
cargo clippy --locked --all-targets --all-features -- -D warnings

step "tests (README test command; includes golden layouts and tidy)"
cargo test --locked

step "golden gate on the in-memory fabric (README main command)"
cargo run --locked --release -- check

step "planner benchmark smoke (numbers only, never a pass/fail timing)"
cargo run --locked --release -- bench --iterations 5
