"""The CPU attention kernel both trainers share: one softmax over shared keys under a mask plus per-query own keys.

EAGLE-3's training-time test (each query also sees its own earlier draft steps) and P-EAGLE (each mask slot also
sees its own chain) are the same computation: a masked block of shared keys [S] and a few keys that belong to
one query alone [j]. The own keys are per-query dot products, never a [C, C] map.
"""
from __future__ import annotations

import torch


def attend_shared_and_own_keys(q, k_shared, v_shared, visible, k_own=None, v_own=None) -> torch.Tensor:
    """q [B, kvh, g, C, d]; k/v_shared [B, kvh, S, d]; visible [B or 1, C, S] bool (broadcast over heads);
    k/v_own [B, kvh, C, j, d] or None -> [B, kvh, g, C, d] in q's dtype, computed in at least fp32."""
    work = torch.promote_types(q.dtype, torch.float32)
    qw = q.to(work) * q.shape[-1] ** -0.5  # scaled once here rather than over [C, S] scores
    scores = qw @ k_shared.to(work).unsqueeze(2).transpose(-1, -2)  # [B, kvh, g, C, S]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if k_own is not None:
        own = torch.einsum("bkgcd,bkcjd->bkgcj", qw, k_own.to(work))  # [B, kvh, g, C, j]
        scores = torch.cat([scores, own], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    S = k_shared.shape[-2]
    out = probs[..., :S] @ v_shared.to(work).unsqueeze(2)  # [B, kvh, g, C, d]
    if v_own is not None:
        out = out + torch.einsum("bkgcj,bkcjd->bkgcd", probs[..., S:], v_own.to(work))
    return out.to(q.dtype)
