"""How many tokens each row of a batch drafts this step: the count that maximises expected
goodput (committed tokens per second), as in SmartSpec (Liu et al., 2024, "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput").

Goodput of a plan = (rows + expected accepted drafts) / (verify seconds + drafting seconds).
- Expected accepted drafts of a row drafting k tokens: sum over i <= k of P(drafts 1..i all
  accepted), from per-position acceptance rates: the row's recent evidence, aged every
  step, over a prior, the pooled rates of every row; times the share of the source's recent
  drafting steps that reached the verify at all (a tree cut to no node after the drafter ran
  is a drafting pass that paid for a plain step). Such a tree, as the plan sized it, is still
  scored against the tokens the target then writes (the engine's `Row.decided_withdrawn`), so
  a source whose trees keep being cut learns its rates as if they had been verified.
- Verify seconds: measured per verify size (query tokens over the batch, padding included:
  it is computed too), by power-of-two bucket. A verify pass costs about the same for 1 to
  8 tokens on a CPU and grows beyond, so the size of the pass, not the batch, is the key.
- Drafting seconds: measured per step by drafted positions (rows x (1 + drafts)), bucketed
  alike: a drafter that drafts every row in one pass costs about the same for 1 or 4 rows.

Token trees (the idea of CaDDTree, arXiv 2606.01813): after the drafter ran, one node count for
every row's tree, the one that maximises the same goodput; a tree's first n nodes are
expected to get sum(reach probability) of them accepted, scaled by how the row's trees'
predictions compared with what the target then accepted (the drafter's marginals are not
calibrated). The drafting is spent by then, so only verify costs weigh.

Everything is measured on this machine while serving; an estimate not refreshed for
`stale_after` steps is re-measured. A cost not measured yet is taken optimistically
(the highest measured cost of a smaller size, else 0): so each size is tried, once, when
it could win. No drafting (a plain step) is one of the candidates, so under load, when
drafting no longer pays, the plan is plain batched decoding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class AcceptanceEvidence:
    """Decayed counts, per draft position (1-based position i at index i - 1), of the times
    it was reached (trials) and accepted (hits): a drafter is surer near the anchor, so the
    rate is kept per position, not one geometric rate."""

    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    # trees: decayed accepted drafts and what the trees' scores predicted (a prior of one each)
    tree_accepted: float = 1.0
    tree_predicted: float = 1.0
    tree_width: float = 0.0  # nodes of this source's recent trees (decayed mean; 0: no tree yet)
    steps_since_tree: int = 0  # steps aged since its last tree
    # decayed steps this source drafted, and how many of them left nothing to verify (a tree cut to
    # no node once the drafter ran: its drafting paid for a plain step)
    drafted_steps: float = 0.0
    wasted_steps: float = 0.0
    source: str = "model"  # the drafter's source it is about (`Drafter.next_sources`)

    def observe(self, drafted: int, accepted: int, decay: float = 1.0) -> None:
        """Positions 1..accepted were accepted; position accepted + 1, if drafted, was
        reached and rejected; later ones were never reached."""
        reached = min(accepted + 1, drafted)
        if len(self.hits) < reached:
            self.hits += [0.0] * (reached - len(self.hits))
            self.trials += [0.0] * (reached - len(self.trials))
        for i in range(len(self.hits)):
            self.hits[i] = decay * self.hits[i] + (i < accepted)
            self.trials[i] = decay * self.trials[i] + (i < reached)

    def age(self, decay: float) -> None:
        self.hits = [decay * h for h in self.hits]
        self.trials = [decay * t for t in self.trials]
        self.drafted_steps *= decay
        self.wasted_steps *= decay
        self.steps_since_tree += 1

    @property
    def wasted_rate(self) -> float:
        """P(a step this source drafts ends with nothing verified), over a prior of one step
        that was not wasted: as the evidence fades the source is tried again."""
        return self.wasted_steps / (self.drafted_steps + 1.0)

    def recent_tree_width(self, decay: float) -> float:
        """Nodes its trees are expected to have: the recent trees' width, fading (by `decay`
        per step) the longer the source has not drafted, so that a source costed out by one
        early wide tree is costed as a chain again and re-probed: its tree is sized after
        drafting, to what pays then, and may well be narrow. (Every step ages every source
        before the drafting one observes its tree: that step does not count.)"""
        return self.tree_width * decay ** max(self.steps_since_tree - 1, 0)

    @property
    def tree_calibration(self) -> float:
        """Accepted drafts per predicted one, in this row's recent trees."""
        return self.tree_accepted / self.tree_predicted


