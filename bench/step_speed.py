"""The EAGLE-3 training step before and after the fused draft head (issue #12, item 2), side by side in one run.

Usage: python bench/step_speed.py [--seqs 512 2048 4096] [--steps 3] [--rounds 2]
"dense" is the step as it was: the draft lm_head on every position of every TTT step ([T, V_d] fp32 logits
each), log_softmax + soft CE, the teacher's softmax once per step, autograd through all of it. "fused" is
train/eagle3.py's step now: the teacher once, at scored positions only; the head and its loss only where a step
is scored, chunk by chunk, gradients taken in forward (train/loss.py HeadSoftCrossEntropy). Each (variant, T)
runs in a fresh process (peak RSS is per process), alternating variants round by round; the loss of both is
printed so the equality is visible. SmolLM2's real dims and lm_head, synthetic states, 80 % of positions scored.
"""
import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from draftsmith.data.config import DrafterConfig
from draftsmith.data.target import load_target_config, resolve_target_path
from draftsmith.train.build import load_teacher_head
from draftsmith.train.drafter import Drafter
from draftsmith.train.loss import teacher_from_final_hidden, teacher_targets, ttt_loss, ttt_step_loss
from draftsmith.train.spec import spec_for_target
from draftsmith.train.ttt import shift_for_ttt, ttt_forward, ttt_step_masks

NUM_AUX, TTT_STEPS, STEP_WEIGHT = 3, 3, 0.8


def dense_step(model, row, teacher_weight):
    """The step before the fused head (the former train/eagle3.py ttt_row_loss + ttt_loss)."""
    ids, final, mask = shift_for_ttt(row["input_ids"], row["final_hidden_states"], row["loss_mask"],
                                     row["document_ids"])
    teacher_logits, in_vocab = teacher_from_final_hidden(final, teacher_weight, model.t2d)
    step_masks = ttt_step_masks(mask & in_vocab, row["document_ids"], TTT_STEPS)
    states = ttt_forward(model, row["aux_hidden_states"], ids, row["position_ids"], row["document_ids"], TTT_STEPS)
    T, loss = ids.shape[1], 0.0
    for j, s in enumerate(states):
        n = T - j
        ce_sum, _ = ttt_step_loss(model.lm_head(s)[:, :n], teacher_logits[:, j: j + n], step_masks[j, :, :n])
        loss = loss + STEP_WEIGHT**j * ce_sum / step_masks[j].sum().clamp(min=1)
    return loss


def fused_step(model, row, teacher_weight):
    """train/eagle3.py's ttt_row_loss (no noise)."""
    ids, final, mask = shift_for_ttt(row["input_ids"], row["final_hidden_states"], row["loss_mask"],
                                     row["document_ids"])
    teacher = teacher_targets(final, teacher_weight, model.t2d, mask)
    step_masks = ttt_step_masks(mask & teacher.in_vocab, row["document_ids"], TTT_STEPS)
    states = ttt_forward(model, row["aux_hidden_states"], ids, row["position_ids"], row["document_ids"], TTT_STEPS)
    return ttt_loss(model.lm_head.weight, states, teacher, step_masks, STEP_WEIGHT)[0]


def smollm2_drafter_and_row(seq: int, draft_vocab: int):
    """(drafter, synthetic row of seq tokens, teacher head weight) at SmolLM2's real dims, seeded."""
    path = resolve_target_path("smollm2")
    hf = load_target_config(path)
    torch.manual_seed(0)
    model = Drafter(spec_for_target(hf, DrafterConfig(), method="eagle3", aux_layer_ids=range(1, NUM_AUX + 1),
                                    draft_vocab_size=draft_vocab))
    model.t2d.zero_()
    model.t2d[torch.randperm(hf.vocab_size)[:draft_vocab]] = True
    g = torch.Generator().manual_seed(1)
    run = 64  # alternating 13-token prompt and 51-token response runs: 80 % scored
    row = {"input_ids": torch.randint(0, hf.vocab_size, (1, seq), generator=g),
           "loss_mask": ((torch.arange(seq) % run) >= 13).long()[None],
           "aux_hidden_states": torch.randn(1, seq, NUM_AUX * hf.hidden_size, generator=g),
           "final_hidden_states": torch.randn(1, seq, hf.hidden_size, generator=g),
           "position_ids": torch.arange(seq)[None], "document_ids": torch.zeros(1, seq, dtype=torch.long)}
    return model, row, load_teacher_head(path)


def one_variant(variant: str, seq: int, steps: int, draft_vocab: int) -> dict:
    model, row, teacher_weight = smollm2_drafter_and_row(seq, draft_vocab)
    step = {"dense": dense_step, "fused": fused_step}[variant]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, loss = [], None
    for _ in range(steps + 1):  # the first step warms up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = step(model, row, teacher_weight)
        loss.backward()
        times.append(time.perf_counter() - start)
    grad_norm = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    return {"variant": variant, "seq": seq, "s_per_step": min(times[1:]), "loss": float(loss),
            "grad_norm": float(grad_norm), "rss_before_gib": before / 2**20,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # variant seq: run in this process, print JSON
    a = p.parse_args()
    if a.one:
        torch.set_num_threads(torch.get_num_threads())
        print(json.dumps(one_variant(a.one[0], int(a.one[1]), a.steps, a.draft_vocab)))
        return
    print(f"EAGLE-3 step, SmolLM2 dims, {TTT_STEPS} TTT steps, draft vocab {a.draft_vocab}, fp32, "
          f"{torch.get_num_threads()} threads; best of {a.steps} steps per process, {a.rounds} round(s)")
    results: dict[tuple[str, int], list[dict]] = {}
    for _ in range(a.rounds):
        for seq in a.seqs:
            for variant in ("dense", "fused"):
                out = subprocess.run([sys.executable, __file__, "--one", variant, str(seq), "--steps", str(a.steps),
                                      "--draft-vocab", str(a.draft_vocab)], capture_output=True, text=True, check=True)
                results.setdefault((variant, seq), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'T':>6} {'variant':>7} {'tokens/s':>9} {'s/step':>7} {'peak RSS GiB':>13} {'step memory GiB':>16} "
          f"{'loss':>10} {'grad norm':>10}")
    for seq in a.seqs:
        best = {}
        for variant in ("dense", "fused"):
            runs = results[(variant, seq)]
            r = min(runs, key=lambda x: x["s_per_step"])
            best[variant] = r
            print(f"{seq:>6} {variant:>7} {seq / r['s_per_step']:>9.0f} {r['s_per_step']:>7.2f} "
                  f"{max(x['peak_rss_gib'] for x in runs):>13.2f} "
                  f"{max(x['peak_rss_gib'] - x['rss_before_gib'] for x in runs):>16.2f} "
                  f"{r['loss']:>10.5f} {r['grad_norm']:>10.5f}")
        d, f = best["dense"], best["fused"]
        print(f"{seq:>6}   fused/dense: tokens/s {d['s_per_step'] / f['s_per_step']:.2f}x, step memory "
              f"{(f['peak_rss_gib'] - f['rss_before_gib']) / max(d['peak_rss_gib'] - d['rss_before_gib'], 1e-9):.2f}x, "
              f"|loss difference| {abs(d['loss'] - f['loss']):.1e}")


if __name__ == "__main__":
    main()
