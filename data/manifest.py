"""Artifact manifests: atomic JSON writes, checksums, and the target identity every stage checks."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from draftsmith.data.errors import UserError
from draftsmith.data.faults import kill_point

_TEMP_SUFFIX = re.compile(r"\.[a-z0-9_]{8}\.tmp")  # what mkstemp adds after our prefix
_stale_temps: dict[Path, set[str]] = {}  # folder -> temp names found there at this process's first write


def stale_temps_of(path: Path) -> list[Path]:
    """Temp files of `path` that a killed write left behind. One writer per file and a writer removes its own temps
    on failure, so the stale ones are those already there when this process first wrote into the folder: the
    folder is listed once per process, not once per write (thousands of shards in one folder)."""
    folder = path.parent
    names = _stale_temps.get(folder)
    if names is None:
        names = _stale_temps[folder] = {p.name for p in folder.glob(".*.tmp")}
    prefix = f".{path.name}"
    mine = {n for n in names if n.startswith(prefix) and _TEMP_SUFFIX.fullmatch(n[len(prefix):])}
    names -= mine
    return [folder / n for n in mine]


def temp_file_beside(path: Path) -> tuple[int, Path]:
    """A new temp file (open fd, path) in path's folder: the same filesystem, so renaming it onto path is atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_temps_of(path):  # never read: what a killed write of this very file left
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; the result should look like any written file
    return fd, Path(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers never see half a file."""
    fd, tmp = temp_file_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_folder(new: Path, target: Path) -> None:
    """Put the finished folder `new` in place of `target` (its files form one set: none may be newer than the rest).

    Two renames: target -> .<name>.old, new -> target. A crash between them leaves only the old folder, under
    its .old name; `settled_folder` reads that one then.
    """
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
        kill_point("bundle_swap")
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def settled_folder(target: Path) -> Path:
    """target, or the complete folder a replace_folder cut short between its renames left under .<name>.old."""
    old = target.with_name(f".{target.name}.old")
    return old if not target.exists() and old.is_dir() else target


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: Path, what: str = "file") -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {path} is not valid JSON ({e}); delete it and rebuild") from None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def target_identity(name_or_path: str, hf_config, revision: str = "") -> dict:
    """What identifies a target for later stages: its name, config hash and the dims a drafter depends on; for a
    Hub id, the commit of the snapshot used."""
    cfg = hf_config.to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        cfg.pop(k, None)
    text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return {
        "name_or_path": str(name_or_path),
        "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest(),
        "num_hidden_layers": int(text_cfg.num_hidden_layers),
        "hidden_size": int(text_cfg.hidden_size),
        "vocab_size": int(text_cfg.vocab_size),
    } | ({"revision": revision} if revision else {})