class CostTable:
    """Seconds as a function of a size (query tokens of a verify pass, drafted positions): an
    exponential moving average per power-of-two bucket of sizes, with optimistic guesses for
    buckets not measured recently, so that they get tried. (Reading a size between buckets
    along a line instead was measured in session 25 and did not pay: scripts/planner_replay.py
    `:line-costs`.)"""

    def __init__(self, decay: float, stale_after: int):
        self.decay, self.stale_after = decay, stale_after
        self.seconds: dict[int, float] = {}  # per bucket
        self.measured_at: dict[int, int] = {}

    def record(self, size: int, seconds: float, now: int) -> None:
        bucket = size_bucket(size)
        fresh = bucket in self.seconds and now - self.measured_at[bucket] <= self.stale_after
        self.seconds[bucket] = self.decay * self.seconds[bucket] + (1 - self.decay) * seconds if fresh else seconds
        self.measured_at[bucket] = now

    def fresh(self, now: int) -> dict[int, float]:
        """Seconds per bucket measured in the last `stale_after` steps."""
        return {k: s for k, s in self.seconds.items() if now - self.measured_at[k] <= self.stale_after}

    def estimates(self, now: int) -> Callable[[int], float]:
        """size -> its bucket's measured seconds, or, not measured recently, a lower bound
        (costs grow with the size): the highest cost measured for a smaller bucket, else 0."""
        fresh = self.fresh(now)

        def estimate(size: int) -> float:
            bucket = size_bucket(size)
            if bucket in fresh:
                return fresh[bucket]
            return max((s for k, s in fresh.items() if k < bucket), default=0.0)

        return estimate


def _goodput(tokens: float, seconds: float) -> float:
    return tokens / max(seconds, 1e-9)  # a cost not measured yet may be 0: it then wins, and gets measured


def size_bucket(tokens: int) -> int:
    return 1 << max(tokens - 1, 0).bit_length()


