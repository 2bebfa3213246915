#!/usr/bin/env bash
# The certification kit in CI (issue 9): transports plugged in two of the three ways certified on this host, each
# clean (must be CERTIFIED, exit 0) and with a planted wrong offset (must be NOT CERTIFIED, exit 1), every run
# leaving junit.xml, report.json and manifest.txt under target/certify/. The third way, the RDMA fabric on
# Soft-RoCE, is certified inside the QEMU guest by ci/rdma.sh.
#   1. kvrelay's in-memory fabric (`--fabric sim`): the baseline the others read against;
#   2. the sample C plug-in (tests/plugins/memcpy/, built by ci/plugin.sh with the system C compiler) loaded with
#      `--fabric plugin:PATH`, clean and built with -DKVRELAY_SAMPLE_PLANT_WRONG_OFFSET;
#   3. a Rust crate calling the library entry point (tests/transports/loopback.rs, `--example certify-loopback`),
#      clean and with --plant-wrong-offset;
#   4. a NIXL-shaped Rust crate meeting the transfer-engine seam directly, not verbs (tests/transports/requests.rs,
#      `--example certify-requests`), clean and with --plant-dropped-tail (a long request's last descriptor dropped
#      while it reports DONE).
#   5. a Python child speaking the transport protocol kvrelay-transport-1 (tests/transports/memcpy_engine.py,
#      `--fabric child:COMMAND`, src/fabric/child/README.md), clean and with --plant-dropped-tail.
set -euo pipefail
cd "$(dirname "$0")/.."

kvrelay=target/release/kvrelay
out=target/certify
failed=()

say() { printf 'certify: %s\n' "$*"; }

# check_files DIR: the three files exist and the JSON report is well-formed JSON with its verdict.
check_files() {
    local dir=$1 file
    for file in junit.xml report.json manifest.txt; do
        [ -s "$dir/$file" ] || { say "MISSING $dir/$file"; return 1; }
    done
    local cases testcases
    cases=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(len(r["cases"]))' "$dir/report.json")
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("certify:   report.json:", r["summary"])' \
        "$dir/report.json"
    testcases=$(grep -c '<testcase ' "$dir/junit.xml")
    say "  junit.xml: $testcases test cases, report.json: $cases cases"
    [ "$testcases" = "$cases" ] || { say "junit.xml and report.json disagree on the cases"; return 1; }
}

# expect VERDICT LABEL DIR COMMAND...: runs COMMAND (which writes into DIR) and requires exit 0 for `pass`,
# exit 1 with failed cases in every file for `fail`.
expect() {
    local verdict=$1 label=$2 dir=$3 rc=0
    shift 3
    printf '\n==> certify: %s (expected: %s)\n' "$label" "$verdict"
    rm -rf "$dir"
    "$@" > "$dir.log" 2>&1 || rc=$?
    grep -E '^(FAIL|UNSUPPORTED|unsupported|fail |throughput:|CERTIFIED|NOT CERTIFIED|wrote)' "$dir.log" | head -n 40 || true
    check_files "$dir" || { failed+=("$label: files"); return; }
    if [ "$verdict" = pass ] && [ "$rc" != 0 ]; then
        failed+=("$label: exit $rc, expected CERTIFIED (log: $dir.log)")
    elif [ "$verdict" = fail ]; then
        if [ "$rc" != 1 ]; then
            failed+=("$label: exit $rc, expected 1 (NOT CERTIFIED)")
        elif ! grep -q '<failure ' "$dir/junit.xml" || ! grep -q '^case: fail ' "$dir/manifest.txt"; then
            failed+=("$label: the planted bug left no failed case in junit.xml and manifest.txt")
        else
            say "  the planted bug is caught: $(grep -c '^case: fail ' "$dir/manifest.txt") failed cases, e.g."
            grep '^case: fail ' "$dir/manifest.txt" | sed -n '1,3s/^/certify:     /p'
        fi
    fi
}

mkdir -p "$out"
cargo build --locked --release --bin kvrelay --example certify-loopback --example certify-requests
bash ci/plugin.sh
plugin=target/plugins/libkvrelay_memcpy.so
planted=target/plugins/libkvrelay_memcpy_planted.so

expect pass "in-memory fabric: kvrelay certify --fabric sim" "$out/sim" \
    "$kvrelay" certify --fabric sim --out "$out/sim"
expect pass "C plug-in: kvrelay certify --fabric plugin:$plugin" "$out/plugin-memcpy" \
    "$kvrelay" certify --fabric "plugin:$plugin" --out "$out/plugin-memcpy"
expect fail "C plug-in with the planted wrong offset: --fabric plugin:$planted" "$out/plugin-memcpy-planted" \
    "$kvrelay" certify --fabric "plugin:$planted" --out "$out/plugin-memcpy-planted"
expect pass "Rust crate: cargo run --example certify-loopback" "$out/loopback" \
    target/release/examples/certify-loopback "$out/loopback"
expect fail "Rust crate with the planted wrong offset: certify-loopback --plant-wrong-offset" "$out/loopback-planted" \
    target/release/examples/certify-loopback "$out/loopback-planted" --plant-wrong-offset
expect pass "NIXL-shaped Rust crate at the transfer-engine seam: cargo run --example certify-requests" "$out/requests" \
    target/release/examples/certify-requests "$out/requests"
expect fail "NIXL-shaped crate with its planted dropped tail: certify-requests --plant-dropped-tail" "$out/requests-planted" \
    target/release/examples/certify-requests "$out/requests-planted" --plant-dropped-tail
child="python3 tests/transports/memcpy_engine.py"
expect pass "Python child over kvrelay-transport-1: --fabric child:$child" "$out/child-memcpy" \
    "$kvrelay" certify --fabric "child:$child" --out "$out/child-memcpy"
expect fail "Python child with its planted dropped tail: --fabric child:$child --plant-dropped-tail" \
    "$out/child-memcpy-planted" \
    "$kvrelay" certify --fabric "child:$child --plant-dropped-tail" --out "$out/child-memcpy-planted"

echo
if [ "${#failed[@]}" -gt 0 ]; then
    for line in "${failed[@]}"; do say "FAILED: $line"; done
    exit 1
fi
say "all nine certification runs ended as expected; reports under $out/"
