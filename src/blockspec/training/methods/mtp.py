"""`blockspec train --method mtp`: the MTP head trained by self-distillation on the
target's regenerated data (data, schedule, checkpoints, resume, held-out tau and DDP are
the trainer's).

For a random position t of a response: h_0 is the target's final hidden state at t
(the target itself predicts x[t+1] from it); the head is unrolled K = block_size - 1
times on the TRUE next tokens, step k predicting x[t+k+1] with loss weight
exp(-(k-1)/gamma), as the DFlash recipe weights block positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.drafters.mtp import MTPConfig, MTPDrafter, MTPHeadModel
from blockspec.training.config import TrainConfig
from blockspec.training.trainer import IGNORE, Trainer


class MTPMethod:
    name = "mtp"
    borrows_target_head = True
    can_train_head = False
    ddp_wrapper = False  # the head runs K times per step: the trainer averages its gradients
    shardable = False  # one small head: nothing to gain from sharding it
    records_target = True

    def build_model(self, config: TrainConfig, target) -> MTPHeadModel:
        head_config = MTPConfig.for_target(target, block_size=config.block_size,
                                           intermediate_size=config.intermediate_size)
        head_config.draft_vocab_size = config.draft_vocab_size
        return MTPHeadModel(head_config)

    def make_drafter(self, model: MTPHeadModel, target) -> MTPDrafter:
        return MTPDrafter(model, target)

    def loss(self, trainer: Trainer, indices: list[int], epoch: int) -> tuple[torch.Tensor, dict]:
        config, model = trainer.config, trainer.model
        steps = config.block_size - 1
        features = trainer.features(indices)
        hiddens, tokens = [], []
        for index, feats in zip(indices, features):
            sequence = trainer.sequence(index)[0]
            for t in trainer.anchors(index, epoch).tolist():
                hiddens.append(feats[t])
                following = sequence[t + 1:t + steps + 2]  # x[t+1] (the target's own) .. x[t+K+1]
                tokens.append(F.pad(following, (0, steps + 1 - following.numel()), value=IGNORE))
        device, dtype = trainer.target.device, next(model.parameters()).dtype
        weight_sum = torch.zeros((), device=device)
        # every parameter takes part in the graph even when this rank has nothing to learn
        # from, so that the ranks reduce the same gradients
        total = sum(p.sum() for p in model.parameters()) * 0.0
        correct = counted = 0
        hidden = torch.stack(hiddens).to(device, dtype) if hiddens else None
        tokens = torch.stack(tokens).to(device) if tokens else None
        for k in range(1, steps + 1 if hiddens else 1):
            inputs, labels = tokens[:, k - 1], tokens[:, k]
            alive = inputs != IGNORE
            if not bool(alive.any()):
                break
            with torch.no_grad():
                embeds = trainer.target.embed(inputs.clamp_min(0))
            hidden = model.step(hidden, embeds)
            mapped = torch.where(alive, trainer.draft_labels(labels), IGNORE)
            loss, weight, right, count = trainer.head_loss(hidden, mapped, float(trainer.weights[k]))
            total, weight_sum, correct, counted = total + loss, weight_sum + weight, correct + right, counted + count
        weight_sum = trainer.global_sum(weight_sum)  # every rank calls this, whatever its batch held
        loss = total / weight_sum.clamp_min(1e-8)
        return loss, {"loss": float(loss.detach()), "acc": correct / counted if counted else 0.0}
