"""Shared fixtures: tiny random-weight targets of several architectures, built from a config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import GenerationConfig

from blockspec.decoding.draft import Drafter
from blockspec.targets.adapter import TargetAdapter
from blockspec.targets.linear_kernels import onednn_available, use_linear_kernels

transformers.utils.logging.set_verbosity_error()
# Under pytest-xdist (`make test` runs `-n auto`) the cores are shared between the workers:
# two torch processes with a thread per core each slow each other many times over.
# OMP_NUM_THREADS carries the share to `load_target` and to the CLI subprocesses.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ["OMP_NUM_THREADS"] = str(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma3"]
# Public eval data (never copied into the repo): BLOCKSPEC_DATA_DIR, else ../shared/data beside the checkout.
DATA_DIR = Path(os.environ.get("BLOCKSPEC_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


def tiny_config(arch: str, vocab_size: int = 96, hidden: int = 64, layers: int = 4):
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if arch == "gemma3":
        # A window of 8 so that the tests run far past it: rollback must still work.
        kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return transformers.Gemma3TextConfig(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                             layer_types=(kinds * layers)[:layers], **common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    config = tiny_config(arch, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model


# Every kernel `load_target` may pick (targets/linear_kernels.py), each at some pass widths: a plain
# step, chains and trees of every size then run through all of them in the engine's tests.
MIXED_KERNELS = {1: "weight-first", 2: "onednn", 4: "linear", 8: "onednn", 16: "weight-first", 33: "linear",
                 64: "onednn"}


def tiny_target(arch: str, seed: int = 0, **kwargs) -> TargetAdapter:
    """As `load_target` builds one: the adapter, then its Linear products dispatched by pass
    width to the kernels of MIXED_KERNELS (transformers' own F.linear runs in the tests that
    build models without this)."""
    target = TargetAdapter(tiny_model(arch, seed, **kwargs), tokenizer=None, name=f"tiny-{arch}")
    kernels = {rows: k if k != "onednn" or onednn_available() else "linear" for rows, k in MIXED_KERNELS.items()}
    use_linear_kernels(target.model, kernels)
    return target


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """transformers' own greedy decoding: same EOS ids, no other logits processors."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids),
                              pad_token_id=list(eos_ids)[0], bos_token_id=None)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session", params=ARCHITECTURES)
def arch_target(request) -> TargetAdapter:
    return tiny_target(request.param)


class OracleDrafter(Drafter):
    """Test helper: proposes the known reference continuation, corrupted at a random
    position in most steps, so every accept length (0..B-1) gets exercised."""

    name = "oracle"
    target_layer_ids = ()
    max_block_size = None

    def __init__(self, reference: list[int], corrupt_prob: float = 0.7, seed: int = 0, vocab_size: int = 96):
        self.reference = reference
        self.corrupt_prob = corrupt_prob
        self.rng = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size

    def begin(self, prompt_ids, prompt_features):
        pass

    def fork(self):
        return self  # stateless per sequence

    def propose_one(self, request):
        from blockspec.decoding.draft import Draft

        start, num_drafts = request.token_ids.numel(), request.num_drafts
        tokens = torch.tensor(self.reference[start:start + num_drafts], dtype=torch.long)
        if tokens.numel() and float(torch.rand(1, generator=self.rng)) < self.corrupt_prob:
            position = int(torch.randint(tokens.numel(), (1,), generator=self.rng))
            tokens[position] = (tokens[position] + 1) % self.vocab_size
        return Draft(tokens=tokens)

    def accept(self, committed_ids, committed_features):
        pass


class TreeOracleDrafter(OracleDrafter):
    """Test helper for token trees: per-position candidates (`top_k` distinct ids, best
    first) with the reference token at a random rank, or missing, so that walks take first,
    later and no branches. Without a candidates request it drafts the rank-1 chain."""

    name = "tree-oracle"
    gives_candidates = True

    def __init__(self, reference: list[int], top_k: int = 3, miss_prob: float = 0.25, seed: int = 0,
                 vocab_size: int = 96):
        super().__init__(reference, seed=seed, vocab_size=vocab_size)
        self.top_k, self.miss_prob = top_k, miss_prob

    def propose_one(self, request):
        from blockspec.decoding.draft import Draft
        from blockspec.decoding.tree import Candidates

        start = request.token_ids.numel()
        truth = self.reference[start:start + request.num_drafts]
        ids = torch.stack([torch.randperm(self.vocab_size, generator=self.rng)[:self.top_k] for _ in truth]) \
            if truth else torch.empty(0, self.top_k, dtype=torch.long)
        for position, token in enumerate(truth):
            ids[position][ids[position] == token] = (token + 1) % self.vocab_size  # placed below, or missing
            if float(torch.rand(1, generator=self.rng)) >= self.miss_prob:
                ids[position, int(torch.randint(self.top_k, (1,), generator=self.rng))] = token
        scores = torch.rand(len(truth), self.top_k, generator=self.rng).sort(dim=-1, descending=True).values
        logprobs = torch.log_softmax(3 * scores, dim=-1)
        if not request.candidates:
            return Draft(tokens=ids[:, 0].clone())
        return Draft(tokens=ids[:, 0].clone(), candidates=Candidates(ids, logprobs))


def assert_same_or_near_tie(model, prompt: list[int], ours: list[int], reference: list[int]):
    """T=0 identity, with exactly one recognised exception: a genuine near-tie.

    A block verified in one pass and tokens decoded one by one may differ in the last
    bits. If the first mismatch sits where the target's top-2 logits are within 1e-4,
    say so and compare the prefix before it; any other mismatch fails.
    """
    if ours == reference:
        return
    index = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + reference[:index]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert index < min(len(ours), len(reference)) and gap < 1e-4, (
        f"output differs from greedy at new token {index} (top-2 gap {gap:.3g}):\n ours {ours}\n ref  {reference}"
    )
    print(f"near-tie at new token {index} (top-2 gap {gap:.2e}): compared the prefix before it")
    assert ours[:index] == reference[:index]
