"""The module every backend wraps: the whole loss runs in one forward, in fp32 or with bf16 weights (DeepSpeed's
bf16 mode and FSDP2's param_dtype hand the rows' fp32 hidden states to bf16 weights)."""
import pytest
import torch

from draftsmith.data.config import load_config
from draftsmith.train import eagle3, peagle
from draftsmith.train.build import build_drafter, build_drafter_spec, load_checked_dataset
from draftsmith.train.objective import DrafterObjective
from draftsmith.train.packing import DataPosition, pack_planned_row, plan_next_row


def objective_and_row(config: str, method: str, dtype: torch.dtype):
    cfg, _ = load_config(config, [])
    train_ds, _, aux_ids, target_path, hf_cfg = load_checked_dataset(cfg)
    spec = build_drafter_spec(cfg, hf_cfg, target_path, aux_ids, method, mask_token_id=5 if method == "peagle" else None)
    drafter = build_drafter(cfg, spec, target_path)
    built = (eagle3 if method == "eagle3" else peagle).build_method(cfg, drafter, target_path, torch.device("cpu"))
    plan = plan_next_row(train_ds, DataPosition(), cfg.train.seed, cfg.train.batch_tokens)
    return DrafterObjective(drafter.to(dtype), built.row_loss), pack_planned_row(train_ds, plan, cfg.train.batch_tokens)


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_bf16_weights_take_fp32_rows(method, tiny_run, tmp_path):
    model, row = objective_and_row(tiny_run(tmp_path, {"peagle": {"num_depths": 3}}), method, torch.bfloat16)
    assert row["aux_hidden_states"].dtype == torch.float32
    loss, metrics = model(row)
    loss.backward()
    assert torch.isfinite(loss) and int(metrics["count"].sum()) > 0
    assert model.drafter.fc.weight.grad.dtype == torch.bfloat16 and model.drafter.fc.weight.grad.abs().sum() > 0


def test_state_dict_is_the_drafters_under_one_prefix(tiny_run, tmp_path):
    model, _ = objective_and_row(tiny_run(tmp_path), "eagle3", torch.float32)
    inner = model.drafter.state_dict()
    assert set(model.state_dict()) == {f"drafter.{k}" for k in inner}
