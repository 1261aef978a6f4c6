"""The draft vocabulary (DESIGN section 3): top-V_d loss-masked target tokens, d2t offsets and t2d mask."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save

from draftsmith.data.manifest import atomic_write_bytes


def count_loss_masked_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts [V_t] int64 of the tokens under the loss mask."""
    ids = input_ids.to(torch.int64)[loss_mask.bool()]
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The V_d most frequent tokens (ties by lower id; unseen ids fill up), sorted ascending.

    Returns d2t [V_d] int64 with target_id = i + d2t[i] (vLLM's convention) and t2d [V_t] bool.
    """
    vocab_size = counts.numel()
    v_d = min(draft_vocab_size, vocab_size)
    # stable sort by descending count keeps lower ids first among equal counts
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    used = torch.sort(order[:v_d]).values
    d2t = used - torch.arange(v_d, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def save_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor) -> None:
    atomic_write_bytes(Path(path), save({"d2t": d2t.contiguous(), "t2d": t2d.contiguous(), "counts": counts.contiguous()}))


def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"draft vocab {path} does not exist; run data/build.py first")
    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[V_d] target id of each draft id."""
    return torch.arange(d2t.numel(), dtype=torch.int64) + d2t
