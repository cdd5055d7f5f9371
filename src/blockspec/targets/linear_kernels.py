"""Which kernel computes a float32 CPU target's Linear products, chosen by the number of rows
(tokens in the pass) from what THIS machine measures fastest.

A decoding step multiplies every weight by 1 row; a verify pass by 2-64. On a CPU each product
streams the whole weight from memory, and how a kernel handles few rows decides whether a verify
pass costs about one plain step or twice it. Three kernels compute the same product (equal up to
float rounding, ~1e-5 relative):
- `linear`: transformers' own `F.linear` (MKL's sgemm, which repacks the weight on every call for
  more than one row);
- `weight-first`: `W @ x^T` (BLAS packs the few rows instead of the weight);
- `onednn`: oneDNN's inner product on a copy of the weight reordered ONCE into its blocked layout
  (what `torch.compile`'s freezing passes use on CPU); it costs a second copy of the weights.
Measured on session 23's AMD EPYC (the default target's shapes, 2 threads, whole weights streamed):
`linear` 64 / 108 / 99 / 105 / 133 / 154 ms at 1 / 2 / 4 / 8 / 16 / 33 rows, `onednn` 38 / 46 / 43
/ 57 / 66 / 111; at one thread `weight-first` was fastest for 1-4 rows. So `load_target` measures
every kernel at each of PROBE_ROWS once per machine (a few seconds, then cached under the user
cache dir) and each Linear takes, for a pass of n rows, the kernel measured fastest at the
smallest probed count >= n; BLOCKSPEC_LINEAR_KERNEL names one kernel for every count instead.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.errors import InvalidArgumentError

KERNEL_ENV = "BLOCKSPEC_LINEAR_KERNEL"
KERNELS = ("linear", "weight-first", "onednn")
PROBE_ROWS = (1, 2, 4, 8, 16, 33, 64)  # a plain step, chains of 1-15 drafts, trees up to 32 nodes, batches
PROBE_BYTES = 128 << 20  # weights streamed per probe pass: more than a CPU cache holds, as a model's are
# Another kernel than transformers' own must be clearly faster at that row count: a short probe on a
# shared machine scatters by +-15% (session 21), and a wrong choice costs on every step.
GAIN_NEEDED = 0.93
# the second copy `onednn` keeps may take at most this share of the memory available at load
ONEDNN_MEMORY_SHARE = 0.25
# weights that fit in a CPU's caches are not streamed from memory, which is what the kernels differ
# in (and what the probe measures): smaller models (the tests' tiny ones) keep transformers' own
SMALLEST_WEIGHT_BYTES = 8 << 20


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def _onednn(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")


class RowDispatchLinear(torch.nn.Module):
    """An `nn.Linear` (same `weight` and `bias` Parameters: a tied head stays tied) whose
    product runs in the kernel `kernel_for_rows[rows]` picks. Anything that needs gradients
    takes `F.linear`: the other kernels are for inference."""

    def __init__(self, linear: torch.nn.Linear, kernel_for_rows: list[str]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernel_for_rows = kernel_for_rows  # index: rows (0 unused); beyond its end: its last
        self.packed = _reorder(self.weight) if "onednn" in kernel_for_rows else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad):
            return F.linear(hidden, self.weight, self.bias)
        rows = hidden.numel() // self.in_features
        kernel = self.kernel_for_rows[min(rows, len(self.kernel_for_rows) - 1)]
        if kernel == "linear":
            return F.linear(hidden, self.weight, self.bias)
        flat = hidden.reshape(-1, self.in_features)
        if kernel == "onednn":
            out = _onednn(flat, self.packed, self.bias)
        else:
            out = (self.weight @ flat.T).T
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels={sorted(set(self.kernel_for_rows[1:]))}"


def _cpu_float32_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, module) of every float32 CPU `nn.Linear` of `model`."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                found.append((parent, name, child))
    return found


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The distinct [out, in] shapes of the products a kernel choice applies to."""
    return sorted({tuple(linear.weight.shape) for _, _, linear in _cpu_float32_linears(model)})


