#!/bin/sh
# Guest side (busybox sh): runs `kvrelay diff --fabric rdma --device rxe0 <scenario>` for every scenario in a list,
# in one guest boot (a boot costs ~3 s; one per scenario would add minutes), keeps going after a failure, and ends
# with a summary. Run from the repo root with the repo shared into the guest:
#   KVRELAY_VM_SHARE=$PWD ci/rdma/run-in-guest.sh ci/rdma/diff-all.sh ci/rdma/scenarios.txt
# LIST: one scenario path per line, relative to the repo root; blank lines and `#` comments are skipped.
# Env: KVRELAY_BIN (default target/release/kvrelay).
# Exit code: 0 when every scenario passed, 1 when any failed or is missing, 2 on a usage error.
set -u
kvrelay=${KVRELAY_BIN:-target/release/kvrelay}
device=rxe0
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
    echo "usage: diff-all.sh LIST   (no list file '${1:-}')" >&2
    exit 2
fi
[ -x "$kvrelay" ] || { echo "diff-all: no executable $kvrelay (build it first, and share the repo)" >&2; exit 2; }

uptime_s() { cut -d' ' -f1 /proc/uptime; }
passed=0
failed=0
failures=""
started=$(uptime_s)
# `|| [ -n "$line" ]` keeps a last line without a newline.
while IFS= read -r line || [ -n "$line" ]; do
    scenario=$(echo "$line" | sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//')
    [ -n "$scenario" ] || continue
    echo
    echo "== kvrelay diff --fabric rdma --device $device $scenario"
    begin=$(uptime_s)
    if [ ! -f "$scenario" ]; then
        echo "diff-all: no such file: $scenario"
        code="none, no such file"
    else
        # stdin from /dev/null: the loop itself reads the list on stdin.
        "$kvrelay" diff --fabric rdma --device "$device" "$scenario" < /dev/null
        code=$?
    fi
    seconds=$(awk -v a="$begin" -v b="$(uptime_s)" 'BEGIN { printf "%.1f", b - a }')
    if [ "$code" = 0 ]; then
        passed=$((passed + 1))
        echo "diff-all: ok     $scenario (${seconds} s)"
    else
        failed=$((failed + 1))
        failures="$failures $scenario"
        echo "diff-all: FAILED $scenario (exit $code, ${seconds} s)"
    fi
done < "$1"

total=$(awk -v a="$started" -v b="$(uptime_s)" 'BEGIN { printf "%.1f", b - a }')
echo
echo "diff-all: $passed passed, $failed failed, ${total} s (guest clock)"
[ "$passed" -gt 0 ] || { echo "diff-all: the list names no scenario" >&2; exit 1; }
if [ "$failed" -gt 0 ]; then
    for scenario in $failures; do echo "diff-all: FAILED $scenario"; done
    exit 1
fi
exit 0
