"""An independent draft model: any small causal LM with the target's tokenizer drafts
autoregressively on its own KV cache (`--drafter model:PATH`).

It keeps the ids it has run; at each proposal it rolls its cache back to the longest
prefix those share with the committed tokens (everything after a rejected draft is
dropped), runs the new committed tokens, then drafts one token per forward pass. At
T > 0 it samples each draft from its own warped distribution and hands that
distribution to the verifier (rejection sampling keeps the output the target's).
"""

from __future__ import annotations

import copy

import torch

from blockspec.decoding.draft import Draft, Drafter, DraftRequest
from blockspec.drafters.base import TokenPicker
from blockspec.errors import DrafterMismatchError


class DraftModelDrafter(Drafter):
    name = "draft-model"
    gives_candidates = True  # each step's best tokens along the chain: token trees (`TokenPicker`)

    def __init__(self, draft, target, *, force: bool = False):
        """`draft` and `target` are TargetAdapters. The vocabularies must match (the
        same tokenizer), unless `force` (then the draft's may be a prefix of the target's)."""
        if draft.vocab_size != target.vocab_size and not (force and draft.vocab_size < target.vocab_size):
            raise DrafterMismatchError(f"draft model vocabulary {draft.vocab_size} != target's {target.vocab_size}")
        ours, theirs = draft.fingerprint().get("tokenizer_sha256"), target.fingerprint().get("tokenizer_sha256")
        if not force and ours and theirs and ours != theirs:
            raise DrafterMismatchError("the draft model has a different tokenizer than the target; "
                                       "--force-drafter uses it anyway")
        self.draft, self.target = draft, target
        self.name = f"draft-model:{draft.name}"
        self._fed: list[int] = []  # ids whose K/V the draft cache holds, in order

    def fork(self) -> "DraftModelDrafter":
        """Same draft weights, its own KV cache."""
        from blockspec.targets.adapter import TargetAdapter

        other = copy.copy(self)
        other.draft = TargetAdapter(self.draft.model, self.draft.tokenizer, self.draft.name)
        other._fed = []
        return other

    def begin(self, prompt_ids, prompt_features) -> None:
        self.draft.reset()
        self._fed = []

    @torch.inference_mode()
    def propose_one(self, request: DraftRequest) -> Draft:
        token_ids, num_drafts = request.token_ids, request.num_drafts
        committed = token_ids.tolist()
        keep = 0
        for ours, theirs in zip(self._fed, committed):
            if ours != theirs:
                break
            keep += 1
        keep = min(keep, len(committed) - 1)  # the anchor is always run: its logits start the draft
        self.draft.rollback(keep)
        self._fed = committed[:keep]
        logits = self.draft.forward(token_ids[keep:], (), last_logits_only=True).logits[-1]
        self._fed += committed[keep:]
        # a forced smaller vocabulary: padded
        pick = TokenPicker(request.params, request.generator, self.target.vocab_size, candidates=request.candidates)
        for index in range(num_drafts):
            token = pick(logits[None])
            if index + 1 < num_drafts:
                logits = self.draft.forward(torch.tensor([token]), ()).logits[-1]
                self._fed.append(token)
        # no rollback here: the next proposal rolls back to what the verifier kept (a
        # sliding-window cache can only drop tokens run since its last rollback)
        return pick.draft()


def load_draft_model(spec: str, target, **options) -> DraftModelDrafter:
    """`model:PATH` -> a draft model loaded like a target (hub id, folder or .gguf), on the
    target's device, in `options['dtype']` (default: the target's dtype)."""
    from blockspec.targets.loading import load_target

    path = spec.removeprefix("model:")
    # the threads already set for the target: load_target's default would reset them to every core
    draft = load_target(path, device=str(target.device), dtype=options.get("dtype") or target.dtype,
                        threads=torch.get_num_threads())
    return DraftModelDrafter(draft, target, force=options.get("force", False))
