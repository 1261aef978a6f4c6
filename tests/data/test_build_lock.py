"""One writer per dataset folder (issue #16, item 3): a build refuses a folder a live build holds, naming it, and
takes over the lock of a build that was killed; a complete folder is only read, whoever holds its lock."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from pathlib import Path
from draftsmith.data.lock import dataset_build_lock
with dataset_build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def build(config: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "data" / "build.py"), "--config", config], cwd=cwd,
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_live_build_holds_the_folder_a_dead_ones_lock_is_taken_over_a_complete_one_is_shared(build_config, tmp_path):
    config = build_config(tmp_path)
    folder = tmp_path / "run" / "dataset"
    lock = folder / "build.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = build(config, tmp_path)
        assert refused.returncode == 2, refused.stderr[-3000:]
        error = refused.stderr.strip().splitlines()[-1]
        assert f"pid {holder.pid}" in error and str(folder) in error, error
        assert sorted(p.name for p in folder.iterdir()) == ["build.lock"]  # refused before writing anything
    finally:
        holder.send_signal(signal.SIGKILL)  # as a crash would: the lock file stays behind
        holder.wait()
    assert lock.is_file()
    time.sleep(0.1)
    done = build(config, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "taking over the lock of a build that is no longer running" in done.stderr
    assert f"pid {holder.pid}" in done.stderr
    assert (folder / "manifest.json").is_file() and not lock.exists()
    # two chains sharing a complete dataset start their data stages at once (the CI's e2e and Slurm chains did):
    # the one that finds the folder complete returns, though the other holds the lock
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        shared = build(config, tmp_path)
        assert shared.returncode == 0, shared.stderr[-3000:]
        assert "is complete and was built with the same data settings: nothing to do" in shared.stderr
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait()
