"""What drafters share beyond the engine's contract (`blockspec.decoding.draft`): binding
their weights to the target (`TargetBoundDrafter`), one-token-at-a-time choices, padding
of per-sequence states, and mapping a reduced draft vocabulary to the target's."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from blockspec.decoding.draft import Draft, Drafter
from blockspec.decoding.sampling import SamplingParams, sample, warp_probs
from blockspec.decoding.tree import Candidates
from blockspec.drafters.checkpoint import fit_problems
from blockspec.errors import DrafterMismatchError


def bind_to_target(model: torch.nn.Module, target, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The drafter's weights on the target's device, in `dtype` (default: the target's), in
    eval mode, WITHOUT changing the module given: `nn.Module.to` converts in place, so a
    trainer handing its fp32 model to a drafter for a held-out eval on a bf16 GPU target
    would silently train in bf16 after it."""
    dtype = dtype or target.dtype
    parameter = next(model.parameters(), None)
    if parameter is not None and (parameter.device != target.device or parameter.dtype != dtype):
        model = copy.deepcopy(model).to(device=target.device, dtype=dtype)
    elif model.training:
        model = copy.deepcopy(model)
    return model.eval()


def frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.nn.Linear:
    """An inference-only `nn.Linear` around a head's (weight, bias) in `dtype`: a module, so that
    the loader can run its product in the kernel this machine runs fastest, as the layers'
    (on an AVX2 EPYC oneDNN took 2.8 ms where `F.linear` took 5.3 for 7 rows of an 8192-row head)."""
    out_features, in_features = weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return linear


class TargetBoundDrafter(Drafter):
    """A drafter with a small model of its own (a `DraftCheckpoint`) that reads the target's
    features and borrows its embedding and LM head: the fit check, the binding and the head,
    written once for every such method."""

    kind = "drafter"  # how errors name it

    def __init__(self, model, target, *, force: bool = False, dtype: torch.dtype | None = None):
        """`force` accepts a drafter trained for another tokenizer (the shapes must still fit).
        `dtype`: the precision the drafter computes in (default: the target's); its inputs
        (the target's embeddings and features) and the borrowed head are cast to it."""
        self.check_fits(model.config, target, check_fingerprint=not force)
        self.dtype = dtype or target.dtype
        self.model = bind_to_target(model, target, self.dtype)
        self.target = target
        self.target_layer_ids = tuple(model.config.target_layer_ids)
        self.head = frozen_linear(*self.model.head(target), dtype=self.dtype)
        self._d2t = getattr(self.model, "d2t", None)

    @staticmethod
    def fit_problems(config, target, check_fingerprint: bool = True) -> list[str]:
        return fit_problems(config, target, check_fingerprint)

    @classmethod
    def check_fits(cls, config, target, check_fingerprint: bool = True) -> None:
        """Raise DrafterMismatchError naming exactly what does not fit `target`."""
        problems = cls.fit_problems(config, target, check_fingerprint)
        if problems:
            raise DrafterMismatchError(f"{cls.kind} does not fit the target: " + "; ".join(problems))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of `token_ids`, in the drafter's precision."""
        return self.target.embed(token_ids).to(self.dtype)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary (the target's head, restricted)."""
        return self.head(hidden).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self._d2t is None else self._d2t[draft_ids]


class TokenPicker:
    """The choices of a draft made one token at a time (MTP, EAGLE-3, a draft model): the
    argmax at T=0, else a sample from the drafter's warped distribution, whose rows the
    rejection sampler needs. `d2t` maps a reduced draft vocabulary to target ids.
    `candidates` > 0 (a token tree will be grown, `DraftRequest.candidates`): the argmax at
    any temperature, and each step's best `candidates` tokens with their log-probabilities
    (at T > 0 under the distribution the target samples with), the tree's per-position
    candidates along the chain (verifying a tree of one-hot drafts is exact at any T)."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, vocab_size: int,
                 d2t: torch.Tensor | None = None, candidates: int = 0):
        self.params, self.generator, self.vocab_size, self.d2t = params, generator, vocab_size, d2t
        self.candidates = candidates
        self.tokens: list[int] = []
        self.rows: list[torch.Tensor] = []
        self.best: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: (target ids [K], log-probs [K])

    def __call__(self, logits: torch.Tensor) -> int:
        """Choose from `logits` [1, V'] (draft vocabulary); returns the TARGET id."""
        if self.candidates:
            logprobs = torch.log_softmax(logits.float(), -1) if self.params.greedy else warp_probs(
                logits.float(), self.params).log()
            best = logprobs[0].topk(min(self.candidates, logprobs.shape[-1]))
            ids = best.indices if self.d2t is None else self.d2t[best.indices]
            self.best.append((ids.cpu(), best.values.cpu()))
            choice = best.indices[:1]
        elif self.params.greedy:
            choice = logits.argmax(-1)
        else:
            probs = warp_probs(logits.float(), self.params)
            self.rows.append(probs[0])
            choice = sample(probs, self.generator)
        token = int(choice[0] if self.d2t is None else self.d2t[choice[0]])
        self.tokens.append(token)
        return token

    def draft(self) -> Draft:
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        if self.best:
            candidates = Candidates(torch.stack([ids for ids, _ in self.best]),
                                    torch.stack([values for _, values in self.best]))
            return Draft(tokens=tokens, candidates=candidates)
        if self.params.greedy or not self.rows:
            return Draft(tokens=tokens)
        probs = on_target_vocabulary(torch.stack(self.rows), self.vocab_size, self.d2t)
        return Draft(tokens=tokens, probs=probs.cpu())


def stack_padded(states: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence K or V [1, heads, n_i, d] -> [rows, heads, max n_i, d], zero-padded at the
    end of each row (a mask must hide the padding); one row is returned as it is."""
    if len(states) == 1:
        return states[0]
    longest = max(state.shape[2] for state in states)
    return torch.cat([F.pad(state, (0, 0, 0, longest - state.shape[2])) for state in states])


def on_target_vocabulary(probs: torch.Tensor, vocab_size: int, d2t: torch.Tensor | None = None) -> torch.Tensor:
    """A draft distribution [k, V'] as one over the target's vocabulary [k, V] (zero where the
    drafter cannot propose): what rejection sampling needs. `d2t` maps a reduced draft
    vocabulary to target ids; without it the first V' ids are the drafter's."""
    if d2t is not None:
        return torch.zeros(probs.shape[0], vocab_size, dtype=probs.dtype, device=probs.device).index_copy_(1, d2t, probs)
    if probs.shape[1] < vocab_size:
        return torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[1]))
    return probs
