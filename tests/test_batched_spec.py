"""Batched speculative decoding: ragged acceptance, continuous admission, compaction; every
row equals greedy decoding of its prompt alone, and at T > 0 the rows are distributed as
the target."""

from __future__ import annotations

import numpy as np
import pytest

from blockspec.decoding.draft import DraftRequest
from blockspec.decoding.engine import BatchedSpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.errors import InvalidArgumentError
from conftest import assert_same_or_near_tie, hf_greedy, tiny_target
from test_lossless_greedy import make_drafter
from test_sampling_exact import BLOCK, NEW, PROMPT, VOCAB, assert_same_distribution, dflash, exact_joint

PROMPTS = [[7], [5, 17, 33, 2, 9, 40], [(i * 37 + 11) % 90 + 2 for i in range(23)], [60, 61, 62, 60, 61, 62, 60]]
EOS = (1,)


def collect(engine, prompt, max_new, **options):
    out = {"tokens": [], "stats": None}
    engine.add(prompt, max_new_tokens=max_new, stop_token_ids=EOS, on_chunk=out["tokens"].extend,
               on_done=lambda stats: out.__setitem__("stats", stats), **options)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])  # gemma3: windows in the mask
@pytest.mark.parametrize("kind", ["none", "prompt-lookup", "dflash", "dflash-reduced-vocab", "oracle", "draft-model",
                                  "mtp", "eagle3"])
def test_every_row_equals_greedy_decoding_alone(arch, kind):
    target = tiny_target(arch)
    references = [hf_greedy(target.model, p, 30, EOS) for p in PROMPTS]
    if kind == "oracle":  # an oracle knows one sequence: the others get its (wrong) drafts
        drafter = make_drafter(kind, target, PROMPTS[1], references[1])
    else:
        drafter = make_drafter(kind, target, PROMPTS[0], references[0])
    engine = BatchedSpecEngine(target, drafter, block_size=6, max_batch=3)
    outputs = [collect(engine, p, 30 - 4 * i) for i, p in enumerate(PROMPTS[:2])]
    engine.step()
    engine.step()  # two rows in flight, then two more arrive (one waits: max_batch 3)
    outputs += [collect(engine, p, 30 - 4 * (i + 2)) for i, p in enumerate(PROMPTS[2:])]
    engine.run()
    for i, (prompt, out, reference) in enumerate(zip(PROMPTS, outputs, references)):
        max_new = 30 - 4 * i
        assert_same_or_near_tie(target.model, prompt, out["tokens"], reference[:max_new])
        assert out["stats"] is not None and out["stats"].new_tokens == len(out["tokens"])
    assert engine.kv.cache is None and not engine.busy


def test_compaction_keeps_outputs_and_shrinks_the_cache():
    target = tiny_target("llama")
    drafter = make_drafter("dflash", target, PROMPTS[0], None)  # random drafts: most slots become holes
    engine = BatchedSpecEngine(target, drafter, block_size=8, max_batch=4, adaptive=False)
    outputs = [collect(engine, p, 60) for p in PROMPTS]
    widths = []
    while engine.busy:
        engine.step()
        if engine.kv.cache is not None:
            widths.append(engine.kv.valid.shape[1])
            assert engine.kv.cache.get_seq_length() == engine.kv.valid.shape[1]
    assert any(b < a for a, b in zip(widths, widths[1:]))  # compacted at least once
    for prompt, out in zip(PROMPTS, outputs):
        assert_same_or_near_tie(target.model, prompt, out["tokens"], hf_greedy(target.model, prompt, 60, EOS))


def test_layers_other_than_full_or_sliding_attention_are_refused():
    target = tiny_target("llama")
    target.model.config.layer_types = ["full_attention", "chunked_attention"] * 2
    with pytest.raises(InvalidArgumentError, match="chunked_attention"):
        BatchedSpecEngine(target, None)


