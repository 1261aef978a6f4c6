"""Shard writing (streamed sample by sample, byte-identical to safetensors' save), resume after a kill, and
refusal of truncated or tampered shards."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from draftsmith.data import shards
from draftsmith.data.capture import capture_to_shards
from draftsmith.data.manifest import atomic_write_json
from draftsmith.data.shards import (
    FORMAT,
    CapturedSample,
    ShardedDataset,
    ShardWriter,
    shard_name,
    write_shard,
)


def _sample(t, seed, h=8, n_aux=3):
    g = torch.Generator().manual_seed(seed)
    return CapturedSample(torch.randint(0, 50, (t,), generator=g), torch.randint(0, 2, (t,), generator=g),
                          torch.randn(t, n_aux * h, generator=g), torch.randn(t, h, generator=g))


def _write_dataset(tmp_path, samples_per_shard=(3, 2)):
    entries, all_samples, seed = [], [], 0
    for index, n in enumerate(samples_per_shard):
        samples = [_sample(4 + seed + i, seed + i) for i in range(n)]
        seed += n
        entries.append(write_shard(tmp_path, index, "train", samples, torch.float32))
        all_samples += samples
    atomic_write_json(tmp_path / "manifest.json", {"format": FORMAT, "shards": entries})
    return all_samples


def test_roundtrip_packed_samples(tmp_path):
    samples = _write_dataset(tmp_path)
    ds = ShardedDataset(tmp_path, "train")
    assert len(ds) == len(samples)
    for i, s in enumerate(samples):
        got = ds[i]
        assert torch.equal(got["input_ids"], s.input_ids.to(torch.int32))
        assert torch.equal(got["loss_mask"], s.loss_mask.to(torch.uint8))
        assert torch.equal(got["aux_hidden_states"], s.aux_hidden_states)
        assert torch.equal(got["final_hidden_states"], s.final_hidden_states)
        assert ds.sample_length(i) == len(s.input_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_read_by_pread_equal_safetensors_own_load_and_leave_no_mapping(tmp_path, dtype):
    samples = [_sample(t, seed) for seed, t in enumerate((5, 1, 9, 4))]
    entry = write_shard(tmp_path, 0, "train", samples, dtype)
    atomic_write_json(tmp_path / "manifest.json", {"format": FORMAT, "shards": [entry]})
    path = tmp_path / shard_name(0)
    extra = {"flags": torch.tensor([True, False, True]), "wide": torch.arange(6, dtype=torch.int64).view(3, 2)}
    (tmp_path / "other.safetensors").write_bytes(save(extra))
    reference = load(path.read_bytes()) | load((tmp_path / "other.safetensors").read_bytes())  # no map either
    ds = ShardedDataset(tmp_path, "train")
    offsets = reference["offsets"]
    for i in range(len(samples)):
        got = ds[i]
        for k, t in got.items():
            want = reference[k][offsets[i]: offsets[i + 1]]
            assert t.dtype == want.dtype and torch.equal(t, want), (k, i)
    # the trainer's RSS must not keep the pages it read (a memory map would list the file here)
    assert str(path) not in Path("/proc/self/maps").read_text()
    for k, t in extra.items():
        assert torch.equal(shards.read_tensor(tmp_path / "other.safetensors", k), t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_streamed_shard_is_byte_identical_to_saving_the_concatenated_tensors(tmp_path, dtype):
    samples = [_sample(t, seed) for seed, t in enumerate((5, 1, 9, 4))]
    reference = save({
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "aux_hidden_states": torch.cat([s.aux_hidden_states for s in samples]).to(dtype),
        "final_hidden_states": torch.cat([s.final_hidden_states for s in samples]).to(dtype),
        "offsets": torch.tensor([0, 5, 6, 15, 19]),
    }, metadata={"format": FORMAT})  # what write_shard wrote before shards were streamed
    with ShardWriter(tmp_path, 0, "train", [5, 1, 9, 4], 24, 8, dtype, "abc") as writer:
        for i in (2, 0, 3, 1):  # capture batches samples by length, so they arrive out of order
            writer.write_sample(i, samples[i])
        entry = writer.finish()
    streamed = (tmp_path / shard_name(0)).read_bytes()
    first_bad = next((i for i, (a, b) in enumerate(zip(streamed, reference)) if a != b), None)
    assert streamed == reference, f"{len(streamed)} vs {len(reference)} bytes, first differing byte {first_bad}"
    assert entry["num_samples"] == 4 and entry["num_tokens"] == 19
    write_shard(tmp_path / "packed", 0, "train", samples, dtype)
    assert (tmp_path / "packed" / shard_name(0)).read_bytes() == reference


def test_an_unfinished_shard_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError, match="capture failed"), \
            ShardWriter(tmp_path, 3, "train", [4, 4], 24, 8, torch.bfloat16) as writer:
        writer.write_sample(0, _sample(4, 0))
        raise RuntimeError("capture failed")
    assert list(tmp_path.iterdir()) == []


def test_tampered_shard_is_refused_naming_the_file(tmp_path):
    _write_dataset(tmp_path)
    path = tmp_path / shard_name(1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = ShardedDataset(tmp_path, "train")
    ds[0]  # shard 0 is fine
    with pytest.raises(ValueError, match=shard_name(1)):
        ds[3]


def test_truncated_shard_is_refused(tmp_path):
    _write_dataset(tmp_path)
    path = tmp_path / shard_name(0)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt"):
        ShardedDataset(tmp_path, "train")[0]


@pytest.mark.parametrize("keep", [0, 5, 100, -40])
@pytest.mark.parametrize("planned", [False, True])
def test_shard_cut_after_opening_is_refused_naming_the_file(tmp_path, keep, planned):
    """A shard cut short (under a header, mid-header, mid-data) once the dataset is open, before or after its
    offsets were read, and with its checksum taken as done (another process verified it): the error names it."""
    _write_dataset(tmp_path)
    ds = ShardedDataset(tmp_path, "train")
    if planned:
        [ds.sample_length(i) for i in range(len(ds))]
    ds.mark_verified()
    path = tmp_path / shard_name(1)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match=shard_name(1)):
        ds[4]


def _counting_target():
    """A real (tiny) HF model that counts its decoder forwards, to see which shards a resume recomputes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.calls = 0

    def count(*_):
        model.calls += 1

    model.model.register_forward_pre_hook(count)
    return model


