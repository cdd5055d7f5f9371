"""The one thin layer between the engine and a transformers causal LM.

It does three things: run new tokens through the model on top of a KV cache
(returning logits and the hidden states of the requested layers), roll that cache
back to a committed length, and expose the embedding and LM head that drafters
borrow. Everything architecture-specific stays inside transformers.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from blockspec.targets.cache import new_cache
from blockspec.targets.linear_kernels import RowDispatchLinear

FP16_MAX = 65504.0


def target_features(hidden_states, layer_ids) -> torch.Tensor:
    """The drafters' features: layer id i = OUTPUT of decoder layer i = hidden_states[i + 1]
    (hidden_states[0] is the embedding), concatenated on the last dimension."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def compact_features(features: torch.Tensor) -> torch.Tensor:
    """Features to keep (stored for training, or cached across epochs): fp16, half of fp32's
    memory, unless a value would overflow fp16 (|x| > 65504, as in some Gemma layers): then
    bf16, which has fp32's range. Already 16-bit features are returned as they are."""
    if features.dtype in (torch.float16, torch.bfloat16):
        return features
    if features.numel() and float(features.abs().max()) > FP16_MAX:
        return features.to(torch.bfloat16)
    return features.to(torch.float16)


def crop_cache_to_length(cache: DynamicCache, length: int) -> None:
    """Roll `cache` back so that it holds exactly the first `length` positions.

    transformers 5.x `crop` takes a NEGATIVE count of tokens to remove (a positive
    value is rejected). We always call it, even with zero tokens to remove: for
    sliding-window layers that record their past, `crop(0)` is what trims the
    states back to the window after a forward pass.
    """
    current = cache.get_seq_length()
    if length > current or length < 0:
        raise ValueError(f"cannot roll the cache back to {length} tokens: it holds {current}")
    cache.crop(-(current - length))


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, vocab] float32
    features: torch.Tensor | None  # [n, len(layer_ids) * hidden] or None


class TargetAdapter:
    """A causal LM plus its tokenizer, decoding one sequence on its own KV cache."""

    def __init__(self, model, tokenizer, name: str):
        head = model.get_output_embeddings()
        # A float32 head gets its kernel with every other Linear (`load_target`); another CPU
        # head is computed as W @ x^T at every width: much faster than F.linear for the few rows
        # of a verify pass (a 4-token verify of the default target 86 -> 73 ms) and no slower for one.
        if type(head) is torch.nn.Linear and head.bias is None and head.weight.device.type == "cpu" \
                and head.weight.dtype != torch.float32:
            model.set_output_embeddings(RowDispatchLinear(head, ["weight-first"]))
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        text_config = model.config.get_text_config(decoder=True)
        self.config = text_config
        self.num_layers: int = text_config.num_hidden_layers
        self.hidden_size: int = text_config.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.max_context: int = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # which kernel runs the Linear products (targets/linear_kernels.py); `load_target` measures and sets it
        self.linear_kernels: dict = {"kernels": {}, "source": "as-built"}
        self.eos_token_ids: tuple[int, ...] = _eos_ids(model, tokenizer)
        self.cache: DynamicCache | None = None
        # With sliding-window layers, only the tokens of the passes since the last
        # rollback can be removed (older ones left the window for good).
        self._rollback_floor = 0
        self._has_sliding_layers = False

    # --- what drafters borrow -------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # Through the module, not its weight: Gemma scales by sqrt(hidden) inside it.
        return self.model.get_input_embeddings()(token_ids)

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def rope_theta(self) -> float:
        params = getattr(self.config, "rope_parameters", None) or {}
        if isinstance(params, dict) and "rope_theta" in params:
            return float(params["rope_theta"])
        if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
            return float(params["full_attention"].get("rope_theta", 10000.0))
        return float(getattr(self.config, "rope_theta", 10000.0))

    def fingerprint(self) -> dict:
        """What a drafter records about the target it was trained for, and checks at load."""
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "tokenizer_sha256": self._tokenizer_sha256,
        }

    @functools.cached_property
    def _tokenizer_sha256(self) -> str | None:
        # hashed once: the vocabulary can hold hundreds of thousands of entries
        if self.tokenizer is None:
            return None
        digest = hashlib.sha256()
        for token, index in sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1]):
            digest.update(f"{index}\t{token}\n".encode())
        return digest.hexdigest()

    # --- decoding on a KV cache ----------------------------------------------
    def reset(self) -> None:
        """Start a new sequence with an empty cache that can always roll back."""
        self.cache = new_cache(self.model.config)  # full-attention layers grow in place
        # Sliding-window layers (Gemma 3) otherwise drop states as soon as they
        # leave the window and can no longer be cropped: keep them until we crop.
        self.cache.activate_past_recording()
        self._has_sliding_layers = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        self._rollback_floor = 0

    @property
    def seq_len(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, layer_ids: tuple[int, ...] = (), last_logits_only: bool = False
    ) -> TargetOutput:
        """Run `token_ids` (1-D) at the next positions of the cache."""
        if self.cache is None:
            self.reset()
        out = self.model(
            input_ids=token_ids.view(1, -1).to(self.device),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(layer_ids),
            logits_to_keep=1 if last_logits_only else 0,
        )
        features = None
        if layer_ids:
            # Layer id i = OUTPUT of decoder layer i = hidden_states[i + 1].
            features = target_features(out.hidden_states, layer_ids)[0]
        return TargetOutput(logits=out.logits[0].float(), features=features)

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions. Call it after every forward (it also trims
        sliding-window layers); it can remove any tokens of the passes since the last call."""
        if self._has_sliding_layers and length < self._rollback_floor:
            raise ValueError(
                f"cannot roll back to {length}: sliding-window layers only keep the tokens added since "
                f"the last rollback (at {self._rollback_floor})"
            )
        crop_cache_to_length(self.cache, length)
        self._rollback_floor = length

    # --- text -----------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """Token ids of a prompt; instruct models get their chat template unless `raw`."""
        if isinstance(prompt, list) or (self.has_chat_template and not raw):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)
