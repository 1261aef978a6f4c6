"""Pack dataset samples into fixed-size token rows (documents kept apart by document_ids), in a
seeded order per epoch, so that a (epoch, cursor) pair is the whole data position for an exact resume."""
from __future__ import annotations

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


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def pack_row(samples: list[dict], row_tokens: int) -> dict[str, torch.Tensor]:
    """Concatenate samples into one row [1, <= row_tokens] (no trailing padding is kept: the CPU pays for
    every position); document ids separate the samples."""
    row_tokens = min(row_tokens, sum(len(s["input_ids"]) for s in samples))
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


def next_row(ds: ShardedDataset, pos: DataPosition, seed: int, row_tokens: int) -> dict[str, torch.Tensor]:
    """Pack the next row from `pos` (advancing it); an epoch boundary starts a new seeded order.

    A sample longer than the row is truncated to it (it then fills a row alone).
    """
    order = epoch_order(len(ds), seed, pos.epoch)
    picked, used = [], 0
    while True:
        if pos.cursor >= len(order):
            if picked:
                break
            pos.epoch, pos.cursor = pos.epoch + 1, 0
            order = epoch_order(len(ds), seed, pos.epoch)
        length = ds.sample_length(order[pos.cursor])
        if picked and used + length > row_tokens:
            break
        picked.append(ds[order[pos.cursor]])
        used += length
        pos.cursor += 1
    return pack_row(picked, row_tokens)


def eval_rows(ds: ShardedDataset, max_samples: int, row_tokens: int) -> list[dict[str, torch.Tensor]]:
    """The first max_samples held-out samples (0 = all), packed in order: the same rows at every evaluation."""
    n = len(ds) if max_samples <= 0 else min(max_samples, len(ds))
    rows, cur, used = [], [], 0
    for i in range(n):
        length = min(ds.sample_length(i), row_tokens)
        if cur and used + length > row_tokens:
            rows.append(pack_row(cur, row_tokens))
            cur, used = [], 0
        cur.append(ds[i])
        used += length
    if cur:
        rows.append(pack_row(cur, row_tokens))
    return rows
