"""Numerical parity with vLLM's own drafter module (slow: three in-process fp32 engines, about 3-6 minutes).

A random drafter is exported for the real SmolLM2 target, served by the installed vLLM in fp32, and its first
proposal is recorded inside the engine: the aux states vLLM hands the drafter, `combine_hidden_states`, the
drafter forward's inputs (token ids, RoPE positions, hidden) and outputs, the target-vocab logits and the proposed
tokens. train/drafter.py, fed the inputs built the way training builds them (token t+1 at position t), must
reproduce each of them: layer 0's input, the norm switches, the RoPE offset and d2t are compared, not assumed.
Each case also runs a deliberately wrong twin (a flipped norm switch, the RoPE positions off by one) that must
miss, so the comparison is shown to be able to fail.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from draftsmith.data.config import DrafterConfig
from draftsmith.export import format as fmt
from draftsmith.export.read import drafter_as_served
from draftsmith.export.write import write_drafter_folder
from draftsmith.train.drafter import Drafter
from draftsmith.train.spec import spec_for_target
from draftsmith.train.ttt import TTTAttention, shift_tokens

pytestmark = pytest.mark.slow

K = 3
TIMEOUT_S = 3600
PROMPT = "def fibonacci(n):\n    "
# 30-layer SmolLM2: id 30 is the stream after the last layer (data/layer_ids.py), which vLLM takes too
CASES = {
    "eagle3-aux-N": ("speculators", {"aux_layer_ids": (2, 15, 30)}),
    "eagle3.1-4aux": ("speculators", {"aux_layer_ids": (2, 10, 20, 27), "fc_norm": True, "norm_output": True,
                                          "norm_before_residual": False}),
    "legacy-norm_before_fc": ("legacy", {"norm_before_fc": True}),
    "peagle": ("speculators", {"method": "peagle", "num_hidden_layers": 2, "mask_token_id": 0, "fc_norm": True,
                                   "norm_output": True, "norm_before_residual": False}),
}
# the norm switch the deliberately wrong twin flips, per case
BROKEN = {"eagle3-aux-N": "norm_before_residual", "eagle3.1-4aux": "norm_output",
          "legacy-norm_before_fc": "norm_before_fc", "peagle": "fc_norm"}

RECORD_SCRIPT = textwrap.dedent('''
    import json, sys, traceback
    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import llama_eagle3
    from vllm.v1.spec_decode import llm_base_proposer

    REC, STATE = {}, {"in_propose": False, "done": False}
    Model = llama_eagle3.Eagle3LlamaForCausalLM

    def first(name, value):
        if STATE["in_propose"] and not STATE["done"] and name not in REC:
            REC[name] = value

    def wrap(cls, method, record):
        real = getattr(cls, method)
        def wrapped(self, *args, **kwargs):
            out = real(self, *args, **kwargs)
            record(args, kwargs, out)
            return out
        setattr(cls, method, wrapped)

    wrap(Model, "combine_hidden_states", lambda a, kw, out: (
        first("aux", a[0].detach().float().clone()), first("combined", out.detach().float().clone())))
    def arg(a, kw, i, name):
        return kw[name] if name in kw else a[i]

    def record_forward(a, kw, out):
        if STATE["in_propose"] and not STATE["done"]:  # every draft step of the first proposal
            REC.setdefault("forwards", []).append({
                "input_ids": arg(a, kw, 0, "input_ids").detach().clone(),
                "positions": arg(a, kw, 1, "positions").detach().clone(),
                "hidden_in": arg(a, kw, 2, "hidden_states").detach().float().clone(),
                "hidden_out": out[0].detach().float().clone(), "aux_out": out[1].detach().float().clone()})
    wrap(Model, "forward", record_forward)

    def record_logits(a, kw, out):
        if STATE["in_propose"] and not STATE["done"]:
            REC.setdefault("logits", []).append(out.detach().float().clone())
    wrap(Model, "compute_logits", record_logits)

    real_propose = llm_base_proposer.SpecDecodeBaseProposer.propose
    def propose(self, *args, **kwargs):
        STATE["in_propose"] = not STATE["done"]
        out = real_propose(self, *args, **kwargs)
        tokens = out[0] if isinstance(out, tuple) else out
        first("draft_tokens", tokens.detach().clone())
        STATE["in_propose"], STATE["done"] = False, bool(REC)
        return out
    llm_base_proposer.SpecDecodeBaseProposer.propose = propose

    if __name__ == "__main__":
        jobs, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
        for name, job in jobs.items():
            REC.clear(); STATE.update(in_propose=False, done=False)
            try:
                llm = LLM(model=job["target"], dtype="float32", max_model_len=256, seed=0, enforce_eager=True,
                          speculative_config=job["speculative_config"])
                out = llm.generate({"prompt_token_ids": job["prompt_ids"]},
                                   SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
                REC["output_ids"] = torch.tensor(list(out[0].outputs[0].token_ids))
                torch.save(dict(REC), f"{out_dir}/{name}.pt")
                del llm
            except Exception:
                open(f"{out_dir}/{name}.error", "w").write(traceback.format_exc()[-4000:])
''')


def case_spec(target: str, overrides: dict):
    from transformers import AutoConfig

    spec = spec_for_target(AutoConfig.from_pretrained(target), DrafterConfig(), method="eagle3",
                           aux_layer_ids=(2, 15, 27), draft_vocab_size=8192, verifier_name_or_path=target)
    return dataclasses.replace(spec, **overrides)


def random_weights(spec, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with norms away from 1 (a skipped norm must show) and d2t over every 6th target id."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (shape, want) in fmt.expected_tensors(spec).items():
        if want is None:
            base = 1.0 if len(shape) == 1 else 0.0
            sd[name] = base + (0.3 if len(shape) == 1 else 0.05) * torch.randn(shape, generator=g)
    used = torch.arange(spec.draft_vocab_size) * (spec.vocab_size // spec.draft_vocab_size)
    sd["d2t"], sd["t2d"] = used - torch.arange(spec.draft_vocab_size), torch.zeros(spec.vocab_size, dtype=torch.bool)
    sd["t2d"][used] = True
    if spec.method == "peagle":
        sd["embed_tokens.weight"] = 0.05 * torch.randn(spec.vocab_size, spec.hidden_size, generator=g)
    return sd


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """case -> (spec, written weights, what vLLM's drafter did on its first proposal)."""
    from transformers import AutoTokenizer

    from draftsmith.data.target import resolve_target_path

    target = resolve_target_path("smollm2")
    prompt_ids = AutoTokenizer.from_pretrained(target)(PROMPT)["input_ids"]
    root = tmp_path_factory.mktemp("vllm_parity")
    jobs, cases = {}, {}
    for seed, (name, (layout, overrides)) in enumerate(CASES.items()):
        spec = case_spec(target, overrides)
        weights = random_weights(spec, seed)
        folder = write_drafter_folder(weights, spec, root / name, layout, "float32", K)
        speculative = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}
        if spec.parallel_drafting:
            speculative["parallel_drafting"] = True
        jobs[name] = {"target": target, "speculative_config": speculative, "prompt_ids": prompt_ids}
        cases[name] = (spec, weights)
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "record.py").write_text(RECORD_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(root / "record.py"), str(root / "jobs.json"), str(root)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    out = {}
    for name, (spec, weights) in cases.items():
        error = root / f"{name}.error"
        assert not error.exists(), error.read_text()
        assert (root / f"{name}.pt").is_file(), f"no record for {name}: rc {proc.returncode}\n{proc.stderr[-4000:]}"
        out[name] = (spec, weights, torch.load(root / f"{name}.pt"), target, prompt_ids)
    return out


def our_drafter(spec, weights, target: str) -> Drafter:
    """train/drafter.py holding the written weights, as the benches' scorer reads an exported folder."""
    from draftsmith.data.target import load_target_head

    return drafter_as_served(spec, weights, load_target_head(target)["embed"].float())


def target_vocab_logits(drafter, normed: torch.Tensor) -> torch.Tensor:
    """Draft logits scattered into the target vocab through d2t (-inf elsewhere), as vLLM's compute_logits."""
    logits = torch.full((drafter.spec.vocab_size,), float("-inf"))
    logits[torch.arange(drafter.spec.draft_vocab_size) + drafter.d2t] = drafter.lm_head(normed)
    return logits


def relative(ours: torch.Tensor, served: torch.Tensor) -> float:
    """Max abs difference relative to the served tensor's largest magnitude (the aux streams reach ~1e2)."""
    return float((ours - served).abs().max() / served.abs().max().clamp(min=1e-12))


def logits_diff(ours: torch.Tensor, served: torch.Tensor) -> tuple[float, float]:
    finite = torch.isfinite(served)
    return float((finite != torch.isfinite(ours)).sum()), relative(ours[finite], served[finite])


def compare(spec, weights, rec, target, prompt_ids, step1_offset: int = 1) -> dict[str, float]:
    """Relative differences (and counts of differing ids) between vLLM's record and train/drafter.py, for draft step 0
    over the prompt and (EAGLE-3)
    draft step 1 at the last position, with the training code's own inputs and TTT unroll."""
    drafter = our_drafter(spec, weights, target)
    n, fwd = len(prompt_ids), rec["forwards"]
    served_tokens = rec["draft_tokens"].flatten().tolist()
    # the training convention: position t holds token t+1 (what followed t), RoPE position t; one more position
    # carries draft token 0, which step 1 reads at t = n-1 (shift_tokens), as vLLM's second forward does
    ids = torch.tensor(prompt_ids[1:] + [int(rec["output_ids"][0]), served_tokens[0]])[None]  # [1, n+1]
    aux = torch.cat([rec["aux"][:n], torch.zeros_like(rec["aux"][:1])])[None]
    positions, documents = torch.arange(n + 1)[None], torch.zeros(1, n + 1, dtype=torch.long)
    diffs = {"input_ids": float((fwd[0]["input_ids"][:n].cpu() != ids[0, :n]).sum()),
             "positions": float((fwd[0]["positions"][:n].cpu() != positions[0, :n]).sum())}
    with torch.no_grad():
        combined = drafter.combine_aux_hidden_states(aux)
        diffs["combined"] = relative(combined[0, :n], rec["combined"][:n])
        attention = TTTAttention(documents, "blockwise")
        h0, normed0 = drafter(ids, combined, positions, attention, apply_lm_head=False)
        diffs["step0_hidden_out"] = relative(normed0[0, :n], fwd[0]["hidden_out"][:n])
        diffs["step0_aux_out"] = relative(h0[0, :n], fwd[0]["aux_out"][:n])
        step0 = target_vocab_logits(drafter, normed0[0, n - 1])
        diffs["step0_logits_support"], diffs["step0_logits"] = logits_diff(step0, rec["logits"][0][0])
        diffs["step0_token"] = float(int(step0.argmax()) != served_tokens[0])
        if not spec.parallel_drafting:
            _, normed1 = drafter(shift_tokens(ids, 1), h0, positions + step1_offset, attention, apply_lm_head=False)
            diffs["step1_positions"] = float(int(fwd[1]["positions"].flatten()[-1]) != n)
            diffs["step1_hidden_out"] = relative(normed1[0, n - 1], fwd[1]["hidden_out"][-1])
            step1 = target_vocab_logits(drafter, normed1[0, n - 1])
            _, diffs["step1_logits"] = logits_diff(step1, rec["logits"][1][-1])
            diffs["step1_token"] = float(int(step1.argmax()) != served_tokens[1])
    return diffs


TOLERANCE = 1e-4  # relative, fp32 on both sides; different kernels (vLLM's fused CPU ops vs plain PyTorch)


@pytest.mark.parametrize("name", list(CASES))
def test_train_drafter_matches_vllm_drafter(recorded, name):
    spec, weights, rec, target, prompt_ids = recorded[name]
    diffs = compare(spec, weights, rec, target, prompt_ids)
    print(name, diffs)
    assert all(v <= TOLERANCE for v in diffs.values()), diffs


@pytest.mark.parametrize("name", list(CASES))
def test_a_wrong_norm_switch_or_rope_offset_is_caught(recorded, name):
    spec, weights, rec, target, prompt_ids = recorded[name]
    key = BROKEN[name]
    broken = dataclasses.replace(spec, **{key: not getattr(spec, key)})
    kept = set(fmt.expected_tensors(broken)) | {"d2t", "t2d", "embed_tokens.weight"}
    flipped = compare(broken, {k: v for k, v in weights.items() if k in kept}, rec, target, prompt_ids)
    print(name, "flipped", key, flipped)
    moved = max(v for k, v in flipped.items() if k.startswith(("combined", "step0_hidden", "step0_aux")))
    assert moved > 100 * TOLERANCE, flipped
    if not spec.parallel_drafting:
        # step 1's queries and its new key at t+1 (the TTT offset): at t, it is a different model
        shifted = compare(spec, weights, rec, target, prompt_ids, step1_offset=0)
        print(name, "step-1 RoPE offset 0", shifted)
        assert shifted["step1_hidden_out"] > 100 * TOLERANCE, shifted
