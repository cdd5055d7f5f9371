"""T=0: the engine's output is token-identical to transformers' greedy generate."""

from __future__ import annotations

import functools

import pytest
import torch

from blockspec.decoding.engine import SpecEngine
from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from blockspec.drafters.prompt_lookup import PromptLookupDrafter
from conftest import ARCHITECTURES, OracleDrafter, assert_same_or_near_tie, hf_greedy, tiny_target

PROMPTS = {"len1": [7], "len6": [5, 17, 33, 2, 9, 40], "len23": [(i * 37 + 11) % 90 + 2 for i in range(23)]}
MAX_NEW = 40
EOS = (1,)


@functools.lru_cache(maxsize=None)
def target_for(arch):
    return tiny_target(arch)


@functools.lru_cache(maxsize=None)
def reference(arch, prompt_name, max_new=MAX_NEW, eos=EOS):
    return hf_greedy(target_for(arch).model, PROMPTS[prompt_name], max_new, eos)


def make_drafter(kind, target, prompt, ref, seed=0, dtype=None):
    """`dtype`: the precision a trained drafter computes in (default: the target's)."""
    if kind == "none":
        return None
    if kind == "prompt-lookup":
        return PromptLookupDrafter()
    if kind == "oracle":
        return OracleDrafter(list(prompt) + [ref[0]] + ref[1:], seed=seed, vocab_size=target.vocab_size)
    if kind == "dflash":  # random weights: low acceptance, stresses rollback
        torch.manual_seed(seed)
        config = DFlashConfig.for_target(target, num_layers=2, block_size=16, mask_token_id=target.vocab_size - 1)
        return DFlashDrafter(DFlashDraftModel(config), target, dtype=dtype)
    if kind == "dflash-reduced-vocab":  # a draft vocabulary of 24 of the 96 ids
        torch.manual_seed(seed)
        config = DFlashConfig.for_target(target, num_layers=1, block_size=16, mask_token_id=target.vocab_size - 1)
        config.draft_vocab_size = 24
        model = DFlashDraftModel(config)
        model.d2t.copy_(torch.randperm(target.vocab_size)[:24].sort().values)
        return DFlashDrafter(model, target, dtype=dtype)
    if kind == "dflash-trained-head":  # a head of its own (random rows) over a draft vocabulary of 24 ids
        torch.manual_seed(seed)
        config = DFlashConfig.for_target(target, num_layers=1, block_size=16, mask_token_id=target.vocab_size - 1)
        config.draft_vocab_size, config.trained_head = 24, True
        model = DFlashDraftModel(config)
        model.d2t.copy_(torch.randperm(target.vocab_size)[:24].sort().values)
        return DFlashDrafter(model, target, dtype=dtype)
    if kind == "mtp":  # a random MTP head (reduced draft vocabulary on odd seeds)
        from blockspec.drafters.mtp import MTPConfig, MTPDrafter, MTPHeadModel

        torch.manual_seed(seed)
        config = MTPConfig.for_target(target, block_size=16)
        model = MTPHeadModel(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.3)
        return MTPDrafter(model, target, dtype=dtype)
    if kind == "eagle3":  # a random EAGLE-3 layer with a reduced draft vocabulary (stresses d2t and t2d)
        from blockspec.drafters.eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Drafter

        torch.manual_seed(seed)
        config = Eagle3Config.for_target(target, block_size=16)
        config.draft_vocab_size = 48
        model = Eagle3DraftModel(config)
        model.d2t.copy_(torch.randperm(target.vocab_size)[:48].sort().values)
        return Eagle3Drafter(model, target, dtype=dtype)
    if kind == "draft-model":  # an independent small LM with the same vocabulary
        from blockspec.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(tiny_target("llama", seed=seed + 7, layers=2), target)
    if kind == "hybrid":  # the oracle (often right) beside prompt lookup: both sources get chosen
        from blockspec.drafters.hybrid import HybridDrafter

        return HybridDrafter(make_drafter("oracle", target, prompt, ref, seed))
    raise ValueError(kind)


