"""Prompt sources (the built-in coding prompts, local JSONL, `datasets`), dedup, filters and the held-out split.

The demo prompt set is built deterministically from the Python standard library's public functions,
their signatures and the first line of their docstrings; the split is by function, so held-out prompts
ask about functions the drafter never saw in training.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import subprocess
import sys
from pathlib import Path

from draftsmith.data.chat import normalize_conversation
from draftsmith.data.config import PromptsConfig
from draftsmith.data.errors import UserError

logger = logging.getLogger(__name__)

DEMO_MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "colorsys", "copy", "csv", "datetime", "difflib",
    "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html", "itertools", "json",
    "math", "operator", "os", "os.path", "pathlib", "pprint", "random", "re", "shlex", "shutil", "statistics",
    "string", "struct", "textwrap", "time", "unicodedata", "urllib.parse", "uuid", "zlib",
)
DEMO_TEMPLATES = (
    "Explain what `{qual}{sig}` does in Python and show a short example of using it.",
    "Write a small Python function that uses `{qual}` to solve a practical task. The documentation says: "
    "\"{doc}\". Include a docstring and a usage example.",
    "I am reading code that calls `{qual}{sig}`. What are its parameters, what does it return, and what "
    "is a common mistake when using it?",
)


def _public_functions(module_name: str):
    module = importlib.import_module(module_name)
    for name in sorted(dir(module)):
        obj = getattr(module, name)
        if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
            continue
        doc = (inspect.getdoc(obj) or "").strip().splitlines()
        try:
            sig = str(inspect.signature(obj))
        except (TypeError, ValueError):
            continue
        # a default shown as "<object object at 0x...>" differs between processes: skip it
        if doc and len(sig) < 120 and " at 0x" not in sig:
            yield f"{module_name}.{name}", sig, doc[0].strip()


def demo_prompt_records() -> list[dict]:
    """The demo prompts, built in a fresh interpreter: libraries imported here (torch, vLLM, ...) patch some
    stdlib functions, which would change signatures and so the prompt set from one process to the next."""
    code = "import json; from draftsmith.data.prompts import stdlib_prompt_records as f; print(json.dumps(f()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def stdlib_prompt_records() -> list[dict]:
    """One record per (function, template), with a `group` key (the function) for the split."""
    records = []
    for module_name in DEMO_MODULES:
        for qual, sig, doc in _public_functions(module_name):
            for template in DEMO_TEMPLATES:
                text = template.format(qual=qual, sig=sig, doc=doc.replace('"', "'"))
                records.append({"messages": [{"role": "user", "content": text}], "group": qual})
    return records


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist (data.prompts.path)")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({e})") from None
    return records


def _read_hf_dataset(cfg: PromptsConfig) -> list[dict]:
    import datasets

    if Path(cfg.path).exists() and Path(cfg.path, "dataset_info.json").exists():
        ds = datasets.load_from_disk(cfg.path)
        ds = ds[cfg.split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        ds = datasets.load_dataset(cfg.path, split=cfg.split)
    return [dict(r) for r in ds]


def load_prompt_records(cfg: PromptsConfig) -> list[dict]:
    """Raw records from the configured source, each normalised to {"messages": [...], "group": str}."""
    if cfg.source == "demo":
        raw = demo_prompt_records()
    elif cfg.source == "jsonl":
        raw = _read_jsonl(Path(cfg.path))
    else:
        raw = _read_hf_dataset(cfg)
    out = []
    for i, rec in enumerate(raw):
        try:
            messages = rec["messages"] if cfg.source == "demo" else normalize_conversation(rec, cfg.conversations_column)
        except ValueError as e:
            raise UserError(f"prompt record {i} of {cfg.source}:{cfg.path or 'demo'}: {e}") from None
        first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
        out.append({"messages": messages, "group": rec.get("group") or first_user})
    return out


def filter_and_dedup(records: list[dict], cfg: PromptsConfig) -> list[dict]:
    """Drop conversations without a user turn, out-of-range prompt lengths and exact duplicates."""
    seen, kept = set(), []
    for rec in records:
        users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
        if not users or not cfg.min_prompt_chars <= len(users[0]) <= cfg.max_prompt_chars:
            continue
        key = hashlib.sha256(json.dumps(rec["messages"], sort_keys=True).encode()).hexdigest()
        if key not in seen:
            seen.add(key)
            kept.append(rec)
    if cfg.max_prompts:
        kept = sorted(kept, key=lambda r: _stable_hash(json.dumps(r["messages"])))[: cfg.max_prompts]
    return kept


def _stable_hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def split_train_heldout(records: list[dict], heldout_fraction: float) -> tuple[list[dict], list[dict]]:
    """Deterministic split by group (e.g. the stdlib function), so held-out groups are unseen in training."""
    train, heldout = [], []
    for rec in records:
        bucket = _stable_hash(rec["group"]) % 10_000
        (heldout if bucket < heldout_fraction * 10_000 else train).append(rec)
    if not heldout and records and heldout_fraction > 0:
        heldout.append(train.pop())
    return train, heldout


def build_prompt_splits(cfg: PromptsConfig) -> tuple[list[dict], list[dict]]:
    records = filter_and_dedup(load_prompt_records(cfg), cfg)
    if not records:
        raise UserError(f"no prompts left from source '{cfg.source}' after filters; check data.prompts settings")
    train, heldout = split_train_heldout(records, cfg.heldout_fraction)
    logger.info("prompts: %d train, %d held-out (source=%s)", len(train), len(heldout), cfg.source)
    return train, heldout
