"""Pack dataset samples into fixed-size token rows (documents kept apart by document_ids), in a
seeded order per epoch, so that a (epoch, cursor) pair is the whole data position for an exact resume.

Rows are planned from sample lengths alone and packed (read) only by the process that trains them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from draftsmith.data.shards import ShardedDataset


@dataclass
class DataPosition:
    epoch: int = 0
    cursor: int = 0  # index into the epoch's sample order of the next sample to pack

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


@functools.lru_cache(maxsize=2)
def epoch_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The epoch's sample order; cached: every process plans every row of a step from it."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(num_samples, generator=g).tolist())


def padded_length(num_tokens: int, row_tokens: int, multiple: int) -> int:
    """num_tokens rounded up to a multiple of `multiple`, at most row_tokens: rows come in a few lengths only, so
    kernels compiled per shape (oneDNN's matmul primitives on CPUs, torch.compile on GPUs) and the allocator's
    blocks are reused instead of growing with every new row length."""
    return min(row_tokens, -(-num_tokens // multiple) * multiple)


def pack_row(samples: list[dict], row_tokens: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Concatenate samples into one row [1, <= row_tokens], padded only up to a multiple of `multiple` (the CPU
    pays for every position); document ids separate the samples, -1 marks the padding (never scored)."""
    row_tokens = padded_length(min(row_tokens, sum(len(s["input_ids"]) for s in samples)), row_tokens, multiple)
    n_aux_h = samples[0]["aux_hidden_states"].shape[-1]
    h = samples[0]["final_hidden_states"].shape[-1]
    dtype = samples[0]["aux_hidden_states"].dtype
    row = {
        "input_ids": torch.zeros(row_tokens, dtype=torch.long),
        "loss_mask": torch.zeros(row_tokens, dtype=torch.long),
        "aux_hidden_states": torch.zeros(row_tokens, n_aux_h, dtype=dtype),
        "final_hidden_states": torch.zeros(row_tokens, h, dtype=dtype),
        "position_ids": torch.zeros(row_tokens, dtype=torch.long),
        "document_ids": torch.full((row_tokens,), -1, dtype=torch.long),
    }
    at = 0
    for doc, s in enumerate(samples):
        t = min(len(s["input_ids"]), row_tokens - at)
        for k in ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states"):
            row[k][at: at + t] = s[k][:t]
        row["position_ids"][at: at + t] = torch.arange(t)
        row["document_ids"][at: at + t] = doc
        at += t
    return {k: v.unsqueeze(0) for k, v in row.items()}


@dataclass(frozen=True)
class RowPlan:
    """Which samples make one packed row, and the seed of its random draws (COD sampling, hidden noise).

    Plans need sample lengths only, so every process plans every row of a step and reads just its own; the
    seed depends on the row's place in the data order, never on which process trains it.
    """

    samples: list[int]
    seed: int


def row_seed(seed: int, epoch: int, cursor: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + cursor) % 2**63


def plan_next_row(ds: ShardedDataset, pos: DataPosition, seed: int, row_tokens: int) -> RowPlan:
    """Plan the next row from `pos` (advancing it); an epoch boundary starts a new seeded order.

    A sample longer than the row is truncated to it (it then fills a row alone).
    """
    order = epoch_order(len(ds), seed, pos.epoch)
    if pos.cursor >= len(order):
        pos.epoch, pos.cursor = pos.epoch + 1, 0
        order = epoch_order(len(ds), seed, pos.epoch)
    plan_seed = row_seed(seed, pos.epoch, pos.cursor)
    picked, used = [], 0
    while pos.cursor < len(order):
        length = ds.sample_length(order[pos.cursor])
        if picked and used + length > row_tokens:
            break
        picked.append(order[pos.cursor])
        used += length
        pos.cursor += 1
    return RowPlan(picked, plan_seed)


def with_training_loss_mask(row: dict, loss_tokens: str, training: bool) -> dict:
    """The row with the loss mask training scores (train.loss_tokens): "all" marks every real token (padding,
    document id -1, never); evaluation keeps the assistant mask."""
    if not training or loss_tokens == "assistant":
        return row
    return row | {"loss_mask": (row["document_ids"] >= 0).to(row["loss_mask"].dtype)}


def row_noise(like: torch.Tensor, seed: int, stream: int = 0) -> torch.Tensor:
    """Standard normal noise shaped like `like`, drawn on the CPU from the row's seed (device-independent)."""
    g = torch.Generator().manual_seed((seed + stream) % 2**63)
    return torch.randn(like.shape, generator=g, dtype=torch.float32).to(like.device, like.dtype)


def pack_planned_row(ds: ShardedDataset, plan: RowPlan, row_tokens: int, multiple: int = 1) -> dict:
    """Read the plan's samples and pack them; "row_seed" and "num_tokens" (the row's real tokens, padding not
    counted) ride along with the tensors as Python ints, so counting them costs no device sync."""
    samples = ds.read_samples(plan.samples)
    num_tokens = min(row_tokens, sum(len(s["input_ids"]) for s in samples))
    return {**pack_row(samples, row_tokens, multiple), "row_seed": plan.seed, "num_tokens": num_tokens}


def plan_eval_rows(ds: ShardedDataset, max_samples: int, row_tokens: int) -> list[RowPlan]:
    """The first max_samples held-out samples (0 = all), packed in order: the same rows at every evaluation."""
    n = len(ds) if max_samples <= 0 else min(max_samples, len(ds))
    plans, cur, used = [], [], 0
    for i in range(n):
        length = min(ds.sample_length(i), row_tokens)
        if cur and used + length > row_tokens:
            plans.append(RowPlan(cur, len(plans)))
            cur, used = [], 0
        cur.append(i)
        used += length
    if cur:
        plans.append(RowPlan(cur, len(plans)))
    return plans
