"""vLLM's spec-decode counters on its Prometheus /metrics page (names from vllm/v1/spec_decode/metrics.py),
read with prometheus_client's own text parser."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Prometheus counter -> SpecCounters field; samples are summed over the `engine` and `model_name` labels
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        after_pos = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        before_pos = before.accepted_per_pos + (0.0,) * (n - len(before.accepted_per_pos))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in zip(after_pos, before_pos)))


def parse_spec_counters(metrics_text: str) -> SpecCounters:
    """The spec-decode counters of a /metrics page, summed over engines; all zero when not speculating."""
    totals = {field: 0.0 for field in SPEC_COUNTERS.values()}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in SPEC_COUNTERS:
                totals[SPEC_COUNTERS[sample.name]] += sample.value
            elif sample.name == PER_POS_COUNTER:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    ordered = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(accepted_per_pos=ordered, **totals)
