"""The target's weight layout, A/B in one process on ONE copy of the target: before every run
each float32 Linear weight is copied afresh, either row-major (transformers' [out, in]) or
transposed (the transpose of a contiguous [in, out] matrix, which MKL's sgemm packs more
cheaply for few rows in a bare matrix product here). Each prompt runs the plain loop and the
default command under both layouts in the order A B B A (fresh copies each time, so neither
layout keeps the memory it was loaded into), median time per output token kept (session 20's
Intel machine: transposed 0.936x; session 21's AMD EPYC: 1.113x, which is why `load_target` now
measures the layout per machine, targets/layout.py). Prints, per
prompt and as medians: the default's speedup over the plain loop under each layout, and the
time per token of each method transposed over row-major.

    python scripts/weight_layout_ab.py --limit 4 --threads 2
    python scripts/weight_layout_ab.py --regenerate --threads 1   # training data: batched regeneration

`--regenerate`: instead, `blockspec data`'s batched regeneration (32 GSM8K train questions, 64
new tokens, features captured) in the order A B B A A B, tokens per CPU-second of this process.
"""

import argparse
import statistics

import torch

from blockspec.bench.datasets import load_prompts
from blockspec.bench.runner import parse_methods, run_prompt
from blockspec.targets.loading import load_target

parser = argparse.ArgumentParser()
parser.add_argument("--limit", type=int, default=4, help="prompts per dataset")
parser.add_argument("--datasets", default="gsm8k,math500,humaneval")
parser.add_argument("--data-dir", default="../shared/data")
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--regenerate", action="store_true", help="time batched regeneration instead")
args = parser.parse_args()

target = load_target("default", threads=args.threads)
linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32]


def lay_out(transposed: bool) -> None:
    for module in linears:
        weight = module.weight.data
        module.weight.data = (weight.t().clone(memory_format=torch.contiguous_format).t() if transposed
                              else weight.clone(memory_format=torch.contiguous_format))


if args.regenerate:
    import json
    import time
    from pathlib import Path

    from blockspec.training.regenerate import generate_batch

    lines = Path(args.data_dir, "gsm8k", "train.jsonl").read_text().splitlines()[:32]
    prompts = [target.encode_prompt(json.loads(line)["question"]) for line in lines]
    rates = {"row-major": [], "transposed": []}
    for layout in ("row-major", "transposed", "transposed", "row-major", "row-major", "transposed"):
        lay_out(layout == "transposed")
        started = time.process_time()
        responses, _, _ = generate_batch(target.model, prompts, 64, (), feature_layers=[1, 8, 15, 22, 27])
        rates[layout].append(sum(len(r) for r in responses) / (time.process_time() - started))
        print(layout, f"{rates[layout][-1]:.1f} tokens per CPU-second", flush=True)
    print(" ".join(f"median {k} {statistics.median(v):.1f}" for k, v in rates.items()))
    raise SystemExit

methods = parse_methods("baseline,default", None)
decoders = {m.name: m.build(target) for m in methods}
rows = []
for dataset in args.datasets.split(","):
    for prompt in load_prompts(dataset, args.data_dir, args.limit, 0):
        tpot = {(layout, name): [] for layout in ("row-major", "transposed") for name in decoders}
        for layout in ("row-major", "transposed", "transposed", "row-major"):
            lay_out(layout == "transposed")
            for name, decoder in decoders.items():
                tpot[layout, name].append(run_prompt(decoder, prompt, args.max_new_tokens, 0.0, 0).tpot_s)
        t = {key: statistics.median(values) for key, values in tpot.items()}
        row = {"speedup row-major": t["row-major", "baseline"] / t["row-major", "default"],
               "speedup transposed": t["transposed", "baseline"] / t["transposed", "default"],
               "plain transposed/row-major": t["transposed", "baseline"] / t["row-major", "baseline"],
               "default transposed/row-major": t["transposed", "default"] / t["row-major", "default"]}
        rows.append(row)
        print(dataset, " ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
for key in rows[0]:
    print(f"median {key}: {statistics.median(r[key] for r in rows):.3f}")
