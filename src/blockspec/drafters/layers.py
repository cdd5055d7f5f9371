"""The pieces every drafter model is built from: a draft layer's shape copied from the
target, RoPE at absolute positions, and the SwiGLU MLP (Qwen3 / LLaMA style)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_shape(target, intermediate_size: int | None = None) -> dict:
    """The config fields a draft layer copies from `target` (a TargetAdapter): sizes, heads,
    norm epsilon, RoPE, context length, vocabulary and the target's fingerprint."""
    tc = target.config
    heads = tc.num_attention_heads
    return dict(hidden_size=target.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
                num_attention_heads=heads, num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                head_dim=getattr(tc, "head_dim", None) or target.hidden_size // heads,
                vocab_size=target.vocab_size, num_target_layers=target.num_layers,
                rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)), rope_theta=target.rope_theta,
                max_position_embeddings=target.max_context, target=target.fingerprint())


def rope_inverse_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [b, 1, n, d] for absolute `positions` [b, n] (default RoPE)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def swiglu(x: torch.Tensor, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> torch.Tensor:
    return down_proj(F.silu(gate_proj(x)) * up_proj(x))


class SwiGLU(nn.Module):
    """The MLP of a draft layer; parameter names are the checkpoints' (gate/up/down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return swiglu(x, self.gate_proj, self.up_proj, self.down_proj)
