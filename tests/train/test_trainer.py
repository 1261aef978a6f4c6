"""A real few-step EAGLE-3 training run on a tiny target: the loss falls, resume is exact, bad inputs refused."""
import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data.errors import UserError
from draftsmith.train import eagle3
from draftsmith.train.checkpoint import load_drafter_bundle
from draftsmith.train.loop import Trainer


def _metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "train" / "metrics.jsonl")]


def test_twenty_steps_lower_the_loss_and_keep_the_best(tiny_run, tmp_path):
    eagle3.main(["--config", tiny_run(tmp_path)])
    run = tmp_path / "run"
    losses = [m["loss"] for m in _metrics(run) if "loss" in m]
    assert losses[-1] < 0.7 * losses[0], losses
    evals = [m for m in _metrics(run) if "eval_sim_al" in m]
    assert [m["step"] for m in evals] == [10, 20]
    _, spec, progress = load_drafter_bundle(run / "train" / "best")
    assert spec.method == "eagle3" and spec.aux_layer_ids == (1, 2, 3)
    # best/ holds the evaluation with the highest simulated acceptance at the served K, and says which step
    best = max(evals, key=lambda m: m["eval_sim_al"]["3"])
    assert progress["step"] == best["step"]
    assert progress["eval"]["simulated_acceptance_length"]["3"] == pytest.approx(best["eval_sim_al"]["3"])
    assert json.loads((run / "train" / "eval_heldout.json").read_text())["step"] == best["step"]


def test_metrics_reach_tensorboard_through_accelerate_and_wandb_is_off_unless_asked(tiny_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    eagle3.main(["--config", tiny_run(tmp_path, {"train": {"max_steps": 5, "log_every": 1, "eval_every": 5}})])
    train_dir = tmp_path / "run" / "train"
    events = EventAccumulator(str(next((train_dir / "tensorboard").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    logged = [m for m in _metrics(tmp_path / "run") if "loss" in m]
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [m["step"] for m in logged]
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in logged], rel=1e-6)
    assert "eval/sim_al_k3" in events.Tags()["scalars"]
    assert not (train_dir / "wandb").exists() and not (train_dir / "wandb-run-id").exists()


def test_wandb_asked_for_but_missing_is_a_clear_error(tiny_run, tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(UserError, match=r"train.report_to includes wandb, which is not installed"):
        eagle3.main(["--config", tiny_run(tmp_path), "train.report_to=[tensorboard,wandb]"])


class _Killed(Exception):
    pass


def test_kill_at_step_ten_then_resume_matches_uninterrupted(tiny_run, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    straight.mkdir()
    eagle3.main(["--config", tiny_run(straight), "train.eval_every=100"])
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    cfg = tiny_run(resumed)
    real_train_step = Trainer.train_step

    def dying_train_step(self):
        if self.step == 12:  # after the step-10 checkpoint, mid-way to the next one
            raise _Killed()
        return real_train_step(self)

    monkeypatch.setattr(Trainer, "train_step", dying_train_step)
    with pytest.raises(_Killed):
        eagle3.main(["--config", cfg, "train.eval_every=100"])
    monkeypatch.setattr(Trainer, "train_step", real_train_step)
    ckpts = sorted(p.name for p in (resumed / "run" / "train" / "checkpoints").iterdir())
    assert ckpts == ["step-0000010"]
    eagle3.main(["--config", cfg, "train.eval_every=100"])
    a = load_file(straight / "run" / "train" / "checkpoints" / "step-0000020" / "model.safetensors")
    b = load_file(resumed / "run" / "train" / "checkpoints" / "step-0000020" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_dataset_for_other_aux_ids_is_refused(tiny_run, tmp_path):
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[1, 2, 3\].*target.aux_layer_ids=\[1, 2\]"):
        eagle3.main(["--config", tiny_run(tmp_path), "target.aux_layer_ids=[1,2]"])


def test_resume_with_changed_model_config_is_refused(tiny_run, tmp_path):
    cfg = tiny_run(tmp_path)
    eagle3.main(["--config", cfg, "train.max_steps=10", "train.eval_every=100"])
    with pytest.raises(ValueError, match="ttt.num_steps"):
        eagle3.main(["--config", cfg, "ttt.num_steps=2"])


def test_resume_on_a_rebuilt_dataset_is_refused_naming_both_manifests(tiny_run, tmp_path):
    cfg = tiny_run(tmp_path)
    eagle3.main(["--config", cfg, "train.max_steps=10", "train.eval_every=100"])
    manifest = tmp_path / "run" / "dataset" / "manifest.json"
    before = manifest.read_bytes()
    # another build of the folder (here: one more field) under the same config
    manifest.write_text(json.dumps({**json.loads(before), "rebuilt": True}))
    with pytest.raises(UserError, match=r"trained on another dataset: its manifest had sha256 [0-9a-f]{16}, .*"
                                        r"manifest.json now has [0-9a-f]{16}"):
        eagle3.main(["--config", cfg, "train.max_steps=12"])
    manifest.write_bytes(before)  # the data it started with: the resume goes on
    eagle3.main(["--config", cfg, "train.max_steps=12"])
    assert [m["step"] for m in _metrics(tmp_path / "run") if "eval_sim_al" in m][-1] == 12


def test_a_frozen_target_head_stays_the_targets_while_the_rest_learns(tiny_run, tmp_path, tiny_target_dir):
    from draftsmith.data.config import load_config
    from draftsmith.data.target import load_target_head
    from draftsmith.train.build import build_drafter, build_drafter_spec, load_checked_dataset

    config = tiny_run(tmp_path, {"train": {"lm_head_init": "target", "freeze_lm_head": True, "max_steps": 6}})
    cfg, _ = load_config(config, [])
    _, _, aux_ids, target_path, hf_cfg = load_checked_dataset(cfg)
    start = build_drafter(cfg, build_drafter_spec(cfg, hf_cfg, target_path, aux_ids, "eagle3"), target_path)
    assert not start.lm_head.weight.requires_grad and start.fc.weight.requires_grad
    eagle3.main(["--config", config])
    weights, _, _ = load_drafter_bundle(tmp_path / "run" / "train" / "best")
    head = load_target_head(str(tiny_target_dir))
    draft_ids = weights["t2d"].nonzero().squeeze(-1)
    assert torch.equal(start.lm_head.weight, head["lm_head"].float()[draft_ids])
    assert torch.equal(weights["lm_head.weight"], start.lm_head.weight)
    # the norm before the head starts as the target's final norm and trains, like every other weight
    assert torch.equal(start.norm.weight, head["norm"].float())
    for name in ("norm.weight", "fc.weight", "layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(weights[name], start.state_dict()[name]), name
