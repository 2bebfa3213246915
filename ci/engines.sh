#!/usr/bin/env bash
# The real transfer engines users ship (issue 20), fetched from the package registries at pinned versions and made
# findable, so that `--fabric nixl` and `--fabric mooncake` run them on this machine's host memory, over loopback only:
#
# - NIXL: `pip download --no-deps nixl-cu12==1.5.1` (about 66 MB: libnixl, its plug-ins, a bundled UCX and
#   libnixl_capi.so, the C API that the nixl-sys bindings load at run time), unzipped into target/engines/nixl.
#   kvrelay finds target/engines/nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so there by itself (src/fabric/nixl.rs);
#   KVRELAY_NIXL_LIB names another copy.
# - Mooncake Transfer Engine: mooncake-transfer-engine-non-cuda==0.3.13.post1 with a pinned numpy in a venv at
#   target/engines/venv (its engine.so needs Debian's libibverbs1, libnl-3-200 and libnl-route-3-200, installed
#   here with apt-get when missing). KVRELAY_MOONCAKE_PYTHON names that venv's python.
#
# It writes target/engines/env.sh, which pins the environment both engines need (source it before running them
# by hand; .ci/run does):
#   UCX_MODULES=^ib      without it every process that made a UCX backend dies with SIGSEGV at exit (libnl, IB module)
#   UCX_NET_DEVICES=lo   UCX would otherwise also send over this machine's other addresses: test traffic stays on
#                        loopback
#   UCX_TLS=cma,tcp      the fastest pair between processes here (`tcp` alone where ptrace is restricted)
#   MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER / MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535: Mooncake's TCP lanes refuse
#                        batches of more than 2 to 4 K entries with the defaults
# Idempotent: a second run downloads nothing. `bash ci/engines.sh --nixl-only` skips Mooncake.
# `bash ci/engines.sh --nixl-cu13` fetches only NIXL's CUDA 13 wheel (nixl-cu13==1.5.1, about 59 MB) into
# target/engines/nixl-cu13, where `--fabric nixl-cuda` finds it (GPU machines; CI has no GPU and never needs it).
set -euo pipefail
cd "$(dirname "$0")/.."

NIXL_WHEEL=nixl-cu12==1.5.1
MOONCAKE_WHEEL=mooncake-transfer-engine-non-cuda==0.3.13.post1
NUMPY_VERSION=2.4.6
ROOT=target/engines
WHEELS=$ROOT/wheels
start=$(date +%s)
took() { printf 'ci/engines.sh: %s after %d s\n' "$1" $(($(date +%s) - start)); }
mkdir -p "$WHEELS"

if [ "${1:-}" = "--nixl-cu13" ]; then
    if [ ! -f "$ROOT/nixl-cu13/.nixl_cu13.mesonpy.libs/libnixl_capi.so" ]; then
        ls "$WHEELS"/nixl_cu13-1.5.1-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps nixl-cu13==1.5.1 -d "$WHEELS"
        rm -rf "$ROOT/nixl-cu13"
        python3 -m zipfile -e "$WHEELS"/nixl_cu13-1.5.1-*.whl "$ROOT/nixl-cu13"
    fi
    took "NIXL (nixl-cu13==1.5.1) in $ROOT/nixl-cu13"
    exit 0
fi

# NIXL: the wheel, unzipped (the libraries carry RPATH $ORIGIN, so no LD_LIBRARY_PATH is needed).
if [ ! -f "$ROOT/nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so" ]; then
    ls "$WHEELS"/nixl_cu12-1.5.1-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps "$NIXL_WHEEL" -d "$WHEELS"
    rm -rf "$ROOT/nixl"
    python3 -m zipfile -e "$WHEELS"/nixl_cu12-1.5.1-*.whl "$ROOT/nixl"
fi
took "NIXL ($NIXL_WHEEL) in $ROOT/nixl"

if [ "${1:-}" != "--nixl-only" ]; then
    missing=()
    for lib in libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200; do
        ldconfig -p | grep -q "$lib" || missing+=("$lib")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        [ "$(id -u)" = 0 ] || { echo "ci/engines.sh: Mooncake needs ${missing[*]} (apt-get install libibverbs1 libnl-3-200 libnl-route-3-200) and apt-get needs root" >&2; exit 1; }
        apt-get update -q && apt-get install -y -q --no-install-recommends libibverbs1 libnl-3-200 libnl-route-3-200
    fi
    if ! "$ROOT/venv/bin/python" -c 'import mooncake.engine' 2>/dev/null; then
        rm -rf "$ROOT/venv"
        python3 -m venv "$ROOT/venv"
        "$ROOT/venv/bin/pip" install -q "$MOONCAKE_WHEEL" "numpy==$NUMPY_VERSION"
    fi
    took "Mooncake ($MOONCAKE_WHEEL) in $ROOT/venv"
fi

abs=$(cd "$ROOT" && pwd)
cat > "$ROOT/env.sh" <<ENV
# Written by ci/engines.sh: the environment kvrelay's real-engine fabrics run in.
export KVRELAY_NIXL_LIB=$abs/nixl/.nixl_cu12.mesonpy.libs
export UCX_MODULES='^ib'
export UCX_NET_DEVICES=lo
export UCX_TLS=cma,tcp
export KVRELAY_MOONCAKE_PYTHON=$abs/venv/bin/python
export MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535
export MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535
ENV
took "wrote $ROOT/env.sh"
