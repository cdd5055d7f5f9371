"""The Drafter interface: the only thing the engine knows about a drafting method."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.decoding.sampling import SamplingParams, sample, warp_probs


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] proposed token ids (k may be smaller than asked, even 0)
    # [k, V] the exact distribution each token was sampled from, or None for
    # one-hot (deterministic) proposals.
    probs: torch.Tensor | None = None


def bind_to_target(model: torch.nn.Module, target) -> torch.nn.Module:
    """The drafter's weights on the target's device and dtype, in eval mode, WITHOUT changing
    the module given: `nn.Module.to` converts in place, so a trainer handing its fp32 model to
    a drafter for a held-out eval on a bf16 GPU target would silently train in bf16 after it."""
    parameter = next(model.parameters(), None)
    if parameter is not None and (parameter.device != target.device or parameter.dtype != target.dtype):
        model = copy.deepcopy(model).to(device=target.device, dtype=target.dtype)
    elif model.training:
        model = copy.deepcopy(model)
    return model.eval()


class Drafter(ABC):
    """begin on the prompt -> propose a block -> learn what was accepted -> repeat."""

    name: str = "drafter"
    #: target layers whose hidden states the drafter reads (empty: none needed)
    target_layer_ids: tuple[int, ...] = ()
    #: the largest block (anchor + drafts) the drafter supports; None = any
    max_block_size: int | None = None

    @abstractmethod
    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        """Start a sequence: the prompt's ids [n] and its target features [n, F] (or None)."""

    @abstractmethod
    def propose(
        self, token_ids: torch.Tensor, num_drafts: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Propose up to `num_drafts` tokens after `token_ids` (all committed tokens; the last
        is the anchor). A sampling drafter draws from `generator`, the engine's one stream."""

    def fork(self) -> "Drafter":
        """A drafter for another sequence, sharing weights but not per-sequence state (the
        batched engine keeps one per row). Default: a shallow copy, fine for drafters whose
        `begin` rebinds all their state."""
        return copy.copy(self)

    def propose_many(self, forks: list["Drafter"], requests: list[tuple]) -> list[Draft]:
        """Drafts for several sequences at once (the batched engine): `forks[i]` (a fork of
        this drafter) proposes for `requests[i]` = (token_ids, num_drafts, params, generator),
        the arguments of `propose`. Default: one by one; a drafter that can draft every
        sequence in one pass overrides it."""
        return [fork.propose(*request) for fork, request in zip(forks, requests)]

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        """The verifier kept `committed_ids` (the anchor and the accepted drafts, which now
        have target K/V) with their target features. Default: nothing to update."""


class TokenPicker:
    """The choices of a draft made one token at a time (MTP, EAGLE-3, a draft model): the
    argmax at T=0, else a sample from the drafter's warped distribution, whose rows the
    rejection sampler needs. `d2t` maps a reduced draft vocabulary to target ids."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, vocab_size: int,
                 d2t: torch.Tensor | None = None):
        self.params, self.generator, self.vocab_size, self.d2t = params, generator, vocab_size, d2t
        self.tokens: list[int] = []
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> int:
        """Choose from `logits` [1, V'] (draft vocabulary); returns the TARGET id."""
        if self.params.greedy:
            choice = logits.argmax(-1)
        else:
            probs = warp_probs(logits.float(), self.params)
            self.rows.append(probs[0])
            choice = sample(probs, self.generator)
        token = int(choice[0] if self.d2t is None else self.d2t[choice[0]])
        self.tokens.append(token)
        return token

    def draft(self) -> Draft:
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        if self.params.greedy or not self.rows:
            return Draft(tokens=tokens)
        probs = on_target_vocabulary(torch.stack(self.rows), self.vocab_size, self.d2t)
        return Draft(tokens=tokens, probs=probs.cpu())


def stack_padded(states: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence K or V [1, heads, n_i, d] -> [rows, heads, max n_i, d], zero-padded at the
    end of each row (a mask must hide the padding); one row is returned as it is."""
    if len(states) == 1:
        return states[0]
    longest = max(state.shape[2] for state in states)
    return torch.cat([F.pad(state, (0, 0, 0, longest - state.shape[2])) for state in states])


def on_target_vocabulary(probs: torch.Tensor, vocab_size: int, d2t: torch.Tensor | None = None) -> torch.Tensor:
    """A draft distribution [k, V'] as one over the target's vocabulary [k, V] (zero where the
    drafter cannot propose): what rejection sampling needs. `d2t` maps a reduced draft
    vocabulary to target ids; without it the first V' ids are the drafter's."""
    if d2t is not None:
        return torch.zeros(probs.shape[0], vocab_size, dtype=probs.dtype, device=probs.device).index_copy_(1, d2t, probs)
    if probs.shape[1] < vocab_size:
        return torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[1]))
    return probs
