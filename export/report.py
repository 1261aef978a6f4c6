"""validation.json -> the readable report: validation.md (tables, the verdict), the per-position acceptance plot,
the TPOT-vs-concurrency plot, the summary and verdict lines."""
from __future__ import annotations

import io
from pathlib import Path

from draftsmith.data.manifest import atomic_write_bytes
from draftsmith.export.verdict import verdict_line


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _methods_table(r: dict) -> list[str]:
    rows = [("none", 0, 1.0, 1.0, r["output_tokens_per_s"]["without_drafter"], r["step_time_ms"]["none"], "reference")]
    entries = r["entries"] or [{
        "num_speculative_tokens": r["num_speculative_tokens"], "acceptance_length": r["acceptance_length"],
        "tokens_per_target_step": r["tokens_per_target_step"]["drafter"], "step_time_ms": r["step_time_ms"]["drafter"],
        "output_tokens_per_s": r["output_tokens_per_s"]["with_drafter"],
        "lossless": r["lossless_by_method"]["drafter"]}]
    named = [(r["method"], e) for e in entries] + ([("ngram", r["ngram"])] if r["ngram"] else [])
    if r.get("compare"):
        named += [(f"{r['compare']['method']} (--compare)", e) for e in r["compare"]["entries"]]
    rows += [(name, e["num_speculative_tokens"], e["acceptance_length"], e["tokens_per_target_step"],
              e["output_tokens_per_s"], e["step_time_ms"], e["lossless"]) for name, e in named]
    return ["| method | K | acceptance length | tokens / target step | output tokens/s | step ms | lossless |",
            "|---|---|---|---|---|---|---|"] + [
        f"| {m} | {k} | {_fmt(al)} | {_fmt(tps)} | {_fmt(tok, '.1f')} | {_fmt(ms, '.1f')} | {ok} |"
        for m, k, al, tps, tok, ms, ok in rows]


def _positions_table(r: dict) -> list[str]:
    k = r["num_speculative_tokens"]
    series = [(r["method"], r["acceptance_rate_per_position"])]
    series += [("ngram", r["ngram"]["acceptance_rate_per_position"])] if r["ngram"] else []
    if r.get("compare"):  # its largest K, the same K as the others
        top = r["compare"]["entries"][-1]
        series.append((f"{r['compare']['method']} (--compare)", top["acceptance_rate_per_position"]))
    return ["| position | " + " | ".join(map(str, range(k))) + " |", "|---" * (k + 1) + "|"] + [
        f"| {name} | " + " | ".join(_fmt(x) for x in rates) + " |" for name, rates in series]


