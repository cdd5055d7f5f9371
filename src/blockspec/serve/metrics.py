"""The server's Prometheus metrics (GET /metrics), named like the serving engines' speculative metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("blockspec_requests", "Requests served (finished, any outcome)", ["route"], registry=r)
        self.errors = Counter("blockspec_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("blockspec_generation_tokens", "Tokens generated", registry=r)
        self.drafts = Counter("blockspec_spec_decode_num_drafts", "Verify steps that checked a draft", registry=r)
        self.draft_tokens = Counter("blockspec_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("blockspec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("blockspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.tpot = Histogram("blockspec_time_per_output_token_seconds", "Decode time per output token",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
                              registry=r)

    def count_error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def record(self, result) -> None:
        """A request's finished choice (a GenerationResult)."""
        stats = result.stats
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        proposed = sum(stats.proposed_by_pos)
        if proposed:
            self.drafts.inc(stats.proposed_by_pos[0])  # steps that proposed at least one draft token
            self.draft_tokens.inc(proposed)
            self.accepted_tokens.inc(sum(stats.accepted_by_pos))
            for position, accepted in enumerate(stats.accepted_by_pos, 1):
                self.accepted_per_pos.labels(position=str(position)).inc(accepted)
        if len(result.token_ids) > 1:
            self.tpot.observe(stats.decode_s / (len(result.token_ids) - 1))

    def exposition(self) -> str:
        """Every metric, in Prometheus' text format."""
        return generate_latest(self.registry).decode()
