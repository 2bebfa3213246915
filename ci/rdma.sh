#!/usr/bin/env bash
# CI stage: kvrelay over real RDMA verbs, in a QEMU guest with a Soft-RoCE device (rxe0). Called by .ci/run after
# the tests, the golden gate and the benchmark smoke, before fuzzing. Runs by hand the same way: bash ci/rdma.sh
#
#   (a) host packages and the guest image (ci/rdma/build-guest.sh --install)
#   (b) one guest boot: ibv_devinfo and perftest's ib_write_bw in loopback, the device's bandwidth ceiling
#       -- KVRELAY_RDMA_STAGE_ONLY_GUEST=1 stops here --
#   (c) cargo build and cargo test --no-run, --release --features rdma
#   (d) in the guest, each under its own timeout and its own boot: the conformance tests, `kvrelay diff` over
#       ci/rdma/scenarios.txt, `kvrelay launch` of the two-stage DCP scenario as one process per rank, and
#       `kvrelay bench` beside ib_write_bw in one boot (ci/rdma/bench-in-guest.sh) with their ratio.
#       All four run even when one fails; the stage fails if any did.
#
# Every step prints its time, and the stage ends with a table of them and the total. The guest runs under TCG
# emulation on this machine (no usable KVM), so nothing here asserts a speed: the bench ratio is printed only.
# Env knobs (all optional):
#   KVRELAY_RDMA_STAGE_ONLY_GUEST=1   stop after (b): image, boot and device ceiling only
#   KVRELAY_RDMA_TIMEOUT_CEILING / _CONFORMANCE / _DIFF / _LAUNCH / _BENCH   per-boot guest timeouts in seconds
#                                     (defaults below); a guest past its timeout is killed and the step fails
#   KVRELAY_VM_CACHE, KVRELAY_VM_MEM, KVRELAY_VM_SMP, KVRELAY_VM_ACCEL   see ci/rdma/run-in-guest.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The scenario `kvrelay launch` runs with one process per rank over rxe0 (a file in scenarios/engines/): DCP
# relayout across two prefill stages (PP2/TP1 -> TP2/DCP2, token-granular writes), four processes.
LAUNCH_SCENARIO=dcp-relayout-two-stages.yaml

MESSAGE_BYTES=65536
timeout_ceiling=${KVRELAY_RDMA_TIMEOUT_CEILING:-180}
timeout_conformance=${KVRELAY_RDMA_TIMEOUT_CONFORMANCE:-600}
timeout_diff=${KVRELAY_RDMA_TIMEOUT_DIFF:-900}
timeout_launch=${KVRELAY_RDMA_TIMEOUT_LAUNCH:-300}
timeout_bench=${KVRELAY_RDMA_TIMEOUT_BENCH:-300}
timeout_certify=${KVRELAY_RDMA_TIMEOUT_CERTIFY:-900}
runner=$PWD/ci/rdma/run-in-guest.sh
# insta must fail on a golden mismatch, never write a .snap.new, in the guest as on the host (.ci/run sets the
# same); run-in-guest.sh passes INSTA_* and CI into the guest.
export INSTA_UPDATE=no CI=${CI:-true}

loud() {
    {
        echo
        echo "rdma: ######################################################################"
        for line in "$@"; do echo "rdma: $line"; done
        echo "rdma: ######################################################################"
    } >&2
}
seconds_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
stage_start=$EPOCHREALTIME
timings=()
logs=$(mktemp -d /tmp/kvrelay-rdma-stage.XXXXXX)
finish() {
    local rc=$?
    echo
    echo "rdma: step times"
    local line
    for line in "${timings[@]}"; do echo "rdma:   $line"; done
    echo "rdma: total RDMA stage time: $(seconds_since "$stage_start") s (exit $rc)"
    rm -rf "$logs"
}
trap finish EXIT
step() {  # step LABEL COMMAND...: runs it with a header and its time; returns its exit code
    local label=$1 start=$EPOCHREALTIME rc=0 verdict=ok
    shift
    printf '\n==> rdma: %s\n' "$label"
    "$@" || rc=$?
    [ "$rc" = 0 ] || verdict="FAILED (exit $rc)"
    [ "$rc" != 124 ] || verdict="TIMEOUT (exit 124)"
    timings+=("$(printf '%7s s  %-9s %s' "$(seconds_since "$start")" "${verdict%% *}" "$label")")
    printf '<== rdma: %s: %s in %s s\n' "$label" "$verdict" "$(seconds_since "$start")"
    return "$rc"
}
# Runs a command in the guest with the repo shared at the same path and the guest starting in the repo root.
in_guest() {  # in_guest TIMEOUT COMMAND...
    local limit=$1
    shift
    KVRELAY_VM_SHARE=$PWD KVRELAY_VM_TIMEOUT=$limit "$runner" "$@"
}

[ -f "scenarios/engines/$LAUNCH_SCENARIO" ] \
    || { loud "LAUNCH_SCENARIO=$LAUNCH_SCENARIO is not in scenarios/engines/ (renamed? update ci/rdma.sh)"; exit 1; }

# (a) Host packages (a no-op when present) and the guest image (rebuilt only when its inputs changed).
step "host packages and guest image: ci/rdma/build-guest.sh --install" bash ci/rdma/build-guest.sh --install