def kernel_table(choice: dict[int, str]) -> list[str]:
    """{probed rows: kernel} -> kernel per row count 0..max probed (n rows take the kernel of
    the smallest probed count >= n)."""
    probed = sorted(choice)
    return [choice[probed[min(bisect.bisect_left(probed, rows), len(probed) - 1)]] for rows in range(probed[-1] + 1)]


def use_linear_kernels(model: torch.nn.Module, choice: dict[int, str]) -> int:
    """Replace every float32 CPU `nn.Linear` of `model` by a `RowDispatchLinear` taking
    `choice` ({probed rows: kernel}); returns how many were replaced. For inference."""
    unknown = set(choice.values()) - set(KERNELS)
    if unknown:
        raise InvalidArgumentError(f"unknown linear kernel {sorted(unknown)}: use one of {', '.join(KERNELS)}")
    table = kernel_table(choice)
    linears = _cpu_float32_linears(model)
    for parent, name, linear in linears:
        setattr(parent, name, RowDispatchLinear(linear, table))
    return len(linears)


def probe_linear_kernels(shapes: list[tuple[int, int]], kernels: tuple[str, ...] = KERNELS,
                         rows: tuple[int, ...] = PROBE_ROWS, probe_bytes: int = PROBE_BYTES,
                         repeats: int = 3) -> dict[int, dict[str, float]]:
    """Seconds per pass of each kernel at each row count: {rows: {kernel: median seconds}} over
    `repeats` passes, the kernels' order rotated every repeat, over distinct matrices of `shapes`
    adding up to about `probe_bytes`, so that they stream from memory as a model's weights do (a
    cache-hot probe misleads: one [1536, 576] matrix reused read level where distinct ones ran 0.87x)."""
    generator = torch.Generator().manual_seed(0)
    per_round = sum(out_features * in_features * 4 for out_features, in_features in shapes)
    copies = max(1, math.ceil(probe_bytes / per_round))
    weights = [torch.randn(*shape, generator=generator) for _ in range(copies) for shape in shapes]
    packed = [_reorder(w) for w in weights] if "onednn" in kernels else []
    products = {
        "linear": lambda x, i: F.linear(x, weights[i]),
        "weight-first": lambda x, i: weights[i] @ x.T,
        "onednn": lambda x, i: _onednn(x, packed[i], None),
    }
    times: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for count in rows:
            inputs = {in_features: torch.randn(count, in_features, generator=generator) for _, in_features in shapes}

            def seconds(kernel: str) -> float:
                started = time.perf_counter()
                for i, weight in enumerate(weights):
                    products[kernel](inputs[weight.shape[1]], i)
                return time.perf_counter() - started

            for kernel in kernels:  # warm-up
                seconds(kernel)
            samples: dict[str, list[float]] = {kernel: [] for kernel in kernels}
            for repeat in range(repeats):
                order = kernels[repeat % len(kernels):] + kernels[:repeat % len(kernels)]
                for kernel in order:
                    samples[kernel].append(seconds(kernel))
            times[count] = {kernel: statistics.median(values) for kernel, values in samples.items()}
    return times


def pick_kernels(times: dict[int, dict[str, float]]) -> dict[int, str]:
    """The kernel per probed row count: the fastest, if it beats `linear` by GAIN_NEEDED."""
    choice = {}
    for rows, by_kernel in times.items():
        fastest = min(by_kernel, key=by_kernel.get)
        clear = fastest == "linear" or by_kernel[fastest] < GAIN_NEEDED * by_kernel["linear"]
        choice[rows] = fastest if clear else "linear"
    return choice


