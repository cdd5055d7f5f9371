#!/usr/bin/env bash
# The drafter campaign for the default target (issue 13): one ROUND per session, run in the
# background beside other work, every step resumable (rerun the same command after a kill).
#
#   ROUND=1 THREADS=1 BUDGET_S=2400 nohup scripts/campaign.sh > runs/campaign/round-1.log 2>&1 &
#   ROUND=2 DATA_ONLY=1 scripts/campaign.sh   # only the data of a round (e.g. the next one, in a spare thread)
#   ROUND=2 DATA_ONLY=1 PARTS="math code" scripts/campaign.sh   # some of its parts (two 1-thread jobs split a round)
#
# A round: (1) regenerates a new slice of training prompts with the target (the benchmark's
# own prompt format on the GSM8K *train* split, plus the project's coding and everyday prompts
# in round 1, self-synthesized ones or code prompts later, and from round 7 competition-math questions
# the target writes), features stored; (2) trains a drafter for
# BUDGET_S seconds of training steps on EVERY round's data so far, warm-started from the
# shipped drafter; (3) measures held-out tau (`blockspec eval-drafter`: benchmark test prompts
# that training never sees) and (4) ships it only when it beats the shipped drafter on both
# domains (math+code and chat; since session 32 on two held-out subsets pooled), appending the result to docs/campaign-ledger.jsonl (tracked: runs/
# did not survive session 14's move to a new machine, the repository did).
# THREADS keeps the job to part of the CPU (two torch processes at full threads thrash).
# WEIGHTING (expected-length) and LR (3e-4): since round 18 (session 27's fourth A/B: expected-length
# weights +0.063 math+code / +0.049 chat over the reference's decayed ones at the same data and CPU time;
# 3e-4 from the long arm of sessions 24-26). Rounds 1-16 ran decay at 6e-4 (round 15: 3e-4).
# PRECISION (auto): `train --precision`; auto = bf16 autocast on CPUs with AMX (round 8's A/B), fp32
# elsewhere (session 14: with AVX512-BF16 alone a bf16 step took 1.8x fp32's time).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUND=${ROUND:?set ROUND=1, 2, ...}
THREADS=${THREADS:-1}
BUDGET_S=${BUDGET_S:-2400}
DATA=${DATA:-../shared/data}
# the target's precision while it writes data, and its batch (session 13, AMX: bf16 at batch 128
# writes 2.4x faster per CPU-second than float32 at 32, its greedy text float32's at ~99% of
# positions; session 14, no AMX: bf16 0.85x float32 at batch 64)
DATA_DTYPE=${DATA_DTYPE:-float32}
DATA_BATCH=${DATA_BATCH:-32}
BS=.venv/bin/blockspec
C=runs/campaign
SHIPPED=src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16
# INIT: where training starts (default: the shipped drafter; a previous round's final continues it)
# VOCAB: the draft vocabulary's size (8192). KEEP_VOCAB=1 (the default from round 18) keeps INIT's
# vocabulary as it is; 0 rebuilds it from the data there is, INIT's tokens filling the free slots (one
# round's data covers less of the held-out output than the shipped vocabulary: session 26)
INIT=${INIT:-$SHIPPED}
LAYERS=1,8,15,22,27
# add_openings ARRAY TEXT...: appends a --synthesize-opening flag per TEXT to ARRAY
add_openings() { local -n into=$1; shift; for opening in "$@"; do into+=(--synthesize-opening "$opening"); done; }
# PARTS: which of the round's data sets (step 1) to write; two DATA_ONLY jobs at one thread each can
# split a round between them (each part is its own folder)
PARTS=" ${PARTS:-math mixed followup code competition} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
# From round 14 on, the data also keeps the target's top-8 distribution at every response token (a
# few bytes per token): a round can then train on it with DISTILL=8 (logit distillation, no extra
# target pass). Rounds before kept none, and a folder resumes only as it was started; their records
# keep hard labels (DISTILL_MISSING=hard, the default: a target pass over each would cost ~3 CPU-s).
TOPK=()
[ "$ROUND" -ge 14 ] && TOPK=(--store-topk 8)
mkdir -p "$C/eval"
# keep FOLDER: its token ids packed to data/campaign/ (tracked: `runs/` goes with its machine; commit
# the archive), scripts/campaign_archive.py
keep() { .venv/bin/python scripts/campaign_archive.py pack "$1"; }

