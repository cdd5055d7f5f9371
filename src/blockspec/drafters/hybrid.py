"""Hybrid: a model drafter and prompt lookup behind one drafter; every step, per sequence,
the source expected to pay more drafts (the suffix-or-model choice of ArcticInference,
scored per request).

Each source is scored by its accepted drafts per proposal in THIS sequence (decayed, over
a prior of one token). How many tokens a proposal was worth is read from the committed
tokens: the longest prefix of the draft they repeat is exactly what the verifier accepted
(a rejected draft token is never the target's token). Prompt lookup costs nothing to ask,
so its continuation is scored every step, drafted or not, once the committed tokens decide
it (a token differs, or all of it came); the model's score moves only when it drafts.

Without a planner, lookup drafts when it has a continuation and scores at least the model;
otherwise the model drafts. With one (the default), both sources are offered every step in
that order (`next_sources`) and the planner drafts with the one of the best goodput by its
own per-source evidence and costs (the model's trees costed at their recent width; ties:
this order), else takes a plain step. Lookup's undrafted continuations reach the planner
as evidence too (`undrafted_outcomes`), so its rates follow the text being written rather
than freezing while the model or plain steps decode it (exact at T = 0, and in
distribution at T > 0: a one-hot draft token is accepted with the target's probability of
it, the probability that the sampled token is that token). Offering lookup as one source
per matched n-gram length was measured and did not pay (docs/benchmarks.md, session 9).

When a token tree is asked for and the model drafts, the lookup continuation (if any)
joins its tree as a branch, each of its tokens right with probability E / (1 + E) for
lookup's score E (a geometric run of that mean): the tree then spends nodes on it only
where it is likelier than the model's own paths.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from blockspec.decoding.draft import Draft, Drafter, DraftRequest
from blockspec.drafters.prompt_lookup import PromptLookupDrafter


@dataclass
class SourceScore:
    accepted: float = 1.0  # decayed accepted drafts, starting from a prior of one proposal worth one token
    proposals: float = 1.0

    def observe(self, accepted: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.proposals = decay * self.proposals + 1

    @property
    def expected(self) -> float:
        return self.accepted / self.proposals


def accepted_prefix(draft: torch.Tensor, committed_after_anchor: torch.Tensor) -> int:
    length = min(draft.numel(), committed_after_anchor.numel())
    same = (draft[:length] == committed_after_anchor[:length]).int()
    return int(same.cumprod(0).sum())


class HybridDrafter(Drafter):
    def __init__(self, model: Drafter, lookup: PromptLookupDrafter | None = None, decay: float = 0.8):
        self.model, self.lookup, self.decay = model, lookup or PromptLookupDrafter(), decay
        self.name = f"hybrid({model.name}+{self.lookup.name})"
        self.target_layer_ids = model.target_layer_ids
        self.max_block_size = model.max_block_size
        self.gives_candidates = model.gives_candidates
        self._reset_scores()

    def _reset_scores(self) -> None:
        self.scores = {"model": SourceScore(), "lookup": SourceScore()}
        self.last_source: str | None = None  # which source drafted the last proposal
        # proposals not scored yet, scored once the committed tokens decide them:
        # [anchor index, source, tokens proposed, whether they were drafted]
        self._pending: list[list] = []
        self._undrafted: list[tuple[str, int, int]] = []  # decided at the last `next_sources`
        # this step's choice, made by `next_sources`: (committed tokens, source, lookup's continuation)
        self._decided: tuple[int, str, torch.Tensor] | None = None

    def fork(self) -> "HybridDrafter":
        other = copy.copy(self)
        other.model = self.model.fork()
        other._reset_scores()
        return other

    def begin(self, prompt_ids, prompt_features) -> None:
        self._reset_scores()
        self.model.begin(prompt_ids, prompt_features)

    def accept(self, committed_ids, committed_features) -> None:
        self.model.accept(committed_ids, committed_features)  # the model's context, whoever drafted

    def _score_decided(self, token_ids: torch.Tensor) -> None:
        """Score every pending proposal the committed tokens now decide: a drafted one at the
        next step (its verdict was committed), an undrafted one once a token differs from it
        or all of it was committed."""
        self._undrafted, pending = [], []
        for anchor, source, tokens, drafted in self._pending:
            committed = token_ids[anchor + 1:]
            accepted = accepted_prefix(tokens, committed)
            if not drafted and accepted == committed.numel() < tokens.numel():
                pending.append([anchor, source, tokens, drafted])  # the target has not written that far yet
                continue
            self.scores[source].observe(accepted, self.decay)
            if not drafted:
                self._undrafted.append((source, tokens.numel(), accepted))
        self._pending = pending

    def undrafted_outcomes(self) -> list[tuple[str, int, int]]:
        """Lookup's continuations that were not drafted and that the committed tokens decided
        by the last `next_sources`: (source, tokens proposed, tokens the target then wrote)."""
        return self._undrafted

    def next_sources(self, token_ids: torch.Tensor) -> dict[str, int | None]:
        """Lookup (as many tokens as its continuation has) when it has a continuation, and
        the model; the one scoring higher first (ties: lookup, it is free). The decision
        and lookup's continuation are kept for this step's `propose`."""
        self._score_decided(token_ids)
        most = self.max_block_size - 1 if self.max_block_size else token_ids.numel()
        continuation = self.lookup.propose_one(DraftRequest(self, token_ids, most, None)).tokens
        if not continuation.numel():
            sources = {"model": None}
        elif self.scores["lookup"].expected >= self.scores["model"].expected:
            sources = {"lookup": continuation.numel(), "model": None}
        else:
            sources = {"model": None, "lookup": continuation.numel()}
        if continuation.numel():  # scored whether it drafts or not (`propose` marks it drafted)
            self._pending.append([token_ids.numel() - 1, "lookup", continuation, False])
        self._decided = (token_ids.numel(), next(iter(sources)), continuation)
        return sources

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(requests)
        continuations = []  # per request: lookup's continuation (empty: none)
        for i, request in enumerate(requests):
            fork: HybridDrafter = request.sequence
            if fork._decided is None or fork._decided[0] != request.token_ids.numel():
                fork.next_sources(request.token_ids)  # not planned: this drafter's own choice
            _, preferred, continuation = fork._decided
            fork._decided = None
            continuations.append(continuation[:request.num_drafts])
            source = request.source or preferred
            fork.last_source = source
            if source == "lookup":
                drafts[i] = Draft(tokens=continuations[i].clone())
                fork._pending[-1][2:] = [drafts[i].tokens, True]  # the entry `next_sources` added: now drafted
        by_model = [i for i, draft in enumerate(drafts) if draft is None]
        if by_model:  # every sequence the model drafts for, in one call (one pass where it can)
            inner = [DraftRequest(requests[i].sequence.model, requests[i].token_ids, requests[i].num_drafts,
                                  requests[i].params, requests[i].generator, requests[i].candidates)
                     for i in by_model]
            for i, draft in zip(by_model, self.model.propose(inner)):
                fork = requests[i].sequence
                if draft.candidates is not None and continuations[i].numel():
                    expected = fork.scores["lookup"].expected
                    right = min(max(expected / (1 + expected), 0.05), 0.95)
                    draft.candidates.branches.append((continuations[i], math.log(right)))
                drafts[i] = draft
                fork._pending.append([requests[i].token_ids.numel() - 1, "model", draft.tokens, True])
        return drafts
