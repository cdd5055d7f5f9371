"""The speculative decoding loop: one step for every drafter, every batch size.

    step(rows): admit -> plan -> propose -> verify -> commit

- admit: prefill each waiting sequence, sample its first token, `begin` its drafter.
- plan: how many tokens each row drafts (a fixed block, or the goodput planner's choice,
  down to none: a plain step) and, for a drafter with several sources (the hybrid), which
  source drafts them (`Drafter.next_sources`; the planner keeps evidence per source).
- propose: every drafting row's draft in one drafter call (one pass where the drafter can).
  With a tree budget, the drafter's per-position candidates grow a token tree per row
  (`tree.py`), cut to the node count the planner chooses (or the budget).
- verify: [anchor, drafts] of every row through the target in ONE pass (`TargetKV`; a tree
  at depth positions under an ancestor-only mask).
- commit: per row, the accepted drafts (a chain's longest correct prefix, a tree's path
  the target walks) plus the target's bonus token; the target cache keeps the anchor and
  the accepted drafts (the bonus is the next anchor), the drafter gets their features.

One request is a batch of one (as in vLLM v1): `generate` streams one sequence over the
same step. No drafter (or block size 1) is the plain autoregressive baseline through the
same code, so a speed ratio between the two measures drafting and nothing else.

A row's drafter is only shown what was committed when it drafts next (the ids and
features wait), so plain steps cost no drafter work. A row that fails (its prefill, its
sampling, its callbacks) fails alone: its `error` is set and the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from blockspec.decoding.draft import NO_DRAFT, Draft, DraftRequest, Drafter
from blockspec.decoding.planner import AcceptanceEvidence, DraftPlanner
from blockspec.decoding.sampling import SamplingParams, TokenSampler, next_token
from blockspec.decoding.stats import GenerationStats
from blockspec.decoding.tree import build_tree, check_budget, committed_depth, depths
from blockspec.decoding.verify import cut_after_stop, record_logprobs, verify
from blockspec.errors import InvalidArgumentError
from blockspec.targets.kv import SingleSequenceKV, SlotKV, TargetKV


@dataclass
class Row:
    """One sequence being decoded."""

    tokens: list[int]  # committed, prompt included; the last one is the anchor
    max_new_tokens: int
    params: SamplingParams
    stop_ids: set[int]
    on_chunk: Callable[[list[int]], None]  # receives each committed chunk
    on_done: Callable[[GenerationStats], None]
    stats: GenerationStats
    logprobs: list | None = None  # one (logprob, top alternatives) per committed token, when asked
    top_logprobs: int = 0
    drafter: Drafter | None = None  # this sequence's fork
    generator: torch.Generator | None = None  # the drafter's random choices (sampled drafts)
    sampler: TokenSampler | None = None  # the target's, keyed by output position
    source: str | None = None  # the drafter's source the planner picked this step (`Drafter.next_sources`)
    evidence: dict[str, AcceptanceEvidence] = field(default_factory=dict)  # per source, for the planner
    # committed since the drafter last saw the sequence: shown to it when it drafts next
    unseen_ids: list = field(default_factory=list)
    unseen_features: list = field(default_factory=list)
    # trees the planner cut to no node after the drafter ran, not scored yet: (anchor index,
    # source, the tree as the plan sized it: tokens, parents)
    withdrawn: list = field(default_factory=list)
    cancelled: bool = False
    error: Exception | None = None  # set when this row failed on its own
    decode_started: float = 0.0

    def decided_withdrawn(self) -> list[tuple[str, int, int]]:
        """The withdrawn trees that the committed tokens now decide, as (source, the tree's
        depth, how deep the target's tokens ran along it); the rest stay until decided."""
        decided, pending = [], []
        for anchor, source, tokens, parents in self.withdrawn:
            accepted, done = committed_depth(tokens, parents, self.tokens[anchor + 1:])
            if done:
                decided.append((source, max(depths(parents)), accepted))
            else:
                pending.append((anchor, source, tokens, parents))
        self.withdrawn = pending
        return decided

    def evidence_for(self, source: str) -> AcceptanceEvidence:
        if source not in self.evidence:
            self.evidence[source] = AcceptanceEvidence(source=source)
        return self.evidence[source]

    @property
    def acceptance(self) -> AcceptanceEvidence:
        """The planner's evidence on the source that drafts this step."""
        return self.evidence_for(self.source or "model")

    @property
    def tokens_left(self) -> int:
        return self.max_new_tokens - self.stats.new_tokens

    def catch_up_drafter(self) -> None:
        """Show the drafter what was committed since it last drafted, in one call."""
        if self.unseen_ids:
            self.drafter.accept(torch.cat(self.unseen_ids), torch.cat(self.unseen_features) if self.unseen_features else None)
            self.unseen_ids, self.unseen_features = [], []

    @property
    def ended(self) -> bool:
        return self.tokens[-1] in self.stop_ids or self.tokens_left <= 0


TREE_TOP_K = 8  # candidates per draft position a tree is grown from


class SpecEngine:
    def __init__(self, target, drafter: Drafter | None = None, block_size: int = 16, *, max_batch: int = 1,
                 adaptive: bool = False, planner: DraftPlanner | None = None, tree_budget: int | None = None):
        """`block_size`: anchor + most drafts per step (a tree's most depth). `max_batch`: rows
        decoded together (1: the single-sequence cache, which also serves sliding-window
        targets). `adaptive`: each step's draft counts (and tree sizes) come from `planner`
        (a new DraftPlanner if None), down to none; otherwise every row drafts a full block
        (a tree of `tree_budget` nodes) every step. `tree_budget`: draft token trees of at
        most this many nodes per row, when the drafter gives per-position candidates and
        the target's cache can hold a tree (else chains, said in every row's stats.notes)."""
        if block_size < 1:
            raise InvalidArgumentError(f"block size must be >= 1, got {block_size}")
        if drafter is not None and drafter.max_block_size is not None and block_size > drafter.max_block_size:
            raise InvalidArgumentError(
                f"block size {block_size} is larger than the drafter supports ({drafter.max_block_size})")
        if max_batch < 1:
            raise InvalidArgumentError(f"max batch must be >= 1, got {max_batch}")
        self.target, self.drafter = target, drafter
        self.block_size = block_size if drafter is not None else 1
        self.max_batch = max_batch
        self.planner = (planner or DraftPlanner(self.block_size - 1)) if adaptive and drafter is not None else None
        self.layer_ids = drafter.target_layer_ids if drafter is not None else ()
        self.notes: list[str] = []  # what runs differently from what was asked (copied to every row's stats)
        self.tree_budget = None
        if tree_budget is not None and drafter is not None:
            check_budget(tree_budget, target.max_context)
            if drafter.gives_candidates:
                self.tree_budget = tree_budget
            else:
                self.notes.append(f"trees: the {drafter.name} drafter gives no per-position distributions; chains")
        if max_batch > 1:
            self.kv: TargetKV = SlotKV(target, self.layer_ids)
        elif self.tree_budget is not None:
            try:  # one row on the slot cache: the one that verifies trees
                self.kv = SlotKV(target, self.layer_ids)
            except InvalidArgumentError as why:
                self.tree_budget = None
                self.notes.append(f"trees: {why}; chains")
                self.kv = SingleSequenceKV(target, self.layer_ids)
        else:
            self.kv = SingleSequenceKV(target, self.layer_ids)
        self.rows: list[Row] = []
        self.waiting: list[Row] = []

    # --- requests -------------------------------------------------------------------------
    def add(self, prompt_ids, *, max_new_tokens: int, on_chunk=None, on_done=None,
            params: SamplingParams = SamplingParams(), stop_token_ids=None, logprobs: list | None = None,
            top_logprobs: int = 0, stats: GenerationStats | None = None) -> Row:
        """Queue a sequence; it is prefilled at the next step. Bad requests raise here."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1).tolist()
        max_new_tokens, stop_ids = check_request(self.target, len(prompt), max_new_tokens, stop_token_ids)
        row = Row(prompt, max_new_tokens, params, stop_ids, on_chunk or (lambda chunk: None),
                  on_done or (lambda stats: None), stats if stats is not None else GenerationStats(self.block_size),
                  logprobs=logprobs, top_logprobs=top_logprobs)
        row.stats.notes += [note for note in self.notes if note not in row.stats.notes]
        self.waiting.append(row)
        return row

    def generate(self, prompt_ids, *, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 stop_token_ids: tuple[int, ...] | None = None, stats: GenerationStats | None = None,
                 logprobs: list | None = None, top_logprobs: int = 0) -> Iterator[list[int]]:
        """One sequence, a batch of one: yield committed tokens chunk by chunk (each chunk is
        final). Stops after an EOS/stop id (included, nothing after it) or `max_new_tokens`.
        With a `logprobs` list, one entry per committed token is appended before its chunk is
        yielded: (log-probability under the target's own distribution, [(id, log-probability)]
        of its `top_logprobs` best tokens)."""
        if self.busy:
            raise InvalidArgumentError("generate needs an idle engine (use add/step for many sequences)")
        chunks: list[list[int]] = []
        row = self.add(prompt_ids, max_new_tokens=max_new_tokens, on_chunk=chunks.append, params=params,
                       stop_token_ids=stop_token_ids, logprobs=logprobs, top_logprobs=top_logprobs, stats=stats)
        try:
            self.admit()  # the first token streams as soon as the prefill is done
            while True:
                if row.error is not None:
                    raise row.error
                yield from chunks
                chunks.clear()
                if not self.busy:
                    return
                self.step()
        finally:  # closed early (or failed): the row leaves and the engine is idle again
            row.cancelled = True
            self.drop_cancelled_rows()
            self.waiting.clear()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def run(self) -> None:
        while self.busy:
            self.step()

    def reset(self) -> None:
        """Drop every row and the cache (after a failed step: start clean)."""
        self.rows, self.waiting = [], []
        self.kv.reset()

    # --- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Admit waiting sequences, then one draft + verify step for every row."""
        self.drop_cancelled_rows()
        self.admit()
        if not self.rows:
            return
        started = time.perf_counter()
        token_ids = [torch.tensor(row.tokens) for row in self.rows]  # once per step: plan and propose read them
        plan = self._plan(token_ids)
        drafts = self._propose(plan, token_ids)
        predicted = self._grow_trees(drafts, plan) if self.tree_budget is not None else [None] * len(drafts)
        drafting_seconds = time.perf_counter() - started
        blocks = [[row.tokens[-1]] + draft.tokens.tolist() for row, draft in zip(self.rows, drafts)]
        trees = [draft.parents for draft in drafts]
        logits, features = self.kv.verify(blocks, trees if any(tree is not None for tree in trees) else None)
        finished = []
        for i, (row, draft) in enumerate(zip(self.rows, drafts)):
            try:
                self._commit(i, row, draft, logits[i, :len(blocks[i])],
                             None if features is None else features[i, :len(blocks[i])], predicted[i])
                if row.ended:
                    finished.append(i)
            except Exception as error:  # this row alone fails (its sampling, its callbacks); the rest go on
                row.error = error
                finished.append(i)
        if self.planner is not None:  # drafting's cost includes the catch-up of the drafting rows
            width = max(len(block) for block in blocks)
            drafting_rows = [row.source for row, count in zip(self.rows, plan) if count]
            self.planner.record(len(blocks) * width, time.perf_counter() - started - drafting_seconds,
                                len(drafting_rows) * width, drafting_seconds,
                                drafting_rows[0] if len(set(drafting_rows)) == 1 else None)
        for i in reversed(finished):
            self._finish(i)

    @torch.inference_mode()
    def admit(self) -> None:
        """Prefill waiting sequences while there is room: each gets its first token."""
        while self.waiting and len(self.rows) < self.max_batch:
            row = self.waiting.pop(0)
            if row.cancelled:  # left before it started: it still ends, with nothing generated
                row.on_done(row.stats)
                continue
            try:
                self._prefill(row)
            except Exception as error:  # this row fails alone; the batch goes on
                row.error = error
                if row in self.rows:
                    self._finish(self.rows.index(row))
                else:
                    row.on_done(row.stats)

    def _prefill(self, row: Row) -> None:
        started = time.perf_counter()
        row.generator = None if row.params.greedy else row.params.generator()
        row.sampler = None if row.params.greedy else TokenSampler(row.params.seed)
        prompt = torch.tensor(row.tokens)
        logits, features = self.kv.prefill(prompt)
        try:
            first = next_token(logits, row.params, row.sampler, 0)
            if self.drafter is not None:
                row.drafter = self.drafter.fork()
                row.drafter.begin(prompt, features)
        except Exception:
            self.kv.drop(len(self.rows))  # the row the prefill added: the batch is as it was
            raise
        self.rows.append(row)
        row.stats.ttft_s = time.perf_counter() - started
        row.decode_started = time.perf_counter()
        self.commit_chunk(row, [first], logits[None])
        if row.ended:
            self._finish(len(self.rows) - 1)

    def _plan(self, token_ids: list[torch.Tensor]) -> list[int]:
        # never draft past max_new_tokens: accepted drafts + bonus <= what is left
        allowed = [min(self.block_size - 1, row.tokens_left - 1) if row.drafter is not None else 0
                   for row in self.rows]
        if self.planner is None:
            return allowed
        offers = []
        for row, count, ids in zip(self.rows, allowed, token_ids):
            if row.drafter is None:
                offers.append(None)
                continue
            sources = row.drafter.next_sources(ids)
            # evidence from proposals that were not verified: a free source's continuations
            # (the drafter's), and drafts whose tree was cut to nothing (else a source whose trees
            # keep being cut never learns its rates fell, and keeps being planned, paying its pass)
            for source, proposed, accepted in row.drafter.undrafted_outcomes() + row.decided_withdrawn():
                self.planner.observe(row.evidence_for(source), proposed, accepted)
            offers.append({source: (row.evidence_for(source), count if most is None else min(count, most))
                           for source, most in sources.items()} or None)
        sources, counts = self.planner.plan_sources(offers)
        for row, source in zip(self.rows, sources):
            row.source = source
        return counts

    def _propose(self, plan: list[int], token_ids: list[torch.Tensor]) -> list[Draft]:
        drafting = [i for i, count in enumerate(plan) if count]
        drafts = [NO_DRAFT] * len(self.rows)
        if not drafting:
            return drafts
        requests = []
        candidates = TREE_TOP_K if self.tree_budget is not None else 0
        for i in drafting:
            row = self.rows[i]
            row.catch_up_drafter()
            requests.append(DraftRequest(row.drafter, token_ids[i], plan[i], row.params, row.generator,
                                         candidates, row.source))
        for i, draft in zip(drafting, self.drafter.propose(requests)):
            drafts[i] = draft
        return drafts

    def _grow_trees(self, drafts: list[Draft], plan: list[int]) -> list[float | None]:
        """Replace every draft that came with candidates by its token tree (in place), all cut
        to one node count: the budget, or the planner's choice (0: a plain step). Returns the
        expected accepted drafts of each tree (None for the rest), for the planner."""
        grown = {i: build_tree(draft.candidates, self.tree_budget, plan[i])
                 for i, draft in enumerate(drafts) if draft.candidates is not None}
        predicted: list[float | None] = [None] * len(drafts)
        if not grown:
            return predicted
        size = self.tree_budget
        if self.planner is not None:
            size = self.planner.tree_size(len(self.rows), [self.planner.tree_gains(self.rows[i].acceptance, tree)
                                                           for i, tree in grown.items()])
        for i, tree in grown.items():
            tree = tree.first(size)
            if not len(tree):
                planned = grown[i].first(plan[i])  # what the plan expected to verify
                if len(planned):
                    row = self.rows[i]
                    row.withdrawn.append((len(row.tokens) - 1, row.source or "model", planned.tokens, planned.parents))
                drafts[i] = NO_DRAFT
                continue
            drafts[i] = Draft(torch.tensor(tree.tokens, dtype=torch.long), parents=tree.parents)
            predicted[i] = tree.expected_accepted()[-1]
        return predicted

    def _commit(self, i: int, row: Row, draft: Draft, logits: torch.Tensor, features: torch.Tensor | None,
                predicted: float | None = None) -> None:
        """Row i's verdict on its draft, given the target's `logits` [1 + k, V] over its block."""
        drafted = draft.tokens.numel()
        path, bonus = verify(logits, draft, row.params, row.sampler, row.stats.new_tokens)
        accept_length = len(path)
        # The target keeps K/V of the anchor and the accepted drafts; the bonus token has
        # none yet: it is the next anchor, written by the next pass.
        kept = [0] + [1 + node for node in path]  # block positions
        self.kv.keep(i, len(row.tokens) + accept_length, kept if draft.parents is not None else None)
        accepted = draft.tokens[path].tolist()
        if row.drafter is not None:
            row.unseen_ids.append(torch.tensor([row.tokens[-1]] + accepted))
            if features is not None:  # a copy: a view would keep the whole batch's features alive
                row.unseen_features.append(features[kept].clone())
        # a tree's depth plays a chain's length: the draft positions the step could accept
        depth = max(depths(draft.parents)) if draft.parents else drafted
        row.stats.record_step(depth, accept_length)
        if draft.parents is not None:
            row.stats.tree_steps += 1
            row.stats.tree_nodes += drafted
        if self.planner is not None:
            for evidence in row.evidence.values():
                self.planner.age(evidence)
            if drafted:
                self.planner.observe(row.acceptance, depth, accept_length, predicted,
                                     drafted if draft.parents is not None else None)
            if row.source is not None:  # planned to draft: did anything of it reach the verify?
                self.planner.observe_drafting(row.acceptance, wasted=not drafted)
        self.commit_chunk(row, accepted + [bonus], logits[kept])

    @staticmethod
    def commit_chunk(row: Row, new: list[int], logits: torch.Tensor) -> None:
        """Append `new` (cut after a stop id and at the budget) to the row and hand it on;
        row j of `logits` is the target's distribution for new[j]."""
        new = cut_after_stop(new, row.stop_ids)[: row.tokens_left]
        if row.logprobs is not None:
            record_logprobs(row.logprobs, logits[: len(new)], new, row.top_logprobs)
        row.tokens += new
        row.stats.new_tokens += len(new)
        row.on_chunk(new)

    def drop_cancelled_rows(self) -> None:
        for i in reversed([i for i, row in enumerate(self.rows) if row.cancelled]):
            self._finish(i)

    def _finish(self, index: int) -> None:
        row = self.rows.pop(index)
        self.kv.drop(index)
        row.stats.decode_s = time.perf_counter() - row.decode_started if row.decode_started else 0.0
        row.stats.total_s = row.stats.ttft_s + row.stats.decode_s
        row.on_done(row.stats)


class BatchedSpecEngine(SpecEngine):
    """The engine for serving: up to `max_batch` sequences per step (continuous batching),
    draft counts planned every step for goodput."""

    def __init__(self, target, drafter: Drafter | None = None, block_size: int = 8, max_batch: int = 8,
                 adaptive: bool = True, planner: DraftPlanner | None = None, tree_budget: int | None = None):
        super().__init__(target, drafter, block_size, max_batch=max_batch, adaptive=adaptive, planner=planner,
                         tree_budget=tree_budget)


def serving_engine(target, drafter: Drafter | None, block_size: int, max_batch: int,
                   tree_budget: int | None = None) -> tuple[SpecEngine, str | None]:
    """The engine for many requests: batched (`BatchedSpecEngine`) when the target's cache can
    hold rows side by side (full and sliding-window attention), else one row at a time with
    the rest waiting (other attention kinds; `max_batch` 1), planned alike, trees where
    asked. Returns it and, when it fell back, why."""
    if tree_budget is not None:
        check_budget(tree_budget, target.max_context)  # a bad budget is the request's error, never a fallback
    if max_batch > 1:
        try:
            return BatchedSpecEngine(target, drafter, block_size, max_batch, tree_budget=tree_budget), None
        except InvalidArgumentError as why:  # the slot cache cannot hold this target
            return SpecEngine(target, drafter, block_size, adaptive=True, tree_budget=tree_budget), str(why)
    return SpecEngine(target, drafter, block_size, adaptive=True, tree_budget=tree_budget), None


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
