"""One load cell of the validation sweep: a fixed number of requests in flight against a running server, timed by
vLLM's own serving benchmark client (`vllm bench serve`'s Python entry: streamed requests, TTFT and TPOT per
request), with the spec-decode counters scraped around it by us (settled, like every other served figure).

vLLM is imported only here and only when a cell runs: the core stays importable without it."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from draftsmith.export import acceptance
from draftsmith.export.server import SERVED_MODEL_NAME, VllmServer
from draftsmith.export.spec_metrics import SpecCounters

logger = logging.getLogger(__name__)

TPOT_PERCENTILES = (50, 90)


@dataclass(frozen=True)
class LoadCell:
    """What one (server, concurrency) cell measured."""
    concurrency: int
    num_requests: int
    output_tokens: int
    tpot_ms: dict[str, float]  # mean, p50, p90 over requests: (latency - TTFT) / (output tokens - 1)
    ttft_ms: float  # mean
    output_tokens_per_s: float
    delta: SpecCounters

    @property
    def acceptance_length(self) -> float | None:
        """Per draft round (bonus token included); None without speculation."""
        return acceptance.acceptance_length(self.delta) if self.delta.drafts > 0 else None

    @property
    def token_acceptance_rate(self) -> float | None:
        """TAR: accepted / proposed draft tokens."""
        return acceptance.token_acceptance_rate(self.delta)

    @property
    def tokens_per_target_step(self) -> float:
        return acceptance.tokens_per_target_step(self.output_tokens, self.delta.accepted)

    def as_dict(self) -> dict:
        return {"concurrency": self.concurrency, "num_requests": self.num_requests,
                "output_tokens": self.output_tokens, "tpot_ms": self.tpot_ms, "ttft_ms": self.ttft_ms,
                "output_tokens_per_s": self.output_tokens_per_s, "acceptance_length": self.acceptance_length,
                "acceptance_rate_per_position": acceptance.acceptance_rates(self.delta),
                "token_acceptance_rate": self.token_acceptance_rate,
                "tokens_per_target_step": self.tokens_per_target_step}


def cell_prompts(prompts: list[list[int]], concurrency: int, min_requests: int) -> list[list[int]]:
    """max(concurrency, min_requests) prompts, cycling through the list: every cell of every method sends the same
    requests in the same order, so their outputs (greedy, lossless) and so their TPOTs compare."""
    n = max(concurrency, min_requests)
    return [prompts[i % len(prompts)] for i in range(n)]


def run_load_cell(server: VllmServer, prompts: list[list[int]], concurrency: int, *, min_requests: int,
                  max_tokens: int, tokenizer, log_path: Path) -> LoadCell:
    """Send the cell's requests, `concurrency` in flight, through vLLM's benchmark client; its printout goes to
    `log_path`."""
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    requests = [SampleRequest(prompt=p, prompt_len=len(p), expected_output_len=max_tokens)
                for p in cell_prompts(prompts, concurrency, min_requests)]
    before = server.settled_spec_counters()
    # the server is on 127.0.0.1: vLLM's client honours proxy variables (trust_env), so exempt loopback
    no_proxy = ",".join(x for x in (os.environ.get("no_proxy", ""), "127.0.0.1", "localhost") if x)
    with _environ(no_proxy=no_proxy, NO_PROXY=no_proxy), open(log_path, "a") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print(f"=== concurrency {concurrency}, {len(requests)} requests, max_tokens {max_tokens}", flush=True)
        result = asyncio.run(benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai", api_url=server.url + "/v1/completions",
            base_url=server.url, model_id=SERVED_MODEL_NAME, model_name=SERVED_MODEL_NAME, tokenizer=tokenizer,
            input_requests=requests, logprobs=None, request_rate=float("inf"), burstiness=1.0, disable_tqdm=True,
            num_warmups=0, profile=False, selected_percentile_metrics=["ttft", "tpot"],
            selected_percentiles=[float(p) for p in TPOT_PERCENTILES], ignore_eos=False, goodput_config_dict={},
            max_concurrency=concurrency, lora_modules=None, extra_headers=None,
            extra_body={"temperature": 0.0}, ready_check_timeout_sec=0))
    delta = server.settled_spec_counters() - before
    failed = [e for e in result.get("errors", []) if e]
    if failed or result["completed"] != len(requests):
        raise RuntimeError(f"vLLM '{server.label}': {len(requests) - result['completed']} of {len(requests)} "
                           f"requests failed at concurrency {concurrency}: {failed[:1]} (log {log_path})")
    cell = LoadCell(concurrency=concurrency, num_requests=len(requests),
                    output_tokens=int(result["total_output_tokens"]),
                    # vLLM's figures are numpy scalars: plain floats keep validation.json writable
                    tpot_ms={"mean": float(result["mean_tpot_ms"]),
                             **{f"p{p}": float(result[f"p{p}_tpot_ms"]) for p in TPOT_PERCENTILES}},
                    ttft_ms=float(result["mean_ttft_ms"]), output_tokens_per_s=float(result["output_throughput"]),
                    delta=delta)
    logger.info("%s c=%d: TPOT %.1f ms (p50 %.1f, p90 %.1f), %.1f output tokens/s%s", server.label, concurrency,
                cell.tpot_ms["mean"], cell.tpot_ms["p50"], cell.tpot_ms["p90"], cell.output_tokens_per_s,
                f", TAR {cell.token_acceptance_rate:.2f}" if cell.token_acceptance_rate is not None else "")
    return cell


@contextlib.contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
