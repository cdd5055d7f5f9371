"""Sampling parameters and the one place where logits become a distribution."""

from __future__ import annotations

import secrets
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
    logits = logits.float()
    # shifted so that the best score is exactly 0 before dividing: a tiny temperature (1e-37)
    # then sends the others to -inf (probability 0), never to inf - inf (NaN)
    scores = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
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


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit hash of a 64-bit value."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class TokenSampler:
    """The target's random choices for one request, keyed by OUTPUT POSITION: the token at
    position p (0 = the first new token) is drawn by inverse CDF from a uniform that depends
    on (seed, p) alone. How many drafts a step verified, which rows shared the batch or
    whether a step drafted at all never changes which random number decides a token, so a
    seeded request gives the same text alone, batched, or with any drafter (with one-hot
    drafts, match-the-sample commits exactly the token plain sampling draws). A uniform
    looked at for a position that was not committed (past a rejection) influenced nothing
    committed, so drawing it again later keeps every committed choice independent."""

    def __init__(self, seed: int | None = None):
        self.seed = seed if seed is not None else secrets.randbits(63)

    def uniforms(self, first_position: int, count: int, stream: int = 0) -> torch.Tensor:
        """[count] float64 uniforms in (0, 1) for positions first_position.. (independent streams)."""
        return self.uniforms_at(range(first_position, first_position + count), stream)

    def uniforms_at(self, positions, stream: int = 0) -> torch.Tensor:
        """The uniforms of the given output positions (a tree's nodes share one per depth)."""
        values = []
        for position in positions:
            bits = _mix64(_mix64(_mix64(self.seed & _MASK64) ^ position) ^ stream)
            values.append(((bits >> 11) + 0.5) / float(1 << 53))
        return torch.tensor(values, dtype=torch.float64)

    def sample(self, probs: torch.Tensor, first_position: int, stream: int = 0, positions=None) -> torch.Tensor:
        """One token id per row of `probs` [n, V]; row i is output position first_position + i,
        or `positions[i]` when given."""
        cdf = probs.double().cumsum(-1)
        if positions is None:
            positions = range(first_position, first_position + probs.shape[0])
        thresholds = self.uniforms_at(positions, stream).to(cdf.device) * cdf[:, -1]
        # the first token whose cumulative mass reaches the threshold (> 0): never a zero-probability one
        picks = torch.searchsorted(cdf, thresholds[:, None]).view(-1)
        return picks.clamp_max(probs.shape[-1] - 1)


def next_token(logits: torch.Tensor, params: SamplingParams, sampler: TokenSampler | None, position: int) -> int:
    """The target's token at output `position` from one row of logits [V]."""
    if params.greedy:
        return int(logits.argmax())
    return int(sampler.sample(warp_probs(logits.view(1, -1), params), position)[0])
