"""The decomposition speedup ~ tau / (r + d): r = verify(B) / decode(1), d = draft / decode(1).

Each cost is the median of several interleaved timings at the same context length,
so that the ratios survive a noisy shared machine.
"""

from __future__ import annotations

import statistics
import time

import torch

from blockspec.decoding.sampling import SamplingParams


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@torch.inference_mode()
def measure_costs(target, drafter, block_size: int, context_len: int = 256, repeats: int = 7) -> dict:
    """Median seconds of decode(1), verify(B) and one draft pass; r and d."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(100, min(target.vocab_size, 20000), (context_len,), generator=generator)
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    target.reset()
    out = target.forward(context, layer_ids)
    target.rollback(context_len)
    if drafter is not None:
        drafter.begin(context, out.features)
    block = torch.randint(100, 1000, (block_size,), generator=generator)
    decode, verify, draft = [], [], []
    params = SamplingParams()
    for _ in range(repeats):
        decode.append(_timed(lambda: target.forward(block[:1], layer_ids)))
        target.rollback(context_len)
        verify.append(_timed(lambda: target.forward(block, layer_ids)))
        target.rollback(context_len)
        if drafter is not None:
            draft.append(_timed(lambda: drafter.propose(context, block_size - 1, params, None)))
    decode_s = statistics.median(decode)
    result = {"context_len": context_len, "block_size": block_size, "decode_s": decode_s,
              "verify_s": statistics.median(verify), "r": statistics.median(verify) / decode_s}
    if draft:
        result.update(draft_s=statistics.median(draft), d=statistics.median(draft) / decode_s)
    return result
