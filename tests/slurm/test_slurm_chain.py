"""The slurm/ scripts on a real (single-host) Slurm: the quick chain submitted by slurm/submit.sh as three
dependent jobs, training as 2 tasks (2 accelerate "machines" of 1 process each, rendezvous from the job's
node list), export + validation serving the drafter in vLLM. Also: the Slurm -> accelerate flag mapping."""
import json
import subprocess
import sys
import time

import pytest
from local_slurm import LocalSlurm, SlurmUnavailable
from stages import REPO

from draftsmith.data.manifest import read_json

pytestmark = pytest.mark.slow

CHAIN_TIMEOUT_S = 2400


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        env = cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    yield cluster, env
    cluster.stop()


def wait_for_jobs(cluster: LocalSlurm, jobs: dict, logs) -> None:
    """Until every job completed; fails on a failed job or one whose dependency can never be met."""
    deadline = time.monotonic() + CHAIN_TIMEOUT_S
    while True:
        states = {name: cluster.job_state(job) for name, job in jobs.items()}
        bad = {n: s for n, s in states.items()
               if s[0] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
               or s[1] == "DependencyNeverSatisfied"}
        assert not bad, f"jobs failed: {bad}\n{logs()}"
        if all(s[0] == "COMPLETED" for s in states.values()):
            return
        assert time.monotonic() < deadline, f"jobs still running after {CHAIN_TIMEOUT_S}s: {states}\n{logs()}"
        time.sleep(2)


def test_quick_chain_as_dependent_jobs_with_two_training_tasks(slurm, quick_dataset, tmp_path):
    cluster, env = slurm
    run_dir = tmp_path / "run"
    env = {**env, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", "HF_HOME": str(tmp_path / "hf"),
           "GLOO_SOCKET_IFNAME": "lo"}
    submitted = subprocess.run(
        ["bash", "slurm/submit.sh", "--tasks-per-node", "2", "--output-dir", str(tmp_path), "smollm2-quick",
         f"output_dir={run_dir}", f"data.dataset_dir={quick_dataset}", "export.ngram_baseline=false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert submitted.returncode == 0, submitted.stderr
    jobs = dict(field.split("=") for field in submitted.stdout.split())
    assert list(jobs) == ["data", "train", "export"]
    assert cluster.job_state(jobs["export"])[1] in ("Dependency", "None", "")

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(tmp_path.glob("slurm-*.out")))

    wait_for_jobs(cluster, jobs, logs)
    train_log = next(tmp_path.glob(f"slurm-draftsmith-train-{jobs['train']}.out")).read_text()
    assert "accelerate: DistributedType.MULTI_CPU, 2 process(es)" in train_log, logs()
    checkpoint = read_json(run_dir / "train" / "checkpoints" / "step-0000012" / "loop_state.json")
    assert checkpoint["world_size"] == 2
    # the drafter trained by the 2-task job, exported and served by vLLM: lossless and accepting
    report = json.loads((run_dir / "validation.json").read_text())
    assert report["lossless"] is True, report
    assert report["acceptance_length"] > 1.0
    assert (run_dir / "drafter" / "config.json").is_file() and (run_dir / "drafter" / "model.safetensors").is_file()


@pytest.mark.parametrize(("env", "expected"), [
    # 2 nodes x 8 GPUs, one task per node: 16 processes, node 1 is machine 1, rendezvous on the first node
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_JOB_ID": "123456",
      "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"},
     "--num_machines 2 --machine_rank 1 --num_processes 16 --main_process_ip gpu-07 --main_process_port 23456"),
    # one CPU node, 2 tasks: each task one process
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "cpu-1", "SLURM_JOB_ID": "7",
      "SLURM_NTASKS_PER_NODE": "2"},
     "--num_machines 2 --machine_rank 0 --num_processes 2 --main_process_ip cpu-1 --main_process_port 20007"),
])
def test_slurm_variables_map_to_accelerate_flags(env, expected, slurm):
    _, slurm_env = slurm  # scontrol expands the node list
    out = subprocess.run(["bash", "slurm/launch_accelerate.sh", "train/eagle3.py", "--config", "qwen3-coder"],
                         cwd=REPO, env={**slurm_env, **env, "DRY_RUN": "1", "PYTHON": "python"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout and out.stdout.rstrip().endswith("train/eagle3.py --config qwen3-coder")
    assert "--config_file configs/accelerate/ddp.yaml" in out.stdout
