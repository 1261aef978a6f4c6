"""The disk a dataset needs, known before a build starts: stored bytes per token (data/shards.py layout) times the
tokens it will capture, against the free space of the dataset folder's filesystem."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from draftsmith.data.chat import prompt_messages, render_generation_prompt
from draftsmith.data.config import DataConfig
from draftsmith.data.errors import UserError


def bytes_per_token(num_aux: int, hidden_size: int, storage_dtype: str) -> int:
    """n_aux aux states and the final state in the storage dtype, plus an int32 id and a uint8 loss mask."""
    return (num_aux + 1) * hidden_size * getattr(torch, storage_dtype).itemsize + 5


def planned_tokens(records: list[dict], samples: dict[str, list[dict]] | None, tokenizer, data: DataConfig) -> int:
    """Tokens the dataset will hold. With regeneration the responses do not exist yet: each templated prompt plus
    regenerate.max_new_tokens, at most max_seq_len (an upper bound); without, the templated samples' lengths."""
    if samples is not None:
        return sum(len(s["input_ids"]) for split in samples.values() for s in split)
    new = data.regenerate.max_new_tokens
    return sum(min(len(render_generation_prompt(tokenizer, prompt_messages(r["messages"]), r.get("tools"))) + new,
                   data.max_seq_len) for r in records)


def free_bytes(folder: Path) -> int:
    """Free space of the filesystem that holds folder (or will: its nearest existing parent)."""
    p = Path(folder).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def shard_bytes_on_disk(folder: Path) -> int:
    """Shards already in folder: a resumed build keeps or replaces them, so they count as available space."""
    return sum(f.stat().st_size for f in Path(folder).glob("shard-*.safetensors"))


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe_disk_plan(folder: Path, tokens: int, per_token: int, regenerate: bool) -> str:
    needed = tokens * per_token
    basis = "templated prompts + regenerate.max_new_tokens per sample" if regenerate else "templated samples"
    return (f"dataset {folder}: about {gib(needed)} on disk ({needed} bytes = {tokens} tokens from the {basis} x "
            f"{per_token} bytes/token)\nshards already there: {gib(shard_bytes_on_disk(folder))}\n"
            f"free space on its filesystem: {gib(free_bytes(folder))}")


def require_free_space(folder: Path, needed: int) -> None:
    """Refuse to start a capture the disk cannot hold, before any expensive work."""
    missing, free = needed - shard_bytes_on_disk(folder), free_bytes(folder)
    if missing > free:
        raise UserError(f"dataset {folder} needs about {gib(needed)} ({needed} bytes; `data/build.py --dry-run` shows "
                        f"the estimate) but its filesystem has {gib(free)} ({free} bytes) free; free space, point "
                        "data.dataset_dir at a larger disk, or lower data.prompts.max_prompts or data.max_seq_len")
