"""Launch real training runs as a user does: `accelerate launch` with the repo's own accelerate configs,
2 processes over gloo on the loopback interface (or plain python for one process); read what they wrote."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = {"ddp": "ddp.yaml", "fsdp2": "fsdp.yaml", "zero2": "zero2.yaml"}
DISTRIBUTED_TYPE = {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "zero2": "DEEPSPEED", None: "NO"}
SCRIPTS = {"eagle3": "train/eagle3.py", "peagle": "train/peagle.py"}
RUN_TIMEOUT_S = 900


def launch_env(home: Path) -> dict:
    """No stray accelerate config (HF_HOME), loopback only, one thread per process, DeepSpeed's CPU op cached."""
    cache = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
    return {**os.environ, "HF_HOME": str(home / "hf"), "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"),
            "PYTHONUNBUFFERED": "1"}


def train_command(method: str, config: str, backend: str | None, overrides=(), num_processes: int = 2) -> list:
    """`accelerate launch --config_file configs/accelerate/<backend>.yaml ...`, or plain python (backend None)."""
    script = [str(REPO / SCRIPTS[method]), "--config", config, *overrides]
    if backend is None:
        return [sys.executable, *script]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "configs" / "accelerate" / ACCELERATE_CONFIGS[backend]), "--num_processes",
            str(num_processes), "--main_process_port", "0", *script]


def run_training(cmd: list, env: dict, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-8000:]}"
    return out


def assert_launched_as(log: str, backend: str | None, num_processes: int) -> None:
    line = f"accelerate: DistributedType.{DISTRIBUTED_TYPE[backend]}, {num_processes} process(es)"
    assert line in log, f"expected '{line}' in the log:\n{log[-3000:]}"


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "train" / "best" / "drafter.safetensors")


def train_lines(run_dir: Path) -> dict[int, dict]:
    """step -> the logged training record (metrics summed over processes)."""
    lines = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in lines if "loss" in m}


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {step: m["loss"] for step, m in train_lines(run_dir).items()}


def max_abs_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def worker_processes(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """The training processes a launcher started, by their RANK."""
    out = {}
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            rank = p.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and any(s.endswith((".py",)) and "train/" in s for s in p.cmdline()):
            out[int(rank)] = p
    return out


def kill_rank_after_checkpoint(cmd: list, env: dict, cwd: Path, checkpoint: Path, rank: int | None) -> str:
    """Start `cmd`; once `checkpoint` exists, SIGKILL the worker of `rank` (None: every process of the run)
    and wait for the launcher to end. Fails if the run finished before the kill."""
    launcher = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not checkpoint.is_dir():
        assert launcher.poll() is None, f"the run ended before {checkpoint} appeared:\n{launcher.stdout.read()[-6000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the checkpoint"
        time.sleep(0.01)
    if rank is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    else:
        workers = worker_processes(launcher)
        assert rank in workers, f"no worker of rank {rank} among {workers}"
        workers[rank].send_signal(signal.SIGKILL)
    out, _ = launcher.communicate(timeout=RUN_TIMEOUT_S)
    assert launcher.returncode != 0, f"the run survived the kill:\n{out[-4000:]}"
    return out
