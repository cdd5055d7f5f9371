#!/usr/bin/env bash
# The exact commands that produced the shipped drafter for the default target
# (src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16). CPU only, 2 cores.
# Both steps resume if interrupted: rerun the script.
set -euo pipefail
cd "$(dirname "$0")/.."
BS=.venv/bin/blockspec
DATA=${DATA:-../shared/data}

$BS data --target default --output runs/data-smollm2 --prompts "$DATA/gsm8k/train.jsonl" --limit 448 \
    --synthesize 128 --max-new-tokens 256 --batch-size 32 --shard-size 64 --seed 0

RESUME=""
[ -f runs/dflash-smollm2/latest/trainer_state.pt ] && RESUME="--resume"
$BS train $RESUME --target default --data runs/data-smollm2 --output runs/dflash-smollm2 \
    --num-layers 2 --target-layer-ids 1,8,15,22,27 --block-size 16 --draft-vocab-size 8192 \
    --num-anchors 24 --batch-size 4 --lr 1e-3 --epochs 10 --max-length 1024 \
    --eval-every 100 --eval-prompts 4 --eval-max-new-tokens 64 --save-every 25 --seed 0

.venv/bin/python scripts/ship_drafter.py runs/dflash-smollm2/final \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/dflash-smollm2/metrics.png
