"""train.init_from: a drafter starts from an exported folder; new layers start as the identity."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.data.config import load_config
from draftsmith.data.errors import UserError
from draftsmith.export.write import write_drafter_folder
from draftsmith.train.build import build_drafter, build_drafter_spec, load_checked_dataset
from draftsmith.train.warm_start import init_drafter_from_exported
from tests.train.test_drafter import V_D, V, causal_attention, tiny_drafter


def with_vocab_map(drafter, shift: int = 1):
    """A real (non-identity) draft vocab: draft id i is target id i * 2 + shift."""
    used = torch.arange(V_D) * 2 + shift
    drafter.d2t.copy_(used - torch.arange(V_D))
    drafter.t2d.zero_()
    drafter.t2d[used] = True
    return drafter


def exported_eagle3(tmp_path, fmt: str = "speculators"):
    source = with_vocab_map(tiny_drafter(seed=1))
    folder = write_drafter_folder(source.state_dict(), source.spec, tmp_path / "eagle3", fmt,
                                  "float32", 3)
    return source, folder


def logits_of(drafter, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 9), generator=g)
    hidden = drafter.combine_aux_hidden_states(torch.randn(2, 9, 3 * drafter.spec.target_hidden_size, generator=g))
    return drafter(ids, hidden, torch.arange(9).expand(2, 9), causal_attention)[1]


@pytest.mark.parametrize("fmt", ["speculators", "legacy"])
def test_peagle_from_eagle3_predicts_exactly_like_the_source_at_step_zero(tmp_path, fmt):
    source, folder = exported_eagle3(tmp_path, fmt)
    peagle = with_vocab_map(tiny_drafter(seed=2, parallel_drafting=True, num_layers=2))
    with torch.no_grad():  # both start from the target's embedding (init_drafter_from_target); EAGLE-3 omits it
        peagle.embed_tokens.weight.copy_(source.embed_tokens.weight)
    fresh_mask_hidden, fresh_embed = peagle.mask_hidden.clone(), peagle.embed_tokens.weight.clone()
    assert not torch.allclose(logits_of(peagle), logits_of(source))
    init_drafter_from_exported(peagle, folder)
    torch.testing.assert_close(logits_of(peagle), logits_of(source), rtol=1e-5, atol=1e-5)
    # the EAGLE-3 export has no embed_tokens / mask_hidden: P-EAGLE keeps its own (the target's embedding)
    assert torch.equal(peagle.mask_hidden, fresh_mask_hidden) and torch.equal(peagle.embed_tokens.weight, fresh_embed)
    assert torch.equal(peagle.layers[1].self_attn.o_proj.weight, torch.zeros_like(peagle.layers[1].self_attn.o_proj.weight))
    # the identity layer still learns: its zeroed projections get gradients
    logits_of(peagle).logsumexp(-1).sum().backward()
    assert peagle.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_a_peagle_export_restores_every_tensor(tmp_path):
    trained = with_vocab_map(tiny_drafter(seed=3, parallel_drafting=True, num_layers=2))
    folder = write_drafter_folder(trained.state_dict(), trained.spec,
                                  tmp_path / "peagle", "speculators", "float32", 4)
    again = with_vocab_map(tiny_drafter(seed=4, parallel_drafting=True, num_layers=2))
    init_drafter_from_exported(again, folder)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_legacy_midlayer_names_map_to_layer_zero(tmp_path):
    source, folder = exported_eagle3(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}, str(folder / "model.safetensors"))
    target = with_vocab_map(tiny_drafter(seed=5))
    with torch.no_grad():
        target.embed_tokens.weight.copy_(source.embed_tokens.weight)
    init_drafter_from_exported(target, folder)
    torch.testing.assert_close(logits_of(target), logits_of(source))


def test_refusals_name_the_problem(tmp_path):
    _, folder = exported_eagle3(tmp_path)
    with pytest.raises(UserError, match="d2t"):  # another draft vocabulary
        init_drafter_from_exported(with_vocab_map(tiny_drafter(), shift=0), folder)
    with pytest.raises(UserError, match="layers.1"):  # the source has more layers than this drafter
        two = with_vocab_map(tiny_drafter(seed=6, num_layers=2))
        deep = write_drafter_folder(two.state_dict(), two.spec, tmp_path / "two", "speculators",
                                    "float32", 3)
        init_drafter_from_exported(with_vocab_map(tiny_drafter()), deep)
    two = with_vocab_map(tiny_drafter(seed=7, num_layers=2))
    half = {k: v for k, v in two.state_dict().items() if "layers.1.mlp" not in k and k != "embed_tokens.weight"}
    (tmp_path / "half").mkdir()
    save_file(half, str(tmp_path / "half" / "model.safetensors"))
    with pytest.raises(UserError, match="part of layers.1"):  # a layer is either all there or all new
        init_drafter_from_exported(with_vocab_map(tiny_drafter(num_layers=2)), tmp_path / "half")
    with pytest.raises(UserError, match="lacks"):  # EAGLE-3.1 fc_norm tensors the source never had
        init_drafter_from_exported(with_vocab_map(tiny_drafter(fc_norm=True)), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :128].contiguous()  # as if trained on 2 aux layers
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="fc.weight has shape"):
        init_drafter_from_exported(with_vocab_map(tiny_drafter()), folder)
    with pytest.raises(UserError, match="not found"):
        init_drafter_from_exported(with_vocab_map(tiny_drafter()), tmp_path / "nowhere")


def test_an_unreadable_source_is_refused_by_name(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        init_drafter_from_exported(with_vocab_map(tiny_drafter()), tmp_path / "bad")


def test_a_resumed_run_does_not_read_init_from(tiny_run, tmp_path):
    cfg, _ = load_config(tiny_run(tmp_path, extra={"train": {"init_from": str(tmp_path / "gone")}}))
    _, _, aux_ids, target_path, hf_cfg = load_checked_dataset(cfg)
    spec = build_drafter_spec(cfg, hf_cfg, target_path, aux_ids, "eagle3")
    with pytest.raises(UserError, match="not found"):  # a fresh run needs its source
        build_drafter(cfg, spec, target_path)
    (cfg.paths.checkpoints / "step-0000010").mkdir(parents=True)
    build_drafter(cfg, spec, target_path)  # resumes: weights come from there
