"""P-EAGLE's loss weighting over depths, decided by served acceptance (issue #15, item 7).

Usage: .venv/bin/python bench/peagle_weighting.py [--budget 100000] [--prompts 64] [--max-tokens 128]
Trains the P-EAGLE recipe of configs/smollm2-peagle.yaml (2 layers, 8 depths, COD 0.7 / 0.2, lr 2e-3, 8 warm-up
steps) twice on the same anchor dataset as bench/levers.py (the first anchor conversations for the budget,
2048-token rows, draft vocab 32000, built once by data/build.py), for the same steps, with
peagle.loss_weighting=elements (each scored element weighs the same: depth d weighs by its COD count) and
=depths (each depth's mean weighs the same); then serves the target alone and both drafters at K=4 with parallel
drafting on the same HumanEval prompts (another task family) through the same vLLM, and prints the held-out
per-depth accuracy and the served acceptance of both.
"""
import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import speculators_side
import vs_speculators

from draftsmith.data.run_paths import RunPaths

SERVE_K = 4
PEAGLE = ["drafter.num_layers=2", "peagle.num_depths=8", "peagle.down_sample_ratio=0.7",
          "peagle.down_sample_ratio_min=0.2", "peagle.max_anchors=1024", "peagle.partition_elements=8192",
          f"export.num_speculative_tokens=[{SERVE_K}]"]


def train_and_export(out: Path, conversations: Path, steps: int, seed: int, weighting: str) -> dict:
    run = vs_speculators.fresh_dir(out / "peagle-weighting" / weighting)
    overrides = vs_speculators.draftsmith_overrides(run, conversations, steps) + [
        f"data.dataset_dir={RunPaths.at(out).dataset.dir}", f"train.seed={seed}", *PEAGLE,
        f"peagle.loss_weighting={weighting}"]
    seconds = vs_speculators.run_stage("train/peagle.py", overrides, run.with_suffix(".log"))
    paths = RunPaths.at(run)
    vs_speculators.run_stage("export/speculators.py", overrides, run.with_suffix(".export.log"),
                             ["--out", str(paths.drafter)])
    rate = vs_speculators.training_rate(paths.metrics)
    return {"weighting": weighting, "seconds": seconds, "tokens_per_s": rate["tokens_per_s"],
            "eval": json.loads(paths.eval_heldout.read_text()), "drafter_dir": str(paths.drafter)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=100_000, help="trained tokens per option (the demo's 100 x 1024)")
    p.add_argument("--dataset-budget", type=int, default=120_000,
                   help="conversations taken as for this budget (bench/levers.py's default: its dataset is reused)")
    p.add_argument("--prompts", type=int, default=64, help="served HumanEval prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from draftsmith.data.target import resolve_target_path

    t0 = time.time()
    target = str(resolve_target_path("smollm2"))
    rows = speculators_side.read_anchor_conversations()
    rows = rows[: speculators_side.num_conversations_for(max(a.dataset_budget, a.budget), rows)]
    out = vs_speculators.work_dir() / f"draftsmith-first{len(rows)}"
    conversations = vs_speculators.anchor_jsonl(rows, out / "conversations.jsonl")
    if not RunPaths.at(out).dataset.manifest.is_file():
        vs_speculators.run_stage("data/build.py", vs_speculators.draftsmith_overrides(out, conversations, 1),
                                 out / "build.log")
    steps, tokens = vs_speculators.steps_for_budget(RunPaths.at(out).dataset.dir, a.budget, a.seed)
    print(f"$ .venv/bin/python bench/peagle_weighting.py --budget {a.budget} --dataset-budget {a.dataset_budget} --prompts {a.prompts} --max-tokens "
          f"{a.max_tokens}; {len(rows)} anchor conversations, {steps} steps = {tokens} trained tokens per option, "
          f"seed {a.seed}; served at K={SERVE_K}", flush=True)
    trained = {w: train_and_export(out, conversations, steps, a.seed, w) for w in ("elements", "depths")}
    for w, r in trained.items():
        acc = " ".join(f"{x:.3f}" for x in r["eval"]["per_step_accuracy"])
        print(f"  {w:9} trained {r['seconds']:.0f} s ({r['tokens_per_s']:.0f} tok/s); held-out per-depth acc {acc}; "
              f"sim AL K={SERVE_K} {r['eval']['simulated_acceptance_length'][str(SERVE_K)]:.3f}", flush=True)
    served = vs_speculators.serve_side_by_side(
        target, {w: Path(r["drafter_dir"]) for w, r in trained.items()},
        vs_speculators.human_eval_prompts(vs_speculators.work_dir()), a.prompts, a.max_tokens,
        vs_speculators.work_dir() / "serve-logs-peagle", k=SERVE_K, parallel_drafting=True)
    print(f"served: {served['num_prompts']} HumanEval prompts x {served['max_tokens']} tokens, greedy, fp32, K={SERVE_K}"
          f" parallel drafting; target alone {served['none']['output_tokens_per_s']:.1f} output tokens/s")
    for w in trained:
        s = served[w]
        rates = " / ".join(f"{x:.3f}" for x in s["per_position"])
        print(f"  {w:9} served AL {s['acceptance_length']:.3f} (per position {rates}); "
              f"{s['output_tokens_per_s']:.1f} output tokens/s; lossless {s['lossless']}")
    ratio = served["depths"]["acceptance_length"] / served["elements"]["acceptance_length"]
    print(f"RATIO: served AL depths / elements {ratio:.3f}x; wall {(time.time() - t0) / 60:.0f} min")
    (vs_speculators.work_dir() / "report-peagle-weighting.json").write_text(
        json.dumps({"trained": trained, "served": served}, indent=1, default=str))


if __name__ == "__main__":
    main()