# (b) The device and its ceiling. ceiling.sh is copied into the guest; no share needed.
ceiling_run() {
    KVRELAY_VM_TIMEOUT=$timeout_ceiling "$runner" ci/rdma/ceiling.sh "$MESSAGE_BYTES" | tee "$logs/ceiling.log"
}
step "guest boot: ibv_devinfo and ib_write_bw -d rxe0 -s $MESSAGE_BYTES -n 2000 loopback (ci/rdma/ceiling.sh)" \
    ceiling_run
ceiling=$(sed -n "s/^ceiling bytes=$MESSAGE_BYTES mbps=\([0-9.]*\)\$/\1/p" "$logs/ceiling.log" | tail -n 1)
[ -n "$ceiling" ] || { loud "ceiling.sh printed no 'ceiling bytes=$MESSAGE_BYTES mbps=' line"; exit 1; }
echo "rdma: device ceiling: $ceiling MB/s at $MESSAGE_BYTES-byte RDMA WRITEs (perftest, MB = 2^20 bytes)"

if [ "${KVRELAY_RDMA_STAGE_ONLY_GUEST:-}" = 1 ]; then
    echo "rdma: KVRELAY_RDMA_STAGE_ONLY_GUEST=1: stopping after the device ceiling; the kvrelay build and the" \
        "RDMA commands are skipped"
    exit 0
fi

# (c) Build. The guest runs host-built binaries; the runner variable below names the host triple.
host=$(rustc -vV | sed -n 's/^host: //p')
[ "$host" = x86_64-unknown-linux-gnu ] \
    || { loud "host triple is $host; this stage sets CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER only"; exit 1; }
if ! cargo metadata --locked --no-deps --format-version 1 | grep -q '"rdma":\['; then
    loud "Cargo.toml has no 'rdma' feature: the kvrelay RDMA fabric is not on this branch yet." \
        "Set KVRELAY_RDMA_STAGE_ONLY_GUEST=1 to run only the guest and device ceiling steps."
    exit 1
fi
step "cargo build --locked --release --features rdma" cargo build --locked --release --features rdma
step "cargo test --locked --release --features rdma --no-run" \
    cargo test --locked --release --features rdma --no-run

# (d) The RDMA commands, each its own guest boot. Keep going after a failure; report them all at the end.
failed=()
conformance() {
    # cargo runs the test binary through the runner, i.e. inside the guest, with CARGO_MANIFEST_DIR (the repo,
    # shared at the same path) finding scenarios/ and golden/.
    KVRELAY_VM_SHARE=$PWD KVRELAY_VM_TIMEOUT=$timeout_conformance CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$runner \
        cargo test --locked --release --features rdma --test it -- conformance rdma
}
step "conformance tests in the guest: cargo test --test it -- conformance rdma" conformance \
    || failed+=("conformance tests")

step "kvrelay diff --fabric rdma --device rxe0, every scenario in ci/rdma/scenarios.txt (ci/rdma/diff-all.sh)" \
    in_guest "$timeout_diff" ci/rdma/diff-all.sh ci/rdma/scenarios.txt \
    || failed+=("kvrelay diff over ci/rdma/scenarios.txt")

step "kvrelay launch scenarios/engines/$LAUNCH_SCENARIO --fabric rdma --device rxe0" \
    in_guest "$timeout_launch" target/release/kvrelay launch "scenarios/engines/$LAUNCH_SCENARIO" \
    --fabric rdma --device rxe0 \
    || failed+=("kvrelay launch $LAUNCH_SCENARIO")

certify_run() {
    rm -rf target/certify/rdma
    in_guest "$timeout_certify" target/release/kvrelay certify --fabric rdma --device rxe0 --out target/certify/rdma \
        | tee "$logs/certify.log"
}
if step "kvrelay certify --fabric rdma --device rxe0: the case set on Soft-RoCE, junit.xml and report.json" \
    certify_run; then
    grep '^CERTIFIED' "$logs/certify.log" | sed 's/^/rdma: /'
    for file in junit.xml report.json manifest.txt; do
        [ -s "target/certify/rdma/$file" ] || failed+=("kvrelay certify: no target/certify/rdma/$file")
    done
else
    failed+=("kvrelay certify --fabric rdma")
fi

bench_run() {
    in_guest "$timeout_bench" ci/rdma/bench-in-guest.sh "$MESSAGE_BYTES" | tee "$logs/bench.log"
}
if step "kvrelay bench --fabric rdma beside ib_write_bw, $MESSAGE_BYTES-byte writes, one boot (ci/rdma/bench-in-guest.sh)" \
    bench_run; then
    summary=$(grep '^rdma-bench ' "$logs/bench.log" | tail -n 1)
    rate=$(grep '^kvrelay-wr-rate ' "$logs/bench.log" | tail -n 1)
    if [ -z "$summary" ]; then
        loud "the bench printed no 'rdma-bench ... ratio=' line: no kvrelay bandwidth to set beside the device's"
        failed+=("kvrelay bench: no rdma-bench line")
    else
        echo "rdma: $summary (MiB/s, best of two interleaved rounds in one guest boot; informational, not a gate)"
        echo "rdma: ${rate:-no work-request rate line}"
    fi
else
    failed+=("kvrelay bench")
fi

if [ "${#failed[@]}" -gt 0 ]; then
    loud "RDMA stage FAILED:" "${failed[@]/#/  - }"
    exit 1
fi
echo "rdma: every RDMA command passed"
