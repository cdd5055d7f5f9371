#!/usr/bin/env bash
# The exact commands that produced the shipped drafter for the default target
# (src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16). CPU only, 2 cores.
# Every step resumes if interrupted: rerun the script (finished steps are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
BS=.venv/bin/blockspec
DATA=${DATA:-../shared/data}

# Stage 1 (session 1): 576 prompts, transformers' generate, trained from the target's top layers.
if [ ! -f runs/dflash-smollm2/final/model.safetensors ]; then
  $BS data --target default --output runs/data-smollm2 --prompts "$DATA/gsm8k/train.jsonl" --limit 448 \
      --synthesize 128 --max-new-tokens 256 --batch-size 32 --shard-size 64 --seed 0
  RESUME=""
  [ -f runs/dflash-smollm2/latest/trainer_state.pt ] && RESUME="--resume"
  $BS train $RESUME --target default --data runs/data-smollm2 --output runs/dflash-smollm2 \
      --num-layers 2 --target-layer-ids 1,8,15,22,27 --block-size 16 --draft-vocab-size 8192 \
      --num-anchors 24 --batch-size 4 --lr 1e-3 --epochs 10 --max-length 1024 \
      --eval-every 100 --eval-prompts 4 --eval-max-new-tokens 64 --save-every 25 --seed 0
fi

# Stage 2 (session 2): more varied prompts (the next 1000 GSM8K train questions, the
# project's own coding tasks and everyday questions, 160 self-synthesized), regenerated
# with the lean batched decoder which also stores the features training needs; then a
# warm start from stage 1 on both datasets.
$BS data --target default --output runs/data2-smollm2 --prompts "$DATA/gsm8k/train.jsonl[448:1448]" \
    --prompts builtin:coding_tasks --prompts builtin:everyday_questions --synthesize 160 \
    --max-new-tokens 256 --batch-size 64 --shard-size 128 --feature-layers 1,8,15,22,27 --seed 1
if [ ! -f runs/dflash2-smollm2/final/model.safetensors ]; then
  RESUME=""
  [ -f runs/dflash2-smollm2/latest/trainer_state.pt ] && RESUME="--resume"
  $BS train $RESUME --target default --data runs/data2-smollm2,runs/data-smollm2 --output runs/dflash2-smollm2 \
      --init-from runs/dflash-smollm2/final \
      --num-layers 2 --target-layer-ids 1,8,15,22,27 --block-size 16 --draft-vocab-size 8192 \
      --num-anchors 24 --batch-size 4 --lr 1e-3 --warmup-ratio 0.02 --epochs 2 --max-length 1024 \
      --eval-every 200 --eval-prompts 6 --eval-max-new-tokens 64 --save-every 50 --seed 0
fi

if [ ! -f runs/campaign/ledger.jsonl ]; then
  .venv/bin/python scripts/ship_drafter.py runs/dflash2-smollm2/final \
      src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/dflash2-smollm2/metrics.png
fi

# Stage 3 (session 5): the campaign's round 1 (docs/training.md), warm-started from stage 2 as
# shipped; it regenerates its own data, trains for a CPU-time budget, evaluates held-out and
# ships only a better drafter. (In session 5 it ran with BUDGET_S=2100 on the first 4 mixed
# shards and was resumed at step ~700 with BUDGET_S=1500 and all shards.)
ROUND=1 THREADS=1 BUDGET_S=1500 scripts/campaign.sh

# Stages 4-7 (sessions 6-11): later rounds, each from a worktree of the session's code, one
# thread. Round 2 shipped. Round 3 ran in a checkout without rounds 1-2's data (so it and
# every later round trained without them: they are set aside below, as then) and was not
# shipped; round 4 continued it on rounds 3-4's data and shipped (stage 5); round 5
# continued round 4 on rounds 3-5's data and was not shipped (chat fell 0.01); round 6
# continued round 5 on rounds 3-6's data and shipped (stage 6).
# Stage 7 (session 11): round 7 continued round 6 on rounds 3-7's data and shipped (stage 7).
# Its competition-math step ran by hand beside the round, with the command the
# script now holds, and was finished before training listed the data folders.
ROUND=2 THREADS=1 BUDGET_S=2400 scripts/campaign.sh
mkdir -p runs/campaign/set-aside
for data in runs/campaign/regen-*-1 runs/campaign/regen-*-2; do
  if [ -e "$data" ]; then mv "$data" runs/campaign/set-aside/; fi
