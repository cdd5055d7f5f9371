#!/usr/bin/env bash
# One arm of a recipe A/B (issue 13, docs/training.md): the same data, the same seconds of
# training steps, warm-started from the shipped drafter, judged by held-out tau on benchmark
# test prompts that training never sees. Resumable; the result lands in runs/ab/ARM.json.
#
#   ARM=anchors96 DATA_FOLDERS=runs/campaign/regen-math-1 BUDGET_S=600 scripts/recipe_ab.sh --num-anchors 96
#
# Extra arguments are `blockspec train` options that override the defaults below. The eval runs the
# drafter in float32 (EVAL_DTYPE), as the campaign's does, so arms and rounds compare.
set -euo pipefail
cd "$(dirname "$0")/.."
ARM=${ARM:?name this arm}
DATA_FOLDERS=${DATA_FOLDERS:?folders written by blockspec data, joined by commas}
BUDGET_S=${BUDGET_S:-600}
THREADS=${THREADS:-1}
EVAL_LIMIT=${EVAL_LIMIT:-8}
INIT=${INIT:-src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16}
BS=.venv/bin/blockspec
mkdir -p runs/ab
RESUME=()
[ -f "runs/ab/$ARM/latest/trainer_state.pt" ] && RESUME=(--resume)
if [ ! -f "runs/ab/$ARM/final/model.safetensors" ] || [ ${#RESUME[@]} -gt 0 ]; then
  INIT_ARGS=()
  [ "$INIT" != none ] && INIT_ARGS=(--init-from "$INIT")
  $BS train "${RESUME[@]}" --target default --data "$DATA_FOLDERS" --output "runs/ab/$ARM" "${INIT_ARGS[@]}" \
      --num-layers 2 --target-layer-ids 1,8,15,22,27 --block-size 16 --draft-vocab-size 8192 \
      --num-anchors 24 --batch-size 4 --lr 6e-4 --warmup-ratio 0.02 --epochs 100 --max-length 1024 \
      --time-budget-s "$BUDGET_S" --eval-every 0 --save-every 25 --seed 0 --threads "$THREADS" "$@"
fi
# held-out subsets (EVAL_SEEDS): seed 1's result is runs/ab/ARM.json as ever, seed N's ARM.seedN.json;
# scripts/pool_heldout.py pools them (one subset of 8 is noisy: docs/training.md, session 32)
for SEED in ${EVAL_SEEDS:-1 2}; do
  OUT=runs/ab/$ARM$([ "$SEED" = 1 ] || echo ".seed$SEED").json
  [ -f "$OUT" ] || $BS eval-drafter "runs/ab/$ARM/final" --data-dir "${DATA:-../shared/data}" \
      --limit "$EVAL_LIMIT" --seed "$SEED" --max-new-tokens 128 --block-size 16 --threads "$THREADS" \
      --drafter-dtype "${EVAL_DTYPE:-float32}" --output "$OUT"
done
