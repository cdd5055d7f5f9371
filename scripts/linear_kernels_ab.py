"""The target's Linear kernels (targets/linear_kernels.py), A/B in one process on ONE loaded
target: every dispatched Linear runs either the kernels `load_target` chose for this machine
(`auto`) or transformers' own F.linear at every pass width (`linear`), switched in place before
every run. Each prompt runs the plain loop and the default command under both in the order
A B B A, median time per output token kept. Prints, per prompt and as medians: the default's
speedup over the plain loop under each, and each method's time per token auto over linear.

    python scripts/linear_kernels_ab.py --limit 4 --threads 2
    python scripts/linear_kernels_ab.py --regenerate --threads 1   # training data: batched regeneration

`--regenerate`: instead, `blockspec data`'s batched regeneration (32 GSM8K train questions, 64
new tokens, features captured) in the order A B B A A B, tokens per CPU-second of this process.
"""

import argparse
import statistics

from blockspec.bench.datasets import load_prompts
from blockspec.bench.runner import parse_methods, run_prompt
from blockspec.targets.linear_kernels import RowDispatchLinear, describe_linear_kernels
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
print(describe_linear_kernels(target.linear_kernels))
dispatched = [m for m in target.model.modules() if isinstance(m, RowDispatchLinear)]
if not dispatched:
    raise SystemExit("load_target chose transformers' own kernel everywhere here: nothing to compare")
chosen = {id(m): m.kernel_for_rows for m in dispatched}


def use(kernels: str) -> None:
    for module in dispatched:
        module.kernel_for_rows = chosen[id(module)] if kernels == "auto" else ["linear"]


if args.regenerate:
    import json
    import time
    from pathlib import Path

    from blockspec.training.regenerate import generate_batch

    lines = Path(args.data_dir, "gsm8k", "train.jsonl").read_text().splitlines()[:32]
    prompts = [target.encode_prompt(json.loads(line)["question"]) for line in lines]
    rates = {"linear": [], "auto": []}
    for kernels in ("linear", "auto", "auto", "linear", "linear", "auto"):
        use(kernels)
        started = time.process_time()
        responses, _, _ = generate_batch(target.model, prompts, 64, (), feature_layers=[1, 8, 15, 22, 27])
        rates[kernels].append(sum(len(r) for r in responses) / (time.process_time() - started))
        print(kernels, f"{rates[kernels][-1]:.1f} tokens per CPU-second", flush=True)
    print(" ".join(f"median {k} {statistics.median(v):.1f}" for k, v in rates.items()))
    raise SystemExit

methods = parse_methods("baseline,default", None)
decoders = {m.name: m.build(target) for m in methods}
rows = []
for dataset in args.datasets.split(","):
    for prompt in load_prompts(dataset, args.data_dir, args.limit, 0):
        tpot = {(kernels, name): [] for kernels in ("linear", "auto") for name in decoders}
        for kernels in ("linear", "auto", "auto", "linear"):
            use(kernels)
            for name, decoder in decoders.items():
                result = run_prompt(decoder, prompt, args.max_new_tokens, 0.0, 0)
                tpot[kernels, name].append(result.tpot_s)
        t = {key: statistics.median(values) for key, values in tpot.items()}
        row = {"speedup linear": t["linear", "baseline"] / t["linear", "default"],
               "speedup auto": t["auto", "baseline"] / t["auto", "default"],
               "plain auto/linear": t["auto", "baseline"] / t["linear", "baseline"],
               "default auto/linear": t["auto", "default"] / t["linear", "default"]}
        rows.append(row)
        print(dataset, prompt.prompt_id, " ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
for key in rows[0]:
    print(f"median {key}: {statistics.median(r[key] for r in rows):.3f}")
