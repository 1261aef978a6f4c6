"""export/format.py and export/write.py: the exact tensor set, its checks, and config.json as vLLM's own
config classes read it (no engine)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.export import format as fmt
from draftsmith.export.write import PROVENANCE, write_drafter_folder
from draftsmith.train.spec import DrafterSpec


def make_spec(**overrides) -> DrafterSpec:
    """A small SmolLM2-shaped drafter spec: H=64, 4 heads of 16, 2 KV heads, V_t=512, V_d=128."""
    spec = {
        "method": "eagle3",
        "arch": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 2048,
        "vocab_size": 512,
        "num_hidden_layers": 1,
        "target_hidden_size": 48,
        "draft_vocab_size": 128,
        "aux_layer_ids": [2, 15, 27],
        "fc_norm": False,
        "norm_output": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "mask_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "verifier_name_or_path": "/models/target",
        "verifier_architectures": ["LlamaForCausalLM"],
    }
    spec.update(overrides)
    return DrafterSpec.from_dict(spec)


EAGLE31 = {"fc_norm": True, "norm_output": True}
PEAGLE = {"method": "peagle", "num_hidden_layers": 2, "mask_token_id": 7, **EAGLE31}
SPECS = {
    "eagle3": make_spec(),
    "eagle3.1-4aux": make_spec(aux_layer_ids=[1, 2, 15, 27], **EAGLE31),
    "norm_before_fc-qwen3": make_spec(arch="qwen3", norm_before_fc=True, num_hidden_layers=2),
    "full-vocab": make_spec(draft_vocab_size=512),
    "peagle": make_spec(**PEAGLE),
}


def random_state_dict(spec: DrafterSpec, dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of exactly the expected shapes, with a valid d2t/t2d (every 4th target id)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (shape, want) in fmt.expected_tensors(spec).items():
        if want is None:
            sd[name] = (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
    if spec.has_vocab_map:
        used = torch.arange(spec.draft_vocab_size) * (spec.vocab_size // spec.draft_vocab_size)
        sd["d2t"] = used - torch.arange(spec.draft_vocab_size)
        sd["t2d"] = torch.zeros(spec.vocab_size, dtype=torch.bool)
        sd["t2d"][used] = True
    return sd


# ---- the tensor set ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPECS))
def test_random_state_dict_passes(name):
    spec = SPECS[name]
    fmt.check_state_dict(random_state_dict(spec), spec, "bfloat16")


def test_expected_tensors_eagle3_literal():
    """The whole key set for one spec, written out: layer 0 q/k/v read 2H = 128, fc reads 3 * 48."""
    got = {k: s for k, (s, _) in fmt.expected_tensors(SPECS["eagle3"]).items()}
    assert got == {
        "fc.weight": (64, 144),
        "layers.0.input_layernorm.weight": (64,),
        "layers.0.hidden_norm.weight": (64,),
        "layers.0.self_attn.q_proj.weight": (64, 128),
        "layers.0.self_attn.k_proj.weight": (32, 128),
        "layers.0.self_attn.v_proj.weight": (32, 128),
        "layers.0.self_attn.o_proj.weight": (64, 64),
        "layers.0.post_attention_layernorm.weight": (64,),
        "layers.0.mlp.gate_proj.weight": (96, 64),
        "layers.0.mlp.up_proj.weight": (96, 64),
        "layers.0.mlp.down_proj.weight": (64, 96),
        "norm.weight": (64,),
        "lm_head.weight": (128, 64),
        "d2t": (128,),
        "t2d": (512,),
    }


def test_expected_tensors_switches():
    qwen = fmt.expected_tensors(SPECS["norm_before_fc-qwen3"])
    assert qwen["input_norm.weight"][0] == (144,)
    assert qwen["layers.1.self_attn.q_proj.weight"][0] == (64, 64)  # later layers read H, not 2H
    assert qwen["layers.1.self_attn.k_norm.weight"][0] == (16,)
    assert "layers.1.hidden_norm.weight" not in qwen
    four = fmt.expected_tensors(SPECS["eagle3.1-4aux"])
    assert [k for k in four if k.startswith("fc_norm.")] == [f"fc_norm.{i}.weight" for i in range(4)]
    assert four["fc.weight"][0] == (64, 192)
    peagle = fmt.expected_tensors(SPECS["peagle"])
    assert peagle["mask_hidden"][0] == (1, 144) and peagle["embed_tokens.weight"][0] == (512, 64)
    assert "embed_tokens.weight" not in fmt.expected_tensors(SPECS["eagle3"])
    full = fmt.expected_tensors(SPECS["full-vocab"])
    assert "d2t" not in full and "t2d" not in full


def test_missing_tensor_is_named():
    spec = SPECS["eagle3"]
    sd = random_state_dict(spec)
    del sd["layers.0.hidden_norm.weight"]
    with pytest.raises(ValueError, match=r"'layers\.0\.hidden_norm\.weight' is missing"):
        fmt.check_state_dict(sd, spec, "bfloat16")


def test_unexpected_tensor_is_named():
    spec = SPECS["eagle3"]
    sd = random_state_dict(spec)
    sd["verifier_lm_head.weight"] = torch.zeros(512, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'verifier_lm_head\.weight' is unexpected"):
        fmt.check_state_dict(sd, spec, "bfloat16")
    sd.pop("verifier_lm_head.weight")
    sd["embed_tokens.weight"] = torch.zeros(512, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'embed_tokens\.weight' is unexpected.*shares the target's"):
        fmt.check_state_dict(sd, spec, "bfloat16")


def test_wrong_shape_names_both_shapes():
    spec = SPECS["eagle3"]
    sd = random_state_dict(spec)
    sd["layers.0.self_attn.q_proj.weight"] = sd["layers.0.self_attn.q_proj.weight"][:, :64]
    with pytest.raises(ValueError, match=r"q_proj\.weight'?: expected shape \[64, 128\], found \[64, 64\]"):
        fmt.check_state_dict(sd, spec, "bfloat16")


def test_wrong_dtype_and_non_finite():
    spec = SPECS["eagle3"]
    sd = random_state_dict(spec)
    sd["norm.weight"] = sd["norm.weight"].float()
    with pytest.raises(
        ValueError, match=r"'norm\.weight': expected dtype torch\.bfloat16, found torch\.float32"
    ):
        fmt.check_state_dict(sd, spec, "bfloat16")
    sd = random_state_dict(spec)
    sd["d2t"] = sd["d2t"].to(torch.int32)
    with pytest.raises(ValueError, match=r"'d2t': expected dtype torch\.int64"):
        fmt.check_state_dict(sd, spec, "bfloat16")
    sd = random_state_dict(spec)
    sd["fc.weight"][3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"'fc\.weight' holds 1 non-finite"):
        fmt.check_state_dict(sd, spec, "bfloat16")


def test_bad_vocab_maps():
    spec = SPECS["eagle3"]
    sd = random_state_dict(spec)
    sd["d2t"][127] = 1000
    with pytest.raises(ValueError, match=r"d2t\[127\]=1000 maps draft id 127 to 1127, outside \[0, 512\)"):
        fmt.check_state_dict(sd, spec, "bfloat16")
    sd = random_state_dict(spec)
    sd["d2t"][10] = sd["d2t"][9] - 1  # target(10) = target(9)
    with pytest.raises(ValueError, match=r"strictly increase, but draft id 10 maps to 36 after 36"):
        fmt.check_state_dict(sd, spec, "bfloat16")
    sd = random_state_dict(spec)
    sd["t2d"][1] = True
    with pytest.raises(
        ValueError, match=r"t2d marks 129 target ids but d2t maps to 128; first disagreement at draft id 1"
    ):
        fmt.check_state_dict(sd, spec, "bfloat16")


def test_select_export_tensors_drops_what_vllm_takes_elsewhere():
    spec = SPECS["full-vocab"]
    sd = random_state_dict(spec)
    sd["embed_tokens.weight"] = torch.zeros(512, 64, dtype=torch.bfloat16)
    sd["d2t"] = torch.zeros(512, dtype=torch.int64)
    sd["t2d"] = torch.ones(512, dtype=torch.bool)
    assert fmt.select_export_tensors(sd, spec).keys() == fmt.expected_tensors(spec).keys()
    sd["d2t"][3] = 1
    with pytest.raises(ValueError, match="d2t is not all zeros"):
        fmt.select_export_tensors(sd, spec)
    peagle = SPECS["peagle"]
    assert "embed_tokens.weight" in fmt.select_export_tensors(random_state_dict(peagle), peagle)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_trainer_drafter_state_dict_is_the_export_set(name):
    """The trainer's nn.Module and this contract name the same tensors (train/drafter.py attributes)."""
    from draftsmith.train.drafter import Drafter

    spec = SPECS[name]
    drafter = Drafter(spec)  # the same spec builds the module and names the export set
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in drafter.state_dict().items()}
    if spec.has_vocab_map:  # a real draft vocab: every 4th target id
        sd["d2t"], sd["t2d"] = random_state_dict(spec)["d2t"], random_state_dict(spec)["t2d"]
    fmt.check_state_dict(fmt.select_export_tensors(sd, spec), spec, "bfloat16")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"fc_norm": True, "norm_before_fc": True}, "fc_norm and norm_before_fc are exclusive"),
        ({"aux_layer_ids": [15, 2, 27]}, "ascending"),
        ({"draft_vocab_size": 513}, "exceeds the target vocab 512"),
        ({"method": "peagle"}, "peagle needs mask_token_id"),
        ({"mask_token_id": 3}, "mask_token_id must be null for method eagle3"),
        ({"num_layers": 1}, r"unknown field\(s\) \['num_layers'\]"),
        ({"rope_parameters": {"rope_type": "default"}}, "rope_theta"),
    ],
)
def test_bad_spec_is_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_spec(**overrides)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("layout", ["speculators", "legacy"])
def test_config_json_reads_back_as_the_same_spec(name, layout):
    """drafter_config and spec_from_drafter_config are inverses (the legacy layout names no verifier)."""
    spec = SPECS[name]
    back = fmt.spec_from_drafter_config(json.loads(json.dumps(fmt.drafter_config(spec, layout, 3))))
    if layout == "legacy":
        spec = dataclasses.replace(spec, verifier_name_or_path="", verifier_architectures=())
    assert back == spec


