"""`blockspec train --method eagle3`: the EAGLE-3-style layer trained with the training-
time test on the target's regenerated data (data, schedule, checkpoints, resume, held-out
tau and DDP are the trainer's).

Per sequence, step 1 runs every position j at once (causal, on the target's fused
features, paired with the next token x[j+1]); then, for `num_anchors` random response
anchors a (chain j = a - 1, as at inference where the anchor has no features yet), the
layer is unrolled K = block_size - 1 times on its OWN hidden state with the TRUE next
token, step s at position j + s - 1 attending the step-1 keys up to j and the chain's
own earlier steps: exactly what drafting sees. Step s predicts x[a + s], weighted
exp(-(s-1)/gamma) like DFlash block position s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.drafters.eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Drafter
from blockspec.training.config import TrainConfig
from blockspec.training.trainer import IGNORE, Trainer


@torch.no_grad()
def init_eagle3_from_target(model: Eagle3DraftModel, target) -> bool:
    """Start the layer as the target's LAST decoder layer reading the highest feature layer
    (the embedding half of q/k/v at zero), and the final norm as the target's: on a CPU
    budget a start that already predicts like the target beats a random one."""
    layers = getattr(getattr(target.model, "model", None), "layers", None)
    if target.config.model_type not in ("llama", "mistral", "qwen2", "qwen3") or not layers:
        return False
    hidden = model.config.hidden_size
    source = layers[-1]
    attention = model.midlayer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        mine, theirs = getattr(attention, name).weight, getattr(source.self_attn, name).weight
        if mine[:, hidden:].shape == theirs.shape:
            mine.zero_()
            mine[:, hidden:] = theirs
    if attention.o_proj.weight.shape == source.self_attn.o_proj.weight.shape:
        attention.o_proj.weight.copy_(source.self_attn.o_proj.weight)
    own_mlp = model.midlayer.mlp.state_dict()
    own_mlp.update({k: v for k, v in source.mlp.state_dict().items() if k in own_mlp and own_mlp[k].shape == v.shape})
    model.midlayer.mlp.load_state_dict(own_mlp)
    model.midlayer.hidden_norm.weight.copy_(source.input_layernorm.weight)
    model.midlayer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
    final_norm = getattr(target.model.model, "norm", None)
    if final_norm is not None and final_norm.weight.shape == model.norm.weight.shape:
        model.norm.weight.copy_(final_norm.weight)
    highest = max(range(len(model.config.target_layer_ids)), key=lambda i: model.config.target_layer_ids[i])
    model.fc.weight.zero_()
    model.fc.weight[:, highest * hidden:(highest + 1) * hidden] = torch.eye(hidden)
    return True


class Eagle3Method:
    name = "eagle3"
    borrows_target_head = True
    can_train_head = False
    ddp_wrapper = False  # the layer runs K times per step: the trainer averages its gradients
    shardable = False  # one layer: nothing to gain from sharding it
    records_target = True

    def build_model(self, config: TrainConfig, target) -> Eagle3DraftModel:
        drafter_config = Eagle3Config.for_target(target, block_size=config.block_size,
                                                 target_layer_ids=config.target_layer_ids,
                                                 intermediate_size=config.intermediate_size)
        drafter_config.draft_vocab_size = config.draft_vocab_size
        model = Eagle3DraftModel(drafter_config)
        if config.init_from_target:
            init_eagle3_from_target(model, target)
        return model

    def make_drafter(self, model: Eagle3DraftModel, target) -> Eagle3Drafter:
        return Eagle3Drafter(model, target)

    def loss(self, trainer: Trainer, indices: list[int], epoch: int) -> tuple[torch.Tensor, dict]:
        config, model = trainer.config, trainer.model
        device, dtype = trainer.target.device, next(model.parameters()).dtype
        sequences = [trainer.sequence(i)[0] for i in indices]
        features = trainer.features(indices)
        width = max(s.numel() for s in sequences)
        ids = torch.stack([F.pad(s, (0, width - s.numel())) for s in sequences]).to(device)
        lengths = torch.tensor([s.numel() for s in sequences], device=device)
        fused = model.fc(torch.stack([F.pad(f.to(dtype), (0, 0, 0, width - f.shape[0])) for f in features]).to(device))
        # step 1, every position j at once: (x[j+1], g_j) at position j, causal
        with torch.no_grad():
            next_embeds = trainer.target.embed(ids[:, 1:])
        positions = torch.arange(width - 1, device=device).expand(len(indices), -1)
        causal = torch.ones(width - 1, width - 1, dtype=torch.bool, device=device).tril()[None, None]
        h_all, k_all, v_all = model(next_embeds, fused[:, :-1], positions, mask=causal)
        # the chains: j = anchor - 1 for random response anchors
        rows, js = [], []
        for row, index in enumerate(indices):
            anchors = trainer.anchors(index, epoch)
            rows += [row] * anchors.numel()
            js += (anchors - 1).tolist()
        # every parameter takes part in the graph even when this rank has no chain, so that
        # the ranks reduce the same gradients
        total = sum(p.sum() for p in model.parameters()) * 0.0
        weight_sum = torch.zeros((), device=device)
        correct = counted = 0
        if js:
            rows_t, js_t = torch.tensor(rows, device=device), torch.tensor(js, device=device)
            h = h_all[rows_t, js_t][:, None]  # [C, 1, H]
            context_k, context_v = k_all[rows_t], v_all[rows_t]  # [C, kv, T-1, d]: step 1's keys
            context_mask = torch.arange(width - 1, device=device)[None] <= js_t[:, None]  # up to j
            chain_k, chain_v = [], []
            for step in range(1, config.block_size):
                label_at = js_t + step + 1  # x[a + step]
                labels = torch.where(label_at < lengths[rows_t], ids[rows_t, label_at.clamp(max=width - 1)], IGNORE)
                loss, weight, right, count = trainer.head_loss(h[:, 0], trainer.draft_labels(labels),
                                                               float(trainer.weights[step]))
                total, weight_sum, correct, counted = total + loss, weight_sum + weight, correct + right, counted + count
                if step == config.block_size - 1 or not bool((label_at < lengths[rows_t]).any()):
                    break
                # the next step: the true token it just predicted, its own hidden state, one position on
                with torch.no_grad():
                    embeds = trainer.target.embed(labels.clamp_min(0))[:, None]
                mask = torch.cat([context_mask, torch.ones(len(js), step, dtype=torch.bool, device=device)], dim=1)
                h, k, v = model(embeds, h, (js_t + step)[:, None], torch.cat([context_k, *chain_k], dim=2),
                                torch.cat([context_v, *chain_v], dim=2), mask[:, None, None])
                chain_k.append(k)
                chain_v.append(v)
        weight_sum = trainer.global_sum(weight_sum)  # every rank calls this, whatever its batch held
        loss = total / weight_sum.clamp_min(1e-8)
        return loss, {"loss": float(loss.detach()), "acc": correct / counted if counted else 0.0}
