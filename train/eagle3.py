"""Train an EAGLE-3 / EAGLE-3.1 drafter with the training-time test on a data/build.py dataset.

Usage: accelerate launch train/eagle3.py --config smollm2-demo [key=value ...]   (or plain python)
"""
from __future__ import annotations

import logging

from draftsmith.data.cli import build_arg_parser, log_run_header, parse_run_args, run_entry
from draftsmith.data.config import RunConfig
from draftsmith.train.build import build_drafter, build_drafter_spec, load_checked_dataset, load_teacher_head
from draftsmith.train.distributed import build_accelerator
from draftsmith.train.loop import Method, run_training
from draftsmith.train.loss import teacher_targets, ttt_loss
from draftsmith.train.packing import row_noise, with_training_loss_mask
from draftsmith.train.ttt import pick_attention_impl, shift_for_ttt, ttt_forward, ttt_step_masks

logger = logging.getLogger("draftsmith.train.eagle3")


def ttt_row_loss(model, row: dict, teacher_weight, t2d, cfg: RunConfig, attention: str):
    """Loss and per-step metrics of one packed row (DESIGN section 3); the noise is drawn from the row's seed.
    Held-out evaluation scores every step at every position (no alignment mask), so figures compare across runs."""
    row = with_training_loss_mask(row, cfg.train.loss_tokens, model.training)
    ids, final, mask = shift_for_ttt(row["input_ids"], row["final_hidden_states"], row["loss_mask"],
                                     row["document_ids"])
    teacher = teacher_targets(final.float(), teacher_weight, t2d, needed=mask, kind=cfg.train.teacher,
                              temperature=cfg.train.teacher_temperature)
    step_masks = ttt_step_masks(mask & teacher.in_vocab, row["document_ids"], cfg.ttt.num_steps)
    aux = row["aux_hidden_states"].float()  # [1, T, n_aux * H_t]
    if model.training and cfg.train.hidden_noise_std > 0:
        aux = aux + cfg.train.hidden_noise_std * row_noise(aux, row["row_seed"])
    states = ttt_forward(model, aux, ids, row["position_ids"], row["document_ids"], cfg.ttt.num_steps, attention)
    return ttt_loss(model.lm_head.weight, states, teacher, step_masks, cfg.ttt.step_weight,
                    alignment_topk=cfg.ttt.alignment_topk if model.training else 0)


def build_method(cfg: RunConfig, model, target_path, device) -> Method:
    teacher_weight = load_teacher_head(target_path).to(device)
    t2d = model.t2d.to(device)
    attention = pick_attention_impl(cfg.train.attention, device)

    def row_loss(drafter, row):
        return ttt_row_loss(drafter, row, teacher_weight, t2d, cfg, attention)

    return Method(name="eagle3", row_loss=row_loss, drafter_spec=model.spec)


def main(argv=None) -> None:
    cfg, args = parse_run_args(build_arg_parser(__doc__), argv)
    log_run_header("train/eagle3", args.config)
    acc = build_accelerator(cfg)
    train_ds, heldout_ds, aux_ids, target_path, hf_cfg = load_checked_dataset(cfg, acc.device)
    model = build_drafter(cfg, build_drafter_spec(cfg, hf_cfg, target_path, aux_ids, "eagle3"), target_path)
    method = build_method(cfg, model, target_path, acc.device)
    run_training(cfg, acc, model, method, train_ds, heldout_ds)

if __name__ == "__main__":
    run_entry(main)
