"""Which compute precision a run trains in: train.precision, where `auto` is bf16 autocast on a GPU and, on a
CPU, bf16 autocast only if a matmul probe at start measures it faster than fp32 (AMX units), else fp32.

Weights stay fp32 either way (autocast casts matmul inputs, not parameters). A CPU without bf16 matmul units
emulates bf16 at a fraction of fp32's speed, so a flag the user must know would be wrong on half the machines.
The choice is made once per run, on the main process, and shared: every process trains in the same precision,
and a resumed run keeps the precision it started with (train/precision.json), whatever a new probe would say.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from draftsmith.data.errors import UserError
from draftsmith.data.manifest import atomic_write_json

logger = logging.getLogger(__name__)

# bf16 wins on a CPU only when its matmuls are at least this much faster (AMX measures 3-10x; AVX-512 BF16
# ~1.5-2x; AVX2 emulates it at ~0.25x). Below it, the lost precision is not worth it.
MIN_CPU_BF16_SPEEDUP = 1.5


def matmul_timer(size: tuple[int, int, int] = (512, 1024, 2048)):
    """A function dtype -> seconds of one [m, k] x [k, n] product in that dtype on the CPU (~5-15 ms in fp32 on
    2 cores: long enough that one scheduler tick of other work does not dominate it)."""
    m, k, n = size
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    operands = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}

    def seconds(dtype: torch.dtype) -> float:
        x, y = operands[dtype]
        start = time.perf_counter()
        x @ y
        return time.perf_counter() - start

    return seconds


def cpu_bf16_speedup(rounds: int = 5, product_seconds=None) -> float:
    """fp32 time / bf16 time of the same matmul on this CPU.

    The two dtypes are timed in alternation, after one warm-up product each, and each keeps its best time: a
    burst of other work on the machine slows one product of each, not the figure (timing 1 ms products, three of
    fp32 and then three of bf16, read 0.05x once on a CPU where bf16 runs 2.5x faster). Emulated bf16 (~200x
    fp32's time) is returned after its warm-up, so the probe stays under a few seconds everywhere.
    """
    product_seconds = product_seconds or matmul_timer()
    product_seconds(torch.float32)
    fp32 = product_seconds(torch.float32)
    warm_up = product_seconds(torch.bfloat16)
    if warm_up > 20 * fp32:
        return fp32 / warm_up
    bf16 = float("inf")
    for _ in range(rounds):
        fp32 = min(fp32, product_seconds(torch.float32))
        bf16 = min(bf16, product_seconds(torch.bfloat16))
    return fp32 / bf16


def pick_mixed_precision(setting: str, on_cuda: bool, speedup=cpu_bf16_speedup) -> str:
    """accelerate's mixed_precision ("bf16" or "no") for train.precision `setting` (auto | bf16 | fp32)."""
    if setting == "fp32":
        return "no"
    if setting == "bf16" or on_cuda:
        return "bf16"
    measured = speedup()
    choice = "bf16" if measured >= MIN_CPU_BF16_SPEEDUP else "no"
    logger.info("train.precision auto: a bf16 matmul runs %.2fx fp32's speed on this CPU -> %s", measured,
                "bf16 autocast" if choice == "bf16" else f"fp32 (bf16 needs >= {MIN_CPU_BF16_SPEEDUP}x)")
    return choice


def run_mixed_precision(setting: str, on_cuda: bool, record: Path, state, speedup=cpu_bf16_speedup) -> str:
    """The run's mixed precision, the same on every process of `state` (an initialized accelerate PartialState)
    and across resumes: the main process reads `record` (auto only) or decides, then tells the others."""
    choice = error = None
    if state.is_main_process:
        try:
            choice = recorded_choice(record) if setting == "auto" and record.is_file() else None
        except UserError as e:
            error = str(e)
        if choice is not None:
            logger.info("train.precision auto: %s, as this run chose at its start (%s)", choice, record)
        elif error is None:
            choice = pick_mixed_precision(setting, on_cuda, speedup)
            record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(record, {"setting": setting, "mixed_precision": choice})
    if state.num_processes > 1:  # the error travels too: a process left waiting here would hang the launch
        box = [(choice, error)]
        torch.distributed.broadcast_object_list(box, src=0)
        choice, error = box[0]
    if error:
        raise UserError(error)
    return choice


def recorded_choice(record: Path) -> str:
    """The mixed precision a run recorded at its start; a clear error if the record is damaged."""
    fix = ("set train.precision to bf16 or fp32 to resume in the precision the run started with, or delete the "
           "file to let this run probe again")
    try:
        choice = json.loads(record.read_text())["mixed_precision"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UserError(f"{record} is damaged ({type(e).__name__}: {e}); {fix}") from None
    if choice not in ("bf16", "no"):
        raise UserError(f"{record} records mixed_precision {choice!r}, not bf16 or no; {fix}")
    return choice
