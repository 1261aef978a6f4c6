"""Multi-process resume with real SIGKILLs: one rank killed -9 mid-run, the same command relaunched, ends with
the weights of an unbroken run; a 2-process run resumed on 1 process continues the same global data order."""
import pytest
from launching import (
    assert_launched_as,
    final_weights,
    kill_rank_after_checkpoint,
    launch_env,
    logged_losses,
    max_abs_difference,
    run_training,
    train_command,
)

pytestmark = pytest.mark.slow

STEPS = {"max_steps": 40, "save_every": 10, "eval_every": 40, "batch_tokens": 512}


def first_checkpoint(run_dir):
    return run_dir / "train" / "checkpoints" / "step-0000010"


@pytest.fixture(scope="module")
def unbroken(scaleout_config):
    """backend -> the uninterrupted 2-process run."""
    runs = {}

    def get(backend: str):
        if backend not in runs:
            config, run_dir = scaleout_config(f"unbroken-{backend}", train=STEPS)
            run_training(train_command("eagle3", config, backend), launch_env(run_dir.parent), run_dir.parent)
            runs[backend] = run_dir
        return runs[backend]

    return get


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2"])
def test_kill_9_of_one_rank_then_the_same_command_ends_bit_identical(backend, unbroken, scaleout_config):
    config, run_dir = scaleout_config(f"killed-{backend}", train=STEPS)
    env, cwd = launch_env(run_dir.parent), run_dir.parent
    cmd = train_command("eagle3", config, backend)
    kill_rank_after_checkpoint(cmd, env, cwd, first_checkpoint(run_dir), rank=1)
    assert not (run_dir / "train" / "best").exists(), "the kill came after the run had finished"
    log = run_training(cmd, env, cwd)
    assert "resumed from" in log and "step-00000" in log
    a, b = final_weights(unbroken(backend)), final_weights(run_dir)
    assert max_abs_difference(a, b) == 0.0
    assert logged_losses(run_dir)[40] == logged_losses(unbroken(backend))[40]


def test_two_process_run_resumed_on_one_process_continues_the_global_order(unbroken, scaleout_config):
    """Killed after its step-10 checkpoint, the 2-process DDP run resumes as 1 process x grad_accum 2 (the same
    global batch): it trains the same rows in the same order, so it ends where the unbroken run ends."""
    config, run_dir = scaleout_config("rescaled", train=STEPS)
    env, cwd = launch_env(run_dir.parent), run_dir.parent
    kill_rank_after_checkpoint(train_command("eagle3", config, "ddp"), env, cwd, first_checkpoint(run_dir), rank=None)
    log = run_training(train_command("eagle3", config, None, ["train.grad_accum=2"]), env, cwd)
    assert_launched_as(log, None, 1)
    assert "written by 2 process(es), resuming on 1" in log
    difference = max_abs_difference(final_weights(unbroken("ddp")), final_weights(run_dir))
    print(f"2 processes -> 1 process x grad_accum 2: max |w - w_unbroken| = {difference:.3e}")
    assert difference < 1e-5
    assert logged_losses(run_dir)[40] == pytest.approx(logged_losses(unbroken("ddp"))[40], rel=1e-5)
