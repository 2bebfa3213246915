#!/usr/bin/env bash
# SGLang's own connectors in kvrelay's connector seat, on the real engines (tests/connectors/sglang/README.md):
# `kvrelay check scenarios --connector CHILD --known FILE` runs every scenario with SGLang 0.5.23's
# MooncakeKVManager send path in each prefill rank's seat, moving the bytes through Mooncake's Transfer Engine, and
# prints the per-scenario table; tests/connectors/sglang/known-differences.yaml pins the known upstream differences
# (a listed case must fail exactly as recorded; anything else that fails, fails the stage). Then the same with
# SGLang's NixlKVManager on NIXL 1.5.1 (tests/connectors/sglang/nixl_connector.py, nixl-known-differences.yaml).
#
# Needs what ci/engines.sh made (target/engines/venv with Mooncake's wheel and numpy; target/engines/env.sh) and the
# SGLang wheel ci/sglang.sh fetched into tests/planners/sglang/wheels. This script adds to that venv the pinned
# pure-Python packages importing SGLang's connector modules needs (never torch: sglang_modules.py stands in for
# it), and is idempotent: once they are there it installs nothing. `--install-only` stops after that.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
    # Imported by the connector modules or by what they import (utils/common.py, environ.py, runtime_context.py).
    pyzmq==27.3.0 msgspec==0.22.0 orjson==3.13.0 prometheus-client==0.26.0 psutil==7.2.2 pydantic==2.14.3
    dill==0.4.1 packaging==26.3 pybase64==1.5.1
    # Already there with Mooncake's wheel (requests, aiohttp); named so that a venv made otherwise has them too.
    requests==2.34.2 aiohttp==3.14.5
)
VENV=target/engines/venv
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
KNOWN=tests/connectors/sglang/known-differences.yaml
NIXL_KNOWN=tests/connectors/sglang/nixl-known-differences.yaml
start=$(date +%s)
took() { printf 'ci/connectors.sh: %s after %d s\n' "$1" $(($(date +%s) - start)); }

[ -x "$VENV/bin/python" ] || bash ci/engines.sh
# shellcheck source=/dev/null
. target/engines/env.sh
if ! "$VENV/bin/python" - "${PACKAGES[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, _, wanted = pin.partition("==")
    assert version(name) == wanted, pin
PY
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PACKAGES[@]}"
fi
took "connector packages in $VENV"
compgen -G "tests/planners/sglang/wheels/sglang-$SGLANG_VERSION-*.whl" >/dev/null ||
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps "sglang==$SGLANG_VERSION" \
        -d tests/planners/sglang/wheels
took "SGLang $SGLANG_VERSION wheel"
[ "${1:-}" = "--install-only" ] && exit 0

[ -x target/release/kvrelay ] || cargo build --locked --release
status=0
target/release/kvrelay check scenarios \
    --connector "$KVRELAY_MOONCAKE_PYTHON tests/connectors/sglang/mooncake_connector.py --version $SGLANG_VERSION" \
    --known "$KNOWN" || status=$?
took "corpus with SGLang $SGLANG_VERSION's Mooncake connector in the connector seat (exit $status)"
# SGLang's NIXL connector on NIXL 1.5.1 (the wheel ci/engines.sh unzipped at target/engines/nixl), same venv.
nixl_status=0
target/release/kvrelay check scenarios \
    --connector "$KVRELAY_MOONCAKE_PYTHON tests/connectors/sglang/nixl_connector.py --version $SGLANG_VERSION" \
    --known "$NIXL_KNOWN" || nixl_status=$?
took "corpus with SGLang $SGLANG_VERSION's NIXL connector in the connector seat (exit $nixl_status)"
[ "$status" = 0 ] || exit "$status"
exit "$nixl_status"
