"""Planner variants compared under ONE fixed cost model, so that the comparison is not at the
mercy of a noisy machine: every generation runs for real (the target's real verdicts, real
outputs, token-identical to plain decoding), but its time is the modeled cost of the steps it
took: each verify pass costs verify(width) and each model drafting pass a fixed time, from a
cost file (measured once, idle: `--measure`). The planner itself is fed the same modeled
costs instead of its timings. Every turn of a prompt runs, each after the method's own
answers, as in the bench. Result: each method's speedup over plain decoding as the
cost model sees it, per prompt and as a geometric mean per dataset.

    python scripts/planner_replay.py --measure --threads 2 --costs runs/replay/costs.json   # idle
    python scripts/planner_replay.py --costs runs/replay/costs.json --datasets gsm8k,math500 --limit 4 \\
        --methods lookup,default,default:decay=0.7,chain --output runs/replay/result.json

Methods: `lookup` (prompt lookup, 7 drafts every step, unplanned), `default` (the hybrid
drafter, planned, 32-node trees), `chain` (the same with chains), each planned one with
`:ATTR=VALUE` options set on its DraftPlanner (e.g. `decay=0.7`), `:no-undrafted` (the
planner gets no evidence from lookup's undrafted continuations) and `:line-costs` (the planner
reads a size between its cost buckets along the line through their mean sizes, instead of at
its bucket's seconds; session 25: it did not pay, docs/benchmarks.md). `--cost-noise S`: the planners
learn the modeled costs as a busy machine would time them (times exp(|N(0, S)|), seeded), to
see how much a variant leans on cost differences that noise blurs.
"""

import argparse
import bisect
import json
import math
import random
import statistics
import sys
from pathlib import Path

from blockspec.bench.costs import measure_costs
from blockspec.bench.datasets import load_prompts
from blockspec.bench.runner import run_prompt
from blockspec.decoding.planner import CostTable, DraftPlanner, size_bucket
from blockspec.drafters.registry import load_drafter
from blockspec.pipeline import SpecDecoder
from blockspec.targets.loading import load_target

