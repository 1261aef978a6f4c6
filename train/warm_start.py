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


DENSE_LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                       "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                       "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@torch.no_grad()
def init_layers_from_target(drafter: Drafter, target_layers: list[dict[str, torch.Tensor]]) -> None:
    """train.layer_init=target: drafter layer i starts as target_layers[i], the target's decoder layer top + i,
    where top is the highest aux id (aux id k is the stream that enters HF layer k), and fc starts by passing
    the top aux block through. Layer 0's q/k/v see only the hidden half of cat(embed, hidden) (the embedding
    half starts at zero) and its hidden_norm takes the target layer's input norm. Without drafter norms the
    drafter's step 0 is then exactly the target's layers above its top aux layer: an early exit it trains on
    from there. Dense layers only (a mixture-of-experts MLP has no drafter counterpart)."""
    spec, H = drafter.spec, drafter.spec.hidden_size
    if spec.target_hidden_size != H:
        raise UserError(f"train.layer_init=target needs the drafter width ({H}) to equal the target's "
                        f"({spec.target_hidden_size})")
    for i, (layer, source) in enumerate(zip(drafter.layers, target_layers)):
        missing = [k for k in DENSE_LAYER_TENSORS if k not in source]
        if missing:
            raise UserError(f"train.layer_init=target: the target layer lacks {missing[:3]} (a dense Llama/Qwen3 "
                            "layer is needed; mixture-of-experts targets train from random init)")
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = source[f"self_attn.{name}.weight"]
            own = getattr(attn, name).weight
            if i == 0:  # [out, 2H]: cat(embed, hidden); the target's projection goes on the hidden half
                own.zero_()
                own[:, H:].copy_(weight)
            else:
                own.copy_(weight)
        attn.o_proj.weight.copy_(source["self_attn.o_proj.weight"])
        for name in ("q_norm", "k_norm"):
            if getattr(attn, name) is not None and f"self_attn.{name}.weight" in source:
                getattr(attn, name).weight.copy_(source[f"self_attn.{name}.weight"])
        (layer.hidden_norm if i == 0 else layer.input_layernorm).weight.copy_(source["input_layernorm.weight"])
        layer.post_attention_layernorm.weight.copy_(source["post_attention_layernorm.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(source[f"mlp.{name}.weight"])
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -spec.target_hidden_size:].copy_(torch.eye(H))
    logger.info("drafter layers initialised from %d target layer(s); fc passes the top aux layer through",
                len(target_layers))
