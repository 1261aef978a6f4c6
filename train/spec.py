"""The drafter spec: every fact that defines a drafter besides its weights, the one place it is defined.

Field names are Hugging Face's where HF has one (`num_attention_heads`, `rope_parameters`, ...). The spec builds
the module (train/drafter.py), is saved beside the weights (`drafter.json` of a checkpoint's drafter bundle), and
is the only thing export/format.py turns into a vLLM config.json, and reads back from one.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from draftsmith.data.config import DrafterConfig
from draftsmith.data.errors import UserError

METHODS = ("eagle3", "peagle")
ARCHS = ("llama", "qwen3")
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


@dataclass(frozen=True, kw_only=True)
class DrafterSpec:
    method: Literal["eagle3", "peagle"]
    """eagle3 (EAGLE-3 / EAGLE-3.1) or peagle (parallel drafting)."""
    arch: Literal["llama", "qwen3"]
    """The decoder layer's family (qwen3 adds q/k norms)."""
    hidden_size: int
    """Drafter width H (= the target's)."""
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict = field(hash=False)
    """The target's transformers-5 `rope_parameters` (rope_type, rope_theta, scaling keys)."""
    max_position_embeddings: int
    vocab_size: int
    """Target vocab V_t (embed_tokens rows, t2d length)."""
    num_hidden_layers: int
    """Drafter decoder layers."""
    target_hidden_size: int
    """H_t, the width of each aux hidden state."""
    draft_vocab_size: int
    """Draft vocab V_d (lm_head rows, d2t length)."""
    aux_layer_ids: tuple[int, ...]
    """Ascending target layer ids whose states are concatenated before fc (data/layer_ids.py)."""
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = True
    mask_token_id: int | None = None
    """P-EAGLE's mask token (a target id); None for eagle3."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    verifier_name_or_path: str = ""
    """The target as vLLM should find it: a Hub id, or a folder."""
    verifier_architectures: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        object.__setattr__(self, "verifier_architectures", tuple(self.verifier_architectures))
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        check_spec_fields(self)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_input_size(self) -> int:
        """Width of the concatenated aux hidden states: n_aux * H_t."""
        return self.num_aux * self.target_hidden_size

    @property
    def has_vocab_map(self) -> bool:
        """vLLM creates draft_id_to_target_id only when draft_vocab_size != the target vocab (llama_eagle3.py)."""
        return self.draft_vocab_size != self.vocab_size

    @property
    def parallel_drafting(self) -> bool:
        return self.method == "peagle"

    def norm_flags(self) -> dict[str, bool]:
        return {k: getattr(self, k) for k in NORM_FLAGS}

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, values: dict, where: str = "drafter spec") -> DrafterSpec:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise UserError(f"{where}: unknown field(s) {unknown} (valid: {names})")
        try:
            return cls(**values)
        except TypeError as e:  # a required field is missing
            raise UserError(f"{where}: {e}") from None

    def save(self, path: Path) -> None:
        from draftsmith.data.manifest import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> DrafterSpec:
        from draftsmith.data.manifest import read_json

        return cls.from_dict(read_json(path, "drafter spec"), str(path))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_spec_fields(spec: DrafterSpec) -> None:
    """Refuse impossible specs at construction, naming the field."""
    if spec.method not in METHODS:
        raise UserError(f"drafter spec: method {spec.method!r} is not one of {METHODS}")
    if spec.arch not in ARCHS:
        raise UserError(f"drafter spec: arch {spec.arch!r} is not one of {ARCHS}")
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "vocab_size", "num_hidden_layers", "target_hidden_size", "draft_vocab_size"):
        if not _is_int(getattr(spec, k)) or getattr(spec, k) <= 0:
            raise UserError(f"drafter spec: {k} must be a positive int, found {getattr(spec, k)!r}")
    for k in NORM_FLAGS:
        if not isinstance(getattr(spec, k), bool):
            raise UserError(f"drafter spec: {k} must be true or false, found {getattr(spec, k)!r}")
    ids = spec.aux_layer_ids
    if not ids or not all(_is_int(i) and i >= 0 for i in ids) or list(ids) != sorted(set(ids)):
        raise UserError(f"drafter spec: aux_layer_ids must be non-empty, ascending, unique ints >= 0; found {list(ids)}")
    if spec.draft_vocab_size > spec.vocab_size:
        raise UserError(f"drafter spec: draft_vocab_size {spec.draft_vocab_size} exceeds the target vocab "
                        f"{spec.vocab_size}")
    if spec.fc_norm and spec.norm_before_fc:
        raise UserError("drafter spec: fc_norm and norm_before_fc are exclusive (EAGLE-3.1 uses fc_norm)")
    check_rope_parameters(spec.rope_parameters)
    if spec.method == "peagle":
        if not _is_int(spec.mask_token_id) or not 0 <= spec.mask_token_id < spec.vocab_size:
            raise UserError(f"drafter spec: peagle needs mask_token_id in [0, {spec.vocab_size}), "
                            f"found {spec.mask_token_id!r}")
    elif spec.mask_token_id is not None:
        raise UserError(f"drafter spec: mask_token_id must be null for method eagle3, found {spec.mask_token_id!r}")


def check_rope_parameters(rope: dict) -> None:
    """Reject RoPE variants the drafter does not implement (it must rotate exactly like vLLM will)."""
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise UserError(f"rope_parameters {rope!r} has no rope_theta (expected transformers>=5 format)")
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(f"target rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported (need 1.0)")


def spec_for_target(target_config, drafter: DrafterConfig, *, method: str, aux_layer_ids, draft_vocab_size: int,
                    mask_token_id: int | None = None, verifier_name_or_path: str = "") -> DrafterSpec:
    """The drafter of run config section `drafter` (arch, layers, norm switches) for the target whose HF config
    is `target_config`: its layers mirror the target's."""
    c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    if getattr(c, "hidden_act", "silu") != "silu":
        raise UserError(f"target hidden_act is {c.hidden_act!r}; the drafter's MLP is SwiGLU and needs 'silu'")
    if not 0 < draft_vocab_size <= c.vocab_size:
        raise UserError(f"draft_vocab_size {draft_vocab_size} must lie in [1, target vocab {c.vocab_size}]")
    if drafter.arch == "qwen3" and getattr(c, "head_dim", None) is None:
        raise UserError("drafter.arch=qwen3 needs a target config with head_dim")
    return DrafterSpec(
        method=method, arch=drafter.arch, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(getattr(c, "rope_parameters", None) or {}),
        max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
        num_hidden_layers=drafter.num_layers, target_hidden_size=c.hidden_size, draft_vocab_size=draft_vocab_size,
        aux_layer_ids=tuple(aux_layer_ids), **{k: getattr(drafter, k) for k in NORM_FLAGS},
        mask_token_id=mask_token_id,
        bos_token_id=getattr(c, "bos_token_id", None), eos_token_id=getattr(c, "eos_token_id", None),
        verifier_name_or_path=verifier_name_or_path,
        verifier_architectures=tuple(getattr(target_config, "architectures", None) or ()))
