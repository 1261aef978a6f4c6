"""The vLLM 0.32 drafter contract: config keys, tensor names, shapes and dtypes (DESIGN section 6).

Every fact is read from vllm/model_executor/models/{llama,qwen3}_eagle3.py and
vllm/transformers_utils/configs/{speculators/base.py, speculators/algos.py, eagle.py}.
"""

from __future__ import annotations

import logging

import torch

from draftsmith.data.errors import UserError
from draftsmith.train.spec import DrafterSpec

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("speculators", "legacy")
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# the class names speculators writes; vLLM ignores them and derives the class from model_type (algos.py)
SPECULATORS_ARCHITECTURES = {"eagle3": "Eagle3DraftModel", "peagle": "PEagleDraftModel"}
# names vLLM's registry maps to Eagle3LlamaForCausalLM / Eagle3Qwen3ForCausalLM; EAGLEConfig keeps a name
# that starts or ends with "Eagle3" (registry.py, configs/eagle.py)
LEGACY_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# the Llama drafter sizes fc from num_aux_hidden_states or eagle_config ids, else 3 (llama_eagle3.py)
VLLM_DEFAULT_NUM_AUX = 3

TensorSpec = tuple[tuple[int, ...], "torch.dtype | None"]


def export_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype) and name in EXPORT_DTYPES.values():
        return name
    if name not in EXPORT_DTYPES:
        raise UserError(f"export dtype {name!r} is not one of {list(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


# ---- tensors ---------------------------------------------------------------------------------------------


def expected_tensors(spec: DrafterSpec) -> dict[str, TensorSpec]:
    """Exactly the tensors vLLM loads for this spec: name -> (shape, dtype); dtype None = the export dtype."""
    tensors = dict(_input_tensors(spec))
    for i in range(spec.num_hidden_layers):
        tensors.update(_layer_tensors(spec, i))
    tensors.update(_output_tensors(spec))
    return tensors


def _input_tensors(spec: DrafterSpec) -> dict[str, TensorSpec]:
    h, h_t, fc_in = spec.hidden_size, spec.target_hidden_size, spec.fc_input_size
    out: dict[str, TensorSpec] = {}
    if spec.method == "peagle":
        # P-EAGLE trains embed_tokens (the mask token's row); vLLM keeps it when it differs from the target's
        out["embed_tokens.weight"] = ((spec.vocab_size, h), None)
        out["mask_hidden"] = ((1, fc_in), None)
    if spec.norm_before_fc:
        out["input_norm.weight"] = ((fc_in,), None)
    if spec.fc_norm:
        out.update({f"fc_norm.{i}.weight": ((h_t,), None) for i in range(spec.num_aux)})
    out["fc.weight"] = ((h, fc_in), None)
    return out


def _layer_tensors(spec: DrafterSpec, i: int) -> dict[str, TensorSpec]:
    """Layer 0's q/k/v read cat(embeds, hidden) of width 2H; later layers read H (llama_eagle3.py)."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    qkv_in = 2 * h if i == 0 else h
    p = f"layers.{i}."
    out: dict[str, TensorSpec] = {p + "input_layernorm.weight": ((h,), None)}
    if i == 0:
        out[p + "hidden_norm.weight"] = ((h,), None)
    out.update({
        p + "self_attn.q_proj.weight": ((q, qkv_in), None),
        p + "self_attn.k_proj.weight": ((kv, qkv_in), None),
        p + "self_attn.v_proj.weight": ((kv, qkv_in), None),
        p + "self_attn.o_proj.weight": ((h, q), None),
    })
    if spec.arch == "qwen3":
        out[p + "self_attn.q_norm.weight"] = ((d,), None)
        out[p + "self_attn.k_norm.weight"] = ((d,), None)
    out.update({
        p + "post_attention_layernorm.weight": ((h,), None),
        p + "mlp.gate_proj.weight": ((inter, h), None),
        p + "mlp.up_proj.weight": ((inter, h), None),
        p + "mlp.down_proj.weight": ((h, inter), None),
    })
    return out


def _output_tensors(spec: DrafterSpec) -> dict[str, TensorSpec]:
    h, v_d, v_t = spec.hidden_size, spec.draft_vocab_size, spec.vocab_size
    out: dict[str, TensorSpec] = {"norm.weight": ((h,), None), "lm_head.weight": ((v_d, h), None)}
    if spec.has_vocab_map:
        out["d2t"] = ((v_d,), torch.int64)
        # vLLM skips t2d; speculators' own loader reads it, and it costs V_t bytes
        out["t2d"] = ((v_t,), torch.bool)
    return out


def dropped_tensors(spec: DrafterSpec) -> dict[str, str]:
    """Tensors a trained drafter holds that the export leaves out, each with the reason."""
    out = {}
    if spec.method == "eagle3":
        out["embed_tokens.weight"] = (
            "EAGLE-3 keeps a frozen copy of the target's embedding; without it vLLM shares the target's "
            "(llm_base_proposer.py _maybe_share_embeddings)"
        )
    if not spec.has_vocab_map:
        out["d2t"] = "draft vocab = target vocab: vLLM has no draft_id_to_target_id and rejects d2t"
        out["t2d"] = "draft vocab = target vocab: the map is the identity"
    return out


def select_export_tensors(state_dict: dict[str, torch.Tensor], spec: DrafterSpec) -> dict[str, torch.Tensor]:
    """The drafter's state dict without dropped_tensors(spec); d2t must be the identity to be dropped."""
    dropped = dropped_tensors(spec)
    d2t = state_dict.get("d2t")
    if "d2t" in dropped and d2t is not None and bool(d2t.ne(0).any()):
        raise UserError(
            "d2t is not all zeros although draft_vocab_size equals the target vocab; the map is broken"
        )
    for name in sorted(dropped.keys() & state_dict.keys()):
        logger.info("export: leaving out %s (%s)", name, dropped[name])
    return {k: v for k, v in state_dict.items() if k not in dropped}


def check_state_dict(state_dict: dict[str, torch.Tensor], spec: DrafterSpec, dtype: str | torch.dtype) -> None:
    """Raise naming the first missing, unexpected, mis-shaped, mis-typed or non-finite tensor, or a bad d2t.

    vLLM aborts on an unexpected tensor but leaves a missing one uninitialised, so this check is ours.
    """
    expected = expected_tensors(spec)
    dtype = export_dtype(dtype)
    missing = [k for k in expected if k not in state_dict]
    if missing:
        raise UserError(
            f"drafter tensor {missing[0]!r} is missing ({len(missing)} missing in all: {missing[:8]})"
        )
    unexpected = sorted(k for k in state_dict if k not in expected)
    if unexpected:
        name = unexpected[0]
        why = dropped_tensors(spec).get(name)
        hint = f"; leave it out: {why}" if why else " (vLLM refuses to load a tensor it has no parameter for)"
        raise UserError(f"drafter tensor {name!r} is unexpected for this spec{hint}")
    for name, (shape, want) in expected.items():
        _check_tensor(name, state_dict[name], shape, want or dtype)
    if spec.has_vocab_map:
        check_vocab_map(state_dict["d2t"], state_dict["t2d"], spec.vocab_size)


def _check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape:
        raise UserError(f"drafter tensor {name!r}: expected shape {list(shape)}, found {list(t.shape)}")
    if t.dtype != dtype:
        raise UserError(f"drafter tensor {name!r}: expected dtype {dtype}, found {t.dtype}")
    if t.is_floating_point():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise UserError(
                f"drafter tensor {name!r} holds {bad} non-finite values (NaN/inf); the training diverged"
            )


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """d2t: offsets (target id = i + d2t[i]) to strictly increasing ids in [0, V_t); t2d marks the same."""
    targets = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    out_of_range = ((targets < 0) | (targets >= vocab_size)).nonzero()
    if out_of_range.numel():
        i = int(out_of_range[0])
        raise UserError(
            f"d2t[{i}]={int(d2t[i])} maps draft id {i} to {int(targets[i])}, outside [0, {vocab_size})"
        )
    not_increasing = (targets[1:] <= targets[:-1]).nonzero()
    if not_increasing.numel():
        i = int(not_increasing[0]) + 1
        raise UserError(
            f"d2t: target ids must strictly increase, but draft id {i} maps to {int(targets[i])} "
            f"after {int(targets[i - 1])}"
        )
    marked = t2d.nonzero().flatten()
    if marked.numel() != targets.numel() or not torch.equal(marked, targets):
        pairs = zip(marked.tolist(), targets.tolist())
        first = next((j for j, (a, b) in enumerate(pairs) if a != b), min(marked.numel(), targets.numel()))
        raise UserError(
            f"t2d marks {marked.numel()} target ids but d2t maps to {targets.numel()}; "
            f"first disagreement at draft id {first}"
        )


# ---- config.json -------------------------------------------------------------------------------------------


def decoder_config(spec: DrafterSpec) -> dict:
    """The drafter's decoder as a plain Llama/Qwen3 HF config; vocab_size is the target's (embed, logits)."""
    cfg = {
        "model_type": spec.arch,
        "architectures": [HF_ARCHITECTURES[spec.arch]],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": dict(spec.rope_parameters),
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
    }
    if spec.arch == "llama":
        cfg["mlp_bias"] = False
    return cfg




def speculators_config(spec: DrafterSpec, num_speculative_tokens: int, *, dtype: str | None = None) -> dict:
    """config.json in the speculators layout (no top-level model_type: that is how vLLM detects it)."""
    _check_num_speculative_tokens(num_speculative_tokens)
    layer = decoder_config(spec)
    if spec.num_aux != VLLM_DEFAULT_NUM_AUX:
        # vLLM's Llama drafter ignores the top-level ids when sizing fc (vllm issue #54526)
        layer["num_aux_hidden_states"] = spec.num_aux
    if spec.method == "peagle":
        # update_peagle (vllm/transformers_utils/configs/speculators/algos.py) forwards neither fc_norm nor
        # norm_output; keys inside transformer_layer_config survive into the HF config the model reads
        layer["fc_norm"], layer["norm_output"] = spec.fc_norm, spec.norm_output
    cfg = {
        "architectures": [SPECULATORS_ARCHITECTURES[spec.method]],
        "speculators_model_type": spec.method,
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        # all four, always: an absent norm_before_residual means True for eagle3 but False for peagle (algos.py)
        **spec.norm_flags(),
        "tie_word_embeddings": False,
    }
    if spec.method == "peagle":
        cfg["mask_token_id"] = spec.mask_token_id
    cfg["speculators_config"] = _proposal_config(spec, num_speculative_tokens)
    if dtype is not None:
        cfg["dtype"] = dtype
    return cfg


def _proposal_config(spec: DrafterSpec, num_speculative_tokens: int) -> dict:
    """vLLM reads proposal_methods[0].speculative_tokens and verifier.name_or_path (speculators/base.py)."""
    greedy = {
        "proposal_type": "greedy",
        "speculative_tokens": num_speculative_tokens,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "algorithm": spec.method,
        "proposal_methods": [greedy],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": spec.verifier_name_or_path,
            "architectures": list(spec.verifier_architectures),
        },
    }


