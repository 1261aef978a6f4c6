"""The shipped recipes, end to end on same-class twins of their real targets, the way a user runs them:
data/build.py (regeneration by vLLM, capture) -> data/check.py -> `accelerate launch train/eagle3.py` ->
export/speculators.py -> export/validate.py (vLLM serves the twin with and without the drafter: greedy
output must be identical). Each recipe file is used as shipped: the command line overrides only the target
(a twin folder) and the sizes.

The Llama-3.1 recipe is not even given its target: the twin sits in a temporary Hugging Face cache under the
recipe's own Hub id, with the Hub switched off (HF_HUB_OFFLINE=1), so every stage, vLLM included, resolves
`meta-llama/Llama-3.1-8B-Instruct` from the cache. Its prompt set (HuggingFaceH4/ultrachat_200k, a `datasets`
set on the Hub) is placed in the same cache, as are the GPT-OSS recipe's.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import pytest
from targets import TWIN_LAYERS, twin_folder

from draftsmith.data.manifest import read_json

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STAGE_TIMEOUT_S = 1200
COMMIT = "31a1b9c3d5e7f90123456789abcdef0123456789"
# recipe -> (twin, Hub id of the real target, whether the twin is placed under that id instead of overriding it)
RECIPES = {
    "qwen3-coder": ("qwen3-coder-30b-a3b-instruct", "Qwen/Qwen3-Coder-30B-A3B-Instruct", False),
    "llama3.1-8b": ("llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", True),
    "gpt-oss-20b": ("gpt-oss-20b", "openai/gpt-oss-20b", False),
}
ARCHITECTURES = {"qwen3-coder": "Qwen3MoeForCausalLM", "llama3.1-8b": "LlamaForCausalLM",
                 "gpt-oss-20b": "GptOssForCausalLM"}
SIZES = (
    "data.prompts.max_prompts=12", "data.prompts.heldout_fraction=0.3", "data.regenerate.max_new_tokens=32",
    "data.regenerate.batch_size=16", "data.max_seq_len=1024", "data.samples_per_shard=4",
    "data.capture_batch_tokens=4096", "data.draft_vocab_size=2048",
    "train.max_steps=3", "train.warmup_steps=1", "train.batch_tokens=2048", "train.grad_accum=1",
    "train.log_every=1", "train.eval_every=3", "train.save_every=3", "train.eval_max_samples=4",
    "export.num_speculative_tokens=[3]", "export.num_validation_prompts=3", "export.max_tokens=24",
    "export.concurrency=3", "export.sweep_min_requests=3", "export.ngram_baseline=false",
    "export.serve_baseline_twice=false",
)


def place_in_hub_cache(hub: Path, repo_type: str, repo_id: str, build) -> Path:
    """A snapshot folder of `repo_id` in the HF cache layout (refs/main -> COMMIT), filled by `build(folder)`."""
    repo = hub / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    build(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def ultrachat_like_conversations(n: int = 24) -> list[dict]:
    """Multi-turn chats in ultrachat_200k's columns (prompt, prompt_id, messages)."""
    topics = ["binary search", "CSV parsing", "unit testing", "regular expressions", "date arithmetic", "recursion"]
    out = []
    for i in range(n):
        topic = topics[i % len(topics)]
        messages = [{"role": "user", "content": f"Can you explain {topic} in Python? (question {i})"},
                    {"role": "assistant", "content": f"Sure: {topic} is a common task. Here is the idea ..."},
                    {"role": "user", "content": f"Show me a short example of {topic}, please."}]
        if i % 2:
            messages.append({"role": "assistant", "content": "Here is one:\n```python\nprint('example')\n```"})
        out.append({"prompt": messages[0]["content"], "prompt_id": f"{i:04d}", "messages": messages})
    return out


@pytest.fixture(scope="module")
def offline_hf_home(tmp_path_factory) -> Path:
    """HF_HOME with the recipes' prompt dataset, and the Llama-3.1 twin under its real id."""
    home = tmp_path_factory.mktemp("hf-home")

    def write_dataset(folder: Path) -> None:
        (folder / "data").mkdir()
        datasets.Dataset.from_list(ultrachat_like_conversations()).to_parquet(
            str(folder / "data" / "train_sft-00000-of-00001.parquet"))

    place_in_hub_cache(home / "hub", "dataset", "HuggingFaceH4/ultrachat_200k", write_dataset)
    twin, repo_id, _ = RECIPES["llama3.1-8b"]
    place_in_hub_cache(home / "hub", "model", repo_id, lambda folder: shutil.copytree(twin_folder(twin), folder,
                                                                                        dirs_exist_ok=True))
    return home


def run(cmd: list, env: dict) -> str:
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S, check=False)
    print(f"{time.time() - start:6.1f} s  {' '.join(c for c in cmd[1:4] if not c.startswith('-'))}", flush=True)
    assert proc.returncode == 0, f"{' '.join(cmd[:4])} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def run_recipe_chain(recipe: str, out: Path, hf_home: Path) -> list[str]:
    twin, _, under_hub_id = RECIPES[recipe]
    args = ["--config", recipe, f"output_dir={out}", *SIZES]
    if not under_hub_id:
        args.append(f"target.name_or_path={twin_folder(twin)}")
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    run([py, "data/build.py", *args], env)
    run([py, "data/check.py", *args, "--samples", "2"], env)
    log = run([py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--main_process_port", "0",
               "train/eagle3.py", *args], env)
    assert "accelerate: DistributedType.NO, 1 process(es)" in log
    run([py, "export/speculators.py", *args], env)
    run([py, "export/validate.py", *args], env)
    return args


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory, offline_hf_home) -> dict[str, Path | BaseException]:
    """The three chains at once, one thread each (each its own processes, folders and ports). Their stages are
    mostly process start-up and vLLM engines coming up, single-threaded work, so on 2 cores three chains take
    about the time of two run one after the other."""
    outs = {recipe: tmp_path_factory.mktemp(recipe) / "run" for recipe in RECIPES}
    with ThreadPoolExecutor(len(RECIPES)) as pool:
        futures = {recipe: pool.submit(run_recipe_chain, recipe, out, offline_hf_home) for recipe, out in outs.items()}
        return {recipe: f.exception() or outs[recipe] for recipe, f in futures.items()}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_on_its_twin_serves_lossless(recipe, recipe_runs):
    out = recipe_runs[recipe]
    if isinstance(out, BaseException):
        raise out
    _, repo_id, under_hub_id = RECIPES[recipe]

    manifest = read_json(out / "dataset" / "manifest.json")
    assert manifest["target"]["num_hidden_layers"] == TWIN_LAYERS
    assert manifest["aux_layer_ids"] == [2, 4, 5]  # vLLM's default [2, N//2, N-3] for the twin's 8 layers
    assert manifest["num_samples"] > 4

    spec = json.loads((out / "drafter" / "config.json").read_text())
    verifier = spec["speculators_config"]["verifier"]
    assert verifier["architectures"] == [ARCHITECTURES[recipe]]
    if under_hub_id:
        # the whole chain named the target by its id and found it in the cache, at the pinned commit
        assert manifest["target"]["name_or_path"] == repo_id and manifest["target"]["revision"] == COMMIT
        assert verifier["name_or_path"] == repo_id

    report = json.loads((out / "validation.json").read_text())
    assert report["lossless"] is True, report
    assert report["num_prompts"] >= 1
