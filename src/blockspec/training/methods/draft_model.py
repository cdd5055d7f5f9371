"""`blockspec train --method draft-model`: a small independent draft LM for a target
that has no smaller sibling (like the default), trained on the target's regenerated
data (schedule, checkpoints, resume, held-out tau, DDP and FSDP are the trainer's).

The draft is a Llama-style causal LM with the target's vocabulary and hidden size and
`num_layers` layers. It starts as the target's embedding, its FIRST `num_layers` decoder
layers and its final norm and head (an "early exit" of the target: a much better start
than random weights on a CPU budget), then learns next-token prediction on the
responses. It is saved as an ordinary transformers folder with the target's tokenizer,
so `--drafter model:FOLDER` (and any other tool) loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from blockspec.drafters.draft_model import DraftModelDrafter
from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import TargetAdapter
from blockspec.training.config import TrainConfig
from blockspec.training.trainer import IGNORE, Trainer

MARKER = "blockspec_draft_model"


class DraftLM(nn.Module):
    """A transformers causal LM plus the checkpoint methods the trainer calls."""

    def __init__(self, lm, tokenizer=None):
        super().__init__()
        self.lm = lm
        self.tokenizer = tokenizer
        self.config = lm.config

    def forward(self, input_ids, attention_mask=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits

    def write_files(self, folder: Path, dtype: torch.dtype | None = None) -> None:
        lm = self.lm if dtype is None else self.lm.to(dtype)
        lm.save_pretrained(folder, safe_serialization=True)
        if dtype is not None:
            self.lm.to(torch.float32)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        config[MARKER] = True
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, folder) -> "DraftLM":
        lm = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
        return cls(lm.eval())


def draft_lm_for(target, num_layers: int) -> DraftLM:
    """The target's first `num_layers` layers as a Llama-style LM (same shapes where they fit)."""
    tc = target.config
    if num_layers >= target.num_layers:
        raise InvalidArgumentError(f"a draft model needs fewer layers than the target's {target.num_layers}")
    heads = tc.num_attention_heads
    config = transformers.LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or target.hidden_size // heads,
        max_position_embeddings=target.max_context, rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters={"rope_type": "default", "rope_theta": target.rope_theta},
        tie_word_embeddings=False, bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=list(target.eos_token_ids) or None)
    lm = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        lm.model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        lm.lm_head.weight.copy_(target.lm_head.weight)
        source = getattr(getattr(target.model, "model", None), "layers", None)
        if target.config.model_type in ("llama", "mistral", "qwen2") and source is not None:
            for mine, theirs in zip(lm.model.layers, source):
                state = mine.state_dict()
                state.update({k: v for k, v in theirs.state_dict().items() if k in state and state[k].shape == v.shape})
                mine.load_state_dict(state)
            norm = getattr(target.model.model, "norm", None)
            if norm is not None and norm.weight.shape == lm.model.norm.weight.shape:
                lm.model.norm.weight.copy_(norm.weight)
    return DraftLM(lm, target.tokenizer)


class DraftModelMethod:
    name = "draft-model"
    borrows_target_head = False  # a whole LM with its own head (the target's vocabulary)
    can_train_head = False
    ddp_wrapper = True
    shardable = True
    records_target = False  # a plain transformers config: its shapes are what ties it to the target

    def build_model(self, config: TrainConfig, target) -> DraftLM:
        return draft_lm_for(target, config.num_layers)

    def make_drafter(self, model: DraftLM, target) -> DraftModelDrafter:
        return DraftModelDrafter(TargetAdapter(model.lm, model.tokenizer, "draft-model"), target)

    def shard(self, model: DraftLM) -> None:
        """FSDP2 in place: each decoder layer one unit, embedding, norm and head the root's."""
        from torch.distributed.fsdp import fully_shard

        for layer in model.lm.model.layers:
            fully_shard(layer)
        fully_shard(model)

    def loss(self, trainer: Trainer, indices: list[int], epoch: int) -> tuple[torch.Tensor, dict]:
        sequences, prompt_lens = zip(*(trainer.sequence(i) for i in indices))
        width = max(s.numel() for s in sequences)
        ids = torch.stack([F.pad(s, (0, width - s.numel())) for s in sequences])
        attention = torch.stack([F.pad(torch.ones_like(s), (0, width - s.numel())) for s in sequences])
        labels = torch.full_like(ids, IGNORE)
        for row, (sequence, prompt_len) in enumerate(zip(sequences, prompt_lens)):
            labels[row, prompt_len:sequence.numel()] = sequence[prompt_len:]  # learn the responses only
        device = trainer.target.device
        logits = trainer.ddp_model(ids.to(device), attention.to(device))[:, :-1].float()
        targets = labels[:, 1:].to(device)
        valid = targets != IGNORE
        per_token = F.cross_entropy(logits[valid], targets[valid], reduction="sum")
        count = trainer.global_sum(valid.sum().to(torch.float32))
        loss = per_token / count.clamp_min(1.0)
        with torch.no_grad():
            acc = float((logits[valid].argmax(-1) == targets[valid]).float().mean()) if bool(valid.any()) else 0.0
        return loss, {"loss": float(loss.detach()), "acc": acc}
