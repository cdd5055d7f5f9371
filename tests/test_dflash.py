"""The DFlash drafter: layer choice, context bookkeeping, attention shape, checkpoint format, fit checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.decoding.draft import Draft, DraftRequest
from blockspec.drafters.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    DFlashDrafter,
    default_target_layer_ids,
    load_dflash,
)
from blockspec.errors import DrafterMismatchError, InvalidArgumentError
from conftest import hf_greedy, tiny_target


def make(target, layers=2, block=8, seed=0, **options):
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target, num_layers=layers, block_size=block, mask_token_id=target.vocab_size - 1)
    return DFlashDrafter(DFlashDraftModel(config), target, **options)


def test_default_target_layer_ids_follow_the_reference_rule():
    assert default_target_layer_ids(30, 1) == [15]
    # round(1 + i * 26 / 4): 7.5 rounds half to even -> 8, 20.5 -> 20
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's released drafter


class OracleDFlash(DFlashDrafter):
    """Real DFlash context bookkeeping, but drafts taken from the known answer, so that
    acceptance is high and varied (the random weights alone accept almost nothing)."""

    def __init__(self, *args, answer, **kwargs):
        super().__init__(*args, **kwargs)
        self.answer, self.step = answer, 0

    def propose(self, requests):
        super().propose(requests)  # exercise the real pass
        (request,) = requests
        self.step += 1
        start = request.token_ids.numel()
        tokens = torch.tensor(self.answer[start:start + request.num_drafts], dtype=torch.long)
        if tokens.numel() > 2 and self.step % 2:
            tokens[self.step % tokens.numel()] = 0  # reject from a varying position
        return [Draft(tokens=tokens)]


@pytest.mark.parametrize("window", [None, 5])
def test_context_cache_holds_target_features_of_every_committed_position(window):
    """After a generation the drafter's cached context K/V equal those computed from ONE
    target pass over the committed sequence (all but the last bonus token)."""
    target = tiny_target("qwen3")
    prompt = [5, 17, 33, 2, 9, 40]
    answer = prompt + hf_greedy(target.model, prompt, 30, (-1,))
    drafter = OracleDFlash(make(target).model, target, answer=answer, context_window=window)
    engine = SpecEngine(target, drafter, 8)
    row = engine.add(prompt, max_new_tokens=30, stop_token_ids=(-1,))
    engine.run()
    assert row.tokens == answer
    row.catch_up_drafter()  # the last step's tokens wait until the drafter drafts next
    drafter = row.drafter  # this sequence's fork
    committed = torch.tensor(answer[:-1])
    with torch.inference_mode():
        hidden = target.model(committed[None], output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in drafter.target_layer_ids], dim=-1)
        expected = drafter.model.context_key_values(features, torch.arange(committed.numel())[None])
    assert drafter._context_len == committed.numel()
    for (k, v), (ek, ev) in zip(drafter._context_kv, expected):
        if window:
            ek, ev = ek[:, :, -window:], ev[:, :, -window:]
        torch.testing.assert_close(k, ek, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, ev, rtol=1e-4, atol=1e-4)


def test_attention_inside_the_block_is_bidirectional_and_sees_the_context():
    target = tiny_target("llama")
    model = make(target).model
    features = torch.randn(1, 6, len(model.config.target_layer_ids) * target.hidden_size)
    context = model.context_key_values(features, torch.arange(6)[None])
    embeds = torch.randn(1, 4, target.hidden_size)
    positions = torch.arange(6, 10)[None]
    with torch.inference_mode():
        base = model(embeds, positions, context)
        changed_last = embeds.clone()
        changed_last[0, 3] += 1.0
        # position 0 reacts to a LATER block position: no causal mask inside the block
        assert not torch.allclose(model(changed_last, positions, context)[0, 0], base[0, 0])
        other_context = model.context_key_values(features + 1.0, torch.arange(6)[None])
        assert not torch.allclose(model(embeds, positions, other_context)[0, 0], base[0, 0])


def test_checkpoint_round_trip_reference_format(tmp_path):
    target = tiny_target("qwen3")
    drafter = make(target, layers=3)
    folder = tmp_path / "drafter"
    drafter.model.save_pretrained(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # nothing half-written left behind
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 8 and config["num_target_layers"] == target.num_layers
    assert config["dflash_config"] == {"mask_token_id": target.vocab_size - 1,
                                       "target_layer_ids": drafter.model.config.target_layer_ids}
    assert config["layer_types"] == ["full_attention"] * 3
    names = set(load_file(folder / "model.safetensors"))
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    assert names == {f"layers.{i}.{n}" for i in range(3) for n in per_layer} | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    loaded = load_dflash(folder, target)
    prompt = torch.tensor([5, 17, 33, 2, 9, 40])
    with torch.inference_mode():
        target.reset()
        features = target.forward(prompt, drafter.target_layer_ids).features
    drafts = []
    for d in (drafter, loaded):
        d.begin(prompt, features)
        drafts.append(d.propose([DraftRequest(d, prompt, 7, SamplingParams())])[0].tokens)
    assert torch.equal(drafts[0], drafts[1])
    # saving again over an existing folder replaces it atomically
    loaded.model.save_pretrained(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


@pytest.mark.parametrize("kernel", ["weight-first", "onednn"])
def test_a_loaded_drafter_runs_its_head_in_the_machines_kernel_with_the_same_logits(tmp_path, monkeypatch, kernel):
    from blockspec.drafters.registry import load_drafter
    from blockspec.targets import linear_kernels

    if kernel == "onednn" and not linear_kernels.onednn_available():
        pytest.skip("this torch build has no oneDNN linear kernels")
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, kernel)
    target = tiny_target("qwen3")
    drafter = make(target)
    drafter.model.save_pretrained(tmp_path / "d")
    loaded = load_drafter(str(tmp_path / "d"), target)
    # the head (borrowed from the target) is dispatched as the drafter's own Linears are
    assert isinstance(loaded.head, linear_kernels.RowDispatchLinear)
    assert isinstance(loaded.model.layers[0].mlp.gate_proj, linear_kernels.RowDispatchLinear)
    assert not isinstance(drafter.head, linear_kernels.RowDispatchLinear)
    assert not loaded.head.weight.requires_grad
    prompt = torch.tensor([5, 17, 33, 2, 9, 40])
    with torch.inference_mode():
        target.reset()
        features = target.forward(prompt, drafter.target_layer_ids).features
    for width in (1, 7):  # one draft, and a block of 8 (the kernel the machine picks differs by rows)
        logits = []
        for d in (drafter, loaded):
            d.begin(prompt, features)
            block = torch.full((width + 1,), drafter.mask_token_id)
            block[0] = prompt[-1]
            logits.append(d.block_logits(block, prompt.numel() - 1))
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)


def test_drafter_that_does_not_fit_the_target_is_refused(tmp_path):
    target = tiny_target("llama")
    other = tiny_target("llama", hidden=32)
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        DFlashDrafter(make(other).model, target)
    config = DFlashConfig.for_target(target, num_layers=1, target_layer_ids=[2, 9])
    with pytest.raises(DrafterMismatchError, match="target_layer_ids"):
        DFlashDrafter(DFlashDraftModel(config), target)
    config = DFlashConfig.for_target(target, num_layers=1, mask_token_id=500)
    with pytest.raises(DrafterMismatchError, match="mask_token_id"):
        DFlashDrafter(DFlashDraftModel(config), target)
    small_vocab = tiny_target("llama", vocab_size=64)
    with pytest.raises(DrafterMismatchError, match="vocabulary"):
        DFlashDrafter(make(small_vocab).model, target)
    folder = tmp_path / "bad"
    make(target).model.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    weights["layers.0.self_attn.qproj.weight"] = weights.pop("layers.0.self_attn.q_proj.weight")
    from safetensors.torch import save_file
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(DrafterMismatchError, match="weight names"):
        load_dflash(folder, target)


def test_block_size_beyond_the_drafter_is_refused():
    target = tiny_target("llama")
    with pytest.raises(InvalidArgumentError, match="larger than the drafter"):
        SpecEngine(target, make(target, block=8), 16)
    with pytest.raises(InvalidArgumentError, match="block size"):
        SpecEngine(target, make(target, block=8), 0)


def test_fingerprint_refuses_a_drafter_for_another_tokenizer_unless_forced():
    target = tiny_target("llama")
    model = make(target).model
    model.config.target = {**model.config.target, "name": "other-model", "tokenizer_sha256": "0" * 64}
    target.fingerprint = lambda: {"tokenizer_sha256": "f" * 64}
    with pytest.raises(DrafterMismatchError, match="different tokenizer"):
        DFlashDrafter(model, target)
    DFlashDrafter(model, target, force=True)


def test_check_drafter_names_each_problem(tmp_path):
    from safetensors.torch import save_file

    from blockspec.export.check import check_drafter

    target = tiny_target("llama")
    folder = tmp_path / "d"
    make(target).model.save_pretrained(folder)
    assert check_drafter(folder, target) == []
    weights = load_file(folder / "model.safetensors")
    weights["layers.0.mlp.up_proj.weight"] = weights["layers.0.mlp.up_proj.weight"][:, :10].contiguous()
    weights["extra.weight"] = weights.pop("norm.weight")
    save_file(weights, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 40]
    (folder / "config.json").write_text(json.dumps(config))
    problems = "\n".join(check_drafter(folder, target))
    assert "target_layer_ids [40]" in problems
    assert "`norm.weight` is missing" in problems
    assert "`extra.weight` is not a DFlash weight" in problems
    assert "`layers.0.mlp.up_proj.weight` has shape" in problems
    del config["block_size"]
    (folder / "config.json").write_text(json.dumps(config))
    assert check_drafter(folder, target) == ["config.json lacks `block_size`"]
