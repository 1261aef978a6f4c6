"""The demo prompt set is deterministic and split by function."""
import torch  # noqa: F401  (imported on purpose: libraries patch stdlib functions and must not change prompts)

from draftsmith.data.config import PromptsConfig
from draftsmith.data.prompts import build_prompt_splits, demo_prompt_records, stdlib_prompt_records


def test_demo_prompts_do_not_depend_on_what_this_process_imported():
    assert demo_prompt_records() == demo_prompt_records()
    assert len(demo_prompt_records()) > 1000


def test_split_keeps_each_function_on_one_side():
    train, heldout = build_prompt_splits(PromptsConfig(max_prompts=300, heldout_fraction=0.2))
    assert len(train) + len(heldout) == 300 and heldout
    assert not {r["group"] for r in train} & {r["group"] for r in heldout}
    assert stdlib_prompt_records()[0]["messages"][0]["role"] == "user"