def _sweep_table(r: dict) -> list[str]:
    """Like beside like: TPOT and tokens per target step for every method; per-draft AL in its own column."""
    rows = sorted(r["sweep"]["cells"], key=lambda c: (c["concurrency"], c["role"] != "none", c["role"],
                                                       c["num_speculative_tokens"]))
    out = [("| concurrency | method | K | TPOT mean ms | p50 | p90 | output tok/s | tokens / target step | TAR | "
            "AL per draft |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        t = c["tpot_ms"]
        out.append(f"| {c['concurrency']} | {c['method']} | {c['num_speculative_tokens']} | {_fmt(t['mean'], '.1f')} | "
                   f"{_fmt(t['p50'], '.1f')} | {_fmt(t['p90'], '.1f')} | {_fmt(c['output_tokens_per_s'], '.1f')} | "
                   f"{_fmt(c['tokens_per_target_step'])} | {_fmt(c['token_acceptance_rate'])} | "
                   f"{_fmt(c['acceptance_length'])} |")
    return out


def verdict_table(decision: dict, method: str) -> list[str]:
    out = [f"| concurrency | best K | TPOT without ms | TPOT with ms | TPOT gain | TAR | use {method} |",
           "|---|---|---|---|---|---|---|"]
    for v in decision["by_concurrency"]:
        tar = _fmt(v["token_acceptance_rate"]) + (" (low)" if v["tar_warning"] else "")
        out.append(f"| {v['concurrency']} | {v['best_k']} | {_fmt(v['tpot_ms_without'], '.1f')} | "
                   f"{_fmt(v['tpot_ms_with'], '.1f')} | {100 * v['tpot_gain']:+.0f}% | {tar} | "
                   f"{'yes' if v['use'] else 'no (within drift)' if v.get('within_drift') else 'no'} |")
    if decision.get("baseline_drift"):
        drift = ", ".join(f"{c}: {100 * d:.0f}%" for c, d in decision["baseline_drift"].items())
        out += ["", (f"TPOT without = the mean of the target alone served before and after the other servers; they "
                     f"differed by {drift} (by concurrency).")]
        if decision["drift_warning"]:
            out += ["", ("**Warning: the machine's speed drifted during the run** by as much as the gain asked for: "
                         "rerun on a quiet machine before trusting the verdict.")]
    sat = decision["saturation_concurrency"]
    out += ["", (f"Saturation point: {sat if sat is not None else 'not reached'} (the lowest concurrency where no K "
                 f"cuts TPOT by {100 * decision['min_tpot_gain']:.0f}%, or by the drift where that is larger). "
                 f"Routing rule: {decision['routing_rule']}.")]
    if any(v["tar_warning"] for v in decision["by_concurrency"]):
        out += ["", (f"**Warning: token acceptance rate under {decision['min_token_acceptance_rate']:.0%}**: most "
                     "proposals are rejected; the verify compute they cost is wasted.")]
    return out


def _lossless_lines(r: dict) -> list[str]:
    counts = r.get("lossless_checks") or {}
    if not counts:
        return []
    rule = ("token identity (fp32)" if r.get("dtype") == "float32" else
            f"{r.get('dtype')}: each first divergence re-scored by the target alone in fp32; a near-tie has both "
            f"tokens within the bound of its top logit")
    out = [f"Lossless check, {rule}:", "", "| run | identical | near-ties | real disagreements |", "|---|---|---|---|"]
    out += [f"| {label} | {c['identical']} | {c['near_ties']} | {c['real']} |" for label, c in counts.items()]
    return out


def _compare_lines(r: dict) -> list[str]:
    cmp = r["compare"]
    out = [f"## {r['method']} vs {cmp['method']} (`{cmp['drafter_dir']}`)", "",
           f"| concurrency | K | {r['method']} TPOT ms | {cmp['method']} TPOT ms | faster |", "|---|---|---|---|---|"]
    for h in cmp["head_to_head"]:
        winner = r["method"] if h["winner"] == "drafter" else cmp["method"]
        out.append(f"| {h['concurrency']} | {h['num_speculative_tokens']} | {_fmt(h['tpot_ms_drafter'], '.1f')} | "
                   f"{_fmt(h['tpot_ms_compare'], '.1f')} | {winner} |")
    if cmp["verdict"]:
        out += ["", f"Verdict for {cmp['method']}:", "", *verdict_table(cmp["verdict"], cmp["method"])]
    return out


def render_markdown(r: dict) -> str:
    cm, best = r["cost_model"], r["recommended_k"]
    by_k = ", ".join(f"K={k}: {_fmt(v)}" for k, v in r["acceptance_length_by_k"].items())
    lines = [f"# Validation of `{r['drafter_dir']}`", "",
             (f"Target `{r['target']}` in {r.get('dtype', '?')}; {r['num_prompts']} prompts, greedy, max_tokens "
              f"{r['max_tokens']}, greedy pass at concurrency {r['concurrency']}; vLLM {r['versions']['vllm']}."),
             ""]
    if r.get("verdict"):
        lines += ["## Verdict", "", f"`{verdict_line(r['verdict'], r['method'])}`", "",
                  *verdict_table(r["verdict"], r["method"]), "", "![TPOT vs concurrency](validation-tpot.png)", "",
                  "## Sweep", "", *_sweep_table(r), ""]
    lines += ["## Greedy pass", "", *_methods_table(r), "",
              f"Per-position acceptance at K={r['num_speculative_tokens']}:", "", *_positions_table(r), "",
              f"Acceptance length predicted from those rates: {by_k}.", "",
              (f"Step-cost model of the greedy pass: {_fmt(cm['c0_ms'])} ms + K x {_fmt(cm['c_draft_ms'])} ms per "
               f"target step; best K by it: {best} (K=0: no drafter), expected speed-up "
               f"{_fmt(cm['expected_speedup_by_k'][str(best)])}x."), ""]
    lines += _lossless_lines(r)
    mismatch = r["train_serve_mismatch"]
    if mismatch["checked"]:
        figures = (f"the trainer simulated acceptance length {_fmt(mismatch['train_simulated_acceptance_length'])} "
                   f"at K={mismatch.get('k')} on these prompts, vLLM served {_fmt(mismatch['served_acceptance_length'])} "
                   f"({100 * mismatch['relative_difference']:.0f}% apart, tolerance "
                   f"{100 * mismatch['tolerance']:.0f}%)")
        lines += ["", f"**Warning: train/serve mismatch**: {figures}." if mismatch["mismatch"]
                  else f"Train/serve check: {figures}."]
    else:
        lines += ["", f"Train/serve check not run: {mismatch['reason']}."]
    if not r["lossless"]:
        lines += ["", ("**Validation failed: outputs really differ from the target alone** (divergences in "
                       "validation.json).")]
    if r.get("compare"):
        lines += ["", *_compare_lines(r)]
    return "\n".join(lines) + "\n"


def plot_tpot(r: dict, path: Path) -> None:
    """Mean TPOT against concurrency: the target alone, the drafter at each K, n-gram (and the --compare one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for c in r["sweep"]["cells"]:
        name = c["method"] if c["role"] in ("none", "none-again") else f"{c['method']} K={c['num_speculative_tokens']}"
        name += " (--compare)" if c["role"] == "compare" else ""  # two drafters of one method stay apart
        series.setdefault(name, []).append((c["concurrency"], c["tpot_ms"]["mean"]))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, points in sorted(series.items(), key=lambda kv: (not kv[0].startswith("none"), kv[0])):
        xs, ys = zip(*sorted(points))
        reference = name.startswith("none")
        ax.plot(xs, ys, marker="o", linewidth=2.5 if reference else 1.2, label=name,
                color=("black" if name == "none" else "grey") if reference else None)
    ax.set_xscale("log", base=2)
    ticks = sorted({c["concurrency"] for c in r["sweep"]["cells"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set(xlabel="concurrent requests", ylabel="mean TPOT (ms)", title="TPOT with and without speculation")
    sat = (r.get("verdict") or {}).get("saturation_concurrency")
    if sat is not None:
        ax.axvline(sat, color="grey", linestyle=":", label=f"saturation ({sat})")
    ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def plot_acceptance(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(f"{r['method']} (AL {r['acceptance_length']:.2f})", r["acceptance_rate_per_position"])]
    if r["ngram"]:
        label = (f"ngram (AL {r['ngram']['acceptance_length']:.2f} per draft, "
                 f"{r['ngram']['tokens_per_target_step']:.2f} per step)")
        series.append((label, r["ngram"]["acceptance_rate_per_position"]))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(series)
    for j, (name, rates) in enumerate(series):
        ax.bar([i + j * width for i in range(len(rates))], rates, width, label=name)
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1),
           title=f"Served per-position acceptance, K={r['num_speculative_tokens']}")
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(r["num_speculative_tokens"])],
                  range(r["num_speculative_tokens"]))
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def print_summary(r: dict, report_path: Path) -> None:
    """Lines that compare like with like: tokens per target step and output tokens/s of the drafter, n-gram and the
    target alone (n-gram's acceptance length counts only the steps where it proposed: not comparable); the verdict
    comes last."""
    tok, per_step = r["output_tokens_per_s"], r["tokens_per_target_step"]
    ngram = (f"; ngram {r['ngram']['tokens_per_target_step']:.3f} tokens/step, "
             f"{r['ngram']['output_tokens_per_s']:.1f} tok/s" if r["ngram"] else "")
    counts = r.get("lossless_checks") or {}
    near = sum(c["near_ties"] for label, c in counts.items() if not label.startswith("ngram"))
    print(f"{r['method']} K={r['num_speculative_tokens']}: {per_step['drafter']:.3f} tokens per target step "
          f"(acceptance length {r['acceptance_length']:.3f}), {tok['with_drafter']:.1f} output tokens/s{ngram}; "
          f"target alone {tok['without_drafter']:.1f} tok/s; lossless {r['lossless']}"
          + (f" ({near} near-tie(s) in {r.get('dtype')})" if near else "")
          + ("; TRAIN/SERVE MISMATCH" if r["train_serve_mismatch"]["mismatch"] else ""))
    print(f"report: {report_path}")
    cmp = r.get("compare")
    if cmp and cmp["head_to_head"]:
        wins = [h for h in cmp["head_to_head"] if h["winner"] == "drafter"]
        print(f"{r['method']} vs {cmp['method']}: {r['method']} faster in {len(wins)} of "
              f"{len(cmp['head_to_head'])} (concurrency, K) cells"
              + (f"; {verdict_line(cmp['verdict'], cmp['method'])}" if cmp["verdict"] else ""))
    if r.get("verdict"):
        print(verdict_line(r["verdict"], r["method"]))
