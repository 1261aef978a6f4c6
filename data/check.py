"""Check a built dataset independently: recompute the target's `output_hidden_states` with transformers for a
few samples and compare with the stored aux and final hidden states; check token counts against the manifest.
Usage: python data/check.py --config smollm2-demo [--samples N]"""
from __future__ import annotations

import logging

import torch

from draftsmith.data.capture import decoder_of, input_device
from draftsmith.data.cli import build_arg_parser, parse_run_args, run_entry
from draftsmith.data.errors import UserError
from draftsmith.data.manifest import read_json
from draftsmith.data.shards import ShardedDataset
from draftsmith.data.target import load_target_model, resolve_target_path

logger = logging.getLogger("draftsmith.data.check")

# Worst relative error (norm-wise, per sample and layer) allowed between the stored states and a fresh forward in
# target.dtype: bf16 storage rounding alone gives ~0.3%; a 16-bit forward adds its own rounding, which differs
# between the padded batches of capture and the single sequences here and grows with depth.
TOLERANCE = {"float32": 0.02, "float16": 0.03, "bfloat16": 0.05}


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


def reference_hidden_states(model, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A fresh forward: (the residual stream after k layers for k = 0..N, the final hidden state after the norm).

    HF's `output_hidden_states[-1]` is already after the final norm, so the stream after all N layers (aux id N,
    as vLLM takes it) is read at the final norm's input."""
    taken = {}
    norm = decoder_of(model).norm
    handle = norm.register_forward_hook(lambda _m, inputs, output: taken.update(pre=inputs[0], post=output))
    try:
        with torch.no_grad():
            out = model(input_ids, output_hidden_states=True)
    finally:
        handle.remove()
    streams = [state[0].cpu() for state in out.hidden_states[:-1]] + [taken["pre"][0].cpu()]
    return streams, taken["post"][0].cpu()


def check_hidden_states(model, ds: ShardedDataset, aux_ids: list[int], num_samples: int, tol: float) -> float:
    """Worst relative error over samples, aux layers (id N included) and the final state; raises past `tol`."""
    worst = 0.0
    h = model.config.get_text_config().hidden_size
    for i in range(min(num_samples, len(ds))):
        s = ds[i]
        streams, final = reference_hidden_states(model, s["input_ids"].long()[None].to(input_device(model)))
        for j, k in enumerate(aux_ids):
            worst = max(worst, relative_error(s["aux_hidden_states"][:, j * h:(j + 1) * h], streams[k]))
        worst = max(worst, relative_error(s["final_hidden_states"], final))
    if worst > tol:
        raise UserError(f"stored hidden states differ from transformers' output_hidden_states: worst relative "
                         f"error {worst:.4f} > {tol}")
    return worst


def main(argv=None) -> None:
    parser = build_arg_parser(__doc__)
    parser.add_argument("--samples", type=int, default=8, help="samples recomputed per split")
    parser.add_argument("--tol", type=float, default=None,
                        help="max relative error; default by target.dtype: " +
                             ", ".join(f"{k} {v}" for k, v in TOLERANCE.items()))
    cfg, args = parse_run_args(parser, argv)
    ds_dir = cfg.paths.dataset.dir
    manifest = read_json(cfg.paths.dataset.manifest, "dataset manifest")
    check_token_counts(ds_dir, manifest)
    if manifest.get("capture", "offline") == "online":
        # training computes the hidden states itself (tests/train/test_online.py checks them against capture)
        print("dataset check passed (data.capture online: tokens only, no stored hidden states to compare)")
        return
    # the target as capture ran it: target.dtype, on a GPU when there is one, placed by target.device_map
    model = load_target_model(resolve_target_path(cfg.target.name_or_path, cfg.target.revision), cfg.target.dtype,
                              cfg.target.device_map)
    tol = args.tol if args.tol is not None else TOLERANCE[cfg.target.dtype]
    for split in ("train", "heldout"):
        worst = check_hidden_states(model, ShardedDataset(ds_dir, split), manifest["aux_layer_ids"], args.samples,
                                    tol)
        logger.info("%s: hidden states match transformers in %s on %s (worst relative error %.4f <= %s, %s storage)",
                    split, cfg.target.dtype, input_device(model), worst, tol, manifest["dtype"])
    print("dataset check passed")


if __name__ == "__main__":
    run_entry(main)
