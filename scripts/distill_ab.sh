#!/usr/bin/env bash
# Issue #3 candidate: hard labels vs distillation from the target's top-8 distribution.
# Two short runs from the same start (the stage-1 drafter) on the same data, same steps
# and seed; compare the held-out tau at the end (metrics.jsonl of each run). Resumable.
set -euo pipefail
cd "$(dirname "$0")/.."
BS=.venv/bin/blockspec
COMMON="--target default --data runs/data2-smollm2 --init-from runs/dflash-smollm2/final
        --num-layers 2 --target-layer-ids 1,8,15,22,27 --block-size 16 --draft-vocab-size 8192
        --num-anchors 24 --batch-size 4 --lr 1e-3 --warmup-ratio 0.02 --epochs 1 --max-steps 150
        --max-length 1024 --holdout 24 --eval-every 150 --eval-prompts 16 --eval-max-new-tokens 64
        --save-every 25 --seed 0"
for k in 0 8; do
  out=runs/distill-ab-k$k
  [ -f "$out/final/model.safetensors" ] && continue
  resume=""
  [ -f "$out/latest/trainer_state.pt" ] && resume="--resume"
  $BS train $resume $COMMON --distill-topk $k --output "$out"
done