def cpu_name() -> str:
    """The CPU's model name (what the kernel choice, and a benchmark's record, are keyed by)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cache_path() -> Path:
    from blockspec.targets.loading import cache_dir

    return cache_dir() / "linear-kernels.json"


def choose_linear_kernels(model: torch.nn.Module) -> dict:
    """{"kernels": {rows: kernel}, "source": env / measured / cached / not-applicable, "ms":
    {rows: {kernel: milliseconds}} when measured}. BLOCKSPEC_LINEAR_KERNEL=linear|weight-first|onednn
    takes one kernel at every row count; `auto` (the default) measures once per CPU model, torch
    version, thread count and set of shapes and keeps the answer in the user cache dir, so every
    later load (and every process of a benchmark) computes the same way; weights under
    SMALLEST_WEIGHT_BYTES keep transformers' own. `onednn` is left out
    where torch lacks it or its second copy of the weights would not fit comfortably in memory."""
    requested = os.environ.get(KERNEL_ENV, "auto").strip() or "auto"
    if requested not in (*KERNELS, "auto"):
        raise InvalidArgumentError(f"{KERNEL_ENV}={requested!r}: use one of auto, {', '.join(KERNELS)}")
    shapes = linear_shapes(model)
    weight_bytes = sum(linear.weight.numel() * 4 for _, _, linear in _cpu_float32_linears(model))
    if not shapes or (requested == "auto" and weight_bytes < SMALLEST_WEIGHT_BYTES):
        # nothing to dispatch (a GPU or a bf16 model), or weights a cache holds
        return {"kernels": {}, "source": "not-applicable"}
    available = _memory_available()
    onednn_fits = onednn_available() and (available is None or weight_bytes <= ONEDNN_MEMORY_SHARE * available)
    if requested != "auto":
        if requested == "onednn" and not onednn_available():
            raise InvalidArgumentError(f"{KERNEL_ENV}=onednn: this torch build has no oneDNN linear kernels")
        return {"kernels": {rows: requested for rows in PROBE_ROWS}, "source": "env"}
    kernels = KERNELS if onednn_fits else tuple(k for k in KERNELS if k != "onednn")
    key = "|".join([cpu_name(), f"torch {torch.__version__}", f"threads {torch.get_num_threads()}",
                    "+".join(kernels), hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]])
    path = _cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("kernels"), dict) \
            and set(entry["kernels"].values()) <= set(kernels) and entry["kernels"]:
        return {"kernels": {int(rows): k for rows, k in entry["kernels"].items()}, "ms": entry.get("ms"),
                "source": "cached"}
    times = probe_linear_kernels(shapes, kernels)
    choice = pick_kernels(times)
    ms = {rows: {kernel: round(seconds * 1e3, 2) for kernel, seconds in by_kernel.items()}
          for rows, by_kernel in times.items()}
    known[key] = {"kernels": {str(rows): k for rows, k in choice.items()},
                  "ms": {str(rows): by_kernel for rows, by_kernel in ms.items()}}
    try:
        from blockspec.atomic import write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(known, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only cache dir costs a probe per load, not a failure
    return {"kernels": choice, "ms": known[key]["ms"], "source": "measured"}


def speed_up_linears(model: torch.nn.Module) -> dict:
    """Apply `choose_linear_kernels` to `model` (for inference); returns the choice."""
    choice = choose_linear_kernels(model)
    if choice["kernels"] and set(choice["kernels"].values()) != {"linear"}:
        use_linear_kernels(model, choice["kernels"])
    return choice


def describe_linear_kernels(choice: dict) -> str:
    """One line on how the target's Linear products run: numbers from two machines are
    comparable only knowing it."""
    kernels = choice.get("kernels") or {}
    if not kernels:
        return f"Target Linear products: transformers' own ({choice.get('source', 'not-applicable')})."
    by_rows = ", ".join(f"{rows}: {kernel}" for rows, kernel in sorted((int(r), k) for r, k in kernels.items()))
    return f"Target Linear kernels by rows in the pass ({choice['source']}): {by_rows}."
