"""The held-out evaluation of a freshly initialised drafter: the baseline a trained drafter must beat.

Usage: python bench/fresh_drafter_eval.py [--config smollm2-demo] [key=value ...]
Builds the drafter exactly as train/eagle3.py does (same seed, same init), runs no training step, and prints
the trainer's own held-out evaluation (per-step accuracy, simulated acceptance length for K = 1..J).
"""
from __future__ import annotations

import json

import torch

from draftsmith.data.cli import build_arg_parser, parse_run_args, run_entry
from draftsmith.train.build import build_drafter, build_drafter_spec, load_checked_dataset
from draftsmith.train.eagle3 import build_method
from draftsmith.train.loop import accuracy_summary
from draftsmith.train.packing import pack_planned_row, plan_eval_rows


def main(argv=None) -> None:
    cfg, _ = parse_run_args(build_arg_parser(__doc__), argv)
    _train_ds, heldout_ds, aux_ids, target_path, hf_cfg = load_checked_dataset(cfg)
    drafter = build_drafter(cfg, build_drafter_spec(cfg, hf_cfg, target_path, aux_ids, "eagle3"), target_path)
    method = build_method(cfg, drafter, target_path, torch.device("cpu"))
    plans = plan_eval_rows(heldout_ds, cfg.train.eval_max_samples, cfg.train.batch_tokens)
    drafter.eval()
    correct = count = 0
    with torch.no_grad():
        for plan in plans:
            _, m = method.row_loss(drafter, pack_planned_row(heldout_ds, plan, cfg.train.batch_tokens))
            correct, count = correct + m["correct"], count + m["count"]
    result = accuracy_summary(correct, count)
    print(f"fresh drafter ({cfg.name}, seed {cfg.train.seed}), held-out evaluation at step 0:")
    print(json.dumps(result))


if __name__ == "__main__":
    run_entry(main)
