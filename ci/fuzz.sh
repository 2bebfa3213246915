#!/usr/bin/env bash
# Fuzz smoke for the scenario loader (tests/fuzz): libFuzzer for a bounded time, seeded with every scenario, every
# kept hostile file and one structure-aware seed per corpus scenario. A crash fails CI; keep its input as
# tests/hostile/fuzz-<name>.yaml (with a `#` comment saying what it found) and accept the snapshot it adds.
# Usage: bash ci/fuzz.sh [SECONDS]   (default 120)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-120}"
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: no nightly toolchain on this machine; the fuzz smoke needs one (cargo-fuzz uses -Zsanitizer)" >&2
    exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --version 0.13.2
fi
corpus=tests/fuzz/corpus/scenario
mkdir -p "$corpus"
find scenarios tests/hostile -name '*.yaml' -size -64k -exec cp {} "$corpus"/ \;
for index in $(seq 0 14); do
    printf "\xff\x$(printf %02x "$index")\x05\x03\x11\x0e" > "$corpus/seed-structured-$index"
done
cargo +nightly fuzz run --fuzz-dir tests/fuzz scenario "$corpus" -- \
    -dict=tests/fuzz/scenario.dict -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=10 -print_final_stats=1
