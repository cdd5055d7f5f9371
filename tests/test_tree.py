"""Token trees (DDTree): the best-first tree, its mask and walk; T = 0 token identity and
T > 0 exactness of tree decoding on every architecture (sliding windows included), alone
and batched; EOS, budgets and budgets as chains have them (stop strings: test_real_target.py); bad budgets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.decoding.engine import BatchedSpecEngine, SpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.decoding.stats import GenerationStats
from blockspec.decoding.tree import Candidates, ancestor_mask, build_tree, walk
from blockspec.errors import InvalidArgumentError
from conftest import ARCHITECTURES, TreeOracleDrafter, assert_same_or_near_tie, hf_greedy, tiny_target
from test_lossless_greedy import EOS, MAX_NEW, PROMPTS, make_drafter, reference, target_for
from test_sampling_exact import BLOCK, VOCAB, assert_same_distribution, dflash, empirical_joint, exact_joint


# --- the tree itself ----------------------------------------------------------------------

def candidates(probabilities: list[list[float]], ids: list[list[int]] | None = None) -> Candidates:
    probs = torch.tensor(probabilities)
    ids = torch.tensor(ids) if ids is not None else torch.arange(probs.shape[1]).expand_as(probs) + 10
    return Candidates(ids.clone(), probs.log())


def all_paths(cands: Candidates, max_depth: int) -> dict[tuple[int, ...], float]:
    """Every token path of the k-best enumeration and its log-score (brute force)."""
    paths = {}
    for depth in range(1, max_depth + 1):
        for ranks in itertools.product(range(cands.ids.shape[1]), repeat=depth):
            tokens = tuple(int(cands.ids[d, r]) for d, r in enumerate(ranks))
            score = sum(float(cands.logprobs[d, r]) for d, r in enumerate(ranks))
            paths[tokens] = max(paths.get(tokens, -math.inf), score)
    return paths


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 20), st.integers(0, 10_000))
def test_best_first_tree_holds_the_best_paths(depth, top_k, budget, seed):
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(depth, top_k, generator=generator).sort(dim=-1, descending=True).values
    probs = probs / probs.sum(-1, keepdim=True)
    cands = Candidates(torch.randint(0, 3, (depth, top_k), generator=generator), probs.log())
    tree = build_tree(cands, budget, max_depth=depth)
    paths = all_paths(cands, depth)
    assert len(tree) == min(budget, len(paths))
    assert all(parent < node for node, parent in enumerate(tree.parents))  # parents first
    assert tree.scores == sorted(tree.scores, reverse=True)  # best first: any prefix is a tree of the best nodes
    seen = set()
    for node in range(len(tree)):
        path, at = [], node
        while at >= 0:
            path.append(tree.tokens[at])
            at = tree.parents[at]
        path = tuple(reversed(path))
        assert path not in seen and math.isclose(tree.scores[node], paths[path], abs_tol=1e-5)
        seen.add(path)
    # no path outside the tree scores more than the worst inside it
    if len(tree) < len(paths):
        outside = max(score for path, score in paths.items() if path not in seen)
        assert outside <= min(tree.scores) + 1e-6


def test_chain_of_top_one_and_budget_and_depth_limits():
    cands = candidates([[0.9, 0.08, 0.02]] * 4)
    assert build_tree(cands, 4, max_depth=4).tokens == [10, 10, 10, 10]  # 0.9^4 > 0.08: a sure drafter's tree is its chain
    assert build_tree(candidates([[0.6, 0.3, 0.1]] * 4), 4, max_depth=4).parents == [-1, 0, -1, 1]  # 0.3 > 0.6^3
    tree = build_tree(cands, 50, max_depth=2)
    assert len(tree) == 3 + 9 and max(tree.depths()) == 2
    assert len(build_tree(cands, 5, max_depth=0)) == 0


def test_branches_join_the_tree_and_merge_where_they_coincide():
    cands = candidates([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], ids=[[1, 2], [3, 4], [5, 6]])
    cands.branches.append((torch.tensor([1, 3, 9]), math.log(0.9)))
    tree = build_tree(cands, 6, max_depth=3)
    # the branch is likelier than the model's paths: its three nodes come first; [1, 3] is shared
    assert tree.tokens[:3] == [1, 3, 9] and tree.parents[:3] == [-1, 0, 1]
    assert len(set(zip(tree.parents, tree.tokens))) == len(tree)  # no duplicate node


def test_ancestor_mask_and_walk():
    #        anchor
    #       /      \
    #    0:a        1:b
    #    /  \
    #  2:c  3:d
    tokens, parents = [11, 12, 13, 14], [-1, -1, 0, 0]
    mask = ancestor_mask(parents)
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]]
    # target_next per block position [anchor, a, b, c, d]
    assert walk(tokens, parents, [11, 14, 0, 0, 7]) == ([0, 3], 7)
    assert walk(tokens, parents, [12, 0, 5, 0, 0]) == ([1], 5)
    assert walk(tokens, parents, [99, 0, 0, 0, 0]) == ([], 99)


def test_committed_depth_follows_the_written_tokens_along_the_tree():
    from blockspec.decoding.tree import committed_depth

    # anchor -> 10 -> (20 -> 30 | 21); anchor -> 11
    tokens, parents = [10, 11, 20, 21, 30], [-1, -1, 0, 0, 2]
    assert committed_depth(tokens, parents, []) == (0, False)  # nothing written yet
    assert committed_depth(tokens, parents, [10]) == (1, False)  # 10 has children: the next token decides
    assert committed_depth(tokens, parents, [10, 21]) == (2, True)  # a leaf
    assert committed_depth(tokens, parents, [10, 20, 30, 5]) == (3, True)
    assert committed_depth(tokens, parents, [10, 22]) == (1, True)  # left the tree
    assert committed_depth(tokens, parents, [12]) == (0, True)
    assert committed_depth([], [], []) == (0, True)


# --- T = 0: token-identical to greedy decoding ----------------------------------------------

def tree_drafter(kind, target, prompt, ref):
    if kind == "tree-oracle":
        return TreeOracleDrafter(list(prompt) + ref, vocab_size=target.vocab_size)
    if kind == "hybrid-tree":  # the lookup continuation joins the oracle's tree
        from blockspec.drafters.hybrid import HybridDrafter

        return HybridDrafter(TreeOracleDrafter(list(prompt) + ref, vocab_size=target.vocab_size))
    return make_drafter(kind, target, prompt, ref)


def run_tree(target, drafter, prompt, *, budget=10, block=8, max_new=MAX_NEW, stop=EOS, planned=False, stats=None):
    engine = SpecEngine(target, drafter, block, adaptive=planned, tree_budget=budget)
    out = [t for chunk in engine.generate(prompt, max_new_tokens=max_new, stop_token_ids=stop, stats=stats)
           for t in chunk]
    return out, engine


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["tree-oracle", "dflash", "dflash-reduced-vocab", "hybrid-tree", "mtp", "eagle3",
                                  "draft-model"])
@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_tree_greedy_identity(arch, kind, planned, prompt_name):
    target = target_for(arch)
    prompt, ref = PROMPTS[prompt_name], reference(arch, prompt_name)
    stats = GenerationStats(8)
    ours, engine = run_tree(target, tree_drafter(kind, target, prompt, ref), prompt, planned=planned, stats=stats)
    assert_same_or_near_tie(target.model, prompt, ours, ref)
    assert engine.tree_budget == 10 and not stats.notes
    if len(ref) > 1:  # (a reference may end at its first token: no step)
        assert stats.tree_steps > 0 and stats.tree_nodes >= stats.tree_steps


def test_trees_accept_more_than_chains_from_the_same_candidates():
    target = target_for("llama")
    prompt, ref = PROMPTS["len6"], reference("llama", "len6")
    chain, tree = GenerationStats(8), GenerationStats(8)
    run_tree(target, TreeOracleDrafter(prompt + ref), prompt, budget=None, stats=chain)
    run_tree(target, TreeOracleDrafter(prompt + ref), prompt, budget=24, stats=tree)
    assert chain.tree_steps == 0 and tree.tau > chain.tau


def test_a_tree_cut_to_nothing_is_recorded_as_wasted_drafting_and_the_step_is_plain():
    """When the planner cuts a drafted tree to no node, the drafter's pass bought a plain step:
    the planner hears of it (it weighs the source's next plans), and the output stays greedy."""
    from blockspec.decoding.planner import DraftPlanner

    class CutEveryTree(DraftPlanner):
        def __init__(self, max_drafts):
            super().__init__(max_drafts)
            self.drafting_outcomes = []

        def tree_size(self, batch, gains):
            return 0

        def observe_drafting(self, evidence, wasted):
            self.drafting_outcomes.append(wasted)
            super().observe_drafting(evidence, wasted)

    target = target_for("llama")
    prompt, ref = PROMPTS["len6"], reference("llama", "len6")
    planner = CutEveryTree(7)
    engine = SpecEngine(target, TreeOracleDrafter(prompt + ref), 8, adaptive=True, planner=planner, tree_budget=10)
    stats = GenerationStats(8)
    out = [t for chunk in engine.generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=EOS, stats=stats)
           for t in chunk]
    assert_same_or_near_tie(target.model, prompt, out, ref)
    assert planner.drafting_outcomes and all(planner.drafting_outcomes)  # every drafted tree was cut
    assert stats.tree_steps == 0 and stats.tau == 1.0


