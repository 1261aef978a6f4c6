"""The Hub push dry run: the exact upload folder, its file list, and a card built from validation.json."""
import hashlib
import json

import pytest

from draftsmith.export import push
from draftsmith.export.format import speculators_config
from draftsmith.train.spec import DrafterSpec

VALIDATION = {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.1,
              "acceptance_rate_per_position": [0.6, 0.35, 0.15], "lossless": True, "num_prompts": 48,
              "acceptance_length_by_k": {"1": 1.6, "2": 1.95, "3": 2.1}, "recommended_k": 2,
              "tokens_per_target_step": {"drafter": 2.05, "ngram": 1.4, "none": 1.0},
              "output_tokens_per_s": {"with_drafter": 90.0, "without_drafter": 70.0}}


def _run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    # the exporter's own config.json (SmolLM2-shaped, as the demo writes it); the weights are not read
    spec = DrafterSpec(method="eagle3", arch="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, max_position_embeddings=8192,
                       vocab_size=49152, num_hidden_layers=1, target_hidden_size=576, draft_vocab_size=16384,
                       aux_layer_ids=(2, 15, 27), verifier_name_or_path="/cache/smollm2")
    (run / "drafter" / "config.json").write_text(json.dumps(speculators_config(spec, 3)))
    (run / "drafter" / "model.safetensors").write_bytes(b"weights")
    (run / "validation.json").write_text(json.dumps(
        VALIDATION | {"drafter_dir": str(run / "drafter"), "drafter_weights_sha256": hashlib.sha256(b"weights").hexdigest()}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"output_dir": str(run)}))
    return run, str(cfg)


def test_dry_run_writes_the_upload_folder_and_lists_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    run, cfg = _run_dir(tmp_path)
    push.main(["--config", cfg, "--repo-id", "me/smol-drafter", "--dry-run"])
    out = capsys.readouterr().out
    staged = run / "hub" / "me--smol-drafter"
    assert sorted(p.name for p in staged.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                        "validation.json"]
    for name in ("README.md", "config.json", "model.safetensors", "validation.json"):
        assert name in out
    card = (staged / "README.md").read_text()
    assert "| 3 | 2.100 | 0.150 |" in card  # the acceptance table comes from validation.json
    assert '"num_speculative_tokens": 2' in card  # the recommended K goes into the serve line
    assert "lossless" in card and "**True**" in card and "n-gram 1.400" in card
    assert "library_name: vllm" in card and "- eagle3" in card and "aux layers [2, 15, 27]" in card
    assert "base_model" not in card  # the verifier is a local folder, not a Hub id


def test_real_push_without_token_fails_before_network(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-cached-login"))
    _, cfg = _run_dir(tmp_path)
    with pytest.raises(ValueError, match="hf auth login"):
        push.main(["--config", cfg, "--repo-id", "me/smol-drafter"])


def test_missing_validation_report_is_a_clear_error(tmp_path):
    run, cfg = _run_dir(tmp_path)
    (run / "validation.json").unlink()
    with pytest.raises(FileNotFoundError, match="run export/validate.py first"):
        push.main(["--config", cfg, "--repo-id", "me/x", "--dry-run"])


def test_a_drafter_other_than_the_validated_one_is_refused(tmp_path):
    run, cfg = _run_dir(tmp_path)
    other = tmp_path / "other-drafter"
    other.mkdir()
    (other / "config.json").write_bytes((run / "drafter" / "config.json").read_bytes())
    (other / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ValueError, match=r"validated weights with sha256 [0-9a-f]{16} \(.*run/drafter\), but "
                                         r".*other-drafter/model.safetensors has sha256 [0-9a-f]{16}: validate this"):
        push.main(["--config", cfg, "--repo-id", "me/x", "--dry-run", "--drafter", str(other)])
    assert not (run / "hub").exists()  # refused before staging anything


def test_the_card_carries_the_sweep_verdict_and_its_plot(tmp_path, monkeypatch):
    from draftsmith.export import verdict

    monkeypatch.delenv("HF_TOKEN", raising=False)
    run, cfg = _run_dir(tmp_path)
    cells = [{"role": role, "method": role, "num_speculative_tokens": k, "concurrency": c,
              "tpot_ms": {"mean": t}, "token_acceptance_rate": tar}
             for role, k, c, t, tar in [("none", 0, 1, 20.0, None), ("none", 0, 16, 40.0, None),
                                        ("drafter", 5, 1, 12.0, 0.55), ("drafter", 5, 16, 44.0, 0.55)]]
    report = json.loads((run / "validation.json").read_text())
    report |= {"dtype": "bfloat16", "verdict": verdict.decide(cells)}
    (run / "validation.json").write_text(json.dumps(report))
    (run / "validation-tpot.png").write_bytes(b"\x89PNG-stand-in")
    push.main(["--config", cfg, "--repo-id", "me/smol-drafter", "--dry-run"])
    staged = run / "hub" / "me--smol-drafter"
    assert (staged / "validation-tpot.png").is_file()
    card = (staged / "README.md").read_text()
    assert "## When to turn it on" in card and "| 1 | 5 | 20.0 | 12.0 | +40% | 0.55 | yes |" in card
    assert "| 16 | 5 | 40.0 | 44.0 | -10% | 0.55 | no |" in card
    assert "speculate while running requests <= 1 (K=5)" in card and "![TPOT vs concurrency](validation-tpot.png)" in card
    assert '"num_speculative_tokens": 5' in card  # K from the sweep, over the cost model's 2
    assert "near-ties of bf16/fp16 numerics re-scored in fp32" in card
