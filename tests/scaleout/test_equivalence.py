"""2 processes x 1 row a step train exactly what 1 process x 2 accumulated rows trains (the same global batch),
under DDP, FSDP2 and DeepSpeed ZeRO-2, for EAGLE-3 and P-EAGLE: weights, logged losses and held-out metrics."""
import json
from pathlib import Path

import pytest
import yaml
from launching import (
    assert_launched_as,
    final_weights,
    launch_env,
    logged_losses,
    max_abs_difference,
    run_training,
    train_command,
    train_lines,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

# fp32, one thread per process, another reduction order: observed differences after 5 steps are 0 (DDP),
# ~1.5e-8 (FSDP2) and <= 6e-8 (ZeRO-2); a rank that trains alone (no gradient sync) is off by > 1e-2
WEIGHT_TOLERANCE = 1e-5
LOSS_RELATIVE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def one_process(scaleout_config, tmp_path_factory):
    """method -> run dir of the 1-process reference with grad_accum 2."""
    runs = {}
    for method in ("eagle3", "peagle"):
        config, run_dir = scaleout_config(f"one-{method}", train={"grad_accum": 2})
        log = run_training(train_command(method, config, None), launch_env(run_dir.parent), run_dir.parent)
        assert_launched_as(log, None, 1)
        runs[method] = run_dir
    return runs


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2"])
@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_two_processes_train_what_one_process_trains(method, backend, one_process, scaleout_config):
    config, run_dir = scaleout_config(f"two-{method}-{backend}")
    log = run_training(train_command(method, config, backend), launch_env(run_dir.parent), run_dir.parent)
    assert_launched_as(log, backend, 2)
    reference = one_process[method]

    difference = max_abs_difference(final_weights(reference), final_weights(run_dir))
    print(f"{method} {backend}: max |w_2proc - w_1proc| = {difference:.3e}")
    assert difference < WEIGHT_TOLERANCE

    want, got = logged_losses(reference), logged_losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in want:
        print(f"{method} {backend}: step {step} loss 1proc {want[step]:.6f} 2proc {got[step]:.6f}")
        assert got[step] == pytest.approx(want[step], rel=LOSS_RELATIVE_TOLERANCE)

    # each process reads only its own rows and hashes its share of the shards: together, what one process reads,
    # plus one more copy of the small offsets tables (every process plans every row from the sample lengths)
    want_line, got_line = train_lines(reference)[5], train_lines(run_dir)[5]
    manifest = json.loads((run_dir / "dataset" / "manifest.json").read_text())
    offsets_bytes = sum(8 * (shard["num_samples"] + 1) for shard in manifest["shards"])
    assert got_line["data_bytes_read"] == want_line["data_bytes_read"] + offsets_bytes
    assert got_line["tokens"] == want_line["tokens"]
    # the full weights in the checkpoint are the ones best/ holds, whatever the backend shards
    checkpoint = load_file(run_dir / "train" / "checkpoints" / "step-0000005" / "drafter" / "drafter.safetensors")
    assert max_abs_difference(checkpoint, final_weights(run_dir)) == 0.0

    # the held-out evaluation is split over the processes and summed: the same counts as one process
    want_eval = json.loads((reference / "train" / "eval_heldout.json").read_text())
    got_eval = json.loads((run_dir / "train" / "eval_heldout.json").read_text())
    assert got_eval["num_scored"] == want_eval["num_scored"] and sum(got_eval["num_scored"]) > 0
    assert got_eval["per_step_accuracy"] == pytest.approx(want_eval["per_step_accuracy"], abs=1e-4)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2"])
def test_two_processes_online_train_what_one_process_offline_trains(backend, one_process, scaleout_config):
    """data.capture online: each process runs its own copy of the frozen target on its own rows; the result is the
    offline global batch's (summation order aside), and the target never enters the optimizer or checkpoints."""
    config, run_dir = scaleout_config(f"two-online-{backend}", online=True)
    log = run_training(train_command("eagle3", config, backend), launch_env(run_dir.parent), run_dir.parent)
    assert_launched_as(log, backend, 2)
    difference = max_abs_difference(final_weights(one_process["eagle3"]), final_weights(run_dir))
    print(f"eagle3 {backend} online 2proc vs offline 1proc: max |dw| = {difference:.3e}")
    assert difference < WEIGHT_TOLERANCE
    want, got = logged_losses(one_process["eagle3"]), logged_losses(run_dir)
    assert all(got[step] == pytest.approx(want[step], rel=LOSS_RELATIVE_TOLERANCE) for step in want)
    checkpoint = load_file(run_dir / "train" / "checkpoints" / "step-0000005" / "drafter" / "drafter.safetensors")
    assert checkpoint.keys() == final_weights(run_dir).keys()


def test_a_rank_training_alone_is_outside_the_tolerance(one_process, scaleout_config):
    """What a launch without gradient sync trains (each rank its own row: 1 process, grad_accum 1) differs
    from the global batch by far more than WEIGHT_TOLERANCE: the equivalence tests can fail."""
    config, run_dir = scaleout_config("alone-eagle3")
    run_training(train_command("eagle3", config, None), launch_env(run_dir.parent), run_dir.parent)
    difference = max_abs_difference(final_weights(one_process["eagle3"]), final_weights(run_dir))
    print(f"a rank alone vs the global batch: {difference:.3e}")
    assert difference > 1000 * WEIGHT_TOLERANCE


def recipe_package(recipe: str = "llama3.1-8b") -> dict:
    """The sections a shipped recipe sets beyond the sizes: its drafter switches, TTT weights and optimizer, head."""
    cfg = yaml.safe_load((REPO / "configs" / f"{recipe}.yaml").read_text())
    train_keys = ("optimizer", "lm_head_init", "freeze_lm_head", "min_lr_ratio", "teacher", "loss_tokens")
    return {"drafter": {k: v for k, v in cfg["drafter"].items() if k != "num_layers"},
            "ttt": {k: v for k, v in cfg.get("ttt", {}).items() if k != "num_steps"},
            "train": {k: v for k, v in cfg["train"].items() if k in train_keys}}


# speculators' optimizer (Muon, Newton-Schulz in bf16) with train.teacher=argmax; and the package the real-target
# recipes ship (Muon, EAGLE-3.1 norms, frozen target head, equal step weights), read from the recipe itself
PACKAGES = {"muon-argmax": {"train": {"optimizer": "muon", "muon_ns_precision": "bf16", "teacher": "argmax"}},
            "recipe": recipe_package()}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_two_processes_with_a_training_package_train_what_one_process_trains(package, scaleout_config):
    """Under DDP each rank orthogonalises the same all-reduced gradient (Muon) and reads the same frozen head,
    so 2 processes x 1 row equal 1 process x 2 accumulated rows."""
    sections = PACKAGES[package]
    train = sections.get("train", {})
    config_one, run_one = scaleout_config(f"one-{package}", **{**sections, "train": {**train, "grad_accum": 2}})
    assert_launched_as(run_training(train_command("eagle3", config_one, None), launch_env(run_one.parent),
                                    run_one.parent), None, 1)
    config_two, run_two = scaleout_config(f"two-{package}-ddp", **sections)
    assert_launched_as(run_training(train_command("eagle3", config_two, "ddp"), launch_env(run_two.parent),
                                    run_two.parent), "ddp", 2)

    difference = max_abs_difference(final_weights(run_one), final_weights(run_two))
    print(f"{package}, ddp: max |w_2proc - w_1proc| = {difference:.3e}")
    assert difference < WEIGHT_TOLERANCE
    want, got = logged_losses(run_one), logged_losses(run_two)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RELATIVE_TOLERANCE)


