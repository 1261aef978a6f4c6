"""The aux-layer id convention (DESIGN section 2), the one place it is defined.

Aux id k = the residual stream after k decoder layers = HF `output_hidden_states[k]` (0 = embeddings),
pre-final-norm. Ids lie in 0..N: N, the stream after the last layer, is what vLLM's target forward takes as
`idx + 1` after its last layer (`_maybe_add_hidden_state`), so capture, check and validate all accept it.
vLLM uses the same ids, sorts and de-duplicates them and concatenates in ascending order.
SGLang/SpecForge write k-1 for the same tensor (`from_sglang_layer_ids`).
"""
from __future__ import annotations

from draftsmith.data.errors import UserError


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """vLLM's default for EAGLE-3 targets: [2, N//2, N-3]."""
    n = num_hidden_layers
    return normalize_aux_layer_ids([2, n // 2, n - 3], n)


def normalize_aux_layer_ids(layer_ids, num_hidden_layers: int) -> list[int]:
    """Sorted, de-duplicated ids as vLLM concatenates them; each must lie in [0, N]."""
    ids = sorted({int(i) for i in layer_ids})
    bad = [i for i in ids if not 0 <= i <= num_hidden_layers]
    if bad:
        raise UserError(f"aux layer ids {bad} are outside [0, {num_hidden_layers}] for a {num_hidden_layers}-layer target")
    if not ids:
        raise UserError("aux layer ids are empty")
    return ids


def resolve_aux_layer_ids(configured, num_hidden_layers: int) -> list[int]:
    """The configured ids, or the default when none are configured."""
    if configured:
        return normalize_aux_layer_ids(configured, num_hidden_layers)
    return default_aux_layer_ids(num_hidden_layers)


def from_sglang_layer_ids(layer_ids) -> list[int]:
    """SGLang/SpecForge name the output of layer i as i; we (and vLLM, HF) call it i+1."""
    return [int(i) + 1 for i in layer_ids]
