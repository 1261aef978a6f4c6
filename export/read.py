"""Read an exported drafter folder back into train/drafter.py's module, as vLLM builds it from the same files.

The held-out scorer of the benches and the vLLM parity test score exported drafters (ours and speculators') with
this one reader, so a drafter is judged as it is served, not as the trainer last held it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.data.errors import UserError
from draftsmith.data.target import load_target_head
from draftsmith.data.vocab import draft_to_target_ids
from draftsmith.export.format import spec_from_drafter_config
from draftsmith.train.drafter import Drafter, init_drafter_from_target
from draftsmith.train.spec import DrafterSpec
from draftsmith.train.warm_start import read_exported_tensors

# vLLM shares the target's embedding with a drafter whose checkpoint has none; mask_hidden is P-EAGLE's only
SHARED_OR_OPTIONAL = {"embed_tokens.weight", "mask_hidden"}


def drafter_as_served(spec: DrafterSpec, tensors: dict[str, torch.Tensor], target_embed: torch.Tensor) -> Drafter:
    """A Drafter of `spec` holding `tensors` in fp32, eval mode; embed_tokens is `target_embed` unless the tensors
    carry their own (P-EAGLE, speculators' exports); t2d is derived from d2t when the folder has none."""
    drafter = Drafter(spec)
    d2t = tensors["d2t"].long() if "d2t" in tensors else torch.zeros(spec.draft_vocab_size, dtype=torch.long)
    if "t2d" in tensors:
        t2d = tensors["t2d"].bool()
    else:
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[draft_to_target_ids(d2t)] = True
    init_drafter_from_target(drafter, target_embed, d2t, t2d)
    missing, unexpected = drafter.load_state_dict({**tensors, "d2t": d2t, "t2d": t2d}, strict=False)
    if unexpected or set(missing) - SHARED_OR_OPTIONAL:
        raise UserError(f"exported tensors do not fit the drafter of its config: unexpected {sorted(unexpected)[:4]}, "
                        f"missing {sorted(set(missing) - SHARED_OR_OPTIONAL)[:4]}")
    return drafter.float().eval()


def read_drafter_folder(folder: str | Path, target_path: str) -> Drafter:
    """An exported speculators-format (or legacy) folder as a Drafter, its embedding shared with the target's."""
    config = Path(folder) / "config.json"
    spec = spec_from_drafter_config(json.loads(config.read_text()), str(config))
    return drafter_as_served(spec, read_exported_tensors(folder), load_target_head(target_path)["embed"].float())
