"""Muon's Newton-Schulz iteration in fp32 against bf16 on this CPU, inside a whole training step, side by side.

Usage: python bench/muon_newton_schulz.py [--seq 512] [--rounds 5]
A run under bf16 autocast (train.precision=auto on a CPU whose probe measures bf16 matmuls >= 1.5x faster, or
bf16) now iterates in bf16 (train/muon.py newton_schulz_dtype); before, a CPU always iterated in fp32. This times,
in one process and in alternation, round by round: one EAGLE-3 step's forward + backward of a row of --seq tokens
under bf16 autocast (SmolLM2's real dims and lm_head, frozen as in speculators' recipe, draft vocab 32000, 3 TTT
steps, synthetic states), and one MuonWithAdamW step on those gradients with each iteration dtype. Each figure is
the best of its rounds. Also printed: the probe's bf16 speedup, and how far the bf16 iteration's update lies from
the fp32 one (relative Frobenius distance, worst matrix).
"""
import argparse
import time

import torch
from step_speed import fused_step, smollm2_drafter_and_row

from draftsmith.train.muon import MuonWithAdamW, orthogonalize, split_params_for_muon
from draftsmith.train.precision import cpu_bf16_speedup

DRAFT_VOCAB = 32000


def build(seq: int):
    model, row, teacher_weight = smollm2_drafter_and_row(seq, DRAFT_VOCAB)
    model.lm_head.weight.requires_grad_(False)  # train.freeze_lm_head, as in speculators' recipe
    return model, row, teacher_weight


def forward_backward_seconds(model, row, teacher_weight) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_step(model, row, teacher_weight)
    loss.backward()
    return time.perf_counter() - start


def optimizer_seconds(model, dtype: torch.dtype) -> float:
    """One Muon + AdamW step on the model's gradients; the weights are put back, so every round starts equal."""
    saved = [p.detach().clone() for p in model.parameters()]
    opt = MuonWithAdamW(model, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0, muon_lr=2e-3, muon_weight_decay=0.0,
                        ns_dtype=dtype)
    start = time.perf_counter()
    opt.step()
    spent = time.perf_counter() - start
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    return spent


def bf16_distance_from_fp32(model) -> float:
    worst = 0.0
    for p in split_params_for_muon(model)[0]:
        exact = orthogonalize(p.grad, dtype=torch.float32)
        worst = max(worst, float((orthogonalize(p.grad, dtype=torch.bfloat16) - exact).norm() / exact.norm()))
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    model, row, teacher_weight = build(a.seq)
    muon = split_params_for_muon(model)[0]
    print(f"EAGLE-3 step, SmolLM2 dims, {a.seq}-token row, draft vocab {DRAFT_VOCAB}, bf16 autocast, "
          f"{torch.get_num_threads()} threads; Muon on {len(muon)} matrices "
          f"({sum(q.numel() for q in muon) / 1e6:.1f}M weights); best of {a.rounds} rounds")
    print(f"probe: a bf16 matmul runs {cpu_bf16_speedup():.2f}x fp32's speed on this CPU")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    fwd_bwd = forward_backward_seconds(model, row, teacher_weight)  # warm-up
    best = {"forward+backward": fwd_bwd} | {n: float("inf") for n in dtypes}
    for n, d in dtypes.items():
        optimizer_seconds(model, d)  # warm-up
    for _ in range(a.rounds):
        best["forward+backward"] = min(best["forward+backward"], forward_backward_seconds(model, row, teacher_weight))
        for n, d in dtypes.items():
            best[n] = min(best[n], optimizer_seconds(model, d))
    fb = best["forward+backward"]
    print(f"  forward+backward {fb:.3f} s")
    for n in dtypes:
        step = fb + best[n]
        print(f"  optimizer, Newton-Schulz in {n}: {best[n]:.3f} s -> whole step {step:.3f} s = "
              f"{a.seq / step:.0f} tokens/s ({best[n] / step:.0%} of it in the optimizer)")
    print(f"bf16 / fp32: optimizer {best['fp32'] / best['bf16']:.2f}x faster, whole step "
          f"{(fb + best['fp32']) / (fb + best['bf16']):.2f}x the tokens/s; the bf16 update lies "
          f"{bf16_distance_from_fp32(model):.4f} from the fp32 one (relative, worst matrix)")


if __name__ == "__main__":
    main()
