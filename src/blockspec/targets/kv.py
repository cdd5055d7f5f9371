"""The target's KV cache as the decoding step sees it: rows of committed tokens, one verify
pass for every row, then each row keeps what it accepted.

One protocol, two backends:

- `SingleSequenceKV`: one row on the adapter's own cache, rolled back by cropping. The
  only one that handles sliding-window layers (Gemma 3): they keep the tokens since the
  last rollback, and this backend rolls back after every pass.
- `SlotKV`: many rows in one batch cache (continuous batching). The stock `DynamicCache`
  crops the whole batch to one length, so rows share one slot axis and a per-row mask of
  valid slots instead: a verify pass appends the same number of slots to every row;
  afterwards only a row's kept tokens stay valid, the rest become holes the mask hides
  (keys are rotated at their own positions when written, so where a slot sits does not
  matter). When holes are most of the cache it is compacted. Full-attention targets only.

Row i of every call is the engine's row i; `drop` removes one and later rows move up.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import TargetAdapter, target_features
from blockspec.targets.cache import GrowingLayer, new_cache, replace_states


class TargetKV(Protocol):
    max_rows: int | None  # None: any number

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Add a row holding `prompt` [n]; returns the logits after it [V] (float32) and its
        features [n, F] (None without feature layers). On failure no row was added."""

    def verify(self, blocks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `blocks[i]` at the next positions of row i, every row in ONE pass. Returns
        logits [rows, width, V] (float32) and features [rows, width, F]; position j of a
        row's block is row j of its output, positions past its block are padding."""

    def keep(self, row: int, length: int) -> None:
        """After `verify`: row `row` keeps its first `length` tokens (its previous tokens and
        the accepted start of its block); called for every row after every pass."""

    def drop(self, row: int) -> None:
        """Remove a row (finished, cancelled or failed)."""

    def reset(self) -> None:
        """Remove every row."""


class SingleSequenceKV:
    max_rows = 1

    def __init__(self, target: TargetAdapter, layer_ids: tuple[int, ...] = ()):
        self.target, self.layer_ids = target, layer_ids
        self.rows = 0

    def prefill(self, prompt):
        if self.rows:
            raise InvalidArgumentError("this cache holds one sequence at a time")
        self.target.reset()
        out = self.target.forward(prompt, self.layer_ids, last_logits_only=True)
        self.target.rollback(prompt.numel())  # trims sliding-window layers; removes nothing
        self.rows = 1
        return out.logits[-1], out.features

    def verify(self, blocks):
        (block,) = blocks
        out = self.target.forward(torch.tensor(block), self.layer_ids)
        return out.logits[None], None if out.features is None else out.features[None]

    def keep(self, row, length):
        self.target.rollback(length)

    def drop(self, row):
        self.reset()

    def reset(self):
        self.rows = 0
        self.target.cache = None


class SlotKV:
    max_rows = None

    def __init__(self, target: TargetAdapter, layer_ids: tuple[int, ...] = ()):
        probe = new_cache(target.model.config)
        if any(not isinstance(layer, GrowingLayer) for layer in probe.layers):
            raise InvalidArgumentError("batched decoding needs a target whose layers all use full attention")
        self.target, self.layer_ids = target, layer_ids
        self.reset()

    def reset(self):
        self.cache = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]: which slots a row may attend
        self.lengths: list[int] = []  # tokens each row holds (= its valid slots)
        self._block_start = 0  # first slot of the last verify pass

    def _run(self, ids, cache, **kwargs):
        out = self.target.model(input_ids=ids.to(self.target.device), cache=cache, use_cache=True,
                                output_hidden_states=bool(self.layer_ids), **kwargs)
        features = target_features(out.hidden_states, self.layer_ids) if self.layer_ids else None
        return out.logits.float(), features

    def prefill(self, prompt):
        single = new_cache(self.target.model.config)
        logits, features = self._run(prompt[None], single, logits_to_keep=1)
        self._append_row(single, prompt.numel())  # the batch is untouched until here
        return logits[0, -1], None if features is None else features[0]

    def _append_row(self, single, length: int) -> None:
        """Append a prefilled sequence's cache as a new row (its slots first, holes after)."""
        self.lengths.append(length)
        if self.cache is None:
            self.cache, self.valid = single, torch.ones(1, length, dtype=torch.bool)
            return
        width = max(self.valid.shape[1], length)
        self._grow_width(width)
        for mine, theirs in zip(self.cache.layers, single.layers):
            keys = F.pad(theirs.keys, (0, 0, 0, width - length))
            values = F.pad(theirs.values, (0, 0, 0, width - length))
            replace_states(mine, torch.cat([mine.keys, keys]), torch.cat([mine.values, values]))
        self.valid = torch.cat([self.valid, (torch.arange(width) < length)[None]])

    def _grow_width(self, width: int) -> None:
        extra = width - self.valid.shape[1]
        if extra <= 0:
            return
        for layer in self.cache.layers:
            replace_states(layer, F.pad(layer.keys, (0, 0, 0, extra)), F.pad(layer.values, (0, 0, 0, extra)))
        self.valid = F.pad(self.valid, (0, extra))

    def verify(self, blocks):
        self._compact_if_sparse()
        batch, width = len(blocks), max(len(block) for block in blocks)
        ids = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        query_valid = torch.zeros(batch, width, dtype=torch.bool)
        for i, (block, start) in enumerate(zip(blocks, self.lengths)):
            ids[i, :len(block)], ids[i, len(block):] = torch.tensor(block), block[0]
            positions[i, :len(block)] = torch.arange(start, start + len(block))
            positions[i, len(block):] = start + len(block) - 1  # padding never runs past the row's real positions
            query_valid[i, :len(block)] = True
        old = self.valid.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        new_part = causal[None] & query_valid[:, None, :]  # a query sees its row's block up to itself
        new_part |= torch.eye(width, dtype=torch.bool)[None]  # padding queries see themselves (no empty row)
        allowed = torch.cat([self.valid[:, None, :].expand(batch, width, old), new_part], dim=2)[:, None]
        # an additive float mask: what every attention implementation (sdpa, eager) reads the same way
        dtype = self.target.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        logits, features = self._run(ids, self.cache, position_ids=positions.to(self.target.device),
                                     attention_mask=mask.to(self.target.device))
        self._block_start = old
        self.valid = F.pad(self.valid, (0, width))  # the new slots stay holes until kept
        return logits, features

    def keep(self, row, length):
        accepted = length - self.lengths[row]
        self.valid[row, self._block_start:self._block_start + accepted] = True
        self.lengths[row] = length

    def drop(self, row):
        del self.lengths[row]
        keep = torch.tensor([i for i in range(self.valid.shape[0]) if i != row], dtype=torch.long)
        if keep.numel() == 0:
            self.reset()
            return
        self.cache.batch_select_indices(keep)
        self.valid = self.valid[keep]

    def _compact_if_sparse(self) -> None:
        """Gather each row's valid slots to the front once holes are most of the cache."""
        if self.cache is None:
            return
        counts = self.valid.sum(dim=1)
        width = int(counts.max())
        if self.valid.shape[1] <= 2 * width + 64:
            return
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :width]  # valid slots first
        for layer in self.cache.layers:
            index = order[:, None, :, None].to(layer.keys.device)
            keys, values = layer.keys, layer.values
            replace_states(layer, keys.gather(2, index.expand(-1, keys.shape[1], -1, keys.shape[3])),
                           values.gather(2, index.expand(-1, values.shape[1], -1, values.shape[3])))
        self.valid = torch.arange(width)[None, :] < counts[:, None]
