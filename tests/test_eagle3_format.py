"""What vLLM and SGLang read from an EAGLE-3 drafter folder, pinned against what blockspec writes.

Neither engine can be installed beside torch 2.13 here; their readers are transcribed
from source (vLLM 0.33.0 `vllm/model_executor/models/llama_eagle3.py` and
`vllm/v1/worker/gpu_model_runner.py`; SGLang 0.5.23 `sglang/srt/models/llama_eagle3.py`,
`sglang/srt/models/llama.py` and `model_runner_components/spec_aux_hidden_state.py`),
each helper naming the function it comes from.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockspec.drafters.eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Drafter, default_eagle3_layer_ids
from blockspec.export.check import check_drafter
from blockspec.export.convert import export_drafter, import_drafter
from blockspec.targets.adapter import TargetAdapter
from conftest import tiny_model

NUM_LAYERS = 12  # enough for the engines' default (2, L//2, L-3) to be three distinct layers

# vLLM 0.33.0 registry.py _SPECULATIVE_DECODING_MODELS / SGLang 0.5.23 llama_eagle3.py EntryClass
VLLM_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}
SGLANG_ARCHITECTURES = {"LlamaForCausalLMEagle3"}
# fields both readers take from config.json without a default that fits a blockspec drafter
REQUIRED = ["model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "vocab_size", "draft_vocab_size", "max_position_embeddings"]


@pytest.fixture(scope="module")
def target():
    return TargetAdapter(tiny_model("llama", layers=NUM_LAYERS), tokenizer=None, name="tiny-llama-12")


def build(target, layer_ids=None, draft_vocab=None) -> Eagle3DraftModel:
    torch.manual_seed(0)
    config = Eagle3Config.for_target(target, target_layer_ids=layer_ids)
    config.draft_vocab_size = draft_vocab
    model = Eagle3DraftModel(config)
    if draft_vocab:
        model.d2t.copy_(torch.randperm(target.vocab_size)[:draft_vocab].sort().values)
    model.stored_head = model.head(target)[0].detach().clone()  # as the trainer does
    return model


def vllm_captured(config: dict, num_target_layers: int) -> list[int]:
    """Our ids of the states vLLM feeds fc. gpu_model_runner.py _get_eagle3_aux_layers_from_config
    reads eagle_config.eagle_aux_hidden_state_layer_ids, else interfaces.py
    get_eagle3_default_aux_hidden_state_layers = (2, L//2, L-3); llama.py LlamaModel.forward
    appends hidden_states + residual BEFORE layer id, i.e. the output of layer id - 1."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or [2, num_target_layers // 2, num_target_layers - 3]
    return [i - 1 for i in ids]


def sglang_captured(config: dict, num_target_layers: int) -> list[int]:
    """Our ids of the states SGLang feeds fc. spec_aux_hidden_state.py passes
    eagle_config["eagle_aux_hidden_state_layer_ids"] (else None) to llama.py
    set_eagle3_layers_to_capture: None -> layers_to_capture [2, L//2, L-3], else
    [val + 1 for val in ids]; LlamaModel.forward captures BEFORE each of those layers."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    before = [2, num_target_layers // 2, num_target_layers - 3] if ids is None else [i + 1 for i in ids]
    return [i - 1 for i in before]


def vllm_weights(tensors: dict, config: dict) -> dict[str, tuple]:
    """llama_eagle3.py Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t -> draft_id_to_target_id,
    other names prefixed with model. (lm_head excepted), midlayer. -> layers.0.; shapes from
    LlamaModel.__init__ (fc: num_aux * target_hidden_size -> hidden; qkv input 2 * hidden) and
    the lm_head (draft_vocab_size rows)."""
    hidden, heads, kv, head_dim = (config["hidden_size"], config["num_attention_heads"],
                                   config["num_key_value_heads"], config["head_dim"])
    num_aux = len((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    expected = {
        "model.fc.weight": (hidden, config.get("target_hidden_size", hidden) * num_aux),
        "model.layers.0.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv * head_dim, 2 * hidden),
        "model.layers.0.self_attn.v_proj.weight": (kv * head_dim, 2 * hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "model.layers.0.mlp.gate_proj.weight": (config["intermediate_size"], hidden),
        "model.layers.0.mlp.up_proj.weight": (config["intermediate_size"], hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, config["intermediate_size"]),
        "model.layers.0.input_layernorm.weight": (hidden,),
        "model.layers.0.hidden_norm.weight": (hidden,),
        "model.layers.0.post_attention_layernorm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
    }
    if config["draft_vocab_size"] != config["vocab_size"]:
        expected["draft_id_to_target_id"] = (config["draft_vocab_size"],)
    loaded = {}
    for name, tensor in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        loaded[name.replace("midlayer.", "layers.0.")] = tuple(tensor.shape)
    assert loaded == expected
    return loaded


def read(folder):
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


@pytest.mark.parametrize("layer_ids", [None, [1, 5, 9]], ids=["engine-default-layers", "own-layers"])
@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["full-vocab", "reduced-vocab"])
def test_vllm_reads_the_native_folder_as_trained(target, tmp_path, layer_ids, draft_vocab):
    model = build(target, layer_ids, draft_vocab)
    model.save_pretrained(tmp_path / "native")
    config, tensors = read(tmp_path / "native")
    assert VLLM_ARCHITECTURES & set(config["architectures"]) and SGLANG_ARCHITECTURES & set(config["architectures"])
    assert [name for name in REQUIRED if name not in config] == []
    vllm_weights(tensors, config)
    assert vllm_captured(config, NUM_LAYERS) == model.config.target_layer_ids
    # the head vLLM builds: its own, from our rows; ids map back through d2t offsets
    head = model.head(target)[0]
    torch.testing.assert_close(tensors["lm_head.weight"], head)
    if draft_vocab:
        # llama_eagle3.py compute_logits: targets = arange(draft_vocab_size) + draft_id_to_target_id
        assert torch.equal(torch.arange(draft_vocab) + tensors["d2t"], model.d2t)
        assert torch.equal(tensors["t2d"].nonzero().view(-1), model.d2t)
    assert check_drafter(tmp_path / "native", target) == []


def test_default_layers_are_left_to_the_engines_and_both_read_them_alike(target, tmp_path):
    model = build(target)
    assert model.config.target_layer_ids == default_eagle3_layer_ids(NUM_LAYERS) == [1, 5, 8]
    model.save_pretrained(tmp_path / "native")
    config, _ = read(tmp_path / "native")
    assert "eagle_aux_hidden_state_layer_ids" not in config["eagle_config"]
    assert vllm_captured(config, NUM_LAYERS) == sglang_captured(config, NUM_LAYERS) == [1, 5, 8]


def test_sglang_export_rewrites_only_the_layer_ids_and_imports_back(target, tmp_path):
    model = build(target, [1, 5, 9], 40)
    model.save_pretrained(tmp_path / "native")
    native, native_tensors = read(tmp_path / "native")
    assert sglang_captured(native, NUM_LAYERS) == [2, 6, 10]  # SGLang would read the native folder one layer off
    export_drafter(tmp_path / "native", "sglang", tmp_path / "sglang")
    exported, exported_tensors = read(tmp_path / "sglang")
    assert sglang_captured(exported, NUM_LAYERS) == [1, 5, 9]
    assert {k: v for k, v in exported.items() if k not in ("eagle_config", "blockspec_layer_ids_for_sglang")} == \
        {k: v for k, v in native.items() if k != "eagle_config"}
    assert all(torch.equal(exported_tensors[name], native_tensors[name]) for name in native_tensors)
    # the SGLang folder loads in blockspec as the same drafter, and imports back to the native folder
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "sglang")
    assert reloaded.config.target_layer_ids == [1, 5, 9]
    import_drafter(tmp_path / "sglang", tmp_path / "back")
    back, back_tensors = read(tmp_path / "back")
    assert back == native
    assert all(torch.equal(back_tensors[name], native_tensors[name]) for name in native_tensors)


def test_check_drafter_names_eagle3_problems(target, tmp_path):
    model = build(target, [1, 5, 9], 40)
    model.save_pretrained(tmp_path / "ok")
    config, tensors = read(tmp_path / "ok")
    broken = tmp_path / "broken"
    broken.mkdir()
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 6, 12]  # our id 11: the last layer
    (broken / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    tensors.pop("lm_head.weight")
    tensors["t2d"] = torch.zeros_like(tensors["t2d"])
    save_file(tensors, broken / "model.safetensors")
    problems = "\n".join(check_drafter(broken, target))
    assert "last layer 11" in problems
    assert "weight `lm_head.weight` is missing" in problems
    assert "t2d does not mark exactly" in problems


def test_an_eagle3_drafter_runs_from_its_folder(target, tmp_path):
    from blockspec.drafters.registry import load_drafter

    build(target, draft_vocab=40).save_pretrained(tmp_path / "d")
    assert isinstance(load_drafter(str(tmp_path / "d"), target), Eagle3Drafter)
    # in another precision than the target's: the weights and the borrowed head alike
    drafter = load_drafter(str(tmp_path / "d"), target, dtype="bfloat16")
    assert drafter.dtype == next(drafter.model.parameters()).dtype == drafter.head.weight.dtype == torch.bfloat16
    assert target.dtype == torch.float32
