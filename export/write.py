"""Write a drafter folder vLLM serves: config.json + model.safetensors + draftsmith_export.json, atomically.

Names, shapes and config keys come from export/format.py; this file only casts, checks and writes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

from draftsmith.data.faults import kill_point
from draftsmith.data.manifest import replace_folder, sha256_file
from draftsmith.export.format import (
    check_state_dict,
    drafter_config,
    expected_tensors,
    export_dtype,
    select_export_tensors,
)
from draftsmith.train.spec import DrafterSpec

logger = logging.getLogger(__name__)

PROVENANCE = "draftsmith_export.json"
WEIGHTS = "model.safetensors"


def write_drafter_folder(
    state_dict: dict[str, torch.Tensor],
    spec: DrafterSpec,
    out_dir: str | Path,
    fmt: str,
    dtype: str,
    num_speculative_tokens: int,
) -> Path:
    """Cast and check the tensors first, then write the folder under a temporary name and rename it."""
    out_dir = Path(out_dir)
    tensors = cast_for_export(select_export_tensors(state_dict, spec), spec, dtype)
    check_state_dict(tensors, spec, dtype)
    dtype_name = str(export_dtype(dtype)).removeprefix("torch.")
    config = drafter_config(spec, fmt, num_speculative_tokens, dtype=dtype_name)
    _refuse_foreign_folder(out_dir)
    remove_orphaned_temp_folders(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")  # the pid: two exports never share one
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_files(tmp, config, tensors, spec, fmt, dtype_name, num_speculative_tokens)
        kill_point("export_write")
        replace_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s drafter (%d tensors, %s) to %s", fmt, len(tensors), dtype_name, out_dir)
    return out_dir


def cast_for_export(tensors: dict[str, torch.Tensor], spec: DrafterSpec, dtype: str) -> dict[str, torch.Tensor]:
    """Floating tensors -> the export dtype; the others keep theirs (d2t int64, t2d bool) for the check."""
    want = export_dtype(dtype)
    fixed = {name: d for name, (_, d) in expected_tensors(spec).items() if d is not None}
    out = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        if t.is_floating_point() and name not in fixed:
            t = t.to(want)
        out[name] = t.contiguous()
    return out


def _write_files(folder: Path, config: dict, tensors: dict, spec: DrafterSpec, fmt: str, dtype: str, k: int) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    provenance = {
        "format": fmt,
        "dtype": dtype,
        "num_speculative_tokens": k,
        "num_tensors": len(tensors),
        "model_safetensors_sha256": sha256_file(folder / WEIGHTS),
        "torch_version": torch.__version__,
        "drafter_spec": spec.to_dict(),
    }
    (folder / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")


def remove_orphaned_temp_folders(out_dir: Path) -> None:
    """Temp folders of exports to out_dir that were killed (their pid is gone) hold nothing anyone reads."""
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _refuse_foreign_folder(out_dir: Path) -> None:
    """Only an empty folder or an earlier export may be replaced: never delete a folder we did not write."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / PROVENANCE).is_file():
        raise FileExistsError(
            f"{out_dir} exists, is not empty and holds no {PROVENANCE}; choose another folder"
        )
