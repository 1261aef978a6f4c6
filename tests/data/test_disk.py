"""Disk planning: `data/build.py --dry-run` prints the dataset's size before anything runs, and a build whose
dataset the disk cannot hold is refused before capture."""
import re
import shutil
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from draftsmith.data.build import main
from draftsmith.data.config import load_config
from draftsmith.data.errors import UserError
from draftsmith.data.manifest import read_json
from draftsmith.data.prompts import build_prompt_splits

BYTES_PER_TOKEN = (3 + 1) * 64 * 2 + 5  # 3 aux layers + the final state of width 64 in bf16, int32 id, uint8 mask


def test_dry_run_prints_the_size_the_build_then_writes(build_config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = build_config(tmp_path)
    main(["--config", config, "--dry-run"])
    printed = capsys.readouterr().out
    assert not (tmp_path / "run").exists(), "a dry run writes nothing"
    assert "free space on its filesystem" in printed
    main(["--config", config])
    manifest = read_json(tmp_path / "run" / "dataset" / "manifest.json")
    # without regeneration the estimate counts exactly the templated samples the build captured
    assert f"{manifest['num_tokens'] * BYTES_PER_TOKEN} bytes = {manifest['num_tokens']} tokens" in printed
    on_disk = sum(p.stat().st_size for p in (tmp_path / "run" / "dataset").glob("shard-*.safetensors"))
    assert on_disk == pytest.approx(manifest["num_tokens"] * BYTES_PER_TOKEN, rel=0.02)  # headers, offsets


def test_dry_run_with_regeneration_counts_each_prompt_plus_max_new_tokens(build_config, chat_target_dir, tmp_path,
                                                                          monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = build_config(tmp_path, regenerate={"enabled": True, "max_new_tokens": 10}, max_seq_len=51)
    main(["--config", config, "--dry-run"])  # no engine starts: nothing is generated
    cfg, _ = load_config(config)
    train, heldout = build_prompt_splits(cfg.data.prompts)
    tok = AutoTokenizer.from_pretrained(chat_target_dir)
    prompts = [tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=True)
               for r in train + heldout]
    lengths = [len(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]  # transformers 5: a dict
    tokens = sum(min(n + 10, 51) for n in lengths)
    assert min(lengths) + 10 <= 51 < max(lengths) + 10, "both sides of the max_seq_len cap are exercised"
    assert f"{tokens * BYTES_PER_TOKEN} bytes = {tokens} tokens" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_a_build_the_disk_cannot_hold_is_refused_before_capture(build_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(total=10**12, used=10**12, free=1000))
    with pytest.raises(UserError, match=rf"dataset {re.escape(str(tmp_path))}/run/dataset needs about .* bytes.* has 1.0 KiB \(1000 bytes\) free"):
        main(["--config", build_config(tmp_path)])
    assert not (tmp_path / "run").exists()


def test_an_online_dataset_holds_the_tokens_alone(build_config, tmp_path, monkeypatch, capsys):
    """data.capture online: the same samples as offline, no hidden states (5 bytes a token), the target not loaded."""
    monkeypatch.chdir(tmp_path)
    main(["--config", build_config(tmp_path, capture="online"), "--dry-run"])
    printed = capsys.readouterr().out
    main(["--config", build_config(tmp_path, capture="online")])
    manifest = read_json(tmp_path / "run" / "dataset" / "manifest.json")
    assert manifest["capture"] == "online"
    assert f"{manifest['num_tokens'] * 5} bytes = {manifest['num_tokens']} tokens" in printed
    on_disk = sum(p.stat().st_size for p in (tmp_path / "run" / "dataset").glob("shard-*.safetensors"))
    offline_bytes = manifest["num_tokens"] * BYTES_PER_TOKEN
    print(f"online shards: {on_disk} bytes, {100 * on_disk / offline_bytes:.2f} % of the offline dataset's size")
    # ids + masks, plus each shard's header and offsets (~0.5 KB: they dominate at 3 samples a shard)
    assert on_disk < manifest["num_tokens"] * 5 + 512 * len(manifest["shards"])
    from draftsmith.data.shards import ShardedDataset

    sample = ShardedDataset(tmp_path / "run" / "dataset", "train")[0]
    assert sample["aux_hidden_states"].shape == (len(sample["input_ids"]), 0)


def test_switching_capture_mode_rewrites_the_shards(build_config, tmp_path, monkeypatch):
    """A finished captured shard is never reused as a tokens-only one, nor the other way round."""
    from draftsmith.data.shards import ShardedDataset

    monkeypatch.chdir(tmp_path)
    widths = []
    for mode in ("offline", "online", "offline"):
        main(["--config", build_config(tmp_path, capture=mode)])
        widths.append(ShardedDataset(tmp_path / "run" / "dataset", "train")[0]["aux_hidden_states"].shape[1])
    assert widths == [3 * 64, 0, 3 * 64]
