"""Serving throughput: C concurrent clients on the batched engine, speculative vs the
non-speculative batched baseline (the same engine with no drafter), in one process.

Closed loop: each of the C clients sends its next request as soon as the previous one
ends, until every request is served. Configurations alternate (baseline, speculative,
then speculative, baseline, ...) per concurrency level, `repeats` times, so machine
drift hits both alike. Reported per configuration: the median over repeats of output
tokens/s, per-request latency (median and p90 over every request of every repeat), and
the speculative / baseline throughput ratio (of those medians). The speculative runs share
one `DraftPlanner`, as a server's long-lived engine does, so what it measured in earlier
runs (costs, acceptance) carries over; the first run at each level starts from less.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from blockspec.decoding.engine import BatchedSpecEngine
from blockspec.decoding.planner import DraftPlanner


def run_closed_loop(engine: BatchedSpecEngine, prompts: list[list[int]], concurrency: int,
                    max_new_tokens: int) -> dict:
    pending = list(prompts)
    latencies, tokens = [], 0
    in_flight = 0
    started = time.perf_counter()

    def submit():
        nonlocal in_flight
        prompt = pending.pop(0)
        sent = time.perf_counter()
        count = [0]

        def done(stats):
            nonlocal tokens, in_flight
            latencies.append(time.perf_counter() - sent)
            tokens += count[0]
            in_flight -= 1

        engine.add(prompt, max_new_tokens=max_new_tokens, on_chunk=lambda chunk: count.__setitem__(0, count[0] + len(chunk)),
                   on_done=done)
        in_flight += 1

    while pending or engine.busy:
        while pending and in_flight < concurrency:
            submit()
        engine.step()
    wall = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "latencies": latencies}


def serving_bench(target, drafter, prompts: list[list[int]], concurrency_levels: list[int], block_size: int,
                  max_new_tokens: int, repeats: int = 1, tree_budget: int | None = None) -> list[dict]:
    rows = []
    configurations = (("baseline", None), ("speculative", drafter))
    # one planner for every speculative run, as a server's engine keeps its own for its whole
    # life: what it measured (the cost of each verify size, the drafter's acceptance) carries over
    planner = DraftPlanner(block_size - 1)
    for concurrency in tqdm(concurrency_levels, desc="serving bench", unit="level"):
        runs: dict[str, list[dict]] = {name: [] for name, _ in configurations}
        for repeat in range(repeats):
            for name, use_drafter in configurations[::1 if repeat % 2 == 0 else -1]:
                engine = BatchedSpecEngine(target, use_drafter, block_size, max_batch=concurrency, planner=planner,
                                           tree_budget=tree_budget if use_drafter is not None else None)
                runs[name].append(run_closed_loop(engine, prompts, concurrency, max_new_tokens))
        for name, _ in configurations:
            done = runs[name]
            latencies = sorted(latency for run in done for latency in run["latencies"])
            rows.append({"concurrency": concurrency, "method": name, "requests": done[0]["requests"],
                         "repeats": repeats, "output_tokens": done[0]["output_tokens"],
                         "tokens_per_s": statistics.median(run["tokens_per_s"] for run in done),
                         "tokens_per_s_runs": [run["tokens_per_s"] for run in done],
                         "latency_median_s": statistics.median(latencies),
                         "latency_p90_s": latencies[max(0, int(0.9 * len(latencies)) - 1)]})
        base, spec = rows[-2], rows[-1]
        spec["throughput_ratio"] = spec["tokens_per_s"] / base["tokens_per_s"]
    return rows


def report_serving(rows: list[dict], output: Path, meta: dict) -> str:
    output.mkdir(parents=True, exist_ok=True)
    (output / "serving.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["| clients | method | output tokens/s | latency median (s) | latency p90 (s) | vs baseline |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['throughput_ratio']:.2f}x" if "throughput_ratio" in r else "1.00x"
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['latency_median_s']:.2f} | "
                     f"{r['latency_p90_s']:.2f} | {ratio} |")
    table = "\n".join(lines)
    (output / "serving.md").write_text(table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    for method in ("baseline", "speculative"):
        got = [r for r in rows if r["method"] == method]
        axis.plot([r["concurrency"] for r in got], [r["tokens_per_s"] for r in got], marker="o", label=method)
    axis.set_xlabel("concurrent clients")
    axis.set_ylabel("output tokens/s")
    axis.set_xscale("log", base=2)
    axis.set_title("batched serving throughput", fontsize=10)
    axis.legend()
    fig.tight_layout()
    fig.savefig(output / "serving.png", dpi=100)
    plt.close(fig)
    return table
