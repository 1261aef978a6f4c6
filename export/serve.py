"""One measured served run for validation: a server per configuration, a warm-up, the greedy pass (every prompt,
its output token ids, between two /metrics scrapes), then the load cells of the sweep (export/sweep.py), and
vLLM's --speculative-config for a drafter or n-gram."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.export.acceptance import acceptance_length
from draftsmith.export.server import VllmServer
from draftsmith.export.spec_metrics import SpecCounters
from draftsmith.export.sweep import LoadCell, run_load_cell

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedRun:
    label: str
    token_ids: list[list[int]]
    latencies_s: list[float]
    wall_s: float
    start_s: float
    delta: SpecCounters
    cells: dict[int, LoadCell] = field(default_factory=dict)  # by concurrency

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
                       max_tokens: int, concurrency: int, log_dir: Path, dtype: str, start_timeout_s: float,
                       sweep_concurrency: tuple[int, ...] = (), sweep_min_requests: int = 0, tokenizer=None
                       ) -> ServedRun:
    """Start a server, warm it up, send the prompts between two /metrics scrapes, run the sweep's load cells (one
    per `sweep_concurrency`), stop it."""
    max_model_len = max(2048, max(len(p) for p in prompts) + max_tokens)
    with VllmServer(target, label, log_dir, spec_config=spec_config, dtype=dtype, max_model_len=max_model_len,
                    start_timeout_s=start_timeout_s) as server:
        server.complete_greedy(prompts[0], min(8, max_tokens))  # first request pays one-off costs
        before = server.settled_spec_counters()
        token_ids, latencies, wall_s = send_prompts(server, prompts, max_tokens, concurrency)
        delta = server.settled_spec_counters() - before
        cells = {c: run_load_cell(server, prompts, c, min_requests=sweep_min_requests, max_tokens=max_tokens,
                                  tokenizer=tokenizer, log_path=Path(log_dir) / f"bench-{label}.txt")
                 for c in sorted(sweep_concurrency)}
    run = ServedRun(label, token_ids, latencies, wall_s, server.start_s, delta, cells)
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