def test_a_tree_cut_to_nothing_still_teaches_the_planner_its_sources_rates():
    """A withdrawn draft (its tree cut to no node) is scored against what the target then
    writes, once that decides it, and reaches the planner as evidence for its source: else a
    source whose trees keep being cut never learns how its drafts fare, and its plan stays
    where the pooled prior puts it (session 22: 32 steps of one MT-Bench prompt paid a
    drafting pass for a plain step)."""
    from blockspec.decoding.planner import DraftPlanner

    class DraftAllCutAll(DraftPlanner):
        """Drafts in full every step, then cuts every tree to nothing."""

        def __init__(self, max_drafts):
            super().__init__(max_drafts)
            self.observed = []  # (source, drafted, accepted) of every observation

        def plan_sources(self, rows):
            offers = [next(iter(row.items())) for row in rows]
            return [source for source, _ in offers], [min(self.max_drafts, allowed) for _, (_, allowed) in offers]

        def tree_size(self, batch, gains):
            return 0

        def observe(self, evidence, drafted, accepted, predicted=None, nodes=None):
            self.observed.append((evidence.source, drafted, accepted))
            super().observe(evidence, drafted, accepted, predicted, nodes)

    def run(drafted_text):
        planner = DraftAllCutAll(7)
        drafter = TreeOracleDrafter(prompt + drafted_text, top_k=1, miss_prob=0.0)  # top-1: `drafted_text`
        engine = SpecEngine(target, drafter, 8, adaptive=True, planner=planner, tree_budget=10)
        out = [t for chunk in engine.generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=EOS) for t in chunk]
        assert out == ref  # plain steps only: exactly greedy
        return planner.observed

    target = target_for("llama")
    prompt, ref = PROMPTS["len23"], reference("llama", "len23")
    observed = run(ref)  # every draft right: decided only once the target wrote all of it
    assert len(observed) >= len(ref) - 8
    assert all(source == "model" and drafted > 0 and accepted == drafted for source, drafted, accepted in observed)
    observed = run([(t + 1) % target.vocab_size for t in ref])  # every draft wrong at once: decided the next step
    assert len(observed) >= len(ref) - 2
    assert all(drafted > 0 and accepted == 0 for _, drafted, accepted in observed)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_trees_equal_greedy_decoding_alone(arch):
    target = target_for(arch)
    prompts = [PROMPTS["len6"], PROMPTS["len23"], [60, 61, 62, 60, 61, 62, 60]]
    references = [hf_greedy(target.model, p, 30, EOS) for p in prompts]
    drafter = TreeOracleDrafter(prompts[1] + references[1], vocab_size=target.vocab_size)  # wrong for the others
    engine = BatchedSpecEngine(target, drafter, block_size=6, max_batch=2, tree_budget=8)
    outputs = []
    for prompt in prompts:
        out = []
        engine.add(prompt, max_new_tokens=30, stop_token_ids=EOS, on_chunk=out.extend)
        outputs.append(out)
    engine.run()
    for prompt, out, ref in zip(prompts, outputs, references):
        assert_same_or_near_tie(target.model, prompt, out, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eos_inside_a_branch_ends_the_output_there(arch):
    target = target_for(arch)
    prompt = PROMPTS["len6"]
    free = reference(arch, "len6", 60, (-1,))
    index = next(i for i in range(5, len(free)) if free[i] not in free[:i])
    eos = (free[index],)
    expected = hf_greedy(target.model, prompt, 60, eos)
    drafter = TreeOracleDrafter(prompt + free, miss_prob=0.0, vocab_size=target.vocab_size)
    ours, _ = run_tree(target, drafter, prompt, max_new=60, stop=eos)
    assert_same_or_near_tie(target.model, prompt, ours, expected)


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_max_new_tokens_inside_a_tree(max_new):
    target = target_for("qwen3")
    prompt = PROMPTS["len6"]
    free = reference("qwen3", "len6", 60, (-1,))
    drafter = TreeOracleDrafter(prompt + free, miss_prob=0.0, vocab_size=target.vocab_size)
    ours, _ = run_tree(target, drafter, prompt, budget=20, max_new=max_new, stop=(-1,))
    assert ours == free[:max_new]


# --- T > 0: exactly the target's distribution ------------------------------------------------

@pytest.mark.parametrize("params, planned", [(SamplingParams(temperature=1.0), False),
                                             (SamplingParams(temperature=0.8, top_k=6, top_p=0.9), True)])
def test_tree_output_distribution_is_the_targets(params, planned):
    target = tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=2, seed=3)
    engine = SpecEngine(target, dflash(target, sample_drafts=False), BLOCK, adaptive=planned, tree_budget=5)
    counts = empirical_joint(engine, params)
    assert_same_distribution(counts, exact_joint(target, params))


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_trees_of_one_token_at_a_time_drafters_keep_the_targets_distribution(kind):
    """MTP heads and EAGLE-3 draft a chain token by token; asked for candidates, each
    step's best tokens along it become the tree (the argmax chain, at any temperature)."""
    target = tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=2, seed=3)
    torch.manual_seed(2)
    if kind == "mtp":
        from blockspec.drafters.mtp import MTPConfig, MTPDrafter, MTPHeadModel

        model = MTPHeadModel(MTPConfig.for_target(target, block_size=BLOCK))
        drafter_class = MTPDrafter
    else:
        from blockspec.drafters.eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Drafter

        model = Eagle3DraftModel(Eagle3Config.for_target(target, block_size=BLOCK))
        drafter_class = Eagle3Drafter
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    engine = SpecEngine(target, drafter_class(model, target), BLOCK, tree_budget=4)
    assert engine.tree_budget == 4 and not engine.notes
    params = SamplingParams(temperature=0.9, top_k=6)
    assert_same_distribution(empirical_joint(engine, params), exact_joint(target, params))


