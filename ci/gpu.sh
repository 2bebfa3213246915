#!/usr/bin/env bash
# Every GPU stage of kvrelay in one command, on a machine with an NVIDIA GPU (driver and CUDA 13's libnvrtc), one log:
#   1. the GPU tests (tests/it/device.rs: a planted wrong byte in device memory, diff against the in-memory fabric)
#   2. check --fabric cuda   every scenario, the same goldens
#   3. diff --fabric cuda    every scenario's decode images against the in-memory fabric's
#   4. selftest --fabric cuda  every mutant caught with the bytes on the GPU
#   5. bench --fabric cuda   ceilings (copy, host<->device), gather and compare kernels, the Kimi-K3 request
#   6. replay --fabric cuda  the seed's load (128 x 32,768 tokens at concurrency 16), moved and verified on the GPU
#
# Usage: bash ci/gpu.sh [--log FILE] [--stages 1,2,...]
#   With cargo on the machine it builds `--features cuda` itself. Without (a GPU box with no Rust), build on another
#   x86-64 machine and name the outputs: KVRELAY_BIN=path/to/kvrelay KVRELAY_TESTS=path/to/it-binary bash ci/gpu.sh
#   ($KVRELAY_TESTS: `cargo test --release --features cuda --test it --no-run` prints its path.)
# Exit: 0 when every stage run passed. NVLink multicast stays off (NCCL_NVLS_ENABLE=0): it can take a shared host's
# GPUs down.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0

log=target/gpu.log
stages=1,2,3,4,5,6
while [ $# -gt 0 ]; do
    case "$1" in
        --log) log=$2; shift 2 ;;
        --stages) stages=$2; shift 2 ;;
        *) echo "usage: bash ci/gpu.sh [--log FILE] [--stages 1,2,...]" >&2; exit 2 ;;
    esac
done
mkdir -p "$(dirname "$log")"
: > "$log"

say() { echo "$*" | tee -a "$log"; }

if ! nvidia-smi -L >/dev/null 2>&1; then
    say "gpu.sh: no NVIDIA GPU answers nvidia-smi here: nothing run (the GPU tests skip themselves on such machines)"
    exit 1
fi
nvidia-smi -L | tee -a "$log"

bin=${KVRELAY_BIN:-}
tests=${KVRELAY_TESTS:-}
if [ -z "$bin" ]; then
    cargo build --release --features cuda 2>&1 | tail -1 | tee -a "$log"
    bin=target/release/kvrelay
fi
if [ -z "$tests" ] && command -v cargo >/dev/null; then
    tests=$(cargo test --release --features cuda --test it --no-run 2>&1 | sed -n 's/.*Executable.*(\(.*\))/\1/p' | tail -1)
fi

declare -a names results
run_stage() {
    local number=$1 name=$2
    shift 2
    case ",$stages," in *",$number,"*) ;; *) return ;; esac
    say ""
    say "=== stage $number: $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    say "=== stage $number: $name: rc=$rc in $((SECONDS - start)) s"
    names+=("$number $name")
    results+=("$rc")
}

if [ -n "$tests" ]; then
    run_stage 1 "GPU tests" "$tests" device:: --test-threads 1 --nocapture
else
    say "=== stage 1: GPU tests: not run (no test binary: set KVRELAY_TESTS or install cargo)"
fi
run_stage 2 "check" "$bin" check --fabric cuda
mapfile -t scenarios < <(find scenarios -name '*.yaml' | sort)
run_stage 3 "diff" "$bin" diff --fabric cuda "${scenarios[@]}"
run_stage 4 "selftest" "$bin" selftest --fabric cuda
run_stage 5 "bench" "$bin" bench --fabric cuda --iterations 3
run_stage 6 "replay" "$bin" replay --fabric cuda

say ""
say "=== summary"
status=0
for index in "${!names[@]}"; do
    verdict=pass
    [ "${results[$index]}" = 0 ] || { verdict="FAIL (rc ${results[$index]})"; status=1; }
    say "stage ${names[$index]}: $verdict"
done
say "gpu.sh: $([ $status = 0 ] && echo 'every stage run passed' || echo 'a stage FAILED'); log: $log"
exit $status
