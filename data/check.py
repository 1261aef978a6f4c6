"""Check a built dataset independently: recompute the target's `output_hidden_states` with transformers for a
few samples and compare with the stored aux and final hidden states; check token counts against the manifest.
Usage: python data/check.py --config smollm2-demo [--samples N]"""
from __future__ import annotations

import logging

import torch

from draftsmith.data.cli import build_arg_parser, parse_run_args, run_entry
from draftsmith.data.errors import UserError
from draftsmith.data.manifest import read_json
from draftsmith.data.shards import ShardedDataset
from draftsmith.data.target import load_target_model, resolve_target_path

logger = logging.getLogger("draftsmith.data.check")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def check_token_counts(ds_dir, manifest: dict) -> None:
    total = 0
    for split in ("train", "heldout"):
        ds = ShardedDataset(ds_dir, split)
        total += sum(ds.sample_length(i) for i in range(len(ds)))
    if total != manifest["num_tokens"]:
        raise UserError(f"{ds_dir}: shards hold {total} tokens, manifest says {manifest['num_tokens']}")
    logger.info("token count OK: %d tokens in %d shards (checksums verified)", total, len(manifest["shards"]))


def check_hidden_states(model, ds: ShardedDataset, aux_ids: list[int], num_samples: int, tol: float) -> float:
    """Worst relative error over samples and layers; raises past `tol`."""
    worst = 0.0
    h = model.config.get_text_config().hidden_size
    for i in range(min(num_samples, len(ds))):
        s = ds[i]
        with torch.no_grad():
            ref = model(s["input_ids"].long()[None], output_hidden_states=True).hidden_states
        for j, k in enumerate(aux_ids):
            # HF's last entry is after the final norm; aux id N is the pre-norm stream, checked via `final`
            if k < len(ref) - 1:
                worst = max(worst, relative_error(s["aux_hidden_states"][:, j * h:(j + 1) * h], ref[k][0]))
        worst = max(worst, relative_error(s["final_hidden_states"], ref[-1][0]))
    if worst > tol:
        raise UserError(f"stored hidden states differ from transformers' output_hidden_states: worst relative "
                         f"error {worst:.4f} > {tol}")
    return worst


def main(argv=None) -> None:
    parser = build_arg_parser(__doc__)
    parser.add_argument("--samples", type=int, default=8, help="samples recomputed per split")
    parser.add_argument("--tol", type=float, default=0.02, help="max relative error (bf16 storage: ~0.4%%)")
    cfg, args = parse_run_args(parser, argv)
    ds_dir = cfg.dataset_dir()
    manifest = read_json(ds_dir / "manifest.json", "dataset manifest")
    check_token_counts(ds_dir, manifest)
    model = load_target_model(resolve_target_path(cfg.target.name_or_path, cfg.target.revision), "float32")
    for split in ("train", "heldout"):
        worst = check_hidden_states(model, ShardedDataset(ds_dir, split), manifest["aux_layer_ids"], args.samples,
                                    args.tol)
        logger.info("%s: hidden states match transformers (worst relative error %.4f, %s storage)", split, worst,
                    manifest["dtype"])
    print("dataset check passed")


if __name__ == "__main__":
    run_entry(main)
