"""Named kill points for the fault tests (tests/faults/, bench/soak.py).

DRAFTSMITH_KILL_AT=<point>:<n> makes this process SIGKILL itself the n-th time it reaches <point>: a real kill,
at an exact place no timer can hit reliably (inside a shard write, between a checkpoint's write and its rename).
Unset, a point costs one environment lookup.
"""
from __future__ import annotations

import os
import signal

POINTS = ("shard_write", "shard_sidecar", "before_manifest", "regenerate_batch", "checkpoint_write", "bundle_swap",
          "export_write")
_reached: dict[str, int] = {}


def kill_point(name: str) -> None:
    """SIGKILL this process here if DRAFTSMITH_KILL_AT names this point and this is its n-th visit."""
    wanted = os.environ.get("DRAFTSMITH_KILL_AT")
    if not wanted:
        return
    point, _, n = wanted.partition(":")
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(n or 1):
        os.kill(os.getpid(), signal.SIGKILL)
