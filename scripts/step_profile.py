"""Where one generation's time goes, per method, on bench prompts (real clock, under cProfile):
the top functions by cumulative time, with the wall time, steps and time per output token.

    python scripts/step_profile.py --dataset mt_bench --prompts 2 --methods baseline,default,prompt-lookup

Each method runs each prompt once to warm up, then once profiled (cProfile slows Python-heavy
code more than torch's kernels: compare methods within one run, not with a bench)."""

import argparse
import cProfile
import pstats
import time

from blockspec.bench.datasets import load_prompts
from blockspec.bench.runner import parse_methods, run_prompt
from blockspec.targets.loading import load_target

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="mt_bench")
parser.add_argument("--data-dir", default="../shared/data")
parser.add_argument("--limit", type=int, default=8, help="the bench's subset (--limit, --seed) the prompts index into")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--prompts", default="0", help="comma-separated indices into that subset")
parser.add_argument("--methods", default="baseline,default,prompt-lookup,default-chain")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--top", type=int, default=25)
args = parser.parse_args()

target = load_target("default", threads=args.threads)
decoders = {method.name: method.build(target) for method in parse_methods(args.methods, "auto")}
prompts = load_prompts(args.dataset, args.data_dir, args.limit, args.seed)
for index in (int(i) for i in args.prompts.split(",")):
    for name, decoder in decoders.items():
        run_prompt(decoder, prompts[index], args.max_new_tokens, 0.0, 0)  # warm-up
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        sample = run_prompt(decoder, prompts[index], args.max_new_tokens, 0.0, 0)
        profile.disable()
        wall = time.perf_counter() - started
        print(f"== {args.dataset} prompt {index}, {name}: {wall:.2f} s, {sample.steps} steps, "
              f"{sample.new_tokens} tokens, {sample.tpot_s * 1000:.1f} ms per token")
        stats = pstats.Stats(profile).stats
        for seconds, (file, line, function) in sorted(((v[3], k) for k, v in stats.items()), reverse=True)[:args.top]:
            print(f"   {seconds:7.3f}  {file.split('/')[-1]}:{line} {function}")
