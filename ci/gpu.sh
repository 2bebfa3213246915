#!/usr/bin/env bash
# Every GPU stage of kvrelay in one command, on a machine with an NVIDIA GPU (driver and CUDA 13's libnvrtc), one log:
#   1. the GPU tests (tests/it/device.rs: a planted wrong byte in device memory, diff against the in-memory fabric)
#   2. check --fabric cuda   every scenario, the same goldens
#   3. diff --fabric cuda    every scenario's decode images against the in-memory fabric's
#   4. selftest --fabric cuda  every mutant caught with the bytes on the GPU
#   5. bench --fabric cuda   ceilings (copy, host<->device), gather and compare kernels, the Kimi-K3 request
#   6. replay --fabric cuda  the seed's load (128 x 32,768 tokens at concurrency 16), moved and verified on the GPU:
#                            through rank engines (live driver), then with --direct (each wave's plan executed
#                            straight through the fabric's engines)
#   NIXL on GPU memory (--fabric nixl-cuda: NIXL's agents, UCX cuda_copy/cuda_ipc, regions registered as VRAM), when
#   the nixl-cu13 wheel's libraries are here (bash ci/engines.sh --nixl-cu13, or $KVRELAY_NIXL_LIB):
#   7. check --fabric nixl-cuda    every scenario, ranks as agents of one process
#   8. launch --fabric nixl-cuda   the Kimi-K3 scenario with every rank its own process (cuda_ipc between them)
#   9. certify --fabric nixl-cuda  the conformance cases and the corpus; report in target/certify/nixl-cuda
#  10. bench --fabric nixl-cuda    ceilings, the Kimi-K3 request, its descriptor lists between two processes
#
# Usage: bash ci/gpu.sh [--log FILE] [--stages 1,2,...]
#   With cargo on the machine it builds `--features cuda` itself. Without (a GPU box with no Rust), build on another
#   x86-64 machine and name the outputs: KVRELAY_BIN=path/to/kvrelay KVRELAY_TESTS=path/to/it-binary bash ci/gpu.sh
#   ($KVRELAY_TESTS: `cargo test --release --features cuda --test it --no-run` prints its path.) A GPU box without
#   network: `bash ci/gpu-pack.sh` on the build machine writes target/gpu-pack.tar.xz (both binaries built with
#   `--features cuda,nixl` and the nixl-cu13 libraries NIXL's UCX path needs); unpack it into target/gpu-pack there
#   and run `bash ci/gpu.sh --pack target/gpu-pack`.
# Exit: 0 when every stage run passed. NVLink multicast stays off (NCCL_NVLS_ENABLE=0): it can take a shared host's
# GPUs down.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0

log=target/gpu.log
stages=1,2,3,4,5,6,7,8,9,10
pack=
while [ $# -gt 0 ]; do
    case "$1" in
        --log) log=$2; shift 2 ;;
        --stages) stages=$2; shift 2 ;;
        --pack) pack=$2; shift 2 ;;
        *) echo "usage: bash ci/gpu.sh [--log FILE] [--stages 1,2,...] [--pack DIR]" >&2; exit 2 ;;
    esac
done
if [ -n "$pack" ]; then
    export KVRELAY_BIN=${KVRELAY_BIN:-$pack/kvrelay} KVRELAY_TESTS=${KVRELAY_TESTS:-$pack/it}
    export KVRELAY_NIXL_LIB=${KVRELAY_NIXL_LIB:-$(cd "$pack" && pwd)/nixl-cu13/.nixl_cu13.mesonpy.libs}
fi
mkdir -p "$(dirname "$log")"
: > "$log"

say() { echo "$*" | tee -a "$log"; }

if ! nvidia-smi -L >/dev/null 2>&1; then
    say "gpu.sh: no NVIDIA GPU answers nvidia-smi here: nothing run (the GPU tests skip themselves on such machines)"
    exit 1
fi
nvidia-smi -L | tee -a "$log"

# NIXL's CUDA 13 libraries: named, or where ci/engines.sh --nixl-cu13 unpacks them.
nixl_lib=${KVRELAY_NIXL_LIB:-target/engines/nixl-cu13/.nixl_cu13.mesonpy.libs}
features=cuda
if [ -f "$nixl_lib/libnixl_capi.so" ]; then
    features=cuda,nixl
    export KVRELAY_NIXL_LIB=$(cd "$nixl_lib" && pwd)
    # UCX's CUDA memory hooks (libucm_cuda) need CUDA 13's runtime library: the toolkit's, or a Python wheel's.
    if ! ldconfig -p | grep -q 'libcudart.so.13'; then
        cudart=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/python3*/ /usr/local/lib/python3*/ \
            -name 'libcudart.so.13*' 2>/dev/null | head -1)
        [ -n "$cudart" ] && export LD_LIBRARY_PATH=$(dirname "$cudart")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
fi
bin=${KVRELAY_BIN:-}
tests=${KVRELAY_TESTS:-}
if [ -z "$bin" ]; then
    cargo build --release --features "$features" 2>&1 | tail -1 | tee -a "$log"
    bin=target/release/kvrelay
fi
if [ -z "$tests" ] && command -v cargo >/dev/null; then
    tests=$(cargo test --release --features "$features" --test it --no-run 2>&1 | sed -n 's/.*Executable.*(\(.*\))/\1/p' | tail -1)
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
run_stage 6 "replay direct" "$bin" replay --fabric cuda --direct
if [ "$features" = cuda,nixl ]; then
    say ""
    # A stage that hangs is a failure (rc 124), not a stuck script.
    stage_limit=${KVRELAY_STAGE_LIMIT:-300}
    say "NIXL on GPU memory: $KVRELAY_NIXL_LIB (UCX_TLS=${UCX_TLS:-unset: kvrelay sets cuda_copy,cuda_ipc,tcp})"
    run_stage 7 "check nixl-cuda" timeout "$stage_limit" "$bin" check --fabric nixl-cuda
    run_stage 8 "launch nixl-cuda" timeout "$stage_limit" "$bin" launch scenarios/basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml --fabric nixl-cuda
    run_stage 9 "certify nixl-cuda" timeout "$stage_limit" "$bin" certify --fabric nixl-cuda --out target/certify/nixl-cuda
    run_stage 10 "bench nixl-cuda" timeout "$stage_limit" "$bin" bench --fabric nixl-cuda --iterations 1 --across-processes
else
    say ""
    say "=== stages 7-10 (NIXL on GPU memory): not run: no nixl-cu13 libraries at $nixl_lib (fix: bash ci/engines.sh --nixl-cu13, or KVRELAY_NIXL_LIB)"
fi

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
