"""DFlash: a block-diffusion drafter conditioned on the target's hidden features.

A stack of Qwen3-style decoder layers with no embedding and no LM head of its own
(it borrows the target's, frozen; `trained_head` gives it a trained copy of the head's
draft-vocabulary rows instead, at the same drafting cost). The hidden states of a few target layers are
fused by `fc` + `hidden_norm` into one context vector per committed position; in
EVERY layer the keys/values are [proj(context) | proj(block)] with that layer's
own k_proj / v_proj, so the drafter "sees" the target's view of the context.
A block is [anchor, MASK x (B-1)]; attention inside it is bidirectional and the
output at block position k predicts the token AT position start + k. One forward
pass drafts the whole block. The context K/V are cached across iterations.

Checkpoints are the reference format (config.json + model.safetensors) that vLLM
(`method: "dflash"`) and SGLang (`DFLASH`) read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.decoding.sampling import sample, warp_probs
from blockspec.decoding.draft import Draft, DraftRequest
from blockspec.decoding.tree import Candidates
from blockspec.drafters.base import TargetBoundDrafter, on_target_vocabulary, stack_padded
from blockspec.drafters.checkpoint import DraftCheckpoint, fit_problems
from blockspec.drafters.layers import SwiGLU, apply_rope, layer_shape, rope_cos_sin, rope_inverse_frequencies
from blockspec.errors import DrafterMismatchError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's choice: evenly from layer 1 to L-3 (one per draft layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return sorted({min(max(i, 0), num_target_layers - 2) for i in ids})  # never repeated, never the last layer


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    target: dict = field(default_factory=dict)  # fingerprint of the target it was trained for
    # Reduced draft vocabulary: the LM head is restricted to these many target ids (the
    # `d2t` buffer maps draft index -> target id). Cuts the head's cost on CPU.
    draft_vocab_size: int | None = None
    # The head's draft-vocabulary rows are the drafter's own (`lm_head.weight`, started from the
    # target's rows and trained with the layers) instead of the target's frozen ones: more
    # capacity where drafting costs the same. Needs a reduced draft vocabulary (serving engines
    # read `lm_head.weight` only then).
    trained_head: bool = False

    @classmethod
    def for_target(cls, target, *, num_layers: int = 1, block_size: int = 16, mask_token_id: int | None = None,
                   target_layer_ids: list[int] | None = None, intermediate_size: int | None = None) -> "DFlashConfig":
        """A drafter shaped to fit `target` (a TargetAdapter)."""
        return cls(
            **layer_shape(target, intermediate_size),
            num_hidden_layers=num_layers,
            target_layer_ids=target_layer_ids or default_target_layer_ids(target.num_layers, num_layers),
            mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            block_size=block_size,
        )

    def to_hf_dict(self) -> dict:
        """config.json in the reference format: a Qwen3 config plus the DFlash fields."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "torch_dtype": "float32",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "blockspec_target": self.target,
            **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}),
            **({"trained_lm_head": True} if self.trained_head else {}),
        }

    @classmethod
    def from_hf_dict(cls, data: dict) -> "DFlashConfig":
        try:
            dflash = data["dflash_config"]
            heads = data["num_attention_heads"]
            rope = data.get("rope_parameters") or {}
            return cls(
                hidden_size=data["hidden_size"],
                intermediate_size=data["intermediate_size"],
                num_hidden_layers=data["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=data.get("num_key_value_heads") or heads,
                head_dim=data.get("head_dim") or data["hidden_size"] // heads,
                vocab_size=data["vocab_size"],
                num_target_layers=data["num_target_layers"],
                target_layer_ids=list(dflash["target_layer_ids"]),
                mask_token_id=int(dflash["mask_token_id"]),
                block_size=int(data.get("block_size", 16)),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=float(data.get("rope_theta") or rope.get("rope_theta", 1e6)),
                max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
                target=data.get("blockspec_target") or {},
                draft_vocab_size=data.get("draft_vocab_size"),
                trained_head=bool(data.get("trained_lm_head", False)),
            )
        except (KeyError, TypeError) as error:
            raise DrafterMismatchError(f"config.json is not a DFlash drafter config: missing or bad field {error}") from None


# --- the model ------------------------------------------------------------------

class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def key_value(self, hidden: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V [b, kv_heads, n, d] of `hidden` [b, n, H]."""
        b, n, _ = hidden.shape
        k = self.k_norm(self.k_proj(hidden).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, hidden, cos, sin, context_k, context_v, attn_mask=None):
        b, n, _ = hidden.shape
        q = self.q_norm(self.q_proj(hidden).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        block_k, block_v = self.key_value(hidden, cos, sin)
        k = torch.cat([context_k, block_k], dim=2)
        v = torch.cat([context_v, block_v], dim=2)
        # No causal mask: the block attends to all its context and bidirectionally to itself.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def context_key_value(self, context, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        # a method of the layer (not only of its attention) so that FSDP, which shards
        # per layer, can gather the layer's weights for it as for `forward`
        return self.self_attn.key_value(context, cos, sin)

    def forward(self, hidden, cos, sin, context_k, context_v, attn_mask=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, context_k, context_v, attn_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(DraftCheckpoint, nn.Module):
    """The drafter's own weights. Parameter names are the reference checkpoint's."""

    architecture = "DFlashDraftModel"
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        feature_width = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(feature_width, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config.rope_theta, config.head_dim), persistent=False)
        if config.draft_vocab_size:
            # draft index -> target token id (sorted, absolute ids in memory). On disk `d2t`
            # holds OFFSETS (target id = index + d2t[index]), the EAGLE-3 convention vLLM reads.
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))
        # The target head's rows for the draft vocabulary, written as `lm_head.weight` so that
        # serving engines use the right rows (vLLM otherwise takes the first N). blockspec
        # itself computes the borrowed head from the target at run time.
        self.stored_head = None
        # ... unless the head is the drafter's own (config.trained_head): then it is a weight like any other
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size or config.vocab_size,
                                 bias=False) if config.trained_head else None

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def context_key_values(self, target_features: torch.Tensor, positions: torch.Tensor):
        """Per layer (K, V) of the fused context: features [b, n, k*H] at `positions` [b, n]."""
        context = self.hidden_norm(self.fc(target_features))
        cos, sin = self.rope(positions, context.dtype)
        return [layer.context_key_value(context, cos, sin) for layer in self.layers]

    def forward(self, block_embeds, block_positions, context_kv, attn_mask=None) -> torch.Tensor:
        """Hidden states [b, q, H] (after the final norm) for the block embeddings [b, q, H]."""
        cos, sin = self.rope(block_positions, block_embeds.dtype)
        hidden = block_embeds
        for layer, (context_k, context_v) in zip(self.layers, context_kv):
            hidden = layer(hidden, cos, sin, context_k, context_v, attn_mask)
        return self.norm(hidden)


# --- the drafter in the engine ----------------------------------------------------

class DFlashDrafter(TargetBoundDrafter):
    name = "dflash"
    gives_candidates = True  # one pass gives every position's distribution: trees (DDTree)

    def __init__(self, model: DFlashDraftModel, target, *, context_window: int | None = None,
                 sample_drafts: bool = False, force: bool = False, dtype: torch.dtype | None = None):
        """`context_window` caps the cached context (a sliding window for long prompts);
        `sample_drafts` samples drafts from the drafter's own warped distribution at
        T > 0 (verified by rejection sampling) instead of drafting greedily; `force`
        accepts a drafter trained for another tokenizer (the shapes must still fit); `dtype`
        the precision it computes in (default: the target's)."""
        super().__init__(model, target, force=force, dtype=dtype)
        self.max_block_size = model.config.block_size
        self.mask_token_id = model.config.mask_token_id
        self.context_window = context_window
        self.sample_drafts = sample_drafts
        self._context_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._context_len = 0  # positions seen so far (the window may hold fewer)

    @torch.inference_mode()
    def _extend_context(self, features: torch.Tensor) -> None:
        n = features.shape[0]
        positions = torch.arange(self._context_len, self._context_len + n, device=features.device)[None]
        new_kv = self.model.context_key_values(features[None].to(self.dtype), positions)
        if self._context_kv:
            new_kv = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                      for (k, v), (nk, nv) in zip(self._context_kv, new_kv)]
        if self.context_window is not None:
            # RoPE is already applied at absolute positions, so dropping the oldest entries is exact.
            new_kv = [(k[:, :, -self.context_window:], v[:, :, -self.context_window:]) for k, v in new_kv]
        self._context_kv = new_kv
        self._context_len += n

    def begin(self, prompt_ids, prompt_features) -> None:
        self._context_kv, self._context_len = [], 0
        self._extend_context(prompt_features)

    @torch.inference_mode()
    def block_logits(self, block: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [len(block) - 1, draft vocabulary] for block positions 1.. of `block` (the
        anchor at position `start`, then tokens or mask ids), on the cached context. Same-
        position prediction: row k - 1 is the token AT start + k. Map ids with `to_target_ids`."""
        block = block.to(self.target.device)
        positions = torch.arange(start, start + block.numel(), device=block.device)[None]
        hidden = self.model(self.embed(block)[None], positions, self._context_kv)
        return self.head_logits(hidden[0, 1:])

    def _draft(self, logits: torch.Tensor, request: DraftRequest) -> Draft:
        params = request.params
        if request.candidates:  # a tree will be grown: the best tokens of every position, deterministic
            # at T > 0 from the distribution the target samples with (temperature, top-k, top-p)
            logprobs = torch.log_softmax(logits.float(), -1) if params.greedy else warp_probs(logits, params).log()
            best = logprobs.topk(min(request.candidates, logprobs.shape[-1]), dim=-1)
            candidates = Candidates(self.to_target_ids(best.indices).cpu(), best.values.cpu())
            return Draft(tokens=candidates.ids[:, 0].clone(), candidates=candidates)
        if self.sample_drafts and not params.greedy:
            probs = warp_probs(logits, params)
            tokens = sample(probs, request.generator)
            probs = on_target_vocabulary(probs, self.target.vocab_size, self._d2t)
            return Draft(tokens=self.to_target_ids(tokens).cpu(), probs=probs.cpu())
        return Draft(tokens=self.to_target_ids(logits.argmax(-1)).cpu())

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Every sequence's block in ONE drafter pass: blocks padded with mask ids to the widest,
        each sequence's cached context padded to the longest; a mask keeps each block query to
        its own context and its own block (padding included nowhere), so every row drafts what
        it would alone, up to float rounding."""
        forks = [request.sequence for request in requests]
        if len(forks) == 1:  # one sequence: its own block on its own context, no padding, no mask
            (request,) = requests
            block = torch.full((request.num_drafts + 1,), self.mask_token_id, dtype=torch.long)
            block[0] = request.token_ids[-1]
            logits = forks[0].block_logits(block, request.token_ids.numel() - 1)
            return [forks[0]._draft(logits, request)]
        width = 1 + max(request.num_drafts for request in requests)
        blocks = torch.full((len(forks), width), self.mask_token_id, dtype=torch.long)
        positions = torch.zeros(len(forks), width, dtype=torch.long)
        contexts = [fork._context_kv[0][0].shape[2] for fork in forks]
        longest = max(contexts)
        allowed = torch.zeros(len(forks), 1, width, longest + width, dtype=torch.bool)
        for row, (request, context) in enumerate(zip(requests, contexts)):
            blocks[row, 0] = request.token_ids[-1]
            anchor_position = request.token_ids.numel() - 1
            positions[row] = torch.arange(anchor_position, anchor_position + width)
            allowed[row, :, :, :context] = True
            allowed[row, :, :, longest:longest + request.num_drafts + 1] = True
        device = self.target.device
        context_kv = [(stack_padded([fork._context_kv[layer][0] for fork in forks]),
                       stack_padded([fork._context_kv[layer][1] for fork in forks]))
                      for layer in range(len(self.model.layers))]
        hidden = self.model(self.embed(blocks.to(device)), positions.to(device), context_kv, allowed.to(device))
        logits = self.head_logits(hidden[:, 1:])
        return [fork._draft(logits[row, :request.num_drafts], request)
                for row, (fork, request) in enumerate(zip(forks, requests))]

    def accept(self, committed_ids, committed_features) -> None:
        self._extend_context(committed_features)

    @staticmethod
    def fit_problems(config: DFlashConfig, target, check_fingerprint: bool = True) -> list[str]:
        problems = fit_problems(config, target, check_fingerprint)
        if not 0 <= config.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {config.mask_token_id} outside the target's vocabulary")
        return problems


check_fits = DFlashDrafter.check_fits  # what `check-drafter` runs on a folder's config


def load_dflash(directory, target, **options) -> DFlashDrafter:
    return DFlashDrafter(DFlashDraftModel.from_pretrained(directory), target, **options)

