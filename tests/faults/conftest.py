"""Fixtures of the fault tests: the data tests' small chat dataset builder, and a small filesystem that fills up."""
import os
import shutil
import subprocess

import pytest

from tests.data.conftest import build_config, chat_target_dir, conversations_jsonl  # noqa: F401 (fixtures)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs mounted for the test and removed after it (skipped where this user cannot mount)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (the fault tests run as root in CI)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_disk(mount, leave_bytes: int):
    """A filler file that leaves `leave_bytes` free on the filesystem of `mount`; returns its path."""
    filler = mount / "filler"
    free = shutil.disk_usage(mount).free
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - leave_bytes, 0))
    return filler
