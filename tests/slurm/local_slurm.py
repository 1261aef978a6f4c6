"""A real single-host Slurm for the tests: Debian's slurm-wlm + munge (installed with apt when missing),
controller and node daemon on 127.0.0.1, configured and kept under one temporary folder.

Only root can install packages and run munged as its user; elsewhere the caller skips with the reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

PACKAGES = ("slurm-wlm", "munge")
MUNGE_SOCKET_DIR = Path("/run/munge")


class SlurmUnavailable(RuntimeError):
    """This host cannot run a local Slurm (the message says why)."""


def run(cmd: list[str], env=None, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc


def ensure_installed() -> None:
    if all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm and munge are not installed and this user cannot apt-get install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], env=env)
    run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES], env=env)


def start_munge() -> bool:
    """Start munged as the munge user unless one answers already; True when this call started it."""
    if run(["bash", "-c", "munge -n | unmunge"], check=False).returncode == 0:
        return False
    if os.geteuid() != 0:
        raise SlurmUnavailable("munged is not running and only root can start it")
    key = Path("/etc/munge/munge.key")
    if not key.is_file():
        run(["mungekey", "--create", "--keyfile", str(key)])
    shutil.chown(key, "munge", "munge")
    MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
    run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
    run(["bash", "-c", "munge -n | unmunge"])
    return True


def stop_munge() -> None:
    run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--stop"], check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(root: Path) -> Path:
    for d in ("state", "spool"):
        (root / d).mkdir(parents=True, exist_ok=True)
    memory_mb = int(psutil.virtual_memory().total / 2**20 * 0.8)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=draftsmith-ci
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
    return conf


class LocalSlurm:
    """start() -> env with SLURM_CONF for sbatch/scontrol; stop() shuts both daemons down and leaves nothing."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.env: dict = {}
        self.started_munge = False

    def start(self, timeout: float = 120) -> dict:
        ensure_installed()
        self.started_munge = start_munge()
        conf = write_config(self.root)
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        run(["slurmctld", "-f", str(conf), "-i"], env=self.env)
        run(["slurmd", "-f", str(conf)], env=self.env)
        deadline = time.monotonic() + timeout
        while True:
            state = run(["sinfo", "-h", "-n", "localhost", "-o", "%T"], env=self.env, check=False).stdout.strip()
            if state == "idle":
                return self.env
            if state.startswith(("down", "drain")):
                run(["scontrol", "update", "NodeName=localhost", "State=RESUME"], env=self.env, check=False)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Slurm node never became idle (state {state!r}); "
                                   f"logs in {self.root}:\n{self.logs()}")
            time.sleep(1)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def job_state(self, job_id: str) -> tuple[str, str]:
        """(JobState, Reason) from scontrol."""
        out = run(["scontrol", "show", "job", job_id], env=self.env, check=False).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "UNKNOWN"), fields.get("Reason", "")

    def stop(self) -> None:
        if self.env:
            run(["scontrol", "shutdown"], env=self.env, check=False, timeout=60)
        for pidfile in ("slurmd.pid", "slurmctld.pid"):
            path = self.root / pidfile
            try:
                pid = int(path.read_text())
                proc = psutil.Process(pid)
                proc.wait(timeout=20)
            except (OSError, ValueError, psutil.NoSuchProcess):
                continue
            except psutil.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
        if self.started_munge:
            stop_munge()
