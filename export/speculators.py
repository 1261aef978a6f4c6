"""Export the trained drafter as a folder vLLM loads (speculators format, or --format legacy).

Usage: python export/speculators.py --config smollm2-demo [--format legacy] [--out DIR] [--checkpoint DIR]
"""
from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.data.cli import build_arg_parser, log_run_header, parse_run_args, run_entry
from draftsmith.export.write import write_drafter_folder
from draftsmith.train.checkpoint import load_drafter_bundle

logger = logging.getLogger("draftsmith.export.speculators")


def main(argv=None) -> None:
    parser = build_arg_parser(__doc__)
    parser.add_argument("--format", choices=("speculators", "legacy"), default=None,
                        help="checkpoint layout (default: export.format of the config)")
    parser.add_argument("--out", default=None, help="output folder (default: <output_dir>/drafter)")
    parser.add_argument("--checkpoint", default=None, help="drafter bundle (default: <output_dir>/train/best)")
    cfg, args = parse_run_args(parser, argv)
    log_run_header("export/speculators", args.config)
    bundle = Path(args.checkpoint) if args.checkpoint else cfg.paths.best
    state_dict, spec, progress = load_drafter_bundle(bundle)
    fmt = args.format or cfg.export.format
    out = Path(args.out) if args.out else cfg.paths.drafter
    step = progress.get("step")
    write_drafter_folder(state_dict, spec, out, fmt, cfg.export.dtype, cfg.export.num_speculative_tokens[0])
    print(f"exported {spec.method} drafter (training step {step}) in {fmt} format to {out}")


if __name__ == "__main__":
    run_entry(main)
