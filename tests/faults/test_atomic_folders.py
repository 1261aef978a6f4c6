"""A drafter bundle (weights, spec, progress) is replaced as one set: a crash at any point leaves either the old
set or the new one, never a mix (issue #16)."""
import os

import torch

from draftsmith.data.manifest import replace_folder, settled_folder
from draftsmith.train.checkpoint import load_drafter_bundle, save_drafter_bundle
from tests.train.test_drafter import tiny_drafter


def test_a_swap_cut_between_its_renames_still_reads_the_old_set(tmp_path):
    drafter = tiny_drafter()
    best = tmp_path / "best"
    save_drafter_bundle(best, drafter.state_dict(), drafter.spec, {"step": 10})
    with torch.no_grad():
        drafter.fc.weight.add_(1.0)
    # the state a kill leaves after the first rename of replace_folder: the old set under .best.old, no best/
    new = tmp_path / ".best.tmp"
    save_drafter_bundle(tmp_path / "staged", drafter.state_dict(), drafter.spec, {"step": 20})
    os.replace(tmp_path / "staged", new)
    os.replace(best, tmp_path / ".best.old")
    weights, _, progress = load_drafter_bundle(best)
    assert progress["step"] == 10 and settled_folder(best) == tmp_path / ".best.old"
    # the next save finishes the swap and the old set is gone
    replace_folder(new, best)
    weights, _, progress = load_drafter_bundle(best)
    assert progress["step"] == 20 and torch.equal(weights["fc.weight"], drafter.fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_a_failed_save_leaves_the_previous_bundle_whole(tmp_path):
    drafter = tiny_drafter()
    best = tmp_path / "best"
    save_drafter_bundle(best, drafter.state_dict(), drafter.spec, {"step": 10})
    before = {p.name: p.read_bytes() for p in best.iterdir()}
    broken = dict(drafter.state_dict(), **{"fc.weight": "not a tensor"})  # fails after the staging folder exists
    try:
        save_drafter_bundle(best, broken, drafter.spec, {"step": 20})
    except AttributeError:
        pass
    assert {p.name: p.read_bytes() for p in best.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_an_atomic_write_removes_only_its_own_files_stale_temps(tmp_path):
    from draftsmith.data.manifest import atomic_write_bytes

    folder = tmp_path / "shards"
    folder.mkdir()
    # what killed writes left: a temp of shard-1 (twice), of its sidecar, and of another shard
    stale = [".shard-1.safetensors.abcd1234.tmp", ".shard-1.safetensors.zz_9yx00.tmp",
             ".shard-1.safetensors.sha256.k3j2h1g0.tmp", ".shard-2.safetensors.q1w2e3r4.tmp"]
    for name in stale:
        (folder / name).write_bytes(b"half")
    atomic_write_bytes(folder / "shard-1.safetensors", b"whole")
    left = sorted(p.name for p in folder.iterdir())
    assert left == [".shard-1.safetensors.sha256.k3j2h1g0.tmp", ".shard-2.safetensors.q1w2e3r4.tmp",
                    "shard-1.safetensors"]
    atomic_write_bytes(folder / "shard-1.safetensors.sha256", b"sum")
    atomic_write_bytes(folder / "shard-2.safetensors", b"whole")
    assert sorted(p.name for p in folder.iterdir()) == ["shard-1.safetensors", "shard-1.safetensors.sha256",
                                                        "shard-2.safetensors"]
