"""Injected faults for the fault tests: named kill points (tests/faults/, bench/soak.py) and extra request fields
for served runs (a forced token for the lossless check, tests/export/test_validate.py).

DRAFTSMITH_KILL_AT=<point>:<n> makes this process SIGKILL itself the n-th time it reaches <point>: a real kill,
at an exact place no timer can hit reliably (inside a shard write, between a checkpoint's write and its rename).
Unset, a point costs one environment lookup.
"""
from __future__ import annotations

import json
import os
import signal

from draftsmith.data.errors import UserError

POINTS = ("shard_write", "shard_sidecar", "before_manifest", "regenerate_batch", "checkpoint_write",
          "checkpoint_prune", "bundle_swap", "export_write")
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


def injected_request_fields(server_label: str) -> dict:
    """DRAFTSMITH_FAULT_REQUEST_FIELDS=<label prefix>:<JSON object> merges the object into the greedy requests of
    the servers whose label starts with the prefix, e.g. {"allowed_token_ids": [id]}: a forced token, a real bug in
    the served output that the lossless check must catch (tests/export/test_validate.py). Unset, nothing changes."""
    wanted = os.environ.get("DRAFTSMITH_FAULT_REQUEST_FIELDS")
    if not wanted:
        return {}
    prefix, _, fields = wanted.partition(":")
    try:
        injected = json.loads(fields)
    except json.JSONDecodeError:
        injected = None
    if not isinstance(injected, dict):
        raise UserError(f"DRAFTSMITH_FAULT_REQUEST_FIELDS={wanted!r}: after '<label prefix>:' comes a JSON object, "
                        f'e.g. drafter:{{"allowed_token_ids": [42]}}; unset the variable to serve normally')
    return injected if server_label.startswith(prefix) else {}
