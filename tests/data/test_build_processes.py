"""data/build.py on 2 real processes (accelerate launch, gloo on the loopback) builds the dataset 1 process builds,
byte for byte; a killed build's rerun captures only the shards it lost; device_map refuses several processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.data.errors import UserError
from draftsmith.data.processes import start_build_processes

REPO = Path(__file__).resolve().parents[2]


def build_command(config: str, num_processes: int) -> list[str]:
    script = [str(REPO / "data" / "build.py"), "--config", config]
    if num_processes == 1:
        return [sys.executable, *script]
    # --multi_gpu starts torchrun's N processes; a GPU node with several GPUs implies it, a CPU host needs it
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--main_process_port", "0", *script]


def run_build(cmd: list[str], cwd: Path) -> str:
    """One thread per process in every run: the same matmul kernels, so 1 and 2 processes compute the same bits.
    HF_HOME keeps a stray default accelerate config out of the launch."""
    cwd.mkdir(exist_ok=True)
    env = {**os.environ, "HF_HOME": str(cwd / "hf"), "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def dataset_files(cwd: Path) -> dict[str, bytes]:
    folder = cwd / "run" / "dataset"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow  # three launches, ~40 s on 2 cores (like tests/scaleout)
def test_two_processes_build_the_dataset_one_process_builds(build_config, tmp_path):
    config = build_config(tmp_path)
    run_build(build_command(config, 1), tmp_path / "one")
    log = run_build(build_command(config, 2), tmp_path / "two")
    assert "data build: 2 processes" in log, log[-3000:]
    one, two = dataset_files(tmp_path / "one"), dataset_files(tmp_path / "two")
    shards = json.loads(one["manifest.json"])["shards"]
    assert {s["split"] for s in shards} == {"train", "heldout"} and len(shards) >= 4  # both processes captured
    assert one.keys() == two.keys()
    assert [name for name in one if one[name] != two[name]] == []

    # killed after capture, before the manifest, with shard 1 lost: the rerun recaptures shard 1 only
    folder = tmp_path / "two" / "run" / "dataset"
    for name in ("manifest.json", "shard-00001.safetensors", "shard-00001.json"):
        (folder / name).unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*")}
    run_build(build_command(config, 2), tmp_path / "two")
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*") if p.name in kept} == kept
    assert dataset_files(tmp_path / "two") == one


def test_device_map_refuses_several_processes_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"target.device_map='auto' .* 2 build processes .* one per node"):
        start_build_processes("auto")
