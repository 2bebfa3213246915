#!/bin/sh
# Guest side (busybox sh): what the guest's RDMA device can do at best, as the reference the kvrelay RDMA
# benchmark is compared against. Prints the device (ibv_devinfo), then runs perftest's RDMA WRITE bandwidth test
# in loopback on rxe0, server and client in the same guest, once per message size, and prints one
# machine-readable line per size:
#   ceiling bytes=65536 mbps=47.50
# mbps is perftest's "BW average[MB/sec]", where perftest's MB is 2^20 bytes (MiB/s).
# Usage (host): ci/rdma/run-in-guest.sh ci/rdma/ceiling.sh SIZE [SIZE...]
# Exit code: 0 when every size produced a number, 1 otherwise (with both sides' output).
set -u
device=rxe0
server_ip=10.199.0.1   # dummy0's address (guest-init.sh); rxe loops it back inside the guest
iterations=2000
port=18515             # perftest's default out-of-band TCP port
[ $# -ge 1 ] || { echo "usage: ceiling.sh SIZE [SIZE...]" >&2; exit 2; }

ibv_devinfo -d "$device" || { echo "ceiling: no device $device" >&2; exit 1; }
status=0
for size in "$@"; do
    echo
    echo "== ib_write_bw -d $device -s $size -n $iterations (loopback on $server_ip)"
    # -F: do not fail on the CPU frequency check, which cannot be read under emulation. Both sides are bounded by
    # `timeout`, so a client that never connects cannot leave the server (and the guest) waiting forever.
    timeout 120 ib_write_bw -d "$device" -s "$size" -n "$iterations" -F > /tmp/ceiling-server.log 2>&1 &
    server=$!
    # The client must not start before the server listens, or it fails with "Couldn't connect".
    waited=0
    until netstat -ltn 2> /dev/null | grep -q ":$port "; do
        waited=$((waited + 1))
        [ "$waited" -le 100 ] || break
        sleep 0.1
    done
    timeout 120 ib_write_bw -d "$device" -s "$size" -n "$iterations" -F "$server_ip" > /tmp/ceiling-client.log 2>&1
    client_rc=$?
    wait "$server"
    server_rc=$?
    # The result row: "#bytes #iterations BW-peak BW-average MsgRate"; the average is the sustained figure.
    mbps=$(awk -v size="$size" '$1 == size && NF >= 5 { value = $4 } END { print value }' /tmp/ceiling-client.log)
    if [ "$client_rc" != 0 ] || [ "$server_rc" != 0 ] || [ -z "$mbps" ]; then
        echo "ceiling: ib_write_bw at $size bytes FAILED (client exit $client_rc, server exit $server_rc)"
        echo "--- client:"; cat /tmp/ceiling-client.log
        echo "--- server:"; cat /tmp/ceiling-server.log
        status=1
        continue
    fi
    grep -E '^ *(#bytes|[0-9]+ )' /tmp/ceiling-client.log
    echo "ceiling bytes=$size mbps=$mbps"
done
exit "$status"
