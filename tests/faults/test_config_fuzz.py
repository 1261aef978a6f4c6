"""Hostile configs (issue #16, item 4): every wrong type, unknown key, negative or zero size, NaN/inf float and
huge integer, in every field of every section, ends in a one-line ConfigError naming the key, never a traceback;
through the stage scripts too, before any model is loaded. Paths with spaces and unicode are accepted and work."""
import dataclasses
import math
import os
import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from draftsmith.data.config import ConfigError, RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("DRAFTSMITH_FUZZ_SEED", "20261201"))


def leaf_fields(cls=RunConfig, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, type) of every leaf field of the config."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += leaf_fields(tp, f"{prefix}{f.name}.")
        elif f.name != "name":
            out.append((prefix + f.name, tp))
    return out


def hostile_values(tp) -> list:
    """Values that must be refused for a field of type tp."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return ["not-a-choice", 12345, None, [1]]
    if origin is tuple:
        args = typing.get_args(tp)
        inner = args[0]
        bad_items = [v for v in hostile_values(inner) if not isinstance(v, list)][:3]
        return [[v] if args[-1] is Ellipsis else [v] * (len(args)) for v in bad_items] + [{"a": 1}]
    if tp is bool:
        return ["yes", 2, None, [True]]
    if tp is int:
        return [2**63, -(2**63) - 1, 10**30, "many", 1.5, None, {"a": 1}, True]
    if tp is float:
        return [math.nan, math.inf, -math.inf, "1e400", "fast", None, [1.0], True]
    if tp is str:
        return [12, None, ["a"], {"a": 1}]
    raise AssertionError(f"no hostile values for {tp}")


def config_with(tmp_path, key: str, value) -> str:
    tree: dict = {}
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def assert_refused_naming(key: str, config: str, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_config(config, list(overrides))
    message = str(e.value)
    assert "\n" not in message, message
    assert key in message, f"{key}: {message}"


def test_every_field_refuses_every_hostile_value_naming_the_key(tmp_path):
    cases = [(key, v) for key, tp in leaf_fields() for v in hostile_values(tp)]
    assert len(cases) > 300
    for key, value in cases:
        assert_refused_naming(key, config_with(tmp_path, key, value))


def test_unknown_keys_and_misplaced_sections_are_refused_naming_them(tmp_path):
    rng = random.Random(SEED)
    print(f"fuzz seed {SEED} (set DRAFTSMITH_FUZZ_SEED to replay)")
    sections = sorted({k.split(".")[0] for k, _ in leaf_fields() if "." in k})
    for _ in range(60):
        section = rng.choice(sections)
        bogus = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randrange(3, 12)))
        assert_refused_naming(f"{section}.{bogus}", config_with(tmp_path, f"{section}.{bogus}", 1))
    assert_refused_naming("train", config_with(tmp_path, "train", [1, 2]))  # a section that is not a mapping


def test_random_hostile_mixes_name_one_of_their_keys(tmp_path):
    rng = random.Random(SEED + 1)
    fields = leaf_fields()
    for _ in range(100):
        picked = rng.sample(fields, 3)
        tree: dict = {}
        for key, tp in picked:
            node = tree
            for p in key.split(".")[:-1]:
                node = node.setdefault(p, {})
            node[key.split(".")[-1]] = rng.choice(hostile_values(tp))
        path = tmp_path / "mix.yaml"
        path.write_text(yaml.safe_dump(tree))
        with pytest.raises(ConfigError) as e:
            load_config(str(path))
        assert "\n" not in str(e.value) and any(k in str(e.value) for k, _ in picked), (picked, str(e.value))


@pytest.mark.parametrize("script, override", [
    ("data/build.py", "data.max_seq_len=-3"),
    ("train/eagle3.py", "train.lr=.nan"),
    ("train/peagle.py", f"train.batch_tokens={2**64}"),
    ("export/validate.py", "export.concurrency=many"),
])
def test_stage_scripts_stop_on_one_line_before_loading_anything(script, override):
    proc = subprocess.run([sys.executable, str(REPO / script), "--config", "smollm2-demo", override],
                          capture_output=True, text=True, timeout=300, check=False)
    key = override.split("=")[0]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Loading" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and key in errors[0], proc.stderr[-2000:]


def test_paths_with_spaces_and_unicode_are_accepted_and_train(tiny_run, tmp_path):
    from draftsmith.train import eagle3

    out = tmp_path / "run dir ü 路径"
    config = tiny_run(tmp_path, {"train": {"max_steps": 2}}, output_dir=out)
    cfg, _ = load_config(config)
    assert cfg.paths.run == out
    eagle3.main(["--config", config])
    assert (out / "train" / "best" / "drafter.safetensors").is_file()
