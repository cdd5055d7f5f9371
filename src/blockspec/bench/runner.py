"""Run every method on the same prompts, INTERLEAVED prompt by prompt (the order
rotates), so that drift of a shared, noisy machine cancels out of the ratios."""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from blockspec.bench.datasets import BenchPrompt, final_answer, load_prompts, same_answer
from blockspec.bench.peers import PEER_KINDS, TransformersPeer
from blockspec.defaults import DEFAULT_TREE_BUDGET, DRAFTER_DTYPES
from blockspec.drafters.registry import NAMED_DRAFTERS, load_drafter
from blockspec.errors import InvalidArgumentError
from blockspec.pipeline import SpecDecoder


@dataclass
class Method:
    name: str
    drafter: str  # "none", a registered name, or a drafter folder
    block_size: int = 16
    engine: str = "blockspec"  # or a transformers peer (hf-generate, hf-prompt-lookup, hf-dflash), or diffusion
    diffusion_steps: int = 1
    plan: bool = False  # blockspec: each step's draft length planned (block_size the most), else a full block
    tree_budget: int | None = None  # blockspec: token trees of at most this many nodes (None: chains)
    drafter_dtype: str = "auto"  # the precision a trained drafter computes in (`targets.loading.drafter_dtype`)

    @property
    def lossless(self) -> bool:
        return self.engine != "diffusion"

    def build(self, target):
        if self.engine == "blockspec":
            return SpecDecoder(target, load_drafter(self.drafter, target, dtype=self.drafter_dtype), self.block_size,
                               self.plan, self.tree_budget)
        if self.engine == "diffusion":
            return DiffusionRunner(target, load_drafter(self.drafter, target, dtype=self.drafter_dtype), self.block_size,
                                   self.diffusion_steps)
        return TransformersPeer(target, self.engine, self.drafter, self.block_size)


class DiffusionRunner:
    """Standalone diffusion decoding behind the runner interface (lossy: never checked
    for identity; its agreement with the baseline and answer accuracy are reported)."""

    def __init__(self, target, drafter, block_size: int, steps: int):
        from blockspec.decoding.diffusion import DiffusionDecoder

        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.decoder = DiffusionDecoder(target, drafter, block_size, steps)

    def generate(self, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0, **_):
        from blockspec.decoding.diffusion import DiffusionStats
        from blockspec.decoding.sampling import SamplingParams
        from blockspec.decoding.stats import GenerationStats
        from blockspec.pipeline import GenerationResult

        ids = self.target.encode_prompt(prompt)
        diffusion = DiffusionStats(self.block_size)
        tokens = [t for chunk in self.decoder.generate(ids, max_new_tokens=max_new_tokens, stats=diffusion,
                                                       params=SamplingParams(temperature, seed=seed)) for t in chunk]
        stats = GenerationStats(1)
        stats.new_tokens, stats.steps = len(tokens), diffusion.blocks  # tau = tokens per target pass
        stats.ttft_s, stats.decode_s = diffusion.ttft_s, diffusion.decode_s
        stats.accept_hist = []
        stop = bool(tokens) and tokens[-1] in self.target.eos_token_ids
        return GenerationResult(text=self.target.decode(tokens), token_ids=tokens, stats=stats,
                                finish_reason="stop" if stop else "length")


DEFAULT_METHODS = ("baseline,default,default-chain,prompt-lookup,dflash-tree,dflash-auto,dflash-b16,dflash-b8,"
                   "hf-generate,hf-prompt-lookup,hf-dflash-b16")
_DIFFUSION = re.compile(r"^diffusion-b(\d+)(?:-s(\d+))?$")
_TREE = re.compile(r"^dflash-tree-n(\d+)$")


