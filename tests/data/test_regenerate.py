"""Regeneration with the real SmolLM2 target (transformers backend, a few tokens): resume, recorded parameters."""
import json

import pytest

from draftsmith.data.config import RegenerateConfig
from draftsmith.data.errors import UserError
from draftsmith.data.manifest import target_identity
from draftsmith.data.regenerate import prompt_key, regenerate_responses
from draftsmith.data.target import load_target_config, load_tokenizer, resolve_target_path


def _records(*questions):
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "(old answer)"}]}
            for q in questions]


def test_regeneration_resumes_by_prompt_and_refuses_changed_parameters(tmp_path):
    path = resolve_target_path("smollm2")
    tok, identity = load_tokenizer(path), target_identity("smollm2", load_target_config(path))
    cfg = RegenerateConfig(backend="transformers", max_new_tokens=4, batch_size=2)
    out = tmp_path / "regenerated.jsonl"
    first = regenerate_responses(_records("Add two numbers in Python.", "What is a tuple?"), tok, path, identity,
                                 "float32", cfg, out, 256)
    assert [len(c["messages"]) for c in first] == [2, 2]
    assert all(c["messages"][-1]["role"] == "assistant" and c["messages"][-1]["content"] != "(old answer)"
               for c in first)
    assert len(out.read_text().splitlines()) == 2
    params = json.loads(out.with_suffix(".params.json").read_text())
    assert params["target"] == {"name_or_path": "smollm2", "config_sha256": identity["config_sha256"]}
    assert params["max_new_tokens"] == 4 and params["backend"] == "transformers"

    # finished responses are reused; the target's folder is not even opened (a moved cache must not matter)
    again = regenerate_responses(_records("Add two numbers in Python.", "What is a tuple?"), tok,
                                 str(tmp_path / "no-such-folder"), identity, "float32", cfg, out, 256)
    assert again == first

    # one new prompt: only it is generated, appended to the same file
    more = regenerate_responses(_records("Add two numbers in Python.", "What is a tuple?", "Sort a list."), tok,
                                path, identity, "float32", cfg, out, 256)
    assert more[:2] == first and len(out.read_text().splitlines()) == 3

    # a crash mid-write tears the last line: the fragment is cut off and its prompt regenerated, and the
    # appended line starts on a line of its own, so every later resume reads all three
    text = out.read_text()
    out.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
    torn = regenerate_responses(_records("Add two numbers in Python.", "What is a tuple?", "Sort a list."), tok,
                                path, identity, "float32", cfg, out, 256)
    assert torn == more and [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1, 2]
    assert regenerate_responses(_records("Add two numbers in Python.", "What is a tuple?", "Sort a list."), tok,
                                str(tmp_path / "no-such-folder"), identity, "float32", cfg, out, 256) == more

    with pytest.raises(UserError, match="regenerated.jsonl was generated with"):
        regenerate_responses(_records("What is a tuple?"), tok, path, identity, "float32",
                             RegenerateConfig(backend="transformers", max_new_tokens=8), out, 256)


def test_the_prompt_key_covers_the_tools_offered():
    record = _records("What is a tuple?")[0]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert prompt_key({**record, "tools": []}) == prompt_key(record)
    assert prompt_key({**record, "tools": [tool]}) != prompt_key(record)
