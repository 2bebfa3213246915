#!/usr/bin/env bash
# Fuzz smoke for kvrelay's decoders of untrusted input (tests/fuzz), libFuzzer for a bounded time split evenly
# between two targets:
# - scenario: the scenario loader, planner and oracle, seeded with every scenario, every kept hostile file and one
#   structure-aware seed per corpus scenario. Keep a crash as tests/hostile/fuzz-<name>.yaml (with a `#` comment
#   saying what it found) and accept the snapshot it adds.
# - wire: every wire message decoder (src/wire/README.md) with a round trip of each accepted message, seeded with
#   one structure-aware seed per golden message. Keep a crash's frame list in tests/it/wire.rs::FUZZ_CRASHES.
# - control: the control-plane frame decoder of the bootstrap hub and rank processes (src/control/frame.rs), with a
#   round trip of each accepted frame.
# - planner: the parser of an external planner's lines (src/external/protocol.rs), with a round trip of each
#   accepted plan answer.
# A crash fails CI. Usage: bash ci/fuzz.sh [SECONDS]   (default 120: 40 % each to scenario and wire, 10 % each to
# control and planner)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-120}"
half=$(( seconds * 40 / 100 > 0 ? seconds * 40 / 100 : 1 ))
tenth=$(( seconds / 10 > 0 ? seconds / 10 : 1 ))
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
    -dict=tests/fuzz/scenario.dict -max_total_time="$half" -rss_limit_mb=4096 -timeout=10 -print_final_stats=1

# Mode byte 0x80 + k starts from golden message k unchanged (tests/fuzz/fuzz_targets/wire.rs); 7 goldens.
corpus=tests/fuzz/corpus/wire
mkdir -p "$corpus"
for index in $(seq 0 6); do
    printf "\x$(printf %02x $(( 0x80 + index )))" > "$corpus/seed-golden-$index"
done
cargo +nightly fuzz run --fuzz-dir tests/fuzz wire "$corpus" -- \
    -dict=tests/fuzz/wire.dict -max_total_time="$half" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1

# A hello, a message and a stop frame body (kind, from, to, parts) as seeds.
corpus=tests/fuzz/corpus/control
mkdir -p "$corpus"
printf '\x01\x00\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00' > "$corpus/seed-hello"
printf '\x03\x01\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x03\x00\x00\x00abc' > "$corpus/seed-message"
printf '\x05\xff\xff\xff\xff\x02\x00\x00\x00\x00\x00\x00\x00' > "$corpus/seed-stop"
cargo +nightly fuzz run --fuzz-dir tests/fuzz control "$corpus" -- \
    -max_total_time="$tenth" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1

# A plan answer with two copies, a rejection and a hello as seeds.
corpus=tests/fuzz/corpus/planner
mkdir -p "$corpus"
printf '{"type":"plan","id":7,"copies":[[0,1,0,2,64,64],[2,0,8,0,0,8]]}' > "$corpus/seed-copies"
printf '{"type":"plan","id":7,"error":"no"}' > "$corpus/seed-error"
printf '{"type":"hello","protocol":"kvrelay-plan","version":1,"planner":"x"}' > "$corpus/seed-hello"
cargo +nightly fuzz run --fuzz-dir tests/fuzz planner "$corpus" -- \
    -max_total_time="$tenth" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1
