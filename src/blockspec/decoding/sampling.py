"""Sampling parameters and the one place where logits become a distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else torch.seed())
        return generator


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [n, V] after temperature, top-k and top-p (params must not be greedy)."""
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token once the tokens ranked above it already reach top_p (keeps at least one).
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of `probs` [n, V] -> [n]."""
    return torch.multinomial(probs, 1, generator=generator).view(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The target's token from one row of logits [V]."""
    if params.greedy:
        return int(logits.argmax())
    return int(sample(warp_probs(logits.view(1, -1), params), generator)[0])
