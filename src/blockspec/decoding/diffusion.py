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

from blockspec.decoding.engine import check_request
from blockspec.decoding.sampling import SamplingParams, TokenSampler, next_token, sample, warp_probs
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
    def fill_block(self, anchor: int, start: int, length: int, params: SamplingParams, generator,
                   stats: DiffusionStats | None = None) -> list[int]:
        """`length` tokens after `anchor` (at position `start`), filled from all-masked."""
        mask_id = self.drafter.mask_token_id
        block = torch.full((length + 1,), mask_id, dtype=torch.long)
        block[0] = anchor
        masked = torch.ones(length, dtype=torch.bool)
        passes = self.steps if self.threshold is None else length
        for done in range(passes):
            logits = self.drafter.block_logits(block, start)
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
            block[1 + positions] = self.drafter.to_target_ids(choice[positions]).cpu()
            masked[positions] = False
            if not masked.any():
                break
        return block[1:].tolist()

    def generate(self, prompt_ids, *, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 stop_token_ids: tuple[int, ...] | None = None,
                 stats: DiffusionStats | None = None) -> Iterator[list[int]]:
        """Yield committed chunks (one per block) until a stop id or `max_new_tokens`."""
        target, drafter = self.target, self.drafter
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1)
        max_new_tokens, stop_ids = check_request(target, prompt.numel(), max_new_tokens, stop_token_ids)
        stats = stats if stats is not None else DiffusionStats(self.block_size)
        generator = None if params.greedy else params.generator()
        layer_ids = drafter.target_layer_ids
        started = time.perf_counter()
        target.reset()
        out = target.forward(prompt, layer_ids)
        target.rollback(prompt.numel())
        sampler = None if params.greedy else TokenSampler(params.seed)
        first = next_token(out.logits[-1], params, sampler, 0)  # the target's own, as in speculative decoding
        drafter.begin(prompt, out.features)
        tokens = prompt.tolist() + [first]
        stats.new_tokens = 1
        first_done = time.perf_counter()
        stats.ttft_s = first_done - started
        try:
            yield [first]
            if first in stop_ids:
                return
            while stats.new_tokens < max_new_tokens:
                length = min(self.block_size - 1, max_new_tokens - stats.new_tokens)
                new = self.fill_block(tokens[-1], len(tokens) - 1, length, params, generator, stats)
                for index, token in enumerate(new):
                    if token in stop_ids:
                        new = new[: index + 1]
                        break
                stats.new_tokens += len(new)
                ended = new[-1] in stop_ids or stats.new_tokens >= max_new_tokens
                # One target pass over the anchor and all committed tokens but the new
                # anchor: the drafter's context for the next block, and the agreement check.
                ran = [tokens[-1]] + new[:-1]
                out = target.forward(torch.tensor(ran), layer_ids)
                target.rollback(len(tokens) + len(new) - 1)
                greedy_choice = out.logits.argmax(dim=-1).tolist()
                stats.checked += len(new)
                stats.agreed += sum(int(a == b) for a, b in zip(greedy_choice, new))
                stats.blocks += 1
                drafter.accept(torch.tensor(ran), out.features)
                tokens += new
                yield new
                if ended:
                    return
        finally:
            stats.decode_s = time.perf_counter() - first_done
