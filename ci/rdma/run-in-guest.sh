#!/usr/bin/env bash
# Runs one command inside kvrelay's RDMA guest (QEMU, Soft-RoCE device rxe0 on 10.199.0.1) and exits with its
# exit code. Works as cargo's target runner:
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$PWD/ci/rdma/run-in-guest.sh KVRELAY_VM_SHARE=$PWD cargo test ...
#
# Usage: ci/rdma/run-in-guest.sh BINARY [ARGS...]
#   BINARY  a host file (an ELF binary, copied in with its shared libraries, or a script) or the name of a guest
#           command (busybox applets, ip, rdma, ibv_devinfo, ib_write_bw, ...)
# Output: the command's stdout and stderr, both on this script's stdout, as they are written. The guest's own
# `kvrelay-vm: ...` lines (device facts, readiness, exit) and this script's messages go to stderr.
# Exit code: the command's; 124 if KVRELAY_VM_TIMEOUT ran out first (QEMU is killed); 125 if the guest never
# reported a code (boot failure, kernel panic, RDMA setup failure, missing image) or on a usage error.
#
# Env (all optional):
#   KVRELAY_VM_CACHE    the image from build-guest.sh (default /var/cache/kvrelay-vm)
#   KVRELAY_VM_TIMEOUT  seconds for the whole boot-run-poweroff (default 300)
#   KVRELAY_VM_SHARE    a host dir mounted read-write at the same path in the guest (virtio-9p); the guest starts
#                       in the current directory when it lies inside it, else in /root
#   KVRELAY_VM_ENV      "NAME1 NAME2": more host variables exported in the guest. RUST_*, CARGO_*, KVRELAY_*,
#                       INSTA_* and CI always are (CI and INSTA_UPDATE keep insta from writing .snap.new files into
#                       the share from inside the guest, where it cannot tell it is running in CI)
#   KVRELAY_VM_MEM / KVRELAY_VM_SMP   guest RAM (default 2G) / vCPUs (default 2)
#   KVRELAY_VM_ACCEL    kvm | tcg (default: kvm only where it can work, see below)
set -euo pipefail
me=run-in-guest
cache=${KVRELAY_VM_CACHE:-/var/cache/kvrelay-vm}
timeout_s=${KVRELAY_VM_TIMEOUT:-300}
share=${KVRELAY_VM_SHARE:-}

