"""vLLM serving for validation, the only module that runs vLLM: start and stop an OpenAI server, send greedy
completions, read the spec-decode counters on /metrics and turn them into acceptance numbers (DESIGN section 7;
counter names from vllm/v1/spec_decode/metrics.py).
"""
from __future__ import annotations

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Self

logger = logging.getLogger(__name__)

SERVED_MODEL_NAME = "target"
REQUEST_TIMEOUT_S = 900
STOP_GRACE_S = 20
# The server is on 127.0.0.1: never route its requests through an http_proxy from the environment
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Prometheus counter -> SpecCounters field; samples are summed over the `engine` and `model_name` labels
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ERROR_LINE = re.compile(r"\b[\w.]*(?:Error|Exception)\b:.*")
_LOG_NOISE = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d ")  # vLLM's non-error log lines


class ServerError(RuntimeError):
    """vLLM refused to start, died, timed out or rejected a request; the message carries vLLM's own words."""


# ---- counters ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        after_pos = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        before_pos = before.accepted_per_pos + (0.0,) * (n - len(before.accepted_per_pos))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in zip(after_pos, before_pos)))


def parse_spec_counters(metrics_text: str) -> SpecCounters:
    """The spec-decode counters of a /metrics page, summed over engines; all zero when not speculating."""
    totals = {field: 0.0 for field in SPEC_COUNTERS.values()}
    per_pos: dict[int, float] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue  # comments (# HELP, # TYPE) and blank lines
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))
        if name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[name]] += value
        elif name == PER_POS_COUNTER:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    ordered = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(accepted_per_pos=ordered, **totals)


# ---- acceptance and cost arithmetic -------------------------------------------------------------------


def acceptance_rates(delta: SpecCounters) -> list[float]:
    """Per-position rate: the share of drafts whose position i (and so every earlier one) was accepted."""
    if delta.drafts <= 0:
        return [0.0] * len(delta.accepted_per_pos)
    return [a / delta.drafts for a in delta.accepted_per_pos]


def acceptance_length(delta: SpecCounters) -> float:
    """Mean tokens emitted per draft round, the bonus token included: 1 + accepted / drafts."""
    return 1.0 + (delta.accepted / delta.drafts if delta.drafts > 0 else 0.0)


def acceptance_length_by_k(rates: list[float]) -> dict[int, float]:
    """AL(K') = 1 + sum of the first K' rates: greedy drafts at position i do not depend on K."""
    out, total = {}, 1.0
    for k, rate in enumerate(rates, 1):
        total += rate
        out[k] = total
    return out


def tokens_per_target_step(output_tokens: int, accepted: float) -> float:
    """Output tokens per target forward: each step emits one token plus the accepted drafts."""
    steps = output_tokens - accepted
    return output_tokens / steps if steps > 0 else 0.0


def fit_step_cost(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of step time = c0 + K * c_draft over measured (K, step time) points; c_draft >= 0."""
    n = len(points)
    mean_k = sum(k for k, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var_k = sum((k - mean_k) ** 2 for k, _ in points)
    slope = sum((k - mean_k) * (t - mean_t) for k, t in points) / var_k if var_k > 0 else 0.0
    slope = max(slope, 0.0)
    return mean_t - slope * mean_k, slope


def recommend_k(rates: list[float], c0: float, c_draft: float) -> tuple[int, dict[int, float]]:
    """K' in 0..K maximising expected tokens per unit time AL(K') / (c0 + K' c_draft); K' = 0 means no drafting."""
    al = {0: 1.0, **acceptance_length_by_k(rates)}
    rate = {k: al[k] / (c0 + k * c_draft) for k in al}
    return max(rate, key=lambda k: (rate[k], -k)), rate


def first_mismatch(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int] | None:
    """(prompt index, token position) of the first output token that differs from the reference, or None."""
    for i, (ref, out) in enumerate(zip(reference, other)):
        if ref != out:
            pos = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            return i, pos
    return None


# ---- the server process -------------------------------------------------------------------------------


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
    """Live (non-zombie) processes in a process group, read from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


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
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = server_command(target, self.port, spec_config, dtype, max_model_len)
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    def __enter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting vLLM '%s' on port %d (log %s)", self.label, self.port, self.log_path)
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                         start_new_session=True)
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


# ---- one measured run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedRun:
    label: str
    token_ids: list[list[int]]
    latencies_s: list[float]
    wall_s: float
    start_s: float
    delta: SpecCounters

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def step_time_s(self) -> float:
        """Mean time of one target step as a request sees it: summed latency over summed target steps."""
        steps = self.output_tokens - self.delta.accepted
        return sum(self.latencies_s) / steps if steps > 0 else 0.0


def send_prompts(server: VllmServer, prompts: list[list[int]], max_tokens: int, concurrency: int):
    """Greedy completions for all prompts, `concurrency` in flight; returns (token ids, latencies, wall s)."""
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    t0 = time.monotonic()
    try:
        results = list(pool.map(lambda p: server.complete_greedy(p, max_tokens), prompts))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [r[0] for r in results], [r[1] for r in results], time.monotonic() - t0


def measure_served_run(target: str, label: str, spec_config: dict | None, prompts: list[list[int]], *,
                       max_tokens: int, concurrency: int, log_dir: Path, dtype: str, start_timeout_s: float
                       ) -> ServedRun:
    """Start a server, warm it up, send the prompts between two /metrics scrapes, stop it."""
    max_model_len = max(2048, max(len(p) for p in prompts) + max_tokens)
    with VllmServer(target, label, log_dir, spec_config=spec_config, dtype=dtype, max_model_len=max_model_len,
                    start_timeout_s=start_timeout_s) as server:
        server.complete_greedy(prompts[0], min(8, max_tokens))  # first request pays one-off costs
        before = server.settled_spec_counters()
        token_ids, latencies, wall_s = send_prompts(server, prompts, max_tokens, concurrency)
        delta = server.settled_spec_counters() - before
    run = ServedRun(label, token_ids, latencies, wall_s, server.start_s, delta)
    logger.info("%s: %d output tokens in %.1f s (%.1f tokens/s), acceptance length %.3f", label, run.output_tokens,
                wall_s, run.output_tokens_per_s, acceptance_length(delta))
    return run


def drafter_spec_config(drafter_dir: Path, k: int, parallel_drafting: bool) -> dict:
    """vLLM's --speculative-config for an exported EAGLE-3 / P-EAGLE folder (DESIGN section 6)."""
    spec = {"method": "eagle3", "model": str(Path(drafter_dir).resolve()), "num_speculative_tokens": k}
    if parallel_drafting:
        spec["parallel_drafting"] = True
    return spec


def ngram_spec_config(k: int) -> dict:
    """vLLM's model-free prompt-lookup drafter, the free baseline a trained drafter must beat."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
