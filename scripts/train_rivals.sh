#!/usr/bin/env bash
# The rival drafters of issue #5 for the default target, trained on the SAME regenerated
# data as the shipped DFlash drafter's stage 2 (runs/data2-smollm2: 1,960 prompts, target
# features stored at layers 1,8,15,22,27), each for one epoch with a fixed step count
# sized to about 20 minutes on this 2-core CPU. Every step resumes if interrupted: rerun
# the script (finished runs are skipped). Usage: scripts/train_rivals.sh [eagle3|mtp|draft-model]...
set -euo pipefail
cd "$(dirname "$0")/.."
BS=.venv/bin/blockspec
COMMON="--target default --data runs/data2-smollm2 --batch-size 4 --lr 1e-3 --epochs 1 --max-length 1024
        --eval-every 100 --eval-prompts 6 --eval-max-new-tokens 64 --save-every 25 --seed 0"

train() {  # train NAME OPTIONS...
  local name=$1; shift
  [ -f "runs/$name/final/model.safetensors" ] || [ -f "runs/$name/final/config.json" ] && return 0
  local resume=""
  [ -f "runs/$name/latest/trainer_state.pt" ] && resume="--resume"
  $BS train $resume $COMMON --output "runs/$name" "$@"
}

for method in "${@:-eagle3 mtp draft-model}"; do
  for m in $method; do
    case $m in
      # one EAGLE-3 layer on low/mid/high features (stored layers: no target pass), 7-step training-time test
      eagle3) train eagle3-smollm2 --method eagle3 --target-layer-ids 1,15,27 --block-size 8 \
                  --draft-vocab-size 8192 --num-anchors 64 --max-steps 480 ;;
      # one FastMTP head on the final hidden state (not stored: computed by a target pass per sequence)
      mtp) train mtp-smollm2 --method mtp --block-size 8 --draft-vocab-size 8192 --num-anchors 64 \
               --max-steps 300 ;;
      # a 4-layer early exit of the target, trained on the responses
      draft-model) train draftlm-smollm2 --method draft-model --num-layers 4 --max-steps 300 ;;
      *) echo "unknown rival $m" >&2; exit 2 ;;
    esac
  done
done