def parse_methods(names: str, drafter: str | None, drafter_dtype: str = "auto") -> list[Method]:
    """Method names -> methods; the first is the baseline. `baseline` (blockspec's plain
    loop), any drafter registered by name (e.g. `prompt-lookup`), `dflash-bN` (the DFlash
    drafter at block size N, a full block every step), `dflash-auto` (the DFlash drafter,
    each step's length planned, at most 16), `dflash-tree` (DFlash token trees of at most
    DEFAULT_TREE_BUDGET nodes, each step's node count planned), `dflash-tree-nN` (a tree of N
    nodes every step, depth at most 15), `default` (what `blockspec generate` does: the DFlash
    drafter's trees with prompt lookup's continuation as a branch, planned), `default-chain`
    (the same with chains, `--chain`), the transformers peers `hf-generate`, `hf-prompt-lookup`
    and `hf-dflash-bN` (transformers' built-in DFlash fed with the same drafter), the lossy
    `diffusion-bN[-sK]`, and `LABEL=FOLDER` for any other trained drafter (e.g.
    `mtp-b4=runs/mtp/final`: an MTP head at block size 4; a LABEL `default...` or
    `default-chain...`, e.g. `default-new=runs/x/final`: the default command with that DFlash
    drafter, so two drafters meet in one interleaved run). A blockspec method ending in
    `@DTYPE` runs its trained drafter in that precision (e.g. `default@float32` beside
    `default`); others run in `drafter_dtype`."""
    methods = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        name, _, precision = name.partition("@")
        if precision and precision not in DRAFTER_DTYPES:
            raise InvalidArgumentError(f"{name}@{precision}: the drafter precision must be one of "
                                       f"{', '.join(DRAFTER_DTYPES)}")
        method = _method(name, drafter)
        if method is None:
            continue  # a DFlash method, and no DFlash drafter for this target: nothing to run
        if precision and method.engine in PEER_KINDS:
            raise InvalidArgumentError(f"{name}@{precision}: a transformers peer runs in the target's precision")
        method.drafter_dtype = precision or drafter_dtype
        if precision:
            method.name += f"@{precision}"
        methods.append(method)
    names = [method.name for method in methods]
    if len(set(names)) < len(names):  # results are kept by name: a repeat would overwrite its twin
        twice = sorted({name for name in names if names.count(name) > 1})
        raise InvalidArgumentError(f"bench method named twice: {', '.join(twice)} (label one, e.g. default-new=FOLDER)")
    if not methods or methods[0].name != "baseline":
        raise InvalidArgumentError("the first bench method must be `baseline` (the plain loop every ratio uses)")
    return methods


def _method(name: str, drafter: str | None) -> Method | None:
    """One method name (without `@DTYPE`) -> its method; None for a DFlash method when the
    target has no DFlash drafter (`drafter` is None)."""
    block = int(name.rsplit("-b", 1)[1]) if "dflash-b" in name and name.rsplit("-b", 1)[1].isdigit() else None
    diffusion = _DIFFUSION.match(name)
    tree = _TREE.match(name)
    if "=" in name:  # LABEL=FOLDER: any trained drafter (DFlash, MTP, ...), block size from a -bN suffix
        label, folder = name.split("=", 1)
        if label.split("-")[0] == "default":  # the default command with this DFlash drafter (`--chain`: default-chain...)
            return replace(_method("default-chain" if label.startswith("default-chain") else "default", folder), name=label)
        suffix = label.rsplit("-b", 1)
        return Method(label, folder, int(suffix[1]) if len(suffix) == 2 and suffix[1].isdigit() else 8)
    if name == "baseline":
        return Method(name, "none", 1)
    if name in ("default", "default-chain"):
        return Method(name, "hybrid" if drafter in (None, "auto") else f"hybrid:{drafter}", 16, plan=True,
                      tree_budget=DEFAULT_TREE_BUDGET if name == "default" else None)
    if name in NAMED_DRAFTERS:
        return Method(name, name, 8)
    if name in ("hf-generate", "hf-prompt-lookup"):
        return Method(name, "none", 1, engine=name)
    if tree and int(tree[1]) < 1:
        raise InvalidArgumentError(f"{name}: the tree node budget must be >= 1")
    if name in ("dflash-auto", "dflash-tree") or tree or diffusion or block:
        if not drafter:
            return None
        if name == "dflash-auto":
            return Method(name, drafter, 16, plan=True)
        if name == "dflash-tree":
            return Method(name, drafter, 16, plan=True, tree_budget=DEFAULT_TREE_BUDGET)
        if tree:
            return Method(name, drafter, 16, tree_budget=int(tree[1]))
        if diffusion:  # lossy: standalone diffusion decoding with the DFlash drafter
            return Method(name, drafter, int(diffusion[1]), engine="diffusion", diffusion_steps=int(diffusion[2] or 1))
        return Method(name, drafter, block, engine="hf-dflash" if name.startswith("hf-") else "blockspec")
    known = ["baseline", "default", "default-chain", *NAMED_DRAFTERS, "dflash-bN", "dflash-auto", "dflash-tree",
             "dflash-tree-nN", *PEER_KINDS[:2], "hf-dflash-bN", "diffusion-bN[-sK] (lossy)"]
    raise InvalidArgumentError(f"unknown bench method {name!r}: one of {', '.join(known)}")


