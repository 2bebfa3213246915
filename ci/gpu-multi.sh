#!/usr/bin/env bash
# What kvrelay can run today on a machine with several NVIDIA GPUs (the nvidia-h200-x2/-x4/-x8 kinds), one log:
#   1. the GPUs and how they are linked (nvidia-smi topo -m)
#   2. the NVLink ceiling: peer copies of 1 GiB between every ordered pair of GPUs at once, and one pair alone
#      (torch; peer access checked first, a pair without it named)
#   3. the one-GPU stages on every GPU side by side, one process per GPU (KVRELAY_CUDA_DEVICE picks it):
#      check --fabric cuda (every scenario) and replay --fabric cuda --direct (the seed's load)
# Not built yet (issue 24): ranks placed on different GPUs, cross-GPU writes by peer copies, CUDA IPC handles in
# the registration, NIXL's cuda_ipc between processes on different GPUs. Today one cuda transport holds one GPU.
#
# Usage: bash ci/gpu-multi.sh [--log FILE] [--pack DIR]   (--pack: as ci/gpu.sh, binaries built by ci/gpu-pack.sh)
# Exit: 0 when every stage run passed. NVLink multicast stays off (NCCL_NVLS_ENABLE=0): it can take a shared host's
# GPUs down; nothing here calls cuMulticastCreate.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0

log=target/gpu-multi.log
pack=
while [ $# -gt 0 ]; do
    case "$1" in
        --log) log=$2; shift 2 ;;
        --pack) pack=$2; shift 2 ;;
        *) echo "usage: bash ci/gpu-multi.sh [--log FILE] [--pack DIR]" >&2; exit 2 ;;
    esac
done
mkdir -p "$(dirname "$log")"
: > "$log"
say() { echo "$*" | tee -a "$log"; }

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "${gpus:-0}" -lt 2 ]; then
    say "gpu-multi.sh: ${gpus:-0} NVIDIA GPU(s) answer nvidia-smi here; this script needs at least 2: nothing run"
    exit 1
fi
bin=${KVRELAY_BIN:-${pack:+$pack/kvrelay}}
if [ -z "$bin" ]; then
    cargo build --release --features cuda 2>&1 | tail -1 | tee -a "$log"
    bin=target/release/kvrelay
fi
failed=0

say "=== stage 1: topology ($gpus GPUs)"
nvidia-smi topo -m 2>&1 | tee -a "$log"

say "=== stage 2: NVLink ceiling (peer copies, 1 GiB each, best of 5)"
python3 - "$gpus" <<'PY' 2>&1 | tee -a "$log"
import sys, time
import torch
n = int(sys.argv[1])
size = 1 << 30
pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
missing = [(i, j) for i, j in pairs if not torch.cuda.can_device_access_peer(i, j)]
for i, j in missing:
    print(f"GPU {i} cannot reach GPU {j} by peer access: its copies go through the host")
bufs = {d: (torch.empty(size, dtype=torch.uint8, device=d), [torch.empty(size, dtype=torch.uint8, device=d)
                                                                for _ in range(n - 1)]) for d in range(n)}
def run(chosen):
    slot = {d: 0 for d in range(n)}
    streams = {p: torch.cuda.Stream(device=p[0]) for p in chosen}
    for d in range(n):
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for i, j in chosen:
        with torch.cuda.stream(streams[(i, j)]):
            bufs[j][1][slot[j]].copy_(bufs[i][0], non_blocking=True)
        slot[j] += 1
    for d in range(n):
        torch.cuda.synchronize(d)
    return time.perf_counter() - start
for name, chosen in (("one pair (0 -> 1)", [(0, 1)]), (f"every ordered pair at once ({len(pairs)})", pairs)):
    best = min(run(chosen) for _ in range(5))
    print(f"peer copy, {name}: {len(chosen) * size / best / 1e9:.1f} GB/s in all, {size / best / 1e9:.1f} GB/s a pair")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

say "=== stage 3: the one-GPU stages on every GPU side by side"
for gpu in $(seq 0 $((gpus - 1))); do
    (
        KVRELAY_CUDA_DEVICE=$gpu "$bin" check --fabric cuda > "target/gpu-multi-check-$gpu.log" 2>&1
        echo "check rc=$?" >> "target/gpu-multi-check-$gpu.log"
        KVRELAY_CUDA_DEVICE=$gpu "$bin" replay --fabric cuda --direct > "target/gpu-multi-replay-$gpu.log" 2>&1
        echo "replay rc=$?" >> "target/gpu-multi-replay-$gpu.log"
    ) &
done
wait
for gpu in $(seq 0 $((gpus - 1))); do
    say "--- GPU $gpu"
    tail -n 2 "target/gpu-multi-check-$gpu.log" | tee -a "$log"
    grep -E '^(device|seconds|input tokens/s|violations|replay rc)' "target/gpu-multi-replay-$gpu.log" | tee -a "$log"
    grep -q 'check rc=0' "target/gpu-multi-check-$gpu.log" || failed=1
    grep -q 'replay rc=0' "target/gpu-multi-replay-$gpu.log" || failed=1
done

if [ "$failed" -eq 0 ]; then say "gpu-multi.sh: every stage run passed; log: $log"; else say "gpu-multi.sh: a stage FAILED; log: $log"; fi
exit "$failed"
