"""Shared fixtures: a tiny random Llama target saved as an HF folder and a captured dataset built from it;
the smollm2-quick dataset of the real embedded target, built once per test run (once for all workers).

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile`): about half of the serial run's
CPU time is idle (single-threaded start-ups, servers coming up, stages waiting on each other), and two workers
fill it. Each test file runs whole on one worker, so a module fixture (the recipe chains, a Slurm cluster) is
built once, and the files that chain stages or serve vLLM are handed out first, costliest first, so that both
workers finish near the same time."""
import json
import os

import pytest
import torch
from stages import run_stage
from tiny_data import TINY_VOCAB, build_tiny_dataset
from transformers import AutoModelForCausalLM, LlamaConfig


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny-target")
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # a peaked teacher: a random head gives near-uniform targets
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_run(tiny_target_dir, tmp_path_factory):
    """A run folder whose dataset/ is built; returns a function writing a config YAML for it."""
    run_dir = tmp_path_factory.mktemp("tiny-run")
    build_tiny_dataset(tiny_target_dir, run_dir / "dataset")

    def write_config(tmp_path, extra: dict | None = None, output_dir=None) -> str:
        import shutil

        out = output_dir or (tmp_path / "run")
        if not (out / "dataset").exists():
            shutil.copytree(run_dir / "dataset", out / "dataset")
        cfg = {"output_dir": str(out), "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32",
                                                   "aux_layer_ids": [1, 2, 3]},
               # fp32 pinned: the tests compare runs at fp32 tolerances, and train.precision=auto picks bf16 on
               # CPUs with bf16 matmul units (tests/train/test_precision.py covers that choice)
               "ttt": {"num_steps": 3}, "train": {"lr": 3e-3, "max_steps": 20, "warmup_steps": 2,
                                                  "batch_tokens": 256, "log_every": 5, "eval_every": 10,
                                                  "save_every": 10, "seed": 0, "precision": "fp32"}}
        for section, values in (extra or {}).items():
            cfg.setdefault(section, {}).update(values)
        path = tmp_path / "tiny.yaml"
        path.write_text(json.dumps(cfg))
        return str(path)

    return write_config


# Minutes each file takes in a serial run on a 2-core AVX2 host (2026-12-02): the order the files are handed to the
# workers in, costliest first, not a limit. A folder stands for each file in it.
COSTLY_FILES = {
    "tests/faults/test_kill_matrix.py": 11, "tests/recipes": 10, "tests/slurm": 8, "tests/e2e": 8,
    "tests/scaleout/test_equivalence.py": 5, "tests/export/test_validate.py": 6.5,
    "tests/scaleout/test_resume.py": 2.5, "tests/export/test_vllm_load.py": 1, "tests/export/test_vllm_parity.py": 1,
}


def minutes_of(nodeid: str) -> float:
    path = nodeid.split("::")[0]
    return next((m for f, m in COSTLY_FILES.items() if path == f or path.startswith(f + "/")), 0)


def pytest_collection_modifyitems(config, items):
    # `--dist loadfile --no-loadscope-reorder` hands the files out in collection order; the sort is stable, so the
    # tests keep their order inside a file (and the other files theirs)
    items.sort(key=lambda item: -minutes_of(item.nodeid))


@pytest.fixture(scope="session")
def quick_dataset(tmp_path_factory):
    """data/build.py --config smollm2-quick (vLLM regeneration + capture on SmolLM2), once for every test that
    trains on it (the e2e chain, the Slurm chain), on whichever worker asks first; runs point at it with
    data.dataset_dir."""
    from filelock import FileLock

    # the base temp folder of this run, common to its xdist workers (each has its own folder below it)
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    work = shared / "quick-data"
    dataset = work / "run" / "dataset"
    with FileLock(str(shared / "quick-data.lock")):
        if not (dataset / "manifest.json").is_file():  # written last: a dataset with one is complete
            work.mkdir(exist_ok=True)
            run_stage("data/build.py", f"output_dir={work / 'run'}", cwd=work)
    return dataset


@pytest.fixture(autouse=True)
def default_dtype_is_left_as_found():
    """A test that leaves torch's default dtype changed (bf16 after an in-process load, say) makes every later test
    in the run build its tensors in that dtype; fail the test that did it, and put the default back."""
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"the test left torch's default dtype at {after} (was {before})")