@dataclass
class Sample:
    """One method on one prompt (all turns)."""
    token_ids: list[list[int]]
    new_tokens: int
    decode_s: float
    ttft_s: float
    steps: int
    accept_hist: list[int]
    wall_s: float
    texts: list[str] = field(default_factory=list)
    answer: str | None = None  # the prompt's reference answer, when the dataset has one

    @property
    def tpot_s(self) -> float:
        return self.decode_s / max(1, self.new_tokens - len(self.token_ids))


@dataclass
class BenchResult:
    samples: dict = field(default_factory=dict)  # (method, dataset) -> list[Sample]
    mismatches: list = field(default_factory=list)  # (method, dataset, prompt_id, turn)


def run_prompt(decoder: SpecDecoder, prompt: BenchPrompt, max_new_tokens: int, temperature: float, seed: int) -> Sample:
    messages, token_ids, texts, new_tokens, decode_s, ttft_s, steps = [], [], [], 0, 0.0, 0.0, 0
    hist = [0] * decoder.block_size
    started = time.perf_counter()
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        chat = decoder.target.has_chat_template
        result = decoder.generate(messages if chat else turn, max_new_tokens=max_new_tokens,
                                  temperature=temperature, seed=seed)
        messages.append({"role": "assistant", "content": result.text})  # the next turn follows OUR answer
        token_ids.append(result.token_ids)
        texts.append(result.text)
        new_tokens += result.stats.new_tokens
        decode_s += result.stats.decode_s
        ttft_s += result.stats.ttft_s
        steps += result.stats.steps
        hist = [a + b for a, b in zip(hist, result.stats.accept_hist)]
        if not chat:
            break  # a base model gets one turn
    return Sample(token_ids, new_tokens, decode_s, ttft_s, steps, hist, time.perf_counter() - started, texts,
                  prompt.answer)


def run_bench(target, methods: list[Method], datasets: list[str], *, data_dir: str | None, limit: int | None,
              max_new_tokens: int, temperature: float = 0.0, seed: int = 0, repeats: int = 1) -> BenchResult:
    """Every method on every prompt, interleaved prompt by prompt (the order rotates, so no
    method always runs first or after the same neighbour). With `repeats` > 1 each prompt
    runs that many rounds of every method and each method keeps its run of median time
    per output token: one slow run on a shared machine then moves no ratio."""
    decoders = {m.name: m.build(target) for m in methods}
    lossless = {m.name: m.lossless for m in methods}
    baseline = methods[0].name
    result = BenchResult()
    for dataset in datasets:
        prompts = load_prompts(dataset, data_dir, limit, seed)
        for index, prompt in enumerate(tqdm(prompts, desc=f"bench {dataset}", unit="prompt")):
            runs: dict[str, list[Sample]] = {m.name: [] for m in methods}
            for repeat in range(repeats):
                first = (index + repeat) % len(methods)
                order = methods[first:] + methods[:first]
                samples = {m.name: run_prompt(decoders[m.name], prompt, max_new_tokens, temperature, seed)
                           for m in order}
                for name, sample in samples.items():
                    runs[name].append(sample)
                    if temperature == 0 and name != baseline and lossless[name]:
                        _check_identity(result, name, baseline, dataset, prompt.prompt_id, sample, samples[baseline])
            for name, samples in runs.items():
                result.samples.setdefault((name, dataset), []).append(median_run(samples))
    return result


