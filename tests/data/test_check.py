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
