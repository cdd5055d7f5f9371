"""Targets: loading any HF causal LM (hub id, folder, GGUF, the packaged default) and the thin adapter."""

from blockspec.targets.adapter import TargetAdapter, TargetOutput, crop_cache_to_length
from blockspec.targets.loading import DEFAULT_TARGET, load_target

__all__ = ["DEFAULT_TARGET", "TargetAdapter", "TargetOutput", "crop_cache_to_length", "load_target"]
