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


def test_hybrid_reports_lookup_continuations_it_did_not_draft_once_the_target_decides_them():
    """Lookup costs nothing to ask, so its continuation is scored every step, drafted or
    not: an undrafted one is handed to the planner (`undrafted_outcomes`) once the committed
    tokens decide it (a token differs, or all of it came), as (source, proposed, written);
    a drafted one is the verifier's business and never reported."""
    from blockspec.decoding.draft import Draft, Drafter
    from blockspec.drafters.hybrid import HybridDrafter

    class Never(Drafter):
        def begin(self, prompt_ids, prompt_features):
            pass

        def propose_one(self, request):
            return Draft(tokens=torch.full((request.num_drafts,), 99))

    hybrid = HybridDrafter(Never()).fork()
    hybrid.begin(torch.tensor([1, 2, 3, 1]), None)
    committed = [1, 2, 3, 1]

    def plain_step(token):  # the planner asked, then took a plain step: the target wrote `token`
        committed.append(token)
        sources = hybrid.next_sources(torch.tensor(committed))
        return sources, hybrid.undrafted_outcomes()

    assert hybrid.next_sources(torch.tensor(committed)) == {"lookup": 3, "model": None}  # [2, 3, 1] after 1
    assert plain_step(2)[1] == []  # 2 matches: not decided yet (3 and 1 still to come)
    assert plain_step(3)[1] == []
    # 9 differs from the third token: [2, 3, 1] got two right; the continuations after 2 ([3, 1, 2])
    # and after 3 ([1, 2, 3]) are decided by the same token: 1 and 0 right
    assert sorted(plain_step(9)[1]) == [("lookup", 3, 0), ("lookup", 3, 1), ("lookup", 3, 2)]
    # drafted (the planner's pick, though lookup now scores below the model): never reported
    committed += [1, 2]
    assert hybrid.next_sources(torch.tensor(committed)) == {"model": None, "lookup": 4}  # [3, 9, 1, 2]
    draft = hybrid.propose([DraftRequest(hybrid, torch.tensor(committed), 3, SamplingParams(), source="lookup")])[0]
    assert draft.tokens.tolist() == [3, 9, 1]
    committed += [3, 9, 1, 5]  # all three accepted, then the bonus token
    hybrid.next_sources(torch.tensor(committed))
    assert hybrid.undrafted_outcomes() == []
    assert hybrid.scores["lookup"].expected > 1.0


def test_the_planner_learns_a_free_source_from_steps_it_did_not_draft():
    """The hybrid's lookup is always right here, but the planner starts sure it is useless
    (a pooled rate of 0 over 50 trials) and the model is always wrong: every step is
    planned plain at first. Lookup's undrafted continuations reach the planner as
    evidence, so it soon drafts with lookup, and does so most steps; without that evidence
    (its rate then only moves when it drafts) it never would. Output stays greedy."""
    from blockspec.decoding.draft import Draft, Drafter
    from blockspec.decoding.planner import DraftPlanner
    from blockspec.drafters.hybrid import HybridDrafter
    from test_batched_spec import CPU_DRAFT, CPU_VERIFY, evidence, measured_planner

    target = tiny_target("llama")
    prompt = [5, 17, 33, 2, 9, 40]
    reference = prompt + hf_greedy(target.model, prompt, 60, (-1,))

    class Wrong(Drafter):
        def begin(self, prompt_ids, prompt_features):
            pass

        def propose_one(self, request):
            start = request.token_ids.numel()
            return Draft(tokens=(torch.tensor(reference[start:start + request.num_drafts]) + 1) % 96)

    class RightLookup(PromptLookupDrafter):  # free, as lookup is, and always right
        def propose_one(self, request):
            start = request.token_ids.numel()
            return Draft(tokens=torch.tensor(reference[start:start + request.num_drafts]))

    class FixedCosts(DraftPlanner):  # the measured CPU costs, not this run's timings
        def record(self, *args, **kwargs):
            pass

    def lookup_steps(with_undrafted_evidence):
        planner = measured_planner(CPU_VERIFY, CPU_DRAFT, cls=FixedCosts, sources=("model",))
        planner.drafting_for("lookup").record(2, 0.0, planner.now)
        planner.pooled["lookup"] = evidence(0.0)
        planner.pooled["model"] = evidence(0.0)
        hybrid = HybridDrafter(Wrong(), RightLookup())
        if not with_undrafted_evidence:
            hybrid.undrafted_outcomes = lambda: []  # forks copy it
        engine = SpecEngine(target, hybrid, 8, adaptive=True, planner=planner)
        sources = []
        original_plan = engine._plan

        def plan(token_ids):
            counts = original_plan(token_ids)
            sources.append(engine.rows[0].source if counts[0] else None)
            return counts

        engine._plan = plan
        out = [t for c in engine.generate(prompt, max_new_tokens=60, stop_token_ids=(-1,)) for t in c]
        assert prompt + out == reference
        assert "model" not in sources
        return sources

    sources = lookup_steps(True)
    assert sources[0] is None  # it had to learn first
    assert sources.count("lookup") >= 3 and sources.count("lookup") >= len(sources) // 2
    assert "lookup" not in lookup_steps(False)


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

    def plan(token_ids):
        counts = original_plan(token_ids)
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
