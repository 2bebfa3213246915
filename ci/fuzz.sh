#!/usr/bin/env bash
# Fuzz smoke for kvrelay's decoders of untrusted input (tests/fuzz), libFuzzer for a bounded time split between
# five targets:
# - scenario: the scenario loader, planner and oracle, seeded with every scenario, every kept hostile file and one
#   structure-aware seed per corpus scenario. Keep a crash as tests/hostile/fuzz-<name>.yaml (with a `#` comment
#   saying what it found) and accept the snapshot it adds.
# - wire: every wire message decoder (src/pure/wire/README.md) with a round trip of each accepted message, seeded with
#   one structure-aware seed per golden message. Keep a crash's frame list in tests/it/wire.rs::FUZZ_CRASHES.
# - control: the control-plane frame decoder of the bootstrap hub and rank processes (src/running/control/frame.rs), with a
#   round trip of each accepted frame.
# - planner: the parser of an external planner's lines (src/running/external/protocol.rs), with a round trip of each
#   accepted plan answer.
# - plugin_info: a C ABI transport plug-in's info text (src/fabric/plugin.rs, `PluginInfo::parse`).
# - from_config: a Hugging Face config.json for `kvrelay scenario from-config` (src/tools/from_config.rs), seeded
#   with tests/configs/.
# A crash fails CI. Usage: bash ci/fuzz.sh [SECONDS]   (default 120: 40 % each to scenario and wire, 10 % to
# control, 5 % each to planner, plugin_info and from_config)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-120}"
half=$(( seconds * 40 / 100 > 0 ? seconds * 40 / 100 : 1 ))
tenth=$(( seconds / 10 > 0 ? seconds / 10 : 1 ))
twentieth=$(( seconds / 20 > 0 ? seconds / 20 : 1 ))
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: no nightly toolchain on this machine; the fuzz smoke needs one (cargo-fuzz uses -Zsanitizer)" >&2
    exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --version 0.13.2
fi

# fuzz TARGET SECONDS RSS_MB [libFuzzer flags...]: one target on its corpus (tests/fuzz/corpus/TARGET, git-ignored).
fuzz() {
    local target=$1 time=$2 rss=$3
    shift 3
    cargo +nightly fuzz run --fuzz-dir tests/fuzz "$target" "tests/fuzz/corpus/$target" -- \
        -max_total_time="$time" -rss_limit_mb="$rss" -timeout=10 -print_final_stats=1 "$@"
}
mkdir -p tests/fuzz/corpus/{scenario,wire,control,planner,plugin_info,from_config}

find scenarios tests/hostile -name '*.yaml' -size -64k -exec cp {} tests/fuzz/corpus/scenario/ \;
for index in $(seq 0 14); do
    printf "\xff\x$(printf %02x "$index")\x05\x03\x11\x0e" > "tests/fuzz/corpus/scenario/seed-structured-$index"
done
fuzz scenario "$half" 4096 -dict=tests/fuzz/scenario.dict

# Mode byte 0x80 + k starts from golden message k unchanged (tests/fuzz/fuzz_targets/wire.rs); 7 goldens.
for index in $(seq 0 6); do
    printf "\x$(printf %02x $(( 0x80 + index )))" > "tests/fuzz/corpus/wire/seed-golden-$index"
done
fuzz wire "$half" 2048 -dict=tests/fuzz/wire.dict

# Control frame bodies (kind, from, to, parts): a hello, a message and a stop.
printf '\x01\x00\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00' > tests/fuzz/corpus/control/seed-hello
printf '\x03\x01\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x03\x00\x00\x00abc' > tests/fuzz/corpus/control/seed-message
printf '\x05\xff\xff\xff\xff\x02\x00\x00\x00\x00\x00\x00\x00' > tests/fuzz/corpus/control/seed-stop
fuzz control "$tenth" 2048

# Planner lines: a plan answer with two copies, a rejection and a hello.
printf '{"type":"plan","id":7,"copies":[[0,1,0,2,64,64],[2,0,8,0,0,8]]}' > tests/fuzz/corpus/planner/seed-copies
printf '{"type":"plan","id":7,"error":"no"}' > tests/fuzz/corpus/planner/seed-error
printf '{"type":"hello","protocol":"kvrelay-plan","version":1,"planner":"x"}' > tests/fuzz/corpus/planner/seed-hello
fuzz planner "$twentieth" 2048

# A plug-in's info text: the sample's, and one without a version.
printf 'name=memcpy-sample\nversion=1.0.0\nbacking=memcpy\n' > tests/fuzz/corpus/plugin_info/seed-sample
printf 'name=x\n=\nversion\n' > tests/fuzz/corpus/plugin_info/seed-broken
fuzz plugin_info "$twentieth" 1024

# Model configs: the real ones the importer's tests use.
cp tests/configs/*.json tests/fuzz/corpus/from_config/
fuzz from_config "$twentieth" 2048
