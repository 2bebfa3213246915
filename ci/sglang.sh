#!/usr/bin/env bash
# SGLang's own planning helpers in kvrelay's planner seat (issue 9): tests/planners/sglang/adapter.py loads
# build_dcp_token_transfer_plan, group_concurrent_contiguous, build_transfer_entry_pairs, resolve_dcp_dst_entry_indices,
# compute_mamba_state_slice_byte_blocks and compute_head_slice_params from the SGLang wheel (no torch, no install) and
# answers the plan protocol the way the Mooncake connector calls them; `kvrelay check --planner` runs the whole corpus
# and prints the per-scenario table, with tests/planners/sglang/known-differences.yaml as the known upstream
# differences (a listed case must fail exactly as recorded; anything else unlisted that fails, fails the stage).
#
# Needs: python3 >= 3.11 with venv, and a package registry (PyPI or a mirror pip is configured for): a venv under
# target/ gets a pinned numpy, and `pip download sglang==VERSION --no-deps` fetches the wheel once into
# tests/planners/sglang/wheels/ (git-ignored; load_helpers checks its sha256 and every source file against RECORD).
# SGLANG_VERSION=0.5.22 bash ci/sglang.sh names another version (its known differences may differ).
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
NUMPY_VERSION=2.4.6
VENV=target/sglang-venv
WHEELS=tests/planners/sglang/wheels
KNOWN=tests/planners/sglang/known-differences.yaml
start=$(date +%s)
took() { printf 'ci/sglang.sh: %s after %d s\n' "$1" $(($(date +%s) - start)); }

if ! "$VENV/bin/python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV"; then
        # A system python without ensurepip: its venv package comes from apt (as .ci/run installs its packages).
        rm -rf "$VENV"
        [ "$(id -u)" = 0 ] || { echo "ci/sglang.sh: python3 -m venv failed and apt-get needs root" >&2; exit 1; }
        apt-get update -q && apt-get install -y -q --no-install-recommends python3-venv
        python3 -m venv "$VENV"
    fi
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "numpy==$NUMPY_VERSION"
took "venv with numpy $NUMPY_VERSION ($VENV)"

if ! compgen -G "$WHEELS/sglang-$SGLANG_VERSION-*.whl" >/dev/null; then
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps "sglang==$SGLANG_VERSION" -d "$WHEELS"
fi
took "SGLang $SGLANG_VERSION wheel ($(basename "$(compgen -G "$WHEELS/sglang-$SGLANG_VERSION-*.whl" | head -1)"))"

[ -x target/release/kvrelay ] || cargo build --locked --release
status=0
target/release/kvrelay check \
    --planner "$VENV/bin/python tests/planners/sglang/adapter.py --version $SGLANG_VERSION" \
    --known "$KNOWN" || status=$?
took "corpus with SGLang $SGLANG_VERSION's helpers in the planner's seat (exit $status)"

# The compatibility matrix with the same helpers in the seat: every generated cell, ≠ where SGLang disagrees with
# kvrelay (README.md "Compatibility matrix"); the table goes to the log and target/matrix-sglang.{md,html}.
matrix=0
target/release/kvrelay matrix \
    --planner "$VENV/bin/python tests/planners/sglang/adapter.py --version $SGLANG_VERSION" \
    --markdown target/matrix-sglang.md --html target/matrix-sglang.html || matrix=$?
cat target/matrix-sglang.md
took "compatibility matrix with SGLang $SGLANG_VERSION's helpers in the planner's seat (exit $matrix)"
[ "$status" = 0 ] || exit "$status"
exit "$matrix"
