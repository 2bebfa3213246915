#!/usr/bin/env bash
# Builds the QEMU guest that gives kvrelay a real RDMA device: Debian's own kernel (which ships rdma_rxe, the
# Soft-RoCE driver, as a module) booted straight into an initramfs holding busybox, the module closure and the
# host's RDMA tools and libraries. The guest's /init (ci/rdma/guest-init.sh) creates rxe0 on a NIC-less dummy0.
#
# Usage: bash ci/rdma/build-guest.sh [--install | --install-only] [--force]
#   --install       apt-get the host packages first (skipped when every one is already installed), then build
#   --install-only  apt-get the host packages and stop (what .ci/run does before clippy --all-features)
#   --force         rebuild the image even when its inputs have not changed
# Env:
#   KVRELAY_VM_CACHE  output and download cache (default /var/cache/kvrelay-vm):
#                     debs/<kernel>.deb, vmlinux, initrd.cpio, image.stamp
#
# Output: $KVRELAY_VM_CACHE/vmlinux (uncompressed, PVH-bootable) and $KVRELAY_VM_CACHE/initrd.cpio (uncompressed
# newc). ci/rdma/run-in-guest.sh boots them. Any missing package, file, module or tool stops the script with a
# message that names it; nothing is skipped silently.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVRELAY_VM_CACHE:-/var/cache/kvrelay-vm}

# Host packages. Exactly these, with --no-install-recommends:
# - qemu-system-x86: the emulator (TCG; see run-in-guest.sh for why not KVM). Installing it removes a
#   preinstalled bookworm-backports qemu-utils, whose qemu-system-common conflicts: expected, and harmless here.
# - busybox-static cpio kmod: the guest's userland, the initramfs packer, depmod/modinfo for the module closure.
# - iproute2 (ip, rdma) ibverbs-providers (librxe) ibverbs-utils (ibv_devinfo) rdmacm-utils (rping) perftest
#   (ib_write_bw): the guest's RDMA userland, copied from the host with its libraries.
# - libibverbs-dev librdmacm-dev libclang-dev pkg-config: what building the `rdma` feature needs (the verbs headers
#   and link libraries, found through pkg-config; libclang for bindgen-generated bindings such as rdma-sys), so
#   clippy --all-features and cargo build --features rdma work on the host.
# Never the `rdma-core` package: it only adds daemons and udev rules, pulls in udev and upgrades systemd.
packages=(qemu-system-x86 busybox-static cpio kmod iproute2 ibverbs-providers ibverbs-utils rdmacm-utils perftest
          libibverbs-dev librdmacm-dev libclang-dev pkg-config)

# Modules the guest loads, plus what the virtio-9p shared folder needs. Their dependency closure is added.
# crc32_generic is listed by hand: rdma_rxe asks the crypto API for "crc32" at device creation, a soft dependency
# that `modinfo -F depends` does not show; without it `rdma link add` fails with "No such file or directory".
modules=(rdma_rxe crc32_generic rdma_ucm dummy virtio_pci 9pnet_virtio 9p)

# Guest executables copied from the host (with every library ldd resolves for them).
guest_tools=(/usr/bin/ip /usr/bin/rdma /usr/bin/ibv_devices /usr/bin/ibv_devinfo /usr/bin/ibv_rc_pingpong
             /usr/bin/ib_write_bw /usr/bin/ib_write_lat /usr/bin/ib_read_bw /usr/bin/ib_send_bw /usr/bin/rping)
# glibc dlopens libgcc_s for pthread_exit and cancellation, so ldd does not list it for C programs; without it
# rping aborts with "libgcc_s.so.1 must be installed for pthread_exit to work".
libdir=/usr/lib/x86_64-linux-gnu
guest_libs=("$libdir/libgcc_s.so.1")

