"""What every trained drafter's weights share: the borrowed (frozen) LM head, restricted
to an optional reduced draft vocabulary (or a trained head of the drafter's own, an
`lm_head` module), and the checkpoint folder (config.json +
model.safetensors, written atomically, safetensors only).

A reduced draft vocabulary lives in memory as `d2t` = absolute target ids; on disk
`d2t` holds OFFSETS (target id = index + d2t[index]) and `lm_head.weight` the target
head's rows for it: the EAGLE-3 convention that vLLM reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from blockspec.atomic import replace_dir
from blockspec.errors import DrafterMismatchError, DrafterNotFoundError


def fit_problems(config, target, check_fingerprint: bool = True) -> list[str]:
    """What every trained drafter's config must share with its target (empty: it fits)."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} != target's {target.vocab_size}")
    if config.num_target_layers != target.num_layers:
        problems.append(f"num_target_layers {config.num_target_layers} != target's {target.num_layers}")
    if config.draft_vocab_size and not 0 < config.draft_vocab_size <= target.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} outside 1..{target.vocab_size}")
    ids = list(config.target_layer_ids)  # the target layers whose features it reads
    if not ids or ids != sorted(set(ids)):
        problems.append(f"target_layer_ids {ids} must be strictly increasing without repeats (serving engines "
                        "capture each layer once, in order)")
    bad_ids = [i for i in ids if not 0 <= i < target.num_layers]
    if bad_ids:
        problems.append(f"target_layer_ids {bad_ids} outside 0..{target.num_layers - 1}")
    recorded = config.target.get("tokenizer_sha256")
    if check_fingerprint and recorded and recorded != target.fingerprint()["tokenizer_sha256"]:
        problems.append(f"trained for a different tokenizer (target {config.target.get('name')!r}); "
                        "--force-drafter uses it anyway")
    return problems


class DraftCheckpoint:
    """Mixin for a drafter's nn.Module. Subclasses set `architecture` (the config.json
    `architectures` entry) and `config_class` (with `from_hf_dict` / `to_hf_dict` and
    a `draft_vocab_size` field), and register a `d2t` buffer when the vocabulary is reduced."""

    architecture: str = ""
    architecture_aliases: tuple[str, ...] = ()  # other names the same format goes by
    config_class = None
    stored_head: torch.Tensor | None = None  # written as lm_head.weight (serving engines use it)
    #: True: the format requires `lm_head.weight` even with the full vocabulary (EAGLE-3 readers
    #: build their own head from it); False: only with a reduced draft vocabulary
    head_always_stored = False

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors the format carries for other readers and blockspec does not load back."""
        return {}

    def own_head(self) -> torch.nn.Linear | None:
        """The drafter's own LM head (its config's `trained_head`), or None: it borrows the target's."""
        return getattr(self, "lm_head", None)

    def shipped_head(self) -> torch.Tensor | None:
        """The rows `lm_head.weight` carries: the trained head's, else the stored copy of the
        target's (None: not stored)."""
        own = self.own_head()
        return self.stored_head if own is None else own.weight

    def head(self, target) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's (weight, bias): the drafter's own trained one, else the borrowed one."""
        own = self.own_head()
        return (own.weight, None) if own is not None else self.borrowed_head(target)

    def borrowed_head(self, target) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's LM head (weight, bias), restricted to the draft vocabulary if any."""
        weight, bias = target.lm_head.weight, getattr(target.lm_head, "bias", None)
        if self.config.draft_vocab_size:
            rows = self.d2t.to(weight.device)  # the drafter may still be elsewhere (a trainer builds it on the CPU)
            weight = weight.index_select(0, rows)
            bias = None if bias is None else bias.index_select(0, rows)
        return weight, bias

    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write config.json + model.safetensors atomically (a reader sees all or nothing).
        `dtype` stores the floating-point weights in another precision (e.g. float16 to ship)."""
        with replace_dir(directory) as staging:
            self.write_files(staging, dtype)

    def write_files(self, folder: Path, dtype: torch.dtype | None = None) -> None:
        """config.json + model.safetensors into an existing folder (not atomic on its own)."""
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}
        if self.config.draft_vocab_size:
            tensors["d2t"] = tensors["d2t"] - torch.arange(self.config.draft_vocab_size)
        if ((self.config.draft_vocab_size or self.head_always_stored) and self.stored_head is not None
                and self.own_head() is None):
            tensors["lm_head.weight"] = self.stored_head.detach().to("cpu", next(self.parameters()).dtype)
        tensors.update(self.extra_tensors())
        if dtype is not None:
            tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        config = self.config.to_hf_dict()
        stored = dtype or next(t.dtype for t in tensors.values() if t.is_floating_point())  # not d2t's int64
        config["torch_dtype"] = str(stored).replace("torch.", "")
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike):
        directory = Path(directory)
        config_path, weights_path = directory / "config.json", directory / "model.safetensors"
        if not config_path.is_file() or not weights_path.is_file():
            raise DrafterNotFoundError(f"{directory} is not a drafter folder (needs config.json and model.safetensors)")
        try:
            data = json.loads(config_path.read_text())
        except json.JSONDecodeError as error:
            raise DrafterMismatchError(f"{config_path} is not valid JSON: {error}") from None
        if not {cls.architecture, *cls.architecture_aliases} & set(data.get("architectures") or []):
            raise DrafterMismatchError(f"{config_path}: architectures {data.get('architectures')} is not "
                                       f"{cls.architecture}")
        model = cls(cls.config_class.from_hf_dict(data))
        state = load_file(weights_path)  # safetensors only: never an unpickled checkpoint
        if model.own_head() is None:  # else lm_head.weight is one of its weights
            model.stored_head = state.pop("lm_head.weight", None)
        for name in model.extra_tensors():
            state.pop(name, None)
        if "d2t" in state and model.config.draft_vocab_size:
            ids = state["d2t"] + torch.arange(model.config.draft_vocab_size)  # offsets -> ids
            if not (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < model.config.vocab_size):
                raise DrafterMismatchError(
                    f"{weights_path}: `d2t` does not map the draft vocabulary to increasing ids inside the "
                    "target's vocabulary; it must hold offsets (target id = index + d2t[index]), as vLLM reads "
                    "them (checkpoints written before blockspec 0.1 stored absolute ids: re-save them)")
            state["d2t"] = ids
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DrafterMismatchError(
                f"{weights_path}: weight names do not match the {cls.architecture} format "
                f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})"
            )
        return model.eval()
