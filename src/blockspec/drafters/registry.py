"""Names and checkpoint formats -> drafters. A new method registers here and shows up
in the CLI, the Python API (and later bench and serve) without touching them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from blockspec.decoding.draft import Drafter
from blockspec.drafters.dflash import load_dflash
from blockspec.drafters.eagle3 import load_eagle3
from blockspec.drafters.hybrid import HybridDrafter
from blockspec.drafters.mtp import load_mtp
from blockspec.drafters.prompt_lookup import PromptLookupDrafter
from blockspec.errors import DrafterNotFoundError
from blockspec.targets.linear_kernels import speed_up_linears
from blockspec.targets.loading import drafter_dtype

# Training-free drafters, by name.
NAMED_DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "prompt-lookup": lambda target, **options: PromptLookupDrafter(),  # options are DFlash's: ignored
}
# Trained drafters, by the `architectures` entry of their config.json.
CHECKPOINT_LOADERS: dict[str, Callable[..., Drafter]] = {
    "DFlashDraftModel": load_dflash,
    "MTPHeadModel": load_mtp,
    "LlamaForCausalLMEagle3": load_eagle3,  # the EAGLE-3 format (vLLM / SGLang names)
    "Eagle3LlamaForCausalLM": load_eagle3,
}
# Drafters shipped inside the package, one folder each.
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


def shipped_drafter_for(target) -> Path | None:
    """The shipped drafter trained for `target` (same tokenizer and shape), if any."""
    if not SHIPPED_DIR.is_dir():
        return None
    fingerprint = target.fingerprint()
    for folder in sorted(SHIPPED_DIR.iterdir()):
        config_path = folder / "config.json"
        if not config_path.is_file():
            continue
        recorded = json.loads(config_path.read_text()).get("blockspec_target") or {}
        if recorded.get("tokenizer_sha256") == fingerprint["tokenizer_sha256"] and recorded.get(
            "num_hidden_layers"
        ) == fingerprint["num_hidden_layers"]:
            return folder
    return None


def load_drafter(spec: str | None, target, **options) -> Drafter | None:
    """`none` (or None), `auto` (the shipped drafter for this target, else prompt lookup),
    `hybrid` (the shipped drafter with prompt lookup beside it, each step the source that
    scores better; `hybrid:FOLDER` with another drafter), a registered name, or a drafter folder.
    `options['dtype']`: the precision a trained drafter computes in, `auto` by default
    (`targets.loading.drafter_dtype`)."""
    if spec is None or spec == "none":
        return None
    options["dtype"] = drafter_dtype(options.get("dtype") or "auto", target)
    if spec == "hybrid" or spec.startswith("hybrid:"):
        model = load_drafter(spec.removeprefix("hybrid").removeprefix(":") or "auto", target, **options)
        return model if isinstance(model, PromptLookupDrafter) else HybridDrafter(model)
    if spec == "auto":
        shipped = shipped_drafter_for(target)
        return load_drafter(str(shipped), target, **options) if shipped else NAMED_DRAFTERS["prompt-lookup"](target)
    if spec in NAMED_DRAFTERS:
        return NAMED_DRAFTERS[spec](target, **options)
    if spec.startswith("model:"):  # an independent draft model with the target's tokenizer
        from blockspec.drafters.draft_model import load_draft_model

        return load_draft_model(spec, target, **options)
    folder = Path(spec).expanduser()
    config_path = folder / "config.json"
    if not config_path.is_file():
        known = ", ".join(["none", "auto", "hybrid", "hybrid:FOLDER", *NAMED_DRAFTERS, "model:PATH"])
        raise DrafterNotFoundError(f"unknown drafter {spec!r}: not one of {known}, and not a drafter folder")
    try:
        architectures = json.loads(config_path.read_text()).get("architectures") or []
    except json.JSONDecodeError as error:
        raise DrafterNotFoundError(f"{config_path} is not valid JSON: {error}") from None
    for architecture in architectures:
        if architecture in CHECKPOINT_LOADERS:
            drafter = CHECKPOINT_LOADERS[architecture](folder, target, **options)
            # its own Linear products and its head's in the kernels this machine runs fastest (as
            # the target's; a loaded drafter only drafts: a model under an optimizer is never bound here)
            products = torch.nn.ModuleDict({"model": drafter.model, "head": drafter.head})
            speed_up_linears(products)
            drafter.head = products["head"]
            return drafter
    raise DrafterNotFoundError(f"{folder}: unsupported drafter architectures {architectures}")
