"""Build the training set: prompts -> [regenerated responses] -> template + loss mask -> captured hidden
states in shards -> draft vocab. Usage: python data/build.py --config smollm2-demo [key=value ...];
`accelerate launch --num_processes N data/build.py ...` captures with N processes; --dry-run prints the disk plan."""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from draftsmith.data.chat import prompt_messages, render_generation_prompt, render_with_loss_mask
from draftsmith.data.cli import (
    build_arg_parser,
    log_run_header,
    parse_run_args,
    run_entry,
    save_resolved_config,
)
from draftsmith.data.config import DataConfig, RunConfig, config_sha256, config_to_dict
from draftsmith.data.disk import (
    bytes_per_token,
    describe_disk_plan,
    disk_full_reported,
    planned_tokens,
    require_free_space,
    shard_bytes_on_disk,
)
from draftsmith.data.errors import UserError
from draftsmith.data.faults import kill_point
from draftsmith.data.layer_ids import resolve_aux_layer_ids
from draftsmith.data.lock import dataset_build_lock
from draftsmith.data.manifest import (
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    sha256_text,
    target_identity,
)
from draftsmith.data.processes import BuildProcesses, end_build_processes, start_build_processes, wait_for_all
from draftsmith.data.prompts import build_prompt_splits
from draftsmith.data.run_paths import DatasetPaths
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


def check_existing_dataset(ds: DatasetPaths, identity: dict, aux_ids: list[int]) -> None:
    """A dataset folder built for another target or other aux ids is refused, not silently mixed."""
    out, path = ds.dir, ds.build_record
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
    data = config_to_dict(cfg.data) | {"dataset_dir": "", "capture_batch_tokens": 0}  # the hash datasets carry
    return sha256_text(json.dumps({"target": identity, "aux_layer_ids": aux_ids, "data": data}, sort_keys=True))


def finished_with_same_recipe(ds: DatasetPaths, recipe_sha256: str) -> bool:
    """True when the manifest exists (the build finished) and records the same data recipe."""
    path = ds.manifest
    return path.is_file() and read_json(path, "dataset manifest").get("data_recipe_sha256") == recipe_sha256


def loss_mask_options(data: DataConfig) -> dict[str, bool]:
    """render_with_loss_mask's options. Regeneration rewrites only the last assistant turn; without it every
    turn comes from the dataset alike, so all are trained."""
    if data.loss_on_earlier_turns and not data.regenerate.enabled:
        logger.warning("data.loss_on_earlier_turns has no effect with data.regenerate.enabled=false: every "
                       "assistant turn comes from the dataset and is trained")
    return {"loss_on_earlier_turns": data.loss_on_earlier_turns or not data.regenerate.enabled,
            "loss_on_reasoning": data.loss_on_reasoning}


def tokenize_samples(conversations: list[dict], tokenizer, max_seq_len: int,
                     mask_options: dict[str, bool]) -> list[dict]:
    samples, too_long, empty = [], 0, 0
    for conv in conversations:
        ids, mask = render_with_loss_mask(tokenizer, conv["messages"], conv.get("tools"), **mask_options)
        if len(ids) > max_seq_len:
            too_long += 1
        elif sum(mask) == 0:
            empty += 1
        else:
            samples.append({"input_ids": ids, "loss_mask": mask})
    logger.info("templated %d samples (dropped %d longer than %d tokens, %d without assistant tokens)",
                len(samples), too_long, max_seq_len, empty)
    return samples


def prompts_inside_window(records: list[dict], tokenizer, max_seq_len: int, split: str) -> list[dict]:
    """The records whose generation prompt leaves the engine (window data.max_seq_len) room for one new token;
    the others are skipped with a count."""
    kept = [r for r in records if len(render_generation_prompt(tokenizer, prompt_messages(r["messages"]),
                                                               r.get("tools"))) < max_seq_len]
    if len(kept) < len(records):
        logger.warning("%s: skipped %d of %d prompts that fill the engine's window of data.max_seq_len=%d tokens "
                       "before generating anything", split, len(records) - len(kept), len(records), max_seq_len)
    if records and not kept:
        raise UserError(f"every {split} prompt is longer than data.max_seq_len={max_seq_len} tokens: raise it")
    return kept