def test_cancelled_rows_leave_and_the_others_finish():
    target = tiny_target("qwen3")
    engine = BatchedSpecEngine(target, make_drafter("prompt-lookup", target, [], []), block_size=4)
    keep = collect(engine, PROMPTS[1], 20)
    engine.add(PROMPTS[2], max_new_tokens=200, stop_token_ids=(), on_chunk=lambda c: None, on_done=lambda s: None)
    engine.step()
    engine.rows[1].cancelled = True
    engine.run()
    assert_same_or_near_tie(target.model, PROMPTS[1], keep["tokens"], hf_greedy(target.model, PROMPTS[1], 20, EOS))


def test_rows_sampled_in_one_batch_are_distributed_as_the_target():
    target = tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=2, seed=3)
    params = SamplingParams(temperature=1.0)
    engine = BatchedSpecEngine(target, dflash(target, sample_drafts=True), block_size=BLOCK, max_batch=100)
    results = []
    for i in range(3000):
        out = []
        engine.add(PROMPT, max_new_tokens=NEW, stop_token_ids=(), on_chunk=out.extend, on_done=lambda s: None,
                   params=SamplingParams(params.temperature, seed=5000 + i))
        results.append(out)
        if len(engine.waiting) == 100:
            engine.run()
    engine.run()
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    for out in results:
        counts[tuple(out[1:])] += 1
    assert_same_distribution(counts, exact_joint(target, params))


def test_serving_bench_closed_loop_counts_every_token(tmp_path):
    from blockspec.bench.serving import report_serving, serving_bench

    target = tiny_target("llama")
    drafter = make_drafter("prompt-lookup", target, [], [])
    rows = serving_bench(target, drafter, PROMPTS, [1, 3], block_size=4, max_new_tokens=10, repeats=2)
    assert [(r["concurrency"], r["method"]) for r in rows] == [(1, "baseline"), (1, "speculative"),
                                                               (3, "baseline"), (3, "speculative")]
    for r in rows:
        assert r["requests"] == len(PROMPTS) and 0 < r["output_tokens"] <= 10 * len(PROMPTS)
        assert len(r["tokens_per_s_runs"]) == 2 and min(r["tokens_per_s_runs"]) <= r["tokens_per_s"]
    # lossless at T=0: both methods emit the same number of tokens
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"]
    report_serving(rows, tmp_path, {})
    assert (tmp_path / "serving.png").stat().st_size > 0 and "speculative" in (tmp_path / "serving.md").read_text()


def measured_planner(verify_ms: dict[int, float], draft_ms: dict[int, float], max_drafts: int = 7, cls=None,
                     sources=("model",)):
    """A DraftPlanner (or a `cls` of one) that has measured these verify costs and drafting
    costs of these sources (both by size bucket: query tokens of the verify pass, drafted
    positions)."""
    from blockspec.decoding.planner import DraftPlanner

    planner = (cls or DraftPlanner)(max_drafts)
    for bucket, ms in verify_ms.items():
        planner.verify.record(bucket, ms / 1000, planner.now)
    for bucket, ms in draft_ms.items():
        for source in sources:
            planner.drafting_for(source).record(bucket, ms / 1000, planner.now)
    return planner


def evidence(rate: float, trials: float = 50.0, positions: int = 7):
    """A row that accepted a `rate` share of the `trials` times each position was reached."""
    from blockspec.decoding.planner import AcceptanceEvidence

    return AcceptanceEvidence([rate * trials] * positions, [trials] * positions)


# costs measured on this repo's CPU for the default target (ms): flat to 8 query tokens, then growing
CPU_VERIFY = {1: 56, 2: 60, 4: 69, 8: 80, 16: 115, 32: 146, 64: 260}
CPU_DRAFT = {2: 8, 4: 9, 8: 11, 16: 14, 32: 20, 64: 32}


