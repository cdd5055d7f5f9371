"""Plain (non-speculative) batched decoding, lean: the loop `blockspec data` uses to
regenerate responses with the target.

Rows are left-padded to one width and decoded together on one KV cache; positions
come from each row's own attention mask, so padding never shifts a row. A row that
ends (EOS or its token budget) leaves the batch at once: its cache rows are
dropped, so the remaining rows stop paying for it. The LM head runs on the last
position only. At T=0 every row equals plain greedy decoding of its prompt alone,
up to the float rounding that padding can move (the near-tie rule of the tests).

With `feature_layers`, the target's features of those layers (`target_features`, the
drafters' one rule for which hidden state a layer id names) are kept for every prompt
and response token the target ran, in fp16: training then reads them instead of
running the target again. The last response token is never fed back, so its row is
absent (no drafter context ever needs it).

With `top_k`, the target's top-k next-token ids and probabilities (at T=1) are kept for
every response position: the distribution each response token was chosen from, which
training distills (`distill_topk`) with no second target pass.
"""

from __future__ import annotations

import torch

from blockspec.targets.adapter import compact_features, target_features
from blockspec.targets.cache import new_cache


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...] | list[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    feature_layers: list[int] | None = None,
    top_k: int = 0,
):
    """Decode every prompt; each response ends with its first EOS (kept) or at `max_new_tokens`.
    Returns the responses; with `feature_layers` or `top_k`, (responses, features, top):
    features (or None) one [len(prompt) + len(response) - 1, len(layers) * hidden] fp16 tensor
    per row (bf16 where a value would overflow fp16); top (or None) per row (ids int32 [len(response), k],
    probabilities fp16 [len(response), k]), row r the distribution of response token r."""
    if not prompts:
        return []
    if any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    pad = int(eos[0]) if eos.numel() else 0
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_cache(model.config)
    capture = feature_layers is not None
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1, output_hidden_states=capture)
    logits = out.logits[:, -1]
    responses: list[list[int]] = [[] for _ in prompts]
    features: list[list[torch.Tensor]] = [[] for _ in prompts]
    tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    if capture:
        stacked = _features(out, feature_layers)
        for row, prompt in enumerate(prompts):
            features[row].append(stacked[row, width - len(prompt):].clone())
    alive = torch.arange(len(prompts), device=device)  # original index of each row still decoding
    next_position = positions[:, -1] + 1
    for step in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            tokens = logits.argmax(dim=-1)
        for row, token in zip(alive.tolist(), tokens.tolist()):
            responses[row].append(token)
        if top_k:
            top = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            ids, probs = top.indices.to("cpu", torch.int32), top.values.to("cpu", torch.float16)
            for position, row in enumerate(alive.tolist()):
                tops[row].append((ids[position], probs[position]))
        finished = torch.isin(tokens, eos) if eos.numel() else torch.zeros_like(tokens, dtype=torch.bool)
        if step == max_new_tokens - 1 or bool(finished.all()):
            break
        if bool(finished.any()):
            keep = (~finished).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            alive, tokens, mask, next_position = alive[keep], tokens[keep], mask[keep], next_position[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                    cache=cache, use_cache=True, output_hidden_states=capture)
        logits = out.logits[:, -1]
        if capture:
            stacked = _features(out, feature_layers)
            for position, row in enumerate(alive.tolist()):
                features[row].append(stacked[position])
        next_position = next_position + 1
    if not capture and not top_k:
        return responses
    top = [(torch.stack([i for i, _ in row]), torch.stack([p for _, p in row])) for row in tops] if top_k else None
    return responses, [_joined(parts) for parts in features] if capture else None, top


def _features(out, layer_ids: list[int]) -> torch.Tensor:
    # to host memory at once: a shard's features must not pile up on an accelerator
    return compact_features(target_features(out.hidden_states, layer_ids).to("cpu"))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    # one step past fp16's range makes the whole row bf16 (never inf in a stored feature)
    dtype = torch.bfloat16 if any(p.dtype == torch.bfloat16 for p in parts) else parts[0].dtype
    return torch.cat([p.to(dtype) for p in parts])
