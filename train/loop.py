"""The training loop shared by the EAGLE-3 and P-EAGLE entry scripts: build, resume, train, evaluate, save.

A method supplies two functions of tensors (`step_fn` for a training row, `eval_fn` for held-out rows);
everything else (optimizer, schedule, accumulation, checkpoints, logging, best-checkpoint choice) lives here.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from draftsmith.data.cli import save_resolved_config
from draftsmith.data.config import RunConfig, TrainConfig, config_sha256, config_to_dict
from draftsmith.data.errors import UserError
from draftsmith.data.manifest import atomic_write_json
from draftsmith.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_drafter_bundle,
)
from draftsmith.train.loss import simulated_acceptance_length
from draftsmith.train.metrics_log import MetricsLog
from draftsmith.train.packing import DataPosition, eval_rows, next_row

logger = logging.getLogger(__name__)


@dataclass
class Method:
    """What differs between EAGLE-3 and P-EAGLE: the per-row loss and the held-out evaluation."""

    name: str
    step_fn: Callable  # (model, row) -> (loss, metrics dict of tensors)
    eval_fn: Callable  # (model, rows) -> {"per_step_accuracy": [...], "simulated_acceptance_length": {k: v}}
    drafter_spec: dict  # what export needs besides the weights


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def row_to_device(row: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in row.items()}


class Trainer:
    """Holds the objects of one run; `train()` reads like a table of contents."""

    def __init__(self, cfg: RunConfig, accelerator, model, method: Method, train_ds, eval_rows: list[dict]):
        self.cfg, self.acc, self.method = cfg, accelerator, method
        self.out = cfg.run_dir() / "train"
        self.opt, self.sched = build_optimizer(model, cfg.train)
        self.model, self.opt, self.sched = accelerator.prepare(model, self.opt, self.sched)
        self.train_ds, self.eval_rows = train_ds, eval_rows
        self.pos, self.step, self.best = DataPosition(), 0, -1.0
        self.best_k = cfg.export.num_speculative_tokens[0]
        self.log = MetricsLog(self.out, cfg, enabled=accelerator.is_main_process)

    def resume_if_possible(self) -> None:
        ckpt = latest_checkpoint(self.out / "checkpoints")
        if ckpt is None:
            return
        state = load_checkpoint(self.acc, ckpt)
        if state["config_sha256"] != config_sha256(self.cfg) and state["resumable_config"] != resumable_config(self.cfg):
            raise UserError(f"{ckpt} was made with a different config; differing fields: "
                             f"{diff_fields(state['resumable_config'], resumable_config(self.cfg))}. "
                             f"Use another output_dir or delete {self.out}")
        self.step, self.best = state["step"], state["best"]
        self.pos.load_state_dict(state["data_position"])
        logger.info("resumed from %s at step %d (epoch %d)", ckpt, self.step, self.pos.epoch)

    def next_local_row(self) -> dict:
        """Every process walks the same row sequence and keeps every world_size-th row."""
        rows = [next_row(self.train_ds, self.pos, self.cfg.train.seed, self.cfg.train.batch_tokens)
                for _ in range(self.acc.num_processes)]
        return row_to_device(rows[self.acc.process_index], self.acc.device)

    def train_step(self) -> tuple[torch.Tensor, dict, int]:
        """grad_accum micro-batches, clip, optimizer step; returns tensors (no host sync) and the token count."""
        tokens, totals = 0, {}
        for _ in range(self.cfg.train.grad_accum):
            row = self.next_local_row()
            with self.acc.autocast():
                loss, metrics = self.method.step_fn(self.model, row)
            if not torch.isfinite(loss):
                last = latest_checkpoint(self.out / "checkpoints")
                raise FloatingPointError(f"non-finite loss {loss.item()} at step {self.step + 1}; "
                                         f"last good checkpoint: {last or 'none'}")
            self.acc.backward(loss / self.cfg.train.grad_accum)
            tokens += int(row["input_ids"].numel())
            for k, v in {"loss": loss.detach() / self.cfg.train.grad_accum, "correct": metrics["correct"],
                         "count": metrics["count"]}.items():
                totals[k] = totals[k] + v if k in totals else v
        grad_norm = (self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
                     if self.cfg.train.grad_clip > 0 else torch.tensor(0.0))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm, totals, tokens

    def evaluate(self) -> dict:
        self.model.eval()
        with torch.no_grad(), self.acc.autocast():
            result = self.method.eval_fn(self.model, [row_to_device(r, self.acc.device) for r in self.eval_rows])
        self.model.train()
        return result

    def save(self, eval_result: dict | None) -> None:
        if eval_result is not None:
            al = eval_result["simulated_acceptance_length"]
            # the served K may exceed the steps trained; rank by the deepest K both cover
            score = al[str(min(self.best_k, max(int(k) for k in al)))]
            if score > self.best and self.acc.is_main_process:
                self.best = score
                state = self.acc.unwrap_model(self.model).state_dict()
                save_drafter_bundle(self.out / "best", state, self.method.drafter_spec,
                                    {"step": self.step, "eval": eval_result})
                atomic_write_json(self.out / "eval_heldout.json", {**eval_result, "step": self.step})
            self.best = max(self.best, score)
        save_checkpoint(self.acc, self.out / "checkpoints", self.step, {
            "step": self.step, "best": self.best, "data_position": self.pos.state_dict(),
            "config_sha256": config_sha256(self.cfg), "resumable_config": resumable_config(self.cfg),
            "config": config_to_dict(self.cfg)})

    def train(self) -> None:
        cfg = self.cfg.train
        self.model.train()
        self.log.start(self.step)
        while self.step < cfg.max_steps:
            grad_norm, totals, tokens = self.train_step()
            self.step += 1
            last = self.step == cfg.max_steps
            if self.step % cfg.log_every == 0 or last:
                self.log.train_line(self.step, totals, grad_norm, self.sched.get_last_lr()[0], tokens, cfg.max_steps)
            else:
                self.log.count_tokens(tokens)
            eval_result = None
            if self.step % cfg.eval_every == 0 or last:
                eval_result = self.evaluate()
                self.log.eval_line(self.step, eval_result)
            if self.step % cfg.save_every == 0 or last or eval_result is not None:
                self.save(eval_result)
        self.log.close()


def resumable_config(cfg: RunConfig) -> dict:
    """The fields a resume may not change (everything but logging/eval/export cadence and the step budget)."""
    d = config_to_dict(cfg)
    for k in ("log_every", "eval_every", "save_every", "max_steps", "eval_max_samples"):
        d["train"].pop(k)
    d.pop("export")
    d.pop("name")
    return d


def diff_fields(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out += diff_fields(a[k], b[k], f"{prefix}{k}.")
        elif a.get(k) != b.get(k):
            out.append(f"{prefix}{k} ({a.get(k)!r} -> {b.get(k)!r})")
    return out



def evaluate_rows(model, rows, loss_fn) -> dict:
    """Per-step top-1 accuracy vs the target's argmax over held-out rows, and simulated AL for K = 1..J."""
    correct = count = 0
    for row in rows:
        _, m = loss_fn(model, row)
        correct, count = correct + m["correct"], count + m["count"]
    acc = (correct / count.clamp(min=1)).tolist()
    al = {str(k): round(float(simulated_acceptance_length(acc[:k])), 4) for k in range(1, len(acc) + 1)}
    return {"per_step_accuracy": [round(a, 4) for a in acc], "simulated_acceptance_length": al,
            "num_scored": count.tolist()}


def build_accelerator(cfg: RunConfig):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    mixed = "bf16" if torch.cuda.is_available() else "no"  # fp32 master weights either way
    acc = Accelerator(mixed_precision=mixed)
    set_seed(cfg.train.seed)
    return acc


def run_training(cfg: RunConfig, accelerator, model, method: Method, train_ds, heldout_ds) -> None:
    """Resume (when the run folder holds a checkpoint), train to the end, and close the accelerator."""
    if accelerator.is_main_process:
        save_resolved_config(cfg, cfg.run_dir() / "train" / "config.yaml")
    rows = eval_rows(heldout_ds, cfg.train.eval_max_samples, cfg.train.batch_tokens)
    trainer = Trainer(cfg, accelerator, model, method, train_ds, rows)
    try:
        trainer.resume_if_possible()
        trainer.train()
    finally:
        accelerator.end_training()
