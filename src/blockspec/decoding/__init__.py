"""The one speculative decoding loop, its acceptance rules, sampling and statistics."""

from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.decoding.stats import GenerationStats

__all__ = ["GenerationStats", "SamplingParams", "SpecEngine"]
