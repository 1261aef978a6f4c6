"""validation.json -> the readable report: validation.md (tables), the per-position acceptance plot, the summary line."""
from __future__ import annotations

import io
from pathlib import Path

from draftsmith.data.manifest import atomic_write_bytes


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
    return ["| position | " + " | ".join(map(str, range(k))) + " |", "|---" * (k + 1) + "|"] + [
        f"| {name} | " + " | ".join(_fmt(x) for x in rates) + " |" for name, rates in series]


def render_markdown(r: dict) -> str:
    cm, best = r["cost_model"], r["recommended_k"]
    by_k = ", ".join(f"K={k}: {_fmt(v)}" for k, v in r["acceptance_length_by_k"].items())
    lines = [f"# Validation of `{r['drafter_dir']}`", "",
             (f"Target `{r['target']}`; {r['num_prompts']} prompts, greedy, max_tokens {r['max_tokens']}, "
              f"concurrency {r['concurrency']}; vLLM {r['versions']['vllm']}."), "", *_methods_table(r), "",
             f"Per-position acceptance at K={r['num_speculative_tokens']}:", "", *_positions_table(r), "",
             f"Acceptance length predicted from those rates: {by_k}.", "",
             (f"**Recommended K: {best}** (K=0: no drafter), from step time {_fmt(cm['c0_ms'])} ms + K x "
              f"{_fmt(cm['c_draft_ms'])} ms; expected speed-up {_fmt(cm['expected_speedup_by_k'][str(best)])}x.")]
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
        lines += ["", "**Warning: outputs differ from the target alone** (first_mismatch in validation.json)."]
    return "\n".join(lines) + "\n"


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
    """One line that compares like with like: tokens per target step and output tokens/s of the drafter, n-gram
    and the target alone (n-gram's acceptance length counts only the steps where it proposed: not comparable)."""
    tok, per_step = r["output_tokens_per_s"], r["tokens_per_target_step"]
    ngram = (f"; ngram {r['ngram']['tokens_per_target_step']:.3f} tokens/step, "
             f"{r['ngram']['output_tokens_per_s']:.1f} tok/s" if r["ngram"] else "")
    print(f"{r['method']} K={r['num_speculative_tokens']}: {per_step['drafter']:.3f} tokens per target step "
          f"(acceptance length {r['acceptance_length']:.3f}), {tok['with_drafter']:.1f} output tokens/s{ngram}; "
          f"target alone {tok['without_drafter']:.1f} tok/s; lossless {r['lossless']}; recommended K "
          f"{r['recommended_k']}" + ("; TRAIN/SERVE MISMATCH" if r["train_serve_mismatch"]["mismatch"] else ""))
    print(f"report: {report_path}")
