"""Online training (data.capture online) trains what offline training trains: the same per-step losses and final
weights within fp32 summation-order noise, for EAGLE-3 and P-EAGLE; an online run resumes bit-exactly; the
target stays out of the checkpoints; the tokens-only dataset is a small fraction of the offline one."""
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_data import build_tiny_dataset

from draftsmith.train import eagle3, peagle
from draftsmith.train.loop import Trainer

# batch composition differs (capture batches vs each row's batches): fp32 summation order, amplified by training
LOSS_RTOL, WEIGHT_ATOL = 1e-4, 1e-4
EXTRA = {"train": {"max_steps": 8, "eval_every": 4, "save_every": 4, "log_every": 1}}


@pytest.fixture(scope="module")
def online_dataset(tiny_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("online") / "dataset"
    build_tiny_dataset(tiny_target_dir, out, online=True)
    return out


def run(main, tiny_run, folder, dataset=None, extra=EXTRA):
    folder.mkdir()
    out = folder / "run"
    if dataset is not None:
        import shutil

        shutil.copytree(dataset, out / "dataset")
    main(["--config", tiny_run(folder, extra, output_dir=out)])
    return out


def losses(out):
    return [m["loss"] for m in map(json.loads, open(out / "train" / "metrics.jsonl")) if "loss" in m]


def last_weights(out):
    return load_file(out / "train" / "checkpoints" / "step-0000008" / "model.safetensors")


@pytest.mark.parametrize("main", [eagle3.main, peagle.main], ids=["eagle3", "peagle"])
def test_online_run_equals_offline_run(main, tiny_run, online_dataset, tmp_path):
    extra = EXTRA if main is eagle3.main else {**EXTRA, "peagle": {"num_depths": 4}}
    offline = run(main, tiny_run, tmp_path / "offline", extra=extra)
    online = run(main, tiny_run, tmp_path / "online", online_dataset, extra=extra)
    a, b = losses(offline), losses(online)
    assert len(a) == len(b) == 8
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=LOSS_RTOL, atol=0)
    wa, wb = last_weights(offline), last_weights(online)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa if not wa[k].is_floating_point())  # d2t, t2d
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa if wa[k].is_floating_point())
    print(f"online vs offline ({'eagle3' if main is eagle3.main else 'peagle'}): losses {a[-1]:.6f} / {b[-1]:.6f}, "
          f"max|dw| {worst:.3g}")
    assert worst <= WEIGHT_ATOL
    # the target is read, never trained or saved: the checkpoint holds the drafter's tensors alone
    assert not any(k.startswith(("model.layers", "target")) for k in wb)


class _Killed(Exception):
    pass


def test_online_resume_is_bit_exact(tiny_run, online_dataset, tmp_path, monkeypatch):
    straight = run(eagle3.main, tiny_run, tmp_path / "straight", online_dataset)
    real_train_step = Trainer.train_step

    def dying_train_step(self):
        if self.step == 6:  # after the step-4 checkpoint
            raise _Killed()
        return real_train_step(self)

    monkeypatch.setattr(Trainer, "train_step", dying_train_step)
    with pytest.raises(_Killed):
        run(eagle3.main, tiny_run, tmp_path / "resumed", online_dataset)
    monkeypatch.setattr(Trainer, "train_step", real_train_step)
    resumed = tmp_path / "resumed" / "run"
    eagle3.main(["--config", str(tmp_path / "resumed" / "tiny.yaml")])
    a, b = last_weights(straight), last_weights(resumed)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_online_dataset_is_tokens_only(tiny_run, online_dataset, tmp_path):
    tiny_run(tmp_path)  # materialises the offline dataset under tmp_path/run
    size = lambda d: sum(f.stat().st_size for f in d.glob("shard-*.safetensors"))
    ratio = size(online_dataset) / size(tmp_path / "run" / "dataset")
    print(f"online dataset: {100 * ratio:.2f} % of the offline one's shard bytes")
    # ids and masks, 5 B/token, against (3 aux + 1 final) x H=64 x fp32 + 5 = 1029 B/token; headers and offsets
    assert ratio < 0.01
