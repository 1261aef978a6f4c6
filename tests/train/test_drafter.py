"""The drafter's tensor names and shapes (vLLM's), EAGLE-3.1 switches, RoPE and HF layer parity."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from draftsmith.data.config import ConfigError, DrafterConfig
from draftsmith.train.drafter import (
    Drafter,
    RMSNorm,
    init_drafter_from_target,
    init_head_from_target,
    rope_attention_factor,
    rope_inv_freq,
)
from draftsmith.train.spec import spec_for_target

H, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, V, V_D, N_AUX = 64, 4, 2, 16, 96, 48, 3
EPS = 1e-6


def tiny_target_config(**overrides) -> LlamaConfig:
    fields = {"hidden_size": H, "intermediate_size": 128, "num_attention_heads": NUM_HEADS,
              "num_key_value_heads": NUM_KV_HEADS, "vocab_size": V, "num_hidden_layers": 4,
              "max_position_embeddings": 256, "rms_norm_eps": EPS}
    return LlamaConfig(**(fields | overrides))


def tiny_spec(cfg: DrafterConfig | None = None, parallel_drafting: bool = False, target=None, v_d: int = V_D):
    return spec_for_target(target or tiny_target_config(), cfg or DrafterConfig(), method="peagle" if parallel_drafting else "eagle3",
                           aux_layer_ids=range(1, N_AUX + 1), draft_vocab_size=v_d,
                           mask_token_id=V - 1 if parallel_drafting else None)


def tiny_drafter(seed: int = 0, parallel_drafting: bool = False, **cfg_fields) -> Drafter:
    cfg = DrafterConfig(**cfg_fields)
    torch.manual_seed(seed)
    drafter = Drafter(tiny_spec(cfg, parallel_drafting))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return drafter


def shapes(module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_state_dict_is_the_vllm_tensor_set():
    sd = tiny_drafter().state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, N_AUX * H),
        "layers.0.input_layernorm.weight": (H,),
        "layers.0.hidden_norm.weight": (H,),
        "layers.0.self_attn.q_proj.weight": (NUM_HEADS * HEAD_DIM, 2 * H),
        "layers.0.self_attn.k_proj.weight": (NUM_KV_HEADS * HEAD_DIM, 2 * H),
        "layers.0.self_attn.v_proj.weight": (NUM_KV_HEADS * HEAD_DIM, 2 * H),
        "layers.0.self_attn.o_proj.weight": (H, NUM_HEADS * HEAD_DIM),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (128, H),
        "layers.0.mlp.up_proj.weight": (128, H),
        "layers.0.mlp.down_proj.weight": (H, 128),
        "norm.weight": (H,),
        "lm_head.weight": (V_D, H),
        "d2t": (V_D,),
        "t2d": (V,),
    }
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool


def test_later_layers_and_qwen3_tensors():
    base = shapes(tiny_drafter())
    two = shapes(tiny_drafter(num_layers=2))
    layer1 = {k: v for k, v in two.items() if k.startswith("layers.1.")}
    assert layer1 == {  # a plain Llama layer: q/k/v read H (not 2H), no hidden_norm
        "layers.1.input_layernorm.weight": (H,),
        "layers.1.self_attn.q_proj.weight": (NUM_HEADS * HEAD_DIM, H),
        "layers.1.self_attn.k_proj.weight": (NUM_KV_HEADS * HEAD_DIM, H),
        "layers.1.self_attn.v_proj.weight": (NUM_KV_HEADS * HEAD_DIM, H),
        "layers.1.self_attn.o_proj.weight": (H, NUM_HEADS * HEAD_DIM),
        "layers.1.post_attention_layernorm.weight": (H,),
        "layers.1.mlp.gate_proj.weight": (128, H),
        "layers.1.mlp.up_proj.weight": (128, H),
        "layers.1.mlp.down_proj.weight": (H, 128),
    }
    assert {k: v for k, v in two.items() if not k.startswith("layers.1.")} == base
    qwen3 = shapes(tiny_drafter(arch="qwen3"))
    assert set(qwen3) - set(base) == {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"}
    assert qwen3["layers.0.self_attn.q_norm.weight"] == (HEAD_DIM,)


def test_eagle31_flags_add_exactly_their_tensors():
    base = shapes(tiny_drafter())
    assert set(shapes(tiny_drafter(fc_norm=True))) - set(base) == {f"fc_norm.{i}.weight" for i in range(N_AUX)}
    assert shapes(tiny_drafter(norm_before_fc=True)).keys() - base.keys() == {"input_norm.weight"}
    assert shapes(tiny_drafter(norm_before_fc=True))["input_norm.weight"] == (N_AUX * H,)
    assert shapes(tiny_drafter(norm_output=True)) == base
    assert shapes(tiny_drafter(norm_before_residual=True)) == base
    with pytest.raises(ConfigError, match="fc_norm and drafter.norm_before_fc"):
        DrafterConfig(fc_norm=True, norm_before_fc=True)


def test_fc_norm_normalises_each_aux_state_before_fc():
    plain, normed = tiny_drafter(), tiny_drafter(fc_norm=True, seed=1)
    missing = normed.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == [f"fc_norm.{i}.weight" for i in range(N_AUX)]
    aux = torch.randn(2, 5, N_AUX * H, dtype=torch.float64) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(H)
    plain, normed = plain.double(), normed.double()
    chunks = [aux[..., i * H : (i + 1) * H] for i in range(N_AUX)]
    weights = [normed.fc_norm[i].weight for i in range(N_AUX)]
    expected = torch.cat([w * c / (c.pow(2).mean(-1, keepdim=True) + EPS).sqrt() for w, c in zip(weights, chunks)], -1)
    with torch.no_grad():
        torch.testing.assert_close(normed.combine_aux_hidden_states(aux), expected @ normed.fc.weight.T,
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(plain.combine_aux_hidden_states(aux), aux @ plain.fc.weight.T, rtol=1e-12, atol=1e-12)
        assert (normed.combine_aux_hidden_states(aux) - plain.combine_aux_hidden_states(aux)).abs().max() > 1.0


def test_parallel_drafting_adds_a_trainable_mask_hidden_and_embeddings():
    eagle3, peagle = tiny_drafter(), tiny_drafter(parallel_drafting=True)
    assert shapes(peagle).keys() - shapes(eagle3).keys() == {"mask_hidden"}
    assert peagle.mask_hidden.shape == (1, N_AUX * H) and peagle.mask_hidden.requires_grad
    assert not eagle3.embed_tokens.weight.requires_grad and peagle.embed_tokens.weight.requires_grad


def causal_attention(layer_idx, q, k, v):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          is_causal=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_later_layers_match_the_hf_decoder_layer(arch):
    """Layers >= 1 are plain decoder layers: same names, same math as transformers' Llama / Qwen3 layer."""
    drafter = tiny_drafter(num_layers=2, arch=arch).double()
    common = {"hidden_size": H, "intermediate_size": 128, "num_attention_heads": NUM_HEADS, "head_dim": HEAD_DIM,
              "num_key_value_heads": NUM_KV_HEADS, "rms_norm_eps": EPS, "attn_implementation": "eager"}
    config = LlamaConfig(**common) if arch == "llama" else Qwen3Config(**common)
    hf_layer = (LlamaDecoderLayer if arch == "llama" else Qwen3DecoderLayer)(config, layer_idx=1).double()
    hf_layer.load_state_dict(drafter.layers[1].state_dict())
    B, T = 2, 7
    h = torch.randn(B, T, H, dtype=torch.float64)
    positions = torch.arange(3, 3 + T).expand(B, T)
    causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1).expand(B, 1, T, T)
    with torch.no_grad():
        cos, sin = drafter.rope_cos_sin(positions, torch.float64)
        ours = drafter.layers[1](None, h, cos, sin, causal_attention)
        hf_rope = LlamaRotaryEmbedding(LlamaConfig(**common)).double()
        theirs = hf_layer(h, attention_mask=causal, position_embeddings=hf_rope(h, positions))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_llama3_rope_matches_transformers():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = tiny_target_config(rope_parameters=rope, hidden_size=256, num_attention_heads=2)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(128, rope)
    torch.testing.assert_close(ours.float(), expected.float(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(128, {"rope_theta": 500000.0})
    assert (ours != plain).any() and (ours[:4] == plain[:4]).all(), "llama3 scales low frequencies only"


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_rope_matches_transformers(truncate):
    # GPT-OSS's rope_parameters (its config.json), with and without truncation of the ramp bounds
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": truncate}
    config = tiny_target_config(rope_parameters=rope, hidden_size=128, num_attention_heads=2,
                                max_position_embeddings=131072)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = rope_inv_freq(64, rope)
    torch.testing.assert_close(ours.float(), expected.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(rope) == pytest.approx(factor, rel=1e-12)
    plain = rope_inv_freq(64, {"rope_theta": 150000.0})
    assert ours[0] == plain[0] and ours[-1] == pytest.approx(plain[-1] / 32), "fast dims kept, slow ones interpolated"


def test_drafter_spec_copies_the_target():
    spec = tiny_spec()
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (
        H, NUM_HEADS, NUM_KV_HEADS, 16)
    assert (spec.vocab_size, spec.draft_vocab_size, spec.target_hidden_size, spec.num_aux) == (V, V_D, H, N_AUX)
    assert spec.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        tiny_spec(target=tiny_target_config(rope_parameters=dynamic))
    with pytest.raises(ValueError, match="silu"):
        tiny_spec(target=tiny_target_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tiny_spec(v_d=V + 1)


def test_init_drafter_from_target_copies_embeddings_and_vocab_maps():
    drafter = tiny_drafter()
    embed = torch.randn(V, H)
    used = torch.arange(0, 2 * V_D, 2)  # draft ids -> even target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    d2t = used - torch.arange(V_D)
    init_drafter_from_target(drafter, embed, d2t, t2d)
    assert torch.equal(drafter.embed_tokens.weight, embed) and torch.equal(drafter.d2t, d2t)
    assert torch.equal(drafter.t2d, t2d)
    with pytest.raises(ValueError, match="d2t has shape"):
        init_drafter_from_target(drafter, embed, d2t[:-1], t2d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_transformers_llama_rmsnorm(dtype):
    """Bit-equal to transformers' own norm (fp32 statistics, cast back before the weight), as vLLM's also is."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm, reference = RMSNorm(H, EPS).to(dtype), LlamaRMSNorm(H, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.rand(H))
        reference.weight.copy_(norm.weight)
    x = (torch.randn(3, H) * 50).to(dtype)
    assert torch.equal(norm(x), reference(x))


def test_bfloat16_step_runs_and_keeps_dtype():
    drafter = tiny_drafter(num_layers=2).to(torch.bfloat16)
    B, T = 2, 6
    hidden = drafter.combine_aux_hidden_states(torch.randn(B, T, N_AUX * H, dtype=torch.bfloat16))
    positions = torch.arange(T).expand(B, T)
    next_hidden, logits = drafter(torch.randint(0, V, (B, T)), hidden, positions, causal_attention)
    assert next_hidden.dtype == logits.dtype == torch.bfloat16 and logits.shape == (B, T, V_D)


def test_head_from_target_gives_the_targets_logits_over_the_draft_vocab():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    drafter = tiny_drafter()
    used = torch.arange(1, 2 * V_D, 2)  # draft ids -> odd target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    init_drafter_from_target(drafter, torch.randn(V, H), used - torch.arange(V_D), t2d)
    target_head, target_norm = torch.randn(V, H), LlamaRMSNorm(H, eps=drafter.spec.rms_norm_eps)
    with torch.no_grad():
        target_norm.weight.copy_(torch.rand(H) + 0.5)
    init_head_from_target(drafter, target_head, target_norm.weight.detach())
    h = torch.randn(5, H)
    with torch.no_grad():
        target_logits = target_norm(h) @ target_head.T  # [5, V]
        torch.testing.assert_close(drafter.lm_head(drafter.norm(h)), target_logits[:, drafter.d2t + torch.arange(V_D)])
    with pytest.raises(ValueError, match="lm_head_init=random"):
        init_head_from_target(drafter, target_head[:, :-1], target_norm.weight.detach())
