"""The on-disk hidden-state dataset (format `draftsmith.hidden_states/1`): write, verify and read shards.

Each `shard-NNNNN.safetensors` packs samples: input_ids [N] int32, loss_mask [N] uint8,
aux_hidden_states [N, n_aux*H] (ascending layer ids), final_hidden_states [N, H] (after the target's
final norm), offsets [S+1] int64. A sidecar `shard-NNNNN.json` marks a finished shard (resume);
`manifest.json` is written last. Checksums are verified when a shard is first read.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch
from safetensors.torch import save

from draftsmith.data.errors import UserError
from draftsmith.data.faults import kill_point
from draftsmith.data.manifest import atomic_write_json, read_json, sha256_file, temp_file_beside
from draftsmith.data.run_paths import DatasetPaths

FORMAT = "draftsmith.hidden_states/1"
SHARD_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states", "offsets")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class CapturedSample:
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] 0/1
    aux_hidden_states: torch.Tensor  # [T, n_aux * H]
    final_hidden_states: torch.Tensor  # [T, H]


def safetensors_header(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
                       ) -> tuple[bytes, dict[str, int]]:
    """The header bytes safetensors' save() writes for tensors of these dtypes and shapes, and the file offset of
    each tensor's data, computed without the tensors themselves.

    save() orders the data by dtype, then name, and pads the JSON with spaces to 8 bytes; the order is read from
    save() run on one-element stand-ins, so it follows the installed library rather than a copy of its rule.
    """
    probe = save({k: torch.zeros(1, dtype=dt) for k, (dt, _) in layout.items()}, metadata=metadata)
    probe_header = json.loads(probe[8: 8 + struct.unpack("<Q", probe[:8])[0]])
    order = [k for k in probe_header if k != "__metadata__"]
    header: dict = {"__metadata__": metadata}
    begin = 0
    for name in order:
        dtype, shape = layout[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": probe_header[name]["dtype"], "shape": list(shape), "data_offsets": [begin, begin + size]}
        begin += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    starts = {name: 8 + len(text) + header[name]["data_offsets"][0] for name in order}
    return struct.pack("<Q", len(text)) + text, starts


# safetensors' dtype names (its format's header), for the dtypes a shard may hold
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                      "BOOL": torch.bool}


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor of a safetensors file lies (dtype, shape, absolute byte offset), from its header.

    Rows are read with pread into fresh buffers rather than through a memory map: the mapped pages a trainer
    touched stay counted in its RSS for the whole run (bench/results-rss-breakdown-cpu.txt: +12 MiB per step,
    up to the dataset's size), while pages read are only the kernel's page cache.
    """
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]]

    @classmethod
    def read(cls, fd: int, path: Path) -> ShardLayout:
        """The layout of the safetensors file open as `fd` (`path` names it in errors)."""
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise ValueError(f"{path} is {len(prefix)} bytes long, shorter than a safetensors header")
        (size,) = struct.unpack("<Q", prefix)
        header = json.loads(os.pread(fd, size, 8))
        data_start = 8 + size
        return cls({name: (SAFETENSORS_DTYPES[t["dtype"]], tuple(t["shape"]), data_start + t["data_offsets"][0])
                    for name, t in header.items() if name != "__metadata__"})

    def read_rows(self, fd: int, name: str, first: int, end: int) -> torch.Tensor:
        """Rows first..end-1 of tensor `name` (along dim 0), read from the open file `fd` into a new tensor."""
        dtype, shape, start = self.tensors[name]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        out = torch.empty((end - first, *shape[1:]), dtype=dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy())  # the tensor's own bytes: read in place
        offset, done = start + first * row_bytes, 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise ValueError(f"tensor {name!r} ends past the end of the file")
            done += n
        return out


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One whole tensor of a safetensors file (no memory map)."""
    return read_layout_and_tensor(path, name)[1]


def read_layout_and_tensor(path: Path, name: str) -> tuple[ShardLayout, torch.Tensor]:
    """A safetensors file's layout and its tensor `name`, from one open of the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        layout = ShardLayout.read(fd, path)
        return layout, layout.read_rows(fd, name, 0, layout.tensors[name][1][0])
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # one pwrite moves at most ~2 GiB on Linux
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class ShardWriter:
    """One shard written in place, sample by sample, so a shard never sits whole in memory.

    The sample lengths are known before capture, so the header and offsets go first and each sample's rows are
    written into every tensor's region when the sample arrives (in any order); the file is byte-identical to
    safetensors' save() of the concatenated tensors. Use it as a context manager: finish() fsyncs, renames the
    temp file onto the shard's name, hashes it and writes the sidecar; leaving without finish() deletes the temp.
    """

    def __init__(self, dataset_dir: Path, index: int, split: str, lengths: list[int], aux_width: int,
                 hidden_size: int, dtype, inputs_sha256: str = ""):
        self.path = Path(dataset_dir) / shard_name(index)
        self.split, self.dtype, self.inputs_sha256 = split, dtype, inputs_sha256
        self.offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)  # [S+1]
        self.offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        n = int(self.offsets[-1])
        layout = {"input_ids": (torch.int32, (n,)), "loss_mask": (torch.uint8, (n,)),
                  "aux_hidden_states": (dtype, (n, aux_width)), "final_hidden_states": (dtype, (n, hidden_size)),
                  "offsets": (torch.int64, (len(lengths) + 1,))}
        header, self.starts = safetensors_header(layout, {"format": FORMAT})
        self.row_bytes = {k: math.prod(shape[1:]) * dt.itemsize for k, (dt, shape) in layout.items()}
        self.missing = set(range(len(lengths)))
        self.fd, self.tmp = temp_file_beside(self.path)
        _pwrite_all(self.fd, memoryview(header), 0)
        self._write_rows("offsets", 0, self.offsets)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:  # not finished: an error or a kill mid-shard leaves no partial file
            os.close(self.fd)
            self.tmp.unlink(missing_ok=True)

    def _write_rows(self, key: str, first_row: int, rows: torch.Tensor) -> None:
        if rows.numel() == 0:  # a tokens-only shard (data.capture online) has zero-width hidden states
            return
        data = memoryview(rows.contiguous().view(torch.uint8).numpy()).cast("B")
        _pwrite_all(self.fd, data, self.starts[key] + first_row * self.row_bytes[key])

    def write_sample(self, i: int, sample: CapturedSample) -> None:
        first, t = int(self.offsets[i]), int(self.offsets[i + 1] - self.offsets[i])
        assert len(sample.input_ids) == t and i in self.missing, (i, len(sample.input_ids), t)
        self._write_rows("input_ids", first, sample.input_ids.to(torch.int32))
        self._write_rows("loss_mask", first, sample.loss_mask.to(torch.uint8))
        self._write_rows("aux_hidden_states", first, sample.aux_hidden_states.to(self.dtype))
        self._write_rows("final_hidden_states", first, sample.final_hidden_states.to(self.dtype))
        self.missing.discard(i)
        kill_point("shard_write")

    def finish(self) -> dict:
        """Publish the shard (fsync, rename), then its sidecar; returns the manifest entry."""
        assert not self.missing, f"samples {sorted(self.missing)[:5]} of {self.path.name} were never written"
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)
        kill_point("shard_sidecar")  # published, its sidecar not yet written: the rerun must re-check it
        entry = {"file": self.path.name, "split": self.split, "num_samples": len(self.offsets) - 1,
                 "num_tokens": int(self.offsets[-1]), "sha256": sha256_file(self.path)}
        atomic_write_json(self.path.with_suffix(".json"), {**entry, "inputs_sha256": self.inputs_sha256})
        return entry