# (1) this round's data: 800 new GSM8K train questions (after the 1,448 of the first two stages).
# SKIP_DATA=1 trains on the shards finished so far (a data job still running adds the rest later).
START=$((1448 + 800 * (ROUND - 1)))
if [ -z "${SKIP_DATA:-}" ]; then
# GSM8K train holds 7,473 questions: round 8 takes the last 425, and later rounds 800 word problems
# the target writes itself, opening as GSM8K questions do
if [ "$START" -lt "$(wc -l < "$DATA/gsm8k/train.jsonl")" ]; then
  MATH=(--prompts "$DATA/gsm8k/train.jsonl[$START:$((START + 800))]")
else
  MATH=(--synthesize 800)
  add_openings MATH 'Janet' 'A store sells' 'Tom has' 'There are' 'John buys' 'A farmer' 'Each day,' 'Sarah' \
      'A class of' 'If a train' 'Mark earns' 'A bakery' 'Lisa reads' 'The price of' 'Two friends' 'A pool'
fi
part math && $BS data --target default --output "$C/regen-math-$ROUND" "${MATH[@]}" \
    --prompt-format math --max-new-tokens 256 --batch-size "$DATA_BATCH" --dtype "$DATA_DTYPE" --shard-size 64 --feature-layers $LAYERS "${TOPK[@]}" \
    --seed "$ROUND" --threads "$THREADS" && keep "$C/regen-math-$ROUND"
# The draft vocabulary is rebuilt from all rounds' data, so every round set must keep code in it:
# rounds 3-4 had none and HumanEval coverage fell 98.5% -> 91.5%. From round 5 on, odd rounds
# bring code and even rounds synthesize user turns. Round 5 regenerated the coding tasks; data is
# greedy, so regenerating them again would only duplicate it: from round 7 on, odd rounds take a
# new slice of HumanEval-style prompts (signature + docstring) mined from the standard library,
# in the benchmark's HumanEval format.
if [ "$ROUND" = 1 ]; then
  MIXED=(--prompts builtin:coding_tasks --prompts builtin:everyday_questions)
elif [ "$ROUND" = 5 ]; then
  MIXED=(--prompts builtin:coding_tasks)
elif [ "$ROUND" -ge 7 ] && [ "$ROUND" -lt 10 ] && [ $((ROUND % 2)) = 1 ]; then
  FIRST=$((400 * (ROUND - 7) / 2))
  MIXED=(--prompts "python-functions:stdlib[$FIRST:$((FIRST + 400))]" --prompt-format code)
else
  MIXED=(--synthesize 400)
fi
part mixed && $BS data --target default --output "$C/regen-mixed-$ROUND" "${MIXED[@]}" --max-new-tokens 256 --batch-size "$DATA_BATCH" --dtype "$DATA_DTYPE" \
    --shard-size 64 --feature-layers $LAYERS "${TOPK[@]}" --seed "$ROUND" --threads "$THREADS" && keep "$C/regen-mixed-$ROUND"
# From round 13 on, second turns: 200 of the round's user-turn conversations continued by a next
# user turn the target writes, the answer regenerated (MT-Bench asks its second turn after the
# model's own first answer; no round before had multi-turn data). Needs the round's mixed data.
if [ "$ROUND" -ge 13 ] && part followup; then
  $BS data --target default --output "$C/regen-followup-$ROUND" --follow-up "$C/regen-mixed-$ROUND[0:200]" \
      --max-new-tokens 256 --batch-size "$DATA_BATCH" --dtype "$DATA_DTYPE" --shard-size 64 --feature-layers $LAYERS "${TOPK[@]}" \
      --seed "$ROUND" --threads "$THREADS"
  keep "$C/regen-followup-$ROUND"
