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

from draftsmith.data.chat import normalize_conversation, normalize_tools
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
    ("Write a small Python function that uses `{qual}` to solve a practical task. The documentation says: "
     "\"{doc}\". Include a docstring and a usage example."),
    ("I am reading code that calls `{qual}{sig}`. What are its parameters, what does it return, and what "
     "is a common mistake when using it?"),
)


def public_functions(module_name: str, max_signature_chars: int = 120):
    """(qualified name, signature, first docstring line) of a stdlib module's documented public functions."""
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
        if doc and len(sig) < max_signature_chars and " at 0x" not in sig:
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
        for qual, sig, doc in public_functions(module_name):
            for template in DEMO_TEMPLATES:
                text = template.format(qual=qual, sig=sig, doc=doc.replace('"', "'"))
                records.append({"messages": [{"role": "user", "content": text}], "group": qual})
    return records


def _read_jsonl(path: Path) -> list[tuple[str, object]]:
    """(file:line, parsed record) per non-empty line; a line that is not JSON refuses the file (it is broken)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist (data.prompts.path)")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append((f"{path}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({e})") from None
    return records


def _read_hf_dataset(cfg: PromptsConfig) -> list[dict]:
    """A `save_to_disk` folder (Dataset or DatasetDict), a local folder or file `load_dataset` reads, or a Hub
    dataset id: its files for the split come through the local HF cache (HF_HUB_OFFLINE=1 reads only the cache),
    like a Hub-id target, and `load_dataset` then reads that snapshot folder."""
    import datasets

    path = Path(cfg.path)
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise UserError(f"data.prompts.split '{cfg.split}' is not in {path} (splits: {sorted(ds)})")
            ds = ds[cfg.split]
    else:
        if path.exists():
            source = str(path)
        else:
            from draftsmith.data.target import hub_snapshot

            # the split's data files (named <split>-NNNNN-of-NNNNN or <split>.<ext> by the Hub's conventions)
            # and the README whose YAML header may declare the splits
            patterns = ["README.md", f"*{cfg.split}-*", f"*{cfg.split}.*", f"*/{cfg.split}/*"]
            source = hub_snapshot(cfg.path, "", patterns, repo_type="dataset")
        try:
            ds = datasets.load_dataset(source, split=cfg.split)
        except ValueError as e:  # an unknown split names the ones that exist
            raise UserError(f"data.prompts: {cfg.path}: {e}") from None
    return [dict(r) for r in ds]


def load_prompt_records(cfg: PromptsConfig) -> list[dict]:
    """Raw records from the configured source, each normalised to {"messages": [...], "tools": [...], "group": str}
    (tools: the record's function schemas, [] when it has none).

    The rule for bad input: a line that is not JSON refuses the whole file; a record that is JSON but not a
    conversation (no turns, a turn without role or content, an unknown role, non-string content, bad tools) is
    skipped and reported with its file and line (or record index); a source whose every record is bad is refused.
    """
    if cfg.source == "demo":
        raw = [(f"demo record {i}", r) for i, r in enumerate(demo_prompt_records())]
    elif cfg.source == "jsonl":
        raw = _read_jsonl(Path(cfg.path))
    else:
        raw = [(f"{cfg.path} record {i}", r) for i, r in enumerate(_read_hf_dataset(cfg))]
    out, skipped = [], []
    for where, rec in raw:
        try:
            if not isinstance(rec, dict):
                raise UserError(f"a record must be a JSON object, got {type(rec).__name__}")
            messages = rec["messages"] if cfg.source == "demo" else normalize_conversation(rec, cfg.conversations_column)
            tools = normalize_tools(rec)
        except ValueError as e:
            skipped.append(f"{where}: {e}")
            continue
        first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
        out.append({"messages": messages, "tools": tools, "group": rec.get("group") or first_user})
    if skipped and not out:
        raise UserError(f"no usable prompt record in {cfg.source}:{cfg.path or 'demo'} ({len(skipped)} malformed); "
                        f"first: {skipped[0]}")
    for line in skipped[:10]:
        logger.warning("skipped malformed prompt record %s", line)
    if skipped:
        logger.warning("skipped %d malformed prompt record(s) of %d%s", len(skipped), len(raw),
                       " (the first 10 are listed above)" if len(skipped) > 10 else "")
    return out


def filter_and_dedup(records: list[dict], cfg: PromptsConfig) -> list[dict]:
    """Drop conversations without a user turn, out-of-range prompt lengths and exact duplicates."""
    seen, kept, no_user, out_of_range = set(), [], 0, 0
    for rec in records:
        users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
        if not users:
            no_user += 1
            continue
        if not cfg.min_prompt_chars <= len(users[0]) <= cfg.max_prompt_chars:
            out_of_range += 1
            continue
        # the same turns offered other tools are another prompt
        key = hashlib.sha256(json.dumps([rec["messages"], rec["tools"]], sort_keys=True).encode()).hexdigest()
        if key not in seen:
            seen.add(key)
            kept.append(rec)
    if no_user or out_of_range or len(seen) < len(records) - no_user - out_of_range:
        logger.info("prompts: dropped %d without a user turn, %d with a first user turn outside [%d, %d] characters "
                    "(data.prompts.min/max_prompt_chars), %d duplicates", no_user, out_of_range, cfg.min_prompt_chars,
                    cfg.max_prompt_chars, len(records) - no_user - out_of_range - len(seen))
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