def test_speculators_own_config_reads_with_vllm_defaults():
    """speculators' trainer writes target_hidden_size null and leaves fc_norm/norm_output out."""
    config = fmt.speculators_config(SPECS["eagle3"], 3)
    config["target_hidden_size"] = None
    del config["fc_norm"], config["norm_output"], config["norm_before_residual"]
    back = fmt.spec_from_drafter_config(config)
    assert back.target_hidden_size == 64 and not back.fc_norm and back.norm_before_residual  # vLLM's eagle3 default
    with pytest.raises(ValueError, match="missing 'draft_vocab_size'"):
        fmt.spec_from_drafter_config({k: v for k, v in config.items() if k != "draft_vocab_size"})


# ---- write.py ---------------------------------------------------------------------------------------------


def test_write_casts_checks_and_replaces(tmp_path):
    spec = SPECS["eagle3"]
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in random_state_dict(spec).items()}
    sd["embed_tokens.weight"] = torch.zeros(512, 64)  # the trainer's frozen copy; left out
    out = write_drafter_folder(sd, spec, tmp_path / "drafter", "speculators", "bfloat16", 3)
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == fmt.expected_tensors(spec).keys()
    assert loaded["fc.weight"].dtype == torch.bfloat16 and loaded["d2t"].dtype == torch.int64
    torch.testing.assert_close(loaded["fc.weight"], sd["fc.weight"].to(torch.bfloat16), rtol=0, atol=0)
    assert json.loads((out / PROVENANCE).read_text())["num_tensors"] == len(loaded)
    write_drafter_folder(sd, spec, out, "legacy", "float32", 3)  # an earlier export may be replaced
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_write_refuses_bad_tensors_before_touching_disk(tmp_path):
    spec = SPECS["eagle3"]
    sd = random_state_dict(spec)
    del sd["norm.weight"]
    with pytest.raises(ValueError, match="'norm.weight' is missing"):
        write_drafter_folder(sd, spec, tmp_path / "drafter", "speculators", "bfloat16", 3)
    assert not any(tmp_path.iterdir())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="holds no draftsmith_export.json"):
        write_drafter_folder(random_state_dict(spec), spec, tmp_path / "mine", "speculators", "bfloat16", 3)