def regenerated_conversations(records, tokenizer, target_path, identity: dict, cfg: RunConfig,
                              ds: DatasetPaths) -> list[dict]:
    """All splits in one call, so the generation engine starts once."""
    if not cfg.data.regenerate.enabled:
        return records
    from draftsmith.data.regenerate import regenerate_responses

    return regenerate_responses(records, tokenizer, target_path, identity, cfg.target.dtype, cfg.data.regenerate,
                                ds.regenerated, cfg.data.max_seq_len, cfg.target.device_map)


def build_vocab(ds: DatasetPaths, samples: list[dict], vocab_size: int, draft_vocab_size: int) -> None:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += count_loss_masked_tokens(torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), vocab_size)
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    covered = counts[t2d].sum().item() / max(counts.sum().item(), 1)
    logger.info("draft vocab: %d of %d ids, covering %.2f%% of loss-masked tokens", len(d2t), vocab_size, 100 * covered)
    save_vocab(ds.vocab, d2t, t2d, counts)


def template_splits(convs: list[dict], num_train: int, tokenizer, data: DataConfig) -> dict[str, list[dict]]:
    options = loss_mask_options(data)
    return {"train": tokenize_samples(convs[:num_train], tokenizer, data.max_seq_len, options),
            "heldout": tokenize_samples(convs[num_train:], tokenizer, data.max_seq_len, options)}


def prompt_line(record: dict) -> dict:
    """A prompts-*.jsonl line: the turns, and the tools the record offers (validation renders both)."""
    return {"messages": record["messages"], **({"tools": record["tools"]} if record.get("tools") else {})}


def write_build_inputs(cfg: RunConfig, identity: dict, aux_ids: list[int], train: list[dict],
                       heldout: list[dict]) -> None:
    """What the folder is built from: the resolved config, the target and aux ids, the prompts."""
    ds = cfg.paths.dataset
    ds.dir.mkdir(parents=True, exist_ok=True)
    save_resolved_config(cfg, cfg.paths.config_copy)
    atomic_write_json(ds.build_record, {"target": identity, "aux_layer_ids": aux_ids})
    write_jsonl(ds.prompts("train"), [prompt_line(r) for r in train])
    write_jsonl(ds.prompts("heldout"), [prompt_line(r) for r in heldout])


def write_manifest(ds: DatasetPaths, cfg: RunConfig, identity: dict, aux_ids: list[int], recipe: str, chat_template: str,
                   shards: list[dict]) -> None:
    manifest = {
        "format": FORMAT, "target": identity, "aux_layer_ids": aux_ids, "dtype": cfg.data.storage_dtype,
        "capture": cfg.data.capture,
        "num_samples": sum(s["num_samples"] for s in shards), "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards, "chat_template_sha256": sha256_text(chat_template),
        "prompt_source": {"source": cfg.data.prompts.source, "path": cfg.data.prompts.path,
                          "split": cfg.data.prompts.split},
        "regenerate": json.loads(json.dumps(cfg.data.regenerate.__dict__)), "config_sha256": config_sha256(cfg),
        "data_recipe_sha256": recipe,
    }
    atomic_write_json(ds.manifest, manifest)  # last: its presence means the dataset is complete
    logger.info("dataset %s: %d samples, %d tokens in %d shards", ds.dir, manifest["num_samples"],
                manifest["num_tokens"], len(shards))


