"""`blockspec train --method dflash`: the DFlash recipe (reference section 3).

Per step, per sequence: sample up to `num_anchors` anchors among the response
tokens (seeded per sample, so runs reproduce whatever the process count). Each
anchor a gives a block [x_a, MASK x (B-1)] at positions a..a+B-1 whose labels are
x[a+k], k = 1..B-1, weighted exp(-(k-1)/gamma). All blocks of a sequence train in
ONE pass: a block sees the target features of positions strictly before its
anchor, itself bidirectionally, and no other block. Only the drafter trains; the
target's embedding and LM head are borrowed frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from blockspec.training.config import TrainConfig
from blockspec.training.trainer import IGNORE, Trainer


def choose_mask_token(target) -> int:
    """An id inside the target's vocabulary that text never uses: the tokenizer's mask
    token, else its last special token that is not BOS/EOS/PAD/UNK or in the chat template."""
    tokenizer = target.tokenizer
    if tokenizer is None:
        return target.vocab_size - 1
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    busy = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    busy |= set(target.eos_token_ids)
    template = getattr(tokenizer, "chat_template", None) or ""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = [i for i, tok in decoder.items()
                  if i not in busy and str(tok) not in template and i < target.vocab_size]
    return max(candidates) if candidates else target.vocab_size - 1


def build_blocks(sequences: list[torch.Tensor], anchors: list[torch.Tensor], block_size: int, mask_token_id: int,
                 context_len: int):
    """Block inputs, positions, labels and the block-sparse attention mask for a batch.

    Returns block_ids, positions, labels [b, A*B] and a bool mask [b, 1, A*B, context_len + A*B]
    (True = may attend). Missing anchors are padding: no labels, and they see only themselves.
    """
    batch = len(sequences)
    num_blocks = max(1, max(a.numel() for a in anchors))
    width = num_blocks * block_size
    block_ids = torch.full((batch, width), mask_token_id, dtype=torch.long)
    positions = torch.zeros(batch, width, dtype=torch.long)
    labels = torch.full((batch, width), IGNORE, dtype=torch.long)
    mask = torch.zeros(batch, 1, width, context_len + width, dtype=torch.bool)
    offsets = torch.arange(block_size)
    block_of = torch.arange(width) // block_size
    same_block = block_of[:, None] == block_of[None, :]
    mask[:, 0, :, context_len:] = same_block
    for row, (sequence, row_anchors) in enumerate(zip(sequences, anchors)):
        for index, anchor in enumerate(row_anchors.tolist()):
            span = slice(index * block_size, (index + 1) * block_size)
            block_ids[row, index * block_size] = sequence[anchor]
            positions[row, span] = anchor + offsets
            targets = anchor + offsets[1:]
            valid = targets < sequence.numel()
            labels[row, index * block_size + 1:(index + 1) * block_size] = torch.where(
                valid, sequence[targets.clamp(max=sequence.numel() - 1)], IGNORE)
            mask[row, 0, span, :anchor] = True  # context strictly before the anchor
    return block_ids, positions, labels, mask


def partially_unmask(block_ids: torch.Tensor, labels: torch.Tensor, block_size: int,
                     generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """For diffusion-mode training: in each block draw a mask ratio r ~ U(0, 1] and reveal
    each draft position with probability 1 - r (always leaving one masked). Revealed
    positions get their true token as input and no label. Rows of padding are untouched."""
    block_ids, labels = block_ids.clone(), labels.clone()
    batch, width = labels.shape
    num_blocks = width // block_size
    for row, generator in zip(range(batch), generators):
        ratio = 1.0 - torch.rand(num_blocks, 1, generator=generator)  # (0, 1]
        draws = torch.rand(num_blocks, block_size - 1, generator=generator)
        keep_masked = draws < ratio
        keep_masked[torch.arange(num_blocks), draws.argmin(dim=1)] = True
        reveal = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        reveal[:, 1:] = ~keep_masked
        reveal = reveal.view(-1) & (labels[row] != IGNORE)
        block_ids[row, reveal] = labels[row, reveal]
        labels[row, reveal] = IGNORE
    return block_ids, labels


@torch.no_grad()
def init_from_target_layers(model: DFlashDraftModel, target) -> bool:
    """Copy the target's top decoder layers (and final norm) into the draft layers.

    Draft layer i starts as target layer L - n + i. `fc` starts by selecting the
    features of the highest target layer id and `hidden_norm` as the next layer's
    input norm, so that when that id is L - n - 1 the first draft layer sees exactly
    the context K/V the target's own layer would. Weights whose shapes differ (or
    that the target lacks, like q_norm / k_norm in Llama) keep their fresh init.
    Returns False when the target's layers are not of the expected Llama-like shape.
    """
    layers = getattr(getattr(target.model, "model", None), "layers", None)
    # Only where the layer layout matches ours (pre-norm, RMSNorm weights used as is).
    if target.config.model_type not in ("llama", "mistral", "qwen2", "qwen3") or layers is None \
            or len(layers) < len(model.layers):
        return False
    first = len(layers) - len(model.layers)
    for index, draft_layer in enumerate(model.layers):
        source = layers[first + index].state_dict()
        own = draft_layer.state_dict()
        own.update({name: tensor for name, tensor in source.items() if name in own and own[name].shape == tensor.shape})
        draft_layer.load_state_dict(own)
    final_norm = getattr(target.model.model, "norm", None)
    if final_norm is not None and final_norm.weight.shape == model.norm.weight.shape:
        model.norm.weight.copy_(final_norm.weight)
    hidden = model.config.hidden_size
    last = max(range(len(model.config.target_layer_ids)), key=lambda i: model.config.target_layer_ids[i])
    model.fc.weight.zero_()
    model.fc.weight[:, last * hidden:(last + 1) * hidden] = torch.eye(hidden)
    next_norm = layers[min(model.config.target_layer_ids[last] + 1, len(layers) - 1)].input_layernorm.weight
    if next_norm.shape == model.hidden_norm.weight.shape:
        model.hidden_norm.weight.copy_(next_norm)
    return True


class DFlashMethod:
    name = "dflash"
    borrows_target_head = True
    can_train_head = True
    ddp_wrapper = True
    shardable = True
    records_target = True

    def build_model(self, config: TrainConfig, target) -> DFlashDraftModel:
        mask_token_id = config.mask_token_id if config.mask_token_id is not None else choose_mask_token(target)
        drafter_config = DFlashConfig.for_target(
            target, num_layers=config.num_layers, block_size=config.block_size, mask_token_id=mask_token_id,
            target_layer_ids=config.target_layer_ids, intermediate_size=config.intermediate_size)
        drafter_config.draft_vocab_size = config.draft_vocab_size
        drafter_config.trained_head = config.train_head
        model = DFlashDraftModel(drafter_config)
        if config.init_from_target:
            init_from_target_layers(model, target)
        return model

    def make_drafter(self, model: DFlashDraftModel, target) -> DFlashDrafter:
        return DFlashDrafter(model, target)

    def shard(self, model: DFlashDraftModel) -> None:
        """FSDP2 in place: each draft layer is one unit, the rest (fc, norms) the root's."""
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for layer in model.layers:
            fully_shard(layer)
            # the context K/V are computed outside forward: gather the layer's weights for it too
            register_fsdp_forward_method(layer, "context_key_value")
        fully_shard(model)
        register_fsdp_forward_method(model, "context_key_values")

    def loss(self, trainer: Trainer, indices: list[int], epoch: int) -> tuple[torch.Tensor, dict]:
        config, model = trainer.config, trainer.model
        sequences = [trainer.sequence(i)[0] for i in indices]
        anchors = [trainer.anchors(i, epoch) for i in indices]
        features = trainer.features(indices)
        context_len = max(s.numel() for s in sequences)
        dtype = next(model.parameters()).dtype
        context = torch.stack([F.pad(f.to(dtype), (0, 0, 0, context_len - f.shape[0])) for f in features])
        block_ids, positions, labels, mask = build_blocks(sequences, anchors, config.block_size,
                                                          model.config.mask_token_id, context_len)
        if config.random_mask:
            generators = [torch.Generator().manual_seed(config.seed * 1_000_033 + epoch * 100_019 + index)
                          for index in indices]
            block_ids, labels = partially_unmask(block_ids, labels, config.block_size, generators)
        device = trainer.target.device
        # the model DDP wraps: the context projection runs outside DDP's forward, its
        # gradients are still reduced by DDP's per-parameter hooks
        positions_all = torch.arange(context_len, device=device).expand(len(indices), -1)
        kv = model.context_key_values(context.to(device), positions_all)
        with torch.no_grad():
            embeds = trainer.target.embed(block_ids.to(device)).to(dtype)  # the target may run in another dtype
        hidden = trainer.ddp_model(embeds, positions.to(device), kv, mask.to(device))
        weights = trainer.position_weights().repeat(block_ids.shape[1] // config.block_size).expand_as(labels)
        labels = trainer.draft_labels(labels)
        valid = labels >= 0  # has a label, inside the draft vocabulary
        logits = trainer.head_logits(hidden[valid])  # only rows with a label
        targets = labels[valid].to(device)
        if config.distill_topk:  # cross-entropy against the target's (top-k) distribution
            soft_ids, soft_probs = trainer.soft_labels(indices, positions, labels)
            log_probs = F.log_softmax(logits, dim=-1)
            picked = log_probs.gather(1, soft_ids[valid].clamp_min(0).to(device))
            per_token = -(soft_probs[valid].to(device) * picked).sum(-1)
        else:
            per_token = F.cross_entropy(logits, targets, reduction="none")
        w = weights[valid].to(device)
        weight_sum = trainer.global_sum(w.sum())
        loss = (per_token * w).sum() / weight_sum.clamp_min(1e-8)
        with torch.no_grad():
            correct = (logits.argmax(-1) == targets).float()
            block_position = (torch.arange(labels.shape[1]) % config.block_size).expand_as(labels)[valid.cpu()]
            trainer.observe_accuracy(block_position, correct.cpu())
        return loss, {"loss": float(loss.detach()), "acc": float(correct.mean()) if correct.numel() else 0.0}
