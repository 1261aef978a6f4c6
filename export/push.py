"""Push the exported drafter to the Hugging Face Hub with a model card built from validation.json.

Usage: python export/push.py --config smollm2-demo --repo-id ORG/NAME [--private] [--dry-run]
"""
from __future__ import annotations

import logging
from pathlib import Path

import yaml

from draftsmith.data.cli import build_arg_parser, parse_run_args, run_entry
from draftsmith.data.errors import UserError
from draftsmith.data.manifest import read_json, sha256_file
from draftsmith.export.format import spec_from_drafter_config
from draftsmith.export.hub import model_card, push_folder, stage_upload_folder

logger = logging.getLogger("draftsmith.export.push")


def check_validated_drafter(validation: dict, report: Path, drafter_dir: Path) -> None:
    """The card publishes the report's figures: they must have been measured on these very weights."""
    weights = drafter_dir / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights} not found: export the drafter first (export/speculators.py)")
    validated, actual = validation.get("drafter_weights_sha256"), sha256_file(weights)
    if validated != actual:
        said = f"validated weights with sha256 {validated[:16]}" if validated else "names no validated weights"
        raise UserError(f"{report} {said} ({validation.get('drafter_dir', '?')}), but {weights} has sha256 "
                        f"{actual[:16]}: validate this drafter first (export/validate.py --drafter {drafter_dir})")


def main(argv=None) -> None:
    parser = build_arg_parser(__doc__)
    parser.add_argument("--repo-id", required=True, help="ORG/NAME on the Hub")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--dry-run", action="store_true", help="write the folder that would be uploaded and list it")
    parser.add_argument("--drafter", default=None, help="exported folder (default: <output_dir>/drafter)")
    cfg, args = parse_run_args(parser, argv)
    if args.repo_id.count("/") != 1:
        raise UserError(f"--repo-id {args.repo_id!r} must look like ORG/NAME")
    paths = cfg.paths
    drafter_dir = Path(args.drafter) if args.drafter else paths.drafter
    validation = read_json(paths.validation_json, "validation report (run export/validate.py first)")
    check_validated_drafter(validation, paths.validation_json, drafter_dir)
    spec = spec_from_drafter_config(read_json(drafter_dir / "config.json", "exported drafter config"),
                                    str(drafter_dir / "config.json"))
    train_config = yaml.safe_load(paths.train_config_copy.read_text()) if paths.train_config_copy.is_file() else {}
    # the dataset this run trained on: its own, or another run's (data.dataset_dir)
    manifest = read_json(paths.dataset.manifest) if paths.dataset.manifest.is_file() else {}
    card = model_card(args.repo_id, spec, validation, train_config, manifest)
    staging = paths.hub_staging(args.repo_id)
    files = stage_upload_folder(drafter_dir, staging, card,
                                [paths.validation_json, paths.validation_md, paths.validation_plot,
                                 paths.validation_tpot_plot])
    print(f"{'would upload' if args.dry_run else 'uploading'} {staging} to {args.repo_id}:")
    for f in files:
        print(f"  {f.name:32s} {f.stat().st_size:>12,d} bytes")
    if not args.dry_run:
        print("pushed:", push_folder(staging, args.repo_id, args.private))


if __name__ == "__main__":
    run_entry(main)
