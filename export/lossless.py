"""The lossless check, sound under every serving dtype (DESIGN section 7).

In fp32 greedy outputs with and without the drafter must be token-identical: any difference is a bug. In
bf16/fp16 they need not be: the verify forward runs K+1 positions per sequence where the target alone runs one,
so its matmuls reduce in another order and a near-tied argmax can flip. So each first divergence is re-scored by
the target alone in fp32 on the common prefix: where both tokens lie within `bound` logits of the fp32 top token
it is a near-tie (numerics); otherwise one of them is a token the target would not have chosen: a real
disagreement, and validation fails."""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def divergences(reference: list[list[int]], other: list[list[int]]) -> list[tuple[int, int]]:
    """(prompt index, token position) of the first differing output token of every prompt whose outputs differ."""
    out = []
    for i, (ref, got) in enumerate(zip(reference, other, strict=True)):
        if ref != got:
            out.append((i, next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))))
    return out


class Fp32Scorer:
    """The target alone in fp32, loaded on first use: next-token logits after a prefix."""

    def __init__(self, target: str):
        self.target, self.model = target, None

    def next_token_logits(self, prefix: list[int]):
        import torch

        if self.model is None:
            from draftsmith.data.target import load_target_model

            logger.info("loading %s in fp32 to re-score divergences", self.target)
            # a target larger than one GPU in fp32 spreads over the node's GPUs
            self.model = load_target_model(self.target, "float32", "auto" if torch.cuda.is_available() else "")
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            return self.model(torch.tensor([prefix], device=device)).logits[0, -1].float().cpu()


def classify(scorer, prompt: list[int], reference: list[int], other: list[int], position: int, bound: float,
             eos_token_id: int | None) -> dict:
    """One first divergence: the fp32 logit gaps of both tokens to the top token, and near-tie or real.
    A sequence that ended there (no token at `position`) stands for end of sequence."""
    def token_at(seq):
        return seq[position] if position < len(seq) else eos_token_id

    ref_tok, other_tok = token_at(reference), token_at(other)
    record = {"position": position, "reference_token": ref_tok, "other_token": other_tok}
    if ref_tok is None or other_tok is None:
        return {**record, "class": "real", "why": "one output ended and the tokenizer names no EOS token"}
    logits = scorer.next_token_logits(prompt + reference[:position])
    top2 = logits.topk(2).values
    top = float(top2[0])
    gaps = {"fp32_gap_reference": top - float(logits[ref_tok]), "fp32_gap_other": top - float(logits[other_tok]),
            "fp32_top2_gap": top - float(top2[1])}
    near = max(gaps["fp32_gap_reference"], gaps["fp32_gap_other"]) <= bound
    return {**record, **gaps, "class": "near_tie" if near else "real"}


def check_lossless(reference: list[list[int]], other: list[list[int]], prompts: list[list[int]], *, dtype: str,
                   scorer, bound: float, eos_token_id: int | None) -> dict:
    """Counts of identical outputs, near-ties and real disagreements of `other` against the target alone."""
    found = divergences(reference, other)
    strict = dtype == "float32"
    records = []
    for i, pos in found:
        if strict:
            record = {"position": pos, "class": "real", "why": "fp32: outputs must be identical"}
        else:
            record = classify(scorer, prompts[i], reference[i], other[i], pos, bound, eos_token_id)
        records.append({"prompt_index": i, **record})
    real = sum(r["class"] == "real" for r in records)
    return {"dtype": dtype, "strict": strict, "near_tie_bound_logits": None if strict else bound,
            "num_prompts": len(reference), "identical": len(reference) - len(found),
            "near_ties": len(found) - real, "real": real, "lossless": real == 0, "divergences": records}