def test_hybrid_tree_output_distribution_is_the_targets():
    from blockspec.drafters.hybrid import HybridDrafter

    target = tiny_target("gemma3", vocab_size=VOCAB, hidden=32, layers=2, seed=3)
    engine = SpecEngine(target, HybridDrafter(dflash(target, sample_drafts=False)), BLOCK, tree_budget=4)
    params = SamplingParams(temperature=1.0)
    assert_same_distribution(empirical_joint(engine, params), exact_joint(target, params))


def test_seeded_tree_sampling_equals_plain_sampling():
    """Nodes of one depth share that output position's uniform: a seeded request gives
    plain sampling's exact tokens through a tree."""
    target = tiny_target("qwen3")
    params = SamplingParams(temperature=0.9, seed=1234)
    plain = [t for c in SpecEngine(target, None).generate(PROMPTS["len6"], max_new_tokens=30, params=params) for t in c]
    drafter = TreeOracleDrafter(PROMPTS["len6"] + plain, vocab_size=target.vocab_size)
    engine = SpecEngine(target, drafter, 8, tree_budget=10)
    stats = GenerationStats(8)
    ours = [t for c in engine.generate(PROMPTS["len6"], max_new_tokens=30, params=params, stats=stats) for t in c]
    assert ours == plain and stats.tau > 1.5


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("budget, message", [(0, ">= 1"), (-3, ">= 1"), (10 ** 9, "context")])
def test_bad_budgets_are_clear_errors(budget, message):
    target = target_for("llama")
    with pytest.raises(InvalidArgumentError, match=message):
        SpecEngine(target, make_drafter("dflash", target, [], []), 8, tree_budget=budget)


