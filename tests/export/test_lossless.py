"""export/lossless.py: first divergences, and their classification by fp32 re-scoring against a brute-force
reading of a tiny random target's logits."""
from __future__ import annotations

import pytest
import torch

from draftsmith.export.lossless import Fp32Scorer, check_lossless, divergences


def test_divergences_find_each_prompts_first_difference():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2]]
    got = [[1, 2, 3], [4, 0, 6], [7, 8], [1, 2, 3]]
    assert divergences(ref, got) == [(1, 1), (2, 2), (3, 2)]
    with pytest.raises(ValueError):  # a run that lost a prompt is not comparable
        divergences(ref, got[:3])


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(path)
    return path, model


def _greedy(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_classification_against_brute_force_logits(tiny_target):
    path, model = tiny_target
    prompts = [[5, 17, 42, 7], [9, 8, 7, 6, 5]]
    reference = [_greedy(model, p, 6) for p in prompts]
    # one forward over the whole sequence: the logits that predicted output position 2 of prompt 0
    with torch.no_grad():
        full = model(torch.tensor([prompts[0] + reference[0]])).logits[0].float()
    at = full[len(prompts[0]) + 2 - 1]
    top2 = at.topk(3)
    runner_up, third = int(top2.indices[1]), int(top2.indices[2])
    gap2, gap3 = float(top2.values[0] - top2.values[1]), float(top2.values[0] - top2.values[2])
    assert int(top2.indices[0]) == reference[0][2]
    # the other run took the runner-up at position 2 (then anything), prompt 1 identical
    other = [reference[0][:2] + [runner_up, 1, 2, 3], list(reference[1])]
    scorer = Fp32Scorer(str(path))
    bound = (gap2 + gap3) / 2  # between the runner-up's gap and the third's
    near = check_lossless(reference, other, prompts, dtype="bfloat16", scorer=scorer, bound=bound, eos_token_id=2)
    assert (near["identical"], near["near_ties"], near["real"], near["lossless"]) == (1, 1, 0, True)
    d = near["divergences"][0]
    assert (d["prompt_index"], d["position"], d["reference_token"], d["other_token"]) == (0, 2, reference[0][2],
                                                                                           runner_up)
    assert d["fp32_gap_reference"] == pytest.approx(0.0, abs=1e-5)
    assert d["fp32_gap_other"] == pytest.approx(gap2, abs=1e-4) and d["fp32_top2_gap"] == pytest.approx(gap2, abs=1e-4)
    # the third-best token lies beyond the bound: a real disagreement, and the check fails
    other[0][2] = third
    real = check_lossless(reference, other, prompts, dtype="float16", scorer=scorer, bound=bound, eos_token_id=2)
    assert (real["near_ties"], real["real"], real["lossless"]) == (0, 1, False)
    assert real["divergences"][0]["fp32_gap_other"] == pytest.approx(gap3, abs=1e-4)
    # fp32 serving: token identity is the rule, nothing is re-scored
    other[0][2] = runner_up
    strict = check_lossless(reference, other, prompts, dtype="float32", scorer=None, bound=bound, eos_token_id=2)
    assert strict["strict"] and (strict["near_ties"], strict["real"]) == (0, 1)


def test_an_output_that_ended_stands_for_eos(tiny_target):
    path, model = tiny_target
    prompt = [5, 17, 42, 7]
    reference = _greedy(model, prompt, 4)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reference[:2]])).logits[0, -1].float()
    eos = int(logits.argsort(descending=True)[1])  # pretend the runner-up is EOS: the shorter run stopped there
    result = check_lossless([reference], [reference[:2]], [prompt], dtype="bfloat16", scorer=Fp32Scorer(str(path)),
                            bound=float(logits.max() - logits[eos]) + 1e-3, eos_token_id=eos)
    assert result["near_ties"] == 1 and result["divergences"][0]["other_token"] == eos
    unknown = check_lossless([reference], [reference[:2]], [prompt], dtype="bfloat16", scorer=None, bound=100.0,
                             eos_token_id=None)
    assert unknown["real"] == 1 and "EOS" in unknown["divergences"][0]["why"]
