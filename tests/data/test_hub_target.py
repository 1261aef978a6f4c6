"""A target named by Hub id resolves through the local Hugging Face cache with HF_HUB_OFFLINE=1, never by joining
a path onto the id: training reads the teacher head from the cached snapshot and the drafter names the id."""
import json
import shutil

import pytest
from huggingface_hub import constants

from draftsmith.data.errors import UserError
from draftsmith.data.target import (
    head_weight_files,
    is_hub_id,
    resolve_target_head_path,
    resolve_target_path,
    snapshot_revision,
)
from draftsmith.train import eagle3
from draftsmith.train.checkpoint import load_drafter_bundle

REPO_ID = "draftsmith-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch, tiny_target_dir):
    """The tiny target placed in a temporary HF cache under a fake repo id, the Hub switched off."""
    repo = tmp_path / "hub" / "models--draftsmith-test--tiny-llama"
    shutil.copytree(tiny_target_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / COMMIT


def test_hub_id_resolves_to_its_cached_snapshot(offline_hub_cache):
    assert is_hub_id(REPO_ID) and not is_hub_id(str(offline_hub_cache)) and not is_hub_id("smollm2")
    assert resolve_target_path(REPO_ID) == str(offline_hub_cache)
    assert resolve_target_path(REPO_ID, COMMIT) == str(offline_hub_cache)
    assert resolve_target_head_path(REPO_ID) == str(offline_hub_cache)
    assert snapshot_revision(resolve_target_path(REPO_ID)) == COMMIT
    assert snapshot_revision(str(offline_hub_cache.parent.parent)) == ""


def test_missing_id_offline_names_the_cache_and_the_fix(offline_hub_cache):
    with pytest.raises(UserError, match=r"'draftsmith-test/absent' is not in the local Hugging Face cache .*"
                                        r"HF_HUB_OFFLINE.*hf download draftsmith-test/absent"):
        resolve_target_path("draftsmith-test/absent")
    with pytest.raises(UserError, match="not an embedded target"):
        resolve_target_path("not a/valid//id")


def test_head_files_of_a_sharded_checkpoint(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00003.safetensors",
        "model.layers.0.mlp.up_proj.weight": "model-00002-of-00003.safetensors",
        "model.norm.weight": "model-00003-of-00003.safetensors",
        "lm_head.weight": "model-00003-of-00003.safetensors"}}))
    assert head_weight_files(tmp_path) == ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def test_training_on_a_hub_id_target(offline_hub_cache, tiny_run, tmp_path):
    """The dataset was captured from the folder; training names the target by its id (same config hash)."""
    cfg = tiny_run(tmp_path, {"target": {"name_or_path": REPO_ID}, "train": {"max_steps": 2, "eval_every": 2}})
    eagle3.main(["--config", cfg])
    _, spec, _ = load_drafter_bundle(tmp_path / "run" / "train" / "best")
    assert spec.verifier_name_or_path == REPO_ID
