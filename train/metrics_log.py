"""Training logs: one line per log step (fixed field order), metrics.jsonl, and the trackers of train.report_to.

Written by the main process only, from metrics already summed over all processes; tokens count every
process's rows, `data_bytes_read` every process's reads from the dataset since its start.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

import torch
from tqdm import tqdm

from draftsmith.data.config import RunConfig, config_to_dict
from draftsmith.data.manifest import atomic_write_bytes
from draftsmith.data.run_paths import RunPaths
from draftsmith.train.loss import simulated_acceptance_length

logger = logging.getLogger(__name__)


def flat_config(cfg: RunConfig) -> dict:
    """The run config as flat scalars (`train.lr`: 0.002), as TensorBoard's hparams and wandb's config take it."""
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    walk(config_to_dict(cfg), "")
    return out


def wandb_init_kwargs(paths: RunPaths, cfg: RunConfig) -> dict:
    """A wandb run id kept in the run folder: a resumed run logs into the same wandb run."""
    if not paths.wandb_run_id.is_file():
        atomic_write_bytes(paths.wandb_run_id, uuid.uuid4().hex[:16].encode())
    return {"name": cfg.name, "id": paths.wandb_run_id.read_text().strip(), "resume": "allow", "dir": str(paths.train)}


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    except ImportError:
        return float("nan")


class MetricsLog:
    """metrics.jsonl (always) and the run's trackers (train.report_to) through accelerate, main process only."""

    def __init__(self, paths: RunPaths, cfg: RunConfig, accelerator, enabled: bool):
        self.enabled, self.acc, self.bar = enabled, accelerator, None
        if not enabled:
            return
        paths.train.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(paths.metrics, "a")  # noqa: SIM115 (open for the whole run, closed in close())
        if cfg.train.report_to:
            wandb = {"wandb": wandb_init_kwargs(paths, cfg)} if "wandb" in cfg.train.report_to else {}
            accelerator.init_trackers("draftsmith", config=flat_config(cfg), init_kwargs=wandb)

    def start(self, step: int) -> None:
        self.t0, self.tokens, self.step0 = time.time(), 0, step
        if self.enabled:
            self.bar = tqdm(initial=step, total=None, desc="train", unit="step", dynamic_ncols=True)

    def count_tokens(self, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)

    def _emit(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if scalars:
            self.acc.log(scalars, step=record["step"])

    def train_line(self, step, totals, grad_norm, lr, tokens, max_steps) -> None:
        self.count_tokens(tokens)
        if not self.enabled:
            return
        acc = (totals["correct"] / totals["count"].clamp(min=1)).tolist()  # host sync only on log steps
        loss = float(totals["loss"])
        elapsed = time.time() - self.t0
        tok_s = self.tokens / max(elapsed, 1e-9)
        eta = (max_steps - step) * elapsed / max(step - self.step0, 1)
        record = {"step": step, "loss": loss, "acc": [round(a, 4) for a in acc],
                  "sim_al": float(simulated_acceptance_length(acc)), "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": tok_s, "peak_mem_gib": peak_memory_gib(), "eta_s": eta,
                  "tokens": self.tokens, "data_bytes_read": totals["data_bytes_read"]}
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}")
        logger.info("step %d | loss %.4f | acc %s | sim_al %.3f | lr %.2e | grad %.3f | %.0f tok/s | %.2f GiB | eta %.0fs",
                    step, loss, " ".join(f"{a:.3f}" for a in acc), record["sim_al"], lr, record["grad_norm"],
                    tok_s, record["peak_mem_gib"], eta)
        self._emit(record)

    def eval_line(self, step: int, result: dict) -> None:
        if not self.enabled:
            return
        al = result["simulated_acceptance_length"]
        logger.info("eval step %d | acc %s | sim_al %s", step,
                    " ".join(f"{a:.3f}" for a in result["per_step_accuracy"]),
                    " ".join(f"K{k}={v:.3f}" for k, v in al.items()))
        record = {"step": step, "eval_acc": result["per_step_accuracy"], "eval_sim_al": al}
        self._emit(record | {f"eval/sim_al_k{k}": v for k, v in al.items()})

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        self.jsonl.close()
