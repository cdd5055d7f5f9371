"""Standalone diffusion decoding (lossy by design): determinism, the confidence rule,
one target pass per block, the agreement it reports, and that it never claims losslessness."""

from __future__ import annotations

import pytest
import torch

from blockspec.decoding.diffusion import DiffusionDecoder, DiffusionStats, unmask_order
from blockspec.decoding.draft import DraftRequest
from blockspec.decoding.sampling import SamplingParams
from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from blockspec.errors import InvalidArgumentError
from conftest import tiny_target

PROMPT = [5, 17, 33, 2, 9, 40]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def drafter_for(target, block=8, seed=0):
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target, num_layers=1, block_size=block, mask_token_id=target.vocab_size - 1)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.3)
    return DFlashDrafter(model, target)


def run(decoder, params=SamplingParams(), max_new=30, stats=None):
    return [t for chunk in decoder.generate(PROMPT, max_new_tokens=max_new, params=params, stop_token_ids=(),
                                            stats=stats) for t in chunk]


def test_unmask_order_confidence_rule():
    confidence = torch.tensor([0.9, 0.2, 0.8, 0.95, 0.1])
    masked = torch.tensor([True, True, True, False, True])
    # 4 masked positions over 2 passes: the 2 most confident still masked (never position 3)
    assert sorted(unmask_order(confidence, masked, 2, None).tolist()) == [0, 2]
    assert unmask_order(confidence, masked, 4, None).tolist() == [0]  # ceil(4 / 4) = 1
    assert sorted(unmask_order(confidence, masked, 1, None).tolist()) == [0, 1, 2, 4]  # last pass: all
    assert sorted(unmask_order(confidence, masked, 3, 0.5).tolist()) == [0, 2]  # threshold: all above it
    assert unmask_order(confidence, masked, 3, 0.99).tolist() == [0]  # none above: the single best


def test_greedy_is_deterministic_and_one_pass_drafts_what_the_drafter_proposes(target):
    drafter = drafter_for(target)
    decoder = DiffusionDecoder(target, drafter, block_size=8, steps=1)
    stats = DiffusionStats(8)
    first = run(decoder, stats=stats)
    assert first == run(decoder)
    assert len(first) == 30
    # one drafter pass and one target pass per block: 29 tokens after the first in blocks of 7
    assert stats.blocks == stats.drafter_passes == 5
    # the first block is exactly the drafter's greedy proposal on the prompt
    target.reset()
    out = target.forward(torch.tensor(PROMPT), drafter.target_layer_ids)
    drafter.begin(torch.tensor(PROMPT), out.features)
    proposal = drafter.propose([DraftRequest(drafter, torch.tensor(PROMPT + [first[0]]), 7, SamplingParams())])[0]
    proposal = proposal.tokens.tolist()
    assert first[1:8] == proposal


def test_iterative_unmasking_one_position_per_pass(target):
    decoder = DiffusionDecoder(target, drafter_for(target), block_size=8, steps=7)
    stats = DiffusionStats(8)
    out = run(decoder, max_new=15, stats=stats)
    assert len(out) == 15 and stats.blocks == 2 and stats.drafter_passes == 14
    assert out == run(decoder, max_new=15)


def test_agreement_is_the_share_of_tokens_the_target_would_choose(target):
    decoder = DiffusionDecoder(target, drafter_for(target), block_size=4, steps=2)
    stats = DiffusionStats(4)
    out = run(decoder, max_new=20, stats=stats)
    with torch.inference_mode():
        logits = target.model(torch.tensor([PROMPT + out])).logits[0]
    greedy = logits[len(PROMPT) - 1:-1].argmax(-1).tolist()  # the target's choice at each new position
    agreed = sum(int(a == b) for a, b in zip(greedy[1:], out[1:]))  # the first token is the target's own
    assert stats.checked == len(out) - 1 and stats.agreed == agreed
    assert greedy[0] == out[0]


def test_sampling_is_seeded_and_never_claims_losslessness(target):
    decoder = DiffusionDecoder(target, drafter_for(target), block_size=8, steps=3)
    params = SamplingParams(temperature=1.0, seed=4)
    assert run(decoder, params) == run(decoder, params)
    stats = DiffusionStats(8)
    run(decoder, params, stats=stats)
    assert stats.as_dict()["lossless"] is False


def test_bad_settings(target):
    drafter = drafter_for(target)
    with pytest.raises(InvalidArgumentError, match="steps"):
        DiffusionDecoder(target, drafter, block_size=8, steps=8)
    with pytest.raises(InvalidArgumentError, match="threshold"):
        DiffusionDecoder(target, drafter, block_size=8, threshold=1.5)
    with pytest.raises(InvalidArgumentError, match="DFlash"):
        DiffusionDecoder(target, None, block_size=8)