done
ROUND=3 THREADS=1 BUDGET_S=2400 scripts/campaign.sh
ROUND=4 THREADS=1 BUDGET_S=2400 INIT=runs/campaign/train-3/final scripts/campaign.sh
ROUND=5 THREADS=1 BUDGET_S=2400 INIT=runs/campaign/train-4/final scripts/campaign.sh
ROUND=6 THREADS=1 BUDGET_S=2400 INIT=runs/campaign/train-5/final scripts/campaign.sh
ROUND=7 THREADS=1 BUDGET_S=2400 INIT=runs/campaign/train-6/final scripts/campaign.sh
# Stage 8 (session 12): round 8 in two arms on the same data. The campaign's own run trained in
# fp32 (the code of the time had no --precision) and shipped in its worktree; the same train
# command under bf16 autocast learned more in the same CPU time and is the drafter in the repo
# (OOM-killed once at step 1,299 beside the fp32 run and resumed with --resume; exact).
ROUND=8 THREADS=1 BUDGET_S=2400 INIT=runs/campaign/train-7/final PRECISION=fp32 scripts/campaign.sh
FOLDERS=$(ls -d runs/campaign/regen-*-[3-8] | sort | paste -sd, -)
.venv/bin/blockspec train --target default --data "$FOLDERS" --output runs/campaign/train-8-bf16 \
    --init-from runs/campaign/train-7/final --num-layers 2 --target-layer-ids 1,8,15,22,27 --block-size 16 \
    --draft-vocab-size 8192 --num-anchors 24 --batch-size 4 --lr 6e-4 --warmup-ratio 0.02 --epochs 100 \
    --loss-weighting decay --time-budget-s 2400 --time-budget-clock cpu --max-length 1024 --eval-every 0 \
    --save-every 25 --seed 8 --threads 1 --precision bf16
.venv/bin/blockspec eval-drafter runs/campaign/train-8-bf16/final --data-dir ../shared/data --limit 8 \
    --max-new-tokens 128 --block-size 16 --threads 1 --output runs/campaign/eval/train-8-bf16.json
python scripts/ship_drafter.py runs/campaign/train-8-bf16/final src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 \
    runs/campaign/train-8-bf16/metrics.png
# Stage 9 (session 13): round 9 continued the bf16 arm of round 8 on rounds 3-9's data (its data
# prepared in session 12 by `ROUND=9 DATA_ONLY=1`, the competition step by hand with the script's
# command); training under bf16 autocast (`--precision auto` on this CPU); shipped.
ROUND=9 THREADS=1 BUDGET_S=2400 INIT=runs/campaign/train-8-bf16/final scripts/campaign.sh
# Stage 10 (session 14, a new machine: runs/ with rounds 1-10's data was gone, so round 10
# regenerated its own data, all four kinds, and trained on it alone from the shipped stage 9).
# Data with two threads, the target in bf16 (slower than fp32 on this VM, which lacks AMX;
# measured afterwards); training in fp32 (`auto` picks fp32 here since session 14); shipped.
ROUND=10 THREADS=2 DATA_ONLY=1 DATA_DTYPE=bfloat16 DATA_BATCH=128 scripts/campaign.sh
ROUND=10 THREADS=1 BUDGET_S=2400 SKIP_DATA=1 PRECISION=fp32 scripts/campaign.sh
# Stage 11 (session 15, runs/ kept: trained on rounds 10 + 11's data from the shipped stage 10).
# Data with two threads, the target in float32 at batch 32 (the defaults); training fp32 (`auto` here); shipped.
ROUND=11 THREADS=2 DATA_ONLY=1 scripts/campaign.sh
ROUND=11 THREADS=1 BUDGET_S=2400 SKIP_DATA=1 scripts/campaign.sh
# Stage 12 (session 27, a new machine with AMX: runs/ was gone again). Rounds 18 and 19's data in
# bf16 at batch 128 (two one-thread lanes in the session: math + code in one, mixed + followup +
# competition in the other; here one after the other), then the recipe A/B arm that was shipped:
# from stage 11 with its draft vocabulary kept, expected-length loss weights, lr 3e-4 cosine over
# 3,600 CPU-seconds of one thread, bf16 autocast (`--precision auto` on AMX); docs/training.md,
# fourth A/B. Its twin with decayed weights (`runs/ab-r18.sh a`) measured lower and was not shipped.
ROUND=18 THREADS=1 DATA_ONLY=1 DATA_DTYPE=bfloat16 DATA_BATCH=128 scripts/campaign.sh
ROUND=19 THREADS=1 DATA_ONLY=1 DATA_DTYPE=bfloat16 DATA_BATCH=128 scripts/campaign.sh
FOLDERS=$(ls -d runs/campaign/regen-*-1[89] | paste -sd, -)
INIT=runs/campaign/train-11/final ARM=r18-lr3e4-dpace DATA_FOLDERS=$FOLDERS BUDGET_S=3600 scripts/recipe_ab.sh \
    --seed 18 --time-budget-clock cpu --lr 3e-4 --keep-init-vocabulary true --loss-weighting expected-length
