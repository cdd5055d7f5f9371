"""`blockspec check-drafter`: validate a drafter folder against a target, listing every
problem, because serving loaders skip mismatched weights silently."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, check_fits
from blockspec.errors import BlockspecError

EAGLE3_FIELDS = ["architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta",
                 "num_target_layers", "eagle_config"]
REQUIRED_FIELDS = ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "block_size",
                   "num_target_layers", "dflash_config", "layer_types"]


def check_drafter(folder: str | Path, target) -> list[str]:
    """Every problem found (empty list: the folder is a valid drafter for `target`)."""
    folder = Path(folder)
    problems: list[str] = []
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            problems.append(f"missing {path.name}")
    if problems:
        return problems
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        return [f"config.json is not valid JSON: {error}"]
    if {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"} & set(data.get("architectures") or []):
        return check_eagle3(data, weights_path, target)
    problems += [f"config.json lacks `{name}`" for name in REQUIRED_FIELDS if name not in data]
    if "DFlashDraftModel" not in (data.get("architectures") or []):
        problems.append(f"architectures is {data.get('architectures')}, not ['DFlashDraftModel']")
    dflash = data.get("dflash_config") or {}
    problems += [f"dflash_config lacks `{name}`" for name in ("mask_token_id", "target_layer_ids") if name not in dflash]
    if len(data.get("layer_types") or []) != data.get("num_hidden_layers"):
        problems.append("layer_types does not have one entry per layer")
    if problems:
        return problems
    try:
        config = DFlashConfig.from_hf_dict(data)
    except BlockspecError as error:
        return [str(error)]
    try:
        check_fits(config, target)
    except BlockspecError as error:
        problems += str(error).split(": ", 1)[1].split("; ")
    if config.num_target_layers - 1 in config.target_layer_ids:
        problems.append(f"target_layer_ids include the target's last layer {config.num_target_layers - 1}: "
                        "transformers returns it after the final norm, vLLM before it and SGLang not at all")
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in DFlashDraftModel(config).state_dict().items()}
    if config.draft_vocab_size:  # the draft head's rows: without them vLLM takes the first N rows of the target's
        expected["lm_head.weight"] = (config.draft_vocab_size, config.hidden_size)
    return problems + weight_problems(weights_path, expected, config, target, "DFlash")


def weight_problems(weights_path: Path, expected: dict, config, target, kind: str) -> list[str]:
    """Missing, unexpected and mis-shaped weights, and a `d2t` that is not a valid id map."""
    problems = []
    with safe_open(weights_path, framework="pt") as handle:
        found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    for name in sorted(set(expected) - set(found)):
        problems.append(f"weight `{name}` is missing")
    for name in sorted(set(found) - set(expected)):
        problems.append(f"weight `{name}` is not a {kind} weight (a serving engine would skip it silently)")
    for name in sorted(set(found) & set(expected)):
        if found[name] != expected[name]:
            problems.append(f"weight `{name}` has shape {list(found[name])}, the config implies {list(expected[name])}")
    if config.draft_vocab_size and "d2t" in found and found["d2t"] == expected.get("d2t"):
        with safe_open(weights_path, framework="pt") as handle:
            ids = handle.get_tensor("d2t") + torch.arange(config.draft_vocab_size)  # stored as offsets
            t2d = handle.get_tensor("t2d") if "t2d" in found and found["t2d"] == expected.get("t2d") else None
        if not (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < target.vocab_size):
            problems.append("d2t does not map the draft vocabulary to increasing target ids inside the vocabulary "
                            "(it holds offsets: target id = index + d2t[index])")
        elif t2d is not None and not (int(t2d.sum()) == config.draft_vocab_size and bool(t2d[ids].all())):
            problems.append("t2d does not mark exactly the target ids that d2t maps to")
    return problems


def check_eagle3(data: dict, weights_path: Path, target) -> list[str]:
    """An EAGLE-3 folder: what vLLM's and SGLang's `llama_eagle3` readers need."""
    from blockspec.drafters.checkpoint import fit_problems
    from blockspec.drafters.eagle3 import Eagle3Config, Eagle3DraftModel

    problems = [f"config.json lacks `{name}`" for name in EAGLE3_FIELDS if name not in data]
    if data.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers is {data.get('num_hidden_layers')}: an EAGLE-3 drafter has one layer")
    if problems:
        return problems
    try:
        config = Eagle3Config.from_hf_dict(data)
    except BlockspecError as error:
        return [str(error)]
    problems += fit_problems(config, target)
    if config.num_target_layers - 1 in config.target_layer_ids:
        problems.append(f"target_layer_ids include the target's last layer {config.num_target_layers - 1}: "
                        "the engines capture states before a layer, never after the last one")
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # the head the engines build (their own, from these rows) and the vocabulary maps
    expected["lm_head.weight"] = (config.draft_vocab_size or config.vocab_size, config.hidden_size)
    expected["t2d"] = (config.vocab_size,)
    return problems + weight_problems(weights_path, expected, config, target, "EAGLE-3")
