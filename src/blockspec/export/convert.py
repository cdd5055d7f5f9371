"""Export a blockspec drafter to the formats other engines read, and import them back.

Native = the reference DFlash format (config.json with `dflash_config` + model.safetensors
with `fc`, `hidden_norm`, `layers.*`, `norm`), which vLLM (`method: "dflash"`) and SGLang
(`DFLASH`) load directly. Two more formats:

* `transformers`: the DFlash draft model built into transformers
  (`transformers/models/muse_glimmer_assistant/`, used by
  `generate(assistant_model=..., speculation_type="dflash")`). Same layers; the context
  projection is named `encoder.fc` / `encoder.output_norm_enc`. Its config defaults
  differ from ours (sliding-attention layers with a 2048 window, rope theta 500000,
  bos/eos/pad ids of its own model), so every field is written explicitly. It always
  drafts over the target's full vocabulary: a reduced draft vocabulary is dropped (the
  draft head is the target's frozen head either way, so no weight changes, but the
  drafts may: tokens outside the draft vocabulary, never trained as labels, can win).
  Layer ids: it reads hidden_states[i + 1] for `target_layer_ids` i, like us.
* `speculators` (vLLM reads it too): `speculators_model_type: "dflash"`, the layer config
  under `transformer_layer_config`, and `aux_hidden_state_layer_ids` = our
  `target_layer_ids` + 1 (speculators counts the embedding output as layer 0; the
  verifier's last layer is implicit and never listed). A reduced draft vocabulary
  becomes its `d2t` (offsets: target id = draft index + d2t) and `t2d` (boolean mask),
  plus `lm_head.weight`, the target head's rows for the draft vocabulary.

EAGLE-3 drafters (`blockspec train --method eagle3`) are natively in the EAGLE-3 format
vLLM reads; `--to sglang` rewrites only `eagle_aux_hidden_state_layer_ids` for SGLang,
which reads that field one layer later than vLLM (see drafters/eagle3.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from blockspec.atomic import replace_dir
from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel
from blockspec.errors import DrafterMismatchError, DrafterNotFoundError, InvalidArgumentError

FORMATS = ("transformers", "speculators", "sglang")
_TRANSFORMERS_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def _layer_config(config: DFlashConfig) -> dict:
    """The Qwen3-style decoder fields every format shares, all explicit."""
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
    }


def to_transformers_config(config: DFlashConfig, bos: int | None = None, eos: int | None = None,
                           pad: int | None = None) -> dict:
    return {
        "architectures": ["MuseGlimmerAssistantModel"],
        "model_type": "muse_glimmer_assistant",
        **_layer_config(config),
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        # must be an int there; unused, as no layer is a sliding one
        "sliding_window": config.max_position_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
        # kept so that import restores our config exactly (transformers ignores it)
        "blockspec": {"vocab_size": config.vocab_size, "num_target_layers": config.num_target_layers,
                      "target": config.target, "draft_vocab_size": config.draft_vocab_size},
    }


def export_drafter(source: str | Path, fmt: str, output: str | Path, target=None, verifier: str | None = None) -> Path:
    """Write the drafter of folder `source` (native format) as `fmt` into `output`, atomically."""
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if _architectures(source) & {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}:
        return _export_eagle3(source, fmt, output)
    if fmt == "sglang":
        raise InvalidArgumentError("SGLang serves a DFlash drafter folder as it is (method DFLASH); "
                                   "--to sglang rewrites EAGLE-3 drafters")
    model = DFlashDraftModel.from_pretrained(source)  # validates names and shapes
    config = model.config
    state = load_file(Path(source) / "model.safetensors")  # the stored tensors, in their stored dtype
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    with replace_dir(output) as staging:
        if fmt == "transformers":
            # transformers drafts over the target's full head: no id map, no head of its own
            if config.trained_head:
                raise InvalidArgumentError("the transformers format drafts through the target's own LM head: a "
                                           "drafter with a trained head (trained_lm_head) exports --to speculators")
            tensors = {_TRANSFORMERS_RENAMES.get(name, name): t for name, t in state.items()
                       if name not in ("d2t", "lm_head.weight")}
            tokenizer = getattr(target, "tokenizer", None)
            special = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) if tokenizer else ()
            hf = to_transformers_config(config, *special)
            hf["dtype"] = str(dtype).replace("torch.", "")
            (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        else:
            if target_layer_ids_not_portable(config):
                raise InvalidArgumentError(
                    f"target_layer_ids {config.target_layer_ids} include the target's last layer "
                    f"({config.num_target_layers - 1}): speculators lists it implicitly and vLLM/SGLang read it "
                    "un-normalised, so this drafter cannot be exported faithfully; train with ids below it")
            tensors = {name: t for name, t in state.items() if name not in ("d2t", "lm_head.weight")}
            if config.draft_vocab_size:
                d2t = model.d2t
                head = model.shipped_head()  # a trained head's rows, or the stored copy of the target's
                if head is None and target is None:
                    raise InvalidArgumentError("exporting a reduced draft vocabulary to speculators needs --target "
                                               "(its lm_head.weight is the target head's rows)")
                if head is None:
                    head = target.lm_head.weight.detach().index_select(0, d2t)
                tensors["d2t"] = d2t - torch.arange(config.draft_vocab_size)  # offsets
                t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
                t2d[d2t] = True
                tensors["t2d"] = t2d
                tensors["lm_head.weight"] = head.to(dtype).contiguous()
            spec = to_speculators_config(config, verifier or config.target.get("name") or "", target)
            spec["torch_dtype"] = str(dtype).replace("torch.", "")
            (staging / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
            save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    return Path(output)


def _architectures(folder) -> set[str]:
    try:
        return set(json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [])
    except (OSError, json.JSONDecodeError):
        return set()  # from_pretrained reports what is wrong


def _export_eagle3(source, fmt: str, output) -> Path:
    """EAGLE-3 for SGLang: the same weights; the layer ids as SGLang 0.5.23 reads them."""
    from blockspec.drafters.eagle3 import SGLANG_MARKER, Eagle3DraftModel

    if fmt != "sglang":
        raise InvalidArgumentError(f"an EAGLE-3 drafter exports --to sglang only (vLLM reads the folder as it is), "
                                   f"not {fmt}")
    config = Eagle3DraftModel.from_pretrained(source).config  # validates names and shapes
    data = json.loads((Path(source) / "config.json").read_text())
    if not config.uses_default_layers():  # the default is read alike by both engines: left out
        data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(config.target_layer_ids)
        data[SGLANG_MARKER] = True
    with replace_dir(output) as staging:
        (staging / "config.json").write_text(json.dumps(data, indent=2) + "\n")
        (staging / "model.safetensors").write_bytes((Path(source) / "model.safetensors").read_bytes())
    return Path(output)


def target_layer_ids_not_portable(config: DFlashConfig) -> bool:
    """The target's last layer: transformers returns it after the final norm, the serving
    engines before it (vLLM) or not at all (SGLang)."""
    return config.num_target_layers - 1 in config.target_layer_ids


def to_speculators_config(config: DFlashConfig, verifier: str, target=None) -> dict:
    layer = {"model_type": "qwen3", "vocab_size": config.vocab_size, "attention_bias": False,
             "tie_word_embeddings": False, **_layer_config(config)}
    layer["rope_theta"] = config.rope_theta
    aux = [i + 1 for i in config.target_layer_ids]  # hidden_states index; the last layer is refused above
    architectures = list(getattr(target.model.config, "architectures", None) or []) if target is not None else []
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.hidden_size,
        "aux_hidden_state_layer_ids": aux,
        "mask_token_id": config.mask_token_id,
        # vLLM 0.33 turns False into causal attention in EVERY draft layer; DFlash blocks are
        # bidirectional (speculators applies the flag to sliding-window layers only: we have none)
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
        "blockspec": {"num_target_layers": config.num_target_layers, "target": config.target,
                      "target_layer_ids": list(config.target_layer_ids),
                      # lm_head.weight is the drafter's own trained head, not a copy of the target's rows
                      **({"trained_lm_head": True} if config.trained_head else {})},
    }


def detect_format(folder: Path) -> str:
    config_path = folder / "config.json"
    if not config_path.is_file() or not (folder / "model.safetensors").is_file():
        raise DrafterNotFoundError(f"{folder} is not a drafter folder (needs config.json and model.safetensors)")
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise DrafterMismatchError(f"{config_path} is not valid JSON: {error}") from None
    if data.get("speculators_model_type") == "dflash":
        return "speculators"
    if data.get("model_type") == "muse_glimmer_assistant":
        return "transformers"
    if "DFlashDraftModel" in (data.get("architectures") or []) and "dflash_config" in data:
        return "native"
    if {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"} & set(data.get("architectures") or []):
        return "eagle3"
    raise DrafterMismatchError(f"{config_path}: not a DFlash drafter in a format blockspec knows "
                               "(native/reference, transformers muse_glimmer_assistant, speculators dflash)")


def import_drafter(source: str | Path, output: str | Path, target=None) -> Path:
    """Bring a DFlash drafter in any known format (a local folder, or a hub id when online)
    into the native format in `output`, atomically. `target` fills what a format lacks
    (vocabulary and layer count) when the drafter was not exported by blockspec."""
    folder = Path(source).expanduser()
    if not folder.exists():
        folder = _download(str(source))
    fmt = detect_format(folder)
    data = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    if fmt in ("native", "eagle3"):  # an EAGLE-3 folder for either engine reads back the same
        from blockspec.drafters.eagle3 import Eagle3DraftModel

        model = (DFlashDraftModel if fmt == "native" else Eagle3DraftModel).from_pretrained(folder)
        model.save_pretrained(output, dtype=next(t.dtype for t in tensors.values() if t.is_floating_point()))
        return Path(output)
    if fmt == "transformers":
        extra = data.get("blockspec") or {}
        inverse = {v: k for k, v in _TRANSFORMERS_RENAMES.items()}
        tensors = {inverse.get(name, name): t for name, t in tensors.items()}
        layer = data
        vocab = extra.get("vocab_size") or (target.vocab_size if target is not None else None)
        num_target_layers = extra.get("num_target_layers") or (target.num_layers if target is not None else None)
        target_layer_ids, mask_token_id, block_size = data["target_layer_ids"], data["mask_token_id"], data["block_size"]
        fingerprint, draft_vocab_size = extra.get("target") or {}, None
        trained_head = False
    else:
        extra = data.get("blockspec") or {}
        layer = data["transformer_layer_config"]
        vocab = layer.get("vocab_size")
        num_target_layers = extra.get("num_target_layers") or (target.num_layers if target is not None else None)
        target_layer_ids = extra.get("target_layer_ids") or [i - 1 for i in data["aux_hidden_state_layer_ids"]]
        mask_token_id, block_size = data["mask_token_id"], data["block_size"]
        fingerprint = extra.get("target") or {}
        draft_vocab_size = data.get("draft_vocab_size") if data.get("draft_vocab_size") != vocab else None
        trained_head = bool(extra.get("trained_lm_head")) and bool(draft_vocab_size)
        tensors.pop("t2d", None)
        if draft_vocab_size:
            tensors["d2t"] = tensors["d2t"] + torch.arange(draft_vocab_size)  # offsets -> absolute ids
        else:
            tensors.pop("d2t", None)
            tensors.pop("lm_head.weight", None)
        for name in ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"):
            tensors.pop(name, None)
    if vocab is None or num_target_layers is None:
        raise InvalidArgumentError(f"{source}: the {fmt} config does not say the target's vocabulary size and layer "
                                   "count: pass --target")
    rope = layer.get("rope_parameters") or {}
    config = DFlashConfig(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_hidden_layers=layer["num_hidden_layers"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        vocab_size=vocab, num_target_layers=num_target_layers, target_layer_ids=list(target_layer_ids),
        mask_token_id=int(mask_token_id), block_size=int(block_size), rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or _missing("rope_theta", source)),
        max_position_embeddings=int(layer.get("max_position_embeddings", 32768)), target=fingerprint,
        draft_vocab_size=draft_vocab_size, trained_head=trained_head)
    model = DFlashDraftModel(config)
    if model.own_head() is None:  # else lm_head.weight is one of its weights
        model.stored_head = tensors.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise DrafterMismatchError(f"{source}: weight names do not match a DFlash drafter (missing: {sorted(missing)[:5]}, "
                                   f"unexpected: {sorted(unexpected)[:5]})")
    model.save_pretrained(output, dtype=next(t.dtype for t in tensors.values() if t.is_floating_point()))
    return Path(output)


def _missing(name: str, source) -> float:
    raise DrafterMismatchError(f"{source}: the config has no `{name}`")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["config.json", "*.safetensors", "*.md"]))
    except Exception as error:  # offline, unknown repo, ...: one clear message
        raise DrafterNotFoundError(f"{repo_id!r} is not a local folder and could not be downloaded: {error}") from None