.venv/bin/python scripts/ship_drafter.py runs/ab/r18-lr3e4-dpace/final \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/ab/r18-lr3e4-dpace/metrics.png
# Stage 13 (session 29, a new machine without AMX: runs/ was gone again). Round 20's data whole and
# round 21's word problems, user turns and competition questions, float32 at batch 64, in two
# one-thread lanes (scripts/data_lanes.sh; here one after the other); then the fifth A/B's 2-layer
# arm from stage 12 (fp32 steps: `auto` on this CPU), continued at two threads and a lower lr, shipped.
# Its 3-layer twin (`--num-layers 3`, same command otherwise) measured level and was not shipped.
DATA_BATCH=64 scripts/data_lanes.sh "20:math" "20:code" "20:mixed followup" "20:competition" "21:math" "21:mixed" "21:competition"
FOLDERS=$(ls -d runs/campaign/regen-*-2[01] | paste -sd, -)
COMMON=(--loss-weighting expected-length --keep-init-vocabulary true)
INIT=runs/ab/r18-lr3e4-dpace/final ARM=r20-keep DATA_FOLDERS=$FOLDERS BUDGET_S=2400 scripts/recipe_ab.sh \
    "${COMMON[@]}" --seed 20 --lr 3e-4 --time-budget-clock cpu
INIT=runs/ab/r20-keep/final ARM=r20-keep-more DATA_FOLDERS=$FOLDERS BUDGET_S=1440 THREADS=2 scripts/recipe_ab.sh \
    "${COMMON[@]}" --seed 21 --lr 1.5e-4 --time-budget-clock wall
.venv/bin/python scripts/ship_drafter.py runs/ab/r20-keep-more/final \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/ab/r20-keep-more/metrics.png
# Stage 14 (session 30, session 29's machine with runs/ kept). Round 21's code and follow-ups and round
# 22 whole in the same two lanes, then the sixth A/B's bf16 arm from stage 13 on rounds 20-22, shipped
# (`--precision auto` takes bf16 on this AVX512-BF16 CPU since session 30; named here so that another CPU
# repeats the same steps). Its fp32 twin (`--precision fp32`) measured level, and continuing it
# (`INIT=runs/ab/r22-bf16/final ARM=r22-bf16-more BUDGET_S=1800 THREADS=2 ... --lr 1.5e-4
# --time-budget-clock wall`) measured lower: neither shipped.
DATA_BATCH=64 scripts/data_lanes.sh "21:code" "21:followup" "22:math" "22:mixed" "22:competition"
FOLDERS=$(ls -d runs/campaign/regen-*-2[012] | paste -sd, -)
INIT=runs/ab/r20-keep-more/final ARM=r22-bf16 DATA_FOLDERS=$FOLDERS BUDGET_S=2400 scripts/recipe_ab.sh \
    "${COMMON[@]}" --seed 22 --lr 3e-4 --time-budget-clock cpu --precision bf16
.venv/bin/python scripts/ship_drafter.py runs/ab/r22-bf16/final \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/ab/r22-bf16/metrics.png
# Stage 15 (sessions 31-32, the same AMD EPYC, runs/ kept): rounds 23 and 24's data in the same lanes
# (round 24's code prompts from torch's public functions), five arms from stage 14 (2,400 CPU-seconds of
# one thread each unless THREADS says otherwise; r23-head, a trained-head twin of r23-base, is not among
# them), and the mean of their weights shipped (docs/training.md, seventh and eighth A/B).
DATA_BATCH=64 scripts/data_lanes.sh "23:math" "23:code" "23:mixed followup" "23:competition" \
    "24:math" "24:code" "24:mixed followup" "24:competition"
