"""Serving throughput: C concurrent clients on the batched engine, speculative vs the
non-speculative batched baseline (the same engine with no drafter), in one process.

Closed loop: each of the C clients sends its next request as soon as the previous one
ends, until every request is served. Configurations alternate (baseline, speculative,
baseline, ...) per concurrency level so machine drift hits both alike. Reported per
configuration: output tokens/s over the whole run, per-request latency (median and p90),
and the speculative / baseline throughput ratio.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from blockspec.decoding.batched_spec import BatchedSpecEngine


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
            "tokens_per_s": tokens / wall, "latency_median_s": statistics.median(latencies),
            "latency_p90_s": sorted(latencies)[max(0, int(0.9 * len(latencies)) - 1)]}


def serving_bench(target, drafter, prompts: list[list[int]], concurrency_levels: list[int], block_size: int,
                  max_new_tokens: int, token_budget: int | None = 8) -> list[dict]:
    rows = []
    for concurrency in tqdm(concurrency_levels, desc="serving bench", unit="level"):
        for name, use_drafter in (("baseline", None), ("speculative", drafter)):
            engine = BatchedSpecEngine(target, use_drafter, block_size, max_batch=concurrency,
                                       token_budget=token_budget)
            result = run_closed_loop(engine, prompts, concurrency, max_new_tokens)
            result["method"] = name
            rows.append(result)
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
