"""The EAGLE-3 / EAGLE-3.1 / P-EAGLE drafter; attribute names are vLLM's checkpoint tensor names.

Math follows vLLM 0.32 `model_executor/models/llama_eagle3.py` and `qwen3_eagle3.py` (DESIGN sections 3-6).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.data.errors import UserError
from draftsmith.train.spec import DrafterSpec

# attention(layer_idx, q [B, heads, T, d], k [B, kv_heads, T, d], v) -> [B, heads, T, d]; RoPE already applied
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope_inv_freq(head_dim: int, rope: dict, device=None) -> torch.Tensor:
    """Inverse frequencies in float64 [head_dim // 2], scaled for rope_type llama3 (Llama-3.1) or yarn (GPT-OSS)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = rope["rope_theta"] ** -exponents
    rope_type = rope.get("rope_type", "default")
    if rope_type == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, rope)
    if rope_type != "llama3":
        return inv_freq
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, rope: dict) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are interpolated
    (divided by `factor`), those that turn more than beta_fast times are kept, with a linear ramp between."""
    factor, old_len, base = rope["factor"], rope["original_max_position_embeddings"], rope["rope_theta"]

    def dim_turning(times: float) -> float:  # the (fractional) pair index whose wave turns `times` over old_len
        return head_dim * math.log(old_len / (times * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(rope.get("beta_fast") or 32), dim_turning(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    # the ramp is float32 in transformers and vLLM: computed the same way so both sides rotate alike
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(torch.float64).to(inv_freq.device)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(rope: dict) -> float:
    """YaRN scales cos and sin by 0.1 ln(factor) + 1 (or the config's attention_factor); 1 otherwise."""
    if rope.get("rope_type", "default") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")

    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all:
        return get(rope["factor"], mscale) / get(rope["factor"], mscale_all)
    return get(rope["factor"])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, like HF Llama and vLLM."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype != torch.float64 else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DrafterAttention(nn.Module):
    """q/k/v/o projections (+ Qwen3 per-head q_norm/k_norm); the score computation is supplied by the caller."""

    def __init__(self, spec: DrafterSpec, in_size: int):
        super().__init__()
        d, heads, kv_heads = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        self.q_proj = nn.Linear(in_size, heads * d, bias=False)
        self.k_proj = nn.Linear(in_size, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_size, kv_heads * d, bias=False)
        self.o_proj = nn.Linear(heads * d, spec.hidden_size, bias=False)
        qk_norm = spec.arch == "qwen3"
        self.q_norm = RMSNorm(d, spec.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps) if qk_norm else None

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, heads, d]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, kv_heads, d]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, d]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v