COMMON=(--time-budget-clock cpu --lr 3e-4 --loss-weighting expected-length --keep-init-vocabulary true --precision bf16)
R20_23=$(ls -d runs/campaign/regen-*-2[0-3] | paste -sd, -)
R20_24=$(ls -d runs/campaign/regen-*-2[0-4] | paste -sd, -)
ARM=r23-base DATA_FOLDERS=$R20_23 BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --seed 23
ARM=r24-code DATA_FOLDERS=$(ls -d runs/campaign/regen-*-2[0-3] runs/campaign/regen-code-24 | paste -sd, -) BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --seed 24
ARM=r24-all DATA_FOLDERS=$R20_24 BUDGET_S=2400 THREADS=2 scripts/recipe_ab.sh "${COMMON[@]}" --seed 25
ARM=r26-base DATA_FOLDERS=$R20_24 BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --seed 26
ARM=r26-ema DATA_FOLDERS=$R20_24 BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --seed 26 --ema-decay 0.998
.venv/bin/python scripts/average_drafters.py runs/soup/s5 runs/ab/{r23-base,r24-code,r24-all,r26-base,r26-ema}/final
.venv/bin/python scripts/ship_drafter.py runs/soup/s5 \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/ab/r26-base/metrics.png
# Stage 16 (session 35, an Intel Xeon with AMX, runs/ lost): rounds 28 and 29 in two bf16 lanes at batch 128,
# each part packed into data/campaign as it finished (on a later machine `python scripts/campaign_archive.py
# restore --dtype bfloat16` brings the folders back instead), two arms from stage 15 on them (lr 3e-4 and
# 1e-4), and the mean of stage 15's weights and theirs shipped (docs/training.md, eleventh A/B).
export DATA_DTYPE=bfloat16 DATA_BATCH=128
scripts/data_lanes.sh "28:math" "28:code" "29:math" "29:code" &
scripts/data_lanes.sh "28:mixed followup" "28:competition" "29:mixed followup" "29:competition"
wait
R28_29=$(ls -d runs/campaign/regen-*-2[89] | paste -sd, -)
COMMON=(--time-budget-clock cpu --loss-weighting expected-length --keep-init-vocabulary true --precision bf16)
ARM=r31-a DATA_FOLDERS=$R28_29 BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 36
ARM=r31-b DATA_FOLDERS=$R28_29 BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 1e-4 --seed 37
.venv/bin/python scripts/average_drafters.py runs/soup/s10c src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 \
    runs/ab/r31-a/final runs/ab/r31-b/final
.venv/bin/python scripts/ship_drafter.py runs/soup/s10c \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/ab/r31-b/metrics.png
# Stage 17 (session 36, the same Xeon, runs/ kept): round 30 in the same two lanes, then two arms from
# stage 16 on rounds 28-30 (lr 3e-4, seeds 38 and 39); r32-b shipped alone, as it measured level with the
# mean of stage 16 and both arms on seeds 1+2 and above it on seed 3 (docs/training.md, twelfth A/B).
scripts/data_lanes.sh "30:math" "30:code" &
scripts/data_lanes.sh "30:mixed followup" "30:competition"
wait
R28_30=$(ls -d runs/campaign/regen-*-{28,29,30} | paste -sd, -)
ARM=r32-a DATA_FOLDERS=$R28_30 BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 38
ARM=r32-b DATA_FOLDERS=$R28_30 BUDGET_S=2400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 39
.venv/bin/python scripts/ship_drafter.py runs/ab/r32-b/final \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/ab/r32-b/metrics.png
# Stage 18 (session 38, an Intel Xeon with AMX, runs/ lost): round 31 written in session 36 in the same two
# lanes; rounds 28-31 restored from data/campaign in bf16, two arms from stage 17 on all four (lr 3e-4,
# seeds 42 and 43, 3,000 CPU-seconds each), and the mean of stage 17's weights and theirs shipped
# (docs/training.md, fourteenth A/B).
scripts/data_lanes.sh "31:mixed followup" "31:code" &
scripts/data_lanes.sh "31:math" "31:competition"
wait
R28_31=$(ls -d runs/campaign/regen-*-{28,29,30,31} | paste -sd, -)
ARM=r34-a DATA_FOLDERS=$R28_31 BUDGET_S=3000 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 42
ARM=r34-b DATA_FOLDERS=$R28_31 BUDGET_S=3000 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 43
.venv/bin/python scripts/average_drafters.py runs/soup/s13c src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 \
    runs/ab/r34-a/final runs/ab/r34-b/final
.venv/bin/python scripts/ship_drafter.py runs/soup/s13c \
    src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 runs/ab/r34-a/metrics.png
