"""Drafters: one file per method, all behind the engine's contract (`blockspec.decoding.draft`)."""

from blockspec.decoding.draft import Draft, Drafter, DraftRequest
from blockspec.drafters.registry import load_drafter

__all__ = ["Draft", "DraftRequest", "Drafter", "load_drafter"]
