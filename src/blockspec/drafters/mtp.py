"""MTP head (FastMTP style): ONE position-shared head on the target's last hidden state,
applied recursively to predict t+2, t+3, ...

    h_0 = the target's final hidden state at the last verified position (it already
          predicted the bonus token x_1 through the target's own head)
    h_k = h_{k-1}' + MLP(norm(h_{k-1}')),  h_{k-1}' = fc([norm(h_{k-1}); norm(embed(x_k))])
    x_{k+1} = argmax(target_head(norm(h_k)))   (or a sample, at T > 0)

The head has no attention of its own: it sees the sequence only through the target's
hidden state, which is what keeps it one small MLP per drafted token. Embedding and LM
head are the target's, frozen; an optional reduced draft vocabulary restricts the head.
Trained by self-distillation on the target's regenerated data (`blockspec train --method
mtp`). Checkpoint: config.json (`architectures: ["MTPHeadModel"]`) + model.safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from blockspec.decoding.draft import Draft, DraftRequest
from blockspec.drafters.base import TargetBoundDrafter, TokenPicker
from blockspec.drafters.checkpoint import DraftCheckpoint
from blockspec.drafters.layers import swiglu
from blockspec.errors import DrafterMismatchError


@dataclass
class MTPConfig:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    block_size: int = 8  # anchor + drafted tokens it was trained for
    draft_vocab_size: int | None = None
    target: dict = field(default_factory=dict)

    @property
    def target_layer_ids(self) -> list[int]:
        return [self.num_target_layers - 1]  # the final hidden state

    @classmethod
    def for_target(cls, target, *, block_size: int = 8, intermediate_size: int | None = None) -> "MTPConfig":
        return cls(hidden_size=target.hidden_size,
                   intermediate_size=intermediate_size or target.config.intermediate_size,
                   vocab_size=target.vocab_size, num_target_layers=target.num_layers,
                   rms_norm_eps=float(getattr(target.config, "rms_norm_eps", 1e-6)), block_size=block_size,
                   target=target.fingerprint())

    def to_hf_dict(self) -> dict:
        return {"architectures": ["MTPHeadModel"], "model_type": "blockspec_mtp", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
                "num_target_layers": self.num_target_layers, "rms_norm_eps": self.rms_norm_eps,
                "block_size": self.block_size, "blockspec_target": self.target,
                **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {})}

    @classmethod
    def from_hf_dict(cls, data: dict) -> "MTPConfig":
        try:
            return cls(hidden_size=data["hidden_size"], intermediate_size=data["intermediate_size"],
                       vocab_size=data["vocab_size"], num_target_layers=data["num_target_layers"],
                       rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), block_size=int(data.get("block_size", 8)),
                       draft_vocab_size=data.get("draft_vocab_size"), target=data.get("blockspec_target") or {})
        except KeyError as error:
            raise DrafterMismatchError(f"config.json is not an MTP head config: missing {error}") from None


class MTPHeadModel(DraftCheckpoint, nn.Module):
    architecture = "MTPHeadModel"
    config_class = MTPConfig

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.embed_norm = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        if config.draft_vocab_size:
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.stored_head = None
        with torch.no_grad():  # start as "the next hidden state is the current one" plus a small update
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.down_proj.weight.mul_(0.1)

    def step(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """One recursion: [.., H] hidden and the next token's embedding -> the next hidden."""
        x = self.fc(torch.cat([self.hidden_norm(hidden), self.embed_norm(token_embeds)], dim=-1))
        y = self.mlp_norm(x)
        return x + swiglu(y, self.gate_proj, self.up_proj, self.down_proj)


class MTPDrafter(TargetBoundDrafter):
    name = "mtp"
    kind = "MTP head"
    gives_candidates = True  # each step's best tokens along the chain: token trees (`TokenPicker`)

    def __init__(self, model: MTPHeadModel, target, *, force: bool = False, dtype: torch.dtype | None = None):
        super().__init__(model, target, force=force, dtype=dtype)
        self._hidden: torch.Tensor | None = None

    def begin(self, prompt_ids, prompt_features) -> None:
        self._hidden = prompt_features[-1].to(self.dtype)

    def accept(self, committed_ids, committed_features) -> None:
        self._hidden = committed_features[-1].to(self.dtype)  # the last verified position: it predicted the bonus token

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Every row's recursion together, one pass per step (a row that needs fewer drafts
        runs along; its extra steps are dropped)."""
        device = self.target.device
        hidden = torch.stack([request.sequence._hidden for request in requests])  # [rows, H]
        tokens = torch.stack([request.token_ids[-1] for request in requests])
        picks = [TokenPicker(request.params, request.generator, self.target.vocab_size, self._d2t, request.candidates)
                 for request in requests]
        for step in range(max(request.num_drafts for request in requests)):
            hidden = self.model.step(hidden, self.embed(tokens.to(device)))
            logits = self.head_logits(self.model.norm(hidden))
            tokens = torch.tensor([pick(logits[row:row + 1]) if step < requests[row].num_drafts else 0
                                   for row, pick in enumerate(picks)])
        return [pick.draft() for pick in picks]


def load_mtp(directory, target, **options) -> MTPDrafter:
    return MTPDrafter(MTPHeadModel.from_pretrained(directory), target, force=options.get("force", False),
                      dtype=options.get("dtype"))
