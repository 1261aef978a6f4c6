"""Train a P-EAGLE (parallel drafting) drafter on a data/build.py dataset (DESIGN section 5).

Usage: accelerate launch train/peagle.py --config smollm2-peagle [key=value ...]   (or plain python)
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from draftsmith.data.cli import build_arg_parser, log_run_header, parse_run_args, run_entry
from draftsmith.data.config import RunConfig
from draftsmith.data.errors import UserError
from draftsmith.data.shards import read_tensor
from draftsmith.train.build import build_drafter, build_drafter_spec, load_checked_dataset, load_teacher_head
from draftsmith.train.distributed import build_accelerator
from draftsmith.train.loop import Method, run_training
from draftsmith.train.packing import row_noise, with_training_loss_mask
from draftsmith.train.parallel import (
    ParallelSetup,
    all_chain_elements,
    cod_sample,
    parallel_loss,
    shift_parallel_row,
)
from draftsmith.train.ttt import pick_attention_impl

logger = logging.getLogger("draftsmith.train.peagle")


def dataset_token_counts(datasets, vocab_size: int) -> torch.Tensor:
    """[V_t] occurrences of each id in every shard's input_ids (reads the ids only, not the hidden states)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ds in datasets:
        for entry in ds.shards:
            input_ids = read_tensor(ds.dir / entry["file"], "input_ids")
            counts += torch.bincount(input_ids.long(), minlength=vocab_size)[:vocab_size]
    return counts


def pick_mask_token_id(token_counts: torch.Tensor, tokenizer_mask_id, special_ids) -> tuple[int, str]:
    """The id fed to every mask slot, and why. In order: the tokenizer's own mask token; the highest-id
    special token the dataset never contains (SmolLM2: 16 '<empty_output>'); the highest id the dataset never
    contains (embedding rows past the tokenizer's length come first); else the last id, with a warning.

    P-EAGLE trains embed_tokens, so the mask id must be one the drafter never reads as a real token.
    """
    V = token_counts.numel()
    if tokenizer_mask_id is not None and 0 <= tokenizer_mask_id < V:
        return int(tokenizer_mask_id), "the tokenizer's mask token"
    unused = token_counts == 0
    for i in sorted({i for i in special_ids if 0 <= i < V}, reverse=True):
        if unused[i]:
            return i, "the highest-id special token absent from the dataset"
    if unused.any():
        return int(unused.nonzero()[-1]), "the highest token id absent from the dataset"
    logger.warning("every token id occurs in the dataset; mask slots reuse id %d", V - 1)
    return V - 1, "the last id (every id occurs in the dataset)"


def choose_mask_token_id(target_path: str, datasets, vocab_size: int) -> int:
    """pick_mask_token_id from the target's tokenizer (when its folder has one) and the dataset's counts."""
    tokenizer, special_ids = None, []
    if any((Path(target_path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_path)
        special_ids = list(tokenizer.all_special_ids)
        special_ids += [i for i, t in tokenizer.added_tokens_decoder.items() if t.special]
    token_id, why = pick_mask_token_id(dataset_token_counts(datasets, vocab_size),
                                       getattr(tokenizer, "mask_token_id", None), special_ids)
    logger.info("mask_token_id = %d (%s)", token_id, why)
    return token_id


def peagle_row_loss(model, row: dict, teacher_weight, t2d, cfg: RunConfig, setup: ParallelSetup):
    """Loss and per-depth metrics of one packed row: COD-sampled elements in training, every chain in
    evaluation. COD and noise draw from the row's seed, so any process (and a resumed run) draws the same."""
    row = with_training_loss_mask(row, cfg.train.loss_tokens, model.training)
    shifted = shift_parallel_row(row, teacher_weight, t2d, cfg.train.teacher, cfg.train.teacher_temperature)
    if model.training and cfg.train.hidden_noise_std > 0:
        noise = cfg.train.hidden_noise_std * row_noise(shifted.aux_hidden, row["row_seed"], stream=1)
        shifted.aux_hidden = shifted.aux_hidden + noise
    mask, docs, p = shifted.loss_mask.cpu(), shifted.document_ids.cpu(), cfg.peagle
    if not model.training:
        anchor, depth = all_chain_elements(mask, docs, p.num_depths)
    else:
        generator = torch.Generator().manual_seed(row["row_seed"])
        anchor, depth = cod_sample(mask, docs, p.num_depths, p.down_sample_ratio, p.down_sample_ratio_min,
                                   p.max_anchors, generator)
    return parallel_loss(model, shifted, anchor, depth, setup)


def build_method(cfg: RunConfig, model, target_path, device) -> Method:
    teacher_weight = load_teacher_head(target_path).to(device)
    t2d = model.t2d.to(device)
    setup = ParallelSetup(mask_token_id=model.spec.mask_token_id, num_depths=cfg.peagle.num_depths,
                          partition_elements=cfg.peagle.partition_elements, loss_weighting=cfg.peagle.loss_weighting,
                          attention_impl=pick_attention_impl(cfg.train.attention, device))

    def row_loss(drafter, row):
        return peagle_row_loss(drafter, row, teacher_weight, t2d, cfg, setup)

    return Method(name="peagle", row_loss=row_loss, drafter_spec=model.spec)


def check_peagle_config(cfg: RunConfig) -> None:
    """The drafter must be trained for at least as many depths as any K served (DESIGN section 5)."""
    k_max = max(cfg.export.num_speculative_tokens)
    if cfg.peagle.num_depths < max(k_max, 2):
        raise UserError(f"peagle.num_depths={cfg.peagle.num_depths} must be >= 2 and >= the largest "
                         f"export.num_speculative_tokens ({k_max}); raise peagle.num_depths")


def main(argv=None) -> None:
    cfg, args = parse_run_args(build_arg_parser(__doc__), argv)
    log_run_header("train/peagle", args.config)
    check_peagle_config(cfg)
    acc = build_accelerator(cfg)
    train_ds, heldout_ds, aux_ids, target_path, hf_cfg = load_checked_dataset(cfg, acc.device)
    mask_token_id = choose_mask_token_id(target_path, [train_ds, heldout_ds], hf_cfg.get_text_config().vocab_size)
    spec = build_drafter_spec(cfg, hf_cfg, target_path, aux_ids, "peagle", mask_token_id=mask_token_id)
    model = build_drafter(cfg, spec, target_path)
    method = build_method(cfg, model, target_path, acc.device)
    run_training(cfg, acc, model, method, train_ds, heldout_ds)

if __name__ == "__main__":
    run_entry(main)