fi
# From round 10 on every round brings code AND user turns: a round may be all the data there is
# (session 14 began on a new machine without runs/), and the draft vocabulary is rebuilt from the
# data that is there. The standard library holds 1,086 such prompts; rounds 7 and 9 took [0:800],
# so the slices cycle from [800:] (greedy data: a slice repeated while runs/ survives weighs code
# more, it adds no new text).
# From round 24 the installed packages' public functions take over (round 23 repeated round 20's
# [0:400] token for token): torch (pinned by the Makefile: 3,067 prompts), sympy (1,666) and
# transformers (1,159), 400 per round from each one's first 1,200, so a slice repeats after 9 rounds.
if [ "$ROUND" -ge 10 ] && part code; then
  SLICES=("800:" "0:400" "400:800")
  CODE_SOURCE="python-functions:stdlib[${SLICES[$(((ROUND - 10) % 3))]}]"
  if [ "$ROUND" -ge 24 ]; then
    SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    PACKAGES=(torch sympy transformers)
    index=$((ROUND - 24))
    first=$((index / 3 % 3 * 400))
    CODE_SOURCE="python-functions:$SITE/${PACKAGES[$((index % 3))]}[$first:$((first + 400))]"
  fi
  $BS data --target default --output "$C/regen-code-$ROUND" \
      --prompts "$CODE_SOURCE" --prompt-format code \
      --max-new-tokens 256 --batch-size "$DATA_BATCH" --dtype "$DATA_DTYPE" --shard-size 64 --feature-layers $LAYERS "${TOPK[@]}" \
      --seed "$ROUND" --threads "$THREADS"
  keep "$C/regen-code-$ROUND"
fi
# From round 7 on, also 400 competition-math questions the target writes itself (MATH-500 was the
# weakest dataset, and no MATH train split is reachable here): each starts with an opening of the
# kind MATH problems use, and gets the benchmark's boxed-answer suffix.
if [ "$ROUND" -ge 7 ] && part competition; then
  OPENINGS=()
  add_openings OPENINGS 'Let $' 'Find the' 'How many' 'What is the value of' 'Compute' 'If $f(x)' 'Solve for' \
      'In triangle $ABC$,' 'Simplify' 'What is the smallest positive integer' 'Evaluate' 'The sum of' \
      'A right triangle' 'What is the probability that' 'Express' 'Suppose'
  $BS data --target default --output "$C/regen-competition-$ROUND" --synthesize 400 "${OPENINGS[@]}" \
      --prompt-format math --max-new-tokens 256 --batch-size "$DATA_BATCH" --dtype "$DATA_DTYPE" --shard-size 64 --feature-layers $LAYERS "${TOPK[@]}" \
      --seed "$ROUND" --threads "$THREADS"
  keep "$C/regen-competition-$ROUND"
fi
fi
# DATA_ONLY=1 stops here: a spare thread can prepare the next round's data (resumable, shard by shard)
if [ -n "${DATA_ONLY:-}" ]; then exit 0; fi
# every round kept in data/campaign that this machine lacks (a new machine: all of them), its
# features recomputed by a prefill pass in DATA_DTYPE (resumable)
if ls data/campaign/*.tar.xz > /dev/null 2>&1; then
  .venv/bin/python scripts/campaign_archive.py restore --threads "$THREADS" --dtype "$DATA_DTYPE"
fi
FOLDERS=$(for f in "$C"/regen-*-*/; do if ls "$f"shard-*.jsonl >/dev/null 2>&1; then echo "${f%/}"; fi; done \
    | sort | paste -sd, -)

