"""How a float32 CPU target stores its Linear weights, chosen by measuring THIS machine.

A Linear weight can be stored row-major ([out, in], transformers' own) or as the transpose of a
contiguous [in, out] matrix: the same values, and `F.linear` hands BLAS the other orientation.
Which one a few-row product (a verify pass) runs faster in depends on the CPU and its BLAS:
- an Intel Xeon (session 20): transposed 0.82x the time at 8 rows, 0.86x at 33 (bare products of
  the default target's shapes); the default command 0.936x the time per token on math and code;
- an AMD EPYC (session 21): transposed 1.09-1.17x at 9 rows, level at 33, 0.87-0.90x at one row
  (distinct weights streamed from memory); the default command 1.11x the time per token.
So `load_target` measures it once per machine (`choose_linear_layout`: about 1.5 s here, then
cached under the user cache dir) unless BLOCKSPEC_LINEAR_LAYOUT names one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from blockspec.errors import InvalidArgumentError

LAYOUT_ENV = "BLOCKSPEC_LINEAR_LAYOUT"
LAYOUTS = ("row-major", "transposed")
PROBE_ROWS = (9, 33)  # a chain verify of 8 drafts and a tree of 32 nodes: the passes speculation pays for
PROBE_BYTES = 128 << 20  # weights streamed per probe pass: more than a CPU cache holds, as a model's are
# Transposed must be clearly faster at EVERY probed size: on this shared, noisy kind of machine a
# short probe scatters by +-15% at one size (session 21, AMD: 0.76-1.09 at 9 rows over repeated
# 64 MB probes, where the engine ran 1.11x slower transposed), while the Intel machine it was
# made for measured 0.82 / 0.86. Anything less keeps transformers' own layout.
GAIN_NEEDED = 0.93


def store_linear_weights_transposed(model: torch.nn.Module) -> int:
    """Store every float32 CPU `nn.Linear` weight of `model` as the transpose of a contiguous
    [in, out] matrix (same values, same module, same Parameter; a tied weight stays tied);
    logits equal up to float rounding (~1e-4). For inference only: a model under an optimizer
    keeps its layout. Returns how many weights were re-laid out."""
    moved = 0
    for weight in _cpu_float32_linear_weights(model):
        if weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
            moved += 1
    return moved


def _cpu_float32_linear_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights a re-layout applies to: float32 `nn.Linear` weights on the CPU."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The distinct [out, in] shapes of the weights a re-layout would move."""
    return sorted({tuple(weight.shape) for weight in _cpu_float32_linear_weights(model)})


def probe_linear_layout(shapes: list[tuple[int, int]], rows: tuple[int, ...] = PROBE_ROWS,
                        probe_bytes: int = PROBE_BYTES, repeats: int = 5) -> list[float]:
    """Time per product, transposed over row-major, at each of `rows`: the median of `repeats`
    interleaved passes (A B, then B A) over distinct matrices of `shapes` adding up to about
    `probe_bytes`, so that they stream from memory as a model's weights do (a cache-hot probe
    misleads: one [1536, 576] matrix reused read level at one row where distinct ones ran 0.87x)."""
    generator = torch.Generator().manual_seed(0)
    per_round = sum(out_features * in_features * 4 for out_features, in_features in shapes)
    copies = max(1, math.ceil(probe_bytes / per_round))
    row_major = [torch.randn(*shape, generator=generator) for _ in range(copies) for shape in shapes]
    transposed = [w.t().contiguous().t() for w in row_major]
    ratios = []
    for count in rows:
        inputs = {in_features: torch.randn(count, in_features, generator=generator) for _, in_features in shapes}

        def seconds(weights: list[torch.Tensor]) -> float:
            started = time.perf_counter()
            for weight in weights:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)
            return time.perf_counter() - started

        seconds(row_major), seconds(transposed)  # warm-up
        times = {"row-major": [], "transposed": []}
        for repeat in range(repeats):
            order = ("row-major", "transposed") if repeat % 2 == 0 else ("transposed", "row-major")
            for layout in order:
                times[layout].append(seconds(row_major if layout == "row-major" else transposed))
        ratios.append(statistics.median(times["transposed"]) / statistics.median(times["row-major"]))
    return ratios


def cpu_name() -> str:
    """The CPU's model name (what the layout choice, and a benchmark's record, are keyed by)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cache_path() -> Path:
    from blockspec.targets.loading import cache_dir

    return cache_dir() / "linear-layout.json"


def choose_linear_layout(model: torch.nn.Module) -> dict:
    """Which layout this machine runs the model's few-row products faster in: {"layout",
    "source" (env / measured / cached / not-applicable), "ratio" (transposed over row-major
    time at each of PROBE_ROWS, when measured)}. BLOCKSPEC_LINEAR_LAYOUT=row-major|transposed
    overrides; `auto` (the default) measures once per CPU model, torch version, thread count
    and set of shapes and keeps the answer in the user cache dir, so every later load (and
    every process of a benchmark) lays the target out the same way."""
    requested = os.environ.get(LAYOUT_ENV, "auto").strip() or "auto"
    if requested not in (*LAYOUTS, "auto"):
        raise InvalidArgumentError(f"{LAYOUT_ENV}={requested!r}: use one of auto, {', '.join(LAYOUTS)}")
    shapes = linear_shapes(model)
    if not shapes:  # nothing a re-layout would move (a GPU or a bf16 model)
        return {"layout": "row-major", "source": "not-applicable"}
    if requested != "auto":
        return {"layout": requested, "source": "env"}
    key = "|".join([cpu_name(), f"torch {torch.__version__}", f"threads {torch.get_num_threads()}",
                    hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]])
    path = _cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("layout") in LAYOUTS:
        return {**entry, "source": "cached"}
    ratios = probe_linear_layout(shapes)
    entry = {"layout": "transposed" if max(ratios) < GAIN_NEEDED else "row-major",
             "ratio": [round(ratio, 4) for ratio in ratios]}
    known[key] = entry
    try:
        from blockspec.atomic import write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(known, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only cache dir costs a probe per load, not a failure
    return {**entry, "source": "measured"}


def lay_out_linear_weights(model: torch.nn.Module) -> dict:
    """Apply `choose_linear_layout` to `model` (for inference); returns the choice."""
    choice = choose_linear_layout(model)
    if choice["layout"] == "transposed":
        store_linear_weights_transposed(model)
    return choice
