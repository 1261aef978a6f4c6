"""The on-disk hidden-state dataset (format `draftsmith.hidden_states/1`): write, verify and read shards.

Each `shard-NNNNN.safetensors` packs samples: input_ids [N] int32, loss_mask [N] uint8,
aux_hidden_states [N, n_aux*H] (ascending layer ids), final_hidden_states [N, H] (after the target's
final norm), offsets [S+1] int64. A sidecar `shard-NNNNN.json` marks a finished shard (resume);
`manifest.json` is written last. Checksums are verified when a shard is first read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from draftsmith.data.errors import UserError
from draftsmith.data.manifest import atomic_write_bytes, atomic_write_json, read_json, sha256_file

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


def write_shard(dataset_dir: Path, index: int, split: str, samples: list[CapturedSample], dtype,
                inputs_sha256: str = "") -> dict:
    """Pack samples into one shard file (atomic), then its sidecar; returns the manifest entry."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "aux_hidden_states": torch.cat([s.aux_hidden_states for s in samples]).to(dtype).contiguous(),
        "final_hidden_states": torch.cat([s.final_hidden_states for s in samples]).to(dtype).contiguous(),
        "offsets": offsets,
    }
    path = Path(dataset_dir) / shard_name(index)
    atomic_write_bytes(path, save(tensors, metadata={"format": FORMAT}))
    entry = {"file": path.name, "split": split, "num_samples": len(samples), "num_tokens": int(offsets[-1]),
             "sha256": sha256_file(path)}
    atomic_write_json(path.with_suffix(".json"), {**entry, "inputs_sha256": inputs_sha256})
    return entry


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
        self.manifest = read_json(self.dir / "manifest.json", "dataset manifest")
        if self.manifest.get("format") != FORMAT:
            raise UserError(f"{self.dir / 'manifest.json'}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.shards = [s for s in self.manifest["shards"] if s["split"] == split]
        self.index = [(si, j) for si, s in enumerate(self.shards) for j in range(s["num_samples"])]
        self._open: dict[int, object] = {}
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

    def _shard(self, si: int):
        self._verify(si)
        if si not in self._open:
            self._open[si] = safe_open(str(self.dir / self.shards[si]["file"]), "pt")
        return self._open[si]

    def _shard_offsets(self, si: int) -> torch.Tensor:
        if si not in self._offsets:
            path = self.dir / self.shards[si]["file"]
            try:
                with safe_open(str(path), "pt") as f:
                    self._offsets[si] = f.get_tensor("offsets")
            except Exception:
                verify_shard(path, self.shards[si])  # names a missing or corrupt file
                raise
            self.bytes_read += self._offsets[si].numel() * 8
        return self._offsets[si]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        si, j = self.index[i]
        f = self._shard(si)
        offsets = self._shard_offsets(si)
        a, b = int(offsets[j]), int(offsets[j + 1])
        sample = {k: f.get_slice(k)[a:b] for k in SHARD_KEYS if k != "offsets"}
        self.bytes_read += sum(t.numel() * t.element_size() for t in sample.values())
        return sample

    def sample_length(self, i: int) -> int:
        si, j = self.index[i]
        offsets = self._shard_offsets(si)
        return int(offsets[j + 1] - offsets[j])
