"""Where the time of one EAGLE-3 training step goes on this CPU (issue #12): torch.profiler over forward +
backward + optimizer of one packed row, operator times summed into the step's parts.

Usage: python bench/profile_step.py [--seq 2048] [--ttt-steps 3] [--draft-vocab 32000] [--steps 2]
The row is synthetic (random hidden states) with the SmolLM2 target's real dims and lm_head, like
bench/train.py. Parts are found from the profiler's record_function scopes placed around each part below
(the teacher, the drafter steps, the loss), so the split is the code's own, not a guess from op names.
"""
import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from draftsmith.data.config import DrafterConfig, load_config
from draftsmith.data.target import load_target_config, resolve_target_path
from draftsmith.train.build import load_teacher_head
from draftsmith.train.drafter import Drafter
from draftsmith.train.loss import teacher_targets, ttt_loss
from draftsmith.train.spec import spec_for_target
from draftsmith.train.ttt import TTTAttention, shift_for_ttt, shift_tokens, ttt_step_masks


def synthetic_row(seq: int, hidden: int, draft_vocab: int, scored_fraction: float) -> dict:
    """Random states; the loss mask holds on `scored_fraction` of the positions, in assistant-like runs."""
    g = torch.Generator().manual_seed(0)
    run = 64  # alternating prompt / response runs
    loss_mask = ((torch.arange(seq) % run) >= round(run * (1 - scored_fraction))).long()[None]
    return {"input_ids": torch.randint(0, draft_vocab, (1, seq), generator=g), "loss_mask": loss_mask,
            "aux_hidden_states": torch.randn(1, seq, 3 * hidden, generator=g).bfloat16(),
            "final_hidden_states": torch.randn(1, seq, hidden, generator=g).bfloat16(),
            "position_ids": torch.arange(seq)[None], "document_ids": torch.zeros(1, seq, dtype=torch.long)}


def profiled_step(model, row, teacher_weight, num_steps: int, step_weight: float):
    """ttt_row_loss (train/eagle3.py) spelled out with a scope around each part; same math."""
    with record_function("part: teacher (target lm_head, full vocab, at scored positions)"):
        ids, final, mask = shift_for_ttt(row["input_ids"], row["final_hidden_states"], row["loss_mask"],
                                         row["document_ids"])
        teacher = teacher_targets(final.float(), teacher_weight, model.t2d, mask)
        step_masks = ttt_step_masks(mask & teacher.in_vocab, row["document_ids"], num_steps)
    attention = TTTAttention(row["document_ids"], "blockwise")
    with record_function("part: fc over aux states"):
        hidden = model.combine_aux_hidden_states(row["aux_hidden_states"].float())
    states = []
    for j in range(num_steps):
        with record_function("part: drafter layer"):
            hidden, head_input = model(shift_tokens(ids, j), hidden, row["position_ids"] + j, attention,
                                       apply_lm_head=False)
        states.append(head_input)
    with record_function("part: draft lm_head + loss + their gradients (fused, scored positions)"):
        loss, _ = ttt_loss(model.lm_head.weight, states, teacher, step_masks, step_weight)
    with record_function("part: backward (the layer; the head's gradients are already computed)"):
        loss.backward()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--scored-fraction", type=float, default=0.8,
                   help="share of positions under the loss mask (the anchor's assistant share is ~0.8)")
    a = p.parse_args()
    cfg, _ = load_config("smollm2-demo", [f"ttt.num_steps={a.ttt_steps}"])
    path = resolve_target_path("smollm2")
    hf = load_target_config(path)
    teacher = load_teacher_head(path)
    model = Drafter(spec_for_target(hf, DrafterConfig(), method="eagle3", aux_layer_ids=(1, 2, 3),
                                    draft_vocab_size=a.draft_vocab))
    model.t2d.zero_()
    model.t2d[: a.draft_vocab] = True
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    row = synthetic_row(a.seq, hf.hidden_size, a.draft_vocab, a.scored_fraction)

    def step():
        profiled_step(model, row, teacher, a.ttt_steps, cfg.ttt.step_weight)
        with record_function("part: optimizer"):
            opt.step()
            opt.zero_grad()

    step()  # warm-up
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    wall = (time.perf_counter() - start) / a.steps
    events = prof.key_averages()
    parts = {e.key: e.cpu_time_total / 1e6 / a.steps for e in events if e.key.startswith("part: ")}
    print(f"one EAGLE-3 step: T={a.seq}, {a.ttt_steps} TTT steps, draft vocab {a.draft_vocab}, SmolLM2 dims "
          f"(H={hf.hidden_size}, V_t={hf.vocab_size}), {a.scored_fraction:.0%} of positions scored, fp32, {torch.get_num_threads()} threads; "
          f"{wall:.2f} s/step under the profiler = {a.seq / wall:.0f} tokens/s")
    for key, secs in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {secs:7.2f} s  {100 * secs / wall:5.1f} %  {key[6:]}")
    by_op = defaultdict(float)
    for e in events:
        if not e.key.startswith("part: "):
            by_op[e.key] += e.self_cpu_time_total / 1e6 / a.steps
    print(f"top {a.top} operators by self time (s/step):")
    for key, secs in sorted(by_op.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"  {secs:7.2f} s  {100 * secs / wall:5.1f} %  {key}")


if __name__ == "__main__":
    main()
