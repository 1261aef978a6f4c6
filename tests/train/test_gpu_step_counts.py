"""bench/gpu_step.py's counts behind its MFU figure, against masks enumerated element by element here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_step


def visible_pairs_brute_force(document_ids: list[int], step: int) -> int:
    """Query t sees step-0 key s <= t of its document and its own keys of steps 1..step (DESIGN section 3)."""
    T = len(document_ids)
    return sum(1 for t in range(T) for k in range((step + 1) * T)
               if (k < T and k <= t and document_ids[k] == document_ids[t]) or (k >= T and k % T == t))


@pytest.mark.parametrize("lengths", [[5], [3, 1, 4], [2, 7, 1, 1]])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_attention_pairs_match_the_ttt_mask(lengths, step):
    document_ids = [i for i, n in enumerate(lengths) for _ in range(n)]
    assert gpu_step.ttt_attention_pairs(lengths, step) == visible_pairs_brute_force(document_ids, step)


def test_synthetic_row_fills_the_row_and_scores_responses_only():
    seq = 2048
    lengths = gpu_step.synthetic_documents(seq)
    assert sum(lengths) == seq and min(lengths[:-1]) >= gpu_step.DOC_LENGTHS[0]
    row = gpu_step.synthetic_row(seq, 8, 100, 3, torch.device("cpu"))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for start, n in zip(starts, lengths):  # the prompt part of each document is unscored, the rest scored
        mask = row["loss_mask"][0, start:start + n].tolist()
        prompt = round(gpu_step.PROMPT_FRACTION * n)
        assert mask == [0] * prompt + [1] * (n - prompt)
        assert row["position_ids"][0, start:start + n].tolist() == list(range(n))
    # step j at t learns token t+1+j of t's document: every response token has >= 3 tokens of its document before it
    responses = sum(n - round(gpu_step.PROMPT_FRACTION * n) for n in lengths)
    assert gpu_step.scored_positions_per_step(seq, 3) == [responses] * 3