die() {
    {
        echo
        echo "build-guest: ERROR: $1"
        shift
        for line in "$@"; do echo "build-guest:        $line"; done
    } >&2
    exit 1
}
now() { echo "$EPOCHREALTIME"; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
phase_start=$(now)
phase() {  # phase NAME: closes the previous phase's timer and prints its time
    echo "build-guest: $1 ($(took "$phase_start") s)"
    phase_start=$(now)
}
script_start=$(now)

install=none force=0
for arg in "$@"; do
    case $arg in
        --install) install=build ;;
        --install-only) install=only ;;
        --force) force=1 ;;
        *) die "unknown argument '$arg'" "usage: build-guest.sh [--install | --install-only] [--force]" ;;
    esac
done

# 1. Host packages. Skip apt entirely when all are present: a warm CI machine then pays nothing, and the stage
# does not depend on the mirror for packages it already has.
missing_packages() {
    local p
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${db:Status-Status}\n' "$p" 2>/dev/null | grep -qx installed || echo "$p"
    done
}
if [ "$install" != none ]; then
    mapfile -t absent < <(missing_packages)
    if [ "${#absent[@]}" -eq 0 ]; then
        echo "build-guest: all ${#packages[@]} host packages already installed"
    else
        [ "$(id -u)" = 0 ] || die "installing ${absent[*]} needs root (apt-get)"
        echo "build-guest: installing ${absent[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q || die "apt-get update failed (see above)"
        apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends "${packages[@]}" \
            || die "apt-get install failed (see above)" "packages: ${packages[*]}"
    fi
    phase "host packages"
    if [ "$install" = only ]; then exit 0; fi
fi

# Every tool and file this script and the guest need, all reported at once.
need=()
for c in qemu-system-x86_64 cpio depmod modinfo ldd dpkg-deb apt-cache apt-get xz sha256sum; do
    command -v "$c" >/dev/null || need+=("command $c")
done
for f in /usr/bin/busybox "${guest_tools[@]}" "${guest_libs[@]}" /etc/libibverbs.d/rxe.driver; do
    [ -e "$f" ] || need+=("file $f")
done
compgen -G "$libdir/libibverbs/librxe-rdmav*.so" >/dev/null || need+=("file $libdir/libibverbs/librxe-rdmav*.so")
[ "${#need[@]}" -eq 0 ] || die "missing on the host:" "${need[@]}" \
    "install them with: bash ci/rdma/build-guest.sh --install   (packages: ${packages[*]})"
# The guest has no dynamic loader of its own for busybox: it must be the static build (busybox-static), not the
# dynamically linked `busybox` package.
if ldd /usr/bin/busybox >/dev/null 2>&1; then
    die "/usr/bin/busybox is dynamically linked" "install busybox-static (it replaces the busybox package)"
fi
if ! mkdir -p "$cache/debs" 2> /dev/null || [ ! -w "$cache" ]; then
    die "cache dir $cache is not writable" "run as root or set KVRELAY_VM_CACHE to a writable dir"
fi

# 2. The kernel: the versioned package linux-image-amd64 depends on (bookworm-security's 6.1 kernel on Debian 12).
# The name changes with every security update (-57 -> -58) and old versions leave the mirror, so it is resolved
# each time and the .deb is cached under its own name; superseded ones are deleted.
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
if [ -z "$kpkg" ] && [ "$install" != none ]; then
    apt-get update -q >/dev/null || true  # packages were present, but the package lists may never have been fetched
    kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
fi
[ -n "$kpkg" ] || die "cannot resolve the kernel package from linux-image-amd64" \
    "apt-cache depends linux-image-amd64 names no linux-image-<version> package: run apt-get update (or --install)"
