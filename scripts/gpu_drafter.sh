#!/usr/bin/env bash
# The GPU shot (issue 13): in ONE device call (<= 10 minutes on an H200) regenerate millions of
# training tokens with the default target, train the DFlash drafter on them from the shipped
# one, and bring it back through $OUT (fp16, < 16 MiB). Prepared by scripts/gpu_prepare.sh
# (which also lists the four calls). Every phase has a deadline, so the call ends in time
# with whatever finished: data shards are atomic, training stops at its time budget.
#
# Rehearsal on the CPU at toy scale (same script, same code paths):
#   PYTHON=.venv/bin/python DEVICE=cpu THREADS=1 OUT=/tmp/gpu-out WORK=/tmp/gpu-work GSM=24 SYNTH=8 \
#     GEN_BATCH=8 SHARD=8 GEN_TOKENS=32 DATA_S=240 TRAIN_S=30 TRAIN_BATCH=4 ANCHORS=8 bash scripts/gpu_drafter.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder that comes back}"
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-/tmp/blockspec-gpu}
GSM=${GSM:-7473}            # GSM8K train questions (all of them), in the benchmark's prompt format
SYNTH=${SYNTH:-6000}        # user turns the target writes itself (chat and everything else)
GEN_BATCH=${GEN_BATCH:-768} # rows decoded together
SHARD=${SHARD:-1536}
GEN_TOKENS=${GEN_TOKENS:-256}
DATA_S=${DATA_S:-200}       # wall-clock for all regeneration
TRAIN_S=${TRAIN_S:-230}     # seconds of training steps
TRAIN_BATCH=${TRAIN_BATCH:-32}
ANCHORS=${ANCHORS:-64}      # 32 x 64 = 2048 blocks per step, the reference's scale
SHIPPED=src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/gpu.log"; }
started=$(date +%s)

# 1. what the device lacks: newer transformers, gguf, platformdirs (wheels), then the target
if [ -d .gpu/wheels ] && [ -z "${SKIP_WHEELS:-}" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      .gpu/wheels/*.whl || { log "wheel install failed"; exit 1; }
  export PYTHONPATH="$WORK/site:$PWD/src"
else
  export PYTHONPATH="$PWD/src"
fi
BS=("$PYTHON" -m blockspec.cli)
if [ -n "${TARGET:-}" ]; then
  GGUF=$TARGET
else
  GGUF="$WORK/SmolLM2-135M-Instruct.Q4_1.gguf"
  cat .gpu/part-*/piece > "$GGUF"
  if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat .gpu/gguf.sha256)" ]; then
    log "the target's GGUF pieces do not add up (sha256 differs): carry .gpu/part-1..3 again"; exit 1
  fi
fi
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/gpu.log"
log "setup done in $(( $(date +%s) - started )) s"

# 2. regeneration until the data deadline; each shard lands atomically, so a cut keeps the finished ones
deadline=$(( $(date +%s) + DATA_S ))
SUFFIX=$'\nPlease reason step by step, and put your final answer within \\boxed{}.'
PROMPTS=${PROMPTS_FILE:-.gpu/gsm8k-train.jsonl}
COMMON=(--target "$GGUF" --device "$DEVICE" --max-new-tokens "$GEN_TOKENS" --batch-size "$GEN_BATCH"
        --shard-size "$SHARD" ${THREADS:+--threads "$THREADS"})
left() { echo $(( deadline - $(date +%s) )); }
[ "$(left)" -gt 5 ] && timeout "$(left)" "${BS[@]}" data "${COMMON[@]}" --output "$WORK/data-math" \
    --prompts "$PROMPTS[0:$GSM]" --prompt-suffix "$SUFFIX" --seed 11 2>&1 | tr '\r' '\n' | grep -v "^regenerating" \
    | tee -a "$OUT/gpu.log"
[ "$(left)" -gt 5 ] && timeout "$(left)" "${BS[@]}" data "${COMMON[@]}" --output "$WORK/data-mixed" \
    --prompts builtin:coding_tasks --prompts builtin:everyday_questions --seed 12 2>&1 | tr '\r' '\n' \
    | grep -v "^regenerating" | tee -a "$OUT/gpu.log"
[ "$(left)" -gt 5 ] && timeout "$(left)" "${BS[@]}" data "${COMMON[@]}" --output "$WORK/data-synth" \
    --synthesize "$SYNTH" --seed 13 2>&1 | tr '\r' '\n' | grep -v -e "^regenerating" -e "^synthesizing" \
    | tee -a "$OUT/gpu.log"
FOLDERS=$(for f in "$WORK"/data-*/; do if ls "$f"shard-*.jsonl >/dev/null 2>&1; then echo "${f%/}"; fi; done \
    | paste -sd, -)
[ -n "$FOLDERS" ] || { log "no finished data shard before the deadline"; exit 1; }
TOKENS=$(cat "$WORK"/data-*/shard-*.jsonl | "$PYTHON" -c "import sys, json; print(sum(len(json.loads(l)['response_ids']) for l in sys.stdin if l.strip()))")
log "data: $TOKENS response tokens in $FOLDERS after $(( $(date +%s) - started )) s"

# 3. training for TRAIN_S seconds of steps, warm-started from the shipped drafter (features are
# computed on the GPU per batch and cached in host memory)
"${BS[@]}" train --device "$DEVICE" --target "$GGUF" --data "$FOLDERS" --output "$WORK/run" --init-from "$SHIPPED" \
    --num-layers 2 --target-layer-ids 1,8,15,22,27 --block-size 16 --draft-vocab-size 8192 \
    --num-anchors "$ANCHORS" --batch-size "$TRAIN_BATCH" --lr 6e-4 --warmup-ratio 0.02 --epochs 100 \
    --time-budget-s "$TRAIN_S" --max-length 1024 --holdout 16 --eval-every 1000000 --eval-prompts 16 \
    --eval-max-new-tokens 96 --save-every 200 --seed 0 ${THREADS:+--threads "$THREADS"} 2>&1 | tr '\r' '\n' | grep -v "^training:" | tee -a "$OUT/gpu.log"

# 4. back through $OUT (files of at most 16 MiB): the drafter's fp16 weights in pieces, its metrics
# and the log; here `python scripts/gpu_unpack.py FILES_AT runs/gpu-drafter` makes it one folder again
"$PYTHON" scripts/gpu_pack.py "$WORK/run/final" "$OUT" 2>&1 | tee -a "$OUT/gpu.log"
log "done in $(( $(date +%s) - started )) s"
