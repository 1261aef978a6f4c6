"""train.layer_init=target_last: the drafter's layers start as the target's last ones.

Brute-force reference: a drafter started from a random HF target's last layer(s), final norm and head, fed the
target's own input to those layers, must give the target's logits (the embedding half of layer 0 starts at zero).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from draftsmith.data.config import DrafterConfig
from draftsmith.data.errors import UserError
from draftsmith.data.target import head_weight_files, last_layer_ids, load_target_head, load_target_layer
from draftsmith.train.drafter import (
    Drafter,
    init_drafter_from_target,
    init_head_from_target,
    init_layers_from_target,
)
from draftsmith.train.spec import spec_for_target

V, LAYERS = 80, 4
SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": V, "num_hidden_layers": LAYERS, "max_position_embeddings": 256, "tie_word_embeddings": False}


def causal_attention(layer_idx, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def saved_target(tmp_path, config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    return model


def drafter_from_target(path, config, num_layers: int) -> Drafter:
    arch = "qwen3" if config.model_type == "qwen3" else "llama"
    spec = spec_for_target(config, DrafterConfig(arch=arch, num_layers=num_layers, norm_before_residual=False),
                           method="eagle3", aux_layer_ids=(1, 2, 3), draft_vocab_size=V)
    drafter = Drafter(spec)
    head = load_target_head(str(path))
    init_drafter_from_target(drafter, head["embed"], torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    init_head_from_target(drafter, head["lm_head"], head["norm"])
    layers = [load_target_layer(str(path), i) for i in last_layer_ids(path, num_layers)]
    init_layers_from_target(drafter, layers)
    return drafter


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("config", [LlamaConfig(**SIZES), Qwen3Config(**SIZES, head_dim=16)], ids=["llama", "qwen3"])
def test_drafter_started_from_the_last_layers_computes_the_target(tmp_path, config, num_layers):
    model = saved_target(tmp_path, config)
    drafter = drafter_from_target(tmp_path, config, num_layers)
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        before_last = out.hidden_states[LAYERS - num_layers]  # the input to the target's last num_layers layers
        positions = torch.arange(12).expand(2, 12)
        other_tokens = torch.randint(0, V, (2, 12))  # the embedding half starts at zero: any token gives the same
        _, logits = drafter(other_tokens, before_last, positions, causal_attention)
    torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)
    q = drafter.layers[0].self_attn.q_proj.weight
    assert q[:, :64].abs().max() == 0 and q[:, 64:].abs().max() > 0


def test_a_layer_that_does_not_fit_is_refused(tmp_path):
    config = LlamaConfig(**SIZES)
    saved_target(tmp_path, config)
    spec = spec_for_target(config, DrafterConfig(), method="eagle3", aux_layer_ids=(1, 2, 3), draft_vocab_size=V)
    layer = load_target_layer(str(tmp_path), LAYERS - 1)
    layer["mlp.experts.0.weight"] = layer.pop("mlp.up_proj.weight")  # a mixture-of-experts layer's names
    with pytest.raises(UserError, match="mixture-of-experts"):
        init_layers_from_target(Drafter(spec), [layer])
    with pytest.raises(UserError, match="no tensors named model.layers.9"):
        load_target_layer(str(tmp_path), 9)


def test_a_hub_snapshot_fetches_only_the_shards_of_the_head_and_last_layers(tmp_path):
    weight_map = {"model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.up_proj.weight": "a.safetensors",
                  "model.layers.2.mlp.up_proj.weight": "b.safetensors",
                  "model.layers.3.mlp.up_proj.weight": "c.safetensors", "model.norm.weight": "d.safetensors",
                  "lm_head.weight": "d.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS}))
    assert head_weight_files(tmp_path) == ["a.safetensors", "d.safetensors"]
    prefixes = [f"model.layers.{i}." for i in last_layer_ids(tmp_path, 1)]
    assert head_weight_files(tmp_path, prefixes) == ["a.safetensors", "c.safetensors", "d.safetensors"]


def test_the_run_config_starts_the_drafter_from_the_targets_last_layer(tiny_run, tiny_target_dir, tmp_path):
    from draftsmith.data.config import load_config
    from draftsmith.train.build import build_drafter, build_drafter_spec, load_checked_dataset

    cfg, _ = load_config(tiny_run(tmp_path, {"train": {"layer_init": "target_last"}}), [])
    _, _, aux_ids, target_path, hf_cfg = load_checked_dataset(cfg)
    drafter = build_drafter(cfg, build_drafter_spec(cfg, hf_cfg, target_path, aux_ids, "eagle3"), target_path)
    last = load_target_layer(str(tiny_target_dir), hf_cfg.num_hidden_layers - 1)
    H = hf_cfg.hidden_size
    torch.testing.assert_close(drafter.layers[0].mlp.down_proj.weight, last["mlp.down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(drafter.layers[0].self_attn.k_proj.weight[:, H:], last["self_attn.k_proj.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(drafter.layers[0].hidden_norm.weight, last["input_layernorm.weight"], rtol=0, atol=0)
