"""Slow: random drafters written by export/write.py for the real SmolLM2 target, loaded and run by vLLM.

One subprocess starts one engine per folder (speculators EAGLE-3.1 with 4 aux layers, legacy with
norm_before_fc, P-EAGLE with 2 layers) and records which drafter parameters vLLM's loader left unloaded.
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
from draftsmith.export.write import write_drafter_folder
from draftsmith.train.spec import DrafterSpec, spec_for_target

pytestmark = pytest.mark.slow

NUM_SPECULATIVE_TOKENS = 3
TARGET_ALONE = "target-alone"
# four eager engine starts (three drafters, the target alone) of ~30 s each on 2 idle cores; many times longer on a shared machine
SERVE_TIMEOUT_S = 3600
# loaded into the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the loader can be observed
SERVE_SCRIPT = textwrap.dedent('''
    import gc, json, sys, traceback
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import utils as model_utils

    RECORD = {}
    _load = model_utils.AutoWeightsLoader.load_weights

    def recording_load(self, weights, *, mapper=None):
        """Note which parameters of the EAGLE-3 drafter its checkpoint did not fill."""
        loaded = _load(self, weights, mapper=mapper)
        if type(self.module).__name__.startswith("Eagle3"):
            params = {name for name, _ in self.module.named_parameters()}
            RECORD["unloaded"] = sorted(params - set(loaded))
        return loaded

    model_utils.AutoWeightsLoader.load_weights = recording_load

    from vllm.v1.spec_decode import llm_base_proposer
    _load_model = llm_base_proposer.SpecDecodeBaseProposer.load_model

    def recording_load_model(self, target_model):
        """After loading (and embedding sharing): what a parallel drafter will actually run with."""
        _load_model(self, target_model)
        if getattr(self, "parallel_drafting", False):
            embed = self.model.model.embed_tokens.weight
            RECORD["mask_token_id"] = int(self.parallel_drafting_token_id)
            RECORD["mask_hidden"] = self.model.mask_hidden.detach().float().flatten().tolist()
            RECORD["embed_rows"] = {str(i): embed[i].detach().float().tolist() for i in (0, 1, 4097)}

    llm_base_proposer.SpecDecodeBaseProposer.load_model = recording_load_model

    def counter(llm, name):
        return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)

    def serve(job):
        RECORD.clear()
        # enforce_eager skips torch.compile: loading is the same, and an engine starts in ~30 s, not 80-120 s
        # fp32: token identity with the target alone is then a sound lossless check (bf16 verify numerics vary
        # with batch shape); the bf16 checkpoint's values load exactly
        llm = LLM(model=job["target"], dtype="float32", max_model_len=512, seed=0, disable_log_stats=False,
                  enforce_eager=True, speculative_config=job["speculative_config"])
        before = counter(llm, "vllm:spec_decode_num_drafts")
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate(["def fibonacci(n):"], greedy)
        drafts = counter(llm, "vllm:spec_decode_num_drafts") - before
        result = {"token_ids": list(out[0].outputs[0].token_ids), "num_drafts": drafts, **RECORD}
        del llm
        gc.collect()
        return result

    if __name__ == "__main__":
        jobs = json.load(open(sys.argv[1]))
        results = {}
        for name, job in jobs.items():
            try:
                results[name] = serve(job)
            except Exception:
                results[name] = {"error": traceback.format_exc()[-3000:]}
            json.dump(results, open(sys.argv[2], "w"))
''')


def target_spec(target: str, **overrides) -> DrafterSpec:
    """The trainers' spec for a 1-layer drafter of `target` (draft vocab 8192), with `overrides` applied."""
    from transformers import AutoConfig

    spec = spec_for_target(AutoConfig.from_pretrained(target), DrafterConfig(norm_before_residual=False),
                           method="eagle3", aux_layer_ids=[2, 15, 27], draft_vocab_size=8192,
                           verifier_name_or_path=target)
    return dataclasses.replace(spec, **overrides)


