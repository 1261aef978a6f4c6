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


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_padding_a_row_to_a_length_multiple_changes_neither_loss_nor_gradients(method, tiny_run, tmp_path):
    """train.row_length_multiple pads rows with document id -1: never scored, never attended by real tokens."""
    cfg_path = tiny_run(tmp_path, {"peagle": {"num_depths": 3}})
    model, row = objective_and_row(cfg_path, method, torch.float32)
    T = row["input_ids"].shape[1]
    multiple = T + 37  # pads the row by 37 positions
    padded = {k: (torch.cat([v, v.new_full((1, multiple - T, *v.shape[2:]), -1 if k == "document_ids" else 0)], 1)
                  if torch.is_tensor(v) else v) for k, v in row.items()}
    cfg, _ = load_config(cfg_path, [])
    train_ds, *_ = load_checked_dataset(cfg)
    plan = plan_next_row(train_ds, DataPosition(), cfg.train.seed, cfg.train.batch_tokens)
    packed = pack_planned_row(train_ds, plan, multiple, multiple)  # the packer pads the same way
    assert all(torch.equal(packed[k], padded[k]) for k in row if torch.is_tensor(row[k]))
    assert packed["num_tokens"] == row["num_tokens"] == T  # trained tokens: the padding is not counted

    results = []
    for r in (row, padded):
        model.zero_grad(set_to_none=True)
        loss, metrics = model(r)
        loss.backward()
        results.append((loss.detach(), metrics["count"], {n: p.grad.clone() for n, p in model.named_parameters()
                                                          if p.grad is not None}))
    (loss_a, count_a, grads_a), (loss_b, count_b, grads_b) = results
    assert torch.equal(count_a, count_b) and int(count_a.sum()) > 0
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_padded_length_rounds_up_within_the_row():
    from draftsmith.train.packing import padded_length

    assert [padded_length(n, 2048, 128) for n in (1, 128, 129, 1900, 2048)] == [128, 128, 256, 1920, 2048]
    assert padded_length(2000, 2000, 128) == 2000 and padded_length(77, 2048, 1) == 77
