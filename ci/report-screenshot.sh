#!/usr/bin/env bash
# Regenerates the README's report screenshot (ci/screenshots/report-mutant.png): the page `kvrelay report` writes for
# a scenario with a self-test mutant planted, rendered by Debian's headless Chromium (apt-get install
# chromium-headless-shell). tests/it/report.rs takes the same kind of screenshot in CI and judges its pixels.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/report-screenshot
rm -rf "$out"
cargo run --locked --release -q -- report scenarios/basic/deepseek-v2-lite-dcp1-to-dcp2.yaml \
    --mutant decode-pages-per-chunk --html "$out"
chromium="${KVRELAY_CHROMIUM:-$(command -v chromium-headless-shell || command -v chromium)}"
"$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1000 \
    --screenshot="$PWD/ci/screenshots/report-mutant.png" "file://$PWD/$out/basic__deepseek-v2-lite-dcp1-to-dcp2.html" 2>/dev/null
echo "wrote ci/screenshots/report-mutant.png"
