"""Strict config loading: unknown keys, wrong types, bad choices and overrides."""
import dataclasses

import pytest

from draftsmith.data.config import ConfigError, load_config
from draftsmith.data.layer_ids import default_aux_layer_ids, from_sglang_layer_ids, normalize_aux_layer_ids


def _write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


def test_demo_config_loads_with_defaults_and_name():
    cfg, sources = load_config("smollm2-demo")
    assert cfg.name == "smollm2-demo" and str(cfg.paths.run) == "runs/smollm2-demo"
    assert sources["train.lr"] == "yaml" and sources["train.grad_clip"] == "default"


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = _write(tmp_path, "train:\n  learning_rate: 1.0e-4\n")
    with pytest.raises(ConfigError, match=r"run.yaml: unknown key 'train.learning_rate' \(did you mean 'train.lr'\?\)"):
        load_config(path)


def test_wrong_type_and_bad_choice(tmp_path):
    with pytest.raises(ConfigError, match="'train.max_steps' must be int, got str"):
        load_config(_write(tmp_path, "train:\n  max_steps: many\n"))
    with pytest.raises(ConfigError, match=r"'drafter.arch' = 'lama' is not one of 'llama', 'qwen3' \(did you mean 'llama'\?\)"):
        load_config(_write(tmp_path, "drafter:\n  arch: lama\n"))


def test_cli_overrides_beat_yaml_and_are_checked(tmp_path):
    path = _write(tmp_path, "train:\n  lr: 1.0e-3\n")
    cfg, sources = load_config(path, ["train.lr=3e-4", "ttt.num_steps=5", "export.num_speculative_tokens=[1,3]"])
    assert cfg.train.lr == 3e-4 and sources["train.lr"] == "cli"
    assert cfg.ttt.num_steps == 5 and cfg.export.num_speculative_tokens == (1, 3)
    with pytest.raises(ConfigError, match="unknown key 'train.lrr'"):
        load_config(path, ["train.lrr=1"])


def test_exponent_strings_become_floats_only_in_float_fields(tmp_path):
    # YAML 1.1 reads 3e-4 as text; a path or a name that looks like a number must stay text
    path = _write(tmp_path, "output_dir: 1e3\ntrain:\n  lr: 3e-4\ndata:\n  dataset_dir: 2e5-run\n")
    cfg, _ = load_config(path, ["target.name_or_path=1e-3", "train.muon_lr=5e-3"])
    assert cfg.output_dir == "1e3" and cfg.data.dataset_dir == "2e5-run" and cfg.target.name_or_path == "1e-3"
    assert cfg.train.lr == 3e-4 and cfg.train.muon_lr == 5e-3 and isinstance(cfg.train.lr, float)
    for bad, message in [("train.lr=fast", "'train.lr' must be float, got str 'fast'"),
                         ("train.lr=1e400", "'train.lr' must be a finite number, got inf"),
                         ("train.grad_clip=.nan", "'train.grad_clip' must be a finite number, got nan"),
                         ("train.lr=true", "'train.lr' must be float, got bool True")]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, [bad])


@pytest.mark.parametrize("override, message", [
    ("train.max_steps=-1", "train.max_steps must be >= 1"),
    ("train.batch_tokens=0", r"train.batch_tokens must be in \[1, 16777216\], got 0"),
    ("train.warmup_steps=-5", "train.warmup_steps must be >= 0"),
    ("train.eval_every=0", "train.eval_every must be >= 1"),
    ("train.grad_accum=0", "train.grad_accum must be >= 1"),
    ("data.max_seq_len=0", r"data.max_seq_len must be in \[2, 16777216\], got 0"),
    ("data.prompts.heldout_fraction=1.5", r"data.prompts.heldout_fraction must be in \[0, 0.9\]"),
    ("target.aux_layer_ids=[2,-1]", "target.aux_layer_ids must be >= 0"),
    ("export.num_speculative_tokens=[0]", r"export.num_speculative_tokens must be in \[1, 64\]"),
    ("export.num_speculative_tokens=[]", "export.num_speculative_tokens needs at least one K"),
    ("train.betas=[0.9,1.5]", "train.betas must be in"),
    ("train.report_to=[tensorbord]", r"train.report_to: \['tensorbord'\] are not trackers"),
    ("train.teacher_temperature=0", "train.teacher_temperature must be > 0, got 0"),
    ("ttt.alignment_topk=-1", "ttt.alignment_topk must be >= 0, got -1"),
])
def test_impossible_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("smollm2-demo", [override])
    assert "\n" not in str(e.value)


def test_a_temperature_on_the_argmax_teacher_is_an_error():
    with pytest.raises(ConfigError, match="teacher_temperature=2.0 needs train.teacher=distribution"):
        load_config("smollm2-demo", ["train.teacher=argmax", "train.teacher_temperature=2"])
    cfg, _ = load_config("smollm2-demo", ["train.teacher_temperature=2"])
    assert cfg.train.teacher_temperature == 2.0


def test_exclusive_norm_flags_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match="fc_norm and drafter.norm_before_fc are exclusive"):
        load_config(_write(tmp_path, "drafter:\n  fc_norm: true\n  norm_before_fc: true\n"))


def test_missing_config_lists_available():
    with pytest.raises(ConfigError, match="smollm2-demo"):
        load_config("no-such-config")


def test_layer_id_convention():
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(48) == [2, 24, 45]
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert normalize_aux_layer_ids([29, 2, 16, 2], 32) == [2, 16, 29]
    assert from_sglang_layer_ids([1, 15, 28]) == [2, 16, 29]
    with pytest.raises(ValueError, match="outside"):
        normalize_aux_layer_ids([2, 40], 32)


def test_overrides_may_follow_options():
    from draftsmith.data.cli import build_arg_parser, parse_run_args

    parser = build_arg_parser("x")
    parser.add_argument("--drafter")
    cfg, args = parse_run_args(parser, ["--config", "smollm2-demo", "train.lr=1e-4", "--drafter", "d",
                                        "export.ngram_baseline=false"])
    assert cfg.train.lr == 1e-4 and cfg.export.ngram_baseline is False and args.drafter == "d"


def test_dataset_dir_defaults_to_the_run_folder_and_can_be_shared():
    cfg, _ = load_config("smollm2-demo")
    assert str(cfg.paths.dataset.dir) == "runs/smollm2-demo/dataset"
    peagle, _ = load_config("smollm2-peagle")
    assert peagle.paths.dataset == cfg.paths.dataset and peagle.paths.run != cfg.paths.run
    assert peagle.paths.drafter == peagle.paths.run / "drafter" and str(peagle.paths.run) == "runs/smollm2-peagle"
    # sharing a dataset only makes sense with the same data recipe: the two demo configs must agree
    assert peagle.data == dataclasses.replace(cfg.data, dataset_dir=peagle.data.dataset_dir)
