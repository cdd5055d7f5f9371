"""The decomposition speedup ~ tau / (r + d): r = verify(B) / decode(1), d = draft / decode(1).
For a token tree of N nodes the verify pass is N + 1 tokens wide: r = verify(N + 1) / decode(1).

Each cost is the median of several interleaved timings at the same context length,
so that the ratios survive a noisy shared machine.
"""

from __future__ import annotations

import statistics
import time

import torch

from blockspec.decoding.draft import DraftRequest
from blockspec.decoding.sampling import SamplingParams


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@torch.inference_mode()
def measure_costs(target, drafter, block_size: int, context_len: int = 256, repeats: int = 7,
                  verify_tokens: int | None = None) -> dict:
    """Median seconds of decode(1), verify(`verify_tokens`, default B) and one draft pass of
    B - 1 positions; r and d."""
    generator = torch.Generator().manual_seed(0)
    low = min(100, target.vocab_size // 2)  # past the special tokens of a real vocabulary
    context = torch.randint(low, min(target.vocab_size, 20000), (context_len,), generator=generator)
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    target.reset()
    out = target.forward(context, layer_ids)
    target.rollback(context_len)
    if drafter is not None:
        drafter.begin(context, out.features)
    verify_tokens = verify_tokens or block_size
    block = torch.randint(low, min(target.vocab_size, 1000), (max(block_size, verify_tokens),), generator=generator)
    decode, verify, draft = [], [], []
    params = SamplingParams()
    # A drafter with several sources (the default's hybrid: the model, and prompt lookup when the
    # context repeats itself) is timed on its model: left to choose, it drafts by lookup (~free)
    # once the repeated anchors below make the context repeat, and d read 0.00 (session 21).
    source = "model" if hasattr(drafter, "next_sources") else None
    committed = context
    for _ in range(repeats):
        decode.append(_timed(lambda: target.forward(block[:1], layer_ids)))
        target.rollback(context_len)
        verify.append(_timed(lambda: target.forward(block[:verify_tokens], layer_ids)))
        target.rollback(context_len)
        if drafter is not None:
            # as in decoding: a new anchor after the committed tokens; then it is committed
            # (with plausible features) so that the next pass drafts after it
            with_anchor = torch.cat([committed, block[:1]])
            request = DraftRequest(drafter, with_anchor, block_size - 1, params, source=source)
            draft.append(_timed(lambda: drafter.propose([request])))
            drafter.accept(block[:1], None if out.features is None else out.features[-1:])
            committed = with_anchor
    decode_s = statistics.median(decode)
    result = {"context_len": context_len, "block_size": block_size, "verify_tokens": verify_tokens, "decode_s": decode_s,
              "verify_s": statistics.median(verify), "r": statistics.median(verify) / decode_s}
    if draft:
        result.update(draft_s=statistics.median(draft), d=statistics.median(draft) / decode_s)
    return result


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Sustained memory read bandwidth in bytes/s: the best of several full reads of a
    buffer far larger than the caches (a sum reads every byte once)."""
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    buffer.sum()  # touch every page first
    best = min(_timed(buffer.sum) for _ in range(repeats))
    return buffer.numel() * 4 / best


def decode_step_bytes(target, context_len: int = 256) -> int:
    """Bytes one plain decode step must read at least: every weight once (a tied
    embedding / LM head counts once: the lookup reads one row, the head all of it) plus
    the KV cache of `context_len` positions."""
    seen, weights = set(), 0
    for parameter in target.model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            weights += parameter.numel() * parameter.element_size()
    config = target.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * target.num_layers * heads * head_dim * context_len * target.dtype.itemsize
    return weights + kv


def roofline(target, context_len: int = 256) -> dict:
    """The memory-bound ceiling of plain decoding: bandwidth / bytes per step, in tokens/s."""
    bandwidth = measure_bandwidth()
    step_bytes = decode_step_bytes(target, context_len)
    return {"bandwidth_gb_s": bandwidth / 1e9, "bytes_per_step_mb": step_bytes / 1e6, "context_len": context_len,
            "ceiling_tokens_per_s": bandwidth / step_bytes}
