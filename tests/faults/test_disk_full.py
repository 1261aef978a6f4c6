"""A full disk (issue #16, item 2): capture and a checkpoint save on a small filesystem that fills up stop with an
error naming the folder and the space needed; nothing partly written is read as complete; after space is freed
the same command finishes, with the artifacts an uninterrupted run makes."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.data.shards import finished_shard_entry
from tests.faults.conftest import fill_disk

REPO = Path(__file__).resolve().parents[2]


def stage(script: str, config: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), "--config", config, *overrides], cwd=cwd,
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_capture_on_a_disk_that_fills_up_stops_cleanly_and_finishes_after_space_is_freed(build_config, small_disk,
                                                                                       tmp_path):
    config = build_config(tmp_path)
    (tmp_path / "ref").mkdir()
    assert stage("data/build.py", config, cwd=tmp_path / "ref").returncode == 0
    plan = stage("data/build.py", config, "--dry-run", cwd=small_disk)
    needed = int(re.search(r"\((\d+) bytes = ", plan.stdout).group(1))
    # room for the shard payload the pre-check plans and 16 KiB: headers, sidecars, prompt files, the vocab overflow it
    filler = fill_disk(small_disk, needed + 16 * 1024)
    full = stage("data/build.py", config, cwd=small_disk)
    folder = small_disk / "run" / "dataset"
    assert full.returncode == 2, full.stderr[-3000:]
    error = next(line for line in full.stderr.splitlines() if line.startswith("error:"))
    assert error.startswith(f"error: {folder}: the disk filled up while writing the dataset (it needs about "), error
    assert "run the same command again" in error and "Traceback" not in full.stderr
    assert not (folder / "manifest.json").exists() and not list(folder.glob(".*tmp*"))
    shards = sorted(folder.glob("shard-*.safetensors"))
    assert all(finished_shard_entry(folder, int(p.stem.split("-")[1]), json.loads(
        p.with_suffix(".json").read_text())["inputs_sha256"]) for p in shards if p.with_suffix(".json").exists())
    filler.unlink()
    again = stage("data/build.py", config, cwd=small_disk)
    assert again.returncode == 0, again.stderr[-3000:]
    assert files_of(folder) == files_of(tmp_path / "ref" / "run" / "dataset")


def disk_bytes(folder: Path) -> int:
    """Space the files under folder take on a page-granular filesystem (tmpfs: 4 KiB pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


def test_a_checkpoint_save_on_a_full_disk_keeps_the_last_one_and_the_rerun_matches(tiny_run, small_disk, tmp_path):
    train = ["train.max_steps=10", "train.save_every=5", "train.eval_every=5"]
    reference = tiny_run(tmp_path / "ref", output_dir=tmp_path / "ref" / "run")
    assert stage("train/eagle3.py", reference, *train, cwd=tmp_path).returncode == 0
    ref_train = tmp_path / "ref" / "run" / "train"
    config = tiny_run(tmp_path, output_dir=small_disk / "run")
    # room for the whole run but half of its second checkpoint: step 5 saves, the disk fills on the way to step 10
    filler = fill_disk(small_disk, disk_bytes(ref_train) - disk_bytes(ref_train / "checkpoints" / "step-0000010") // 2)
    full = stage("train/eagle3.py", config, *train, cwd=tmp_path)
    assert full.returncode == 2, full.stderr[-3000:]
    error = next(line for line in full.stderr.splitlines() if line.startswith("error:"))
    assert "the disk filled up" in error and str(small_disk / "run" / "train") in error, error
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    ckpts = small_disk / "run" / "train" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000005"]  # the cut-short save left nothing behind
    assert files_of(ckpts / "step-0000005" / "drafter") == files_of(ref_train / "checkpoints" / "step-0000005" /
                                                                     "drafter")
    filler.unlink()
    again = stage("train/eagle3.py", config, *train, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "at step 5" in again.stderr
    done = load_file(str(ckpts / "step-0000010" / "drafter" / "drafter.safetensors"))
    want = load_file(str(ref_train / "checkpoints" / "step-0000010" / "drafter" / "drafter.safetensors"))
    assert done.keys() == want.keys() and all(torch.equal(done[k], want[k]) for k in done)
