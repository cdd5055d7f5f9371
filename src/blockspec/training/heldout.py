"""Held-out acceptance of a drafter: tau on benchmark prompts that training never sees.

The campaign and its A/B runs judge every drafter this way (issue 13): T=0, the
benchmark's own prompt formats (GSM8K / MATH-500 with the boxed-answer suffix,
HumanEval as a function to complete, both MT-Bench turns), the test splits only.
Only acceptance is measured, no timing, so it can run beside a training job.
Domains: `math+code` pools GSM8K, MATH-500 and HumanEval steps, `chat` is MT-Bench.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from blockspec.bench.datasets import load_prompts
from blockspec.bench.runner import run_prompt
from blockspec.pipeline import SpecDecoder

DOMAINS = {"gsm8k": "math+code", "math500": "math+code", "humaneval": "math+code", "mt_bench": "chat"}


@dataclass
class Acceptance:
    """Pooled over the prompts of one dataset or domain."""
    steps: int = 0
    committed: int = 0  # accepted drafts + one bonus token per step
    accept_hist: list[int] = field(default_factory=list)
    tokens: int = 0  # the target's output tokens
    in_vocabulary: int = 0  # ... of which the drafter can propose (its draft vocabulary)

    def add(self, accept_hist: list[int]) -> None:
        if not self.accept_hist:
            self.accept_hist = [0] * len(accept_hist)
        for length, count in enumerate(accept_hist):
            self.accept_hist[length] += count
            self.steps += count
            self.committed += count * (length + 1)

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def first_position_rate(self) -> float:
        """Share of steps that accepted draft position 1 (every step proposes it)."""
        return 1.0 - self.accept_hist[0] / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        coverage = self.in_vocabulary / self.tokens if self.tokens else 0.0
        return {"tau": round(self.tau, 4), "pos1": round(self.first_position_rate, 4), "steps": self.steps,
                "vocab_coverage": round(coverage, 4)}


def heldout_acceptance(target, drafter, *, datasets: list[str], data_dir: str | None, limit: int,
                       max_new_tokens: int = 128, block_size: int = 16, seed: int = 1,
                       tree_budget: int | None = None, progress: bool = True) -> dict:
    """{'datasets': {name: {...}}, 'domains': {'math+code': {...}, 'chat': {...}}} at T=0.
    `seed` picks the subset of each test split (the bench uses seed 0 for its own).
    `tree_budget`: verify token trees of exactly this many nodes (what the default command
    verifies at most); None: chains of block_size - 1 drafts. pos1 is then the share of
    steps that accepted a node of the tree's first level."""
    # the drafter's quality, not the planner's choices: a full chain (or a full tree) every
    # step (a planned decoder drafts less, or not at all, where drafting does not pay here)
    decoder = SpecDecoder(target, drafter, block_size, plan=False, tree_budget=tree_budget)
    # a reduced draft vocabulary: every target token outside it is a certain rejection
    d2t = getattr(getattr(drafter, "model", None), "d2t", None)
    proposable = set(d2t.tolist()) if d2t is not None else None
    per_dataset: dict[str, Acceptance] = {}
    per_domain: dict[str, Acceptance] = {}
    for dataset in datasets:
        prompts = load_prompts(dataset, data_dir, limit, seed)
        for prompt in tqdm(prompts, desc=f"held-out {dataset}", unit="prompt", disable=not progress):
            sample = run_prompt(decoder, prompt, max_new_tokens, temperature=0.0, seed=seed)
            outputs = [t for turn in sample.token_ids for t in turn]
            covered = sum(1 for t in outputs if t in proposable) if proposable is not None else len(outputs)
            for pool in (per_dataset.setdefault(dataset, Acceptance()),
                         per_domain.setdefault(DOMAINS.get(dataset, dataset), Acceptance())):
                pool.add(sample.accept_hist)
                pool.tokens += len(outputs)
                pool.in_vocabulary += covered
    return {"datasets": {name: a.as_dict() for name, a in per_dataset.items()},
            "domains": {name: a.as_dict() for name, a in per_domain.items()},
            "block_size": block_size, "tree_budget": tree_budget, "max_new_tokens": max_new_tokens,
            "prompts_per_dataset": limit, "subset_seed": seed}


def format_acceptance(result: dict) -> str:
    rows = [f"{name:>10}: tau {r['tau']:.2f}  pos-1 {r['pos1']:.2f}  draft-vocabulary coverage "
            f"{r['vocab_coverage']:.3f}  ({r['steps']} steps)"
            for name, r in {**result["datasets"], **result["domains"]}.items()]
    return "\n".join(rows)