# ---- config.json through vLLM's own config classes ------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_configs():
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    return get_config, EAGLEConfig, SpeculatorsConfig


def write_config(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_speculators_config_as_vllm_reads_it(tmp_path, vllm_configs):
    get_config, _, speculators_cls = vllm_configs
    spec = SPECS["eagle3.1-4aux"]
    config = fmt.speculators_config(spec, 5)
    assert "model_type" not in config
    hf = get_config(write_config(tmp_path, config), trust_remote_code=False)
    assert isinstance(hf, speculators_cls)
    assert hf.architectures == ["Eagle3LlamaForCausalLM"]
    assert (hf.draft_vocab_size, hf.vocab_size, hf.target_hidden_size) == (128, 512, 48)
    assert hf.eagle_aux_hidden_state_layer_ids == [1, 2, 15, 27]
    assert hf.num_aux_hidden_states == 4  # vllm #54526: the Llama drafter sizes fc from this
    assert (hf.norm_before_residual, hf.norm_before_fc, hf.fc_norm, hf.norm_output) == (
        False,
        False,
        True,
        True,
    )
    assert hf.rope_parameters["rope_theta"] == 100000.0 and hf.num_hidden_layers == 1
    assert speculators_cls.extract_vllm_speculative_config(config) == {
        "method": "eagle3",
        "num_speculative_tokens": 5,
    }
    assert (
        "num_aux_hidden_states" not in fmt.speculators_config(SPECS["eagle3"], 3)["transformer_layer_config"]
    )


def test_peagle_speculators_config_keeps_eagle31_norms(tmp_path, vllm_configs):
    get_config, _, speculators_cls = vllm_configs
    config = fmt.speculators_config(SPECS["peagle"], 4)
    hf = get_config(write_config(tmp_path, config), trust_remote_code=False)
    assert hf.architectures == ["PeagleLlamaForCausalLM"]
    assert hf.pard_token == 7 and hf.num_hidden_layers == 2
    # update_peagle forwards neither flag; they reach the model only through transformer_layer_config
    assert (hf.fc_norm, hf.norm_output, hf.norm_before_residual, hf.norm_before_fc) == (
        True,
        True,
        False,
        False,
    )
    assert speculators_cls.extract_vllm_speculative_config(config) == {
        "method": "eagle3",
        "parallel_drafting": True,
        "num_speculative_tokens": 4,
    }


def test_qwen3_speculators_config(tmp_path, vllm_configs):
    get_config, _, _ = vllm_configs
    hf = get_config(write_config(tmp_path, fmt.speculators_config(SPECS["norm_before_fc-qwen3"], 3)), False)
    assert hf.architectures == ["Eagle3Qwen3ForCausalLM"]
    assert (hf.norm_before_fc, hf.fc_norm, hf.head_dim) == (True, False, 16)


@pytest.mark.parametrize(
    "arch, expected", [("llama", "LlamaForCausalLMEagle3"), ("qwen3", "Eagle3Qwen3ForCausalLM")]
)
def test_legacy_config_as_vllm_reads_it(tmp_path, vllm_configs, arch, expected):
    get_config, eagle_cls, _ = vllm_configs
    spec = make_spec(arch=arch, aux_layer_ids=[1, 2, 15, 27], **EAGLE31)
    raw = get_config(write_config(tmp_path, fmt.legacy_config(spec)), trust_remote_code=False)
    # what vllm/config/speculative.py does with a non-speculators eagle3 draft
    hf = eagle_cls(raw, method="eagle3", model_type="eagle")
    assert hf.architectures == [expected]
    assert (hf.draft_vocab_size, hf.vocab_size, hf.target_hidden_size) == (128, 512, 48)
    assert hf.eagle_config == {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 15, 27],
        "use_aux_hidden_state": True,
    }
    assert (hf.norm_before_residual, hf.norm_before_fc, hf.fc_norm, hf.norm_output) == (
        False,
        False,
        True,
        True,
    )
