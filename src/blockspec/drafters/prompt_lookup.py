"""Prompt lookup: copy what followed the most recent earlier occurrence of the last n tokens.

Training-free; pays off when the output repeats its input (summaries, code edits, RAG).
"""

from __future__ import annotations

import torch

from blockspec.decoding.draft import Draft, Drafter, DraftRequest


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, prompt_ids, prompt_features) -> None:
        pass  # stateless: everything it needs is in the committed tokens

    def propose_one(self, request: DraftRequest) -> Draft:
        token_ids, num_drafts = request.token_ids, request.num_drafts
        length = token_ids.numel()
        # Longest n-gram first: a longer match is a more specific (more often right) guess.
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = token_ids[-n:]
            windows = token_ids[:-1].unfold(0, n, 1)  # every earlier n-gram (not the suffix itself)
            hits = (windows == suffix).all(dim=1).nonzero().view(-1)
            if hits.numel():
                start = int(hits[-1]) + n  # the most recent occurrence
                continuation = token_ids[start : start + num_drafts]
                if continuation.numel():
                    return Draft(tokens=continuation.clone())
        return Draft(tokens=torch.empty(0, dtype=torch.long))
