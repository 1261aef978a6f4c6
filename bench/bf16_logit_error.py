"""How far bf16 moves the target's top-2 logit gap: the basis of export.near_tie_logit_gap (export/lossless.py).

Greedy continuations of held-out prompts by the target in fp32, then one forward over each full sequence in fp32
and one in bf16 (or fp16); at every output position, the fp32 gap between the top two tokens against the same
two tokens' gap in the lower precision. A flip between two lower-precision runs (the verify forward and the
target alone) needs a true gap no larger than both runs' errors together.

Usage: python bench/bf16_logit_error.py [--target smollm2] [--prompts bench/other-prompts.jsonl] [--num-prompts 8]
       [--max-tokens 96] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from draftsmith.data.target import load_target_model, load_tokenizer, resolve_target_path
from draftsmith.export.validate import load_prompt_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", default=str(Path(__file__).parent / "other-prompts.jsonl"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = p.parse_args()
    target = resolve_target_path(args.target)
    prompts = load_prompt_ids(Path(args.prompts), args.num_prompts, load_tokenizer(target))
    exact = load_target_model(target, "float32", device="cpu")
    low = load_target_model(target, args.dtype, device="cpu")
    errors, gaps = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = exact.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
            n = seq.shape[1] - len(prompt)
            at = slice(len(prompt) - 1, len(prompt) - 1 + n)  # the logits that chose each output token
            l32 = exact(seq).logits[0, at].float()
            llow = low(seq).logits[0, at].float()
            top2 = l32.topk(2, dim=-1)
            gap32 = top2.values[:, 0] - top2.values[:, 1]
            gap_low = llow.gather(1, top2.indices[:, :1])[:, 0] - llow.gather(1, top2.indices[:, 1:])[:, 0]
            errors.append((gap_low - gap32).abs())
            gaps.append(gap32)
    e, g = torch.cat(errors), torch.cat(gaps)
    q = lambda x, v: float(x.quantile(v))
    print(f"target {args.target}, {len(prompts)} prompts, {e.numel()} output positions, {args.dtype} vs fp32")
    print(f"|top-2 gap error| in logits: mean {e.mean():.3f}  p50 {q(e, .5):.3f}  p90 {q(e, .9):.3f}  "
          f"p99 {q(e, .99):.3f}  max {e.max():.3f}")
    print(f"fp32 top-2 gap: p1 {q(g, .01):.3f}  p5 {q(g, .05):.3f}  p10 {q(g, .1):.3f}  "
          f"(share of positions within 1.0 logit: {float((g <= 1.0).float().mean()):.3f})")
    print(f"suggested export.near_tie_logit_gap: 2 x max error = {2 * e.max():.2f}")


if __name__ == "__main__":
    main()
