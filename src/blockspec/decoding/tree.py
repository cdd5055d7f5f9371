"""Token trees: many continuations of the anchor verified in ONE target pass (DDTree,
Ringel et al. 2026, arXiv 2604.12989).

A block drafter (DFlash) gives, in one pass, a distribution for every draft position; its
top-1 path is the chain. The tree spends a node budget on the most likely token PATHS
instead: a path's score is the product of its tokens' marginal probabilities, and the
tree is grown best-first (the k-best enumeration over per-position ranks), so its first n
nodes are always the n best paths' nodes and always a tree (a parent scores at least its
child). Other sources' continuations (an n-gram lookup's) join as branches, scored by
their observed acceptance; where they coincide with model nodes the nodes merge.

A tree is flat: node i has token `tokens[i]` and parent `parents[i]` (-1: the anchor),
parents before children. The target runs [anchor] + tokens with node i at position
anchor + depth(i) and an ancestor-only mask (`ancestor_mask`); `walk` then follows the
target's own choice from the anchor down, as far as the tree has it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from blockspec.errors import InvalidArgumentError


@dataclass
class Candidates:
    """What a tree is built from: per draft position (1..k) the drafter's best tokens
    (target ids) and their log-probabilities, best first, and other sources' chains."""

    ids: torch.Tensor  # [k, K]
    logprobs: torch.Tensor  # [k, K]; -inf for a token the drafter rules out
    # (tokens [m], log-probability that each is right given the ones before): e.g. an n-gram continuation
    branches: list[tuple[torch.Tensor, float]] = field(default_factory=list)


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int]  # -1: the anchor
    scores: list[float]  # log-probability of reaching node i (the product of marginals on its path)

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, count: int) -> "Tree":
        """The tree of the first `count` nodes (the best `count` paths' nodes)."""
        return Tree(self.tokens[:count], self.parents[:count], self.scores[:count])

    def depths(self) -> list[int]:
        return depths(self.parents)

    def expected_accepted(self) -> list[float]:
        """E[accepted drafts] of the first n nodes, n = 1..len: the sum of their reach
        probabilities (a node is accepted iff the target's path passes through it)."""
        total, expected = 0.0, []
        for score in self.scores:
            total += math.exp(score)
            expected.append(total)
        return expected


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (1: a child of the anchor), parents before children."""
    result: list[int] = []
    for parent in parents:
        result.append(1 if parent < 0 else result[parent] + 1)
    return result


def check_budget(budget: int, max_context: int) -> None:
    if budget < 1:
        raise InvalidArgumentError(f"tree node budget must be >= 1, got {budget}")
    if budget >= max_context:
        raise InvalidArgumentError(f"tree node budget {budget} does not fit the target's context ({max_context})")


def build_tree(candidates: Candidates, budget: int, max_depth: int) -> Tree:
    """The best `budget` nodes, at most `max_depth` deep, best first."""
    ids, logprobs = candidates.ids.tolist(), candidates.logprobs.tolist()
    depth_limit = min(max_depth, len(ids))
    tree = Tree([], [], [])
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node: where sources coincide they merge
    # heap items: (-score, tie, depth, rank or -1 for a branch, parent node, branch number)
    heap: list[tuple[float, int, int, int, int, int]] = []
    tie = 0

    def push(score: float, depth: int, rank: int, parent: int, branch: int) -> None:
        nonlocal tie
        if score > -math.inf:
            heapq.heappush(heap, (-score, tie, depth, rank, parent, branch))
            tie += 1

    if depth_limit >= 1 and ids and ids[0]:
        push(logprobs[0][0], 1, 0, -1, -1)
    branches = [(chain.tolist()[:max_depth], logprob) for chain, logprob in candidates.branches if chain.numel()]
    for number, (chain, logprob) in enumerate(branches):
        push(logprob, 1, -1, -1, number)
    while heap and len(tree) < budget:
        negative, _, depth, rank, parent, branch = heapq.heappop(heap)
        score = -negative
        token = branches[branch][0][depth - 1] if rank < 0 else ids[depth - 1][rank]
        node = index.get((parent, token))
        if node is None:
            node = index[(parent, token)] = len(tree)
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.scores.append(score)
        if rank < 0:  # a branch goes on along its own chain
            chain, logprob = branches[branch]
            if depth < len(chain):
                push(score + logprob, depth + 1, -1, node, branch)
            continue
        # the k-best enumeration: this path's next rank at the same depth, and its best child
        if rank + 1 < len(ids[depth - 1]):
            push(score - logprobs[depth - 1][rank] + logprobs[depth - 1][rank + 1], depth, rank + 1, parent, -1)
        if depth < depth_limit:
            push(score + logprobs[depth][0], depth + 1, 0, node, -1)
    return tree


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool over [anchor] + nodes: row i may attend to column j iff j is i
    or one of its ancestors (the anchor is everyone's)."""
    count = len(parents) + 1
    mask = torch.zeros(count, count, dtype=torch.bool)
    mask[:, 0] = True
    for node, parent in enumerate(parents, start=1):
        mask[node] = mask[parent + 1]
        mask[node, node] = True
    return mask


def walk(tokens: list[int], parents: list[int], target_next: list[int]) -> tuple[list[int], int]:
    """Follow the target from the anchor: `target_next[i]` is its token after block position
    i (0: the anchor, i: node i - 1). Returns the accepted nodes, in order, and the target's
    token after the last of them (the bonus)."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    path, node = [], -1
    while True:
        token = target_next[node + 1]
        child = children.get((node, token))
        if child is None:
            return path, token
        path.append(child)
        node = child


def committed_depth(tokens: list[int], parents: list[int], committed: list[int]) -> tuple[int, bool]:
    """How deep the tokens the target committed after the anchor run along the tree (what a
    verify of it would have accepted, at T = 0), and whether that is decided: a committed
    token leaves the tree, or the path reached a leaf. Undecided: the target has not
    written that far yet."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    inner = set(parents)  # the nodes with a child
    node = -1
    for depth, token in enumerate(committed):
        node = children.get((node, token), -2)
        if node == -2:
            return depth, True
        if node not in inner:
            return depth + 1, True
    return len(committed), not tokens
