"""The vLLM 0.32 drafter contract: config keys, tensor names, shapes and dtypes (DESIGN section 6).

Every fact is read from vllm/model_executor/models/{llama,qwen3}_eagle3.py and
vllm/transformers_utils/configs/{speculators/base.py, speculators/algos.py, eagle.py}.
"""

from __future__ import annotations

import logging

import torch

from draftsmith.data.errors import UserError

logger = logging.getLogger(__name__)

SPEC_KEYS = (
    "method", "arch", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size",
    "num_hidden_layers", "target_hidden_size", "draft_vocab_size", "aux_layer_ids", "fc_norm",
    "norm_output", "norm_before_fc", "norm_before_residual", "mask_token_id", "bos_token_id",
    "eos_token_id", "verifier",
)
POSITIVE_INT_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "vocab_size", "num_hidden_layers", "target_hidden_size", "draft_vocab_size",
)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
METHODS = ("eagle3", "peagle")
ARCHS = ("llama", "qwen3")
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


def check_spec(spec: dict) -> None:
    """Reject a drafter spec (drafter.json) with missing, unknown or impossible fields."""
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise UserError(f"drafter spec: missing field(s) {missing}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise UserError(f"drafter spec: unknown field(s) {unknown} (valid: {list(SPEC_KEYS)})")
    if spec["method"] not in METHODS:
        raise UserError(f"drafter spec: method {spec['method']!r} is not one of {METHODS}")
    if spec["arch"] not in ARCHS:
        raise UserError(f"drafter spec: arch {spec['arch']!r} is not one of {ARCHS}")
    for k in POSITIVE_INT_KEYS:
        if not isinstance(spec[k], int) or isinstance(spec[k], bool) or spec[k] <= 0:
            raise UserError(f"drafter spec: {k} must be a positive int, found {spec[k]!r}")
    for k in NORM_FLAGS:
        if not isinstance(spec[k], bool):
            raise UserError(f"drafter spec: {k} must be true or false, found {spec[k]!r}")
    _check_spec_relations(spec)


def _check_spec_relations(spec: dict) -> None:
    ids = spec["aux_layer_ids"]
    if not ids or not all(isinstance(i, int) and i >= 0 for i in ids) or list(ids) != sorted(set(ids)):
        raise UserError(
            f"drafter spec: aux_layer_ids must be non-empty, ascending, unique ints >= 0; found {ids}"
        )
    if spec["draft_vocab_size"] > spec["vocab_size"]:
        raise UserError(
            f"drafter spec: draft_vocab_size {spec['draft_vocab_size']} exceeds "
            f"the target vocab {spec['vocab_size']}"
        )
    if spec["fc_norm"] and spec["norm_before_fc"]:
        raise UserError("drafter spec: fc_norm and norm_before_fc are exclusive (EAGLE-3.1 uses fc_norm)")
    rope = spec["rope_parameters"]
    if not isinstance(rope, dict) or "rope_type" not in rope or "rope_theta" not in rope:
        raise UserError(f"drafter spec: rope_parameters needs rope_type and rope_theta, found {rope!r}")
    verifier = spec["verifier"]
    if not isinstance(verifier, dict) or set(verifier) != {"name_or_path", "architectures"}:
        raise UserError(
            f"drafter spec: verifier must hold exactly name_or_path and architectures, found {verifier!r}"
        )
    _check_mask_token(spec)


def _check_mask_token(spec: dict) -> None:
    mask = spec["mask_token_id"]
    if spec["method"] == "peagle":
        if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < spec["vocab_size"]:
            raise UserError(
                f"drafter spec: peagle needs mask_token_id in [0, {spec['vocab_size']}), found {mask!r}"
            )
    elif mask is not None:
        raise UserError(f"drafter spec: mask_token_id must be null for method eagle3, found {mask!r}")


def num_aux(spec: dict) -> int:
    return len(spec["aux_layer_ids"])


def fc_input_size(spec: dict) -> int:
    """Width of the concatenated aux hidden states: n_aux * H_t."""
    return num_aux(spec) * spec["target_hidden_size"]


def has_vocab_map(spec: dict) -> bool:
    """vLLM creates draft_id_to_target_id only when draft_vocab_size != the target vocab (llama_eagle3.py)."""
    return spec["draft_vocab_size"] != spec["vocab_size"]


def export_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype) and name in EXPORT_DTYPES.values():
        return name
    if name not in EXPORT_DTYPES:
        raise UserError(f"export dtype {name!r} is not one of {list(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


# ---- tensors ---------------------------------------------------------------------------------------------


def expected_tensors(spec: dict) -> dict[str, TensorSpec]:
    """Exactly the tensors vLLM loads for this spec: name -> (shape, dtype); dtype None = the export dtype."""
    check_spec(spec)
    tensors = dict(_input_tensors(spec))
    for i in range(spec["num_hidden_layers"]):
        tensors.update(_layer_tensors(spec, i))
    tensors.update(_output_tensors(spec))
    return tensors


def _input_tensors(spec: dict) -> dict[str, TensorSpec]:
    h, h_t, fc_in = spec["hidden_size"], spec["target_hidden_size"], fc_input_size(spec)
    out: dict[str, TensorSpec] = {}
    if spec["method"] == "peagle":
        # P-EAGLE trains embed_tokens (the mask token's row); vLLM keeps it when it differs from the target's
        out["embed_tokens.weight"] = ((spec["vocab_size"], h), None)
        out["mask_hidden"] = ((1, fc_in), None)
    if spec["norm_before_fc"]:
        out["input_norm.weight"] = ((fc_in,), None)
    if spec["fc_norm"]:
        out.update({f"fc_norm.{i}.weight": ((h_t,), None) for i in range(num_aux(spec))})
    out["fc.weight"] = ((h, fc_in), None)
    return out


def _layer_tensors(spec: dict, i: int) -> dict[str, TensorSpec]:
    """Layer 0's q/k/v read cat(embeds, hidden) of width 2H; later layers read H (llama_eagle3.py)."""
    h, d, inter = spec["hidden_size"], spec["head_dim"], spec["intermediate_size"]
    q, kv = spec["num_attention_heads"] * d, spec["num_key_value_heads"] * d
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
    if spec["arch"] == "qwen3":
        out[p + "self_attn.q_norm.weight"] = ((d,), None)
        out[p + "self_attn.k_norm.weight"] = ((d,), None)
    out.update({
        p + "post_attention_layernorm.weight": ((h,), None),
        p + "mlp.gate_proj.weight": ((inter, h), None),
        p + "mlp.up_proj.weight": ((inter, h), None),
        p + "mlp.down_proj.weight": ((h, inter), None),
    })
    return out


def _output_tensors(spec: dict) -> dict[str, TensorSpec]:
    h, v_d, v_t = spec["hidden_size"], spec["draft_vocab_size"], spec["vocab_size"]
    out: dict[str, TensorSpec] = {"norm.weight": ((h,), None), "lm_head.weight": ((v_d, h), None)}
    if has_vocab_map(spec):
        out["d2t"] = ((v_d,), torch.int64)
        # vLLM skips t2d; speculators' own loader reads it, and it costs V_t bytes
        out["t2d"] = ((v_t,), torch.bool)
    return out


def dropped_tensors(spec: dict) -> dict[str, str]:
    """Tensors a trained drafter holds that the export leaves out, each with the reason."""
    out = {}
    if spec["method"] == "eagle3":
        out["embed_tokens.weight"] = (
            "EAGLE-3 keeps a frozen copy of the target's embedding; without it vLLM shares the target's "
            "(llm_base_proposer.py _maybe_share_embeddings)"
        )
    if not has_vocab_map(spec):
        out["d2t"] = "draft vocab = target vocab: vLLM has no draft_id_to_target_id and rejects d2t"
        out["t2d"] = "draft vocab = target vocab: the map is the identity"
    return out


def select_export_tensors(state_dict: dict[str, torch.Tensor], spec: dict) -> dict[str, torch.Tensor]:
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


def check_state_dict(state_dict: dict[str, torch.Tensor], spec: dict, dtype: str | torch.dtype) -> None:
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
    if has_vocab_map(spec):
        check_vocab_map(state_dict["d2t"], state_dict["t2d"], spec["vocab_size"])


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


def decoder_config(spec: dict) -> dict:
    """The drafter's decoder as a plain Llama/Qwen3 HF config; vocab_size is the target's (embed, logits)."""
    cfg = {
        "model_type": spec["arch"],
        "architectures": [HF_ARCHITECTURES[spec["arch"]]],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": spec["rms_norm_eps"],
        "rope_parameters": dict(spec["rope_parameters"]),
        "max_position_embeddings": spec["max_position_embeddings"],
        "vocab_size": spec["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": spec["bos_token_id"],
        "eos_token_id": spec["eos_token_id"],
    }
    if spec["arch"] == "llama":
        cfg["mlp_bias"] = False
    return cfg


def norm_flags(spec: dict) -> dict:
    """All four switches, always explicit: an absent norm_before_residual means True on vLLM's eagle3 path
    but False on its peagle path (algos.py)."""
    return {k: spec[k] for k in NORM_FLAGS}


def speculators_config(spec: dict, num_speculative_tokens: int, *, dtype: str | None = None) -> dict:
    """config.json in the speculators layout (no top-level model_type: that is how vLLM detects it)."""
    check_spec(spec)
    _check_num_speculative_tokens(num_speculative_tokens)
    layer = decoder_config(spec)
    if num_aux(spec) != VLLM_DEFAULT_NUM_AUX:
        # vLLM's Llama drafter ignores the top-level ids when sizing fc (vllm issue #54526)
        layer["num_aux_hidden_states"] = num_aux(spec)
    if spec["method"] == "peagle":
        # update_peagle (vllm/transformers_utils/configs/speculators/algos.py) forwards neither fc_norm nor
        # norm_output; keys inside transformer_layer_config survive into the HF config the model reads
        layer["fc_norm"], layer["norm_output"] = spec["fc_norm"], spec["norm_output"]
    cfg = {
        "architectures": [SPECULATORS_ARCHITECTURES[spec["method"]]],
        "speculators_model_type": spec["method"],
        "transformer_layer_config": layer,
        "draft_vocab_size": spec["draft_vocab_size"],
        "target_hidden_size": spec["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(spec["aux_layer_ids"]),
        **norm_flags(spec),
        "tie_word_embeddings": False,
    }
    if spec["method"] == "peagle":
        cfg["mask_token_id"] = spec["mask_token_id"]
    cfg["speculators_config"] = _proposal_config(spec, num_speculative_tokens)
    if dtype is not None:
        cfg["dtype"] = dtype
    return cfg


def _proposal_config(spec: dict, num_speculative_tokens: int) -> dict:
    """vLLM reads proposal_methods[0].speculative_tokens and verifier.name_or_path (speculators/base.py)."""
    greedy = {
        "proposal_type": "greedy",
        "speculative_tokens": num_speculative_tokens,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "algorithm": spec["method"],
        "proposal_methods": [greedy],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": spec["verifier"]["name_or_path"],
            "architectures": list(spec["verifier"]["architectures"]),
        },
    }


def legacy_config(spec: dict, *, dtype: str | None = None) -> dict:
    """config.json in the legacy EAGLE-3 layout: a plain decoder config plus the EAGLE fields.

    Tensor names are the same as in the speculators layout (one loader serves both), so nothing is renamed.
    P-EAGLE needs "parallel_drafting": true in the serving config, as it does in both layouts.
    """
    check_spec(spec)
    cfg = decoder_config(spec)
    cfg["architectures"] = [LEGACY_ARCHITECTURES[spec["arch"]]]
    cfg["draft_vocab_size"] = spec["draft_vocab_size"]
    cfg["target_hidden_size"] = spec["target_hidden_size"]
    # both drafters size fc from these ids and the runner captures them (llama_eagle3.py, gpu_model_runner.py)
    cfg["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": list(spec["aux_layer_ids"]),
        "use_aux_hidden_state": True,
    }
    cfg.update(norm_flags(spec))
    if spec["method"] == "peagle":
        cfg["mask_token_id"] = spec["mask_token_id"]
    if dtype is not None:
        cfg["dtype"] = dtype
    return cfg


def drafter_config(spec: dict, fmt: str, num_speculative_tokens: int, *, dtype: str | None = None) -> dict:
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