parser = argparse.ArgumentParser()
parser.add_argument("--costs", required=True, help="cost file (JSON), written by --measure")
parser.add_argument("--measure", action="store_true", help="measure the costs into --costs and stop")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--datasets", default="gsm8k,math500,humaneval,mt_bench")
parser.add_argument("--data-dir", default="../shared/data")
parser.add_argument("--limit", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--methods", default="lookup,default")
parser.add_argument("--output", default=None)
parser.add_argument("--trace", action="store_true",
                    help="print, per prompt and method, the steps by source (plain: none planned) with their mean "
                         "verify width and accepted drafts")
parser.add_argument("--cost-noise", type=float, default=0.0,
                    help="the planner's measured costs are the modeled ones times exp(|N(0, SIGMA)|): a busy "
                         "machine's timings, which interference only slows (the clock stays noise-free)")
args = parser.parse_args()

target = load_target("default", threads=args.threads)
if args.measure:
    model = load_drafter("auto", target)
    verify_s = {}
    for width in [1, 2, 4, 8, 12, 16, 24, 33, 48, 64]:
        costs = measure_costs(target, model, 16, verify_tokens=width, repeats=9)
        verify_s[width] = costs["decode_s"] if width == 1 else costs["verify_s"]
        draft_s = costs["draft_s"]
    Path(args.costs).parent.mkdir(parents=True, exist_ok=True)
    Path(args.costs).write_text(json.dumps({"verify_s": verify_s, "draft_s": draft_s, "threads": args.threads}))
    print(json.dumps({"verify_ms": {w: round(s * 1000, 1) for w, s in verify_s.items()}, "draft_ms": draft_s * 1000}))
    sys.exit(0)

cost_model = json.loads(Path(args.costs).read_text())
WIDTHS = sorted(int(width) for width in cost_model["verify_s"])
VERIFY = [cost_model["verify_s"][str(width)] for width in WIDTHS]
DRAFT_S = cost_model["draft_s"]


def verify_cost(width: int) -> float:
    """Linear between measured widths (beyond the last: proportional to the width)."""
    if width <= WIDTHS[0]:
        return VERIFY[0]
    i = bisect.bisect_left(WIDTHS, width)
    if i == len(WIDTHS):
        return VERIFY[-1] * width / WIDTHS[-1]
    low, high = WIDTHS[i - 1], WIDTHS[i]
    return VERIFY[i - 1] + (VERIFY[i] - VERIFY[i - 1]) * (width - low) / (high - low)


class Clock:
    seconds = 0.0


NOISE = random.Random(0)


def noisy(seconds: float) -> float:
    return seconds * math.exp(abs(NOISE.gauss(0.0, args.cost_noise))) if args.cost_noise else seconds


class ModeledPlanner(DraftPlanner):
    """Learns the modeled costs of its steps instead of their timings (with --cost-noise: as a
    busy machine would time them)."""

    def record(self, query_tokens, verify_seconds, drafted_positions, drafting_seconds, source="model"):
        super().record(query_tokens, noisy(verify_cost(query_tokens)), drafted_positions,
                       noisy(DRAFT_S) if source == "model" else 0.0, source)


class LineCostTable(CostTable):
    """Session 25's variant: per bucket, the mean size measured beside the mean seconds; a size
    between two measured buckets read on the line through them (below the first: its seconds
    if in its bucket, else 0; past the last: the highest seconds)."""

    def __init__(self, decay: float, stale_after: int):
        super().__init__(decay, stale_after)
        self.sizes: dict[int, float] = {}

    def record(self, size: int, seconds: float, now: int) -> None:
        bucket = size_bucket(size)
        fresh = bucket in self.seconds and now - self.measured_at[bucket] <= self.stale_after
        self.sizes[bucket] = self.decay * self.sizes[bucket] + (1 - self.decay) * size if fresh else float(size)
        super().record(size, seconds, now)

    def estimates(self, now):
        points = sorted((self.sizes[bucket], seconds, bucket) for bucket, seconds in self.fresh(now).items())

        def estimate(size: int) -> float:
            if not points:
                return 0.0
            if size <= points[0][0]:
                return points[0][1] if size_bucket(size) == points[0][2] else 0.0
            if size >= points[-1][0]:
                return max(seconds for _, seconds, _ in points)
            for (size_a, seconds_a, _), (size_b, seconds_b, _) in zip(points, points[1:]):
                if size <= size_b:
                    return seconds_a + (seconds_b - seconds_a) * (size - size_a) / max(size_b - size_a, 1e-9)
            raise AssertionError("unreachable: the size lies between the first and the last point")

        return estimate


def build(method: str) -> SpecDecoder:
    kind, *options = method.split(":")
    if kind == "lookup":
        decoder = SpecDecoder(target, load_drafter("prompt-lookup", target), 8, plan=False)
    elif kind in ("default", "chain"):
        decoder = SpecDecoder(target, load_drafter("hybrid", target), 16, plan=True,
                              tree_budget=32 if kind == "default" else None)
        planner = ModeledPlanner(decoder.engine.block_size - 1)
        for option in options:
            if option == "no-undrafted":
                decoder.engine.drafter.undrafted_outcomes = lambda: []  # forks copy it
            elif option == "line-costs":
                planner.verify = LineCostTable(planner.decay, planner.stale_after)
                planner.drafting = {source: LineCostTable(planner.decay, planner.stale_after)
                                    for source in ("model", "lookup")}
            else:
                name, value = option.split("=")
                if not hasattr(planner, name):
                    sys.exit(f"{method}: the planner has no attribute {name!r}")
                setattr(planner, name, float(value))
        decoder.engine.planner = planner
    else:
        sys.exit(f"unknown method {method!r}: lookup, default[:OPTIONS], chain[:OPTIONS]")
    kv, drafter = decoder.engine.kv, decoder.engine.drafter
    verify = kv.verify

    def modeled_verify(blocks, trees=None):
        Clock.seconds += verify_cost(len(blocks) * max(len(block) for block in blocks))
        return verify(blocks, trees)

    kv.verify = modeled_verify
    if args.trace:  # (source, drafted tokens or nodes, accepted drafts) of every step
        commit = decoder.engine._commit

        def accepted_so_far(row) -> int:
            return sum(length * count for length, count in enumerate(row.stats.accept_hist))

        def traced_commit(i, row, draft, *rest):
            before = accepted_so_far(row)
            commit(i, row, draft, *rest)
            drafted = draft.tokens.numel()
            # a source's tree cut to no node after the drafter ran: drafting paid for a plain step
            label = row.source if drafted else "plain" if row.source is None else f"{row.source} (cut to 0)"
            decoder.trace.append((label, drafted, accepted_so_far(row) - before))

        decoder.trace = []
        decoder.engine._commit = traced_commit
    model = getattr(drafter, "model", None)  # the hybrid's model drafter: a pass costs DRAFT_S
    if model is not None:
        propose = model.propose

        def modeled_propose(requests):
            Clock.seconds += DRAFT_S
            return propose(requests)

        model.propose = modeled_propose
    return decoder


methods = args.methods.split(",")
decoders = {method: build(method) for method in methods}
datasets = args.datasets.split(",")
speedups = {method: {dataset: [] for dataset in datasets} for method in methods}
for dataset in datasets:
    for prompt in load_prompts(dataset, args.data_dir, args.limit, 0)[: args.limit]:
        outputs, line = [], []
        for method in methods:
            Clock.seconds = 0.0
            if args.trace:
                decoders[method].trace.clear()
            sample = run_prompt(decoders[method], prompt, args.max_new_tokens, 0.0, 0)  # every turn, as the bench
            outputs.append(sample.token_ids)
            speedup = sample.new_tokens * verify_cost(1) / Clock.seconds
            speedups[method][dataset].append(speedup)
            line.append(f"{method} {speedup:.2f}")
        if any(output != outputs[0] for output in outputs):
            sys.exit(f"!! outputs differ on {dataset} {prompt.prompt_id}: a lossless method is broken")
        print(f"{dataset} {prompt.prompt_id}: " + ", ".join(line), flush=True)
        for method in methods if args.trace else []:
            steps = decoders[method].trace
            by_source = {}
            for source, drafted, accepted in steps:
                by_source.setdefault(source, []).append((drafted, accepted))
            print(f"    {method}: " + "; ".join(
                f"{source} {len(got)} steps, width {statistics.mean(d for d, _ in got):.1f}, "
                f"accepted {statistics.mean(a for _, a in got):.2f}" for source, got in by_source.items()))

summary = {method: {dataset: statistics.geometric_mean(values) for dataset, values in by_dataset.items()}
           for method, by_dataset in speedups.items()}
print("\nmodeled speedup over plain decoding (geometric mean per dataset)")
print("| method | " + " | ".join(datasets) + " | all |")
print("|---" * (len(datasets) + 2) + "|")
for method in methods:
    every = [value for values in speedups[method].values() for value in values]
    print(f"| {method} | " + " | ".join(f"{summary[method][d]:.3f}" for d in datasets)
          + f" | {statistics.geometric_mean(every):.3f} |")
if args.output:  # the numbers, and a plot of them beside (OUTPUT with .png)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"costs": cost_model, "speedups": speedups, "summary": summary}, indent=1))
    fig, axis = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        axis.bar([d + i * width for d in range(len(datasets))], [summary[method][d] for d in datasets], width,
                 label=method)
    axis.set_xticks([d + 0.4 - width / 2 for d in range(len(datasets))], datasets)
    axis.axhline(1.0, color="grey", lw=0.8)
    axis.set_title(f"modeled speedup over plain decoding (geometric mean of {args.limit} prompts)", fontsize=10)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output.with_suffix(".png"), dpi=100)
