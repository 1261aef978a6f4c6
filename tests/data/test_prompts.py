"""The demo prompt set is deterministic and split by function; records carry the tools they offer."""
import json

import pytest
import torch  # noqa: F401  (imported on purpose: libraries patch stdlib functions and must not change prompts)

from draftsmith.data.config import PromptsConfig
from draftsmith.data.errors import UserError
from draftsmith.data.prompts import (
    build_prompt_splits,
    demo_prompt_records,
    filter_and_dedup,
    load_prompt_records,
    stdlib_prompt_records,
)


def test_demo_prompts_do_not_depend_on_what_this_process_imported():
    assert demo_prompt_records() == demo_prompt_records()
    assert len(demo_prompt_records()) > 1000


def test_split_keeps_each_function_on_one_side():
    train, heldout = build_prompt_splits(PromptsConfig(max_prompts=300, heldout_fraction=0.2))
    assert len(train) + len(heldout) == 300 and heldout
    assert not {r["group"] for r in train} & {r["group"] for r in heldout}
    assert stdlib_prompt_records()[0]["messages"][0]["role"] == "user"


def test_jsonl_records_carry_their_tools_and_dedup_tells_them_apart(tmp_path):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    turns = [{"role": "user", "content": "Q"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"messages": turns, "tools": [tool]}, {"messages": turns, "tools": json.dumps([tool])},
        {"messages": turns}]))
    cfg = PromptsConfig(source="jsonl", path=str(path))
    records = load_prompt_records(cfg)
    assert [r["tools"] for r in records] == [[tool], [tool], []]
    assert [r["tools"] for r in filter_and_dedup(records, cfg)] == [[tool], []]


def test_a_bad_tools_field_names_the_record(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": "Q", "tools": [{"description": "no name"}]}) + "\n")
    with pytest.raises(UserError, match=r"prompt record 0 of jsonl:.*tools\[0\] must be"):
        load_prompt_records(PromptsConfig(source="jsonl", path=str(path)))
