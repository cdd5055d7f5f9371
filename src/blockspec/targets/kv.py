"""The target's KV cache as the decoding step sees it: rows of committed tokens, one verify
pass for every row, then each row keeps what it accepted.

One protocol, two backends:

- `SingleSequenceKV`: one row on the adapter's own cache, rolled back by cropping. The
  only one that handles sliding-window layers (Gemma 3): they keep the tokens since the
  last rollback, and this backend rolls back after every pass.
- `SlotKV`: many rows in one batch cache (continuous batching), and token trees. The stock
  `DynamicCache` crops the whole batch to one length, so rows share one slot axis and a
  per-row mask of valid slots instead: a verify pass appends the same number of slots to
  every row; afterwards only a row's kept tokens stay valid (a tree's: its accepted path),
  the rest become holes the mask hides (keys are rotated at their own positions when
  written, so where a slot sits does not matter). When holes are most of the cache it is
  compacted. Sliding-window layers (Gemma 3) keep every token here and the window lives in
  their mask instead (from each slot's position), passed per layer type.

Row i of every call is the engine's row i; `drop` removes one and later rows move up.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from blockspec.decoding.tree import ancestor_mask, depths
from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import TargetAdapter, target_features
from blockspec.targets.cache import GrowingLayer, new_cache, replace_states


class TargetKV(Protocol):
    max_rows: int | None  # None: any number

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Add a row holding `prompt` [n]; returns the logits after it [V] (float32) and its
        features [n, F] (None without feature layers). On failure no row was added."""

    def verify(self, blocks: list[list[int]], trees: list[list[int] | None] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `blocks[i]` at the next positions of row i, every row in ONE pass. Returns
        logits [rows, width, V] (float32) and features [rows, width, F]; position j of a
        row's block is row j of its output, positions past its block are padding.
        `trees[i]`, when given, makes row i's block [anchor] + a token tree: the parent of
        each node (-1: the anchor); a node sits at anchor + its depth and sees only its
        ancestors (`supports_trees` backends only)."""

    def keep(self, row: int, length: int, kept: list[int] | None = None) -> None:
        """After `verify`: row `row` keeps `length` tokens: its previous tokens and, of its
        block, the first ones (a chain) or the block positions `kept` (a tree's anchor and
        accepted path). Called for every row after every pass."""

    def drop(self, row: int) -> None:
        """Remove a row (finished, cancelled or failed)."""

    def reset(self) -> None:
        """Remove every row."""


class SingleSequenceKV:
    max_rows = 1
    supports_trees = False

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

    def verify(self, blocks, trees=None):
        if trees is not None and any(tree is not None for tree in trees):
            raise InvalidArgumentError("the single-sequence cache verifies chains only")
        (block,) = blocks
        out = self.target.forward(torch.tensor(block), self.layer_ids)
        return out.logits[None], None if out.features is None else out.features[None]

    def keep(self, row, length, kept=None):
        self.target.rollback(length)

    def drop(self, row):
        self.reset()

    def reset(self):
        self.rows = 0
        self.target.cache = None


class SlotKV:
    max_rows = None
    supports_trees = True

    def __init__(self, target: TargetAdapter, layer_ids: tuple[int, ...] = ()):
        config = target.model.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        # windows in the mask need a model that takes one mask per layer type (transformers'
        # models with sliding layers do); anything else (chunked, linear attention) is refused
        self.window = getattr(config, "sliding_window", None) if "sliding_attention" in layer_types else None
        if not layer_types <= {"full_attention", "sliding_attention"} or (
                "sliding_attention" in layer_types and not self.window):
            raise InvalidArgumentError(
                f"the slot cache (batches, trees) needs full or sliding-window attention layers, not {sorted(layer_types)}")
        self.target, self.layer_ids = target, layer_ids
        self.reset()

    def reset(self):
        self.cache = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]: which slots a row may attend
        self.slot_positions = torch.zeros(0, 0, dtype=torch.long)  # [rows, slots]: each slot's position (windows)
        self.lengths: list[int] = []  # tokens each row holds (= its valid slots)
        self._block_start = 0  # first slot of the last verify pass

    def _new_cache(self):
        cache = new_cache(self.target.model.config)
        cache.layers = [layer if isinstance(layer, GrowingLayer) else GrowingLayer() for layer in cache.layers]
        return cache

    def _mask(self, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
        """The attention mask for `allowed` [rows, queries, keys]: an additive float mask (what
        every attention implementation reads the same way), per layer type with windows."""
        dtype, device = self.target.dtype, self.target.device

        def additive(where: torch.Tensor) -> torch.Tensor:
            return torch.zeros(where.shape, dtype=dtype).masked_fill(~where, torch.finfo(dtype).min)[:, None].to(device)

        if self.window is None:
            return additive(allowed)
        # transformers' window: a query sees the keys less than `sliding_window` positions back
        in_window = query_positions[:, :, None] - key_positions[:, None, :] < self.window
        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & in_window)}

    def _run(self, ids, cache, **kwargs):
        out = self.target.model(input_ids=ids.to(self.target.device), cache=cache, use_cache=True,
                                output_hidden_states=bool(self.layer_ids), **kwargs)
        features = target_features(out.hidden_states, self.layer_ids) if self.layer_ids else None
        return out.logits.float(), features

    def prefill(self, prompt):
        single = self._new_cache()
        length = prompt.numel()
        positions = torch.arange(length)[None]
        mask = {} if self.window is None else {
            "attention_mask": self._mask(torch.ones(length, length, dtype=torch.bool).tril()[None], positions, positions)}
        logits, features = self._run(prompt[None], single, logits_to_keep=1, **mask)
        self._append_row(single, prompt.numel())  # the batch is untouched until here
        return logits[0, -1], None if features is None else features[0]

    def _append_row(self, single, length: int) -> None:
        """Append a prefilled sequence's cache as a new row (its slots first, holes after)."""
        self.lengths.append(length)
        if self.cache is None:
            self.cache, self.valid = single, torch.ones(1, length, dtype=torch.bool)
            self.slot_positions = torch.arange(length)[None]
            return
        width = max(self.valid.shape[1], length)
        self._grow_width(width)
        for mine, theirs in zip(self.cache.layers, single.layers):
            keys = F.pad(theirs.keys, (0, 0, 0, width - length))
            values = F.pad(theirs.values, (0, 0, 0, width - length))
            replace_states(mine, torch.cat([mine.keys, keys]), torch.cat([mine.values, values]))
        self.valid = torch.cat([self.valid, (torch.arange(width) < length)[None]])
        self.slot_positions = torch.cat([self.slot_positions, F.pad(torch.arange(length), (0, width - length))[None]])

    def _grow_width(self, width: int) -> None:
        extra = width - self.valid.shape[1]
        if extra <= 0:
            return
        for layer in self.cache.layers:
            replace_states(layer, F.pad(layer.keys, (0, 0, 0, extra)), F.pad(layer.values, (0, 0, 0, extra)))
        self.valid = F.pad(self.valid, (0, extra))
        self.slot_positions = F.pad(self.slot_positions, (0, extra))

    def verify(self, blocks, trees=None):
        self._compact_if_sparse()
        batch, width = len(blocks), max(len(block) for block in blocks)
        ids = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        # a query sees its row's block up to itself (a tree: its ancestors); padding queries
        # see only themselves (no empty row)
        new_part = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
        for i, (block, start) in enumerate(zip(blocks, self.lengths)):
            tree = trees[i] if trees is not None else None
            size = len(block)
            ids[i, :size], ids[i, size:] = torch.tensor(block), block[0]
            if tree is None:
                positions[i, :size] = torch.arange(start, start + size)
                new_part[i, :size, :size] = torch.ones(size, size, dtype=torch.bool).tril()
            else:
                positions[i, :size] = start + torch.tensor([0] + depths(tree))
                new_part[i, :size, :size] = ancestor_mask(tree)
            positions[i, size:] = positions[i, :size].max()  # padding never runs past the row's real positions
        old = self.valid.shape[1]
        key_positions = torch.cat([self.slot_positions, positions], dim=1)
        mask = {}
        # one row without holes verifying a chain is plain causal attention: no mask, the model's
        # fastest path (a mask costs a plain step ~15% here)
        if not (batch == 1 and self.window is None and (trees is None or trees[0] is None) and self.valid.all()):
            allowed = torch.cat([self.valid[:, None, :].expand(batch, width, old), new_part], dim=2)
            mask = {"attention_mask": self._mask(allowed, positions, key_positions)}
        logits, features = self._run(ids, self.cache, position_ids=positions.to(self.target.device), **mask)
        self._block_start = old
        self.valid = F.pad(self.valid, (0, width))  # the new slots stay holes until kept
        self.slot_positions = key_positions
        return logits, features

    def keep(self, row, length, kept=None):
        if kept is None:
            kept = range(length - self.lengths[row])
        slots = [self._block_start + index for index in kept]
        self.lengths[row] = length
        if self.valid.shape[0] == 1 and bool(self.valid[0, :self._block_start].all()):
            # one row: move the kept slots (a tree's path) next to the others and drop the rest,
            # so the row never has holes (and verifies chains without a mask)
            moved = slots != list(range(self._block_start, self._block_start + len(slots)))  # else a prefix: crop only
            index = torch.tensor(slots, device=self.target.device) if moved else None
            for layer in self.cache.layers:
                if moved:
                    layer.keys[:, :, self._block_start:self._block_start + len(slots)] = layer.keys[:, :, index]
                    layer.values[:, :, self._block_start:self._block_start + len(slots)] = layer.values[:, :, index]
                layer.crop(-(layer.get_seq_length() - length))
            self.valid = torch.ones(1, length, dtype=torch.bool)
            self.slot_positions = torch.arange(length)[None]
            return
        self.valid[row, slots] = True

    def drop(self, row):
        del self.lengths[row]
        keep = torch.tensor([i for i in range(self.valid.shape[0]) if i != row], dtype=torch.long)
        if keep.numel() == 0:
            self.reset()
            return
        self.cache.batch_select_indices(keep)
        self.valid = self.valid[keep]
        self.slot_positions = self.slot_positions[keep]

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
        self.slot_positions = self.slot_positions.gather(1, order)
