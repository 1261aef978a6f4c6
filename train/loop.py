"""The training loop shared by the EAGLE-3 and P-EAGLE entry scripts: build, resume, train, evaluate, save.

A method supplies one function of tensors (`row_loss`: a packed row's loss and metrics); everything else
(optimizer, schedule, accumulation, data sharding, metric reduction, checkpoints, logging, best-checkpoint
choice) lives here, the same on 1..N processes and under every backend (train/distributed.py).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from draftsmith.data.cli import save_resolved_config
from draftsmith.data.config import RunConfig, TrainConfig, config_sha256, config_to_dict
from draftsmith.data.errors import UserError
from draftsmith.data.manifest import atomic_write_json, sha256_file
from draftsmith.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    save_drafter_bundle,
)
from draftsmith.train.distributed import after_prepare, full_state_dict, sum_over_processes
from draftsmith.train.loss import simulated_acceptance_length
from draftsmith.train.metrics_log import MetricsLog
from draftsmith.train.muon import MuonWithAdamW, newton_schulz_dtype
from draftsmith.train.objective import DrafterObjective, RowLoss
from draftsmith.train.packing import DataPosition, pack_planned_row, plan_eval_rows, plan_next_row
from draftsmith.train.spec import DrafterSpec

logger = logging.getLogger(__name__)


@dataclass
class Method:
    """What differs between EAGLE-3 and P-EAGLE: the per-row loss (training or held-out by drafter.training)."""

    name: str
    row_loss: RowLoss
    drafter_spec: DrafterSpec  # what export needs besides the weights


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, mixed_precision: str = "no"):
    """The optimizer and its LR schedule; `mixed_precision` is the run's ("bf16" or "no", as accelerate names it)."""
    if cfg.optimizer == "muon":
        opt = MuonWithAdamW(model, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr or cfg.lr,
                            muon_weight_decay=cfg.muon_weight_decay,
                            ns_dtype=newton_schulz_dtype(cfg.muon_ns_precision, mixed_precision))
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def row_to_device(row: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in row.items()}


def accuracy_summary(correct: torch.Tensor, count: torch.Tensor) -> dict:
    """Per-step top-1 accuracy vs the target's argmax and simulated AL for K = 1..J, from summed hit counts."""
    acc = (correct / count.clamp(min=1)).tolist()
    al = {str(k): round(float(simulated_acceptance_length(acc[:k])), 4) for k in range(1, len(acc) + 1)}
    return {"per_step_accuracy": [round(a, 4) for a in acc], "simulated_acceptance_length": al,
            "num_scored": [int(c) for c in count.tolist()]}


def verify_datasets(acc, datasets) -> None:
    """Each process hashes its share of the shards; all raise if any share failed (no rank left waiting)."""
    error = None
    for ds in datasets:
        try:
            ds.verify_share(acc.process_index, acc.num_processes)
        except (UserError, FileNotFoundError) as e:
            error = error or e
    failed = int(sum_over_processes(acc, torch.tensor([float(error is not None)], dtype=torch.float64))[0])
    if error is not None:
        raise error
    if failed:
        raise UserError(f"{failed} process(es) found missing or corrupt shards in {datasets[0].dir}; "
                        "their error lines name the files")
    for ds in datasets:
        ds.mark_verified()


