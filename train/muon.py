"""Muon for the drafter's hidden matrices and AdamW for everything else, as one optimizer (train.optimizer: muon).

One optimizer object keeps one LR schedule (each group's own peak lr times the same factor), one state dict for
checkpoints and one `step` for accelerate. The Newton-Schulz iteration runs by default in the precision of the
run's matmuls (`newton_schulz_dtype`): bfloat16 under bf16 autocast, as torch.optim.Muon does, which on a CPU means
its probe measured bf16 matmuls faster (bench/muon_newton_schulz.py times both there); float32 otherwise, where a
CPU emulates bf16 (~0.5 s per step for a 1-layer drafter against ~28 s in bf16 on an AVX2 CPU). Which
parameters go where follows Keller Jordan's Muon: 2D matrices with both sides > 1, except the embeddings and the
output head.
"""
from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of Muon's reference implementation (and torch's)
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head")


def split_params_for_muon(model: torch.nn.Module) -> tuple[list, list]:
    """(Muon params, AdamW params) among the trainable ones."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS)
        (muon if is_matrix else adamw).append(p)
    return muon, adamw


def newton_schulz_dtype(setting: str, mixed_precision: str) -> torch.dtype:
    """The iteration's dtype for train.muon_ns_precision `setting` (auto | bf16 | fp32) in a run under
    accelerate's `mixed_precision` ("bf16" or "no"). auto is bf16 only where the run already trusts bf16 matmuls
    to be fast (train/precision.py decides that once per run)."""
    if setting == "auto":
        setting = "bf16" if mixed_precision == "bf16" else "fp32"
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[setting]


def orthogonalize(update: torch.Tensor, ns_steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately U V^T of update = U S V^T: the quintic Newton-Schulz iteration on the wide orientation."""
    a, b, c = NS_COEFFICIENTS
    tall = update.shape[0] > update.shape[1]
    x = (update.T if tall else update).to(dtype)
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        # addmm sums inside the product kernel: one rounding per line in bf16, not one per term
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # aX + (bG + cG^2)X
    return (x.T if tall else x).to(update.dtype)


def muon_lr_scale(shape: torch.Size) -> float:
    """Scale the orthogonalized update to AdamW's typical RMS (0.2 sqrt(max(A, B))), so one lr suits any shape."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


class MuonWithAdamW(torch.optim.Optimizer):
    """Param groups flagged use_muon take Muon steps (Nesterov momentum, orthogonalized update, decoupled weight
    decay); the others take AdamW steps (as torch.optim.AdamW, bias-corrected)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 muon_lr: float, muon_weight_decay: float, momentum: float = 0.95, ns_steps: int = 5,
                 eps: float = 1e-8, ns_dtype: torch.dtype = torch.float32):
        muon, adamw = split_params_for_muon(model)
        groups = [{"params": muon, "use_muon": True, "lr": muon_lr, "weight_decay": muon_weight_decay,
                   "momentum": momentum, "ns_steps": ns_steps},
                  {"params": adamw, "use_muon": False, "lr": lr, "weight_decay": weight_decay, "betas": betas,
                   "eps": eps}]
        super().__init__([g for g in groups if g["params"]], {})
        self.ns_dtype = ns_dtype  # not a group setting: a resumed run keeps its precision (train/precision.json)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                (self._muon_update if group["use_muon"] else self._adamw_update)(p, group)
        return loss

    def _muon_update(self, p, group) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        update = p.grad.lerp(buf, group["momentum"])  # Nesterov
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(orthogonalize(update, group["ns_steps"], dtype=self.ns_dtype), alpha=-group["lr"] * muon_lr_scale(p.shape))

    def _adamw_update(self, p, group) -> None:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        p.mul_(1 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**t))
