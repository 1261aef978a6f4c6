"""The operator's answer from the sweep's cells (DESIGN section 7): per concurrency the best K and its TPOT gain
over no speculation, "off" where no K gains enough, a warning where proposals are mostly rejected, the saturation
point and a routing rule. Pure arithmetic over the report's cell dicts, so tests check it by hand."""
from __future__ import annotations

MIN_TPOT_GAIN = 0.10
"""A K is worth turning on where it cuts mean TPOT by at least this share against no speculation."""
MIN_TOKEN_ACCEPTANCE_RATE = 0.30
"""Below this TAR (accepted / proposed draft tokens) the drafter mostly burns verify compute."""
MAX_BASELINE_DRIFT = 0.10
"""The target alone is served again after every other server; where its TPOT moved by more than this share, the
machine's speed drifted during the run by as much as the gain the verdict asks for: the verdict says so. At any
drift, a K is turned on only where its gain also exceeds the drift measured at that concurrency."""


def tpot_gain(tpot_ms: float, baseline_tpot_ms: float) -> float:
    """Share of the baseline's mean TPOT that speculation saves (0.2 = 20 % less time per output token)."""
    return 1.0 - tpot_ms / baseline_tpot_ms if baseline_tpot_ms > 0 else 0.0


def cells_of(cells: list[dict], role: str) -> dict[tuple[int, int], dict]:
    """{(concurrency, K): cell} of one role ('drafter', 'compare', 'ngram', 'none')."""
    return {(c["concurrency"], c["num_speculative_tokens"]): c for c in cells if c["role"] == role}


def decide(cells: list[dict], role: str = "drafter") -> dict:
    """Best K per concurrency, saturation point and routing rule for the drafter of `role`."""
    first = {c: cell["tpot_ms"]["mean"] for (c, _), cell in cells_of(cells, "none").items()}
    again = {c: cell["tpot_ms"]["mean"] for (c, _), cell in cells_of(cells, "none-again").items()}
    # the target alone is measured right after the drafters and again at the very end: their mean is the baseline,
    # their gap the machine's drift, reported (a detector, not a bracket: the drafters ran before both)
    baseline = {c: (t + again[c]) / 2 if c in again else t for c, t in first.items()}
    drift = {c: abs(t - again[c]) / baseline[c] for c, t in first.items() if c in again and baseline[c] > 0}
    mine = cells_of(cells, role)
    rows = []
    for c in sorted(baseline):
        by_k = {k: cell for (cc, k), cell in mine.items() if cc == c}
        if not by_k:
            continue
        gains = {k: tpot_gain(cell["tpot_ms"]["mean"], baseline[c]) for k, cell in by_k.items()}
        best = max(gains, key=lambda k: (gains[k], -k))
        tar = by_k[best]["token_acceptance_rate"]
        # a gain is evidence only beyond the machine's own drift at that load: where the target alone's TPOT moved
        # by 15 % between its two measurements, a 12 % gain is as likely the machine as the drafter
        needed = max(MIN_TPOT_GAIN, drift.get(c, 0.0))
        use = gains[best] >= needed - 1e-9  # exactly 10 % counts, rounding aside
        rows.append({"concurrency": c, "best_k": best, "tpot_gain": gains[best], "use": use,
                     "within_drift": not use and gains[best] >= MIN_TPOT_GAIN - 1e-9, "drift": drift.get(c),
                     "tpot_ms_without": baseline[c], "tpot_ms_with": by_k[best]["tpot_ms"]["mean"],
                     "token_acceptance_rate": tar,
                     "tar_warning": tar is not None and tar < MIN_TOKEN_ACCEPTANCE_RATE,
                     "tpot_gain_by_k": {str(k): gains[k] for k in sorted(gains)}})
    off = [r["concurrency"] for r in rows if not r["use"]]
    saturation = min(off) if off else None
    worst = max(drift.values(), default=None)
    return {"role": role, "min_tpot_gain": MIN_TPOT_GAIN, "min_token_acceptance_rate": MIN_TOKEN_ACCEPTANCE_RATE,
            "by_concurrency": rows, "saturation_concurrency": saturation,
            "routing_rule": routing_rule(rows, saturation),
            "baseline_drift": {str(c): d for c, d in sorted(drift.items())} or None,
            "drift_warning": worst is not None and worst > MAX_BASELINE_DRIFT}


def routing_rule(rows: list[dict], saturation: int | None) -> str:
    """The rule a proxy applies; vLLM 0.32 has no setting that switches speculation off by batch size (V0's
    speculative_disable_by_batch_size went with V0), so the switch lives in front of two deployments."""
    if not rows:
        return "no measurement"
    if saturation is None:
        return (f"speculate at every measured load (up to {rows[-1]['concurrency']} running requests, "
                f"K={rows[-1]['best_k']} there); saturation not reached")
    below = [r for r in rows if r["concurrency"] < saturation and r["use"]]
    if not below:
        return "do not speculate for this traffic: no K cuts TPOT by " \
               f"{100 * MIN_TPOT_GAIN:.0f}% even at {rows[0]['concurrency']} running request(s)"
    n = below[-1]["concurrency"]
    return (f"speculate while running requests <= {n} (K={below[-1]['best_k']}); above, route to a server without "
            f"--speculative-config (proxy rule on vLLM's vllm:num_requests_running)")


def head_to_head(cells: list[dict], first: str = "drafter", second: str = "compare") -> list[dict]:
    """Per (concurrency, K) served by both: which drafter has the lower mean TPOT."""
    a, b = cells_of(cells, first), cells_of(cells, second)
    out = []
    for key in sorted(set(a) & set(b)):
        ta, tb = a[key]["tpot_ms"]["mean"], b[key]["tpot_ms"]["mean"]
        out.append({"concurrency": key[0], "num_speculative_tokens": key[1], f"tpot_ms_{first}": ta,
                    f"tpot_ms_{second}": tb, "winner": first if ta <= tb else second})
    return out


def verdict_line(decision: dict, method: str) -> str:
    """The last line the validator prints: per concurrency the best K and its gain, or 'off', and the rule."""
    parts = [f"c={r['concurrency']}: {cell_phrase(r)}" for r in decision["by_concurrency"]]
    verdict = "use" if any(r["use"] for r in decision["by_concurrency"]) else "do not use for this traffic"
    line = f"verdict ({method}): {verdict}; " + "; ".join(parts) + f"; routing: {decision['routing_rule']}"
    if decision.get("drift_warning"):
        line += (f"; UNSTABLE MACHINE: the target alone's TPOT moved up to "
                 f"{100 * max(decision['baseline_drift'].values()):.0f}% during the run")
    return line


def cell_phrase(row: dict) -> str:
    """One concurrency's part of the verdict line: 'K=3 +25% TPOT' or 'off (best K=3 +4%)', and its TAR warning."""
    gain = f"K={row['best_k']} {100 * row['tpot_gain']:+.0f}%"
    if row["use"]:
        what = f"{gain} TPOT"
    elif row["within_drift"]:
        what = f"off (best {gain}, within the machine's {100 * row['drift']:.0f}% drift)"
    else:
        what = f"off (best {gain})"
    if row["tar_warning"]:
        what += f", TAR {row['token_acceptance_rate']:.2f} < {MIN_TOKEN_ACCEPTANCE_RATE:.2f}"
    return what