kver=${kpkg#linux-image-}
deb=$(compgen -G "$cache/debs/${kpkg}_*.deb" | head -n 1 || true)
if [ -z "$deb" ]; then
    echo "build-guest: downloading $kpkg"
    # apt-get download writes into the current directory; a temporary dir keeps a broken download out of the cache.
    # Owned by _apt, apt downloads as its sandbox user instead of warning that it runs "unsandboxed as root".
    download=$(mktemp -d "$cache/debs/.download.XXXXXX")
    chown _apt "$download" 2> /dev/null || true
    (cd "$download" && apt-get download -q "$kpkg") || { rm -rf "$download"; die "apt-get download $kpkg failed"; }
    mv "$download"/"${kpkg}"_*.deb "$cache/debs/"
    rm -rf "$download"
    deb=$(compgen -G "$cache/debs/${kpkg}_*.deb" | head -n 1)
fi
for old in "$cache"/debs/linux-image-*.deb; do
    if [ "$old" != "$deb" ] && [ -e "$old" ]; then
        echo "build-guest: removing superseded $(basename "$old")"
        rm -f "$old"
    fi
done
phase "kernel package $(basename "$deb")"

# Host files copied into the image: the tools, the rxe provider, libgcc_s and every library ldd resolves for them.
# ldd prints "name => /path (addr)" and bare "/path (addr)" lines; only the absolute .so paths are wanted.
provider=$(compgen -G "$libdir/libibverbs/librxe-rdmav*.so" | head -n 1)
host_files() {
    {
        printf '%s\n' "${guest_tools[@]}" "${guest_libs[@]}" "$provider"
        ldd "${guest_tools[@]}" "$provider" | grep -o '/[^ :]*\.so[^ :]*' || true
    } | sort -u
}
mapfile -t files < <(host_files)

# Everything the image is made of: skip the rebuild when none of it changed (saves ~5 s on a warm machine).
stamp=$(
    {
        echo "kernel $(basename "$deb")"
        cat "$here/build-guest.sh" "$here/guest-init.sh" | sha256sum  # contents only: any checkout shares the image
        stat -L -c '%n %s %Y' /usr/bin/busybox /etc/libibverbs.d/rxe.driver "${files[@]}"
    } | sha256sum | cut -d' ' -f1
)
if [ "$force" = 0 ] && [ -f "$cache/vmlinux" ] && [ -f "$cache/initrd.cpio" ] \
    && [ "$(cat "$cache/image.stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "build-guest: image in $cache is up to date ($kpkg); --force rebuilds it"
    echo "build-guest: done in $(took "$script_start") s"
    exit 0
fi

kdir=$(mktemp -d /tmp/kvrelay-vm-kernel.XXXXXX)
stage=$(mktemp -d /tmp/kvrelay-vm-stage.XXXXXX)
trap 'rm -rf "$kdir" "$stage"' EXIT
dpkg-deb -x "$deb" "$kdir" || die "cannot unpack $deb"
moddir=""
for d in "$kdir/lib/modules/$kver" "$kdir/usr/lib/modules/$kver"; do  # the second is Debian 13's layout
    [ -d "$d" ] && moddir=$d && break
done
[ -n "$moddir" ] || die "no modules directory for $kver in $deb"
vmlinuz="$kdir/boot/vmlinuz-$kver"
[ -f "$vmlinuz" ] || die "no $vmlinuz in $deb"
phase "unpacked $kpkg"

# 3. Uncompressed vmlinux. QEMU boots it through its PVH entry note (Debian builds CONFIG_PVH=y), which skips the
# bzImage's XZ self-decompression: ~3.5 s of every boot under TCG emulation. The payload starts at the XZ magic.
# tail writes to a file, not a pipe: under pipefail `tail | xz --single-stream` fails when xz stops reading early.
offset=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vmlinuz" | head -n 1 | cut -d: -f1 || true)
[ -n "$offset" ] || die "no XZ payload in $vmlinuz" "the kernel is not XZ-compressed; the PVH boot needs vmlinux"
tail -c +$((offset + 1)) "$vmlinuz" > "$kdir/vmlinux.xz"
xz -dc --single-stream "$kdir/vmlinux.xz" > "$cache/vmlinux.tmp" || die "cannot decompress the kernel payload"
[ "$(head -c 4 "$cache/vmlinux.tmp" | od -An -c | tr -d ' ')" = '177ELF' ] \
    || die "the payload of $vmlinuz is not an ELF vmlinux"
phase "vmlinux"

# 4. Root skeleton, usr-merged like the host so that every host path (and every path ldd prints) works unchanged.
mkdir -p "$stage"/usr/bin "$stage"/usr/lib64 "$stage$libdir" "$stage"/etc/libibverbs.d \
         "$stage"/proc "$stage"/sys "$stage"/dev "$stage"/tmp "$stage"/root "$stage"/opt/kvrelay-vm/bin
ln -s usr/bin "$stage/bin"
ln -s usr/bin "$stage/sbin"
ln -s bin "$stage/usr/sbin"
ln -s usr/lib "$stage/lib"
ln -s usr/lib64 "$stage/lib64"
echo 'root:x:0:0:root:/root:/bin/sh' > "$stage/etc/passwd"
echo 'root:x:0:' > "$stage/etc/group"
echo '127.0.0.1 localhost' > "$stage/etc/hosts"
install -m 755 "$here/guest-init.sh" "$stage/init"

# 5. Kernel modules: the dependency closure of the list above, stored uncompressed (busybox modprobe cannot read
# .ko.xz or .ko.zst), then depmod over the staged subset: the .deb ships no modules.dep (its postinst makes it).
find_module() {  # module names use _, some file names use -
    find "$moddir/kernel" \( -name "$1.ko*" -o -name "${1//_/-}.ko*" \) -print -quit
}
queue=("${modules[@]}")
declare -A seen=()
while [ "${#queue[@]}" -gt 0 ]; do
    m=${queue[0]}
    queue=("${queue[@]:1}")
    if [ -z "$m" ] || [ -n "${seen[$m]:-}" ]; then continue; fi
    seen[$m]=1
    f=$(find_module "$m")
    if [ -z "$f" ]; then
        # Built into the kernel is fine (e.g. crc32 on a future kernel); absent altogether is not.
        grep -qE "/(${m}|${m//_/-})\.ko$" "$moddir/modules.builtin" 2>/dev/null \
            || die "kernel $kver has no module $m, built in or loadable"
        echo "build-guest: $m is built into $kver"
        continue
    fi
    rel=${f#"$moddir"/}
    dest="$stage/lib/modules/$kver/${rel%/*}"
    mkdir -p "$dest"
    case $f in
        *.ko.xz) xz -dc "$f" > "$dest/$(basename "$f" .xz)" ;;
        *.ko.zst) command -v zstd >/dev/null || die "$f is zstd-compressed and zstd is not installed"
                  zstd -qdc "$f" > "$dest/$(basename "$f" .zst)" ;;
        *) cp "$f" "$dest/" ;;
    esac
    IFS=, read -r -a deps <<< "$(modinfo -F depends "$f")"
    queue+=("${deps[@]}")
