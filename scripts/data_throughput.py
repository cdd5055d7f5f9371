"""Training data per CPU-second: regenerating responses (the lean batched decoder, features
captured) against the prefill-only pass that `--from-text` training runs over existing text
(features + the target's top-k, one forward per batch). Both on the same prompts and the same
number of response tokens, in CPU seconds of this process (a busy machine does not inflate
them), alternating, medians of REPEATS.

    python scripts/data_throughput.py --threads 1 --rows 32 --new-tokens 64 --repeats 3
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from blockspec.targets.adapter import target_features
from blockspec.targets.loading import load_target
from blockspec.training.regenerate import generate_batch

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--rows", type=int, default=32)
parser.add_argument("--new-tokens", type=int, default=64)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
args = parser.parse_args()

target = load_target("default", threads=args.threads)
questions = [json.loads(line)["question"] for line in Path(args.data).read_text().splitlines()[: args.rows]]
prompts = [target.encode_prompt(q) for q in questions]
layers = [1, 8, 15, 22, 27]


def regenerate() -> int:
    responses, _, _ = generate_batch(target.model, prompts, args.new_tokens, (), feature_layers=layers)
    return sum(len(r) for r in responses)


@torch.inference_mode()
def prefill(responses: list[list[int]]) -> int:
    # left-padded, so every response ends the row and the LM head runs over response positions only
    sequences = [p + r for p, r in zip(prompts, responses)]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[0] * (width - len(s)) + s for s in sequences])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = target.model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True,
                       logits_to_keep=max(len(r) for r in responses) + 1)
    target_features(out.hidden_states, layers).to(torch.float16)
    torch.softmax(out.logits.float(), dim=-1).topk(8, dim=-1)
    return sum(len(r) for r in responses)


fixed = generate_batch(target.model, prompts, args.new_tokens, ())  # the text both passes cover
rates = {"regenerate": [], "prefill": []}
for _ in range(args.repeats):
    for name, run in (("regenerate", regenerate), ("prefill", lambda: prefill(fixed))):
        started = time.process_time()
        tokens = run()
        rates[name].append(tokens / (time.process_time() - started))
regen, pre = statistics.median(rates["regenerate"]), statistics.median(rates["prefill"])
print(json.dumps({"threads": args.threads, "rows": args.rows, "new_tokens": args.new_tokens,
                  "regenerate_tokens_per_cpu_s": round(regen, 1), "prefill_tokens_per_cpu_s": round(pre, 1),
                  "prefill_over_regenerate": round(pre / regen, 2), "runs": rates}, indent=1))
