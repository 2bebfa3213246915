#!/usr/bin/env bash
# Builds the sample C transport plug-in (tests/plugins/memcpy/memcpy_transport.c) with the system C compiler, clean
# and with its planted wrong-offset bug, into target/plugins/, and prints the two paths (one a line):
#   target/plugins/libkvrelay_memcpy.so          must pass certification
#   target/plugins/libkvrelay_memcpy_planted.so  must fail it
# Load either with `--fabric plugin:PATH`. CC overrides the compiler (default: cc).
set -euo pipefail
cd "$(dirname "$0")/.."
cc="${CC:-cc}"
if ! command -v "$cc" >/dev/null 2>&1 && [ "$cc" = cc ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ci/plugin.sh: no C compiler on PATH: apt-get install gcc libc6-dev" >&2
    apt-get update -q && apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends gcc libc6-dev >&2
fi
if ! command -v "$cc" >/dev/null 2>&1; then
    echo "ci/plugin.sh: no C compiler \`$cc\` on PATH (fix: apt-get install gcc, or set CC)" >&2
    exit 1
fi
out=target/plugins
mkdir -p "$out"
flags=(-std=c11 -Wall -Wextra -Werror -O2 -shared -fPIC -I src/fabric)
source=tests/plugins/memcpy/memcpy_transport.c
"$cc" "${flags[@]}" -o "$out/libkvrelay_memcpy.so" "$source"
"$cc" "${flags[@]}" -DKVRELAY_SAMPLE_PLANT_WRONG_OFFSET -o "$out/libkvrelay_memcpy_planted.so" "$source"
echo "$PWD/$out/libkvrelay_memcpy.so"
echo "$PWD/$out/libkvrelay_memcpy_planted.so"
