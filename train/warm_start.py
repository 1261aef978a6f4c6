"""Start a drafter from an exported one (train.init_from): e.g. a P-EAGLE drafter from the EAGLE-3 drafter
of the same dataset, or an EAGLE-3 drafter fine-tuned from a published speculator.

The exported folder's tensors use the drafter's own state-dict names (export/format.py); `midlayer.` is
the legacy alias of `layers.0.`. Layers the source lacks start as the identity (zero o_proj and down_proj),
so at step 0 the new drafter predicts depth 0 exactly as the source does. Tensors a P-EAGLE drafter has
and an EAGLE-3 export lacks (`embed_tokens`, `mask_hidden`, `t2d`) keep their fresh values.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.data.errors import UserError
from draftsmith.train.drafter import Drafter

logger = logging.getLogger(__name__)

OPTIONAL_IN_SOURCE = ("embed_tokens.weight", "mask_hidden", "t2d", "d2t")  # d2t: absent for a full vocab


def read_exported_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """model.safetensors of an exported drafter folder, with `midlayer.` renamed to `layers.0.`."""
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise UserError(f"train.init_from: {path} not found; point it at an exported drafter folder "
                        "(the `drafter/` of a finished run)")
    try:
        tensors = load_file(str(path))
    except SafetensorError as e:
        raise UserError(f"train.init_from: {path} is not a readable safetensors file ({e})") from None
    return {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in tensors.items()}


@torch.no_grad()
def init_drafter_from_exported(drafter: Drafter, folder: str | Path) -> None:
    """Copy every tensor of the exported drafter at `folder` into `drafter`; refuse any mismatch by name."""
    source = read_exported_tensors(folder)
    own = drafter.state_dict()
    unknown = sorted(source.keys() - own.keys())
    if unknown:
        raise UserError(f"train.init_from={folder}: tensors {unknown[:4]} have no place in this drafter "
                        "(other norms, arch or more layers than drafter.num_layers?)")
    for name, tensor in source.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise UserError(f"train.init_from={folder}: {name} has shape {tuple(tensor.shape)}, this drafter "
                            f"has {tuple(own[name].shape)}; match drafter.* and the dataset to the source")
    source_d2t = source.get("d2t", torch.zeros_like(drafter.d2t))  # no d2t: draft vocab = target vocab
    if not torch.equal(source_d2t.long(), drafter.d2t):
        raise UserError(f"train.init_from={folder}: its draft vocabulary (d2t) differs from this dataset's; "
                        "warm-start only from a drafter trained on the same vocab.safetensors")
    missing = sorted(own.keys() - source.keys())
    new_layers = sorted({int(m.group(1)) for k in missing if (m := re.match(r"layers\.(\d+)\.", k))})
    lacking = [k for k in missing if not k.startswith("layers.") and k not in OPTIONAL_IN_SOURCE]
    partial = [i for i in new_layers if any(k.startswith(f"layers.{i}.") for k in source)]
    if lacking or 0 in new_layers or partial:
        what = lacking or [f"part of layers.{(partial or [0])[0]}.*"]
        raise UserError(f"train.init_from={folder}: the source lacks {what[:4]}")
    for name, tensor in source.items():
        own[name].copy_(tensor.to(own[name].dtype))
    for i in new_layers:  # residual branches off: layer i passes h through unchanged until it learns
        drafter.layers[i].self_attn.o_proj.weight.zero_()
        drafter.layers[i].mlp.down_proj.weight.zero_()
    logger.info("drafter initialised from %s (%d tensors)%s", folder, len(source),
                f"; layers {new_layers} start as the identity" if new_layers else "")