def test_planner_drafts_a_full_block_for_one_predictable_row_and_nothing_under_load():
    planner = measured_planner(CPU_VERIFY, CPU_DRAFT)
    assert planner.plan([(evidence(0.8), 7)]) == [7]  # batch 1: a wider pass is nearly free
    assert planner.plan([(evidence(0.8), 3)]) == [3]  # never past what the row may still draft
    assert planner.plan([(evidence(0.05), 7)]) == [0]  # a row that accepts nothing decodes plainly
    # 8 rows of modest acceptance: 16+ query tokens cost more than the drafts bring
    assert planner.plan([(evidence(0.4), 7)] * 8) == [0] * 8


def test_planner_picks_per_row_the_source_that_pays_most_or_a_plain_step():
    """Sources offered per row (the hybrid: lookup with the tokens its continuation has, and
    the model): each weighed alone by the row's evidence on it, its drafting cost and its
    verify width (a tree source: its recent trees' size); none paying, a plain step."""
    planner = measured_planner(CPU_VERIFY, CPU_DRAFT)
    planner.drafting_for("lookup").record(2, 0.0, planner.now)  # free, as measured

    def offer(lookup_rate, model_rate, lookup_tokens=5, model_tree_width=0.0):
        model = evidence(model_rate)
        model.tree_width = model_tree_width
        return {"lookup": (evidence(lookup_rate, positions=lookup_tokens), lookup_tokens), "model": (model, 7)}

    assert planner.plan_sources([offer(0.9, 0.1)]) == (["lookup"], [5])  # never past lookup's continuation
    assert planner.plan_sources([offer(0.6, 0.6, lookup_tokens=7)])[0] == ["lookup"]  # equal rates: lookup costs no pass
    assert planner.plan_sources([offer(0.02, 0.8)]) == (["model"], [7])
    assert planner.plan_sources([offer(0.02, 0.02)]) == ([None], [0])  # neither pays: plain
    # the model's trees verify ~31 nodes: a 7-token lookup chain that gets somewhat less pays more
    assert planner.plan_sources([offer(0.6, 0.7, lookup_tokens=7)])[0] == ["model"]
    assert planner.plan_sources([offer(0.6, 0.7, lookup_tokens=7, model_tree_width=31)])[0] == ["lookup"]
    # one pass for the batch: each row with its own source; a row without a drafter stays plain
    sources, counts = planner.plan_sources([offer(0.9, 0.1), None, offer(0.02, 0.9)])
    assert sources == ["lookup", None, "model"] and counts[0] > 0 and counts[1] == 0 and counts[2] > 0


def test_planner_lets_only_the_rows_that_pay_draft():
    planner = measured_planner({1: 50, 2: 50, 4: 50, 8: 50, 16: 50}, {8: 20, 16: 40, 32: 80})
    plan = planner.plan([(evidence(0.05), 7), (evidence(0.9), 7), None, (evidence(0.1), 7)])
    assert plan[1] > 0 and plan[0] == plan[2] == plan[3] == 0  # None: a row with no drafter


def test_a_tree_source_costed_out_by_one_wide_tree_is_probed_again():
    """A source's recent trees stand for its width only while it drafts: one early 32-node
    tree (drafted before anything was measured) must not cost it out for good."""
    planner = measured_planner(CPU_VERIFY, CPU_DRAFT)
    model = evidence(0.4)
    planner.observe(model, 5, 2, predicted=2.0, nodes=32)  # one wide tree
    assert planner.plan_sources([{"model": (model, 7)}]) == ([None], [0])  # 33 tokens a step: not worth it
    for _ in range(12):  # plain steps: the row's evidence ages, its trees' width fades
        planner.age(model)
    sources, counts = planner.plan_sources([{"model": (model, 7)}])
    assert sources == ["model"] and counts[0] > 0  # costed as the chain it can at least be, drafted again
    planner.age(model)
    planner.observe(model, 3, 1, predicted=1.0, nodes=4)  # the tree it then verified was narrow
    assert model.recent_tree_width(planner.decay) < 8