def legacy_config(spec: DrafterSpec, *, dtype: str | None = None) -> dict:
    """config.json in the legacy EAGLE-3 layout: a plain decoder config plus the EAGLE fields.

    Tensor names are the same as in the speculators layout (one loader serves both), so nothing is renamed.
    P-EAGLE needs "parallel_drafting": true in the serving config, as it does in both layouts.
    """
    cfg = decoder_config(spec)
    cfg["architectures"] = [LEGACY_ARCHITECTURES[spec.arch]]
    cfg["draft_vocab_size"] = spec.draft_vocab_size
    cfg["target_hidden_size"] = spec.target_hidden_size
    # both drafters size fc from these ids and the runner captures them (llama_eagle3.py, gpu_model_runner.py)
    cfg["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "use_aux_hidden_state": True,
    }
    cfg.update(spec.norm_flags())
    if spec.method == "peagle":
        cfg["mask_token_id"] = spec.mask_token_id
    if dtype is not None:
        cfg["dtype"] = dtype
    return cfg


def drafter_config(spec: DrafterSpec, fmt: str, num_speculative_tokens: int, *, dtype: str | None = None) -> dict:
    """config.json for either layout."""
    if fmt == "speculators":
        return speculators_config(spec, num_speculative_tokens, dtype=dtype)
    if fmt == "legacy":
        _check_num_speculative_tokens(num_speculative_tokens)
        return legacy_config(spec, dtype=dtype)
    raise UserError(f"export format {fmt!r} is not one of {EXPORT_FORMATS}")


