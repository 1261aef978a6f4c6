"""Acceptance and step-cost arithmetic over spec-decode counters and served outputs (DESIGN section 7)."""
from __future__ import annotations

from draftsmith.export.spec_metrics import SpecCounters


def acceptance_rates(delta: SpecCounters) -> list[float]:
    """Per-position rate: the share of drafts whose position i (and so every earlier one) was accepted."""
    if delta.drafts <= 0:
        return [0.0] * len(delta.accepted_per_pos)
    return [a / delta.drafts for a in delta.accepted_per_pos]


def acceptance_length(delta: SpecCounters) -> float:
    """Mean tokens emitted per draft round, the bonus token included: 1 + accepted / drafts."""
    return 1.0 + (delta.accepted / delta.drafts if delta.drafts > 0 else 0.0)


def token_acceptance_rate(delta: SpecCounters) -> float | None:
    """TAR: accepted / proposed draft tokens; None when nothing was proposed (no speculation)."""
    return delta.accepted / delta.draft_tokens if delta.draft_tokens > 0 else None


def acceptance_length_by_k(rates: list[float]) -> dict[int, float]:
    """AL(K') = 1 + sum of the first K' rates: greedy drafts at position i do not depend on K."""
    out, total = {}, 1.0
    for k, rate in enumerate(rates, 1):
        total += rate
        out[k] = total
    return out


def tokens_per_target_step(output_tokens: int, accepted: float) -> float:
    """Output tokens per target forward: each step emits one token plus the accepted drafts."""
    steps = output_tokens - accepted
    return output_tokens / steps if steps > 0 else 0.0


def fit_step_cost(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of step time = c0 + K * c_draft over measured (K, step time) points; c_draft >= 0."""
    n = len(points)
    mean_k = sum(k for k, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var_k = sum((k - mean_k) ** 2 for k, _ in points)
    slope = sum((k - mean_k) * (t - mean_t) for k, t in points) / var_k if var_k > 0 else 0.0
    slope = max(slope, 0.0)
    return mean_t - slope * mean_k, slope


def recommend_k(rates: list[float], c0: float, c_draft: float) -> tuple[int, dict[int, float]]:
    """K' in 0..K maximising expected tokens per unit time AL(K') / (c0 + K' c_draft); K' = 0 means no drafting."""
    al = {0: 1.0, **acceptance_length_by_k(rates)}
    rate = {k: al[k] / (c0 + k * c_draft) for k in al}
    return max(rate, key=lambda k: (rate[k], -k)), rate


def first_mismatch(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int] | None:
    """(prompt index, token position) of the first output token that differs from the reference, or None."""
    for i, (ref, out) in enumerate(zip(reference, other)):
        if ref != out:
            pos = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            return i, pos
    return None