def test_a_source_whose_trees_are_cut_to_nothing_stops_drafting_and_is_tried_again_later():
    """Session 15's trace of chat prompts: the model drafted (its evidence, aged toward the pooled
    rate, promised a gain), then its tree's own scores cut it to no node: ~60 passes of the drafter
    per prompt paid for plain steps. A source's wasted drafting now weighs in its plan."""
    planner = measured_planner(CPU_VERIFY, CPU_DRAFT)
    model = evidence(0.3)  # chat-like: position 1 accepted ~0.3 of the time
    assert planner.plan_sources([{"model": (model, 7)}])[0] == ["model"]  # worth a try
    for _ in range(4):  # drafted, cut to nothing before the verify
        planner.age(model)
        planner.observe_drafting(model, wasted=True)
    assert model.wasted_rate > 0.7
    assert planner.plan_sources([{"model": (model, 7)}]) == ([None], [0])  # drafting it would pay for a plain step
    plans = []
    for _ in range(20):  # plain steps: the wasted steps fade with the rest of the evidence
        planner.age(model)
        plans.append(planner.plan_sources([{"model": (model, 7)}])[0][0])
    assert plans[0] is None and plans[-1] == "model"
    planner.observe_drafting(model, wasted=False)  # a kept draft
    assert model.wasted_rate < 0.2


def test_costs_are_kept_per_power_of_two_bucket_of_sizes():
    from blockspec.decoding.planner import CostTable

    table = CostTable(decay=0.5, stale_after=10)
    table.record(5, 0.070, now=0)
    table.record(8, 0.090, now=0)  # the same bucket as 5: averaged
    table.record(1, 0.050, now=0)
    estimate = table.estimates(now=0)
    assert estimate(6) == estimate(8) == pytest.approx(0.080) and estimate(1) == pytest.approx(0.050)
    assert estimate(3) == pytest.approx(0.050)  # bucket 4 not measured: the highest smaller one, a lower bound
    assert estimate(20) == pytest.approx(0.080)  # past every measurement: a lower bound too, so it gets tried
    assert table.estimates(now=11)(6) == 0.0  # stale: re-measured


def test_planner_tries_a_size_it_has_not_measured_then_follows_the_measurement():
    planner = measured_planner({4: 70}, {2: 5})
    rows = [(evidence(0.6), 1)] * 4
    assert planner.plan(rows) == [1] * 4  # a pass of 8 tokens was never measured: optimistic, so tried
    planner.record(query_tokens=8, verify_seconds=0.300, drafted_positions=8, drafting_seconds=0.02)
    assert planner.plan(rows) == [0] * 4  # measured far slower: plain steps
    planner.now += planner.verify.stale_after + 1
    planner.verify.record(4, 0.070, planner.now)
    assert planner.plan(rows) == [1] * 4  # a stale measurement is re-taken


def test_planner_starts_drafting_before_anything_is_measured():
    from blockspec.decoding.planner import DraftPlanner

    assert DraftPlanner(5).plan([(evidence(0.0, 0.0), 5), (evidence(0.0, 0.0), 2)]) == [5, 2]


def test_expected_acceptance_follows_each_positions_rate():
    from blockspec.decoding.planner import AcceptanceEvidence, DraftPlanner

    planner = DraftPlanner(3)
    row = AcceptanceEvidence([90.0, 45.0, 0.0], [100.0, 90.0, 45.0])  # 0.9, then 0.5, then never
    rates = planner.acceptance_rates(row, 3)
    assert rates == pytest.approx([90.5 / 101, 45.5 / 91, 0.5 / 46])
    assert planner.expected_accepted(row, 2) == pytest.approx([rates[0], rates[0] + rates[0] * rates[1]])


