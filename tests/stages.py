"""Run the repo's stage scripts as a user does: `python <stage>.py --config NAME key=value ...` in a subprocess."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE_TIMEOUT_S = 1800
# every stage's stdout and stderr, in order: tests grep them (a planted secret must never be printed)
OUTPUTS: list[str] = []


def run_stage(script: str, *args: str, cwd: Path, config: str = "smollm2-quick") -> str:
    proc = subprocess.run([sys.executable, str(REPO / script), "--config", config, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=STAGE_TIMEOUT_S, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    OUTPUTS.append(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def processes_with_marker(marker: str) -> list[int]:
    """Pids, other than this one, whose environment has DRAFTSMITH_TEST_MARKER=`marker`: every process that a
    test's servers or launches started inherits it, so none can hide from the teardown checks."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("DRAFTSMITH_TEST_MARKER") == marker:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found if p != os.getpid()]


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by `pids`."""
    import psutil

    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.pid in pids and c.status == psutil.CONN_LISTEN]