class DraftPlanner:
    def __init__(self, max_drafts: int, decay: float = 0.8, pooled_decay: float = 0.98, stale_after: int = 256):
        self.max_drafts = max_drafts
        self.decay, self.pooled_decay = decay, pooled_decay
        self.verify = CostTable(decay, stale_after)  # size: query tokens of the verify pass
        self.stale_after = stale_after
        # per drafter source, size: drafted positions
        self.drafting: dict[str, CostTable] = {}
        # every row's evidence per drafter source, decayed more slowly: the prior of each row
        self.pooled: dict[str, AcceptanceEvidence] = {}
        self.now = 0

    # --- acceptance -------------------------------------------------------------------------
    def drafting_for(self, source: str) -> CostTable:
        if source not in self.drafting:
            self.drafting[source] = CostTable(self.decay, self.stale_after)
        return self.drafting[source]

    def pooled_for(self, source: str) -> AcceptanceEvidence:
        if source not in self.pooled:
            self.pooled[source] = AcceptanceEvidence(source=source)
        return self.pooled[source]

    def acceptance_rates(self, evidence: AcceptanceEvidence, drafts: int) -> list[float]:
        """P(position i accepted | position i reached), i = 1..drafts: the row's evidence over a
        prior, the pooled rate of that position over every row with the same source (weighing
        as one trial; before any evidence, Laplace's rule: 1/2)."""
        rates, pooled = [], self.pooled_for(evidence.source)
        for i in range(drafts):
            pooled_hits = pooled.hits[i] if i < len(pooled.hits) else 0.0
            pooled_trials = pooled.trials[i] if i < len(pooled.trials) else 0.0
            prior = (pooled_hits + 1.0) / (pooled_trials + 2.0)
            hits = evidence.hits[i] if i < len(evidence.hits) else 0.0
            trials = evidence.trials[i] if i < len(evidence.trials) else 0.0
            rates.append((hits + prior) / (trials + 1.0))
        return rates

    def expected_accepted(self, evidence: AcceptanceEvidence, drafts: int) -> list[float]:
        """E[accepted drafts] when drafting 1, 2, .., `drafts` tokens: the sum over i <= k of
        P(positions 1..i all accepted)."""
        expected, reach, total = [], 1.0, 0.0
        for rate in self.acceptance_rates(evidence, drafts):
            reach *= rate
            total += reach
            expected.append(total)
        return expected

    def observe(self, evidence: AcceptanceEvidence, drafted: int, accepted: int, predicted: float | None = None,
                nodes: int | None = None) -> None:
        """A step drafted `drafted` positions (a tree: its depth) and `accepted` were kept;
        a tree's `predicted`: what its scores expected, `nodes`: its size."""
        evidence.observe(drafted, accepted)
        self.pooled_for(evidence.source).observe(drafted, accepted, self.pooled_decay)
        if predicted is not None:
            evidence.tree_accepted = self.decay * evidence.tree_accepted + accepted
            evidence.tree_predicted = self.decay * evidence.tree_predicted + predicted
        if nodes is not None:
            fresh = evidence.tree_width == 0.0
            evidence.tree_width = nodes if fresh else self.decay * evidence.recent_tree_width(self.decay) + (
                1 - self.decay) * nodes
            evidence.steps_since_tree = 0

    def observe_drafting(self, evidence: AcceptanceEvidence, wasted: bool) -> None:
        """The source of `evidence` drafted this step; `wasted`: nothing of it was verified (its
        tree was cut to no node: the tree's own scores said no size pays)."""
        evidence.drafted_steps += 1.0
        evidence.wasted_steps += float(wasted)

    def tree_gains(self, evidence: AcceptanceEvidence, tree) -> list[float]:
        """E[accepted drafts] of the tree's first n nodes, n = 1..len, calibrated for the row."""
        calibration = evidence.tree_calibration
        return [calibration * expected for expected in tree.expected_accepted()]

    def tree_size(self, batch: int, gains: list[list[float]]) -> int:
        """Nodes per tree this step (every tree cut to its first n; 0: a plain step) for a batch
        of `batch` rows whose trees gain `gains[i][n - 1]` with n nodes. The pass is as wide as
        its widest row, so one count serves all."""
        most = max((len(row) for row in gains), default=0)
        if most == 0:
            return 0
        verify = self.verify.estimates(self.now)
        best_size, best_goodput = 0, _goodput(batch, verify(batch))
        for size in range(1, most + 1):
            tokens = batch + sum(row[min(size, len(row)) - 1] for row in gains if row)
            goodput = _goodput(tokens, verify(batch * (1 + size)))
            if goodput > best_goodput:
                best_size, best_goodput = size, goodput
        return best_size

    def age(self, evidence: AcceptanceEvidence) -> None:
        """Once per step for every row: old evidence fades, so a row that stopped drafting
        drifts back to the pooled rates (and a tree source to a chain's width) and is probed
        again."""
        evidence.age(self.decay)

    # --- the plan ---------------------------------------------------------------------------
    def plan(self, rows: list[tuple[AcceptanceEvidence, int] | None]) -> list[int]:
        """Drafts per row, for rows with one source each. `rows`: (evidence, most drafts
        allowed) of each row that can draft, None for a row that cannot (no drafter)."""
        return self.plan_sources([None if row is None else {row[0].source: row} for row in rows])[1]

    def plan_sources(self, rows: list[dict[str, tuple[AcceptanceEvidence, int]] | None]
                     ) -> tuple[list[str | None], list[int]]:
        """The source and the draft count of every row. `rows`: per row, the sources that
        could draft it this step (`Drafter.next_sources`, in the drafter's order of
        preference), each with the row's evidence on it and the most drafts it may propose;
        None for a row that cannot draft. Each row drafts with the source of the best
        goodput on its own (ties: the drafter's order), counting that source's drafting
        time (prompt lookup's is ~0, as measured) and its verify width: a chain's drafts,
        or, for a source verified as token trees, its recent trees' node count (a tree is
        sized only after the drafter ran, so its recent trees stand for it here; fading
        while it does not draft). Then, at
        each draft count, the rows that gain most draft first, and a row joins only while
        it brings more than it costs."""
        self.now += 1
        batch = len(rows)
        sources: list[str | None] = [None] * batch
        offers = {i: {source: offer for source, offer in row.items() if offer[1] > 0}
                  for i, row in enumerate(rows) if row is not None}
        offers = {i: offer for i, offer in offers.items() if offer}
        if not offers or self.max_drafts < 1:
            return sources, [0] * batch
        if not self.verify.fresh(self.now):  # nothing measured yet: draft in full, each row's first source
            counts = [0] * batch
            for i, offer in offers.items():
                sources[i], (_, allowed) = next(iter(offer.items()))
                counts[i] = min(self.max_drafts, allowed)
            return sources, counts
        verify = self.verify.estimates(self.now)
        drafting = {source: self.drafting_for(source).estimates(self.now)
                    for offer in offers.values() for source in offer}

        def width(evidence: AcceptanceEvidence, drafts: int) -> int:
            """Tokens per row in the verify pass: anchor + drafts, or the source's recent trees."""
            return max(1 + drafts, round(1 + evidence.recent_tree_width(self.decay)))

        def alone(source: str, evidence: AcceptanceEvidence, gains: list[float]) -> float:
            return max(_goodput(batch + gain, verify(batch * width(evidence, k + 1))
                                + drafting[source](2 + k)) for k, gain in enumerate(gains))

        # one source per row: the best alone (ties: the drafter's order), with its E[accepted]
        # for every draft count, computed once: chosen_by_row[i] = (source, evidence, allowed, gains)
        chosen_by_row = {}
        for i, offer in offers.items():
            scored = []
            for order, (source, (evidence, allowed)) in enumerate(offer.items()):
                # a step whose drafts are thrown away before the verify (a tree cut to nothing)
                # gains nothing: expect the gains of the steps that keep theirs
                kept = 1.0 - evidence.wasted_rate
                gains = [kept * gain for gain in self.expected_accepted(evidence, min(self.max_drafts, allowed))]
                scored.append((alone(source, evidence, gains), -order, (source, evidence, allowed, gains)))
            chosen_by_row[i] = max(scored, key=lambda entry: entry[:2])[2]
        most = min(self.max_drafts, max(allowed for _, _, allowed, _ in chosen_by_row.values()))
        best_plan, best_goodput = (sources, [0] * batch), _goodput(batch, verify(batch))
        for drafts in range(1, most + 1):
            ranked = sorted(((gains[min(drafts, len(gains)) - 1], i) for i, (_, _, _, gains) in chosen_by_row.items()),
                            reverse=True)
            # the rows that gain most draft first; stop adding rows once one costs more than it brings
            tokens, goodput, chosen, by_source, pass_width = float(batch), 0.0, [], {}, 1
            for gain, i in ranked:
                source, evidence, _, _ = chosen_by_row[i]
                rows_of = {**by_source, source: by_source.get(source, 0) + 1}
                row_width = max(pass_width, width(evidence, drafts))
                seconds = verify(batch * row_width) + sum(
                    drafting[s](n * (1 + drafts)) for s, n in rows_of.items())
                if chosen and _goodput(tokens + gain, seconds) <= goodput:
                    break
                tokens, goodput, by_source, pass_width = tokens + gain, _goodput(tokens + gain, seconds), rows_of, row_width
                chosen.append(i)
            if goodput > best_goodput:
                best_goodput = goodput
                best_plan = ([None] * batch, [0] * batch)
                for i in chosen:
                    source, _, allowed, _ = chosen_by_row[i]
                    best_plan[0][i], best_plan[1][i] = source, min(drafts, allowed)
        return best_plan

    def record(self, query_tokens: int, verify_seconds: float, drafted_positions: int,
               drafting_seconds: float, source: str | None = "model") -> None:
        """What one step cost: its verify pass over `query_tokens` (padding included) and the
        drafting of `drafted_positions` (drafting rows x (1 + drafts), padding included) by
        `source` (None: rows drafted with different sources, whose shares are not known)."""
        self.verify.record(query_tokens, verify_seconds, self.now)
        if drafted_positions and source is not None:
            self.drafting_for(source).record(drafted_positions, drafting_seconds, self.now)
