"""train.precision: the CPU probe's decision, and a bf16-autocast step against the fp32 step."""
from __future__ import annotations

import math
import os
import socket
from types import SimpleNamespace

import pytest
import torch

from draftsmith.data.errors import UserError
from draftsmith.train.loss import teacher_targets, ttt_loss
from draftsmith.train.precision import (
    MIN_CPU_BF16_SPEEDUP,
    cpu_bf16_speedup,
    pick_mixed_precision,
    run_mixed_precision,
)


def fail_if_probed():
    raise AssertionError("the probe must not run when the setting or the device decides")


@pytest.mark.parametrize("setting, on_cuda, speedup, want", [
    ("fp32", True, fail_if_probed, "no"),
    ("bf16", False, fail_if_probed, "bf16"),
    ("auto", True, fail_if_probed, "bf16"),
    ("auto", False, lambda: 6.0, "bf16"),  # AMX
    ("auto", False, lambda: MIN_CPU_BF16_SPEEDUP - 0.01, "no"),
    ("auto", False, lambda: 0.005, "no"),  # emulated bf16 (AVX2)
])
def test_pick_mixed_precision(setting, on_cuda, speedup, want):
    assert pick_mixed_precision(setting, on_cuda, speedup) == want


def test_a_run_keeps_the_precision_it_started_with(tmp_path):
    record, main = tmp_path / "train" / "precision.json", SimpleNamespace(is_main_process=True, num_processes=1)
    assert run_mixed_precision("auto", False, record, main, lambda: 6.0) == "bf16"
    # resumed on a CPU (or under a load) where the probe would now say fp32: the numerics stay the run's own
    assert run_mixed_precision("auto", False, record, main, fail_if_probed) == "bf16"
    assert run_mixed_precision("fp32", False, record, main) == "no"  # an explicit setting is obeyed...
    assert run_mixed_precision("auto", False, record, main, fail_if_probed) == "no"  # ...and recorded


def _decide_in_process(rank: int, record, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    state = SimpleNamespace(is_main_process=rank == 0, num_processes=2)
    # each process's own probe would disagree; the main process's decision must reach both
    try:
        choice = run_mixed_precision("auto", False, record, state, (lambda: 6.0) if rank == 0 else (lambda: 0.1))
    except UserError as e:
        choice = f"UserError: {e}"
    (out / f"rank{rank}").write_text(choice)
    torch.distributed.destroy_process_group()


def test_every_process_trains_in_the_main_process_precision(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_decide_in_process, args=(tmp_path / "precision.json", port, tmp_path), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["bf16", "bf16"]


@pytest.mark.parametrize("content", ['{"mixed_precision": "bf1', '{"setting": "auto"}', '{"mixed_precision": "fp8"}'])
def test_a_damaged_record_stops_every_process_with_its_path(tmp_path, content):
    record = tmp_path / "precision.json"
    record.write_text(content)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the main process finds the damage; the other must hear of it rather than wait in the broadcast
    torch.multiprocessing.spawn(_decide_in_process, args=(record, port, tmp_path), nprocs=2)
    for r in (0, 1):
        said = (tmp_path / f"rank{r}").read_text()
        assert said.startswith(f"UserError: {record}") and "train.precision" in said, said


def test_the_probe_measures_this_cpu():
    speedup = cpu_bf16_speedup()
    assert math.isfinite(speedup) and speedup > 0


def test_a_burst_of_other_work_does_not_decide_the_probe():
    # products take 10 ms in fp32 and 4 ms in bf16 (2.5x); other work stalls a few of them, a different few per
    # dtype, as a scheduler would: the probe keeps 2.5x, where timing one dtype's products after the other's and
    # taking either's worst or average would not
    stalls = {torch.float32: iter([0, 0, 0.2, 0, 0, 0, 0]), torch.bfloat16: iter([0, 0.3, 0.3, 0, 0.3, 0])}
    base = {torch.float32: 0.010, torch.bfloat16: 0.004}
    assert cpu_bf16_speedup(product_seconds=lambda dt: base[dt] + next(stalls[dt])) == pytest.approx(2.5)
    slow = iter([0.010, 0.010, 2.0])  # emulated bf16: its warm-up alone answers, no rounds of 2 s products
    assert cpu_bf16_speedup(product_seconds=lambda dt: next(slow)) == pytest.approx(0.005)


def test_bf16_autocast_step_is_the_fp32_step_within_bf16_precision():
    g = torch.Generator().manual_seed(0)
    B, T, H, V_T, V_D = 1, 64, 32, 80, 48
    final = torch.randn(B, T, H, generator=g)
    target_head = torch.randn(V_T, H, generator=g) * 0.3
    t2d = torch.zeros(V_T, dtype=torch.bool)
    t2d[:V_D] = True
    head = (torch.randn(V_D, H, generator=g) * 0.3).requires_grad_(True)
    states = torch.randn(B, T, H, generator=g).requires_grad_(True)
    mask = torch.ones(B, T, dtype=torch.bool)

    def step():
        teacher = teacher_targets(final, target_head, t2d, mask)
        masks = (mask & teacher.in_vocab)[None]
        loss, _ = ttt_loss(head, [states @ torch.eye(H)], teacher, masks, 0.8)
        return (loss, *torch.autograd.grad(loss, [head, states]))

    fp32 = step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = step()
    torch.testing.assert_close(bf16[0], fp32[0], rtol=2e-2, atol=0)
    for got, want in zip(bf16[1:], fp32[1:]):
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cosine > 0.99, f"bf16 gradient direction off: cosine {cosine:.4f}"
        assert not torch.equal(got, want), "autocast did not change the precision"
