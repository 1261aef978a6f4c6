"""The kill matrix (issue #16, item 1): every stage's real command, SIGKILLed at named points (inside a shard
write, between a shard and its sidecar, before the manifest, between regeneration batches, inside a checkpoint
write, between a bundle's renames, inside an export) and at a random moment, then run again: the artifacts are
those of an uninterrupted run, byte for byte (datasets, exported folders) and bit for bit (trained weights,
P-EAGLE included). Kill points come from data/faults.py (DRAFTSMITH_KILL_AT); the random ones from a seed the
test prints (DRAFTSMITH_FAULT_SEED replays them)."""
import ipaddress
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stages import listening_sockets, processes_with_marker

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("DRAFTSMITH_FAULT_SEED", str(int(time.time()) % 100_000)))


def command(script: str, config: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO / script), "--config", config, *args]


def run(cmd: list[str], cwd: Path, kill_at: str | None = None, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
    environ.pop("DRAFTSMITH_KILL_AT", None)
    if kill_at:
        environ["DRAFTSMITH_KILL_AT"] = kill_at
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600, check=False)


def run_killed_after(cmd: list[str], cwd: Path, seconds: float) -> int:
    """Start cmd and SIGKILL it after `seconds` (it may have finished by then); returns its exit code."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return proc.returncode


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def killed(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == -signal.SIGKILL, f"expected a SIGKILL, got exit {proc.returncode}:\n{proc.stderr[-3000:]}"


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_files(got: Path, want: Path, ignore=()) -> None:
    a, b = files_of(got), files_of(want)
    for name in ignore:
        a.pop(name, None)
        b.pop(name, None)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert [n for n in a if a[n] != b[n]] == []


@pytest.fixture(scope="module")
def rng():
    print(f"kill matrix seed {SEED} (DRAFTSMITH_FAULT_SEED={SEED} replays the random kills)")
    return random.Random(SEED)


# ---- capture and regeneration ----------------------------------------------------------------------------------


@pytest.mark.parametrize("regenerate", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["capture", "regenerate+capture"])
def test_dataset_build_killed_anywhere_reruns_to_the_same_bytes(build_config, tmp_path, rng, regenerate):
    extra = {"regenerate": {"enabled": True, "backend": "transformers", "max_new_tokens": 6, "batch_size": 4}} \
        if regenerate else {}
    config = build_config(tmp_path, **extra)
    (tmp_path / "ref").mkdir()
    ok(run(command("data/build.py", config), tmp_path / "ref"))
    want = tmp_path / "ref" / "run" / "dataset"
    num_shards = len(list(want.glob("shard-*.safetensors")))
    points = [f"shard_write:{rng.randrange(2, 3 * num_shards // 2)}", f"shard_sidecar:{rng.randrange(1, num_shards)}",
              "before_manifest:1"] + (["regenerate_batch:2"] if regenerate else [])
    for point in points:
        work = tmp_path / point.replace(":", "-")
        work.mkdir()
        killed(run(command("data/build.py", config), work, kill_at=point))
        assert not (work / "run" / "dataset" / "manifest.json").exists(), point  # never read as complete
        ok(run(command("data/build.py", config), work))
        assert_same_files(work / "run" / "dataset", want)
    # and at a random moment, twice over the same folder
    work = tmp_path / "random"
    work.mkdir()
    for _ in range(2):
        run_killed_after(command("data/build.py", config), work, rng.uniform(4.0, 12.0))
    ok(run(command("data/build.py", config), work))
    assert_same_files(work / "run" / "dataset", want)


# ---- training ----------------------------------------------------------------------------------------------------


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "train" / "best" / "drafter.safetensors"))


def assert_bit_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []


@pytest.mark.parametrize("method", ["eagle3", pytest.param("peagle", marks=pytest.mark.slow)])
def test_training_killed_anywhere_resumes_to_bit_identical_weights(tiny_run, tmp_path, rng, method):
    extra = {"train": {"max_steps": 12, "save_every": 4, "eval_every": 4}}
    if method == "peagle":
        extra |= {"peagle": {"num_depths": 4}, "drafter": {"num_layers": 2}}
    script = f"train/{method}.py"
    ref = tiny_run(tmp_path / "ref", extra, output_dir=tmp_path / "ref" / "run")
    ok(run(command(script, ref), tmp_path))
    want = final_weights(tmp_path / "ref" / "run")
    # bundle_swap: best/ replaced by a better eval; checkpoint_prune:3: the step-12 save renamed, step 4 not yet pruned
    for point in ("checkpoint_write:2", "checkpoint_prune:3", "bundle_swap:1", "random"):
        out = tmp_path / point.replace(":", "-") / "run"
        config = tiny_run(out.parent, extra, output_dir=out)
        if point == "random":
            run_killed_after(command(script, config), tmp_path, rng.uniform(6.0, 14.0))
        else:
            killed(run(command(script, config), tmp_path, kill_at=point))
        resumed = ok(run(command(script, config), tmp_path))
        if point == "checkpoint_write:2":  # killed inside the step-8 save: the rerun resumes from step 4
            assert "at step 4" in resumed.stderr, resumed.stderr[-2000:]
        assert_bit_identical(final_weights(out), want)
        ckpt = out / "train" / "checkpoints"
        assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step-0000008",
                                                                                         "step-0000012"]


# ---- export --------------------------------------------------------------------------------------------------------


def test_export_killed_inside_its_write_reruns_to_the_same_folder(tiny_run, tmp_path):
    config = tiny_run(tmp_path, {"train": {"max_steps": 4}})
    ok(run(command("train/eagle3.py", config), tmp_path))
    ok(run(command("export/speculators.py", config, "--out", str(tmp_path / "ref-drafter")), tmp_path))
    out = tmp_path / "run" / "drafter"
    killed(run(command("export/speculators.py", config), tmp_path, kill_at="export_write:1"))
    assert not out.exists()  # a killed first export leaves no folder a loader could take for complete
    ok(run(command("export/speculators.py", config), tmp_path))
    # killed again while replacing that export: the old folder or the new one, then the rerun's
    killed(run(command("export/speculators.py", config), tmp_path, kill_at="bundle_swap:1"))
    ok(run(command("export/speculators.py", config), tmp_path))
    assert_same_files(out, tmp_path / "ref-drafter")
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []


# ---- validation ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_validation_killed_while_serving_leaves_no_process_or_port_after_the_rerun(tmp_path):
    import json
    import uuid

    from draftsmith.data.target import resolve_target_path
    from tests.export.test_validate import PROMPTS, _random_drafter, _write_yaml

    target = Path(resolve_target_path("smollm2"))
    run_dir = tmp_path / "run"
    drafter = _random_drafter(target, run_dir / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    config = str(_write_yaml(tmp_path, run_dir, "  num_validation_prompts: 3\n  max_tokens: 16\n  concurrency: 2\n"
                                                "  sweep_min_requests: 2\n  ngram_baseline: false\n"
                                                "  serve_baseline_twice: false\n"))
    cmd = command("export/validate.py", config, "--drafter", str(drafter), "--prompts", str(prompts))
    marker = f"kill-matrix-{uuid.uuid4().hex}"
    env = {**os.environ, "DRAFTSMITH_TEST_MARKER": marker, "PYTHONUNBUFFERED": "1"}
    validator = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
    try:
        for line in validator.stderr:  # killed once the first server (the drafter's) is up and serving
            if "healthy after" in line:
                break
        serving = processes_with_marker(marker)
        assert len(serving) >= 3, serving  # the validator, the API server and its engine
        # while it serves: vLLM's API server and engine listen on loopback only (issue #16), and the check sees the
        # API socket (tests/export/test_server_binding.py shows that it reports an exposed one)
        sockets = listening_sockets(serving)
        assert sockets, "no listening socket found among the serving processes"
        assert [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback] == [], sockets
        validator.send_signal(signal.SIGKILL)
        validator.wait()
    finally:
        if validator.poll() is None:
            validator.kill()
    # the kernel kills the server with its validator (PR_SET_PDEATHSIG) and vLLM's engine follows it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(processes_with_marker(marker)) > 1:
        time.sleep(1)
    rerun = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert json.loads((run_dir / "validation.json").read_text())["lossless"] is True
    time.sleep(2)
    assert processes_with_marker(marker) == [], "the killed validation left processes behind after the rerun"
    assert list((run_dir / "logs").glob("*.group.json")) == []