loud() {  # a banner nobody scrolls past in a CI log
    {
        echo
        echo "$me: ######################################################################"
        for line in "$@"; do echo "$me: $line"; done
        echo "$me: ######################################################################"
    } >&2
}
[ $# -ge 1 ] || { loud "usage: run-in-guest.sh BINARY [ARGS...]"; exit 125; }
if [ ! -f "$cache/vmlinux" ] || [ ! -f "$cache/initrd.cpio" ]; then
    loud "no guest image in $cache" "build it with: bash ci/rdma/build-guest.sh --install"
    exit 125
fi
if [[ ! $timeout_s =~ ^[1-9][0-9]*$ ]]; then
    loud "KVRELAY_VM_TIMEOUT must be a whole number of seconds, not '$timeout_s'"
    exit 125
fi
if [ -n "$share" ]; then
    [ -d "$share" ] || { loud "KVRELAY_VM_SHARE=$share is not a directory"; exit 125; }
    share=$(realpath "$share")
    # QEMU's option parser splits on commas.
    [[ $share != *,* ]] || { loud "KVRELAY_VM_SHARE may not contain a comma: $share"; exit 125; }
fi

work=$(mktemp -d /tmp/kvrelay-vm.XXXXXX)
overlay=$work/overlay
mkdir -p "$overlay/opt/kvrelay-vm/bin"
qemu_pid="" relay_pid=""
# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
    [ -z "$qemu_pid" ] || kill -TERM "$qemu_pid" 2> /dev/null || true
    [ -z "$relay_pid" ] || kill "$relay_pid" 2> /dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
# Ctrl-C or a CI cancel: QEMU runs in the background (see below), so it does not get the signal by itself.
trap 'echo "$me: interrupted, stopping the guest" >&2; exit 130' INT
trap 'echo "$me: terminated, stopping the guest" >&2; exit 143' TERM

# 1. The program. A host file goes into an overlay at /opt/kvrelay-vm/bin with every library ldd resolves for it,
# at the same paths, so the guest runs it against exactly the host's libraries. A file under the share runs in
# place instead: std::env::current_exe() then names a path that exists in the guest, so a program that spawns
# copies of itself (or reads files beside itself) works. Its libraries still go into the overlay.
prog=$1
shift
if [ -f "$prog" ]; then
    path=$(realpath "$prog")
    while read -r lib; do
        mkdir -p "$overlay$(dirname "$lib")"
        cp -L "$lib" "$overlay$lib"
    done < <({ ldd "$path" 2> /dev/null || true; } | grep -o '/[^ :]*\.so[^ :]*' | sort -u)
    if [ -n "$share" ] && [[ $path == "$share"/* ]]; then
        prog=$path
    else
        cp -L "$path" "$overlay/opt/kvrelay-vm/bin/"
        prog=/opt/kvrelay-vm/bin/$(basename "$path")
    fi
fi
# Linux unpacks concatenated cpio archives in order, and an overlay entry replaces a base entry: a real lib or lib64
# directory would replace the base image's lib -> usr/lib symlinks. ldd prints /lib64/ld-linux-x86-64.so.2 and
# /lib/x86_64-linux-gnu/..., so move those under usr/ where the symlinks point.
for top in lib lib64; do
    if [ -d "$overlay/$top" ]; then
        mkdir -p "$overlay/usr/$top"
        cp -a "$overlay/$top/." "$overlay/usr/$top/"
        rm -rf "${overlay:?}/$top"
    fi
done
# The command, quoted for the guest's sh; exec keeps the exit code (or 128+signal) the program's own.
{ printf 'exec'; printf ' %q' "$prog" "$@"; echo; } > "$overlay/opt/kvrelay-vm/cmd"

# 2. The environment: where to mount and start, plus the passed-through variables.
{
    printf 'KVRELAY_VM_SHARE=%q\n' "$share"
    cwd=$(pwd -P)
    if [ -n "$share" ] && [[ $cwd/ == "$share"/* ]]; then printf 'KVRELAY_VM_CWD=%q\n' "$cwd"; fi
    for name in $(compgen -e | grep -E '^(RUST_|CARGO_|KVRELAY_|INSTA_)|^CI$') ${KVRELAY_VM_ENV:-}; do
        [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || { loud "KVRELAY_VM_ENV: '$name' is not a variable name"; exit 125; }
        printf 'export %s=%q\n' "$name" "${!name-}"
    done
} > "$overlay/opt/kvrelay-vm/env"
{ cat "$cache/initrd.cpio"; (cd "$overlay" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet); } \
    > "$work/initrd"

# 3. Acceleration. KVM only with hardware virtualization that a stock kernel can use: /dev/kvm writable, the CPU
# advertising vmx or svm, and not PVM (the kvm_pvm module). On a PVM host /dev/kvm exists but cannot run Debian's
# kernel: QEMU aborts ("failed to set MSR 0x10a"), hangs in early boot, or dies on an emulation failure and then
# pauses forever. Everywhere else: TCG, multi-threaded, ~5x slower for CPU-bound code, fine for functional tests.
accel=${KVRELAY_VM_ACCEL:-}
if [ -z "$accel" ]; then
    accel=tcg
    if [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then accel=kvm; fi
fi
case $accel in
    kvm) cpu=(-accel kvm -cpu host) ;;
    tcg) cpu=(-accel "tcg,thread=multi" -cpu max) ;;
    *) loud "KVRELAY_VM_ACCEL must be kvm or tcg, not '$accel'"; exit 125 ;;
esac
virtfs=()
[ -z "$share" ] || virtfs=(-virtfs "local,path=$share,mount_tag=kvrelay,security_model=none,id=kvrelay")

# 4. Boot. ttyS0 (kernel console, markers) goes to console.log; ttyS1 (the program's output) to our stdout. No
# NIC (-nodefaults -nic none): nothing in the guest reaches any network. stdin from /dev/null keeps the stdio
# chardev happy without a terminal. -no-reboot turns the guest's poweroff and any panic (panic=-1) into QEMU
# exiting. vmlinux boots through its PVH note. QEMU runs in the background under `timeout` so this script can
# relay the guest's progress lines while it runs and stop it on a signal.
console=$work/console.log
: > "$console"
started=$SECONDS
timeout -k 10 "$timeout_s" qemu-system-x86_64 \
    "${cpu[@]}" -m "${KVRELAY_VM_MEM:-2G}" -smp "${KVRELAY_VM_SMP:-2}" \
    -nodefaults -display none -no-reboot -nic none "${virtfs[@]}" \
    -chardev stdio,id=out,signal=off -serial "file:$console" -serial chardev:out \
    -kernel "$cache/vmlinux" -initrd "$work/initrd" \
    -append "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init" < /dev/null &
qemu_pid=$!
# The guest's `kvrelay-vm:` lines, live: tail follows the console log until QEMU (timeout) is gone.
tail -n +1 -F -s 0.2 --pid="$qemu_pid" "$console" 2> /dev/null | grep -a --line-buffered '^kvrelay-vm:' >&2 &
relay_pid=$!
qemu_rc=0
wait "$qemu_pid" || qemu_rc=$?
qemu_pid=""
wait "$relay_pid" || true
relay_pid=""
elapsed=$((SECONDS - started))

# 5. The verdict, from the console log.
code=$(grep -a -o 'KVRELAY_VM_EXIT=[0-9]*' "$console" | tail -n 1 | cut -d= -f2 || true)
timed_out=0
if [ "$qemu_rc" = 124 ] || { [ "$qemu_rc" = 137 ] && [ "$elapsed" -ge "$timeout_s" ]; }; then timed_out=1; fi
console_tail() { tail -n "${1:-30}" "$console" | tr -d '\r' | sed "s/^/$me: console: /" >&2; }
if [ -n "$code" ]; then
    if [ "$timed_out" = 1 ]; then
        echo "$me: warning: the command exited with $code, but the guest then hung until the timeout" >&2
    fi
    exit "$code"
fi
if [ "$timed_out" = 1 ]; then
    loud "TIMEOUT: the guest ran past KVRELAY_VM_TIMEOUT=${timeout_s}s; QEMU was killed." \
        "command: $prog $*" \
        "Raise KVRELAY_VM_TIMEOUT if the work is genuinely long; a verbs program waiting forever for a" \
        "completion looks exactly like this. Last console lines:"
    console_tail 20
    exit 124
fi
if grep -aq KVRELAY_VM_SETUP_FAILED "$console"; then
    loud "GUEST SETUP FAILED before the command ran (see the kvrelay-vm lines above); qemu exit code $qemu_rc." \
        "command: $prog $*"
    exit 125
fi
loud "NO EXIT CODE: the guest never reported one (boot failure or kernel panic?); qemu exit code $qemu_rc" \
    "after ${elapsed}s. command: $prog $*" "Last console lines:"
console_tail 40
exit 125