def run(target, drafter, block, prompt, max_new=MAX_NEW, stop=EOS, planned=False):
    engine = SpecEngine(target, drafter, block, adaptive=planned)
    return [t for chunk in engine.generate(prompt, max_new_tokens=max_new, stop_token_ids=stop) for t in chunk]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["none", "prompt-lookup", "dflash", "dflash-reduced-vocab", "dflash-trained-head", "oracle",
                                  "draft-model", "mtp", "eagle3", "hybrid"])
@pytest.mark.parametrize("block", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_greedy_identity(arch, kind, block, prompt_name):
    target = target_for(arch)
    prompt = PROMPTS[prompt_name]
    ref = reference(arch, prompt_name)
    ours = run(target, make_drafter(kind, target, prompt, ref), block, prompt)
    assert_same_or_near_tie(target.model, prompt, ours, ref)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["dflash", "dflash-reduced-vocab", "dflash-trained-head", "mtp", "eagle3"])
@pytest.mark.parametrize("shape", ["chain", "tree", "batched"])
def test_greedy_identity_with_a_bfloat16_drafter(arch, kind, shape):
    """A drafter computing in bf16 beside a float32 target (what `--drafter-dtype auto`
    picks on CPUs with bf16 matrix units) changes what is drafted, never what is output:
    chains, token trees, and rows batched together."""
    target = target_for(arch)
    prompt = PROMPTS["len23"]
    ref = reference(arch, "len23")
    drafter = make_drafter(kind, target, prompt, ref, dtype=torch.bfloat16)
    assert next(drafter.model.parameters()).dtype == torch.bfloat16 and target.dtype == torch.float32
    if shape == "batched":  # beside another row: the drafter's padded, masked pass in bf16
        engine = SpecEngine(target, drafter, 8, max_batch=2)
        outputs = {name: [] for name in ("len23", "len6")}
        for name, tokens in outputs.items():
            engine.add(PROMPTS[name], max_new_tokens=MAX_NEW, stop_token_ids=EOS, on_chunk=tokens.extend)
        engine.run()
        assert_same_or_near_tie(target.model, PROMPTS["len6"], outputs["len6"], reference(arch, "len6"))
        ours = outputs["len23"]
    else:
        engine = SpecEngine(target, drafter, 8, tree_budget=12 if shape == "tree" else None)
        ours = [t for chunk in engine.generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=EOS) for t in chunk]
    assert_same_or_near_tie(target.model, prompt, ours, ref)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["prompt-lookup", "dflash", "oracle", "hybrid"])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_greedy_identity_with_planned_draft_lengths(arch, kind, prompt_name):
    """The single-sequence planner (draft lengths from measured costs, plain steps
    included) changes how many tokens are drafted, never which are output."""
    target = target_for(arch)
    prompt = PROMPTS[prompt_name]
    ref = reference(arch, prompt_name)
    ours = run(target, make_drafter(kind, target, prompt, ref), 16, prompt, planned=True)
    assert_same_or_near_tie(target.model, prompt, ours, ref)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["prompt-lookup", "dflash", "oracle"])
def test_eos_mid_block(arch, kind):
    """An EOS that the verifier accepts in the middle of a block ends the output there."""
    target = target_for(arch)
    prompt = PROMPTS["len6"]
    free = reference(arch, "len6", 60, (-1,))  # no EOS: the continuation to pick one from
    index = next(i for i in range(5, len(free)) if free[i] not in free[:i])
    eos = (free[index],)
    ref = hf_greedy(target.model, prompt, 60, eos)
    assert ref[-1] == eos[0] and len(ref) == index + 1
    drafter = make_drafter(kind, target, prompt, free)
    if kind == "oracle":
        drafter.corrupt_prob = 0.0  # drafts run THROUGH the EOS: it lands mid-block
    ours = run(target, drafter, 8, prompt, max_new=60, stop=eos)
    assert_same_or_near_tie(target.model, prompt, ours, ref)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("max_new", [1, 2, 13, 17])
def test_max_new_tokens_mid_block(arch, max_new):
    target = target_for(arch)
    prompt = PROMPTS["len6"]
    free = reference(arch, "len6", 60, (-1,))
    drafter = OracleDrafter(prompt + free, corrupt_prob=0.0)
    ours = run(target, drafter, 8, prompt, max_new=max_new, stop=(-1,))
    assert ours == free[:max_new]
