"""T > 0: the engine's output distribution is exactly the target's, for both acceptance rules.

A tiny target with an 8-token vocabulary; 4 new tokens with block size 3, so the
span after the first token (sampled at prefill, without drafting) crosses a block
boundary. The exact joint distribution of tokens 2..4 is enumerated from the target
itself (one batched pass over all 8^4 continuations); the engine's empirical one
is compared with a chi-square test at p = 0.001 with a fixed seed.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from blockspec.decoding.verify import accept_rejection_sampling
from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.sampling import SamplingParams, TokenSampler, warp_probs
from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from conftest import tiny_target

VOCAB, NEW, BLOCK, SAMPLES = 8, 4, 3, 3000
PROMPT = [2, 5, 3]


def exact_joint(target, params) -> np.ndarray:
    """P(t2, t3, t4) under the target (t1 marginalised), shape [8, 8, 8]."""
    sequences = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    inputs = torch.cat([torch.tensor(PROMPT).expand(len(sequences), -1), sequences], dim=1)
    with torch.inference_mode():
        logits = target.model(inputs).logits  # [N, len, V]
    probability = torch.ones(len(sequences), dtype=torch.float64)
    for step in range(NEW):
        row = logits[:, len(PROMPT) - 1 + step]
        probability *= warp_probs(row, params).double().gather(1, sequences[:, step:step + 1]).view(-1)
    return probability.view(VOCAB, VOCAB, VOCAB, VOCAB).sum(0).numpy()


def empirical_joint(engine, params) -> np.ndarray:
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    for i in range(SAMPLES):
        seeded = SamplingParams(params.temperature, params.top_p, params.top_k, seed=1000 + i)
        out = [t for c in engine.generate(PROMPT, max_new_tokens=NEW, params=seeded, stop_token_ids=()) for t in c]
        counts[tuple(out[1:])] += 1
    return counts


def assert_same_distribution(counts, probabilities):
    expected = probabilities.ravel() / probabilities.sum() * counts.sum()  # float64 sums to 1 only within 1e-7
    observed = counts.ravel()
    order = np.argsort(expected)
    # pool the rarest cells until every bin expects at least 5
    bins_obs, bins_exp, acc_o, acc_e = [], [], 0.0, 0.0
    for index in order:
        acc_o += observed[index]
        acc_e += expected[index]
        if acc_e >= 5:
            bins_obs.append(acc_o)
            bins_exp.append(acc_e)
            acc_o = acc_e = 0.0
    bins_exp[-1] += acc_e
    bins_obs[-1] += acc_o
    result = chisquare(bins_obs, bins_exp)
    assert result.pvalue > 1e-3, f"distribution differs: chi2={result.statistic:.1f}, p={result.pvalue:.2e}"
    return result


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=2, seed=3)


def dflash(target, sample_drafts, draft_vocab=None, dtype=None, trained_head=False):
    """`trained_head`: the drafter's own head (random rows, unlike the target's)."""
    torch.manual_seed(1)
    config = DFlashConfig.for_target(target, num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1)
    config.draft_vocab_size = len(draft_vocab) if draft_vocab else None
    config.trained_head = trained_head
    model = DFlashDraftModel(config)
    if draft_vocab:
        model.d2t.copy_(torch.tensor(draft_vocab))
    return DFlashDrafter(model, target, sample_drafts=sample_drafts, dtype=dtype)


@pytest.mark.parametrize(
    "rule, params",
    [
        ("one-hot drafts, accept on matching samples", SamplingParams(temperature=1.0)),
        ("sampled drafts, rejection sampling", SamplingParams(temperature=1.0)),
        ("sampled drafts, rejection sampling, top-k/top-p", SamplingParams(temperature=0.8, top_k=6, top_p=0.9)),
        ("sampled drafts from a reduced draft vocabulary, rejection sampling", SamplingParams(temperature=1.0)),
        ("sampled drafts through a trained head over a reduced vocabulary, rejection sampling",
         SamplingParams(temperature=1.0)),
        ("sampled drafts from an independent draft model, rejection sampling", SamplingParams(temperature=0.9)),
        ("sampled drafts from an MTP head with a reduced vocabulary, rejection sampling",
         SamplingParams(temperature=1.0, top_k=6)),
        ("sampled drafts from an EAGLE-3 layer with a reduced vocabulary, rejection sampling",
         SamplingParams(temperature=1.0)),
        ("sampled drafts from an EAGLE-3 layer with a reduced vocabulary in bfloat16, rejection sampling",
         SamplingParams(temperature=1.0)),
        ("sampled drafts from a DFlash drafter in bfloat16 (the target float32), rejection sampling",
         SamplingParams(temperature=1.0)),
        ("hybrid of prompt lookup and sampled DFlash drafts, each step planned", SamplingParams(temperature=1.0)),
    ],
)
def test_output_distribution_is_the_targets(target, rule, params):
    draft_vocab = [0, 2, 3, 5, 6] if "reduced" in rule else None
    dtype = torch.bfloat16 if "bfloat16" in rule else None  # the drafter's precision
    if "MTP" in rule:
        from blockspec.drafters.mtp import MTPConfig, MTPDrafter, MTPHeadModel

        torch.manual_seed(2)
        config = MTPConfig.for_target(target, block_size=BLOCK)
        config.draft_vocab_size = 5
        model = MTPHeadModel(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.5)
            model.d2t.copy_(torch.tensor([0, 2, 3, 5, 6]))
        drafter = MTPDrafter(model, target)
    elif "EAGLE-3" in rule:
        from blockspec.drafters.eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Drafter

        torch.manual_seed(4)
        config = Eagle3Config.for_target(target, block_size=BLOCK)
        config.draft_vocab_size = 5
        model = Eagle3DraftModel(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.5)
            model.d2t.copy_(torch.tensor([0, 2, 3, 5, 6]))
        drafter = Eagle3Drafter(model, target, dtype=dtype)
    elif "draft model" in rule:
        from blockspec.drafters.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter(tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=1, seed=9), target)
    elif "hybrid" in rule:
        from blockspec.drafters.hybrid import HybridDrafter

        drafter = HybridDrafter(dflash(target, True))
    else:
        drafter = dflash(target, rule.startswith("sampled"), draft_vocab, dtype, trained_head="trained head" in rule)
    engine = SpecEngine(target, drafter, BLOCK, adaptive="planned" in rule)
    counts = empirical_joint(engine, params)
    probabilities = exact_joint(target, params)
    assert_same_distribution(counts, probabilities)


def test_the_check_detects_a_biased_sampler(target):
    """The statistical test has power: plain sampling at a wrong temperature fails it."""
    engine = SpecEngine(target, None, 1)
    counts = empirical_joint(engine, SamplingParams(temperature=0.6))
    with pytest.raises(AssertionError, match="distribution differs"):
        assert_same_distribution(counts, exact_joint(target, SamplingParams(temperature=1.0)))


def test_rejection_rule_single_position_exact():
    """accept-or-residual reproduces p exactly for a fixed q (one position, many draws)."""
    generator = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    params = SamplingParams(temperature=1.0)
    p = warp_probs(p_logits[:1], params)[0].double().numpy()
    counts = np.zeros(4)
    for draw in range(20000):
        draft = torch.multinomial(q[0], 1, generator=generator)
        accepted, bonus = accept_rejection_sampling(p_logits, draft, q, params, TokenSampler(draw), 0)
        counts[int(draft[0]) if accepted else bonus] += 1
    assert chisquare(counts, p / p.sum() * counts.sum()).pvalue > 1e-3


def test_a_seeded_request_gives_the_same_text_with_any_drafting_alone_or_batched():
    """The target's random choices are keyed by output position (TokenSampler): at T > 0 a
    seeded request is plain sampling's text, whatever was drafted, batched beside others or not."""
    from blockspec.decoding.engine import BatchedSpecEngine
    from conftest import OracleDrafter

    target = tiny_target("llama", vocab_size=96)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    plain = [t for c in SpecEngine(target, None, 1).generate(PROMPT, max_new_tokens=40, params=params,
                                                            stop_token_ids=()) for t in c]
    drafter = OracleDrafter(plain, corrupt_prob=0.5, seed=3)
    drafted = [t for c in SpecEngine(target, drafter, 6).generate(PROMPT, max_new_tokens=40, params=params,
                                                                  stop_token_ids=()) for t in c]
    assert drafted == plain
    batched = BatchedSpecEngine(target, OracleDrafter(plain, corrupt_prob=0.3, seed=5), 6, max_batch=4)
    outputs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for index, (prompt, seed) in enumerate([(PROMPT, 7), ([4, 4, 1, 9], 8), (PROMPT, 99)]):
        batched.add(prompt, max_new_tokens=40, params=SamplingParams(temperature=0.9, top_p=0.95, seed=seed),
                    stop_token_ids=(), on_chunk=outputs[index].extend, on_done=lambda stats: None)
    while batched.busy:
        batched.step()
    assert outputs[0] == plain
    assert outputs[2] != plain  # another seed, another text


def test_a_tiny_temperature_is_greedy_not_an_overflow():
    logits = torch.tensor([[3.0, 1.0, 2.9, -50.0]])
    probs = warp_probs(logits, SamplingParams(temperature=1e-37))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