class Trainer:
    """Holds the objects of one run; `train()` reads like a table of contents.

    Process r of W trains rows r, r + W, ... of the global row order, so W processes x grad_accum A train the
    same global batch as 1 process x grad_accum W*A; logged metrics are sums over all processes.
    """

    def __init__(self, cfg: RunConfig, accelerator, drafter, method: Method, train_ds, heldout_ds):
        self.cfg, self.acc, self.method = cfg, accelerator, method
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.paths = cfg.paths
        model = DrafterObjective(drafter, method.row_loss)
        opt, sched = build_optimizer(model, cfg.train, accelerator.mixed_precision)
        self.model, self.opt, self.sched = accelerator.prepare(model, opt, sched)
        after_prepare(accelerator, self.model)
        verify_datasets(accelerator, [train_ds, heldout_ds])
        self.train_ds, self.heldout_ds = train_ds, heldout_ds
        self.eval_plans = plan_eval_rows(heldout_ds, cfg.train.eval_max_samples, cfg.train.batch_tokens)
        if not self.eval_plans:
            raise UserError(f"{heldout_ds.dir}: the held-out split is empty; set data.prompts.heldout_fraction > 0 "
                            "and rebuild the dataset")
        self.eval_rows: dict[int, dict] = {}  # this process's packed held-out rows, read once
        # the manifest lists every shard's sha256: its own hash names the exact data a checkpoint was trained on
        self.dataset_sha256 = sha256_file(self.paths.dataset.manifest)
        self.pos, self.step, self.best = DataPosition(), 0, -1.0
        self.best_k = cfg.export.num_speculative_tokens[0]
        self.log = MetricsLog(self.paths, cfg, accelerator, enabled=accelerator.is_main_process)

    def resume_if_possible(self) -> None:
        ckpt = latest_checkpoint(self.paths.checkpoints)
        if ckpt is None:
            return
        if self.acc.is_main_process:  # a run killed between a save and its prune left one too many
            prune_checkpoints(self.paths.checkpoints)
        state = load_checkpoint(self.acc, ckpt)
        stored = state["resumable_config"]
        stored["train"].pop("grad_accum", None)  # checkpoints written before grad_accum became resumable
        if state["config_sha256"] != config_sha256(self.cfg) and stored != resumable_config(self.cfg):
            raise UserError(f"{ckpt} was made with a different config; differing fields: "
                             f"{diff_fields(stored, resumable_config(self.cfg))}. "
                             f"Use another output_dir or delete {self.paths.train}")
        trained_on = state.get("dataset_manifest_sha256", self.dataset_sha256)  # absent in older checkpoints
        if trained_on != self.dataset_sha256:
            raise UserError(f"{ckpt} was trained on another dataset: its manifest had sha256 {trained_on[:16]}, "
                            f"{self.paths.dataset.manifest} now has {self.dataset_sha256[:16]} (rebuilt or replaced "
                            f"since); resume on the data it started with, or start over in another output_dir")
        self.step, self.best = state["step"], state["best"]
        self.pos.load_state_dict(state["data_position"])
        self.acc.step = 0  # accelerate's micro-step counter: a step boundary, whatever grad_accum was before
        if state.get("world_size", self.world) != self.world:
            logger.warning("%s was written by %d process(es), resuming on %d: the global data order continues; "
                           "the global batch is now %d rows a step", ckpt, state["world_size"], self.world,
                           self.world * self.cfg.train.grad_accum)
        logger.info("resumed from %s at step %d (epoch %d)", ckpt, self.step, self.pos.epoch)

    def next_local_row(self) -> dict:
        """Every process plans the same W rows (lengths only) and reads and packs just its own."""
        plans = [plan_next_row(self.train_ds, self.pos, self.cfg.train.seed, self.cfg.train.batch_tokens)
                 for _ in range(self.world)]
        t = self.cfg.train
        return row_to_device(pack_planned_row(self.train_ds, plans[self.rank], t.batch_tokens, t.row_length_multiple),
                             self.acc.device)

    def train_step(self) -> tuple[float, dict, int]:
        """grad_accum micro-batches, then one optimizer and scheduler step; returns the global grad norm, the
        metrics summed over processes and the tokens trained by all processes."""
        local = {"nonfinite": 0.0, "loss": 0.0, "tokens": 0.0, "correct": 0, "count": 0}
        for _ in range(self.cfg.train.grad_accum):
            row = self.next_local_row()
            with self.acc.accumulate(self.model):  # no all-reduce before the last micro-step
                with self.acc.autocast():
                    loss, metrics = self.model(row)
                self.acc.backward(loss)  # accelerate divides by grad_accum (DeepSpeed: its engine does)
            loss = loss.detach().double()
            local["nonfinite"] += float(not torch.isfinite(loss))
            local["loss"] += loss
            local["tokens"] += row["num_tokens"]  # trained tokens: the padding is not
            local["correct"] += metrics["correct"]
            local["count"] += metrics["count"]
        totals = self.reduce_step_metrics(local)
        if totals["nonfinite"]:
            last = latest_checkpoint(self.paths.checkpoints)
            raise FloatingPointError(f"non-finite loss on {int(totals['nonfinite'])} micro-batch(es) at step "
                                     f"{self.step + 1}; last good checkpoint: {last or 'none'}")
        grad_norm = 0.0
        if self.cfg.train.grad_clip > 0:
            norm = self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
            grad_norm = float(norm) if norm is not None else float("nan")
        self.opt.step()
        self.sched.step()  # once per global step, whatever the world size
        self.opt.zero_grad(set_to_none=True)
        return grad_norm, totals, int(totals["tokens"])

    def reduce_step_metrics(self, local: dict) -> dict:
        """Sum the step's metrics over processes (one small all-reduce); loss becomes the mean per row."""
        data_bytes = self.train_ds.bytes_read + self.heldout_ds.bytes_read  # this process, since the start
        head = torch.tensor([local["nonfinite"], float(local["loss"]), local["tokens"], data_bytes],
                            dtype=torch.float64)
        correct, count = local["correct"].double().cpu(), local["count"].double().cpu()
        summed = sum_over_processes(self.acc, torch.cat([head, correct, count]))
        J = correct.numel()
        rows = self.cfg.train.grad_accum * self.world
        return {"nonfinite": summed[0].item(), "loss": summed[1] / rows, "tokens": summed[2].item(),
                "data_bytes_read": summed[3].item(), "correct": summed[4: 4 + J], "count": summed[4 + J:]}

    def local_eval_row(self, index: int) -> dict:
        if index not in self.eval_rows:
            row = pack_planned_row(self.heldout_ds, self.eval_plans[index], self.cfg.train.batch_tokens,
                                   self.cfg.train.row_length_multiple)
            self.eval_rows[index] = row_to_device(row, self.acc.device)
        return self.eval_rows[index]

    def evaluate(self) -> dict:
        """Held-out rows split over processes; hit counts summed. Every process runs the same number of
        forwards (FSDP2 gathers parameters in each): a process short of rows repeats row 0 unscored."""
        correct = count = 0
        self.model.eval()
        with torch.no_grad(), self.acc.autocast():
            for i in range(math.ceil(len(self.eval_plans) / self.world)):
                index = i * self.world + self.rank
                scored = float(index < len(self.eval_plans))
                _, m = self.model(self.local_eval_row(index if scored else 0))
                correct = correct + scored * m["correct"].double().cpu()
                count = count + scored * m["count"].double().cpu()
        self.model.train()
        J = correct.numel()
        summed = sum_over_processes(self.acc, torch.cat([correct, count]))
        return accuracy_summary(summed[:J], summed[J:])

    def save(self, eval_result: dict | None) -> None:
        """Checkpoint on every process, with the full weights; a new best held-out score also writes `best/`."""
        state = full_state_dict(self.acc, self.model)  # a collective under FSDP2: every process calls it
        if eval_result is not None:
            al = eval_result["simulated_acceptance_length"]
            # the served K may exceed the steps trained; rank by the deepest K both cover
            score = al[str(min(self.best_k, max(int(k) for k in al)))]
            if score > self.best:  # the same on every process: the evaluation was reduced
                if self.acc.is_main_process:
                    save_drafter_bundle(self.paths.best, state, self.method.drafter_spec,
                                        {"step": self.step, "eval": eval_result})
                    atomic_write_json(self.paths.eval_heldout, {**eval_result, "step": self.step})
                self.best = score
        save_checkpoint(self.acc, self.paths.checkpoints, self.step, {
            "step": self.step, "best": self.best, "data_position": self.pos.state_dict(),
            "world_size": self.world, "config_sha256": config_sha256(self.cfg),
            "dataset_manifest_sha256": self.dataset_sha256,
            "resumable_config": resumable_config(self.cfg), "config": config_to_dict(self.cfg)},
            drafter=(state, self.method.drafter_spec))

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
    """The fields a resume may not change (everything but logging/eval/export cadence, the step budget and
    grad_accum, which a resume on another world size changes to keep the global batch)."""
    d = config_to_dict(cfg)
    for k in ("log_every", "eval_every", "save_every", "max_steps", "eval_max_samples", "grad_accum"):
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



def run_training(cfg: RunConfig, accelerator, drafter, method: Method, train_ds, heldout_ds) -> None:
    """Resume (when the run folder holds a checkpoint), train to the end, and close the accelerator."""
    if accelerator.is_main_process:
        save_resolved_config(cfg, cfg.paths.train_config_copy)
    trainer = Trainer(cfg, accelerator, drafter, method, train_ds, heldout_ds)
    try:
        trainer.resume_if_possible()
        trainer.train()
    finally:
        accelerator.end_training()
