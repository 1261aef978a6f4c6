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
    with pytest.raises(UserError, match=r"no usable prompt record .* first: .*prompts.jsonl:1: tools\[0\] must be"):
        load_prompt_records(PromptsConfig(source="jsonl", path=str(path)))


def test_malformed_records_are_skipped_and_reported_with_file_and_line(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "Good one?"}, {"role": "assistant", "content": "Yes."}]},
        {"messages": [{"content": "who said this?"}]},  # 2: a turn without a role
        {"messages": [{"role": "user", "content": 42}]},  # 3: non-string content
        ["not", "an", "object"],  # 4
        {"messages": []},  # 5: no turns
        {"messages": [{"role": "wizard", "content": "hi"}]},  # 6: unknown role
        {"messages": [{"role": "user", "content": "Only a question, no answer yet"}]},  # 7: a prompt: kept
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},  # 8: filtered later
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = PromptsConfig(source="jsonl", path=str(path))
    with caplog.at_level("WARNING"):
        records = load_prompt_records(cfg)
    skipped = [r.getMessage() for r in caplog.records if "skipped malformed prompt record" in r.getMessage()]
    assert [m.split(": ", 1)[0].rsplit(":", 1)[1] for m in skipped] == ["2", "3", "4", "5", "6"], skipped
    assert all(str(path) in m for m in skipped)
    assert "found keys ['content']" in skipped[0] and "must be a string, got int" in skipped[1]
    assert any("skipped 5 malformed prompt record(s) of 8" in r.getMessage() for r in caplog.records)
    assert [r["messages"][0]["content"] for r in records] == ["Good one?", "Only a question, no answer yet", ""]
    with caplog.at_level("INFO"):
        kept = filter_and_dedup(records, cfg)
    assert len(kept) == 2 and any("1 with a first user turn outside" in r.getMessage() for r in caplog.records)
    path.write_text(json.dumps(lines[0]) + "\n{broken\n")  # a line that is not JSON refuses the file
    with pytest.raises(UserError, match=r"mixed.jsonl:2: not valid JSON"):
        load_prompt_records(cfg)
