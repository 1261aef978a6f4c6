"""data/check.py: a built dataset matches a fresh transformers forward of its target in target.dtype, on the
target's input device; states from another target are refused."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.data import check
from draftsmith.data.build import main as build
from draftsmith.data.errors import UserError
from draftsmith.data.shards import ShardedDataset


def test_check_passes_on_a_built_dataset_and_refuses_another_targets_states(build_config, chat_target_dir,
                                                                           tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    config = build_config(tmp_path)
    build(["--config", config])
    caplog.set_level("INFO", logger="draftsmith.data.check")
    check.main(["--config", config, "--samples", "3"])
    assert "in float32 on cpu" in caplog.text and f"<= {check.TOLERANCE['float32']}" in caplog.text
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(chat_target_dir).config).eval()
    with pytest.raises(UserError, match="worst relative error"):
        check.check_hidden_states(other, ShardedDataset(tmp_path / "run" / "dataset"), [1, 2, 3], 2, 0.02)


class LastAuxSwapped:
    """A dataset whose aux id N slot holds the post-norm final state instead (the mistake HF's list invites)."""

    def __init__(self, ds, hidden):
        self.ds, self.hidden = ds, hidden

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        s = dict(self.ds[i])
        s["aux_hidden_states"] = s["aux_hidden_states"].clone()
        s["aux_hidden_states"][:, -self.hidden:] = s["final_hidden_states"]
        return s


def test_check_compares_aux_id_n_with_the_pre_norm_stream(build_config, chat_target_dir, tmp_path, monkeypatch):
    # the tiny target has N = 4 layers: aux id 4 is the last layer's output before the final norm, as vLLM takes it
    monkeypatch.chdir(tmp_path)
    config = build_config(tmp_path)
    build(["--config", config, "target.aux_layer_ids=[1,2,4]"])
    model = AutoModelForCausalLM.from_pretrained(chat_target_dir, dtype=torch.float32).eval()
    ds = ShardedDataset(tmp_path / "run" / "dataset")
    tol = check.TOLERANCE["float32"]
    assert check.check_hidden_states(model, ds, [1, 2, 4], 2, tol) < 0.005  # bf16 storage rounding only
    with pytest.raises(UserError, match="worst relative error"):
        check.check_hidden_states(model, LastAuxSwapped(ds, model.config.hidden_size), [1, 2, 4], 2, tol)
