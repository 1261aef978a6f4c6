"""The disk a dataset needs, known before a build starts: stored bytes per token (data/shards.py layout) times the
tokens it will capture, against the free space of the dataset folder's filesystem."""
from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
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


def human_bytes(n: int) -> str:
    """1.50 GiB, 12.3 MiB, 40.0 KiB: a size readable at any scale."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def describe_disk_plan(folder: Path, tokens: int, per_token: int, regenerate: bool) -> str:
    needed = tokens * per_token
    basis = "templated prompts + regenerate.max_new_tokens per sample" if regenerate else "templated samples"
    return (f"dataset {folder}: about {human_bytes(needed)} on disk ({needed} bytes = {tokens} tokens from the "
            f"{basis} x {per_token} bytes/token)\nshards already there: {human_bytes(shard_bytes_on_disk(folder))}\n"
            f"free space on its filesystem: {human_bytes(free_bytes(folder))}")


def require_free_space(folder: Path, needed: int) -> None:
    """Refuse to start a capture the disk cannot hold, before any expensive work."""
    missing, free = needed - shard_bytes_on_disk(folder), free_bytes(folder)
    if missing > free:
        raise UserError(f"dataset {Path(folder).absolute()} needs about {human_bytes(needed)} ({needed} bytes; "
                        f"`data/build.py --dry-run` shows the estimate) but its filesystem has {human_bytes(free)} "
                        f"({free} bytes) free; free space, point data.dataset_dir at a larger disk, or lower "
                        "data.prompts.max_prompts or data.max_seq_len")


class DiskFullError(UserError):
    """A write ran out of space: a one-line error naming the folder and the space the work needs."""


# how torch.save's stream writer reports a failed write (it keeps no errno)
TORCH_WRITE_FAILURES = ("file write failed", "iostream error", "unexpected pos")


def is_disk_full(e: BaseException, folder: Path | None = None, needed: int | None = None) -> bool:
    """ENOSPC / EDQUOT; or a RuntimeError of torch.save's writer while `folder`'s filesystem has less than `needed`
    (1 MiB if unknown) free."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(e, RuntimeError):
        return False
    if "No space left" in str(e):
        return True
    return (folder is not None and any(m in str(e) for m in TORCH_WRITE_FAILURES)
            and free_bytes(folder) < (needed or 2**20))


@contextlib.contextmanager
def disk_full_reported(folder: Path, needed: int | None, what: str) -> Iterator[None]:
    """Turn a full disk inside the body into DiskFullError; the body's own cleanup (temp files) has run by then."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e, folder, needed):
            raise
        need = f"it needs about {human_bytes(needed)} more" if needed else "it needs more"
        raise DiskFullError(f"{Path(folder).absolute()}: the disk filled up while writing {what} ({need}; "
                            f"{human_bytes(free_bytes(folder))} "
                            "free now). Nothing partly written is kept or read as complete: free space and run the same "
                            "command again, it resumes") from None


def folder_bytes(folder: Path | None) -> int:
    """Bytes of the files under folder (0 if it is None or gone)."""
    if folder is None or not Path(folder).is_dir():
        return 0
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
