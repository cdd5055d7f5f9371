"""EAGLE-3-style drafter: ONE autoregressive decoder layer on fused target features.

    g_j     = fc([f_low; f_mid; f_high]_j)        the target's features at position j, fused
    input_j = [input_layernorm(embed(x_{j+1})); hidden_norm(g_j)]   (2H wide: q/k/v read both)
    h_j     = the layer's residual stream after attention and MLP (g_j is its residual start)
    x_{j+2} = argmax(head(norm(h_j)))

Drafting from the last verified position j = n - 1 (the anchor x_n has no features yet):
step 1 runs the committed positions whose features are new (causal attention over the
drafter's own cache of committed positions) and predicts x_{n+1} at position n - 1; step
s >= 2 feeds the drafter's OWN h of the previous step with the embedding of the token it
just drafted, at position n + s - 2, attending the committed cache and the chain's
earlier steps. Drafted positions are never kept: the cache holds only committed
positions, computed from the target's true features. Training unrolls the same steps
on the true tokens (training-time test, `blockspec train --method eagle3`).

The checkpoint IS the EAGLE-3 format vLLM (`llama_eagle3`, method "eagle3") and SGLang
read: `architectures: ["LlamaForCausalLMEagle3"]`, weights `fc`, `midlayer.*`, `norm`,
`lm_head` (the target head's rows for the draft vocabulary), `d2t` (offsets) and `t2d`,
`draft_vocab_size`. Embedding and LM head are the target's, frozen.

Which target layers: both engines default to capturing the hidden state BEFORE decoder
layers (2, L//2, L-3), i.e. our ids (1, L//2 - 1, L - 4) (ours count the output of layer
i as i). When a drafter uses those, `eagle_aux_hidden_state_layer_ids` is left out and
both read it right. Other ids are written as vLLM 0.33 reads the field (the state before
layer id: ours + 1); SGLang 0.5.23 adds one more (`set_eagle3_layers_to_capture`), so
`blockspec export DIR --to sglang OUT` writes ours unchanged there, marked for reading back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.decoding.draft import Draft, DraftRequest
from blockspec.drafters.base import TargetBoundDrafter, TokenPicker, stack_padded
from blockspec.drafters.checkpoint import DraftCheckpoint
from blockspec.drafters.layers import SwiGLU, apply_rope, layer_shape, rope_cos_sin, rope_inverse_frequencies
from blockspec.errors import DrafterMismatchError


# config.json of a folder exported `--to sglang`: eagle_aux_hidden_state_layer_ids holds our ids
SGLANG_MARKER = "blockspec_layer_ids_for_sglang"


def default_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """Low, middle and high features: vLLM's default aux layers (2, L//2, L-3), in our
    convention (`i` = the output of decoder layer i, i.e. their id - 1)."""
    last = num_target_layers - 1
    return sorted({min(max(i, 0), last) for i in (1, num_target_layers // 2 - 1, num_target_layers - 4)})


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    block_size: int = 8  # anchor + the drafts it was trained to unroll
    draft_vocab_size: int | None = None
    target: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, target, *, block_size: int = 8, target_layer_ids: list[int] | None = None,
                   intermediate_size: int | None = None) -> "Eagle3Config":
        return cls(**layer_shape(target, intermediate_size),
                   target_layer_ids=list(target_layer_ids or default_eagle3_layer_ids(target.num_layers)),
                   block_size=block_size)

    def to_hf_dict(self) -> dict:
        """config.json as vLLM's and SGLang's EAGLE-3 Llama readers expect it."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "target_hidden_size": self.hidden_size,
            "eagle_config": {"use_aux_hidden_state": True, **(
                {} if self.uses_default_layers() else
                {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids]})},
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "torch_dtype": "float32",
            "blockspec_target": self.target,
        }

    def uses_default_layers(self) -> bool:
        # below 8 layers the engines' default (2, L//2, L-3) is not three distinct layers
        return self.num_target_layers >= 8 and list(self.target_layer_ids) == default_eagle3_layer_ids(
            self.num_target_layers)

    @classmethod
    def from_hf_dict(cls, data: dict) -> "Eagle3Config":
        try:
            heads = data["num_attention_heads"]
            aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if not aux:  # the engines' default
                layer_ids = default_eagle3_layer_ids(data["num_target_layers"])
            elif data.get(SGLANG_MARKER):  # written for SGLang: the ids are ours
                layer_ids = [int(i) for i in aux]
            else:  # vLLM's reading: the state before layer id
                layer_ids = [int(i) - 1 for i in aux]
            vocab = data["vocab_size"]
            draft_vocab = data.get("draft_vocab_size")
            return cls(hidden_size=data["hidden_size"], intermediate_size=data["intermediate_size"],
                       num_attention_heads=heads, num_key_value_heads=data.get("num_key_value_heads") or heads,
                       head_dim=data.get("head_dim") or data["hidden_size"] // heads, vocab_size=vocab,
                       num_target_layers=data["num_target_layers"], target_layer_ids=layer_ids,
                       rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(data.get("rope_theta") or 1e6),
                       max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
                       block_size=int(data.get("block_size", 8)),
                       draft_vocab_size=draft_vocab if draft_vocab and draft_vocab != vocab else None,
                       target=data.get("blockspec_target") or {})
        except (KeyError, TypeError) as error:
            raise DrafterMismatchError(f"config.json is not an EAGLE-3 drafter config: missing or bad field {error}") from None


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        wide = 2 * config.hidden_size  # [embedding; hidden]
        self.q_proj = nn.Linear(wide, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, past_k, past_v, mask):
        """x [b, n, 2H]; keys/values = [past | new]; `mask` [b, 1, n, past + n] (True: attend).
        Returns (output [b, n, H], new K, new V)."""
        b, n, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), k, v


