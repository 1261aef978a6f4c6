"""Build the training set: prompts -> [regenerated responses] -> template + loss mask -> captured hidden
states in shards -> draft vocab. Usage: python data/build.py --config smollm2-demo [key=value ...]"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from draftsmith.data.chat import render_with_loss_mask
from draftsmith.data.cli import (
    build_arg_parser,
    log_run_header,
    parse_run_args,
    run_entry,
    save_resolved_config,
)
from draftsmith.data.config import RunConfig, config_sha256, config_to_dict
from draftsmith.data.errors import UserError
from draftsmith.data.layer_ids import resolve_aux_layer_ids
from draftsmith.data.manifest import (
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    sha256_text,
    target_identity,
)
from draftsmith.data.prompts import build_prompt_splits
from draftsmith.data.shards import FORMAT
from draftsmith.data.target import (
    load_target_config,
    load_target_model,
    load_tokenizer,
    resolve_target_path,
    snapshot_revision,
)
from draftsmith.data.vocab import build_draft_vocab, count_loss_masked_tokens, save_vocab

logger = logging.getLogger("draftsmith.data.build")


def write_jsonl(path: Path, records: list[dict]) -> None:
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode())


def check_existing_dataset(out: Path, identity: dict, aux_ids: list[int]) -> None:
    """A dataset folder built for another target or other aux ids is refused, not silently mixed."""
    path = out / "build.json"
    if not path.is_file():
        return
    prev = read_json(path, "dataset build record")
    for key, want, have in (("target", identity, prev.get("target")), ("aux_layer_ids", aux_ids, prev.get("aux_layer_ids"))):
        if want != have:
            raise UserError(f"{out} was built with {key}={have}, the config now gives {want}; "
                             f"use another output_dir or delete {out}")


def data_recipe_sha256(cfg: RunConfig, identity: dict, aux_ids: list[int]) -> str:
    """Hash of everything that decides a dataset's content: the target, the aux ids and the data section.

    dataset_dir (where it lives) and capture_batch_tokens (how fast it is captured) are left out, so two
    runs sharing one dataset (smollm2-demo, smollm2-peagle) agree.
    """
    data = dataclasses.replace(cfg.data, dataset_dir="", capture_batch_tokens=0)
    return sha256_text(json.dumps({"target": identity, "aux_layer_ids": aux_ids,
                                   "data": config_to_dict(data)}, sort_keys=True))


def finished_with_same_recipe(out: Path, recipe_sha256: str) -> bool:
    """True when out/manifest.json exists (the build finished) and records the same data recipe."""
    path = out / "manifest.json"
    return path.is_file() and read_json(path, "dataset manifest").get("data_recipe_sha256") == recipe_sha256


def tokenize_samples(conversations: list[dict], tokenizer, max_seq_len: int) -> list[dict]:
    samples, too_long, empty = [], 0, 0
    for conv in conversations:
        ids, mask = render_with_loss_mask(tokenizer, conv["messages"])
        if len(ids) > max_seq_len:
            too_long += 1
        elif sum(mask) == 0:
            empty += 1
        else:
            samples.append({"input_ids": ids, "loss_mask": mask})
    logger.info("templated %d samples (dropped %d longer than %d tokens, %d without assistant tokens)",
                len(samples), too_long, max_seq_len, empty)
    return samples


def regenerated_conversations(records, tokenizer, target_path, identity: dict, cfg: RunConfig,
                              out: Path) -> list[dict]:
    """All splits in one call, so the generation engine starts once."""
    if not cfg.data.regenerate.enabled:
        return records
    from draftsmith.data.regenerate import regenerate_responses

    return regenerate_responses(records, tokenizer, target_path, identity, cfg.target.dtype, cfg.data.regenerate,
                                out / "regenerated.jsonl", cfg.data.max_seq_len)


def build_vocab(out: Path, samples: list[dict], vocab_size: int, draft_vocab_size: int) -> None:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += count_loss_masked_tokens(torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), vocab_size)
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    covered = counts[t2d].sum().item() / max(counts.sum().item(), 1)
    logger.info("draft vocab: %d of %d ids, covering %.2f%% of loss-masked tokens", len(d2t), vocab_size, 100 * covered)
    save_vocab(out / "vocab.safetensors", d2t, t2d, counts)


def main(argv=None) -> None:
    cfg, args = parse_run_args(build_arg_parser(__doc__), argv)
    log_run_header("data/build", args.config)
    out = cfg.dataset_dir()
    target_path = resolve_target_path(cfg.target.name_or_path, cfg.target.revision)
    hf_cfg = load_target_config(target_path)
    identity = target_identity(cfg.target.name_or_path, hf_cfg, snapshot_revision(target_path))
    aux_ids = resolve_aux_layer_ids(cfg.target.aux_layer_ids, identity["num_hidden_layers"])
    check_existing_dataset(out, identity, aux_ids)
    recipe = data_recipe_sha256(cfg, identity, aux_ids)
    if finished_with_same_recipe(out, recipe):
        # a second run over a shared dataset must not rewrite its prompts, vocab or manifest
        logger.info("dataset %s is complete and was built with the same data settings: nothing to do", out)
        return
    out.mkdir(parents=True, exist_ok=True)
    save_resolved_config(cfg, cfg.run_dir() / "config.yaml")
    atomic_write_json(out / "build.json", {"target": identity, "aux_layer_ids": aux_ids})
    tokenizer = load_tokenizer(target_path)
    train, heldout = build_prompt_splits(cfg.data.prompts)
    write_jsonl(out / "prompts-train.jsonl", [{"messages": r["messages"]} for r in train])
    write_jsonl(out / "prompts-heldout.jsonl", [{"messages": r["messages"]} for r in heldout])
    convs = regenerated_conversations(train + heldout, tokenizer, target_path, identity, cfg, out)
    samples = {"train": tokenize_samples(convs[: len(train)], tokenizer, cfg.data.max_seq_len),
               "heldout": tokenize_samples(convs[len(train):], tokenizer, cfg.data.max_seq_len)}
    from draftsmith.data.capture import capture_to_shards

    model = load_target_model(target_path, cfg.target.dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    storage = getattr(torch, cfg.data.storage_dtype)
    shards, first = [], 0
    for split in ("train", "heldout"):
        entries = capture_to_shards(model, samples[split], aux_ids, out, split, first, cfg.data.samples_per_shard,
                                    cfg.data.capture_batch_tokens, pad_id, storage)
        shards += entries
        first += len(entries)
    manifest = {
        "format": FORMAT, "target": identity, "aux_layer_ids": aux_ids, "dtype": cfg.data.storage_dtype,
        "num_samples": sum(s["num_samples"] for s in shards), "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards, "chat_template_sha256": sha256_text(tokenizer.chat_template),
        "prompt_source": {"source": cfg.data.prompts.source, "path": cfg.data.prompts.path,
                          "split": cfg.data.prompts.split},
        "regenerate": json.loads(json.dumps(cfg.data.regenerate.__dict__)), "config_sha256": config_sha256(cfg),
        "data_recipe_sha256": recipe,
    }
    build_vocab(out, samples["train"], identity["vocab_size"], cfg.data.draft_vocab_size)
    atomic_write_json(out / "manifest.json", manifest)  # last: its presence means the dataset is complete
    logger.info("dataset %s: %d samples, %d tokens in %d shards", out, manifest["num_samples"],
                manifest["num_tokens"], len(shards))


if __name__ == "__main__":  # vLLM (regeneration) spawns worker processes
    run_entry(main)
