"""Statistics of one generation call."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    block_size: int
    steps: int = 0  # draft -> verify iterations (the first token, from prefill, is not a step)
    new_tokens: int = 0
    accept_hist: list[int] = field(default_factory=list)  # steps by number of accepted drafts, 0..B-1
    proposed_by_pos: list[int] = field(default_factory=list)  # steps that proposed draft position k
    accepted_by_pos: list[int] = field(default_factory=list)  # steps that accepted draft position k
    tree_nodes: int = 0  # draft nodes verified in token trees (a chain's drafts are not counted)
    tree_steps: int = 0  # steps that verified a tree
    notes: list[str] = field(default_factory=list)  # what ran differently from what was asked, and why
    ttft_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # everything after the first token
    total_s: float = 0.0

    def __post_init__(self):
        width = max(self.block_size - 1, 0)
        self.accept_hist = self.accept_hist or [0] * (width + 1)
        self.proposed_by_pos = self.proposed_by_pos or [0] * width
        self.accepted_by_pos = self.accepted_by_pos or [0] * width

    def record_step(self, num_drafts: int, accept_length: int) -> None:
        self.steps += 1
        self.accept_hist[accept_length] += 1
        for position in range(num_drafts):
            self.proposed_by_pos[position] += 1
            if position < accept_length:
                self.accepted_by_pos[position] += 1

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step: accepted drafts + 1 bonus."""
        if not self.steps:
            return 0.0
        accepted = sum(length * count for length, count in enumerate(self.accept_hist))
        return (accepted + self.steps) / self.steps

    @property
    def accept_rate_by_pos(self) -> list[float]:
        """Per draft position k: fraction of the steps that proposed k in which k was accepted."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_pos, self.proposed_by_pos)]

    @property
    def tpot_s(self) -> float:
        """Decode time per output token after the first (prefill excluded)."""
        return self.decode_s / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "tau": round(self.tau, 4),
            "accept_hist": list(self.accept_hist),
            "accept_rate_by_pos": [round(rate, 4) for rate in self.accept_rate_by_pos],
            "steps": self.steps,
            **({"tree_steps": self.tree_steps, "tree_nodes": self.tree_nodes} if self.tree_steps else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
            "new_tokens": self.new_tokens,
            "ttft_s": round(self.ttft_s, 5),
            "tpot_s": round(self.tpot_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }

    def summary(self) -> str:
        return (
            f"[{self.new_tokens} tokens | tau {self.tau:.2f} over {self.steps} steps | "
            f"{self.tokens_per_s:.1f} tok/s | ttft {self.ttft_s * 1000:.0f} ms | "
            f"tpot {self.tpot_s * 1000:.1f} ms]"
        )
