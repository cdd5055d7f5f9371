"""`blockspec train --method mtp`: the MTP head trained by self-distillation on the
target's regenerated data, with everything else (data, schedule, checkpoints, resume,
held-out tau, DDP) from the DFlash trainer.

For a random position t of a response: h_0 is the target's final hidden state at t
(the target itself predicts x[t+1] from it); the head is unrolled K = block_size - 1
times on the TRUE next tokens, step k predicting x[t+k+1] with loss weight
exp(-(k-1)/gamma), as the DFlash recipe weights block positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.drafters.mtp import MTPConfig, MTPDrafter, MTPHeadModel
from blockspec.errors import InvalidArgumentError
from blockspec.training.trainer import IGNORE, DFlashTrainer, sample_anchors


class MTPTrainer(DFlashTrainer):
    uses_ddp_wrapper = False  # the head runs K times per step: gradients are averaged by hand

    def build_model(self):
        config = MTPConfig.for_target(self.target, block_size=self.config.block_size,
                                      intermediate_size=self.config.intermediate_size)
        config.draft_vocab_size = self.config.draft_vocab_size
        return MTPHeadModel(config)

    def make_drafter(self, model=None):
        return MTPDrafter(model or self.model, self.target)

    def shard(self, model) -> None:
        # one small head called K times per step through several methods: nothing to gain
        raise InvalidArgumentError("--parallel fsdp trains dflash and draft-model drafters; "
                                   "the MTP head (one layer) trains with --parallel ddp")

    def compute_loss(self, indices: list[int], epoch: int) -> tuple[torch.Tensor, dict]:
        config = self.config
        steps = config.block_size - 1
        features = self._target_features(list(indices))
        hiddens, tokens = [], []
        for index, feats in zip(indices, features):
            sequence, prompt_len = self._sequence(self.train_records[index])
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch * 100_003 + index)
            for t in sample_anchors(prompt_len, sequence.numel(), config.num_anchors, generator).tolist():
                hiddens.append(feats[t])
                following = sequence[t + 1:t + steps + 2]  # x[t+1] (the target's own) .. x[t+K+1]
                tokens.append(F.pad(following, (0, steps + 1 - following.numel()), value=IGNORE))
        device, dtype = self.target.device, next(self.model.parameters()).dtype
        weight_sum = torch.zeros((), device=device)
        # every parameter takes part in the graph even when this rank has nothing to learn
        # from, so that the ranks reduce the same gradients
        total = sum(p.sum() for p in self.model.parameters()) * 0.0
        correct = counted = 0
        hidden = torch.stack(hiddens).to(device, dtype) if hiddens else None
        tokens = torch.stack(tokens).to(device) if tokens else None
        for k in range(1, steps + 1 if hiddens else 1):
            inputs, labels = tokens[:, k - 1], tokens[:, k]
            alive = inputs != IGNORE
            if not bool(alive.any()):
                break
            with torch.no_grad():
                embeds = self.target.embed(inputs.clamp_min(0))
            hidden = self.model.step(hidden, embeds)
            mapped = torch.where(alive, self.draft_labels(labels), IGNORE)
            loss, weight, right, count = self.head_loss(hidden, mapped, float(self.weights[k]))
            total, weight_sum, correct, counted = total + loss, weight_sum + weight, correct + right, counted + count
        weight_sum = self.global_sum(weight_sum)  # every rank calls this, whatever its batch held
        loss = total / weight_sum.clamp_min(1e-8)
        return loss, {"loss": float(loss.detach()), "acc": correct / counted if counted else 0.0}
