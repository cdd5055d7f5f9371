"""The speculative decoding loop: one for every drafter.

prefill -> [draft B-1 tokens -> verify [anchor + drafts] in ONE target pass ->
accept the longest correct prefix -> commit it plus the target's bonus token ->
roll the target cache back to the last accepted draft] until a stop.

No drafter (or block size 1) is the plain autoregressive baseline through the
same code, so a speed ratio between the two measures drafting and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from blockspec.decoding.acceptance import accept_by_matching_samples, accept_greedy, accept_rejection_sampling
from blockspec.decoding.sampling import SamplingParams, TokenSampler, next_token
from blockspec.decoding.stats import GenerationStats
from blockspec.drafters.base import Draft, Drafter
from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import TargetAdapter

_NO_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))


class SpecEngine:
    def __init__(self, target: TargetAdapter, drafter: Drafter | None = None, block_size: int = 16):
        if block_size < 1:
            raise InvalidArgumentError(f"block size must be >= 1, got {block_size}")
        if drafter is not None and drafter.max_block_size is not None and block_size > drafter.max_block_size:
            raise InvalidArgumentError(
                f"block size {block_size} is larger than the drafter supports ({drafter.max_block_size})"
            )
        self.target = target
        self.drafter = drafter
        self.block_size = block_size if drafter is not None else 1

    def generate(
        self,
        prompt_ids: list[int] | torch.Tensor,
        *,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        stop_token_ids: tuple[int, ...] | None = None,
        stats: GenerationStats | None = None,
        logprobs: list | None = None,
        top_logprobs: int = 0,
    ) -> Iterator[list[int]]:
        """Yield committed tokens chunk by chunk (each chunk is final). Stops after an
        EOS/stop id (included, nothing after it) or `max_new_tokens` tokens.

        With a `logprobs` list, one entry per committed token is appended before its
        chunk is yielded: (log-probability of the token under the target's own
        distribution, [(id, log-probability)] of its `top_logprobs` best tokens)."""
        target, drafter = self.target, self.drafter
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1)
        max_new_tokens, stop_ids = check_request(target, prompt.numel(), max_new_tokens, stop_token_ids)
        stats = stats if stats is not None else GenerationStats(self.block_size)
        layer_ids = drafter.target_layer_ids if drafter is not None else ()
        # the drafter's own random choices (sampled drafts) and the target's (keyed by position)
        generator = None if params.greedy else params.generator()
        sampler = None if params.greedy else TokenSampler(params.seed)

        started = time.perf_counter()
        target.reset()
        out = target.forward(prompt, layer_ids)
        target.rollback(prompt.numel())  # trims sliding-window layers; removes nothing
        first = next_token(out.logits[-1], params, sampler, 0)
        if logprobs is not None:
            record_logprobs(logprobs, out.logits[-1:], [first], top_logprobs)
        if drafter is not None:
            drafter.begin(prompt, out.features)
        tokens = torch.cat([prompt, torch.tensor([first])])  # committed; the last one is the anchor
        first_done = time.perf_counter()
        stats.ttft_s = first_done - started
        stats.new_tokens = 1
        try:
            yield [first]
            if first in stop_ids:
                return
            while stats.new_tokens < max_new_tokens:
                # Never draft past max_new_tokens: accepted drafts + bonus <= what is left.
                num_drafts = min(self.block_size - 1, max_new_tokens - stats.new_tokens - 1)
                draft = drafter.propose(tokens, num_drafts, params, generator) if drafter and num_drafts else _NO_DRAFT
                num_drafts = draft.tokens.numel()
                verify_ids = torch.cat([tokens[-1:], draft.tokens])
                out = target.forward(verify_ids, layer_ids)
                accept_length, bonus = verify(out.logits, draft, params, sampler, stats.new_tokens)
                # The target keeps K/V of the anchor and the accepted drafts; the bonus
                # token has none yet: it is the next anchor, written by the next pass.
                target.rollback(tokens.numel() + accept_length)
                if drafter is not None:
                    kept = slice(0, accept_length + 1)
                    drafter.accept(verify_ids[kept], None if out.features is None else out.features[kept])
                new = committed_tokens(draft, accept_length, bonus, stop_ids)
                stats.record_step(num_drafts, accept_length)
                if logprobs is not None:  # row i of the verify pass is the target's distribution for new[i]
                    record_logprobs(logprobs, out.logits[: len(new)], new, top_logprobs)
                tokens = torch.cat([tokens, torch.tensor(new)])
                stats.new_tokens += len(new)
                yield new
                if new[-1] in stop_ids:
                    return
        finally:
            finished = time.perf_counter()
            stats.decode_s = finished - first_done
            stats.total_s = finished - started



def check_request(target, prompt_len: int, max_new_tokens: int, stop_token_ids=None) -> tuple[int, set[int]]:
    """What every decoding loop checks first: a non-empty prompt that fits the context and
    a positive budget. Returns the budget clipped to the context, and the stop ids
    (the target's EOS ids unless given)."""
    if prompt_len == 0:
        raise InvalidArgumentError("the prompt is empty")
    if prompt_len >= target.max_context:
        raise InvalidArgumentError(f"the prompt has {prompt_len} tokens; the target's context is {target.max_context}")
    if max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop_ids = set(target.eos_token_ids if stop_token_ids is None else stop_token_ids)
    return min(max_new_tokens, target.max_context - prompt_len), stop_ids


def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams, sampler: TokenSampler | None,
           position: int) -> tuple[int, int]:
    """The one verifier every engine uses: (accept_length, bonus token) for `draft` given the
    target's logits over [anchor, drafts]; `position` is the output position of the first
    token decided (the number of tokens generated so far)."""
    if params.greedy:
        return accept_greedy(logits, draft.tokens)
    if draft.probs is None:
        return accept_by_matching_samples(logits, draft.tokens, params, sampler, position)
    return accept_rejection_sampling(logits, draft.tokens, draft.probs, params, sampler, position)


def committed_tokens(draft: Draft, accept_length: int, bonus: int, stop_ids: set[int]) -> list[int]:
    """The accepted drafts plus the bonus token, cut after the first stop id."""
    new = draft.tokens[:accept_length].tolist() + [bonus]
    for index, token in enumerate(new):
        if token in stop_ids:
            return new[: index + 1]
    return new


def record_logprobs(sink: list, logits: torch.Tensor, tokens: list[int], top: int) -> None:
    """Append (log-probability of each token under the target, its `top` best alternatives)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    for row, token in zip(log_probs, tokens):
        best = row.topk(top) if top else None
        sink.append((float(row[token]), [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))))