# From stage 19 on, every stage takes the same steps; these helpers say them once.
SHIPPED=src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16
# write_round R: round R's data in the two one-thread bf16 lanes (runs/campaign/regen-*-R)
write_round() {
  scripts/data_lanes.sh "$1:mixed followup" "$1:code" &
  scripts/data_lanes.sh "$1:competition" "$1:math"
  wait
}
# rounds R...: those rounds' data folders, comma-separated, as recipe_ab.sh's DATA_FOLDERS
rounds() { local round folders=(); for round in "$@"; do folders+=(runs/campaign/regen-*-"$round"); done
  ls -d "${folders[@]}" | paste -sd, -; }
# Stage 19 (session 39, the same Xeon, runs/ kept): round 32 written in session 38 in two bf16 lanes at
# batch 128; two arms from stage 18 on rounds 28-32 (lr 3e-4, seeds 44 and 45, 4,200 CPU-seconds each),
# and the mean of their weights (without stage 18's) shipped (docs/training.md, fifteenth A/B).
write_round 32
R28_32=$(rounds 28 29 30 31 32)
ARM=r35-a DATA_FOLDERS=$R28_32 BUDGET_S=4200 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 44
ARM=r35-b DATA_FOLDERS=$R28_32 BUDGET_S=4200 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 45
.venv/bin/python scripts/average_drafters.py runs/soup/s14 runs/ab/r35-a/final runs/ab/r35-b/final
.venv/bin/python scripts/ship_drafter.py runs/soup/s14 $SHIPPED runs/ab/r35-a/metrics.png
# Stage 20 (session 40, the same Xeon, runs/ kept): round 33 written in session 39 in two bf16 lanes at
# batch 128; two arms from stage 19 on rounds 28-33 (lr 3e-4 and 5e-4, seeds 46 and 47, 5,400
# CPU-seconds each), and the mean of their weights (without stage 19's) shipped (docs/training.md,
# sixteenth A/B).
write_round 33
R28_33=$(rounds 28 29 30 31 32 33)
ARM=r36-a DATA_FOLDERS=$R28_33 BUDGET_S=5400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 3e-4 --seed 46
ARM=r36-b DATA_FOLDERS=$R28_33 BUDGET_S=5400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 5e-4 --seed 47
.venv/bin/python scripts/average_drafters.py runs/soup/s15 runs/ab/r36-a/final runs/ab/r36-b/final
.venv/bin/python scripts/ship_drafter.py runs/soup/s15 $SHIPPED runs/ab/r36-b/metrics.png
# Stage 21 (session 41, the same Xeon, runs/ kept): round 34 written in session 40 in two bf16 lanes at
# batch 128; two arms from stage 20 on rounds 28-34 (lr 5e-4 and 8e-4, seeds 48 and 49, 5,400
# CPU-seconds each), and the mean of their weights (without stage 20's) shipped (docs/training.md,
# seventeenth A/B).
write_round 34
R28_34=$(rounds 28 29 30 31 32 33 34)
ARM=r37-a DATA_FOLDERS=$R28_34 BUDGET_S=5400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 5e-4 --seed 48
ARM=r37-b DATA_FOLDERS=$R28_34 BUDGET_S=5400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 8e-4 --seed 49
.venv/bin/python scripts/average_drafters.py runs/soup/s16 runs/ab/r37-a/final runs/ab/r37-b/final
.venv/bin/python scripts/ship_drafter.py runs/soup/s16 $SHIPPED runs/ab/r37-a/metrics.png
# Stage 22 (session 42, the same Xeon, runs/ kept): round 35 written in session 41 in two bf16 lanes at
# batch 128; two arms from stage 21 on the newest five rounds, 31-35 (lr 5e-4, seeds 50 and 51, 5,400
# CPU-seconds each), and the mean of stage 21's weights and theirs shipped (docs/training.md,
# eighteenth A/B).
write_round 35
R31_35=$(rounds 31 32 33 34 35)
ARM=r38-a DATA_FOLDERS=$R31_35 BUDGET_S=5400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 5e-4 --seed 50
ARM=r38-b DATA_FOLDERS=$R31_35 BUDGET_S=5400 scripts/recipe_ab.sh "${COMMON[@]}" --lr 5e-4 --seed 51
.venv/bin/python scripts/average_drafters.py runs/soup/s17c $SHIPPED runs/ab/r38-a/final runs/ab/r38-b/final
.venv/bin/python scripts/ship_drafter.py runs/soup/s17c $SHIPPED runs/ab/r38-a/metrics.png