def build_dataset(cfg: RunConfig, procs: BuildProcesses, dry_run: bool) -> None:
    """Every process plans the same samples and shards and captures its share; the main process holds the folder's
    lock, writes the folder, regenerates the responses (the others wait, then read them) and writes the vocab and
    manifest. A complete dataset is only read: runs that find it so return without the lock, so two chains that
    share one (a resubmitted Slurm chain, say) never refuse each other."""
    ds = cfg.paths.dataset
    out = ds.dir
    target_path = resolve_target_path(cfg.target.name_or_path, cfg.target.revision)
    identity = target_identity(cfg.target.name_or_path, load_target_config(target_path),
                               snapshot_revision(target_path))
    aux_ids = resolve_aux_layer_ids(cfg.target.aux_layer_ids, identity["num_hidden_layers"])
    check_existing_dataset(ds, identity, aux_ids)
    recipe = data_recipe_sha256(cfg, identity, aux_ids)
    if finished_with_same_recipe(ds, recipe):
        # a second run over a shared dataset must not rewrite its prompts, vocab or manifest
        logger.info("dataset %s is complete and was built with the same data settings: nothing to do", out)
        return
    # one writer per folder: the main process holds its lock (the others write only their shards)
    holds_lock = procs.is_main and not dry_run
    with dataset_build_lock(ds.build_lock) if holds_lock else contextlib.nullcontext():
        write_dataset(cfg, procs, dry_run, target_path, identity, aux_ids, recipe)


def write_dataset(cfg: RunConfig, procs: BuildProcesses, dry_run: bool, target_path: str, identity: dict,
                  aux_ids: list[int], recipe: str) -> None:
    """Template (or regenerate) the prompts, capture every process's shards, then the vocab and the manifest."""
    ds = cfg.paths.dataset
    out = ds.dir
    tokenizer = load_tokenizer(target_path)
    train, heldout = build_prompt_splits(cfg.data.prompts)
    if cfg.data.regenerate.enabled:  # the engine refuses such a prompt and would abort the whole batch
        train, heldout = (prompts_inside_window(split, tokenizer, cfg.data.max_seq_len, name)
                          for split, name in ((train, "train"), (heldout, "heldout")))
    records = train + heldout
    samples = None if cfg.data.regenerate.enabled else template_splits(records, len(train), tokenizer, cfg.data)
    tokens = planned_tokens(records, samples, tokenizer, cfg.data)
    # online datasets store no hidden states: ids and masks only
    per_token = bytes_per_token(len(aux_ids), identity["hidden_size"] if cfg.data.capture == "offline" else 0,
                                cfg.data.storage_dtype)
    if dry_run:
        print(describe_disk_plan(out, tokens, per_token, samples is None))
        return
    require_free_space(out, tokens * per_token)
    with disk_full_reported(out, tokens * per_token - shard_bytes_on_disk(out), "the dataset"):
        if procs.is_main:
            write_build_inputs(cfg, identity, aux_ids, train, heldout)
            convs = regenerated_conversations(records, tokenizer, target_path, identity, cfg, ds)
        wait_for_all(procs)  # the folder is written and every response generated
        if not procs.is_main:  # reads the main process's responses back: nothing is left to generate
            convs = regenerated_conversations(records, tokenizer, target_path, identity, cfg, ds)
        if samples is None:
            samples = template_splits(convs, len(train), tokenizer, cfg.data)
        from draftsmith.data.capture import capture_splits, planned_shard_entries

        online = cfg.data.capture == "online"
        model = None if online else load_target_model(target_path, cfg.target.dtype, cfg.target.device_map)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        capture_splits(model, samples, aux_ids, out, cfg.data.samples_per_shard, cfg.data.capture_batch_tokens, pad_id,
                       getattr(torch, cfg.data.storage_dtype), procs.rank, procs.world_size)
        wait_for_all(procs)  # every shard and its sidecar are written
        if procs.is_main:
            kill_point("before_manifest")
            build_vocab(ds, samples["train"], identity["vocab_size"], cfg.data.draft_vocab_size)
            write_manifest(ds, cfg, identity, aux_ids, recipe, tokenizer.chat_template,
                           planned_shard_entries(out, samples, cfg.data.samples_per_shard, tokens_only=online))


def main(argv=None) -> None:
    parser = build_arg_parser(__doc__)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the dataset's estimated size on disk and the free space there, then exit")
    cfg, args = parse_run_args(parser, argv)
    log_run_header("data/build", args.config)
    procs = start_build_processes(cfg.target.device_map)
    try:
        build_dataset(cfg, procs, args.dry_run)
    finally:
        end_build_processes(procs)


if __name__ == "__main__":  # vLLM (regeneration) spawns worker processes
    run_entry(main)
