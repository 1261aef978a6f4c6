"""A real few-step EAGLE-3 training run on a tiny target: the loss falls, resume is exact, bad inputs refused."""
import json

import pytest
import torch
from safetensors.torch import load_file

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
