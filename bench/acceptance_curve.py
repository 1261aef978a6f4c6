"""Acceptance vs training budget on the demo's dataset: one longer run of the demo recipe, evaluated on the
held-out split as it trains (simulated acceptance length), then exported and served in vLLM at its end.

Usage: python bench/acceptance_curve.py [--config smollm2-demo] [--steps 400] [--out runs/curve]
       python bench/acceptance_curve.py --config smollm2-peagle --method peagle --steps 250 \
           --init-from runs/smollm2-demo-steps300/drafter peagle.num_depths=4

It reuses the config's dataset (run `make demo` first) and prints one table: training tokens -> per-step (or
per-depth) held-out accuracy and simulated AL at K=1..J, then the served figures of the final drafter beside
the config's own validation.json (when present), so the demo budget and a larger one compare in one place.
`--method peagle` trains with train/peagle.py; trailing key=value pairs override the config.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from draftsmith.data.config import load_config
from draftsmith.data.run_paths import RunPaths

ROOT = Path(__file__).resolve().parents[1]


def run(stage: str, config: str, overrides: list[str]) -> None:
    cmd = [sys.executable, str(ROOT / stage), "--config", config, *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def eval_history(paths: RunPaths) -> list[dict]:
    lines = paths.metrics.read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval_sim_al" in r]


def served_line(name: str, path: Path) -> str:
    if not path.is_file():
        return f"{name}: no validation.json at {path}"
    v = json.loads(path.read_text())
    by_k = " ".join(f"K{k}={al:.2f}" for k, al in v["acceptance_length_by_k"].items())
    rates = " ".join(f"{r:.2f}" for r in v["acceptance_rate_per_position"])
    return (f"{name}: served AL {by_k}; per-position {rates}; lossless {v['lossless']}; "
            f"recommended K {v['recommended_k']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm2-demo")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default=None, help="run folder (default: runs/<config>-steps<N>)")
    p.add_argument("--method", choices=["eagle3", "peagle"], default="eagle3", help="which trainer runs")
    p.add_argument("--init-from", default="", help="exported drafter folder to start from (train.init_from)")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides, e.g. peagle.num_depths=4")
    args = p.parse_args()
    cfg, _ = load_config(args.config, args.overrides)  # the overrides may move the dataset too
    demo_dir, dataset = ROOT / cfg.paths.run, ROOT / cfg.paths.dataset.dir
    out = Path(args.out) if args.out else ROOT / "runs" / f"{args.config}-steps{args.steps}"
    if not (ROOT / cfg.paths.dataset.manifest).is_file():
        sys.exit(f"error: {dataset} is not built; run `make demo` first")
    overrides = [f"output_dir={out}", f"data.dataset_dir={dataset}", f"train.max_steps={args.steps}",
                 f"train.eval_every={max(args.steps // 8, 1)}", f"train.save_every={args.steps}",
                 f"train.init_from={args.init_from}", *args.overrides]
    run(f"train/{args.method}.py", args.config, overrides)
    run("export/speculators.py", args.config, overrides)
    run("export/validate.py", args.config, [*overrides, "export.ngram_baseline=false"])

    out_paths = RunPaths.at(out, dataset)
    batch_tokens = yaml.safe_load(out_paths.train_config_copy.read_text())["train"]["batch_tokens"]
    print(f"\nheld-out simulated acceptance, {args.config} recipe trained for {args.steps} steps "
          f"x {batch_tokens} tokens:")
    print("| step | packed tokens | per-step accuracy | simulated AL by K |")
    print("|---|---|---|---|")
    for r in eval_history(out_paths):
        acc = " ".join(f"{a:.3f}" for a in r["eval_acc"])
        al = " ".join(f"K{k}={v:.2f}" for k, v in r["eval_sim_al"].items())
        print(f"| {r['step']} | {r['step'] * batch_tokens} | {acc} | {al} |")
    print(served_line(f"demo budget ({demo_dir.name})", ROOT / cfg.paths.validation_json))
    print(served_line(f"{args.steps} steps ({out.name})", out_paths.validation_json))


if __name__ == "__main__":
    main()
