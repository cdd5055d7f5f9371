"""One typed config per command: a JSON file plus `--key value` overrides; unknown keys are errors."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from blockspec.errors import InvalidArgumentError


@dataclass
class TrainConfig:
    # what to train, for which target, on what
    method: str = "dflash"  # dflash | eagle3 | mtp | draft-model
    target: str = "default"
    data: str = ""  # folder(s) written by `blockspec data`, joined by commas
    output: str = "runs/dflash"
    # drafter shape
    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # None: the reference rule for num_layers
    mask_token_id: int | None = None  # None: an unused special token of the target
    intermediate_size: int | None = None  # None: the target's
    draft_vocab_size: int | None = None  # None: the full vocabulary; N: the N most frequent response tokens
    # Start the draft layers as copies of the target's top layers (same shapes), with fc
    # selecting the last feature layer: sample efficiency matters more than anything on a CPU.
    init_from_target: bool = True
    # Warm start: the weights of a drafter trained before (same shape, or fewer layers: the
    # added ones start as the identity), e.g. on an earlier, smaller dataset. Its draft
    # vocabulary is recomputed on this data (the head is frozen), unless keep_init_vocabulary.
    init_from: str | None = None
    # With init_from: keep the warm start's draft vocabulary as it is instead of rebuilding it from
    # this run's data. A round's ~0.5M tokens cover less of what the target writes than the
    # vocabulary built from every earlier round (session 26: 93.3% against 96.2% of held-out
    # math+code tokens; the shipped vocabulary gave the same weights +0.009 / +0.010 tau).
    keep_init_vocabulary: bool = False
    # Train the head's draft-vocabulary rows with the drafter (its own `lm_head`, started from the
    # target's rows, or the warm start's trained rows where it has them) instead of borrowing the
    # target's frozen head: more capacity at the same drafting cost. Needs draft_vocab_size.
    train_head: bool = False
    # A trained head's lr as a share of `lr`. Its rows start as the target's, tuned weights that
    # Adam's per-weight steps at the layers' lr scatter (session 31: at lr 3e-4 the rows moved ~10%
    # in 800 steps and the training loss stayed ~0.06 above the borrowed head's).
    head_lr_scale: float = 0.1
    # the recipe (reference section 3)
    num_anchors: int = 16  # blocks per sequence per step, resampled every step
    gamma: float | None = None  # loss decay; None: 7 for B=16, 5 for B=10, 4 for B=8
    # how much each draft position's loss counts: "decay" = exp(-(k-1)/gamma) (the reference);
    # "expected-length" (D-PACE-style) = the chance that drafting reaches position k, i.e. the
    # product of the drafter's own running top-1 accuracy at positions 1..k-1
    loss_weighting: str = "decay"
    # Reveal a random share of each block's tokens (ratio ~ U(0, 1]) so that the drafter
    # learns to fill partially masked blocks: needed for iterative unmasking in diffusion mode.
    random_mask: bool = False
    # 0: learn the target's tokens (hard labels). K: learn the target's whole next-token
    # distribution over its top K (soft labels, renormalised over the ids the draft
    # vocabulary holds): read where `blockspec data --store-topk K'` (K' >= K) stored it, else
    # from one target pass per training sequence, cached across epochs.
    distill_topk: int = 0
    # Distilling, the records whose distributions were not stored (data written before
    # --store-topk): "compute" runs the target over each (one pass per record, cached); "hard"
    # keeps their hard labels, which on the target's own greedy text are its top-1 (the k = 1
    # distillation), so older rounds' data mixes in without a target pass.
    distill_missing: str = "compute"
    max_length: int = 1024
    batch_size: int = 4
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    epochs: int = 6
    max_steps: int | None = None  # stop early (the schedule still spans `epochs`)
    # Stop after this many seconds of training steps (evaluation and saving excluded), and
    # let the lr schedule (warmup, cosine) span this time instead of the epochs: A/B runs at
    # equal compute, and a campaign that fits the time a session has. `epochs` stays a bound.
    time_budget_s: float | None = None
    # "wall": seconds on the clock; "cpu": CPU seconds of this process (all its threads), which a
    # busy shared machine does not inflate: A/B arms that ran beside different loads stay comparable
    time_budget_clock: str = "wall"
    grad_clip: float = 1.0
    # 0: the drafter is the weights of the last step. D in (0, 1): an exponential moving average
    # of the weights after every step (w_avg <- D w_avg + (1 - D) w), which is what checkpoints
    # hold, evaluation measures and `final` ships; the live weights are kept in the trainer state
    # to resume. Session 32: D = 0.998 over 2,072 steps measured level with the same run without
    # it; averaging separate runs from one parent paid (scripts/average_drafters.py, stage 15).
    ema_decay: float = 0.0
    seed: int = 0
    # bookkeeping
    holdout: int = 8  # records kept out of training, for evaluation
    eval_every: int = 100
    eval_prompts: int = 4
    eval_max_new_tokens: int = 64
    save_every: int = 50
    threads: int | None = None
    # under torchrun / accelerate with several processes: "ddp" (replicated drafter,
    # gradients all-reduced) or "fsdp" (FSDP2: parameters, gradients and optimizer state
    # sharded across processes, each draft layer its own unit); one process ignores it
    parallel: str = "ddp"
    # "cpu", "cuda" (under torchrun each rank takes cuda:LOCAL_RANK) or an explicit device
    device: str | None = None
    # what a training step computes in (the weights stay fp32 master weights, the loss fp32):
    # "bf16" = bf16 autocast, "fp32", or "auto" = bf16 on a GPU, on a CPU with bf16 matrix
    # units (AMX: a training-sized matmul 3-14x faster than fp32), and on an AVX512-BF16 CPU where
    # a probe measures bf16 products clearly faster (session 30's AMD EPYC: a step 1.56x faster;
    # session 14's Xeon VM: 1.8x slower); fp32 elsewhere (`targets.loading.cpu_trains_faster_in_bf16`)
    precision: str = "auto"

    def resolved_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2.3))


def _convert(text: str, annotation):
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and args:
        if text.lower() in ("none", "null"):
            return None
        return _convert(text, args[0])
    if origin is list:
        return [int(x) for x in text.replace(",", " ").split()]
    if annotation is bool:
        return text.lower() in ("1", "true", "yes")
    return annotation(text)


def load_config(cls, path: str | None, overrides: list[str]):
    """Build `cls` from an optional JSON file, then `--key value` overrides."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values: dict = {}
    if path:
        try:
            values.update(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise InvalidArgumentError(f"cannot read config {path}: {error}") from None
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise InvalidArgumentError(f"unknown config keys in {path}: {', '.join(unknown)}")
    items = list(overrides)
    while items:
        key = items.pop(0)
        if not key.startswith("--") or not items:
            raise InvalidArgumentError(f"overrides must be --key value pairs, got {key!r}")
        name = key[2:].replace("-", "_")
        if name not in fields:
            raise InvalidArgumentError(f"unknown option {key}: valid keys are {', '.join(fields)}")
        raw = items.pop(0)
        try:
            values[name] = _convert(raw, hints[name])
        except ValueError:
            raise InvalidArgumentError(f"bad value for {key}: {raw!r}") from None
    return cls(**values)
