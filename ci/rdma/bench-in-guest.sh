#!/bin/sh
# Guest side (busybox sh): kvrelay's RDMA fabric against the device's own ceiling, in the same boot, interleaved
# (ceiling, kvrelay, ceiling, kvrelay) so both see the same emulated machine; each side's best run counts.
# Prints both tools' lines, kvrelay's work-request rate for a token-granular DCP plan, and one summary line:
#   rdma-bench bytes=65536 kvrelay_mbps=46.1 ceiling_mbps=48.0 ratio=0.96
# Both figures are MiB/s (perftest's MB is 2^20 bytes; kvrelay prints the same unit).
# Usage (host): KVRELAY_VM_SHARE=$PWD ci/rdma/run-in-guest.sh ci/rdma/bench-in-guest.sh SIZE
set -u
size=${1:?usage: bench-in-guest.sh SIZE}
here=$(cd "$(dirname "$0")" && pwd)
best() { awk -v key="$1" '{ for (i = 1; i <= NF; i++) if (index($i, key "=") == 1) { v = substr($i, length(key) + 2) + 0; if (v > m) m = v } } END { print m + 0 }'; }
: > /tmp/ceiling.all
: > /tmp/kvrelay.all
status=0
for round in 1 2; do
    echo "== round $round: ib_write_bw"
    sh "$here/ceiling.sh" "$size" | tee -a /tmp/ceiling.all | grep -E '^(ceiling|ib_write_bw|ceiling:)' || status=1
    echo "== round $round: kvrelay bench --fabric rdma --device rxe0"
    target/release/kvrelay bench --fabric rdma --device rxe0 --message-bytes "$size" --iterations 3 \
        | tee -a /tmp/kvrelay.all || status=1
done
ceiling=$(grep "^ceiling bytes=$size " /tmp/ceiling.all | best mbps)
kvrelay=$(grep "^kvrelay-bw bytes=$size " /tmp/kvrelay.all | best mbps)
if [ "$ceiling" = 0 ] || [ "$kvrelay" = 0 ]; then
    echo "rdma-bench: missing a figure (ceiling $ceiling, kvrelay $kvrelay)"
    exit 1
fi
ratio=$(awk -v a="$kvrelay" -v b="$ceiling" 'BEGIN { printf "%.2f", a / b }')
echo "rdma-bench bytes=$size kvrelay_mbps=$kvrelay ceiling_mbps=$ceiling ratio=$ratio"
exit "$status"