done
cp "$moddir/modules.order" "$moddir"/modules.builtin* "$stage/lib/modules/$kver/"
depmod -b "$stage" "$kver" || die "depmod failed for the staged modules"
echo "build-guest: modules: ${!seen[*]}"
phase "modules"

# 6. Userspace: static busybox with a link per applet, then the host's RDMA tools, libraries and provider.
cp /usr/bin/busybox "$stage/usr/bin/busybox"
for f in "${files[@]}"; do
    mkdir -p "$stage$(dirname "$f")"
    cp -L "$f" "$stage$f"
done
# libibverbs finds providers through /etc/libibverbs.d/*.driver; only rxe is present in the guest.
cp /etc/libibverbs.d/rxe.driver "$stage/etc/libibverbs.d/"
for applet in $(/usr/bin/busybox --list); do
    [ -e "$stage/usr/bin/$applet" ] || ln -s busybox "$stage/usr/bin/$applet"
done
phase "userspace (${#files[@]} host files)"

# 7. Pack: uncompressed newc (fastest to build and to unpack). Renamed into place last, so a guest started while
# this runs never sees a half-written image.
(cd "$stage" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) > "$cache/initrd.cpio.tmp"
mv "$cache/vmlinux.tmp" "$cache/vmlinux"
mv "$cache/initrd.cpio.tmp" "$cache/initrd.cpio"
echo "$stamp" > "$cache/image.stamp"
phase "initramfs"
ls -l "$cache/vmlinux" "$cache/initrd.cpio"
echo "build-guest: done in $(took "$script_start") s"
