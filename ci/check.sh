#!/usr/bin/env bash
# Local entry point: the exact checks CI runs (.ci/run), with the same environment.
set -euo pipefail
exec bash "$(dirname "$0")/../.ci/run"