def write_shard(dataset_dir: Path, index: int, split: str, samples: list[CapturedSample], dtype,
                inputs_sha256: str = "") -> dict:
    """Pack samples held in memory into one shard file (atomic), then its sidecar; returns the manifest entry."""
    with ShardWriter(dataset_dir, index, split, [len(s.input_ids) for s in samples],
                     samples[0].aux_hidden_states.shape[-1], samples[0].final_hidden_states.shape[-1], dtype,
                     inputs_sha256) as writer:
        for i, s in enumerate(samples):
            writer.write_sample(i, s)
        return writer.finish()


def finished_shard_entry(dataset_dir: Path, index: int, inputs_sha256: str = "") -> dict | None:
    """The manifest entry of a finished shard made from the same inputs whose file still matches its checksum,
    else None (rebuild it)."""
    path = Path(dataset_dir) / shard_name(index)
    side = path.with_suffix(".json")
    if not (path.is_file() and side.is_file()):
        return None
    try:
        entry = read_json(side)
    except ValueError:
        return None
    if entry.pop("inputs_sha256", "") != inputs_sha256:
        return None
    return entry if sha256_file(path) == entry.get("sha256") else None


def written_shard_entry(dataset_dir: Path, index: int, inputs_sha256: str) -> dict:
    """The manifest entry of shard `index` from its sidecar, written (and its checksum taken) by whichever process
    captured it; not re-hashed here, so collecting a large dataset's manifest costs no full read."""
    side = (Path(dataset_dir) / shard_name(index)).with_suffix(".json")
    if not side.is_file():
        raise UserError(f"{side} is missing: the process that captures shard {index} did not finish it; rerun the "
                        "same build command (finished shards are kept)")
    entry = read_json(side, "shard sidecar")
    if entry.pop("inputs_sha256", "") != inputs_sha256:
        raise UserError(f"{side} records other input samples than this build planned for shard {index}; rerun the "
                        "same build command (it recaptures stale shards)")
    return entry


