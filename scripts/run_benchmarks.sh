#!/usr/bin/env bash
# The exact commands behind docs/benchmarks.md (default target, shipped drafter, this CPU).
# Run them one at a time on an otherwise idle machine: never two torch processes at once.
set -euo pipefail
cd "$(dirname "$0")/.."
BS=.venv/bin/blockspec
DATA=${DATA:-../shared/data}

# T = 0: every method, four datasets, interleaved prompt by prompt (+ costs, roofline, peak memory)
$BS bench --datasets gsm8k,math500,humaneval,mt_bench --data-dir "$DATA" --limit 4 --max-new-tokens 96 \
    --methods baseline,prompt-lookup,dflash-b16,dflash-b8,hf-generate,hf-prompt-lookup,hf-dflash-b16,diffusion-b8 \
    --output runs/bench-t0-v3

# T = 1 (sampling): tau and speedup
$BS bench --datasets gsm8k --data-dir "$DATA" --limit 4 --max-new-tokens 96 --temperature 1.0 \
    --methods baseline,prompt-lookup,dflash-b8 --no-memory --output runs/bench-t1-v3

# the rival routes (issue #5), trained by scripts/train_rivals.sh on the same data, against DFlash
$BS bench --datasets gsm8k,math500,humaneval,mt_bench --data-dir "$DATA" --limit 4 --max-new-tokens 96 \
    --methods baseline,dflash-b8,eagle3-b8=runs/eagle3-smollm2/final,mtp-b8=runs/mtp-smollm2/final,draft-model-b8=model:runs/draftlm-smollm2/final \
    --no-memory --output runs/bench-rivals

# serving: 1, 2, 4 and 8 concurrent clients, speculative vs the non-speculative batched loop
$BS bench-serve --data-dir "$DATA" --concurrency 1,2,4,8 --requests 12 --max-new-tokens 64 --repeats 3 \
    --output runs/bench-serve-v2

# what the README shows: T=0, 2 prompts per dataset, at most 64 new tokens (must stay under 10 minutes here)
$BS bench --quick --data-dir "$DATA" --no-memory --output runs/bench-quick

# session 7: token trees (issue 15): the default command, chains, lookup, tau against the node budget
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 1 --no-memory \
    --methods baseline,default,default-chain,prompt-lookup,dflash-tree,dflash-b8,dflash-tree-n8,dflash-tree-n16,dflash-tree-n32 \
    --output runs/bench-s7

# session 8: the default command, --chain and lookup on the idle machine
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory \
    --methods baseline,default,default-chain,prompt-lookup --output runs/bench-s8
# held-out tau of the shipped drafter as full chains and as full 32-node trees
$BS eval-drafter auto --data-dir "$DATA" --limit 8 --max-new-tokens 128 --block-size 16 --output runs/eval-s8/chain.json
$BS eval-drafter auto --data-dir "$DATA" --limit 8 --max-new-tokens 128 --block-size 16 --tree-budget 32 \
    --output runs/eval-s8/tree32.json
# serving with token trees against chains (1 and 4 clients)
$BS bench-serve --data-dir "$DATA" --concurrency 1,4 --requests 8 --max-new-tokens 64 --repeats 2 \
    --output runs/bench-serve-s8-chain
$BS bench-serve --data-dir "$DATA" --concurrency 1,4 --requests 8 --max-new-tokens 64 --repeats 2 --tree-budget 32 \
    --output runs/bench-serve-s8-tree

# session 15: round 10's drafter, idle, 2 threads
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory \
    --methods baseline,default,prompt-lookup,default-chain,dflash-b8 --output runs/bench-s15
# session 16: round 11's drafter, the planner counting wasted
# drafting, idle, 2 threads
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory \
    --methods baseline,default,prompt-lookup,default-chain,dflash-b8 --output runs/bench-s16
# session 16: MT-Bench again on 16 other questions (--seed 1 picks the subset)
$BS bench --data-dir "$DATA" --datasets mt_bench --limit 16 --seed 1 --max-new-tokens 128 --threads 2 --no-memory \
    --methods baseline,default,prompt-lookup,default-chain --output runs/bench-s16-mt16

# session 24 (what the README table shows now): round 11's drafter, the Linear kernels chosen per pass
# width (session 23), idle, 2 threads; the four methods people compare twice per prompt, then DFlash
# alone as B=8 / B=16 chains and a fixed 32-node tree
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory \
    --datasets gsm8k,math500,humaneval,mt_bench --repeats 2 \
    --methods baseline,default,prompt-lookup,default-chain --output runs/bench-s24
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory \
    --datasets gsm8k,math500,humaneval,mt_bench \
    --methods baseline,dflash-b8,dflash-b16,dflash-tree-n32 --output runs/bench-s24b

# session 25: the planner's costs read along a line between buckets (`:line-costs`) against the
# shipped reading by bucket, under one fixed cost model (measured idle), then with noisy timings
PY=.venv/bin/python
$PY scripts/planner_replay.py --measure --threads 2 --costs runs/replay/costs-s25.json
for noise in 0 0.15; do
  $PY scripts/planner_replay.py --costs runs/replay/costs-s25.json --threads 1 --limit 8 \
      --datasets gsm8k,math500,humaneval,mt_bench --cost-noise $noise --trace \
      --methods lookup,default,default:line-costs,chain,chain:line-costs --output runs/replay/s25-noise$noise.json
done

# session 26 (what the README table shows now): 16 prompts per dataset, idle, 2 threads; HumanEval
# twice (every method twice per prompt), the other three datasets once
$BS bench --data-dir "$DATA" --datasets humaneval --limit 16 --max-new-tokens 128 --threads 2 --no-memory \
    --repeats 2 --methods baseline,default,prompt-lookup --output runs/bench-s26-he16
$BS bench --data-dir "$DATA" --datasets humaneval --limit 16 --max-new-tokens 128 --threads 2 --no-memory \
    --repeats 2 --methods baseline,default,prompt-lookup,default-chain --output runs/bench-s26-he16b
$BS bench --data-dir "$DATA" --datasets gsm8k,math500,mt_bench --limit 16 --max-new-tokens 128 --threads 2 \
    --no-memory --methods baseline,default,prompt-lookup,default-chain --output runs/bench-s26-3x16
# session 27 (an Intel Xeon with AMX): the stage-12 drafter (its float16 copy, before shipping) against
# round 11 (shipped then), both as the default command, interleaved, idle, 2 threads
.venv/bin/python scripts/ship_drafter.py runs/ab/r18-lr3e4-dpace/final /tmp/shipcand
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory --repeats 1 \
    --methods baseline,default,default-r18=/tmp/shipcand,prompt-lookup --output runs/bench-s27
# session 27, after shipping stage 12: DFlash alone as B=8 and B=16 chains
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory \
    --methods baseline,dflash-b8,dflash-b16 --output runs/bench-s27-b8
# sessions 29, 30 and 32 (an AMD EPYC, AVX512-BF16, no AMX): the shipped drafter (stages 13, 14, 15) as a
# B=8 chain, idle, 2 threads
$BS bench --data-dir "$DATA" --limit 8 --max-new-tokens 128 --threads 2 --no-memory \
    --methods baseline,dflash-b8 --output runs/bench-s32-b8
