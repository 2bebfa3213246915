#!/bin/sh
# /init of kvrelay's RDMA guest (PID 1 in the initramfs that ci/rdma/build-guest.sh builds; busybox sh).
#
# 1. mounts proc, sys, dev, tmp;  2. loads Soft-RoCE and creates rxe0 on dummy0 (10.199.0.1), a NIC-less device
# that exists only inside this guest;  3. waits for the port and the RoCE v2 IPv4-mapped GID, prints the device
# facts once;  4. mounts the host's shared folder at the same path when one is given;  5. runs the command from
# /opt/kvrelay-vm/cmd with stdout+stderr on ttyS1 (the host's stdout) and stdin from /dev/null;  6. prints
# KVRELAY_VM_EXIT=<code> on ttyS0 (the console log the host reads) and powers off.
#
# Channels: ttyS1 carries only the program's output. ttyS0 carries the kernel log, `kvrelay-vm: ...` lines (the
# host relays them to its stderr as they arrive) and the markers. A setup failure prints KVRELAY_VM_SETUP_FAILED
# instead of running the command, so a broken guest is never mistaken for a failing program.
export PATH=/usr/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
# An oops would leave a half-dead guest that only the host's timeout ends; panic (and with -no-reboot, exit) now.
echo 1 > /proc/sys/kernel/panic_on_oops

# No \n -> \r\n translation on either port: the host gets plain lines. Busybox stty sets the mode with TCSADRAIN,
# so running it again later also waits until everything written so far has left the port.
CONSOLE=/dev/ttyS0
OUT=/dev/ttyS1
[ -c "$OUT" ] || OUT=$CONSOLE
stty -onlcr < "$CONSOLE" 2>/dev/null
stty -onlcr < "$OUT" 2>/dev/null
say() { echo "kvrelay-vm: $*" > "$CONSOLE"; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
setup_failed() {
    say "SETUP FAILED: $*"
    dmesg | tail -n 25 | sed 's/^/kvrelay-vm: dmesg: /' > "$CONSOLE"
    echo "KVRELAY_VM_SETUP_FAILED" > "$CONSOLE"
    stty -onlcr < "$CONSOLE" 2>/dev/null
    poweroff -f
}

# KVRELAY_VM_SHARE, KVRELAY_VM_CWD and the passed-through variables (written by run-in-guest.sh).
[ -f /opt/kvrelay-vm/env ] || setup_failed "no /opt/kvrelay-vm/env (not started by run-in-guest.sh?)"
# shellcheck source=/dev/null
. /opt/kvrelay-vm/env

# crc32_generic first: rxe needs the "crc32" crypto algorithm, a soft dependency modprobe does not pull in
# ("rdma_rxe: failed to init crc32 algorithm err:-2", then `rdma link add` fails with ENOENT). rdma_ucm gives
# user space the rdma_cm device. A module built into the kernel is already there, so only a real absence fails.
for module in crc32_generic rdma_rxe rdma_ucm dummy; do
    modprobe "$module" || [ -d "/sys/module/$module" ] || setup_failed "modprobe $module"
done
ip link set lo up
# `modprobe dummy` creates dummy0 by itself (numdummies=1); adding it again would fail with "File exists".
ip link show dummy0 > /dev/null 2>&1 || ip link add dummy0 type dummy || setup_failed "no dummy0"
# A dummy device rather than lo: rdma_cm cannot resolve routes for loopback addresses on rxe. There is no NIC in
# the guest (QEMU runs with -nic none), so 10.199.0.1 never reaches any network.
ip addr add 10.199.0.1/24 dev dummy0 || setup_failed "ip addr add 10.199.0.1/24 dev dummy0"
ip link set dummy0 up || setup_failed "ip link set dummy0 up"
rdma link add rxe0 type rxe netdev dummy0 || setup_failed "rdma link add rxe0 type rxe netdev dummy0"

# The port goes ACTIVE and the IPv4-mapped GID appears asynchronously; tests must not race them.
# RoCE v2 with an IPv4 address: GID ::ffff:10.199.0.1 (index 1 here; index 0 is the fe80:: link-local GID).
gid_line() { ibv_devinfo -v -d rxe0 2>/dev/null | grep -m 1 -i 'GID\[.*::ffff:10\.199\.0\.1.*v2'; }
tries=0
until ibv_devinfo -d rxe0 2>/dev/null | grep -q PORT_ACTIVE && [ -n "$(gid_line)" ]; do
    tries=$((tries + 1))
    [ "$tries" -le 100 ] || setup_failed "rxe0 has no active port with a RoCE v2 GID ::ffff:10.199.0.1 after 10 s"
    sleep 0.1
done
# The device facts, once per boot: the CI log shows which verbs device the run really used.
say "rxe0 on dummy0 (10.199.0.1), kernel $(uname -r)"
ibv_devinfo -d rxe0 | grep -E 'state:|active_mtu|link_layer' \
    | sed -e 's/^[[:space:]]*/kvrelay-vm: rxe0 /' -e 's/[[:space:]]\{1,\}/ /g' > "$CONSOLE"
say "rxe0 $(gid_line | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]\{1,\}/ /g')"

# The host folder shared over virtio-9p, mounted read-write at the same path, so paths compiled into test
# binaries (CARGO_MANIFEST_DIR) and relative to the repo root work unchanged.
if [ -n "${KVRELAY_VM_SHARE:-}" ]; then
    for module in virtio_pci 9pnet_virtio 9p; do
        modprobe "$module" || [ -d "/sys/module/$module" ] || setup_failed "modprobe $module"
    done
    mkdir -p "$KVRELAY_VM_SHARE"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 kvrelay "$KVRELAY_VM_SHARE" \
        || setup_failed "mount of the shared folder $KVRELAY_VM_SHARE"
    say "shared folder $KVRELAY_VM_SHARE mounted read-write"
fi
cd "${KVRELAY_VM_CWD:-/root}" 2> /dev/null || setup_failed "no directory ${KVRELAY_VM_CWD:-/root} in the guest"

say "guest ready at $(uptime_s) s (guest clock), running: $(cat /opt/kvrelay-vm/cmd)"
sh /opt/kvrelay-vm/cmd > "$OUT" 2>&1 < /dev/null
code=$?
# Let leftover background writers finish, then drain the output port before the exit marker goes out.
sleep 0.2
stty -onlcr < "$OUT" 2>/dev/null
say "command exited with $code at $(uptime_s) s"
echo "KVRELAY_VM_EXIT=$code" > "$CONSOLE"
stty -onlcr < "$CONSOLE" 2>/dev/null
sync
poweroff -f
