#!/usr/bin/env bash
# A 100,000-seed fault swarm over the corpus as a Slurm array job, one shard per task, merged by a job that waits
# for the array (README "Faults and swarm runs", "Across machines"). From a checkout with kvrelay built
# (cargo build --release), on the cluster's login node:
#   bash ci/slurm/swarm-array.sh [SHARDS] [SEEDS]
# Each task runs `kvrelay sim scenarios --shard slurm --json target/swarm/shard-<task>.json` (the task's shard of
# the (seed, scenario) cases, from SLURM_ARRAY_TASK_ID/MIN/MAX); the merge job prints the unsharded report and
# fails on any harness failure, each with its one-line reproduce command.
set -euo pipefail
cd "$(dirname "$0")/../.."
shards=${1:-64}
seeds=${2:-100000}
mkdir -p target/swarm
array=$(sbatch --parsable --array=0-$((shards - 1)) --job-name kvrelay-swarm --output target/swarm/task-%a.log \
    --wrap "target/release/kvrelay sim scenarios --seeds $seeds --shard slurm --json target/swarm/shard-\$SLURM_ARRAY_TASK_ID.json")
sbatch --parsable --dependency=afterany:"$array" --job-name kvrelay-swarm-merge --output target/swarm/merge.log \
    --wrap "target/release/kvrelay merge target/swarm/shard-*.json --json target/swarm/merged.json"
echo "submitted array $array ($shards shards of $seeds seeds); the merged report will be in target/swarm/merge.log"