def test_a_row_that_stopped_drafting_is_probed_again_as_its_evidence_ages():
    planner = measured_planner(CPU_VERIFY, CPU_DRAFT)
    planner.pooled["model"] = evidence(0.8)
    row = evidence(0.02, trials=10.0)
    plans = []
    for _ in range(30):
        plans.append(planner.plan([(row, 7)])[0])
        planner.age(row)
    assert plans[0] == 0 and plans[-1] > 0  # it drifted back towards the pooled rate


def test_planner_evidence_counts_reached_positions():
    from blockspec.decoding.planner import AcceptanceEvidence, DraftPlanner

    planner, row = DraftPlanner(7), AcceptanceEvidence()
    planner.observe(row, drafted=5, accepted=2)  # positions 1, 2 accepted, 3 rejected, 4-5 never reached
    planner.observe(row, drafted=3, accepted=3)  # all accepted: nothing rejected
    assert (row.hits, row.trials) == ([2, 2, 1], [2, 2, 2])
    assert planner.pooled["model"].hits[:3] == pytest.approx([0.98 + 1, 0.98 + 1, 1])  # pooled, decayed per observation


class ScriptedPlanner:
    """Full drafts on the first step and from step `resume` on, plain in between."""

    def __init__(self, resume):
        from blockspec.decoding.planner import DraftPlanner

        self.planner, self.resume, self.step = DraftPlanner(7), resume, 0

    def plan_sources(self, rows):
        self.step += 1
        drafting = self.step == 1 or self.step >= self.resume
        offers = [next(iter(row.items())) if row is not None and drafting else (None, (None, 0)) for row in rows]
        return [source for source, _ in offers], [allowed for _, (_, allowed) in offers]

    def __getattr__(self, name):  # ageing, observing and recording as the real planner does
        return getattr(self.planner, name)


@pytest.mark.parametrize("kind", ["dflash", "mtp", "draft-model", "oracle", "eagle3"])
def test_plain_steps_defer_the_drafter_and_outputs_stay_greedy(kind):
    target = tiny_target("llama")
    references = [hf_greedy(target.model, p, 30, EOS) for p in PROMPTS]
    drafter = make_drafter(kind, target, PROMPTS[1], references[1])
    calls = {"accept": 0, "propose": 0}
    originals = type(drafter).accept, type(drafter).propose

    class Spy(type(drafter)):
        def accept(self, *args):
            calls["accept"] += 1
            return originals[0](self, *args)

        def propose(self, requests):
            calls["propose"] += len(requests)
            return originals[1](self, requests)

    drafter.__class__ = Spy
    engine = BatchedSpecEngine(target, drafter, block_size=5, max_batch=4,
                               planner=ScriptedPlanner(resume=20))
    outputs = [collect(engine, p, 30) for p in PROMPTS]
    for _ in range(8):  # one drafting step, then plain ones: the drafters are not called
        engine.step()
    proposals_after_first_step = calls["propose"]
    assert calls["accept"] == 0 and proposals_after_first_step <= len(PROMPTS)
    engine.run()  # drafting again from step 20
    assert calls["propose"] > proposals_after_first_step
    assert calls["accept"] <= calls["propose"]  # one catch-up per drafting row at most
    for prompt, out, reference in zip(PROMPTS, outputs, references):
        assert_same_or_near_tie(target.model, prompt, out["tokens"], reference)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-drafts"])
