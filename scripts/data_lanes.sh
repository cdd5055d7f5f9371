#!/usr/bin/env bash
# One lane of a campaign's data step: runs `ROUND=R DATA_ONLY=1 PARTS=... scripts/campaign.sh` for each
# "R:PARTS" argument in turn, one thread. Two lanes side by side use both cores of this machine without
# thrashing (session 27: two one-thread lanes beat one two-thread process). Resumable: rerun the same
# command after a kill (every `blockspec data` folder resumes shard by shard).
#
#   nohup scripts/data_lanes.sh "20:math" "20:code" > runs/lane-a20.log 2>&1 &
#   nohup scripts/data_lanes.sh "20:mixed followup" "20:competition" > runs/lane-b20.log 2>&1 &
#
# DATA_DTYPE / DATA_BATCH pass through to campaign.sh (bfloat16 / 128 on CPUs with AMX; float32 elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs/campaign
for job in "$@"; do
  round=${job%%:*}; parts=${job#*:}
  log="runs/campaign/data-$round-${parts// /-}.log"
  echo "$(date -u +%T) start round $round parts '$parts' (log $log)"
  ROUND=$round DATA_ONLY=1 PARTS="$parts" THREADS=1 scripts/campaign.sh > "$log" 2>&1
  echo "$(date -u +%T) done round $round parts '$parts'"
done