def verify_shard(path: Path, entry: dict) -> None:
    """Refuse a truncated or tampered shard, naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"shard {path} listed in the manifest is missing; rebuild the dataset")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise UserError(f"shard {path} is corrupt: sha256 {actual[:12]}... != manifest {entry['sha256'][:12]}...; "
                         "rebuild it (delete the file and rerun data/build.py)")


class ShardedDataset:
    """Samples of one split, read lazily from verified shards; item i -> dict of per-sample tensors.

    Sample lengths come from each shard's small `offsets` tensor alone, so a trainer can plan rows without
    reading hidden states. A shard's checksum is verified before its first sample is read, unless
    `verify_share` already verified it (several processes split that work). `bytes_read` counts what this
    object read: hashed bytes and the bytes of every tensor slice returned.
    """

    def __init__(self, dataset_dir: Path, split: str = "train"):
        self.dir = Path(dataset_dir)
        self.manifest = read_json(DatasetPaths(self.dir).manifest, "dataset manifest")
        if self.manifest.get("format") != FORMAT:
            raise UserError(f"{DatasetPaths(self.dir).manifest}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.shards = [s for s in self.manifest["shards"] if s["split"] == split]
        self.index = [(si, j) for si, s in enumerate(self.shards) for j in range(s["num_samples"])]
        self._layouts: dict[int, ShardLayout] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        self._verified: set[int] = set()
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.index)

    def _verify(self, si: int) -> None:
        if si not in self._verified:
            path = self.dir / self.shards[si]["file"]
            verify_shard(path, self.shards[si])
            self.bytes_read += path.stat().st_size
            self._verified.add(si)

    def verify_share(self, rank: int, world_size: int) -> None:
        """Verify shards rank, rank + world_size, ...; the caller makes sure every rank's share passed."""
        for si in range(rank, len(self.shards), world_size):
            self._verify(si)

    def mark_verified(self) -> None:
        """Every shard was verified (by this or other processes): reads skip the checksum."""
        self._verified = set(range(len(self.shards)))

    def _layout(self, si: int) -> ShardLayout:
        self._verify(si)
        self._shard_offsets(si)  # reads the layout with the offsets: one header parse per shard
        return self._layouts[si]

    def _shard_offsets(self, si: int) -> torch.Tensor:
        """The shard's sample offsets, read without verifying its checksum (planning needs only these): the
        layout read with them serves the rows too, since verification hashes the whole file, header included."""
        if si not in self._offsets:
            path = self.dir / self.shards[si]["file"]
            try:
                self._layouts[si], self._offsets[si] = read_layout_and_tensor(path, "offsets")
            except (OSError, ValueError, KeyError):
                verify_shard(path, self.shards[si])  # names a missing or corrupt file
                raise
            self.bytes_read += self._offsets[si].numel() * 8
        return self._offsets[si]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        si, j = self.index[i]
        layout = self._layout(si)
        offsets = self._shard_offsets(si)
        a, b = int(offsets[j]), int(offsets[j + 1])
        path = self.dir / self.shards[si]["file"]
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                sample = {k: layout.read_rows(fd, k, a, b) for k in SHARD_KEYS if k != "offsets"}
            finally:
                os.close(fd)
        except (OSError, ValueError):
            verify_shard(path, self.shards[si])  # changed since it was verified: name the file and the fix
            raise
        self.bytes_read += sum(t.numel() * t.element_size() for t in sample.values())
        return sample

    def read_samples(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The samples of one packed row (an online dataset computes their hidden states here, in one batch)."""
        return [self[i] for i in indices]

    def sample_length(self, i: int) -> int:
        si, j = self.index[i]
        offsets = self._shard_offsets(si)
        return int(offsets[j + 1] - offsets[j])