def test_dflash_drafts_every_row_in_one_pass_as_it_would_alone(sampled):
    import torch

    target = tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=2, seed=3)
    drafter = dflash(target, sample_drafts=sampled, draft_vocab=list(range(0, VOCAB, 2)))
    width = len(drafter.target_layer_ids) * target.hidden_size
    forks, requests = [], []
    torch.manual_seed(0)
    for prompt, num_drafts in zip(PROMPTS, [2, 1, 2, 1]):  # contexts of 1 to 23 tokens, ragged blocks
        prompt = [token % VOCAB for token in prompt]
        fork = drafter.fork()
        fork.begin(torch.tensor(prompt), torch.randn(len(prompt), width))
        forks.append(fork)
        params = SamplingParams(temperature=1.0, top_k=5, seed=7) if sampled else SamplingParams()
        requests.append(DraftRequest(fork, torch.tensor(prompt), num_drafts, params,
                                     params.generator() if sampled else None))
    together = drafter.propose(requests)
    for i, request in enumerate(requests):
        request.generator = request.params.generator() if sampled else None
        (alone,) = drafter.propose([request])
        assert together[i].tokens.tolist() == alone.tokens.tolist()
        if sampled:  # the distributions the rejection sampler reads agree too
            torch.testing.assert_close(together[i].probs, alone.probs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["eagle3", "mtp", "dflash"])
def test_drafters_draft_every_row_together_as_they_would_alone(kind, sampled):
    import torch

    target = tiny_target("llama")
    drafter = make_drafter(kind, target, [], [])
    width = len(drafter.target_layer_ids) * target.hidden_size
    torch.manual_seed(0)
    features = [torch.randn(len(p), width) for p in PROMPTS]
    committed = [torch.randn(3, width) for _ in PROMPTS]  # a later step: 3 more committed positions

    def started():  # one fork per row, in the same state, having drafted once already
        forks = []
        for prompt, prompt_features, more in zip(PROMPTS, features, committed):
            fork = drafter.fork()
            fork.begin(torch.tensor(prompt), prompt_features)
            fork.propose([DraftRequest(fork, torch.tensor(prompt + [5]), 2, SamplingParams())])  # 5: the prefill's token
            fork.accept(torch.tensor([5, 6, 7]), more)
            forks.append(fork)
        return forks

    def requests(forks):
        out = []
        for fork, prompt, num_drafts in zip(forks, PROMPTS, [5, 1, 3, 4]):  # ragged chains
            params = SamplingParams(temperature=1.0, top_k=5, seed=7) if sampled else SamplingParams()
            out.append(DraftRequest(fork, torch.tensor(prompt + [5, 6, 7, 8]), num_drafts, params,
                                    params.generator() if sampled else None))
        return out

    together = drafter.propose(requests(started()))
    alone = [drafter.propose([request])[0] for request in requests(started())]
    for mine, theirs in zip(together, alone):
        assert mine.tokens.tolist() == theirs.tokens.tolist()
        assert (mine.probs is None) == (theirs.probs is None) == (not sampled or kind == "dflash")
        if mine.probs is not None:  # the distributions the rejection sampler reads agree too
            torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-5, rtol=1e-4)


def test_a_failing_row_fails_alone_and_its_neighbours_finish_as_greedy():
    target = tiny_target("llama")
    references = [hf_greedy(target.model, p, 20, EOS) for p in PROMPTS[:3]]
    engine = BatchedSpecEngine(target, make_drafter("prompt-lookup", target, PROMPTS[0], references[0]),
                               block_size=6, max_batch=3)
    healthy = [collect(engine, PROMPTS[0], 20), collect(engine, PROMPTS[2], 20)]
    failed = {"stats": None}

    def broken_client(chunk):  # e.g. a sampling overflow or a callback bug in ONE request
        raise RuntimeError("this row's own failure")

    row = engine.add(PROMPTS[1], max_new_tokens=20, stop_token_ids=EOS, on_chunk=lambda chunk: None,
                     on_done=lambda stats: failed.__setitem__("stats", stats))
    engine.step()  # prefill (first chunk) goes through; the failure comes in a verify step
    row.on_chunk = broken_client
    engine.run()
    assert isinstance(row.error, RuntimeError) and failed["stats"] is not None
    for out, prompt, reference in zip(healthy, [PROMPTS[0], PROMPTS[2]], [references[0], references[2]]):
        assert_same_or_near_tie(target.model, prompt, out["tokens"], reference)
    assert not engine.busy
