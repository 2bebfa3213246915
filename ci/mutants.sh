#!/usr/bin/env bash
# Optional CI job, never on the default .ci/run path: cargo-mutants over the planner (src/pure/plan), reporting its kill
# rate. Runs only when KVRELAY_MUTANTS=1 (a scheduled job, or by hand); it takes hours on 2 cores for the whole of
# src/pure/plan, so split it with KVRELAY_MUTANTS_SHARD=k/n (cargo-mutants --shard) across jobs with the same arguments.
# Installs cargo-mutants from crates.io with `cargo install --locked` when it is missing.
#   KVRELAY_MUTANTS=1                  run at all (otherwise say so and exit 0)
#   KVRELAY_MUTANTS_SHARD=k/n          this job's shard (default: every mutant)
#   KVRELAY_MUTANTS_TIMEOUT=SECONDS    per-mutant test timeout (default 600)
#   KVRELAY_MUTANTS_FILES='glob ...'   files to mutate (default 'src/pure/plan/*.rs')
# Exit: 0 when the run completed (missed or timed-out mutants are reported in the kill rate, not failures), the
# cargo-mutants code otherwise (1 usage, 4 the unmutated tree fails its tests).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${KVRELAY_MUTANTS:-0}" != 1 ]]; then
    echo "ci/mutants.sh: skipped (set KVRELAY_MUTANTS=1 to run cargo-mutants over src/pure/plan)"
    exit 0
fi
if ! cargo mutants --version >/dev/null 2>&1; then
    cargo install --locked cargo-mutants
fi

out=target/mutants
mkdir -p target # a fresh clone has none; cargo-mutants creates only the last path component
args=(--no-shuffle --output "$out" --timeout "${KVRELAY_MUTANTS_TIMEOUT:-600}")
set -f # the globs are cargo-mutants', not the shell's
for glob in ${KVRELAY_MUTANTS_FILES:-src/pure/plan/*.rs}; do
    args+=(--file "$glob")
done
set +f
if [[ -n "${KVRELAY_MUTANTS_SHARD:-}" ]]; then
    args+=(--shard "$KVRELAY_MUTANTS_SHARD")
fi

status=0
cargo mutants "${args[@]}" || status=$?
case "$status" in
    0 | 2 | 3) ;; # 2: some mutants missed, 3: some timed out; both go into the kill rate below
    *) echo "ci/mutants.sh: cargo-mutants failed with exit $status" >&2; exit "$status" ;;
esac

count() { if [[ -f "$out/mutants.out/$1.txt" ]]; then wc -l <"$out/mutants.out/$1.txt"; else echo 0; fi; }
caught=$(count caught) missed=$(count missed) timeout=$(count timeout) unviable=$(count unviable)
viable=$((caught + missed + timeout))
if ((viable == 0)); then
    echo "ci/mutants.sh: no viable mutants (unviable: $unviable)"
    exit 0
fi
echo "cargo-mutants over ${KVRELAY_MUTANTS_FILES:-src/pure/plan/*.rs}${KVRELAY_MUTANTS_SHARD:+ (shard $KVRELAY_MUTANTS_SHARD)}: $caught caught, $timeout timed out, $missed missed, $unviable unviable"
echo "kill rate: $(((caught + timeout) * 1000 / viable / 10)).$(((caught + timeout) * 1000 / viable % 10)) % of $viable viable mutants (timeouts count as killed); missed ones: $out/mutants.out/missed.txt"
