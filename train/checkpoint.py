"""Training checkpoints (full state for an exact resume) and the drafter bundle that export reads.

A checkpoint is written by accelerate's save_state (model, optimizer, scheduler, RNG of every process;
sharded under FSDP2 and ZeRO) plus our loop state and the full drafter weights (`drafter/`, whatever the
backend), into a temporary folder that is renamed when complete: a half-written checkpoint
never carries a `step-*` name, so it is never picked up.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from draftsmith.data.disk import disk_full_reported, folder_bytes
from draftsmith.data.faults import kill_point
from draftsmith.data.manifest import (
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    replace_folder,
    settled_folder,
)
from draftsmith.train.spec import DrafterSpec

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{7})$")
BUNDLE_WEIGHTS = "drafter.safetensors"
BUNDLE_SPEC = "drafter.json"
BUNDLE_PROGRESS = "progress.json"
KEEP_LAST = 2  # checkpoints kept: the newest, and the one before it in case the newest was cut short


def checkpoint_dirs(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    dirs = checkpoint_dirs(ckpt_root)
    return dirs[-1] if dirs else None


def prune_checkpoints(ckpt_root: Path, keep_last: int = KEEP_LAST) -> None:
    """Keep the newest keep_last checkpoints. Each old one is renamed to a hidden name before it is deleted, so
    a kill inside the deletion never leaves a half-deleted folder under a `step-*` name; the leftovers of such a
    kill are removed by the next prune (on every save and on resume)."""
    for old in checkpoint_dirs(ckpt_root)[:-keep_last]:
        os.replace(old, ckpt_root / f".old-{old.name}")
    for hidden in ckpt_root.glob(".old-step-*"):
        shutil.rmtree(hidden, ignore_errors=True)


def save_checkpoint(accelerator, ckpt_root: Path, step: int, loop_state: dict, drafter: tuple | None = None,
                    keep_last: int = KEEP_LAST) -> Path:
    """All processes call this (a collective under FSDP2 and ZeRO); the main process adds `drafter/` (the full
    weights as a bundle export/ can read, from `drafter` = (state_dict, spec)), renames the finished folder and
    prunes old ones."""
    final = ckpt_root / f"step-{step:07d}"
    tmp = ckpt_root / f".tmp-step-{step:07d}"  # never read: a save cut short (a kill, a full disk) stays hidden
    # a full disk ends the run with the folder named; the last complete checkpoint stays the one a rerun resumes
    with disk_full_reported(ckpt_root, folder_bytes(latest_checkpoint(ckpt_root)) or None, f"checkpoint step {step}"):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(str(tmp))
            accelerator.wait_for_everyone()  # FSDP2/ZeRO: every process writes its shard into tmp before the rename
            if accelerator.is_main_process:
                if drafter is not None:
                    state, spec = drafter
                    save_drafter_bundle(tmp / "drafter", state, spec, {"step": step})
                atomic_write_json(tmp / "loop_state.json", loop_state)
            kill_point("checkpoint_write")  # written, not yet renamed: the rerun must resume from the one before
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # give back what the cut-short save took
            raise
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            kill_point("checkpoint_prune")  # renamed, old ones not yet pruned: the rerun prunes them
            prune_checkpoints(ckpt_root, keep_last)
        accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> dict:
    accelerator.load_state(str(path))
    return read_json(path / "loop_state.json", "checkpoint loop state")


def save_drafter_bundle(out_dir: Path, state_dict: dict[str, torch.Tensor], spec: DrafterSpec,
                        progress: dict) -> None:
    """The trained weights (fp32), the drafter spec export/ turns into a vLLM folder, and where training was
    (step, held-out evaluation) in a file of its own; written beside out_dir and swapped in as one set, so a
    crash or a full disk never leaves the weights of one step with the progress of another."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        atomic_write_bytes(tmp / BUNDLE_WEIGHTS, save(tensors))
        spec.save(tmp / BUNDLE_SPEC)
        atomic_write_json(tmp / BUNDLE_PROGRESS, progress)
        replace_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_drafter_bundle(bundle_dir: Path) -> tuple[dict[str, torch.Tensor], DrafterSpec, dict]:
    """(weights, spec, progress) of a bundle save_drafter_bundle wrote."""
    bundle_dir = settled_folder(Path(bundle_dir))
    weights = bundle_dir / BUNDLE_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"no trained drafter at {weights}; run train/eagle3.py (or train/peagle.py) first")
    progress = bundle_dir / BUNDLE_PROGRESS
    return (load_file(str(weights)), DrafterSpec.load(bundle_dir / BUNDLE_SPEC),
            read_json(progress, "training progress") if progress.is_file() else {})