def median_run(samples: list[Sample]) -> Sample:
    """The run of median time per output token (of an even count, the faster middle one)."""
    ranked = sorted(samples, key=lambda sample: sample.tpot_s)
    return ranked[(len(ranked) - 1) // 2]


def _check_identity(result: BenchResult, name: str, baseline: str, dataset: str, prompt_id: str, sample: Sample,
                    base: Sample) -> None:
    for turn, (ours, theirs) in enumerate(zip(sample.token_ids, base.token_ids)):
        if ours != theirs and (name, dataset, prompt_id, turn) not in result.mismatches:
            result.mismatches.append((name, dataset, prompt_id, turn))
            print(f"!! LOSSLESSNESS VIOLATION: {name} differs from {baseline} on {dataset} "
                  f"prompt {prompt_id} turn {turn}")


def summarize(result: BenchResult, methods: list[Method]) -> list[dict]:
    baseline = methods[0].name
    rows = []
    for (name, dataset), samples in result.samples.items():
        base = result.samples[(baseline, dataset)]
        per_prompt = [b.tpot_s / s.tpot_s if s.tpot_s > 0 else None for b, s in zip(base, samples)]
        ratios = sorted(r for r in per_prompt if r is not None)
        steps = sum(s.steps for s in samples)
        committed = sum(s.new_tokens - len(s.token_ids) for s in samples)  # first token of a turn is not a step
        hist = [sum(col) for col in zip(*(s.accept_hist for s in samples))]
        proposed = [sum(hist[k:]) for k in range(1, len(hist))]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        rows.append({
            "method": name, "dataset": dataset, "prompts": len(samples),
            "speedup_median": statistics.median(ratios), "speedup_p25": quartiles[0], "speedup_p75": quartiles[2],
            "speedup_by_prompt": per_prompt,  # prompt order, for paired comparisons between methods
            "tau": committed / steps if steps else 0.0,
            "accept_by_pos": [round(p / steps, 4) if steps else 0.0 for p in proposed],
            "tokens_per_s": sum(s.new_tokens for s in samples) / sum(s.decode_s + s.ttft_s for s in samples),
            "ttft_s_median": statistics.median(s.ttft_s for s in samples),
            "mismatches": sum(1 for m in result.mismatches if m[0] == name and m[1] == dataset),
            # share of the baseline's tokens reproduced at the same position (1.0 for a lossless method at T=0)
            "agreement": statistics.mean(_agreement(s.token_ids, b.token_ids) for s, b in zip(samples, base)),
        })
        answered = [s for s in samples if s.answer is not None]
        if answered:
            rows[-1]["answer_accuracy"] = sum(same_answer(final_answer(s.texts[-1]), s.answer)
                                              for s in answered) / len(answered)
    return rows


def paired_comparisons(rows: list[dict], methods: list[Method], resamples: int = 2000, seed: int = 0) -> list[dict]:
    """The first method after the baseline against each later one, PROMPT BY PROMPT.

    Two methods' medians over a few prompts differ by run-to-run noise of the order of the
    gaps between them (each prompt's speed varies far more than a method's); their per-prompt
    ratio does not carry that spread, since both ran back to back on the same prompt. Per
    dataset and over all datasets: the geometric mean of `other's time / subject's time`
    (above 1: the subject is faster) with a 95% bootstrap interval over prompts."""
    if len(methods) < 3:
        return []
    subject = methods[1].name
    by_key = {(r["method"], r["dataset"]): r["speedup_by_prompt"] for r in rows}
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    rng = random.Random(seed)
    comparisons = []
    for other in (m.name for m in methods[2:]):
        pooled = []
        for dataset in [*datasets, "all"]:
            if dataset == "all":
                logs = pooled
            else:  # subject speedup / other speedup = other time / subject time, on the same prompt
                pairs = zip(by_key.get((subject, dataset), []), by_key.get((other, dataset), []))
                logs = [math.log(a / b) for a, b in pairs if a and b]
                pooled += logs
            if not logs or (dataset == "all" and len(datasets) < 2):
                continue
            means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
            comparisons.append({"method": subject, "against": other, "dataset": dataset, "prompts": len(logs),
                                "ratio": math.exp(statistics.fmean(logs)),
                                "ci95": [math.exp(means[int(0.025 * resamples)]),
                                         math.exp(means[int(0.975 * resamples) - 1])]})
    return comparisons


def machine_description() -> dict:
    """What a reader needs to compare numbers across machines."""
    import datetime
    import os
    import platform

    import torch
    import transformers

    import blockspec

    from blockspec.targets.linear_kernels import cpu_name

    return {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "blockspec": blockspec.__version__}


def _agreement(ours: list[list[int]], base: list[list[int]]) -> float:
    same = sum(sum(int(a == b) for a, b in zip(o, r)) for o, r in zip(ours, base))
    return same / max(1, sum(len(r) for r in base))


def _markdown_row(r: dict) -> str:
    accepted = " / ".join(f"{a:.2f}" for a in r["accept_by_pos"][:3]) or "-"
    accuracy = f"{r['answer_accuracy']:.2f}" if "answer_accuracy" in r else "-"
    return (f"| {r['method']} | {r['dataset']} | {r['prompts']} | {r['speedup_median']:.2f}x | "
            f"{r['speedup_p25']:.2f}-{r['speedup_p75']:.2f} | {r['tau']:.2f} | {accepted} | {r['tokens_per_s']:.1f} | "
            f"{r['ttft_s_median'] * 1e3:.0f} | {r['mismatches']} | {r['agreement']:.2f} | {accuracy} |")


def report(rows: list[dict], output: Path, meta: dict) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    header = f"{'method':<18}{'dataset':<10}{'n':>4}{'speedup':>9}{'[p25-p75]':>14}{'tau':>7}{'tok/s':>8}{'mismatch':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['method']:<18}{r['dataset']:<10}{r['prompts']:>4}{r['speedup_median']:>8.2f}x"
                     f"{'[%.2f-%.2f]' % (r['speedup_p25'], r['speedup_p75']):>14}{r['tau']:>7.2f}"
                     f"{r['tokens_per_s']:>8.1f}{r['mismatches']:>10}")
    for c in meta.get("paired", []):
        lines.append(f"{c['method']} vs {c['against']} on {c['dataset']}: {c['ratio']:.2f}x "
                     f"[{c['ci95'][0]:.2f}-{c['ci95'][1]:.2f}] (per-prompt geomean, 95% bootstrap, {c['prompts']} prompts)")
    table = "\n".join(lines)
    print(table)
    markdown = ["| method | dataset | prompts | speedup (median) | p25-p75 | tau | accepted at draft pos 1/2/3 | "
                "tokens/s | TTFT ms | T=0 mismatches | agreement | answer acc. |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    markdown += [_markdown_row(r) for r in rows]
    if meta.get("paired"):
        markdown += ["", "| method | against | dataset | prompts | time ratio (per-prompt geomean) | 95% bootstrap |",
                     "|---|---|---|---|---|---|"]
        markdown += [f"| {c['method']} | {c['against']} | {c['dataset']} | {c['prompts']} | {c['ratio']:.2f}x | "
                     f"{c['ci95'][0]:.2f}-{c['ci95'][1]:.2f} |" for c in meta["paired"]]
    costs = meta.get("costs") or {}
    if costs:
        markdown += ["", "| method | decode(1) ms | verified tokens | verify ms | r | draft ms | d |",
                     "|---|---|---|---|---|---|---|"]
        markdown += [f"| {name} | {c['decode_s'] * 1e3:.1f} | {c.get('verify_tokens', c['block_size'])} | "
                     f"{c['verify_s'] * 1e3:.1f} | {c['r']:.2f} | {c.get('draft_s', 0) * 1e3:.1f} | {c.get('d', 0):.2f} |"
                     for name, c in costs.items()]
    if meta.get("roofline"):
        line = meta["roofline"]
        markdown += ["", f"Memory bandwidth {line['bandwidth_gb_s']:.1f} GB/s; a decode step reads at least "
                         f"{line['bytes_per_step_mb']:.0f} MB (weights + KV at {line['context_len']} tokens): plain "
                         f"decoding cannot exceed {line['ceiling_tokens_per_s']:.1f} tokens/s here."]
    if meta.get("linear_kernels"):
        from blockspec.targets.linear_kernels import describe_linear_kernels

        markdown += ["", describe_linear_kernels(meta["linear_kernels"])]
    if meta.get("peak_memory"):
        markdown += ["", "| method | RSS once loaded (MB) | peak RSS while generating (MB) | added by generating (MB) |",
                     "|---|---|---|---|"]
        markdown += [f"| {e.get('method')} | {e.get('rss_mb_loaded')} | {e.get('peak_rss_mb_generating')} | "
                     f"{e.get('added_mb', e.get('error'))} |" for e in meta["peak_memory"]]
    (output / "table.md").write_text("\n".join(markdown) + "\n")
    _plot(rows, output / "bench.png")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["dataset"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        color = f"C{i % 10}"  # one colour per method in all three panels (the baseline has no line)
        got = {r["dataset"]: r for r in rows if r["method"] == method}
        xs = [d + i * width for d in range(len(datasets))]
        axes[0].bar(xs, [got[d]["speedup_median"] if d in got else 0 for d in datasets], width, label=method,
                    color=color)
        axes[1].bar(xs, [got[d]["tau"] if d in got else 0 for d in datasets], width, label=method, color=color)
        accept = [r["accept_by_pos"] for r in rows if r["method"] == method and r["accept_by_pos"]]
        if accept:  # averaged over datasets
            width_k = min(len(a) for a in accept)
            mean = [sum(a[k] for a in accept) / len(accept) for k in range(width_k)]
            axes[2].plot(range(1, width_k + 1), mean, marker="o", label=method, color=color)
    for axis, title in zip(axes[:2], ["median speedup vs plain decoding (decode only)", "acceptance length tau"]):
        axis.set_xticks([d + 0.4 - width / 2 for d in range(len(datasets))], datasets)
        axis.set_title(title, fontsize=10)
    axes[2].set_title("accepted at draft position k (mean over datasets)", fontsize=10)
    axes[2].set_xlabel("draft position k")
    axes[2].set_ylim(0, 1)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8)
    if axes[2].lines:
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
