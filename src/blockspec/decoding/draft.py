"""The draft contract: what the engine asks of a drafting method, and what it gets back.

The engine owns it (as vLLM v1's engine owns its proposer metadata); drafters in
`blockspec.drafters` implement it and import it from here, never the reverse.

A drafter object holds weights; `fork()` gives one per sequence for its own state.
Per sequence: `begin` on the prompt, then every step `propose` (through a request
naming that sequence's fork) and, once the verifier has decided, `accept` of what the
target kept. One `propose` call serves any number of sequences: a drafter that can
draft them all in one pass does so; the default drafts them one by one.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from blockspec.decoding.sampling import SamplingParams
from blockspec.decoding.tree import Candidates


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] proposed token ids (k may be smaller than asked, even 0)
    # [k, V] the exact distribution each token was sampled from, or None for
    # one-hot (deterministic) proposals.
    probs: torch.Tensor | None = None
    # a token tree: node i's parent (-1: the anchor), parents first; None: a chain
    parents: list[int] | None = None
    # per-position candidates, when asked for (`DraftRequest.candidates`): what a tree is grown from
    candidates: Candidates | None = None


NO_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))


@dataclass
class DraftRequest:
    sequence: "Drafter"  # the fork holding this sequence's drafter state (its begin / accept)
    token_ids: torch.Tensor  # [n] every committed token, prompt included; the last is the anchor
    num_drafts: int  # propose at most this many tokens after the anchor
    params: SamplingParams
    generator: torch.Generator | None = None  # the drafter's own random stream (sampled drafts)
    candidates: int = 0  # > 0: also return this many best tokens per position (`Draft.candidates`)
    source: str | None = None  # the planner's pick among `Drafter.next_sources`; None: the drafter's own


class Drafter(ABC):
    """begin on the prompt -> propose a block -> learn what was accepted -> repeat."""

    name: str = "drafter"
    #: target layers whose hidden states the drafter reads (empty: none needed)
    target_layer_ids: tuple[int, ...] = ()
    #: the largest block (anchor + drafts) the drafter supports; None = any
    max_block_size: int | None = None
    #: whether it answers `DraftRequest.candidates` (per-position distributions, for trees)
    gives_candidates: bool = False

    @abstractmethod
    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        """Start a sequence: the prompt's ids [n] and its target features [n, F] (or None)."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request (the engine's only drafting call). Default: each sequence's
        fork on its own (`propose_one`); a drafter that drafts every sequence in one pass
        overrides this instead."""
        return [request.sequence.propose_one(request) for request in requests]

    def propose_one(self, request: DraftRequest) -> Draft:
        """Up to `request.num_drafts` tokens after the anchor, from this fork's state. A
        sampling drafter draws from `request.generator`."""
        raise NotImplementedError(f"{type(self).__name__} overrides neither propose nor propose_one")

    def next_sources(self, token_ids: torch.Tensor) -> dict[str, int | None]:
        """Asked of a sequence's fork before a planned step: the sources that could draft
        next, given every committed token, in this drafter's order of preference, each with
        the most tokens it has (None: as many as asked). The planner keeps acceptance
        evidence and drafting costs per source and picks one (`DraftRequest.source`): a
        drafter that switches between sources (the hybrid: prompt lookup, free and often
        long, or the model, which must earn its pass) is planned by the rates of each."""
        return {"model": None}

    def undrafted_outcomes(self) -> list[tuple[str, int, int]]:
        """Asked right after `next_sources`: proposals of a source that costs nothing to ask
        (the hybrid's prompt lookup) made at earlier steps and NOT drafted, which the
        committed tokens have now decided: (source, tokens proposed, how many of them the
        target then wrote). The planner counts each as if it had been drafted (exact at
        T = 0, and in distribution at T > 0 for one-hot drafts), so a free source's rate
        follows the text even while another source or plain steps decode it. Default: none."""
        return []

    def fork(self) -> "Drafter":
        """A drafter for another sequence, sharing weights but not per-sequence state. Default:
        a shallow copy, fine for drafters whose `begin` rebinds all their state."""
        return copy.copy(self)

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        """The verifier kept `committed_ids` (anchors and accepted drafts, which now have
        target K/V) with their target features. Default: nothing to update."""
