"""The training loop every drafting method shares, on one CPU, one GPU or under torchrun
(DDP or FSDP).

`Trainer(config, target, method)` owns what does not depend on the method: the records
(split into training and held-out ones), the global batch of each step (a pure function
of seed and step, so a run resumes bit-identically), the target's features and
distributions of each record (read where `blockspec data` stored them, else computed
once), AdamW with warmup and cosine over the epochs or a time budget, held-out tau
through the engine, checkpoints swapped in atomically, DDP / FSDP and the metrics log.

A method is ONE strategy object in `training/methods/` (the `Method` protocol below): it
builds the model, computes the loss of a batch, and says as data what it supports. Only
the drafter trains: the target is frozen.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import json
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tqdm import tqdm

from blockspec.atomic import replace_dir, write_text
from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.stats import GenerationStats
from blockspec.decoding.draft import Drafter
from blockspec.drafters.checkpoint import fit_problems
from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import compact_features, target_features
from blockspec.targets.loading import cpu_trains_faster_in_bf16
from blockspec.training.config import TrainConfig
from blockspec.training.data import check_data_target, load_records, right_padded

IGNORE = -100
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
TRIM_EVERY = 25  # steps between hand-backs of the C heap's free pages (release_freed_memory)


class Method(Protocol):
    """What a drafting method gives the trainer: one object, one file in `training/methods/`."""

    name: str  # its --method value
    #: it drafts through the target's frozen LM head (`model.head`): a reduced draft vocabulary applies
    borrows_target_head: bool
    #: its model can carry a trained head of its own instead (`--train-head`, `model.own_head()`)
    can_train_head: bool
    #: it calls its model once per step, so DDP wraps the model; else the trainer averages the
    #: gradients over processes itself
    ddp_wrapper: bool
    #: FSDP can shard its model: the method then has `shard(model)`, FSDP2 in place; else
    #: --parallel fsdp is refused
    shardable: bool
    #: its model's config records the target it was trained for: a resume checks that it is
    #: this run's target (`fit_problems`)
    records_target: bool

    def build_model(self, config: TrainConfig, target) -> torch.nn.Module:
        """A fresh fp32 model for `target`, with `from_pretrained(folder)` and `write_files(folder)`."""

    def make_drafter(self, model: torch.nn.Module, target) -> Drafter:
        """The drafter that serves `model` (the held-out evaluation drafts with it)."""

    def loss(self, trainer: Trainer, indices: list[int], epoch: int) -> tuple[torch.Tensor, dict]:
        """This process's share of the global batch's loss (records `indices` of the training set),
        and its metrics `loss` and `acc`."""


def sample_anchors(prompt_len: int, length: int, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct sorted anchor positions among response tokens that have at least one label."""
    candidates = torch.arange(prompt_len, length - 1)
    if candidates.numel() == 0:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
    return candidates[pick].sort().values


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Weight of each block position: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def draft_vocabulary(records: list[dict], size: int, vocab_size: int,
                     preferred: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent response tokens (sorted ids): the reduced draft vocabulary.

    Regenerated data of a few thousand prompts holds fewer distinct tokens than a useful
    vocabulary (7.4K in 1,376 responses of the default target), and a larger set cuts the
    vocabulary among tokens seen equally often (session 14's 377K tokens: 9,656 distinct, the
    cut among 2,360 tokens seen once). Among equal counts the `preferred` ids (a warm start's
    vocabulary, built from earlier runs' data) come first, then the others in id order, which
    for BPE vocabularies is merge order (roughly frequency in the tokenizer's corpus), never
    arbitrary ids (a plain top-k breaks ties anywhere)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in records:
        counts += torch.bincount(torch.tensor(record["response_ids"], dtype=torch.long), minlength=vocab_size)[:vocab_size]
    rank = 2 * counts  # by count; among equal counts a preferred id first (+1), then by id (stable sort)
    if preferred is not None:
        rank[preferred[(preferred >= 0) & (preferred < vocab_size)]] += 1
    order = torch.sort(-rank, stable=True).indices
    return order[: min(size, vocab_size)].sort().values


def check_config(config: TrainConfig, method: Method, world_size: int) -> None:
    """Refuse what this run cannot train, before anything loads."""
    if config.method != method.name:
        raise InvalidArgumentError(f"the config trains --method {config.method}, the trainer got {method.name}")
    if config.block_size < 2:
        raise InvalidArgumentError("block_size must be >= 2 to train a drafter")
    if config.draft_vocab_size and not method.borrows_target_head:
        raise InvalidArgumentError(f"draft_vocab_size does not apply to --method {config.method}")
    if config.parallel not in ("ddp", "fsdp"):
        raise InvalidArgumentError(f"parallel must be ddp or fsdp, got {config.parallel!r}")
    if config.parallel == "fsdp" and world_size > 1 and not method.shardable:
        raise InvalidArgumentError(f"--parallel fsdp does not shard --method {method.name}: train it with "
                                   "--parallel ddp")
    if config.batch_size % world_size:
        raise InvalidArgumentError(f"batch_size {config.batch_size} is not divisible by {world_size} processes")
    if config.time_budget_s is not None and not config.time_budget_s > 0:
        raise InvalidArgumentError(f"time_budget_s must be > 0, got {config.time_budget_s}")
    if config.time_budget_clock not in CLOCKS:
        raise InvalidArgumentError(f"time_budget_clock must be wall or cpu, got {config.time_budget_clock!r}")
    if config.loss_weighting not in ("decay", "expected-length"):
        raise InvalidArgumentError(f"loss_weighting must be decay or expected-length, got {config.loss_weighting!r}")
    if config.distill_topk < 0:
        raise InvalidArgumentError(f"distill_topk must be >= 0, got {config.distill_topk}")
    if config.distill_missing not in ("compute", "hard"):
        raise InvalidArgumentError(f"distill_missing must be compute or hard, got {config.distill_missing!r}")
    if config.precision not in ("auto", "bf16", "fp32"):
        raise InvalidArgumentError(f"precision must be auto, bf16 or fp32, got {config.precision!r}")
    if not config.head_lr_scale >= 0:
        raise InvalidArgumentError(f"head_lr_scale must be >= 0, got {config.head_lr_scale}")
    if config.train_head and not method.can_train_head:
        raise InvalidArgumentError(f"train_head does not apply to --method {config.method}")
    if config.train_head and config.parallel == "fsdp" and world_size > 1:
        raise InvalidArgumentError("train_head is not sharded by --parallel fsdp: train it with --parallel ddp")
    if config.train_head and not config.draft_vocab_size:
        raise InvalidArgumentError("train_head needs --draft-vocab-size: serving engines read a drafter's own "
                                   "lm_head.weight only with a reduced draft vocabulary")
    if not 0 <= config.ema_decay < 1:
        raise InvalidArgumentError(f"ema_decay must be in [0, 1), got {config.ema_decay}")
    if config.ema_decay and config.parallel == "fsdp" and world_size > 1:
        raise InvalidArgumentError("ema_decay is not sharded by --parallel fsdp: train it with --parallel ddp")
    if config.keep_init_vocabulary and not (config.init_from and config.draft_vocab_size):
        raise InvalidArgumentError("keep_init_vocabulary needs --init-from a drafter with a reduced draft "
                                   "vocabulary and --draft-vocab-size")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype a training step autocasts to (None: plain fp32)."""
    if precision == "fp32":
        return None
    if precision == "bf16" or device.type == "cuda" or (device.type == "cpu" and cpu_trains_faster_in_bf16()):
        return torch.bfloat16
    return None


class Trainer:
    """Trains `method`'s drafter for `target` on the records of `config.data` (or `records`)."""

    def __init__(self, config: TrainConfig, target, method: Method, records: list[dict] | None = None):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        check_config(config, method, self.world_size)
        self.config, self.target, self.method = config, target, method
        for parameter in target.model.parameters():
            parameter.requires_grad_(False)  # frozen: only the drafter trains
        if records is None:
            for folder in [f for f in str(config.data).split(",") if f.strip()]:
                check_data_target(Path(folder), target)
            records = load_records(config.data)
        order = list(range(len(records)))
        random.Random(config.seed).shuffle(order)
        holdout = min(config.holdout, max(0, len(records) - 1))
        self.eval_records = [records[i] for i in order[:holdout]]
        self.train_records = [records[i] for i in order[holdout:]]
        if not self.train_records:
            raise InvalidArgumentError("no training records")
        torch.manual_seed(config.seed)
        self.model = method.build_model(config, target)
        # the warm start's draft vocabulary (target ids), if it has one: it breaks this run's ties;
        # and its trained head's rows, if it has one
        warm_vocabulary, warm_head = self._warm_start(config.init_from) if config.init_from else (None, None)
        # target id -> draft index (-1: not in the draft vocabulary, its label is ignored)
        self.t2d = torch.arange(target.vocab_size)
        # check_config made sure init_from and draft_vocab_size are set; only here is the size known
        if config.keep_init_vocabulary and (warm_vocabulary is None or len(warm_vocabulary) != config.draft_vocab_size):
            drafts = "no reduced vocabulary" if warm_vocabulary is None else f"{len(warm_vocabulary)} tokens"
            raise InvalidArgumentError(f"keep_init_vocabulary: {config.init_from} drafts {drafts}, this run "
                                       f"--draft-vocab-size {config.draft_vocab_size}")
        if config.draft_vocab_size:
            self.model.d2t.copy_(warm_vocabulary if config.keep_init_vocabulary else
                                 draft_vocabulary(self.train_records, config.draft_vocab_size, target.vocab_size,
                                                  preferred=warm_vocabulary))
            self.t2d = torch.full((target.vocab_size,), -1, dtype=torch.long)
            self.t2d[self.model.d2t] = torch.arange(config.draft_vocab_size)
        # the drafter's own trained head (--train-head), or None: it borrows the target's, if any
        own_head = self.model.own_head() if method.can_train_head else None
        if own_head is not None:
            self._start_trained_head(warm_vocabulary, warm_head)
        elif warm_head is not None:
            raise InvalidArgumentError(f"init_from {config.init_from} drafts through a trained head of its own: "
                                       "pass --train-head true to keep training it")
        # every module and buffer on the target's device; the weights stay fp32 (master
        # weights), a CUDA step computes under bf16 autocast (`train_step`)
        self.model.to(target.device)
        self._head = None
        if own_head is not None or method.borrows_target_head:
            # the drafter's own weight (trains with the rest), or the target's, frozen and restricted
            # to d2t: computed once
            self._head = self.model.head(target)
            if own_head is None and (config.draft_vocab_size or self.model.head_always_stored):
                self.model.stored_head = self._head[0].detach()  # shipped as lm_head.weight for serving engines
        self.ddp_model = self.model  # what a step calls: the model, or DDP's wrapper around it
        # FSDP only: an unsharded copy of the model that rank 0 fills from the shards to
        # evaluate and save (the drafter is small; its training state is what is sharded)
        self.replica = None
        if self.world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo" if target.device.type == "cpu" else "nccl")
            if config.parallel == "fsdp":
                self.replica = copy.deepcopy(self.model)
                method.shard(self.model)
            elif method.ddp_wrapper:
                self.ddp_model = torch.nn.parallel.DistributedDataParallel(self.model)
        # the moving average of the weights (ema_decay), a copy on the same device; None: off
        self.ema = None
        if config.ema_decay:
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

            self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(config.ema_decay))
        groups = [{"params": [p for p in self.model.parameters() if own_head is None or p is not own_head.weight]}]
        if own_head is not None:  # a trained head steps at its own, smaller lr (TrainConfig.head_lr_scale)
            groups.append({"params": [own_head.weight], "lr": config.lr * config.head_lr_scale})
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
        # drop_last: every step sees a full global batch, so any process count splits it evenly
        self.steps_per_epoch = max(1, len(self.train_records) // config.batch_size)
        self.total_steps = self.steps_per_epoch * config.epochs
        warmup = max(1, int(config.warmup_ratio * self.total_steps))
        self.clock = CLOCKS[config.time_budget_clock]
        self.train_seconds = 0.0  # time spent in training steps so far (kept across resumes)

        def schedule(step: int) -> float:
            if config.time_budget_s:  # warmup and cosine over the time budget
                progress = self.train_seconds / config.time_budget_s
                if progress < config.warmup_ratio:
                    return max(progress, 1e-3) / config.warmup_ratio
                progress = (progress - config.warmup_ratio) / max(1e-9, 1 - config.warmup_ratio)
                return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, self.total_steps - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.weights = loss_weights(config.block_size, config.resolved_gamma())
        # running top-1 accuracy per block position (index 0, the anchor, unused): the
        # expected-length weights come from it; kept in the trainer state for exact resume
        self.position_accuracy = torch.full((config.block_size,), 0.5)
        self.step = 0
        self._features: dict[int, torch.Tensor] = {}  # record index -> target features, computed once
        self._top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # record index -> target top-k (ids, probs)
        self.output = Path(config.output)
        self.autocast = autocast_dtype(config.precision, target.device)

    def _warm_start(self, folder: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Load `folder`'s weights into the model (not its vocabulary: this run builds its own unless
        keep_init_vocabulary, nor a trained head, whose rows follow the vocabulary:
        `_start_trained_head`); returns that vocabulary (target ids) and trained head rows, or None.

        A model with more layers than the folder's grows from it: the folder's layers come
        first and every added layer starts as the identity (its attention and MLP output
        projections zeroed, as LLaMA Pro's block expansion does), so the grown drafter drafts
        exactly what the warm start did until training moves it."""
        try:
            source = type(self.model).from_pretrained(folder)
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(f"init_from {folder}: {error}") from None
        mine, theirs = self.model.config, source.config
        grows = hasattr(self.model, "layers") and mine.num_hidden_layers > theirs.num_hidden_layers
        for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "target_layer_ids"):
            if getattr(mine, field, None) != getattr(theirs, field, None) and not (grows and field == "num_hidden_layers"):
                raise InvalidArgumentError(f"init_from {folder}: {field} is {getattr(theirs, field)}, this run trains "
                                           f"{getattr(mine, field)}")
        state = {k: v for k, v in source.state_dict().items() if k not in ("d2t", "lm_head.weight")}
        self.model.load_state_dict(state, strict=False)
        added = list(self.model.layers)[theirs.num_hidden_layers:] if grows else []
        for name, weight in (item for layer in added for item in layer.named_parameters()):
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                torch.nn.init.zeros_(weight)
        own = source.own_head() if self.method.can_train_head else None
        return getattr(source, "d2t", None), None if own is None else own.weight.detach()

    @torch.no_grad()
    def _start_trained_head(self, warm_vocabulary: torch.Tensor | None, warm_head: torch.Tensor | None) -> None:
        """The trained head starts as the target's rows for this run's draft vocabulary (the
        drafter then drafts exactly as with the borrowed head), and where the warm start trained
        rows of its own, as those, matched by target id."""
        weight, bias = self.model.borrowed_head(self.target)
        if bias is not None:
            raise InvalidArgumentError("train_head: the target's LM head has a bias, which a trained head "
                                       "does not carry")
        rows = weight.detach().to("cpu", torch.float32).clone()  # never a view of the target's own head
        ids = self.model.d2t
        if warm_head is not None:
            warm_ids = warm_vocabulary if warm_vocabulary is not None else torch.arange(len(warm_head))
            where = torch.full((self.target.vocab_size,), -1, dtype=torch.long)
            where[warm_ids] = torch.arange(len(warm_ids))
            found = where[ids] >= 0
            rows[found] = warm_head.float()[where[ids][found]]
        self.model.own_head().weight.copy_(rows)

    # --- processes -------------------------------------------------------------------
    def full_model(self):
        """The drafter this run has trained so far: the moving average of its weights (ema_decay),
        else the model itself, or under FSDP the replica filled from the shards (collective:
        every rank calls it; only rank 0's replica is filled)."""
        if self.ema is not None:
            return self.ema.module
        if self.replica is None:
            return self.model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            self.replica.load_state_dict(state)
        return self.replica

    def reduce_gradients(self) -> None:
        # FSDP reduce-scatters the gradients itself, DDP all-reduces them in its hooks
        if self.world_size > 1 and not self.method.ddp_wrapper and self.replica is None:
            import torch.distributed as dist

            for parameter in self.model.parameters():
                if not parameter.requires_grad:
                    continue
                if parameter.grad is None:  # every rank must reduce the same tensors
                    parameter.grad = torch.zeros_like(parameter)
                dist.all_reduce(parameter.grad)
                parameter.grad /= self.world_size

    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (detached) summed over every process: the loss normaliser with which N
        processes together compute exactly one process's loss over the whole batch."""
        value = value.detach().clone()
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
        return value

    # --- data ----------------------------------------------------------------------
    def sequence(self, index: int) -> tuple[torch.Tensor, int]:
        """Training record `index` as one id sequence (cut at `max_length`) and its prompt length."""
        record = self.train_records[index]
        ids = (record["prompt_ids"] + record["response_ids"])[: self.config.max_length]
        return torch.tensor(ids, dtype=torch.long), min(len(record["prompt_ids"]), len(ids))

    def anchors(self, index: int, epoch: int) -> torch.Tensor:
        """The anchors of training record `index` in `epoch`, seeded per record: a run draws
        the same ones whatever its process count."""
        sequence, prompt_len = self.sequence(index)
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch * 100_003 + index)
        return sample_anchors(prompt_len, sequence.numel(), self.config.num_anchors, generator)

    def batch_indices(self, step: int) -> list[int]:
        """The global batch of `step` (a pure function of seed and step: resumable)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.train_records), generator=torch.Generator().manual_seed(self.config.seed + epoch))
        size = self.config.batch_size
        return order[position * size:(position + 1) * size].tolist()

    def _padded(self, indices: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The records' sequences, and as a right-padded batch (ids, attention mask) on the target's device."""
        sequences = [self.sequence(i)[0] for i in indices]
        return sequences, *right_padded(sequences, self.target.device)

    @torch.inference_mode()
    def features(self, indices: list[int]) -> list[torch.Tensor]:
        """Per training record: the target's features of the drafter's layers, [n, layers * hidden]
        on the host, 16-bit: read where `blockspec data` stored them (every time: the OS caches
        the files, and a campaign's features outgrow RAM: 14 folders held 12 GiB), else computed
        and kept for the next epochs."""
        with torch.autocast(self.target.device.type, enabled=False):  # the target's own precision
            return self._features_of(indices)

    def _features_of(self, indices: list[int]) -> list[torch.Tensor]:
        layer_ids = tuple(self.model.config.target_layer_ids)
        found = {}
        missing = [i for i in indices if i not in self._features]
        # captured by `blockspec data` while it generated, for these layers or more
        stored = [i for i in missing
                  if set(layer_ids) <= set(self.train_records[i].get("features_ref", (None, None, ()))[2] or ())]
        for index in stored:
            path, key, stored_ids = self.train_records[index]["features_ref"]
            with safe_open(path, framework="pt") as handle:
                length = self.sequence(index)[0].numel()
                everything = handle.get_tensor(key)[:length]
            width = everything.shape[-1] // len(stored_ids)
            if not bool(torch.isfinite(everything).all()):
                raise InvalidArgumentError(f"{path}: the stored features of record {key} hold inf/NaN (fp16 "
                                           "overflow?): rebuild this dataset with the current `blockspec data`, "
                                           "which stores bf16 where fp16 would overflow")
            chosen = [everything[:, stored_ids.index(i) * width:(stored_ids.index(i) + 1) * width] for i in layer_ids]
            found[index] = compact_features(torch.cat(chosen, dim=-1))
        missing = [i for i in missing if i not in found]
        if missing:
            sequences, ids, attention = self._padded(missing)
            # distilling: the same pass gives the target's distributions (one target pass per record, not two)
            distill = [i for i in missing if self.config.distill_topk and self.config.distill_missing == "compute"
                       and i not in self._top]
            out = self.target.model(input_ids=ids, attention_mask=attention, output_hidden_states=True,
                                    logits_to_keep=0 if distill else 1)
            stacked = target_features(out.hidden_states, layer_ids)
            for row, index in enumerate(missing):
                # 16-bit in host memory: computed features are kept for reuse each epoch
                self._features[index] = compact_features(stacked[row, : sequences[row].numel()].to("cpu"))
            if distill:
                self._keep_top(missing, sequences, out.logits)
        return [found[i] if i in found else self._features[i] for i in indices]

    def _keep_top(self, indices: list[int], sequences: list[torch.Tensor], logits: torch.Tensor) -> None:
        """Cache the target's top-k next-token ids and probabilities of each record (rows of `logits`)."""
        top = torch.softmax(logits.float(), dim=-1).topk(self.config.distill_topk, dim=-1)
        for row, index in enumerate(indices):
            n = sequences[row].numel()
            self._top[index] = (top.indices[row, :n].to("cpu", torch.int32), top.values[row, :n].to("cpu", torch.float16))

    @torch.inference_mode()
    def _target_top(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per record: the target's top-k next-token ids [n, k] and probabilities [n, k]
        (row p: the distribution of the token at p + 1; only response tokens' rows are ever
        read), read where `blockspec data --store-topk` stored them, else computed (None
        with distill_missing="hard": that record keeps its hard labels); kept."""
        k = self.config.distill_topk
        for index in indices:
            ref = self.train_records[index].get("topk_ref")
            if index in self._top or not ref or ref[2] < k:
                continue
            path, key, _ = ref
            sequence, prompt_len = self.sequence(index)
            with safe_open(path, framework="pt") as handle:
                stored_ids, stored_probs = handle.get_tensor(f"{key}.ids"), handle.get_tensor(f"{key}.probs")
            ids = torch.zeros(sequence.numel(), k, dtype=torch.int32)
            probs = torch.zeros(sequence.numel(), k, dtype=torch.float16)
            rows = min(stored_ids.shape[0], sequence.numel() - prompt_len)  # response rows inside max_length
            ids[prompt_len - 1:prompt_len - 1 + rows] = stored_ids[:rows, :k]
            probs[prompt_len - 1:prompt_len - 1 + rows] = stored_probs[:rows, :k]
            self._top[index] = (ids, probs)
        missing = [i for i in indices if i not in self._top]
        if missing and self.config.distill_missing == "compute":
            # records whose features were stored: their distributions still need a pass
            sequences, ids, attention = self._padded(missing)
            with torch.autocast(self.target.device.type, enabled=False):  # the target's own precision
                logits = self.target.model(input_ids=ids, attention_mask=attention).logits
            self._keep_top(missing, sequences, logits)
        return [self._top.get(i) for i in indices]

    # --- what the losses share -------------------------------------------------------
    def soft_labels(self, indices: list[int], positions: torch.Tensor, labels: torch.Tensor):
        """The target's distributions for the labels at `positions` [b, w] (label = token AT
        the position): draft-vocabulary ids [b, w, k] (-1 outside it) and weights [b, w, k]
        summing to 1 over the ids inside (0 where a label is IGNORE)."""
        tops = self._target_top(indices)
        batch, width = labels.shape
        k = self.config.distill_topk
        ids = torch.full((batch, width, k), -1, dtype=torch.long)
        probs = torch.zeros(batch, width, k)
        for row, top in enumerate(tops):
            if top is not None:
                source = (positions[row] - 1).clamp(0, top[0].shape[0] - 1)  # the distribution that predicts it
                ids[row], probs[row] = top[0][source].long(), top[1][source].float()
        ids = torch.where(ids >= 0, self.t2d[ids.clamp_min(0)], -1)
        for row, top in enumerate(tops):
            if top is None:  # no stored distribution: all weight on the label (already a draft id)
                ids[row, :, 0], probs[row, :, 0] = labels[row], 1.0
        probs = torch.where((ids >= 0) & (labels != IGNORE)[..., None], probs, 0.0)
        return ids, probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft-vocabulary indices (-1: outside it, no label; IGNORE stays)."""
        t2d = self.t2d.to(labels.device)
        return torch.where(labels == IGNORE, IGNORE, t2d[labels.clamp_min(0)])

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the head: the borrowed (frozen) one keeps the target's dtype; a trained one is fp32."""
        return F.linear(hidden.to(self._head[0].dtype), *self._head).float()

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, weight: float):
        """For the drafters that draft token by token (one step of MTP / EAGLE-3): weight x the
        summed cross-entropy of the borrowed head on norm(hidden) [n, H] against draft-vocabulary
        `labels` [n] (rows without a label skipped). Returns (loss sum, weight sum, correct, counted)."""
        valid = labels >= 0
        if not bool(valid.any()):
            return 0.0, 0.0, 0, 0
        logits = self.head_logits(self.model.norm(hidden[valid]))
        loss = weight * F.cross_entropy(logits, labels[valid], reduction="sum")
        with torch.no_grad():
            correct = int((logits.argmax(-1) == labels[valid]).sum())
        return loss, weight * valid.sum(), correct, int(valid.sum())

    def position_weights(self) -> torch.Tensor:
        """Loss weight per block position (0 for the anchor)."""
        if self.config.loss_weighting == "decay":
            return self.weights
        reach = torch.ones(self.config.block_size)
        reach[2:] = torch.cumprod(self.position_accuracy[1:-1], 0)  # position k needs 1..k-1 accepted
        reach[0] = 0.0
        return reach.clamp_min(1e-3) * (reach > 0)

    def observe_accuracy(self, block_position: torch.Tensor, correct: torch.Tensor, momentum: float = 0.95) -> None:
        """Fold one step's top-1 accuracy per block position into the running estimate (the
        counts summed over processes, so every rank weighs the loss alike)."""
        size = self.config.block_size
        counts = torch.stack([torch.bincount(block_position, weights=correct, minlength=size),
                              torch.bincount(block_position, minlength=size).float()])
        counts = self.global_sum(counts.to(self.target.device)).cpu()  # NCCL reduces GPU tensors only
        seen = counts[1] > 0
        rate = counts[0][seen] / counts[1][seen]
        self.position_accuracy[seen] = momentum * self.position_accuracy[seen] + (1 - momentum) * rate

    # --- one step ------------------------------------------------------------------
    def out_of_time(self) -> bool:
        return bool(self.config.time_budget_s) and self.train_seconds >= self.config.time_budget_s

    def train_step(self) -> dict:
        started = self.clock()
        indices = self.batch_indices(self.step)
        if self.world_size > 1:  # each rank takes its share of the global batch
            indices = indices[self.rank::self.world_size]
        epoch = self.step // self.steps_per_epoch
        self.ddp_model.train()
        # bf16 autocast where it pays (`precision`); fp32 master weights and loss either way
        with torch.autocast(self.target.device.type, dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            loss, metrics = self.method.loss(self, indices, epoch)
        self.optimizer.zero_grad(set_to_none=True)
        # DDP AVERAGES gradients over ranks while each rank's loss is already its share
        # of the global loss: scale back up by the world size.
        (loss * self.world_size).backward()
        self.reduce_gradients()
        if self.world_size > 1:
            import torch.distributed as dist

            summed = torch.tensor([metrics["loss"]])
            dist.all_reduce(summed)
            metrics["loss"] = float(summed)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        elapsed = torch.tensor([self.clock() - started])
        if self.world_size > 1:  # every rank stops at the same step: the slowest rank's clock
            import torch.distributed as dist

            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.train_seconds += float(elapsed)
        self.scheduler.step()
        self.step += 1
        metrics.update(step=self.step, lr=self.scheduler.get_last_lr()[0], grad_norm=float(grad_norm),
                       train_s=round(self.train_seconds, 2))
        return metrics

    # --- evaluation ------------------------------------------------------------------
    def evaluate_tau(self) -> float | None:
        """Real acceptance length of the current drafter through the engine, held-out prompts
        (every rank calls it; rank 0 evaluates, the others get None)."""
        model = self.full_model()
        if self.rank != 0:
            return None
        with torch.inference_mode():
            return self._evaluate_tau(model)

    def _evaluate_tau(self, model) -> float:
        # the drafter binds an eval-mode copy (bind_to_target): the model under the optimizer
        # keeps its mode, device and dtype
        engine = SpecEngine(self.target, self.method.make_drafter(model, self.target), self.config.block_size)
        committed = steps = 0
        for record in self.eval_records[: self.config.eval_prompts]:
            stats = GenerationStats(self.config.block_size)
            for _ in engine.generate(record["prompt_ids"], max_new_tokens=self.config.eval_max_new_tokens, stats=stats):
                pass
            committed += stats.new_tokens - 1
            steps += stats.steps
        return committed / steps if steps else 0.0

    # --- checkpoints -----------------------------------------------------------------
    def save(self, name: str = "latest") -> Path:
        """Drafter (reference format) + trainer state in one folder, swapped in atomically
        (every rank calls it: under FSDP gathering the shards is collective; rank 0 writes)."""
        model = self.full_model()
        if self.replica is None:
            optimizer_state = self.optimizer.state_dict()
        else:  # the full state keyed by parameter names, gathered on rank 0
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            optimizer_state = get_optimizer_state_dict(
                self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return self.output / name
        state = {"step": self.step, "optimizer": optimizer_state,
                 "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(),
                 "train_seconds": self.train_seconds, "position_accuracy": self.position_accuracy,
                 "config": asdict(self.config)}
        if self.ema is not None:  # the folder's drafter is the average; the live weights resume from here
            state["live_model"] = self.model.state_dict()
        with replace_dir(self.output / name) as staging:
            model.write_files(staging)
            torch.save(state, staging / "trainer_state.pt")
        return self.output / name

    def resume(self, name: str = "latest") -> bool:
        folder = self.output / name
        if not (folder / "trainer_state.pt").exists():
            return False
        restored = type(self.model).from_pretrained(folder)
        # a run folder of another target (or of another drafter shape) is refused, not overwritten
        problems = fit_problems(restored.config, self.target) if self.method.records_target else []
        mine = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        theirs = {n: tuple(t.shape) for n, t in restored.state_dict().items()}
        if mine != theirs:
            problems.append("its drafter has another shape than this run's options")
        if problems:
            raise InvalidArgumentError(f"cannot resume {folder}: {'; '.join(problems)}; pass another --output "
                                       "(or the options it was started with)")
        state = torch.load(folder / "trainer_state.pt", weights_only=True)  # tensors and plain types only
        if self.ema is None and "live_model" in state:
            raise InvalidArgumentError(f"cannot resume {folder}: it was started with --ema-decay (its folder holds "
                                       "the average of the weights); pass the ema_decay it was started with")
        if self.ema is not None and "live_model" not in state:
            raise InvalidArgumentError(f"cannot resume {folder}: it was started without --ema-decay; drop it, or "
                                       "start a new --output")
        saved = restored.state_dict()  # the folder's weights: the live ones, or with ema_decay their average
        if self.ema is not None:  # the trainer state then holds the live weights
            self.ema.module.load_state_dict(saved)
            self.ema.n_averaged.fill_(state["step"])  # one update per step
        live = saved if self.ema is None else state["live_model"]
        if self.replica is None:  # (ema_decay is refused under multi-process FSDP)
            self.model.load_state_dict(live)
            self.optimizer.load_state_dict(state["optimizer"])
        else:  # every rank reads the full state and keeps its shard of it
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, live, options=full)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=full)
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.step = state["step"]
        self.train_seconds = float(state.get("train_seconds", 0.0))
        if "position_accuracy" in state:
            self.position_accuracy = state["position_accuracy"].clone()
        return True

    # --- the run ---------------------------------------------------------------------
    def run(self, resume: bool = False) -> Path:
        config = self.config
        log_path = self.output / "metrics.jsonl"
        if resume and self.resume():
            history = [json.loads(l) for l in log_path.read_text().splitlines() if l] if log_path.exists() else []
            history = [h for h in history if h["step"] <= self.step]
        else:
            history = []
        last_steps = min(self.total_steps, config.max_steps or self.total_steps)
        is_main = self.rank == 0
        if is_main:
            self.output.mkdir(parents=True, exist_ok=True)
            (self.output / "train_config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
        bar = tqdm(total=last_steps, initial=self.step, desc="training", unit="step", disable=not is_main)
        started = time.perf_counter()
        while self.step < last_steps and not self.out_of_time():
            metrics = self.train_step()
            done = self.step == last_steps or self.out_of_time()
            if config.eval_every and (self.step % config.eval_every == 0 or done):
                tau = self.evaluate_tau()
                if tau is not None:
                    metrics["tau"] = tau
            if is_main:
                history.append(metrics)
                write_text(log_path, "".join(json.dumps(row) + "\n" for row in history))
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc']:.2f}",
                                **({"tau": f"{metrics['tau']:.2f}"} if "tau" in metrics else {}))
            if self.step % config.save_every == 0 or done:
                self.save()
            if self.step % TRIM_EVERY == 0:
                release_freed_memory()
            bar.update(1)
        bar.close()
        final = self.save("final")
        if is_main:
            plot_metrics(history, self.output / "metrics.png")
            taus = [h["tau"] for h in history if "tau" in h]
            print(f"trained {self.step} steps in {time.perf_counter() - started:.0f} s; "
                  f"last loss {history[-1]['loss']:.3f}" + (f", held-out tau {taus[-1]:.2f}" if taus else "")
                  + f"; drafter at {final}")
        return final


@functools.cache
def _malloc_trim():
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    except (OSError, TypeError):  # no C library to open (Windows)
        return None


def release_freed_memory() -> bool:
    """Hand the free pages of the C heap back to the OS (glibc's `malloc_trim`); False where
    the C library has no such call. Each CPU step frees activations of a new size (records of
    every length), and glibc keeps the holes between live blocks: a training process grew to
    7.5 GB resident in session 41 and squeezed the page cache that holds the stored features
    out of RAM (60% system time a step). Called every TRIM_EVERY steps."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)  # 0: keep no padding at the heap's top
    return True


def finish_distributed() -> None:
    """End a torchrun worker (the trainer started its process group) once everything is
    written: every rank waits at a barrier, so no rank tears down while another still
    talks to it, then the group is destroyed and the process exits WITHOUT interpreter
    finalization. Gloo's worker threads can abort finalization after a clean run (SIGABRT,
    "terminate called without an active exception", pytorch/pytorch#179291), which
    torchrun would report as a failure."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def plot_metrics(history: list[dict], path: Path) -> None:
    """Loss and held-out tau against steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, loss_axis = plt.subplots(figsize=(7, 4))
    loss_axis.plot([h["step"] for h in history], [h["loss"] for h in history], color="tab:blue", lw=1)
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("weighted CE loss", color="tab:blue")
    taus = [(h["step"], h["tau"]) for h in history if "tau" in h]
    if taus:
        tau_axis = loss_axis.twinx()
        tau_axis.plot(*zip(*taus), "o-", color="tab:red")
        tau_axis.set_ylabel("held-out tau", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
