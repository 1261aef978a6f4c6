"""Fixtures of the multi-process tests: run configs on the shared tiny dataset."""
from pathlib import Path

import pytest
from tiny_data import build_tiny_dataset


@pytest.fixture(scope="session")
def scaleout_config(tiny_run, tiny_target_dir, tmp_path_factory):
    """write(name, online=False, **sections) -> (config path, run dir): the tiny run, 5 logged steps, evaluated at
    the end; online: on the tokens-only dataset (data.capture online)."""
    root = tmp_path_factory.mktemp("scaleout")

    def write(name: str, online: bool = False, **sections) -> tuple[str, Path]:
        base = {"train": {"max_steps": 5, "log_every": 1, "eval_every": 5, "save_every": 5, "batch_tokens": 128},
                "peagle": {"num_depths": 3, "partition_elements": 64}, "export": {"num_speculative_tokens": [2]}}
        for section, values in sections.items():
            base.setdefault(section, {}).update(values)
        folder = root / name
        folder.mkdir()
        if online:
            build_tiny_dataset(tiny_target_dir, folder / "run" / "dataset", online=True)
        return tiny_run(folder, base), folder / "run"

    return write
