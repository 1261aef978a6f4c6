"""Shard writing, resume after a kill, and refusal of truncated or tampered shards."""
import pytest
import torch

from draftsmith.data.capture import capture_to_shards
from draftsmith.data.manifest import atomic_write_json
from draftsmith.data.shards import FORMAT, CapturedSample, ShardedDataset, shard_name, write_shard


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


class _CountingModel(torch.nn.Module):
    """A real (tiny) HF model whose forward calls are counted, to see which shards a resume recomputes."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, 0

    def get_decoder(self):
        self.calls += 1
        return self.inner.model


def test_kill_and_resume_skips_finished_shards(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    model = _CountingModel(AutoModelForCausalLM.from_config(cfg).eval())
    samples = [{"input_ids": list(range(1, 5 + i)), "loss_mask": [0, 1] * 2 + [1] * i} for i in range(6)]
    args = dict(aux_layer_ids=[1, 2], dataset_dir=tmp_path, split="train", first_shard=0, samples_per_shard=2,
                max_batch_tokens=10_000, pad_id=0, storage_dtype=torch.float32)

    import draftsmith.data.shards as shards

    real_write, written = shards.write_shard, []

    def dying_write(*a, **k):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        written.append(a[1])
        return real_write(*a, **k)

    monkeypatch.setattr(shards, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        capture_to_shards(model, samples, **args)
    monkeypatch.setattr(shards, "write_shard", real_write)
    assert written == [0, 1] and not (tmp_path / shard_name(2)).exists()
    model.calls = 0
    entries = capture_to_shards(model, samples, **args)
    assert model.calls == 1  # only shard 2 was captured again
    assert [e["file"] for e in entries] == [shard_name(i) for i in range(3)]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    again = capture_to_shards(model, samples, **{**args, "dataset_dir": fresh})
    assert [e["sha256"] for e in again] == [e["sha256"] for e in entries]  # resumed == uninterrupted


def test_resume_with_changed_samples_recaptures_their_shard(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    model = _CountingModel(AutoModelForCausalLM.from_config(cfg).eval())
    samples = [{"input_ids": list(range(1, 5 + i)), "loss_mask": [1] * (4 + i)} for i in range(4)]
    args = dict(aux_layer_ids=[1, 2], dataset_dir=tmp_path, split="train", first_shard=0, samples_per_shard=2,
                max_batch_tokens=10_000, pad_id=0, storage_dtype=torch.float32)
    capture_to_shards(model, samples, **args)
    samples[3] = {"input_ids": [9, 9, 9], "loss_mask": [1, 1, 1]}
    model.calls = 0
    entries = capture_to_shards(model, samples, **args)
    assert model.calls == 1 and entries[1]["num_tokens"] == 6 + 3  # only shard 1 was stale
