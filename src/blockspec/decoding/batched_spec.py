"""Batched speculative decoding: many sequences verified together in ONE target pass per
step, each accepting its own number of drafts (ragged acceptance), new sequences admitted
between steps (continuous batching).

The stock `DynamicCache` crops the whole batch to one length, so rows share one slot
axis and a per-row mask of valid slots instead: a step appends the same number of slots
to every row; afterwards only a row's anchor and accepted drafts stay valid, the rest
become holes that the mask hides (keys are rotated at their own positions when written,
so where a slot sits does not matter). When holes pile up the cache is compacted. Each
row has its own drafter state (a fork); the drafting rows of a step are handed to the
drafter together (`propose_many`: DFlash drafts them in one pass), and the target pass is
shared.

How many tokens each row drafts is planned every step (`DraftPlanner`): the count that
maximises expected committed tokens per second, from each row's recent acceptance and
the measured cost of verify passes and of drafting on this machine. Under load, on a CPU,
a wider verify pass costs more than the drafts bring, and the plan becomes plain batched
decoding. A row's drafter state is only brought up to date when it drafts next (the
committed tokens and their features wait), so plain steps cost what the non-speculative
engine costs.

Only full-attention targets (no sliding-window layers): those are rejected up front.
At T=0 every row equals the single-sequence engine's output up to the float rounding a
batched pass can move (the near-tie rule of the tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from blockspec.decoding.engine import check_request, committed_tokens, record_logprobs, verify
from blockspec.decoding.planner import AcceptanceEvidence, DraftPlanner
from blockspec.decoding.sampling import SamplingParams, TokenSampler, next_token
from blockspec.drafters.base import Draft
from blockspec.decoding.stats import GenerationStats
from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import target_features
from blockspec.targets.cache import GrowingLayer, new_cache, replace_states


@dataclass
class BatchRow:
    tokens: list[int]  # committed, prompt included; the last one is the anchor
    max_new_tokens: int
    params: SamplingParams
    stop_ids: set[int]
    on_chunk: Callable[[list[int]], None]  # receives each committed chunk
    on_done: Callable[[GenerationStats], None]
    drafter: object = None
    generator: torch.Generator | None = None  # the drafter's random choices (sampled drafts)
    sampler: TokenSampler | None = None  # the target's, keyed by output position
    stats: GenerationStats = None
    logprobs: list | None = None
    top_logprobs: int = 0
    acceptance: AcceptanceEvidence = field(default_factory=AcceptanceEvidence)  # for the planner
    # committed since the drafter last saw the sequence (ids, features): it catches up, in one
    # call, only when it drafts next, so plain steps cost no drafter work
    unseen_ids: list = None
    unseen_features: list = None
    cancelled: bool = False
    error: Exception | None = None  # set when this row failed on its own (e.g. its prefill)
    decode_started: float = 0.0


class BatchedSpecEngine:
    def __init__(self, target, drafter=None, block_size: int = 8, max_batch: int = 8, adaptive: bool = True,
                 planner: DraftPlanner | None = None):
        """`adaptive`: each step's draft counts come from `planner` (a new DraftPlanner if
        None), down to none; otherwise every row drafts a full block every step."""
        if block_size < 1:
            raise InvalidArgumentError(f"block size must be >= 1, got {block_size}")
        self.target, self.drafter = target, drafter
        self.block_size = block_size if drafter is not None else 1
        self.max_batch = max_batch
        self.planner = (planner or DraftPlanner(self.block_size - 1)) if adaptive and drafter is not None else None
        self.layer_ids = drafter.target_layer_ids if drafter is not None else ()
        self.rows: list[BatchRow] = []
        self.waiting: list[BatchRow] = []
        self.cache = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]: which cache slots a row may attend
        probe = new_cache(target.model.config)
        if any(not isinstance(layer, GrowingLayer) for layer in probe.layers):
            raise InvalidArgumentError("batched decoding needs a target whose layers all use full attention")

    # --- admission ----------------------------------------------------------------------
    def add(self, prompt_ids: list[int], *, max_new_tokens: int, on_chunk, on_done,
            params: SamplingParams = SamplingParams(), stop_token_ids=None, logprobs: list | None = None,
            top_logprobs: int = 0) -> BatchRow:
        max_new_tokens, stops = check_request(self.target, len(prompt_ids), max_new_tokens, stop_token_ids)
        row = BatchRow(list(prompt_ids), max_new_tokens, params, stops, on_chunk, on_done, logprobs=logprobs,
                       top_logprobs=top_logprobs)
        self.waiting.append(row)
        return row

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    @torch.inference_mode()
    def _admit(self) -> None:
        while self.waiting and len(self.rows) < self.max_batch:
            row = self.waiting.pop(0)
            if row.cancelled:  # left before it started: it still ends, with nothing generated
                row.stats = GenerationStats(self.block_size)
                row.on_done(row.stats)
                continue
            row.stats = GenerationStats(self.block_size)
            try:
                self._prefill(row)
            except Exception as error:  # this row fails alone; the batch goes on
                if row in self.rows:  # it failed after joining (in a callback): not a prefill failure
                    raise
                row.error = error
                row.on_done(row.stats)

    def _prefill(self, row: BatchRow) -> None:
        started = time.perf_counter()
        row.generator = None if row.params.greedy else row.params.generator()
        row.sampler = None if row.params.greedy else TokenSampler(row.params.seed)
        prompt = torch.tensor(row.tokens)
        single = new_cache(self.target.model.config)
        out = self.target.model(input_ids=prompt[None].to(self.target.device), cache=single, use_cache=True,
                                output_hidden_states=bool(self.layer_ids), logits_to_keep=1)
        logits = out.logits[0, -1].float()
        first = next_token(logits, row.params, row.sampler, 0)
        if row.logprobs is not None:
            record_logprobs(row.logprobs, logits[None], [first], row.top_logprobs)
        drafter = None
        if self.drafter is not None:
            drafter = self.drafter.fork()
            features = target_features(out.hidden_states, self.layer_ids)[0] if self.layer_ids else None
            drafter.begin(prompt, features)
        # nothing of the batch changes before this point: a failure above leaves it intact
        row.drafter, row.unseen_ids, row.unseen_features = drafter, [], []
        self._merge(single, prompt.numel())
        row.tokens.append(first)
        row.stats.new_tokens = 1
        row.stats.ttft_s = time.perf_counter() - started
        row.decode_started = time.perf_counter()
        self.rows.append(row)
        row.on_chunk([first])
        if first in row.stop_ids or row.stats.new_tokens >= row.max_new_tokens:
            self._finish(len(self.rows) - 1)

    def reset(self) -> None:
        """Drop every row and the cache (after a failed step: start clean)."""
        self.rows, self.waiting, self.cache = [], [], None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    def _merge(self, single, length: int) -> None:
        """Append a prefilled sequence's cache as a new row (its slots first, holes after)."""
        if self.cache is None:
            self.cache = single
            self.valid = torch.ones(1, length, dtype=torch.bool)
            return
        width = max(self.valid.shape[1], length)
        self._grow_width(width)
        for mine, theirs in zip(self.cache.layers, single.layers):
            pad = width - length
            keys = torch.nn.functional.pad(theirs.keys, (0, 0, 0, pad))
            values = torch.nn.functional.pad(theirs.values, (0, 0, 0, pad))
            replace_states(mine, torch.cat([mine.keys, keys], dim=0), torch.cat([mine.values, values], dim=0))
        row_valid = torch.zeros(1, width, dtype=torch.bool)
        row_valid[0, :length] = True
        self.valid = torch.cat([self.valid, row_valid], dim=0)

    def _grow_width(self, width: int) -> None:
        current = self.valid.shape[1]
        if width <= current:
            return
        for layer in self.cache.layers:
            replace_states(layer, torch.nn.functional.pad(layer.keys, (0, 0, 0, width - current)),
                    torch.nn.functional.pad(layer.values, (0, 0, 0, width - current)))
        self.valid = torch.nn.functional.pad(self.valid, (0, width - current))

    # --- one step -------------------------------------------------------------------------
    def _plan(self) -> list[int]:
        # never draft past max_new_tokens: accepted drafts + bonus <= what is left
        allowed = [min(self.block_size - 1, row.max_new_tokens - row.stats.new_tokens - 1) for row in self.rows]
        if self.planner is None:
            return [count if row.drafter is not None else 0 for row, count in zip(self.rows, allowed)]
        return self.planner.plan([(row.acceptance, count) if row.drafter is not None else None
                                  for row, count in zip(self.rows, allowed)])

    @torch.inference_mode()
    def step(self) -> None:
        """Admit waiting sequences, then one draft + batched verify step for every row."""
        self.drop_cancelled_rows()
        self._admit()
        if not self.rows:
            return
        started = time.perf_counter()
        batch = len(self.rows)
        plan = self._plan()
        drafting = [i for i, count in enumerate(plan) if count]
        for i in drafting:
            self._catch_up(self.rows[i])
        drafts = [None] * batch
        if drafting:  # every drafting row in one drafter call (one pass where the drafter can)
            proposed = self.drafter.propose_many(
                [self.rows[i].drafter for i in drafting],
                [(torch.tensor(self.rows[i].tokens), plan[i], self.rows[i].params, self.rows[i].generator)
                 for i in drafting])
            for i, draft in zip(drafting, proposed):
                drafts[i] = draft
        drafting_seconds = time.perf_counter() - started
        lengths = [1 + (d.tokens.numel() if d is not None else 0) for d in drafts]
        width_q = max(lengths)
        ids = torch.zeros(batch, width_q, dtype=torch.long)
        positions = torch.zeros(batch, width_q, dtype=torch.long)
        query_valid = torch.zeros(batch, width_q, dtype=torch.bool)
        for i, (row, draft) in enumerate(zip(self.rows, drafts)):
            block = [row.tokens[-1]] + (draft.tokens.tolist() if draft is not None else [])
            ids[i, :len(block)] = torch.tensor(block)
            ids[i, len(block):] = row.tokens[-1]
            start = len(row.tokens) - 1
            positions[i, :len(block)] = torch.arange(start, start + len(block))
            positions[i, len(block):] = start + len(block) - 1  # padding never runs past the row's real positions
            query_valid[i, :len(block)] = True
        old = self.valid.shape[1]
        causal = torch.ones(width_q, width_q, dtype=torch.bool).tril()
        new_part = causal[None] & query_valid[:, None, :]  # a query sees the valid block slots up to itself
        new_part |= torch.eye(width_q, dtype=torch.bool)[None]  # padding queries see themselves (no empty row)
        allowed = torch.cat([self.valid[:, None, :].expand(batch, width_q, old), new_part], dim=2)[:, None]
        # additive float mask: what every attention implementation (sdpa, eager) reads the same way
        dtype = self.target.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        out = self.target.model(input_ids=ids.to(self.target.device), position_ids=positions.to(self.target.device),
                                attention_mask=mask.to(self.target.device), cache=self.cache, use_cache=True,
                                output_hidden_states=bool(self.layer_ids))
        logits = out.logits.float()
        features = target_features(out.hidden_states, self.layer_ids) if self.layer_ids else None
        new_valid = torch.zeros(batch, width_q, dtype=torch.bool)
        finished = []
        for i, (row, draft) in enumerate(zip(self.rows, drafts)):
            try:
                count = lengths[i] - 1
                row_draft = draft if draft is not None else _NO_DRAFT
                accept_length, bonus = verify(logits[i, :count + 1], row_draft, row.params, row.sampler,
                                              row.stats.new_tokens)
                new_valid[i, :accept_length + 1] = True
                if row.drafter is not None:  # the drafter reads these when it drafts next (`_catch_up`)
                    row.unseen_ids.append(ids[i, :accept_length + 1])
                    if features is not None:  # a copy: a view would keep the whole batch's features alive
                        row.unseen_features.append(features[i, :accept_length + 1].clone())
                row.stats.record_step(count, accept_length)
                if self.planner is not None:
                    self.planner.age(row.acceptance)
                    if count:
                        self.planner.observe(row.acceptance, count, accept_length)
                new = committed_tokens(row_draft, accept_length, bonus, row.stop_ids)
                new = new[: row.max_new_tokens - row.stats.new_tokens]
                if row.logprobs is not None:
                    record_logprobs(row.logprobs, logits[i, :len(new)], new, row.top_logprobs)
                row.tokens += new
                row.stats.new_tokens += len(new)
                row.on_chunk(new)
                if new[-1] in row.stop_ids or row.stats.new_tokens >= row.max_new_tokens:
                    finished.append(i)
            except Exception as error:  # this row alone fails (its sampling, its callbacks); the batch goes on
                row.error = error
                finished.append(i)  # (appending i is the try block's last statement: never twice)
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        if self.planner is not None:  # drafting's cost includes the catch-up of the drafting rows
            self.planner.record(batch * width_q, time.perf_counter() - started - drafting_seconds,
                                len(drafting) * width_q, drafting_seconds)
        for i in reversed(finished):
            self._finish(i)
        self._compact_if_sparse()

    @staticmethod
    def _catch_up(row: BatchRow) -> None:
        """Show the row's drafter what was committed since it last drafted, in one call."""
        if not row.unseen_ids:
            return
        ids = torch.cat(row.unseen_ids)
        features = torch.cat(row.unseen_features) if row.unseen_features else None
        row.unseen_ids, row.unseen_features = [], []
        row.drafter.accept(ids, features)

    def drop_cancelled_rows(self) -> None:
        for i in reversed([i for i, row in enumerate(self.rows) if row.cancelled]):
            self._finish(i)

    def _finish(self, index: int) -> None:
        row = self.rows.pop(index)
        row.stats.decode_s = time.perf_counter() - row.decode_started if row.decode_started else 0.0
        row.stats.total_s = row.stats.ttft_s + row.stats.decode_s
        keep = torch.tensor([i for i in range(self.valid.shape[0]) if i != index], dtype=torch.long)
        if keep.numel() == 0:
            self.cache, self.valid = None, torch.zeros(0, 0, dtype=torch.bool)
        else:
            self.cache.batch_select_indices(keep)
            self.valid = self.valid[keep]
        row.on_done(row.stats)

    def _compact_if_sparse(self) -> None:
        """Gather each row's valid slots to the front once holes are most of the cache."""
        if self.cache is None:
            return
        counts = self.valid.sum(dim=1)
        width = int(counts.max())
        if self.valid.shape[1] <= 2 * width + 64:
            return
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :width]  # valid slots first
        for layer in self.cache.layers:
            index = order[:, None, :, None].to(layer.keys.device)
            keys, values = layer.keys, layer.values
            replace_states(layer, keys.gather(2, index.expand(-1, keys.shape[1], -1, keys.shape[3])),
                    values.gather(2, index.expand(-1, values.shape[1], -1, values.shape[3])))
        self.valid = torch.arange(width)[None, :] < counts[:, None]

    def run(self) -> None:
        while self.busy:
            self.step()


_NO_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))
