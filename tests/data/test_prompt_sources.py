"""Every prompt source a recipe can name gives the same conversations: a JSONL file, a `save_to_disk` folder
(Dataset or DatasetDict), a local folder `load_dataset` reads, and a Hub dataset id read from the local HF cache
with the Hub switched off."""
import json

import datasets
import pytest
from huggingface_hub import constants

from draftsmith.data.config import PromptsConfig
from draftsmith.data.errors import UserError
from draftsmith.data.prompts import load_prompt_records

CONVERSATIONS = [
    {"prompt": f"question {i}", "messages": [{"role": "user", "content": f"question {i}"},
                                              {"role": "assistant", "content": f"answer {i}"}]}
    for i in range(5)
]
EXPECTED = [c["messages"] for c in CONVERSATIONS]
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def messages_of(cfg: PromptsConfig) -> list[list[dict]]:
    return [r["messages"] for r in load_prompt_records(cfg)]


def test_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS) + "\n")
    assert messages_of(PromptsConfig(source="jsonl", path=str(path))) == EXPECTED
    path.write_text('{"messages": [}\n')
    with pytest.raises(UserError, match=r"p.jsonl:1: not valid JSON"):
        load_prompt_records(PromptsConfig(source="jsonl", path=str(path)))


def test_save_to_disk_dataset_and_datasetdict(tmp_path):
    ds = datasets.Dataset.from_list(CONVERSATIONS)
    ds.save_to_disk(str(tmp_path / "single"))
    assert messages_of(PromptsConfig(source="hf", path=str(tmp_path / "single"))) == EXPECTED
    datasets.DatasetDict({"train_sft": ds, "test_sft": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert messages_of(PromptsConfig(source="hf", path=str(tmp_path / "dict"), split="train_sft")) == EXPECTED
    with pytest.raises(UserError, match=r"split 'train' is not in .*\['test_sft', 'train_sft'\]"):
        load_prompt_records(PromptsConfig(source="hf", path=str(tmp_path / "dict"), split="train"))


def write_parquet_splits(folder):
    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_list(CONVERSATIONS).to_parquet(str(folder / "data" / "train_sft-00000-of-00001.parquet"))
    datasets.Dataset.from_list(CONVERSATIONS[:1]).to_parquet(str(folder / "data" / "test_sft-00000-of-00001.parquet"))


def test_load_dataset_on_a_local_folder(tmp_path):
    write_parquet_splits(tmp_path / "local")
    cfg = PromptsConfig(source="hf", path=str(tmp_path / "local"), split="test_sft")
    assert messages_of(cfg) == EXPECTED[:1]


@pytest.fixture
def offline_dataset_cache(tmp_path, monkeypatch):
    """A dataset repo in a temporary HF cache under the id a recipe names, the Hub switched off."""
    repo = tmp_path / "hub" / "datasets--HuggingFaceH4--ultrachat_200k"
    write_parquet_splits(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hub_dataset_id_from_the_local_cache(offline_dataset_cache):
    cfg = PromptsConfig(source="hf", path="HuggingFaceH4/ultrachat_200k", split="train_sft",
                        conversations_column="messages")
    assert messages_of(cfg) == EXPECTED
    with pytest.raises(UserError, match=r"Unknown split .*train_sft"):
        load_prompt_records(PromptsConfig(source="hf", path="HuggingFaceH4/ultrachat_200k", split="nope"))
    with pytest.raises(UserError, match=r"dataset 'org/absent' is not in the local Hugging Face cache.*"
                                        r"hf download org/absent --repo-type dataset"):
        load_prompt_records(PromptsConfig(source="hf", path="org/absent"))