def test_a_drafter_without_distributions_drafts_chains_and_says_so():
    target = target_for("llama")
    prompt, ref = PROMPTS["len6"], reference("llama", "len6")
    stats = GenerationStats(8)
    ours, engine = run_tree(target, make_drafter("prompt-lookup", target, prompt, ref), prompt, stats=stats)
    assert_same_or_near_tie(target.model, prompt, ours, ref)
    assert engine.tree_budget is None and stats.tree_steps == 0
    assert any("no per-position distributions" in note for note in stats.notes)


def test_one_row_keeps_only_the_accepted_path_in_its_cache():
    """Cache compaction: after every tree step the row's cache holds exactly its committed
    tokens but the last (the next anchor), the path moved next to the others."""
    target = target_for("llama")
    prompt = PROMPTS["len23"]
    ref = hf_greedy(target.model, prompt, 60, (-1,))
    engine = SpecEngine(target, TreeOracleDrafter(prompt + ref), 8, tree_budget=30)
    out = []
    row = engine.add(prompt, max_new_tokens=60, stop_token_ids=(-1,), on_chunk=out.extend)
    engine.admit()
    while engine.busy:
        engine.step()
        if engine.busy:
            assert engine.kv.cache.get_seq_length() == len(row.tokens) - 1 and bool(engine.kv.valid.all())
    assert_same_or_near_tie(target.model, prompt, out, ref)
    assert row.stats.tree_nodes > 3 * row.stats.tree_steps and row.stats.tau > 2


def test_batched_tree_slots_off_the_path_become_holes_and_compaction_keeps_outputs():
    target = target_for("qwen3")
    prompts = [PROMPTS["len23"], PROMPTS["len6"]]
    refs = [hf_greedy(target.model, p, 80, (-1,)) for p in prompts]
    engine = BatchedSpecEngine(target, TreeOracleDrafter(prompts[0] + refs[0]), 8, max_batch=2, adaptive=False,
                               tree_budget=30)
    outputs = [[], []]
    for prompt, out in zip(prompts, outputs):
        engine.add(prompt, max_new_tokens=80, stop_token_ids=(-1,), on_chunk=out.extend)
    widths = []
    while engine.busy:
        engine.step()
        if engine.kv.cache is not None:
            widths.append(engine.kv.valid.shape[1])
    assert any(b < a for a, b in zip(widths, widths[1:]))  # compacted at least once
    for prompt, out, ref in zip(prompts, outputs, refs):
        assert_same_or_near_tie(target.model, prompt, out, ref)
