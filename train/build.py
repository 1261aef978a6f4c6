"""Builders the trainers share: the checked dataset, the frozen teacher head, the drafter and its export spec.

The dataset is checked against the run config (target identity, aux ids, hidden size) before anything
expensive is loaded; a mismatch names both values.
"""
from __future__ import annotations

import logging

import torch

from draftsmith.data.config import RunConfig
from draftsmith.data.errors import UserError
from draftsmith.data.layer_ids import resolve_aux_layer_ids
from draftsmith.data.manifest import read_json, target_identity
from draftsmith.data.shards import ShardedDataset
from draftsmith.data.target import (
    is_hub_id,
    load_target_config,
    load_target_head,
    load_target_model,
    resolve_target_head_path,
    resolve_target_path,
)
from draftsmith.data.vocab import load_vocab
from draftsmith.train.checkpoint import latest_checkpoint
from draftsmith.train.drafter import Drafter, init_drafter_from_target, init_head_from_target
from draftsmith.train.spec import DrafterSpec, spec_for_target
from draftsmith.train.warm_start import init_drafter_from_exported

logger = logging.getLogger(__name__)


def check_dataset_matches(cfg: RunConfig, manifest: dict, identity: dict, where: str) -> list[int]:
    """Refuse a dataset made for another target, other aux ids or another hidden size; returns the aux ids."""
    stored = manifest["target"]
    for key in ("config_sha256", "num_hidden_layers", "hidden_size", "vocab_size"):
        if stored.get(key) != identity[key]:
            raise UserError(f"{where}: dataset target {key}={stored.get(key)!r} but the config's target "
                             f"'{cfg.target.name_or_path}' has {key}={identity[key]!r}; rebuild the dataset")
    want = resolve_aux_layer_ids(cfg.target.aux_layer_ids, identity["num_hidden_layers"])
    if manifest["aux_layer_ids"] != want:
        raise UserError(f"{where}: dataset aux_layer_ids={manifest['aux_layer_ids']} but the config gives "
                         f"target.aux_layer_ids={want}; rebuild the dataset or set target.aux_layer_ids")
    return want


def load_checked_dataset(cfg: RunConfig, device="cpu"):
    """-> (train ShardedDataset, held-out ShardedDataset, aux ids, target path, target HF config).

    A tokens-only dataset (data.capture online) comes back wrapped so that reading a row runs the frozen target,
    loaded here on `device` in target.dtype.
    """
    ds_dir = cfg.paths.dataset.dir
    manifest = read_json(cfg.paths.dataset.manifest, "dataset manifest (run data/build.py first)")
    target_path = resolve_target_head_path(cfg.target.name_or_path, cfg.target.revision)
    hf_cfg = load_target_config(target_path)
    aux_ids = check_dataset_matches(cfg, manifest, target_identity(cfg.target.name_or_path, hf_cfg),
                                    str(cfg.paths.dataset.manifest))
    train_ds, heldout_ds = ShardedDataset(ds_dir, "train"), ShardedDataset(ds_dir, "heldout")
    if len(train_ds) == 0:
        raise UserError(f"{ds_dir}: the train split is empty")
    if manifest.get("capture", "offline") == "online":
        from draftsmith.train.online import online_datasets

        full = resolve_target_path(cfg.target.name_or_path, cfg.target.revision)  # every weight, not the head only
        target = load_target_model(full, cfg.target.dtype, cfg.target.device_map, device=device)
        train_ds, heldout_ds = online_datasets(train_ds, heldout_ds, target, aux_ids, cfg.data.capture_batch_tokens)
    return train_ds, heldout_ds, aux_ids, target_path, hf_cfg


def build_drafter_spec(cfg: RunConfig, hf_cfg, target_path: str, aux_ids: list[int], method: str,
                       mask_token_id: int | None = None) -> DrafterSpec:
    """The run's drafter: one layer of the target's shape, the run's drafter.* switches, the dataset's vocab."""
    d2t, _ = load_vocab(cfg.paths.dataset.vocab)
    # vLLM resolves a Hub id itself; a folder or the embedded target is named by its path
    verifier = cfg.target.name_or_path if is_hub_id(cfg.target.name_or_path) else str(target_path)
    return spec_for_target(hf_cfg, cfg.drafter, method=method, aux_layer_ids=aux_ids, draft_vocab_size=len(d2t),
                           mask_token_id=mask_token_id, verifier_name_or_path=verifier)


def build_drafter(cfg: RunConfig, spec: DrafterSpec, target_path: str) -> Drafter:
    """A fresh drafter of `spec`: the target's embeddings, the dataset's vocab maps, or train.init_from's weights."""
    d2t, t2d = load_vocab(cfg.paths.dataset.vocab)
    torch.manual_seed(cfg.train.seed)
    drafter = Drafter(spec)
    head = load_target_head(target_path)
    init_drafter_from_target(drafter, head["embed"].float(), d2t, t2d)
    if cfg.train.lm_head_init == "target":
        init_head_from_target(drafter, head["lm_head"].float(), head["norm"].float())
    if cfg.train.init_from and latest_checkpoint(cfg.paths.checkpoints) is None:
        # a resumed run restores its own weights: the source may be gone by then and is not read
        init_drafter_from_exported(drafter, cfg.train.init_from)
    drafter.lm_head.weight.requires_grad_(not cfg.train.freeze_lm_head)
    n_train = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    logger.info("drafter: %d layer(s), H=%d, V_d=%d, %.1fM trainable parameters", spec.num_hidden_layers,
                spec.hidden_size, spec.draft_vocab_size, n_train / 1e6)
    return drafter


def load_teacher_head(target_path: str) -> torch.Tensor:
    """The target's lm_head [V_t, H_t] in fp32, frozen (final hidden states are stored after the final norm)."""
    return load_target_head(target_path)["lm_head"].float().requires_grad_(False)
