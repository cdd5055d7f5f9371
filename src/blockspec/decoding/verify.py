"""Verification: which drafted tokens the target keeps, its bonus token, what is committed.

`verify` picks one of four lossless rules. Inputs: `target_logits` [k+1, V] from ONE target pass over
[anchor, d_1..d_k] (row i is the target's distribution for the token after
position i), the k draft tokens and, for probabilistic drafts, `draft_probs` [k, V]:
exactly the distribution each draft token was sampled from. The chain rules return
(accept_length, bonus_token); a tree (`Draft.parents`) is walked along the target's own
choices (`accept_tree`); `verify` returns the accepted drafts' indices either way.
"""

from __future__ import annotations

import torch

from blockspec.decoding.draft import Draft
from blockspec.decoding.sampling import SamplingParams, TokenSampler, warp_probs
from blockspec.decoding.tree import depths, walk


def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams, sampler: TokenSampler | None,
           position: int) -> tuple[list[int], int]:
    """The one verifier every path uses: (the accepted drafts' indices, in order; the bonus
    token) for `draft` given the target's logits over [anchor, drafts]; `position` is the
    output position of the first token decided (the number of tokens generated so far).
    A chain's accepted drafts are its first ones; a tree's are the path the target walks."""
    if draft.parents is not None:
        return accept_tree(logits, draft.tokens.tolist(), draft.parents, params, sampler, position)
    if params.greedy:
        accept_length, bonus = accept_greedy(logits, draft.tokens)
    elif draft.probs is None:
        accept_length, bonus = accept_by_matching_samples(logits, draft.tokens, params, sampler, position)
    else:
        accept_length, bonus = accept_rejection_sampling(logits, draft.tokens, draft.probs, params, sampler, position)
    return list(range(accept_length)), bonus


def accept_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
                sampler: TokenSampler | None, position: int) -> tuple[list[int], int]:
    """A tree, by matching the target's own choices: its argmax (T = 0), or its sample at
    every node's output position (T > 0: nodes at one depth share that position's uniform,
    so whichever node the walk reaches, its token is exactly what plain sampling draws after
    that prefix). The walk keeps a node only if it IS the target's choice after its parent,
    so every committed token is the target's: lossless for any tree."""
    if params.greedy:
        target_next = logits.argmax(-1).tolist()
    else:
        target_next = sampler.sample(warp_probs(logits, params), position,
                                     positions=[position + depth for depth in [0] + depths(parents)]).tolist()
    return walk(tokens, parents, target_next)


def cut_after_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """`tokens` up to and including the first stop id (nothing after it is generated)."""
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens


def record_logprobs(sink: list, logits: torch.Tensor, tokens: list[int], top: int) -> None:
    """Append (log-probability of each token under the target, its `top` best alternatives)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    for row, token in zip(log_probs, tokens):
        best = row.topk(top) if top else None
        sink.append((float(row[token]), [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))))


def accept_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """T = 0: keep the longest prefix equal to the target's argmax."""
    target_tokens = target_logits.argmax(-1)
    return _match_prefix(target_tokens, draft_tokens)


def accept_by_matching_samples(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, params: SamplingParams, sampler: TokenSampler,
    position: int,
) -> tuple[int, int]:
    """T > 0 with one-hot drafts (the reference rule).

    Sample the target's own token at every position; a draft survives only if it
    equals that sample. Each kept token is a genuine target sample given a prefix
    that is itself the target's, so the output distribution is the target's.
    `position` is the output position of the first token decided here.
    """
    target_tokens = sampler.sample(warp_probs(target_logits, params), position)
    return _match_prefix(target_tokens, draft_tokens)


def accept_rejection_sampling(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    params: SamplingParams,
    sampler: TokenSampler,
    position: int,
) -> tuple[int, int]:
    """T > 0 with probabilistic drafts: accept x with min(1, p(x)/q(x)), else resample
    from the residual max(0, p - q) normalised (Leviathan et al.; Chen et al.)."""
    p = warp_probs(target_logits, params)
    k = draft_tokens.shape[0]
    positions = torch.arange(k)
    p_draft = p[positions, draft_tokens]
    q_draft = draft_probs[positions, draft_tokens]
    uniforms = sampler.uniforms(position, k, stream=1).float()
    # accept iff u < p/q  <=>  u * q < p (q > 0 for a token that was sampled from q)
    accepted = (uniforms * q_draft < p_draft).int()
    accept_length = int(accepted.cumprod(0).sum())
    if accept_length < k:
        residual = (p[accept_length] - draft_probs[accept_length]).clamp_min(0)
        total = residual.sum()
        # total == 0 only if p == q exactly, where rejection has probability 0.
        residual = residual / total if total > 0 else p[accept_length]
        return accept_length, int(sampler.sample(residual.view(1, -1), position + accept_length, stream=2)[0])
    return accept_length, int(sampler.sample(p[k].view(1, -1), position + k, stream=2)[0])


def _match_prefix(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    k = draft_tokens.shape[0]
    matches = (target_tokens[:k] == draft_tokens).int()
    accept_length = int(matches.cumprod(0).sum())
    return accept_length, int(target_tokens[accept_length])