class Eagle3Layer(nn.Module):
    """vLLM's `llama_eagle3` first layer: attention over [norm(embedding); norm(hidden)],
    the residual stream starting from the (un-normed) hidden state."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, embeds, hidden, cos, sin, past_k=None, past_v=None, mask=None):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, k, v = self.self_attn(x, cos, sin, past_k, past_v, mask)
        residual = hidden + attended
        return residual + self.mlp(self.post_attention_layernorm(residual)), k, v


class Eagle3DraftModel(DraftCheckpoint, nn.Module):
    """Weight names are the EAGLE-3 checkpoints' (fc, midlayer.*, norm)."""

    architecture = "LlamaForCausalLMEagle3"
    architecture_aliases = ("Eagle3LlamaForCausalLM",)
    config_class = Eagle3Config
    head_always_stored = True

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config.rope_theta, config.head_dim), persistent=False)
        if config.draft_vocab_size:
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.stored_head = None

    def forward(self, embeds, hidden, positions, past_k=None, past_v=None, mask=None):
        """One pass of the layer: embeddings and hidden states [b, n, H] at `positions` [b, n]
        -> (h [b, n, H] before the final norm, new K, new V)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, embeds.dtype)
        return self.midlayer(embeds, hidden, cos, sin, past_k, past_v, mask)

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        # t2d: which target ids the draft vocabulary holds, part of the EAGLE-3 checkpoint
        # convention (vLLM and SGLang skip it, reading d2t); all of them when not reduced
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[self.d2t if self.config.draft_vocab_size else slice(None)] = True
        return {"t2d": t2d}


class Eagle3Drafter(TargetBoundDrafter):
    name = "eagle3"
    kind = "EAGLE-3 drafter"
    gives_candidates = True  # each step's best tokens along the chain: token trees (`TokenPicker`)

    def __init__(self, model: Eagle3DraftModel, target, *, force: bool = False, dtype: torch.dtype | None = None):
        super().__init__(model, target, force=force, dtype=dtype)
        self.max_block_size = model.config.block_size
        self._keys = self._values = None  # the committed positions' K/V [1, kv, m, d]
        self._unseen: list[torch.Tensor] = []  # features of committed positions not yet in the cache

    def begin(self, prompt_ids, prompt_features) -> None:
        self._keys = self._values = None
        self._unseen = [prompt_features]

    def accept(self, committed_ids, committed_features) -> None:
        self._unseen.append(committed_features)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.model.norm(h))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Every row's chain together (`unroll_rows`)."""
        picks = [TokenPicker(request.params, request.generator, self.target.vocab_size, self._d2t, request.candidates)
                 for request in requests]
        self.unroll_rows([request.sequence for request in requests], [request.token_ids for request in requests],
                         [request.num_drafts for request in requests],
                         lambda row, step, logits: picks[row](logits))
        return [pick.draft() for pick in picks]

    @torch.inference_mode()
    def unroll(self, token_ids: torch.Tensor, num_drafts: int, pick) -> None:
        """One sequence's chain: `pick(step, logits [1, V'])` chooses each step's token."""
        self.unroll_rows([self], [token_ids], [num_drafts], lambda row, step, logits: pick(step, logits))

    def unroll_rows(self, forks: list["Eagle3Drafter"], token_ids: list[torch.Tensor], num_drafts: list[int],
                    pick) -> None:
        """Bring each fork's cache up to its committed tokens (row by row: their lengths
        differ), then run every row's chain together, one pass per step. `pick(row, step,
        logits [1, V'])` chooses a row's token (a target id), fed back as its next input.
        Rows' committed K/V are padded to the longest, under a mask only where lengths
        differ; a row that needs fewer drafts runs along, its extra steps dropped."""
        device = self.target.device
        states = [fork._catch_up(ids) for fork, ids in zip(forks, token_ids)]
        h = torch.cat([state for state, _ in states])  # [rows, 1, H]
        anchors = torch.tensor([n for _, n in states], device=device)
        cached = torch.tensor([fork._keys.shape[2] for fork in forks], device=device)
        chain_k = stack_padded([fork._keys for fork in forks])
        chain_v = stack_padded([fork._values for fork in forks])
        ragged = bool((cached != cached[0]).any())
        visible = torch.arange(chain_k.shape[2], device=device)[None] < cached[:, None] if ragged else None
        longest_chain = max(num_drafts)
        for step in range(longest_chain):
            logits = self._logits(h[:, 0])  # [rows, V']
            tokens = [int(pick(row, step, logits[row:row + 1])) if step < wanted else 0
                      for row, wanted in enumerate(num_drafts)]
            if step == longest_chain - 1:
                break
            if visible is not None:  # each row also sees its own new step
                visible = torch.cat([visible, visible.new_ones(len(forks), 1)], dim=1)
            h, k, v = self.model(self.embed(torch.tensor(tokens, device=device)[:, None]), h,
                                 (anchors + step)[:, None], chain_k, chain_v,
                                 None if visible is None else visible[:, None, None, :])
            chain_k, chain_v = torch.cat([chain_k, k], dim=2), torch.cat([chain_v, v], dim=2)

    def _catch_up(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Step 1: the new committed positions, each paired with the NEXT token, into the cache.
        Returns the anchor's state h [1, 1, H] and its position n."""
        device, dtype = self.target.device, self.dtype
        features = torch.cat(self._unseen).to(device, dtype)
        self._unseen = []
        cached = 0 if self._keys is None else self._keys.shape[2]
        n = token_ids.numel() - 1  # the anchor's position; features cover 0..n-1
        if features.shape[0] != n - cached:
            raise RuntimeError(f"EAGLE-3 drafter out of step: features for {features.shape[0]} new positions, "
                               f"{n - cached} committed")
        positions = torch.arange(cached, n, device=device)[None]
        embeds = self.embed(token_ids[cached + 1:n + 1].to(device))[None]
        causal = torch.ones(n - cached, n, dtype=torch.bool, device=device).tril(cached)[None, None]
        h, k, v = self.model(embeds, self.model.fc(features[None]), positions, self._keys, self._values, causal)
        self._keys = k if self._keys is None else torch.cat([self._keys, k], dim=2)
        self._values = v if self._values is None else torch.cat([self._values, v], dim=2)
        return h[:, -1:], n

def load_eagle3(directory, target, **options) -> Eagle3Drafter:
    return Eagle3Drafter(Eagle3DraftModel.from_pretrained(directory), target, force=options.get("force", False),
                         dtype=options.get("dtype"))