def _check_num_speculative_tokens(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"num_speculative_tokens must be an int >= 1, found {k!r}")


# ---- config.json -> spec -------------------------------------------------------------------------------------

# vLLM's value for an absent flag (vllm/transformers_utils/configs/speculators/algos.py); speculators' own
# trainer leaves some out
VLLM_NORM_DEFAULTS = {"eagle3": {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False,
                                 "norm_output": False},
                      "peagle": {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
                                 "norm_output": False}}


def spec_from_drafter_config(config: dict, where: str = "drafter config.json") -> DrafterSpec:
    """The DrafterSpec of an exported folder's config.json, in either layout, ours or another trainer's (the
    inverse of drafter_config); absent norm flags take vLLM's defaults, as vLLM would serve them."""
    legacy = "speculators_model_type" not in config
    try:
        if legacy:
            layer, top = config, {**config, **(config.get("eagle_config") or {})}
            method = "peagle" if config.get("mask_token_id") is not None else "eagle3"
            arch = next(a for a, name in LEGACY_ARCHITECTURES.items() if name in config.get("architectures", []))
            verifier = {}
        else:
            layer, top, method = config["transformer_layer_config"], config, config["speculators_model_type"]
            arch = layer["model_type"]
            verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        flags = {k: bool(top.get(k, layer.get(k, default))) for k, default in VLLM_NORM_DEFAULTS[method].items()}
        return DrafterSpec(
            method=method, arch=arch, hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            rms_norm_eps=layer["rms_norm_eps"], rope_parameters=layer["rope_parameters"],
            max_position_embeddings=layer["max_position_embeddings"], vocab_size=layer["vocab_size"],
            num_hidden_layers=layer["num_hidden_layers"],
            # speculators' trainer writes null, which vLLM reads as the drafter's own width
            target_hidden_size=top.get("target_hidden_size") or layer["hidden_size"],
            draft_vocab_size=top["draft_vocab_size"], aux_layer_ids=tuple(top["eagle_aux_hidden_state_layer_ids"]),
            mask_token_id=top.get("mask_token_id") if method == "peagle" else None,
            bos_token_id=layer.get("bos_token_id"), eos_token_id=layer.get("eos_token_id"),
            verifier_name_or_path=verifier.get("name_or_path") or "",
            verifier_architectures=tuple(verifier.get("architectures") or ()), **flags)
    except (KeyError, StopIteration) as e:
        raise UserError(f"{where}: not a drafter config vLLM can serve (missing {e})") from None