def test_token_alignment_trains_the_same_on_two_processes(scaleout_config):
    """ttt.alignment_topk masks each row from its own draft logits: DDP over 2 processes x 1 row still trains what
    1 process x 2 accumulated rows trains; and the mask changes what is trained (against the same run without it)."""
    align = {"alignment_topk": 1}
    config, reference = scaleout_config("one-eagle3-align", train={"grad_accum": 2}, ttt=align)
    run_training(train_command("eagle3", config, None), launch_env(reference.parent), reference.parent)
    config, run_dir = scaleout_config("two-eagle3-ddp-align", ttt=align)
    log = run_training(train_command("eagle3", config, "ddp"), launch_env(run_dir.parent), run_dir.parent)
    assert_launched_as(log, "ddp", 2)
    assert max_abs_difference(final_weights(reference), final_weights(run_dir)) < WEIGHT_TOLERANCE
    want, got = logged_losses(reference), logged_losses(run_dir)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RELATIVE_TOLERANCE)
    config, unaligned = scaleout_config("one-eagle3-unaligned", train={"grad_accum": 2})
    run_training(train_command("eagle3", config, None), launch_env(unaligned.parent), unaligned.parent)
    assert max_abs_difference(final_weights(reference), final_weights(unaligned)) > 1e-3