def random_drafter(spec: DrafterSpec, seed: int) -> dict[str, torch.Tensor]:
    """Small random weights (norms near 1), d2t over every 6th target id: what a trainer would hold."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (shape, want) in fmt.expected_tensors(spec).items():
        if want is None:
            base = 1.0 if len(shape) == 1 else 0.0
            sd[name] = base + 0.02 * torch.randn(shape, generator=g)
    v_d, v_t = spec.draft_vocab_size, spec.vocab_size
    used = torch.arange(v_d) * (v_t // v_d)
    sd["d2t"], sd["t2d"] = used - torch.arange(v_d), torch.zeros(v_t, dtype=torch.bool)
    sd["t2d"][used] = True
    # eagle3 holds a frozen copy of the target's embedding too; the writer leaves it out. P-EAGLE trains its own
    # (the mask token's row above all), so it gets distinct values the loaded model can be checked against.
    sd.setdefault("embed_tokens.weight", 0.02 * torch.randn(v_t, spec.hidden_size, generator=g))
    return sd


DRAFTERS = {
    "speculators-eagle3.1-4aux": (
        "speculators",
        {"aux_layer_ids": [2, 10, 20, 27], "fc_norm": True, "norm_output": True},
    ),
    "legacy-norm_before_fc": ("legacy", {"norm_before_fc": True}),
    "speculators-peagle": (
        "speculators",
        {
            "method": "peagle",
            "num_hidden_layers": 2,
            "mask_token_id": 0,
            "fc_norm": True,
            "norm_output": True,
        },
    ),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("vllm")
    from draftsmith.data.target import resolve_target_path

    target = resolve_target_path("smollm2")
    root = tmp_path_factory.mktemp("vllm_load")
    jobs, written = {}, {}
    for seed, (name, (layout, overrides)) in enumerate(DRAFTERS.items()):
        spec = target_spec(target, **overrides)
        written[name] = random_drafter(spec, seed)
        folder = write_drafter_folder(
            written[name], spec, root / name, layout, "bfloat16", NUM_SPECULATIVE_TOKENS
        )
        spec_cfg = {
            "method": "eagle3",
            "model": str(folder),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        }
        if spec.method == "peagle":
            spec_cfg["parallel_drafting"] = True
        jobs[name] = {"target": target, "speculative_config": spec_cfg}
    jobs[TARGET_ALONE], written[TARGET_ALONE] = {"target": target, "speculative_config": None}, {}
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "serve.py").write_text(SERVE_SCRIPT)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    command = [sys.executable, str(root / "serve.py"), str(root / "jobs.json"), str(root / "results.json")]
    try:
        proc = subprocess.run(
            command, env=env, cwd=root, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, check=False
        )
        log = f"rc {proc.returncode}:\n{proc.stderr[-4000:]}"
    except subprocess.TimeoutExpired:
        log = f"timed out after {SERVE_TIMEOUT_S} s"  # the jobs that finished still count
    results_path = root / "results.json"
    assert results_path.is_file(), f"serve script wrote no results ({log})"
    results = {name: {"error": log} for name in jobs} | json.loads(results_path.read_text())
    return {name: {**r, "written": written[name]} for name, r in results.items()}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_vllm_loads_and_drafts(served, name):
    result = served[name]
    assert "error" not in result, result["error"]
    assert len(result["token_ids"]) == 8
    assert result["num_drafts"] > 0, "the drafter never proposed tokens"
    # what may stay unfilled: eagle3's embedding (vLLM shares the target's) and hidden_norm of layers >= 1,
    # which vLLM creates but never applies (llama_eagle3.py)
    allowed = {"model.embed_tokens.weight"} if "peagle" not in name else set()
    allowed |= {f"model.layers.{i}.hidden_norm.weight" for i in range(1, 4)}
    assert set(result["unloaded"]) <= allowed, (
        f"vLLM left {sorted(set(result['unloaded']) - allowed)} uninitialised"
    )


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_output_is_the_target_alone(served, name):
    """Greedy speculative decoding is lossless: each drafter yields exactly the target's own tokens."""
    alone = served[TARGET_ALONE]
    assert "error" not in alone, alone["error"]
    assert len(alone["token_ids"]) == 8 and alone["num_drafts"] == 0
    assert served[name].get("token_ids") == alone["token_ids"], (served[name].get("token_ids"), alone["token_ids"])


def test_parallel_drafter_runs_with_the_trained_mask_token_hidden_and_embeddings(served):
    """vLLM must serve P-EAGLE with our mask_token_id, mask_hidden and embed_tokens, not defaults or the target's."""
    result = served["speculators-peagle"]
    assert "error" not in result, result["error"]
    sd = result["written"]
    as_served = lambda t: t.to(torch.bfloat16).float()  # the checkpoint is bfloat16 (the engine upcasts exactly)
    assert result["mask_token_id"] == DRAFTERS["speculators-peagle"][1]["mask_token_id"]
    torch.testing.assert_close(torch.tensor(result["mask_hidden"]), as_served(sd["mask_hidden"]).flatten())
    for row, values in result["embed_rows"].items():
        torch.testing.assert_close(torch.tensor(values), as_served(sd["embed_tokens.weight"][int(row)]))

