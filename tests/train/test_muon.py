"""train/muon.py against torch.optim: its AdamW half equals torch.optim.AdamW; its Muon half equals
torch.optim.Muon (adjust_lr_fn="match_rms_adamw"), with the Newton-Schulz iteration in float32 (patched into
torch's) and in bfloat16 (torch's own)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from draftsmith.data.config import load_config
from draftsmith.data.errors import UserError
from draftsmith.train.loop import build_optimizer
from draftsmith.train.muon import MuonWithAdamW, orthogonalize, split_params_for_muon


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(10, 8)
        self.fc = nn.Linear(12, 8, bias=False)
        self.q_proj = nn.Linear(8, 16, bias=False)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 12))  # [1, N]: a vector, AdamW's


def fake_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def test_split_follows_muon_practice():
    model = Tiny()
    muon, adamw = split_params_for_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == ["fc.weight", "q_proj.weight"]
    assert "lm_head.weight" in {names[id(p)] for p in adamw} and "mask_hidden" in {names[id(p)] for p in adamw}


def test_adamw_half_equals_torch_adamw():
    ours, ref = Tiny(), Tiny()
    opt = MuonWithAdamW(ours, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, muon_lr=0.02, muon_weight_decay=0.1)
    adamw_params = split_params_for_muon(ref)[1]
    ref_opt = torch.optim.AdamW(adamw_params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(4):
        fake_grads(ours, step)
        fake_grads(ref, step)
        opt.step()
        ref_opt.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if name in ("lm_head.weight", "norm.weight", "norm.bias", "mask_hidden", "embed_tokens.weight"):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_muon_half_equals_torch_muon_with_float32_newton_schulz(monkeypatch):
    ours, ref = Tiny(), Tiny()
    opt = MuonWithAdamW(ours, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, muon_lr=0.02, muon_weight_decay=0.1)
    # torch's iteration runs in bf16; in float32 it is the same algorithm at the precision ours uses on a CPU
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz",
                        lambda grad, coefficients, ns_steps, eps: orthogonalize(grad, ns_steps, eps))
    ref_opt = torch.optim.Muon(split_params_for_muon(ref)[0], lr=0.02, weight_decay=0.1, momentum=0.95,
                               nesterov=True, adjust_lr_fn="match_rms_adamw")
    for step in range(4):
        fake_grads(ours, step)
        fake_grads(ref, step)
        opt.step()
        ref_opt.step()
    for name in ("fc.weight", "q_proj.weight"):
        torch.testing.assert_close(dict(ours.named_parameters())[name], dict(ref.named_parameters())[name],
                                   rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_muon_half_in_bf16_equals_torch_muon_unpatched():
    """torch.optim.Muon iterates in bf16 on every device: ours does the same when the run is bf16."""
    ours, ref = Tiny(), Tiny()
    opt = MuonWithAdamW(ours, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, muon_lr=0.02, muon_weight_decay=0.1,
                        ns_dtype=torch.bfloat16)
    ref_opt = torch.optim.Muon(split_params_for_muon(ref)[0], lr=0.02, weight_decay=0.1, momentum=0.95,
                               nesterov=True, adjust_lr_fn="match_rms_adamw")
    fp32 = Tiny()
    fp32_opt = MuonWithAdamW(fp32, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, muon_lr=0.02, muon_weight_decay=0.1)
    for step in range(4):
        for m in (ours, ref, fp32):
            fake_grads(m, step)
        for o in (opt, ref_opt, fp32_opt):
            o.step()
    for name in ("fc.weight", "q_proj.weight"):
        a, b = dict(ours.named_parameters())[name], dict(ref.named_parameters())[name]
        # the same bf16 roundings as torch's (max |difference| 0 here), far inside bf16's distance from fp32
        # (checked below, so the tolerance cannot pass an fp32 iteration by accident)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert (a - dict(fp32.named_parameters())[name]).abs().max() > 1e-4


@pytest.mark.parametrize(("setting", "mixed_precision", "expected"), [
    ("auto", "bf16", torch.bfloat16), ("auto", "no", torch.float32),
    ("fp32", "bf16", torch.float32), ("bf16", "no", torch.bfloat16)])
def test_the_run_precision_picks_the_iteration_dtype(setting, mixed_precision, expected):
    cfg, _ = load_config("smollm2-quick", ["train.optimizer=muon", f"train.muon_ns_precision={setting}"])
    assert build_optimizer(Tiny(), cfg.train, mixed_precision)[0].ns_dtype == expected


def test_an_unknown_iteration_precision_names_the_field():
    with pytest.raises(UserError, match="muon_ns_precision"):
        load_config("smollm2-quick", ["train.muon_ns_precision=fp16"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orthogonalize_approaches_the_polar_factor(dtype):
    g = torch.randn(64, 24, generator=torch.Generator().manual_seed(0))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    x = orthogonalize(g, dtype=dtype)
    assert x.dtype == g.dtype
    singular = torch.linalg.svdvals(x)
    assert singular.min() > 0.5 and singular.max() < 1.25, "Muon's quintic keeps singular values near 1"
    assert torch.nn.functional.cosine_similarity(x.flatten(), (u @ vh).flatten(), dim=0) > 0.95


def test_muon_refuses_sharded_backends(monkeypatch):
    from draftsmith.train.distributed import build_accelerator

    cfg, _ = load_config("smollm2-quick", ["train.optimizer=muon"])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserError, match="train.optimizer=muon"):
        build_accelerator(cfg)