def test_kill_and_resume_skips_finished_shards(tmp_path, monkeypatch):
    model = _counting_target()
    samples = [{"input_ids": list(range(1, 5 + i)), "loss_mask": [0, 1] * 2 + [1] * i} for i in range(6)]
    args = {"aux_layer_ids": [1, 2], "dataset_dir": tmp_path, "split": "train", "first_shard": 0,
            "samples_per_shard": 2, "max_batch_tokens": 10_000, "pad_id": 0, "storage_dtype": torch.float32}

    real_write = shards.ShardWriter.write_sample

    def dying_write(writer, i, sample):
        if writer.path.name == shard_name(2):
            raise KeyboardInterrupt("killed")  # mid-shard: part of shard 2 is already on disk
        real_write(writer, i, sample)

    monkeypatch.setattr(shards.ShardWriter, "write_sample", dying_write)
    with pytest.raises(KeyboardInterrupt):
        capture_to_shards(model, samples, **args)
    monkeypatch.setattr(shards.ShardWriter, "write_sample", real_write)
    # shards 0 and 1 are finished; the half-written shard 2 left no file, not even its temp file
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [shard_name(i) for i in range(2)] + [shard_name(i).replace(".safetensors", ".json") for i in range(2)])
    model.calls = 0
    entries = capture_to_shards(model, samples, **args)
    assert model.calls == 1  # only shard 2 was captured again
    assert [e["file"] for e in entries] == [shard_name(i) for i in range(3)]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    again = capture_to_shards(model, samples, **{**args, "dataset_dir": fresh})
    assert [e["sha256"] for e in again] == [e["sha256"] for e in entries]  # resumed == uninterrupted


def test_resume_with_changed_samples_recaptures_their_shard(tmp_path):
    model = _counting_target()
    samples = [{"input_ids": list(range(1, 5 + i)), "loss_mask": [1] * (4 + i)} for i in range(4)]
    args = {"aux_layer_ids": [1, 2], "dataset_dir": tmp_path, "split": "train", "first_shard": 0,
            "samples_per_shard": 2, "max_batch_tokens": 10_000, "pad_id": 0, "storage_dtype": torch.float32}
    capture_to_shards(model, samples, **args)
    samples[3] = {"input_ids": [9, 9, 9], "loss_mask": [1, 1, 1]}
    model.calls = 0
    entries = capture_to_shards(model, samples, **args)
    assert model.calls == 1 and entries[1]["num_tokens"] == 6 + 3  # only shard 1 was stale