# (2) train on everything so far, from the drafter shipped now
RUN="$C/train-$ROUND"
RESUME=()
[ -f "$RUN/latest/trainer_state.pt" ] && RESUME=(--resume)
if [ ! -f "$RUN/final/model.safetensors" ] || [ ${#RESUME[@]} -gt 0 ]; then
  $BS train "${RESUME[@]}" --target default --data "$FOLDERS" --output "$RUN" --init-from "$INIT" \
      --num-layers 2 --target-layer-ids $LAYERS --block-size 16 --draft-vocab-size ${VOCAB:-8192} --keep-init-vocabulary $([ "${KEEP_VOCAB:-1}" = 1 ] && echo true || echo false) \
      --num-anchors ${ANCHORS:-24} --batch-size ${BATCH:-4} --lr ${LR:-3e-4} --warmup-ratio 0.02 --epochs 100 \
      --loss-weighting ${WEIGHTING:-expected-length} --distill-topk ${DISTILL:-0} --distill-missing ${DISTILL_MISSING:-hard} --time-budget-s "$BUDGET_S" --time-budget-clock cpu --max-length 1024 --eval-every 0 --save-every 25 --seed "$ROUND" --threads "$THREADS" \
      --precision "${PRECISION:-auto}"
fi

# (3) held-out tau of the candidate and of what is shipped now (same prompts, same settings)
# float32 drafters, as every round before session 13 measured (`auto` would run them in bf16 on this
# CPU: the same tau within 0.01, session 13)
# Two subsets of 8 prompts per dataset (EVAL_SEEDS), pooled: one subset's MT-Bench tau moved by 0.23
# between subsets for the same drafter (session 32), more than any round's gain; seed 1's file keeps
# its old name (the ledger's `heldout_*` stay seed 1's, comparable with every earlier round)
EVAL=(--data-dir "$DATA" --limit 8 --max-new-tokens 128 --block-size 16 --threads "$THREADS" --drafter-dtype float32)
SHIPPED_HASH=$(sha256sum "$SHIPPED/model.safetensors" | cut -c1-12)
for SEED in ${EVAL_SEEDS:-1 2}; do
  SUFFIX=$([ "$SEED" = 1 ] || echo ".seed$SEED")
  [ -f "$C/eval/shipped-$SHIPPED_HASH$SUFFIX.json" ] || $BS eval-drafter auto "${EVAL[@]}" --seed "$SEED" --output "$C/eval/shipped-$SHIPPED_HASH$SUFFIX.json"
  [ -f "$C/eval/train-$ROUND$SUFFIX.json" ] || $BS eval-drafter "$RUN/final" "${EVAL[@]}" --seed "$SEED" --output "$C/eval/train-$ROUND$SUFFIX.json"
done

# (4) ship only a better drafter; the ledger keeps every round's numbers
.venv/bin/python - "$C" "$ROUND" "$SHIPPED_HASH" "$RUN" "$SHIPPED" "${LEDGER:-docs/campaign-ledger.jsonl}" "${LR:-3e-4}" \
    "$FOLDERS" "${KEEP_VOCAB:-1}" "${WEIGHTING:-expected-length}" "${EVAL_SEEDS:-1 2}" <<'EOF'
import json, subprocess, sys
from pathlib import Path

campaign, round_, shipped_hash, run, shipped = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
ledger_path = Path(sys.argv[6])
done = [json.loads(l) for l in ledger_path.read_text().splitlines() if l] if ledger_path.exists() else []
if any(entry["round"] == int(round_) for entry in done):
    sys.exit(f"round {round_} is already in {ledger_path}")
seeds = sys.argv[11].split()
def results(name):  # the eval-drafter files of one drafter, one per subset seed
    return [str(campaign / "eval" / f"{name}{'' if seed == '1' else '.seed' + seed}.json") for seed in seeds]
def pooled(name):
    out = subprocess.run([sys.executable, "scripts/pool_heldout.py", "--json", *results(name)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["domains"]
old = json.loads(Path(results(f"shipped-{shipped_hash}")[0]).read_text())["domains"]
new = json.loads(Path(results(f"train-{round_}")[0]).read_text())["domains"]
old_pooled, new_pooled = pooled(f"shipped-{shipped_hash}"), pooled(f"train-{round_}")
history = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line]
better = all(new_pooled[d]["tau"] > old_pooled[d]["tau"] for d in old_pooled)  # pooled over the subsets
entry = {"round": int(round_), "shipped_before": shipped_hash, "heldout_before": old, "heldout_after": new,
         "heldout_pooled_before": old_pooled, "heldout_pooled_after": new_pooled, "subset_seeds": [int(s) for s in seeds],
         "train_seconds": history[-1].get("train_s"), "steps": history[-1]["step"], "lr": float(sys.argv[7]),
         "data": sys.argv[8].split(","), "kept_init_vocabulary": sys.argv[9] == "1",
         "loss_weighting": sys.argv[10],
         # the target's precision while it wrote each folder (`blockspec data --dtype`)
         "data_dtypes": sorted({json.loads((Path(f) / "meta.json").read_text())["config"].get("dtype", "float32")
                                for f in sys.argv[8].split(",")}),
         "shipped": better}
with open(ledger_path, "a") as ledger:
    ledger.write(json.dumps(entry) + "\n")
print(json.dumps(entry, indent=1))
if better:
    subprocess.run([sys.executable, "scripts/ship_drafter.py", f"{run}/final", shipped, f"{run}/metrics.png"], check=True)
EOF
