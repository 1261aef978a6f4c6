"""One writer per dataset folder: data/build.py holds `build.lock` (its pid, host and start time) while it writes.

A second build of an unfinished folder is refused with the holder named (a finished folder is only read, without
the lock); a lock whose process is gone (a SIGKILL, a lost node) is taken over with a warning, since resuming is the
normal way on after a crash.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from draftsmith.data.errors import UserError

logger = logging.getLogger(__name__)


def this_process() -> dict:
    me = psutil.Process()
    return {"pid": me.pid, "host": socket.gethostname(), "create_time": me.create_time(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def holder_is_running(holder: dict) -> bool | None:
    """True/False for a holder on this host (pid alive and the same process, not a reused pid); None elsewhere."""
    if holder.get("host") != socket.gethostname():
        return None
    try:
        return abs(psutil.Process(int(holder["pid"])).create_time() - float(holder["create_time"])) < 1.0
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False


def _create(path: Path, record: dict) -> bool:
    """Create the lock file atomically; False if one exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # torn by a crash between create and write: no live holder can be named


@contextlib.contextmanager
def dataset_build_lock(path: Path) -> Iterator[None]:
    """Hold `path` (a dataset's build.lock) for the body; refuse if a live build holds it, take over a dead one."""
    path = path.resolve()
    created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]  # innermost first
    path.parent.mkdir(parents=True, exist_ok=True)
    me = this_process()
    while not _create(path, me):
        holder = _read(path)
        running = holder_is_running(holder) if holder else False
        where = f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
        if running:
            raise UserError(f"{path.parent} is being built by another data/build.py ({where}); wait for it to "
                            "finish, or give this run another data.dataset_dir")
        if running is None:
            raise UserError(f"{path.parent} is locked by a build on another host ({where}); if that build is gone, "
                            f"delete {path} and run again")
        logger.warning("%s: taking over the lock of a build that is no longer running (%s)", path.parent,
                       where if holder else "unreadable lock file")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    try:
        yield
    finally:
        if _read(path).get("pid") == me["pid"]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        for folder in created:  # a build refused before writing anything leaves no empty folders behind
            with contextlib.suppress(OSError):
                folder.rmdir()
