"""Prompt lookup proposals and the statistics the engine reports."""

from __future__ import annotations

import torch

from blockspec.decoding.draft import DraftRequest
from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.decoding.stats import GenerationStats
from blockspec.drafters.prompt_lookup import PromptLookupDrafter
from conftest import OracleDrafter, hf_greedy, tiny_target


def propose(tokens, num):
    drafter = PromptLookupDrafter()
    return drafter.propose([DraftRequest(drafter, torch.tensor(tokens), num, SamplingParams())])[0].tokens.tolist()


def test_prompt_lookup_copies_after_the_most_recent_longest_match():
    assert propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 3) == [7, 8, 5]
    assert propose([4, 5, 6, 7, 4, 5], 2) == [6, 7]
    assert propose([1, 2, 3, 4], 5) == []  # the suffix never occurred before
    assert propose([6, 1, 6], 4) == [1, 6]  # the continuation may reach the end
    assert propose([3], 4) == []


def test_stats_count_every_step():
    stats = GenerationStats(block_size=4)
    stats.record_step(3, 3)
    stats.record_step(3, 0)
    stats.record_step(1, 1)
    assert stats.steps == 3
    assert stats.accept_hist == [1, 1, 0, 1]
    assert stats.tau == (3 + 0 + 1 + 3) / 3
    assert stats.accept_rate_by_pos == [2 / 3, 0.5, 0.5]


def test_engine_stats_are_consistent_with_its_output():
    target = tiny_target("llama")
    prompt = [5, 17, 33, 2, 9, 40]
    reference = hf_greedy(target.model, prompt, 40, (-1,))
    stats = GenerationStats(8)
    engine = SpecEngine(target, OracleDrafter(prompt + reference, seed=3), 8)
    out = [t for c in engine.generate(prompt, max_new_tokens=40, stop_token_ids=(-1,), stats=stats) for t in c]
    assert out == reference
    assert stats.new_tokens == 40 == 1 + sum((a + 1) * n for a, n in enumerate(stats.accept_hist))
    assert stats.steps == sum(stats.accept_hist)
    assert 1.0 < stats.tau <= 8
    assert stats.ttft_s > 0 and stats.tpot_s > 0 and stats.tokens_per_s > 0
    plain = GenerationStats(1)
    list(SpecEngine(target, None, 8).generate(prompt, max_new_tokens=10, stop_token_ids=(-1,), stats=plain))
    assert plain.tau == 1.0 and plain.steps == 9 and plain.accept_hist == [9]


def test_hybrid_scores_each_source_by_what_was_committed_and_drafts_with_the_better_one():
    """Lookup's score is kept up to date even when the model drafted; the model's only when
    it drafted; the source with the higher score (ties: lookup, it is free) drafts."""
    from blockspec.decoding.draft import Draft, Drafter
    from blockspec.drafters.hybrid import HybridDrafter

    class Fixed(Drafter):  # always proposes the same tokens
        name = "fixed"

        def __init__(self, tokens):
            self.tokens = tokens

        def begin(self, prompt_ids, prompt_features):
            pass

        def propose_one(self, request):
            return Draft(tokens=torch.tensor(self.tokens[:request.num_drafts]))

    hybrid = HybridDrafter(Fixed([7, 8, 9])).fork()
    hybrid.begin(torch.tensor([1, 2, 3, 1]), None)

    def step(committed):
        return hybrid.propose([DraftRequest(hybrid, torch.tensor(committed), 3, SamplingParams())])[0].tokens.tolist()

    # lookup has a continuation ([2, 3, 1]) and both scores start equal: lookup drafts
    assert step([1, 2, 3, 1]) == [2, 3, 1] and hybrid.last_source == "lookup"
    # the target wrote 5 after the anchor: lookup's proposal was worth 0, so the model drafts
    assert step([1, 2, 3, 1, 5]) == [7, 8, 9] and hybrid.last_source == "model"
    assert hybrid.scores["lookup"].expected < hybrid.scores["model"].expected
    # the model's 7, 8 were accepted (then 4): its score rises; lookup had no continuation after 5
    assert step([1, 2, 3, 1, 5, 7, 8, 4]) == [7, 8, 9]
    assert hybrid.scores["model"].expected > 1.0


def test_the_planner_weighs_each_step_by_the_rates_of_the_source_that_drafts_it():
    """A drafter with two sources, one always right and one always wrong, alternating: with
    evidence kept per source the planner drafts a full block whenever the good source drafts
    and (after a probe or two) plain steps when the bad one would; one pooled rate would
    blur them into a middling rate for both. Output stays the target's greedy tokens."""
    from blockspec.decoding.draft import Draft, Drafter
    from blockspec.decoding.planner import DraftPlanner
    from test_batched_spec import CPU_DRAFT, CPU_VERIFY, measured_planner

    target = tiny_target("llama")
    prompt = [5, 17, 33, 2, 9, 40]
    reference = prompt + hf_greedy(target.model, prompt, 60, (-1,))
    drafted_by = {"good": [], "bad": []}  # per step of each source: how many drafts it was asked for

    class TwoSources(Drafter):
        name = "two-sources"

        def begin(self, prompt_ids, prompt_features):
            self.asked = None

        def next_sources(self, token_ids):  # one source offered per step
            self.asked = token_ids.numel()
            return {"good" if (token_ids.numel() // 3) % 2 == 0 else "bad": None}

        def propose_one(self, request):
            assert self.asked == request.token_ids.numel()  # asked before this very step
            start = request.token_ids.numel()
            tokens = torch.tensor(reference[start:start + request.num_drafts])
            drafted_by[request.source][-1] = request.num_drafts
            return Draft(tokens=tokens if request.source == "good" else (tokens + 1) % 96)

    class FixedCosts(DraftPlanner):  # the measured CPU costs, not this run's timings
        def record(self, *args, **kwargs):
            pass

    planner = measured_planner(CPU_VERIFY, CPU_DRAFT, cls=FixedCosts, sources=("good", "bad"))
    engine = SpecEngine(target, TwoSources(), 8, adaptive=True, planner=planner)
    original_plan = engine._plan

    def plan():
        counts = original_plan()
        for row in engine.rows:
            source = next(iter(row.drafter.next_sources(torch.tensor(row.tokens))))
            drafted_by[source].append(0)
        return counts

    engine._plan = plan
    out = [t for c in engine.generate(prompt, max_new_tokens=60, stop_token_ids=(-1,)) for t in c]
    assert prompt + out == reference
    assert set(planner.pooled) == {"good", "bad"}
    assert planner.pooled["good"].hits[0] > 0 and planner.pooled["bad"].hits[0] == 0
    assert all(drafted_by["good"][1:])  # every step of the good source drafted
    assert sum(1 for count in drafted_by["bad"] if count) <= len(drafted_by["bad"]) // 3  # mostly plain
