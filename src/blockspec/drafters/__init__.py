"""Drafters: one file per method, all behind the `Drafter` interface of base.py."""

from blockspec.drafters.base import Draft, Drafter
from blockspec.drafters.registry import load_drafter

__all__ = ["Draft", "Drafter", "load_drafter"]
