"""Standalone diffusion decoding with a DFlash drafter: fast, and NOT lossless.

No verification. Block by block: the block starts as [anchor, MASK x (B-1)] and the
drafter fills it, either in one pass (steps = 1) or by unmasking over several passes
the positions it is most confident about (MDLM / LLaDA style; with a confidence
threshold, every position above it is unmasked at once, Fast-dLLM style, at least one
per pass). The committed block then goes through the target ONCE (one pass per block,
not per token) only to give the drafter its context features for the next block.

That same pass yields, for free, how often the target would have chosen each
committed token itself (`agreement`): the quality measure reported next to the speed.
The output is the drafter's, not the target's; callers must say so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.sampling import SamplingParams, sample, warp_probs
from blockspec.decoding.verify import cut_after_stop
from blockspec.errors import InvalidArgumentError


@dataclass
class DiffusionStats:
    block_size: int
    blocks: int = 0  # target passes after the prefill (one per committed block)
    drafter_passes: int = 0
    new_tokens: int = 0
    agreed: int = 0  # committed tokens the target would also have chosen greedily
    checked: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0

    @property
    def agreement(self) -> float:
        return self.agreed / self.checked if self.checked else 1.0

    def as_dict(self) -> dict:
        return {"lossless": False, "blocks": self.blocks, "drafter_passes": self.drafter_passes,
                "new_tokens": self.new_tokens, "agreement_with_target": round(self.agreement, 4),
                "ttft_s": round(self.ttft_s, 5),
                "tokens_per_s": round(self.new_tokens / max(self.ttft_s + self.decode_s, 1e-9), 3)}


def unmask_order(confidence: torch.Tensor, masked: torch.Tensor, passes_left: int,
                 threshold: float | None) -> torch.Tensor:
    """Positions to unmask in this pass: those above `threshold` (when given), else the
    ceil(masked / passes_left) most confident ones; always at least one, never an unmasked one."""
    candidates = masked.nonzero().view(-1)
    scores = confidence[candidates]
    if threshold is not None:
        chosen = candidates[scores >= threshold]
        if chosen.numel():
            return chosen
        return candidates[scores.argmax()].view(1)
    count = math.ceil(candidates.numel() / max(passes_left, 1))
    return candidates[scores.topk(count).indices]


class DiffusionDecoder:
    def __init__(self, target, drafter, block_size: int | None = None, steps: int = 1,
                 threshold: float | None = None):
        if not hasattr(drafter, "block_logits"):
            raise InvalidArgumentError("diffusion mode needs a DFlash drafter")
        block_size = block_size or drafter.max_block_size
        if not 2 <= block_size <= drafter.max_block_size:
            raise InvalidArgumentError(f"block size must be in 2..{drafter.max_block_size}, got {block_size}")
        if steps < 1 or steps > block_size - 1:
            raise InvalidArgumentError(f"diffusion steps must be in 1..{block_size - 1}, got {steps}")
        if threshold is not None and not 0 < threshold <= 1:
            raise InvalidArgumentError(f"confidence threshold must be in (0, 1], got {threshold}")
        self.target, self.drafter = target, drafter
        self.block_size, self.steps, self.threshold = block_size, steps, threshold

    @torch.inference_mode()
    def fill_block(self, drafter, anchor: int, start: int, length: int, params: SamplingParams, generator,
                   stats: DiffusionStats | None = None) -> list[int]:
        """`length` tokens after `anchor` (at position `start`), filled from all-masked by
        `drafter` (a fork of this decoder's drafter, begun on the sequence)."""
        mask_id = drafter.mask_token_id
        block = torch.full((length + 1,), mask_id, dtype=torch.long)
        block[0] = anchor
        masked = torch.ones(length, dtype=torch.bool)
        passes = self.steps if self.threshold is None else length
        for done in range(passes):
            logits = drafter.block_logits(block, start)
            if stats is not None:
                stats.drafter_passes += 1
            if params.greedy:
                probs = torch.softmax(logits, dim=-1)
                confidence, choice = probs.max(dim=-1)
            else:
                probs = warp_probs(logits, params)
                choice = sample(probs, generator)
                confidence = probs.gather(1, choice[:, None]).view(-1)
            positions = unmask_order(confidence, masked, passes - done, self.threshold)
            block[1 + positions] = drafter.to_target_ids(choice[positions]).cpu()
            masked[positions] = False
            if not masked.any():
                break
        return block[1:].tolist()

    @torch.inference_mode()
    def generate(self, prompt_ids, *, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 stop_token_ids: tuple[int, ...] | None = None,
                 stats: DiffusionStats | None = None) -> Iterator[list[int]]:
        """Yield committed chunks (one per block) until a stop id or `max_new_tokens`. The
        prefill, the first token (the target's own, as in speculative decoding) and the
        commit rules are the speculative engine's; only the step differs."""
        stats = stats if stats is not None else DiffusionStats(self.block_size)
        engine = SpecEngine(self.target, self.drafter, self.block_size)
        chunks: list[list[int]] = []
        row = engine.add(prompt_ids, max_new_tokens=max_new_tokens, params=params, stop_token_ids=stop_token_ids,
                         on_chunk=chunks.append)
        try:
            engine.admit()
            if row.error is not None:
                raise row.error
            stats.ttft_s, stats.new_tokens = row.stats.ttft_s, row.stats.new_tokens
            first_done = time.perf_counter()
            yield from chunks
            while not row.ended:
                length = min(self.block_size - 1, row.tokens_left)
                new = cut_after_stop(self.fill_block(row.drafter, row.tokens[-1], len(row.tokens) - 1, length,
                                                     params, row.generator, stats), row.stop_ids)
                # One target pass over the anchor and the new tokens but the last (the next
                # anchor): the drafter's context for the next block, and the agreement check.
                ran = [row.tokens[-1]] + new[:-1]
                logits, features = engine.kv.verify([ran])
                engine.kv.keep(0, len(row.tokens) + len(new) - 1)
                greedy_choice = logits[0].argmax(dim=-1).tolist()
                stats.checked += len(new)
                stats.agreed += sum(int(a == b) for a, b in zip(greedy_choice, new))
                stats.blocks += 1
                row.drafter.accept(torch.tensor(ran), None if features is None else features[0])
                chunks.clear()
                engine.commit_chunk(row, new, logits[0])
                stats.new_tokens = row.stats.new_tokens
                stats.decode_s = time.perf_counter() - first_done
                yield from chunks
        finally:
            engine.reset()
