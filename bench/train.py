"""EAGLE-3 training throughput and peak memory at several sequence lengths, side by side (issue #3).

Usage: python bench/train.py [--seqs 512 2048 8192] [--ttt-steps 3] [--draft-vocab 32000] [--steps 2]
Each length runs in a fresh subprocess (so peak RSS is its own) on synthetic hidden states with the
SmolLM2 target's real dims and lm_head (the teacher); prints tokens/s, peak memory and their ratios.
"""
import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def run_one(seq: int, ttt_steps: int, draft_vocab: int, steps: int, attention: str) -> dict:
    from draftsmith.data.config import DrafterConfig, load_config
    from draftsmith.data.target import load_target_config, resolve_target_path
    from draftsmith.train.build import load_teacher_head
    from draftsmith.train.drafter import Drafter
    from draftsmith.train.eagle3 import ttt_row_loss
    from draftsmith.train.spec import spec_for_target

    cfg, _ = load_config("smollm2-demo", [f"ttt.num_steps={ttt_steps}", f"train.attention={attention}"])
    path = resolve_target_path("smollm2")
    hf = load_target_config(path)
    teacher = load_teacher_head(path)
    model = Drafter(spec_for_target(hf, DrafterConfig(), method="eagle3", aux_layer_ids=(1, 2, 3),
                                    draft_vocab_size=draft_vocab))
    model.t2d.zero_()
    model.t2d[:draft_vocab] = True
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    h = hf.hidden_size
    row = {"input_ids": torch.randint(0, draft_vocab, (1, seq), generator=g),
           "loss_mask": torch.ones(1, seq, dtype=torch.long),
           "aux_hidden_states": torch.randn(1, seq, 3 * h, generator=g).bfloat16(),
           "final_hidden_states": torch.randn(1, seq, h, generator=g).bfloat16(),
           "position_ids": torch.arange(seq)[None], "document_ids": torch.zeros(1, seq, dtype=torch.long)}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps + 1):  # the first step warms up
        t = time.perf_counter()
        loss, _ = ttt_row_loss(model, row, teacher, model.t2d, cfg, attention)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step_s = sum(times[1:]) / steps
    return {"seq": seq, "tokens_per_s": seq / step_s, "step_s": step_s, "peak_rss_gib": peak / 2**20,
            "peak_increment_gib": (peak - base) / 2**20}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--attention", default="blockwise")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(run_one(a.one, a.ttt_steps, a.draft_vocab, a.steps, a.attention)))
        return
    results = []
    for seq in a.seqs:
        out = subprocess.run([sys.executable, __file__, "--one", str(seq), "--ttt-steps", str(a.ttt_steps),
                              "--draft-vocab", str(a.draft_vocab), "--steps", str(a.steps),
                              "--attention", a.attention], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"EAGLE-3 TTT training, {a.ttt_steps} steps, draft vocab {a.draft_vocab}, SmolLM2 dims, fp32 CPU, "
          f"attention={a.attention}, torch threads {torch.get_num_threads()}")
    print(f"{'seq':>6s} {'tokens/s':>9s} {'s/step':>7s} {'peak RSS GiB':>13s} {'peak - start GiB':>17s}")
    for r in results:
        print(f"{r['seq']:6d} {r['tokens_per_s']:9.0f} {r['step_s']:7.2f} {r['peak_rss_gib']:13.2f} "
              f"{r['peak_increment_gib']:17.2f}")
    by = {r["seq"]: r for r in results}
    if 2048 in by and 8192 in by:
        print(f"peak(8192)/peak(2048): RSS {by[8192]['peak_rss_gib'] / by[2048]['peak_rss_gib']:.2f}, "
              f"increment {by[8192]['peak_increment_gib'] / by[2048]['peak_increment_gib']:.2f}  (goal <= 4.5)")


if __name__ == "__main__":
    main()
