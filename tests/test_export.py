"""Export / import of drafters, and cross-checks against transformers' own DFlash
implementation (`muse_glimmer_assistant`, `generate(speculation_type="dflash")`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig, MuseGlimmerAssistantModel

from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.stats import GenerationStats
from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from blockspec.errors import DrafterMismatchError, InvalidArgumentError
from blockspec.export.convert import detect_format, export_drafter, import_drafter
from blockspec.targets.adapter import TargetAdapter
from conftest import tiny_model


def random_drafter(target, block=8, draft_vocab_size=None, seed=0, layers=2):
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target, num_layers=layers, block_size=block, mask_token_id=target.vocab_size - 1,
                                     target_layer_ids=[0, 1, 2])
    config.draft_vocab_size = draft_vocab_size
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.3)
        if draft_vocab_size:
            model.d2t.copy_(torch.randperm(target.vocab_size)[:draft_vocab_size].sort().values)
            model.stored_head = model.head(target)[0].detach().clone()  # as the trainer does
    return model.eval()


@pytest.fixture()
def target():
    return TargetAdapter(tiny_model("llama"), tokenizer=None, name="tiny-llama")


def tensors_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("fmt", ["transformers", "speculators"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_round_trip_keeps_weights_bit_identical(target, tmp_path, fmt, dtype):
    draft_vocab = 40 if fmt == "speculators" else None
    random_drafter(target, draft_vocab_size=draft_vocab).save_pretrained(tmp_path / "native", dtype=dtype)
    export_drafter(tmp_path / "native", fmt, tmp_path / "out", target=target)
    assert detect_format(tmp_path / "out") == fmt
    import_drafter(tmp_path / "out", tmp_path / "back")
    tensors_equal(load_file(tmp_path / "native" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors"))
    assert DFlashDraftModel.from_pretrained(tmp_path / "back").config == DFlashDraftModel.from_pretrained(
        tmp_path / "native").config


def test_transformers_export_sets_every_field_its_defaults_get_wrong(target, tmp_path):
    random_drafter(target).save_pretrained(tmp_path / "native")
    export_drafter(tmp_path / "native", "transformers", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "muse_glimmer_assistant"
    assert config["layer_types"] == ["full_attention", "full_attention"]  # its default: sliding, window 2048
    assert config["rope_parameters"]["rope_theta"] == target.rope_theta  # its default: 500000
    assert config["target_layer_ids"] == [0, 1, 2] and config["block_size"] == 8
    assert config["mask_token_id"] == target.vocab_size - 1
    names = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight", "norm.weight"} <= names
    assert not {"fc.weight", "hidden_norm.weight"} & names
    loaded = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "hf")
    assert loaded.config.layer_types == ["full_attention", "full_attention"]
    assert set(loaded.state_dict()) - {"rotary_emb.inv_freq", "rotary_emb.original_inv_freq"} == names


def test_speculators_export_fields(target, tmp_path):
    random_drafter(target, draft_vocab_size=40).save_pretrained(tmp_path / "native")
    export_drafter(tmp_path / "native", "speculators", tmp_path / "spec", target=target, verifier="org/target")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    # speculators counts the embedding output as layer 0: our ids + 1
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["sliding_window_non_causal"] is True  # False would make vLLM attend causally in the block
    assert config["draft_vocab_size"] == 40 and config["block_size"] == 8
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    tensors = load_file(tmp_path / "spec" / "model.safetensors")
    d2t = DFlashDraftModel.from_pretrained(tmp_path / "native").d2t
    assert torch.equal(tensors["d2t"] + torch.arange(40), d2t)  # offsets
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 40 and bool(tensors["t2d"][d2t].all())
    torch.testing.assert_close(tensors["lm_head.weight"], target.lm_head.weight[d2t])
    native = load_file(tmp_path / "native" / "model.safetensors")  # the native folder carries the same map and head
    assert torch.equal(native["d2t"], tensors["d2t"]) and torch.equal(native["lm_head.weight"], tensors["lm_head.weight"])


def test_speculators_export_refuses_the_last_target_layer(target, tmp_path):
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target, num_layers=1, block_size=4, mask_token_id=5, target_layer_ids=[1, 3])
    DFlashDraftModel(config).save_pretrained(tmp_path / "native")
    with pytest.raises(InvalidArgumentError, match="last layer"):
        export_drafter(tmp_path / "native", "speculators", tmp_path / "spec")


def test_same_draft_block_as_transformers_on_a_fixed_context(target, tmp_path):
    ours = random_drafter(target)
    ours.save_pretrained(tmp_path / "native")
    export_drafter(tmp_path / "native", "transformers", tmp_path / "hf")
    theirs = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "hf").eval()
    torch.manual_seed(1)
    context_len, block = 11, ours.config.block_size
    features = torch.randn(1, context_len, 3 * target.hidden_size)
    block_ids = torch.tensor([[17] + [ours.config.mask_token_id] * (block - 1)])
    embeds = target.embed(block_ids)
    positions = torch.arange(context_len + block)[None]
    with torch.inference_mode():
        kv = ours.context_key_values(features, positions[:, :context_len])
        mine = ours(embeds, positions[:, context_len:], kv)
        reference = theirs(noise_embeds=embeds, context_hidden_states=features, position_ids=positions).last_hidden_state
        head = target.lm_head.weight
        drafted = (mine[0, 1:] @ head.T).argmax(-1)
        assert torch.equal(drafted, (reference[0, 1:] @ head.T).argmax(-1))
    torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-4)
    assert drafted.unique().numel() > 1  # a real draft, not one token repeated


def test_transformers_dflash_generate_gives_our_tokens(tmp_path):
    model = tiny_model("llama")
    target = TargetAdapter(model, tokenizer=None, name="tiny-llama")
    drafter = random_drafter(target, block=4)
    drafter.save_pretrained(tmp_path / "native")
    export_drafter(tmp_path / "native", "transformers", tmp_path / "hf")
    assistant = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "hf").eval()
    prompt = [5, 9, 13, 7, 3, 22, 40]
    config = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=[1], pad_token_id=1, bos_token_id=None,
                              speculation_type="dflash")
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             assistant_model=assistant, generation_config=config)
    theirs = out[0, len(prompt):].tolist()
    stats = GenerationStats(4)
    engine = SpecEngine(target, DFlashDrafter(drafter, target), 4)
    mine = [t for chunk in engine.generate(prompt, max_new_tokens=24, stats=stats) for t in chunk]
    assert mine == theirs


def test_import_rejects_what_is_not_a_drafter(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "x" / "model.safetensors").write_bytes(b"")
    with pytest.raises(DrafterMismatchError, match="not a DFlash drafter"):
        import_drafter(tmp_path / "x", tmp_path / "y")
    with pytest.raises(InvalidArgumentError, match="unknown export format"):
        export_drafter(tmp_path / "x", "onnx", tmp_path / "z")


@pytest.mark.real
def test_shipped_drafter_drafts_the_same_block_in_transformers(tmp_path):
    """The default target and the shipped drafter: transformers' DFlash model, loaded
    from our export, drafts the same block as blockspec on a real context."""
    from blockspec.drafters.registry import shipped_drafter_for
    from blockspec.targets.loading import load_target

    target = load_target("default")
    folder = shipped_drafter_for(target)
    export_drafter(folder, "transformers", tmp_path / "hf", target=target)
    theirs = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = DFlashDraftModel.from_pretrained(folder).float().eval()
    ids = torch.tensor(target.encode_prompt("Natalia sold clips to 48 of her friends in April. How many in May?"))
    with torch.inference_mode():
        target.reset()
        features = target.forward(ids, ours.config.target_layer_ids).features[None]
        block = ours.config.block_size
        block_ids = torch.tensor([[int(ids[-1])] + [ours.config.mask_token_id] * (block - 1)])
        embeds = target.embed(block_ids)
        positions = torch.arange(ids.numel() + block)[None]
        mine = ours(embeds, positions[:, ids.numel():], ours.context_key_values(features, positions[:, :ids.numel()]))
        reference = theirs(noise_embeds=embeds, context_hidden_states=features, position_ids=positions).last_hidden_state
        head = target.lm_head.weight  # transformers drafts over the full vocabulary
        assert torch.equal((mine[0, 1:] @ head.T).argmax(-1), (reference[0, 1:] @ head.T).argmax(-1))
    torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-3)


def test_an_absolute_id_map_is_refused_with_a_clear_message(target, tmp_path):
    from safetensors.torch import save_file

    random_drafter(target, draft_vocab_size=40).save_pretrained(tmp_path / "native")
    tensors = load_file(tmp_path / "native" / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(40)  # absolute ids, as checkpoints before 0.1 stored them
    tensors["d2t"][-1] = target.vocab_size + 5  # and one beyond the vocabulary
    save_file(tensors, tmp_path / "native" / "model.safetensors")
    with pytest.raises(DrafterMismatchError, match="offsets"):
        DFlashDraftModel.from_pretrained(tmp_path / "native")