class DrafterMLP(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Layer 0 reads cat(input_layernorm(embed), hidden_norm(h)) (width 2H); later layers are plain Llama layers."""

    def __init__(self, spec: DrafterSpec, layer_idx: int):
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_idx = layer_idx
        self.norm_before_residual = spec.norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps) if layer_idx == 0 else None
        in_size = 2 * H if layer_idx == 0 else H
        self.self_attn = DrafterAttention(spec, in_size)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = DrafterMLP(spec)

    def forward(self, embeds, h, cos, sin, attention: AttentionFn) -> torch.Tensor:
        # --- attention (vLLM llama_eagle3.LlamaDecoderLayer.forward) ---
        if self.hidden_norm is not None:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        else:
            residual, x = h, self.input_layernorm(h)
        q, k, v = self.self_attn.project_qkv(x, cos, sin)
        out = attention(self.layer_idx, q, k, v)  # [B, heads, T, d]
        h = residual + self.self_attn.o_proj(out.transpose(1, 2).flatten(2))  # [B, T, H]
        # --- MLP ---
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    """state_dict() is the vLLM tensor set; `mask_hidden` exists only for parallel drafting (P-EAGLE).

    embed_tokens is frozen (EAGLE-3) unless parallel drafting, where the mask token's embedding is trained.
    """

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        fc_in, eps, parallel = spec.fc_input_size, spec.rms_norm_eps, spec.parallel_drafting
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_tokens.weight.requires_grad_(parallel)
        self.input_norm = RMSNorm(fc_in, eps) if spec.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList([RMSNorm(spec.target_hidden_size, eps) for _ in range(spec.num_aux)])
            if spec.fc_norm
            else None
        )
        self.fc = nn.Linear(fc_in, spec.hidden_size, bias=False)
        self.layers = nn.ModuleList([DrafterLayer(spec, i) for i in range(spec.num_hidden_layers)])
        self.norm = RMSNorm(spec.hidden_size, eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[: spec.draft_vocab_size] = True  # identity map until init_drafter_from_target sets the real one
        self.register_buffer("t2d", t2d)
        self.mask_hidden = nn.Parameter(0.02 * torch.randn(1, fc_in)) if parallel else None

    def combine_aux_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, T, n_aux * H_t] -> [B, T, H]: optional norms, then fc (vLLM `combine_hidden_states`).

        The states take the weights' dtype: bf16 under DeepSpeed's bf16 mode or FSDP2's param_dtype.
        """
        aux = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(self.spec.num_aux, dim=-1)  # n_aux x [B, T, H_t], ascending aux ids
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def rope_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """cos, sin [B, 1, T, d]; angles in float64 so large positions stay exact, then cast to `dtype`."""
        inv_freq = rope_inv_freq(self.spec.head_dim, self.spec.rope_parameters, position_ids.device)
        angles = position_ids.to(torch.float64)[..., None] * inv_freq  # [B, T, d/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, d]
        scale = rope_attention_factor(self.spec.rope_parameters)
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)

    def forward_step(self, input_ids, hidden, position_ids, attention: AttentionFn, apply_lm_head: bool = True):
        """One draft step: tokens [B, T] + hidden [B, T, H] at RoPE positions [B, T] -> (next_hidden, logits).

        next_hidden is norm(h) with norm_output (EAGLE-3.1), else the pre-norm h; logits are [B, T, V_d].
        With apply_lm_head=False the second output is the lm_head's input norm(h) [B, T, H] instead: training
        applies the head only at scored positions, fused with its loss (train/loss.py).
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rope_cos_sin(position_ids, hidden.dtype)
        h = hidden
        for layer in self.layers:
            h = layer(embeds, h, cos, sin, attention)
        normed = self.norm(h)
        next_hidden = normed if self.spec.norm_output else h
        if not apply_lm_head:
            return next_hidden, normed
        return next_hidden, self.lm_head(normed)  # [B, T, V_d]

    # nn.Module hooks (FSDP, DDP, autocast wrappers) run on __call__: drafter(...) is forward_step(...)
    forward = forward_step


@torch.no_grad()
def init_drafter_from_target(drafter: Drafter, target_embed_weight, d2t, t2d) -> None:
    """Copy the target's embeddings and the draft-vocab maps into a fresh drafter (lm_head stays random)."""
    expected = {
        "target_embed_weight": (tuple(drafter.embed_tokens.weight.shape), target_embed_weight),
        "d2t": (tuple(drafter.d2t.shape), d2t),
        "t2d": (tuple(drafter.t2d.shape), t2d),
    }
    for name, (shape, tensor) in expected.items():
        if tuple(tensor.shape) != shape:
            raise UserError(f"{name} has shape {tuple(tensor.shape)}, the drafter expects {shape}")
    if int(t2d.sum()) != drafter.spec.draft_vocab_size:
        raise UserError(f"t2d marks {int(t2d.sum())} tokens, expected draft_vocab_size {drafter.spec.draft_vocab_size}")
    drafter.embed_tokens.weight.copy_(target_embed_weight)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)


@torch.no_grad()
def init_head_from_target(drafter: Drafter, target_lm_head_weight, target_final_norm_weight) -> None:
    """Start the draft head as the target's own: its lm_head rows of the draft vocab (draft id i = the i-th marked
    target id, as d2t encodes it) and its final norm. Call after init_drafter_from_target has set t2d."""
    draft_ids = drafter.t2d.nonzero().squeeze(-1)
    if tuple(target_lm_head_weight.shape) != (drafter.t2d.numel(), drafter.spec.hidden_size):
        raise UserError(f"target lm_head has shape {tuple(target_lm_head_weight.shape)}, the drafter expects "
                        f"({drafter.t2d.numel()}, {drafter.spec.hidden_size}): train.lm_head_init=target needs the drafter's "
                        "hidden size to be the target's; use train.lm_head_init=random")
    drafter.lm_head.weight.copy_(target_lm_head_weight[draft_ids])
    drafter.norm.weight.copy_(target_final_norm_weight)
