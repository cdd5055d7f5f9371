"""A KV cache that grows in place.

transformers' `DynamicLayer` appends with `torch.cat`, which copies the whole cache
at every step: for a batch of 64 rows of 300 tokens on the default target that copy
was 73% of a decode step (profiled here). `GrowingLayer` keeps a buffer with spare
capacity (doubling when full), writes new keys/values into it and hands attention
a view of the filled part; a rollback only moves the length. Everything else is
the stock `DynamicCache`, so masks, sliding-window layers and model code are
untouched.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256


class GrowingLayer(DynamicLayer):
    def __init__(self, **kwargs):
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        super().__init__(**kwargs)

    # `keys` / `values` stay assignable so the inherited batch helpers keep working:
    # an assigned tensor becomes the buffer, exactly full.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._key_buffer is None else self._key_buffer[:, :, : self._length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._key_buffer = value
        self._length = 0 if value is None or value.dim() < 3 else value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._value_buffer is None else self._value_buffer[:, :, : self._length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._value_buffer = value

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.device = key_states.device
            self.is_initialized = True
        new = key_states.shape[-2]
        needed = self._length + new
        if self._key_buffer is None or self._key_buffer.dim() < 3 or needed > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, max(needed, 2 * self._length, MIN_CAPACITY))
        self._key_buffer[:, :, self._length:needed] = key_states
        self._value_buffer[:, :, self._length:needed] = value_states
        self._length = needed
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        batch, heads, _, key_dim = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, key_dim)
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if self._length:
            keys[:, :, : self._length] = self._key_buffer[:, :, : self._length]
            values[:, :, : self._length] = self._value_buffer[:, :, : self._length]
        self._key_buffer, self._value_buffer = keys, values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self._length = max(0, self._length + tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._length:
            length = self._length
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]
            self._length = length

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self._length = 0
        self.is_initialized = False


def replace_states(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Give a cache layer new keys and values, both computed from the old ones BEFORE this
    call: a GrowingLayer's `values` view depends on the length its `keys` sets."""
    layer.keys, layer.values = keys, values


def new_cache(config) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers grow in place."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
