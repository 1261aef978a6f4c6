"""export/validate.py and export/serve.py: /metrics arithmetic, the pre-flight drafter check, and (slow) real
vLLM servers on the SmolLM2 target with a random drafter: lossless outputs, teardown on a drafter vLLM refuses.
"""
from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
import torch
from stages import processes_with_marker

from draftsmith.data.cli import run_entry
from draftsmith.data.config import DrafterConfig
from draftsmith.export import acceptance, serve, server, spec_metrics, sweep, validate
from draftsmith.export import format as fmt
from draftsmith.export.report import plot_acceptance, plot_tpot, print_summary, render_markdown
from draftsmith.export.write import write_drafter_folder
from draftsmith.train.spec import spec_for_target

METRICS_BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 5.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7646e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="target"} 15.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="target"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="2"} 0.0
vllm:generation_tokens_total{engine="0",model_name="target"} 99.0
"""
# 100 more drafts; 60, 30, 10 more accepted at positions 0, 1, 2
METRICS_AFTER = (METRICS_BEFORE.replace('"0",model_name="target"} 10.0', '"0",model_name="target"} 110.0')
                 .replace("} 30.0", "} 330.0").replace('} 12.0', '} 112.0')
                 .replace('position="0"} 7.0', 'position="0"} 67.0').replace('position="1"} 4.0', 'position="1"} 34.0')
                 .replace('position="2"} 1.0', 'position="2"} 11.0'))


def test_parse_spec_counters_sums_engines():
    c = spec_metrics.parse_spec_counters(METRICS_BEFORE)
    assert (c.drafts, c.draft_tokens, c.accepted) == (15.0, 45.0, 15.0)
    assert c.accepted_per_pos == (9.0, 5.0, 1.0)


def test_parse_spec_counters_without_speculation_is_zero():
    c = spec_metrics.parse_spec_counters('vllm:generation_tokens_total{engine="0",model_name="target"} 99.0\n')
    assert c == spec_metrics.SpecCounters()
    assert acceptance.acceptance_length(c) == 1.0


def test_counter_delta_gives_acceptance():
    delta = spec_metrics.parse_spec_counters(METRICS_AFTER) - spec_metrics.parse_spec_counters(METRICS_BEFORE)
    assert (delta.drafts, delta.draft_tokens, delta.accepted) == (100.0, 300.0, 100.0)
    assert delta.accepted_per_pos == (60.0, 30.0, 10.0)
    assert acceptance.acceptance_length(delta) == pytest.approx(2.0)
    assert acceptance.acceptance_rates(delta) == pytest.approx([0.6, 0.3, 0.1])
    # 500 output tokens of which 100 came from accepted drafts: 400 target steps
    assert acceptance.tokens_per_target_step(500, delta.accepted) == pytest.approx(1.25)
    assert acceptance.tokens_per_target_step(500, 0) == 1.0


def test_acceptance_length_by_k_is_prefix_sum():
    assert acceptance.acceptance_length_by_k([0.6, 0.3, 0.1]) == pytest.approx({1: 1.6, 2: 1.9, 3: 2.0})


def test_fit_step_cost_and_recommended_k():
    # 10 ms without drafting, 22 ms with K=3: c0 = 10 ms, c_draft = 4 ms
    c0, c_draft = acceptance.fit_step_cost([(0, 0.010), (3, 0.022)])
    assert (c0, c_draft) == (pytest.approx(0.010), pytest.approx(0.004))
    # tokens per ms: K=0 1/10 = .1, K=1 1.6/14 = .1143, K=2 1.9/18 = .1056, K=3 2.0/22 = .0909
    best, speed = acceptance.recommend_k([0.6, 0.3, 0.1], c0, c_draft)
    assert best == 1
    assert speed[1] == pytest.approx(1.6 / 0.014)
    assert acceptance.recommend_k([0.0, 0.0, 0.0], c0, c_draft)[0] == 0  # a useless drafter: do not draft
    assert acceptance.recommend_k([0.95, 0.9, 0.85], c0, c_draft)[0] == 3
    # a drafter measured faster than no drafter (noise) costs nothing rather than less than nothing
    assert acceptance.fit_step_cost([(0, 0.010), (3, 0.009)]) == (pytest.approx(0.0095), 0.0)


def test_first_mismatch():
    assert acceptance.first_mismatch([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert acceptance.first_mismatch([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == (1, 1)
    assert acceptance.first_mismatch([[1, 2, 3]], [[1, 2]]) == (0, 2)


def test_error_excerpt_quotes_vllm_exception(tmp_path):
    log = tmp_path / "vllm-x.log"
    log.write_text("(APIServer pid=6) WARNING 11-29 11:19:59 [system_utils.py:255] can cause `OSError: [Errno 24]`\n"
                   "(Worker pid=8) ERROR 11-29 11:21:14 [multiproc_executor.py:953] safetensors_rust.SafetensorError: "
                   "Error while deserializing header: HeaderTooLarge\n"
                   "(EngineCore pid=7) ERROR 11-29 11:21:19 [core.py:1510] Exception: WorkerProc failed\n"
                   "Exception: WorkerProc failed\nRuntimeError: Engine core initialization failed.\n")
    excerpt = server.vllm_error_excerpt(log)
    assert excerpt.startswith("safetensors_rust.SafetensorError: Error while deserializing header: HeaderTooLarge; "
                              "Exception: WorkerProc failed; RuntimeError: Engine core initialization failed.\n")


# ---- the pre-flight check (no server) --------------------------------------------------------------------


def _write_yaml(tmp_path: Path, run_dir: Path, export: str = "", dtype: str = "float32") -> Path:
    # a first-ever torch.compile on a busy 2-core machine can take many minutes
    path = tmp_path / "validate-test.yaml"
    path.write_text(f"output_dir: {run_dir}\ntarget:\n  name_or_path: smollm2\n  dtype: {dtype}\n"
                    f"export:\n  server_start_timeout_s: 1800\n{export}")
    return path


def _tiny_target(path: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000).save_pretrained(path)
    return path


def test_mismatched_drafter_is_refused_before_any_server(tmp_path, capsys):
    target = _tiny_target(tmp_path / "target")
    drafter = _random_drafter(target, tmp_path / "drafter", aux_layer_ids=(1, 2, 3))
    _edit_config(drafter, lambda c: c.update(target_hidden_size=576))
    cfg = _write_yaml(tmp_path, tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        run_entry(validate.main, ["--config", str(cfg), "--target", str(target), "--drafter", str(drafter)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "target_hidden_size = 576" in err and "target has 64" in err, err
    assert not (tmp_path / "run" / "logs").exists(), "a vLLM server was started"


def test_aux_ids_beyond_target_layers_are_refused(tmp_path):
    # vLLM takes id N (the stream after the last layer, before the final norm), as data/layer_ids.py does
    target = _tiny_target(tmp_path / "target")
    drafter = _random_drafter(target, tmp_path / "drafter", aux_layer_ids=(1, 2, 4))
    assert validate.check_drafter_fits_target(drafter, str(target))["aux_layer_ids"] == [1, 2, 4]
    _edit_config(drafter, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 5]))
    with pytest.raises(ValueError, match=r"\[1, 2, 5\] but the target has 4 layers \(ids lie in 0..N"):
        validate.check_drafter_fits_target(drafter, str(target))


def test_sweep_flags_take_comma_lists_and_pass_the_config_range_checks(tmp_path, capsys):
    cfg_path = _write_yaml(tmp_path, tmp_path / "run", "  concurrency: 8\n")
    cfg, _ = validate.parse_args(["--config", str(cfg_path), "--concurrency", "1,4", "--num-speculative-tokens", "5"])
    assert cfg.export.concurrency == (1, 4) and cfg.export.num_speculative_tokens == (5,)
    cfg, _ = validate.parse_args(["--config", str(cfg_path)])
    assert cfg.export.concurrency == (8,)  # no flag: the config's value (a scalar is one cell)
    with pytest.raises(ValueError, match=r"concurrency.*\(from the command line\)"):
        validate.parse_args(["--config", str(cfg_path), "--concurrency", "1,0"])
    with pytest.raises(SystemExit):
        validate.parse_args(["--config", str(cfg_path), "--concurrency", "1,many"])
    assert "'1,many' is not a comma-separated list of integers" in capsys.readouterr().err


def test_injected_request_fields_apply_by_label_prefix_and_refuse_a_malformed_value(monkeypatch):
    from draftsmith.data.faults import injected_request_fields

    assert injected_request_fields("drafter-k3") == {}
    monkeypatch.setenv("DRAFTSMITH_FAULT_REQUEST_FIELDS", 'drafter:{"allowed_token_ids": [7]}')
    assert injected_request_fields("drafter-k3") == {"allowed_token_ids": [7]}
    assert injected_request_fields("none") == {}
    for bad in ('drafter:{"allowed_token_ids": [7]', "drafter:[7]", "drafter"):
        monkeypatch.setenv("DRAFTSMITH_FAULT_REQUEST_FIELDS", bad)
        with pytest.raises(ValueError, match="comes a JSON object"):
            injected_request_fields("drafter-k3")


def test_server_env_leaves_the_hub_setting_to_the_caller(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert "HF_HUB_OFFLINE" not in server.server_env()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert server.server_env()["HF_HUB_OFFLINE"] == "1"


def test_null_target_hidden_size_means_the_layer_width(tmp_path):
    """speculators' trainer writes "target_hidden_size": null; like vLLM, read it as the drafter's hidden size."""
    target = _tiny_target(tmp_path / "target")
    drafter = _random_drafter(target, tmp_path / "drafter", aux_layer_ids=(1,))
    _edit_config(drafter, lambda c: c.update(target_hidden_size=None))
    assert validate.check_drafter_fits_target(drafter, str(target))["aux_layer_ids"] == [1]
    _edit_config(drafter, lambda c: c["transformer_layer_config"].update(hidden_size=32, head_dim=8))
    with pytest.raises(ValueError, match="target_hidden_size = 32 but the target has 64"):
        validate.check_drafter_fits_target(drafter, str(target))


# ---- real vLLM servers (slow: 6 server starts in all, about 5 minutes on 2 cores) ----------------------------


def _random_drafter(target_dir: Path, out: Path, aux_layer_ids=(2, 15, 27), method: str = "eagle3") -> Path:
    """A random 1-layer EAGLE-3 (or P-EAGLE) drafter for the target, written by the exporter in the speculators
    format."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    spec = spec_for_target(config, DrafterConfig(norm_before_residual=False), method=method,
                           aux_layer_ids=aux_layer_ids, draft_vocab_size=config.vocab_size,
                           mask_token_id=config.vocab_size - 1 if method == "peagle" else None,
                           verifier_name_or_path=str(target_dir))
    g = torch.Generator().manual_seed(0)
    tensors = {name: 0.02 * torch.randn(shape, generator=g) for name, (shape, _) in fmt.expected_tensors(spec).items()}
    return write_drafter_folder(tensors, spec, out, "speculators", "bfloat16", num_speculative_tokens=3)


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def server_marker(monkeypatch):
    marker = f"draftsmith-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("DRAFTSMITH_TEST_MARKER", marker)
    return marker


@pytest.fixture(scope="module")
def target_dir() -> Path:
    from draftsmith.data.target import resolve_target_path

    return Path(resolve_target_path("smollm2"))


PROMPTS = [{"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
           {"conversations": [{"from": "human", "value": "What does math.gcd do? Answer in one sentence."}]},
           {"prompt": "List three colors."}]


@pytest.mark.slow
def test_serves_random_drafter_losslessly(tmp_path, target_dir, server_marker, capsys):
    """A random P-EAGLE drafter served with parallel drafting, the target alone before and after it (3 servers;
    n-gram and --compare are served by tests/e2e/test_quick_chain.py)."""
    run_dir = tmp_path / "run"
    drafter = _random_drafter(target_dir, run_dir / "drafter", method="peagle")
    heldout = run_dir / "dataset" / "prompts-heldout.jsonl"
    heldout.parent.mkdir(parents=True)
    heldout.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (run_dir / "train").mkdir()
    (run_dir / "train" / "eval_heldout.json").write_text(json.dumps(
        {"per_step_accuracy": [0.7, 0.5, 0.4], "simulated_acceptance_length": {"1": 1.7, "2": 2.2, "3": 2.6}}))
    cfg = _write_yaml(tmp_path, run_dir, "  num_validation_prompts: 3\n  max_tokens: 16\n  sweep_min_requests: 2\n"
                                         "  ngram_baseline: false\n")
    run_entry(validate.main, ["--config", str(cfg), "--drafter", str(drafter), "--target", str(target_dir),
                              "--concurrency", "1,2"])

    report = json.loads((run_dir / "validation.json").read_text())
    assert report["method"] == "peagle" and report["lossless"] is True, report["first_mismatch"]
    assert '"parallel_drafting": true' in (run_dir / "logs" / "vllm-drafter-k3.log").read_text().splitlines()[0]
    # fp32: the strict check, token identity, with nothing left to re-score
    check = report["lossless_checks"]["drafter-k3"]
    assert (check["strict"], check["identical"], check["near_ties"], check["real"]) == (True, 3, 0, 0)
    assert report["num_prompts"] == 3 and report["num_speculative_tokens"] == 3 and report["ngram"] is None
    rates = report["acceptance_rate_per_position"]
    # vLLM's per-position counters add up to its accepted total: AL = 1 + the sum of the per-position rates
    assert len(rates) == 3 and report["acceptance_length"] == pytest.approx(1 + sum(rates))
    assert report["tokens_per_target_step"]["none"] == 1.0
    assert all(math.isfinite(v) and v > 0 for k, v in report["output_tokens_per_s"].items() if k != "ngram")
    cost = report["cost_model"]
    assert report["recommended_k"] == acceptance.recommend_k(rates, cost["c0_ms"], cost["c_draft_ms"])[0]
    # a random drafter accepts (almost) nothing, far from the 2.6 the fake trainer eval claims
    assert report["train_serve_mismatch"]["checked"] and report["train_serve_mismatch"]["mismatch"]

    # the sweep: one cell per (server, concurrency), timed by vLLM's client, the same requests everywhere
    cells = report["sweep"]["cells"]
    assert sorted((c["role"], c["num_speculative_tokens"], c["concurrency"]) for c in cells) == [
        ("drafter", 3, 1), ("drafter", 3, 2), ("none", 0, 1), ("none", 0, 2), ("none-again", 0, 1),
        ("none-again", 0, 2)]
    for c in cells:
        assert c["num_requests"] == 2 and 0 < c["output_tokens"] <= 2 * 16
        assert 0 < c["tpot_ms"]["p50"] <= c["tpot_ms"]["p90"] and c["tpot_ms"]["mean"] > 0
        assert (c["token_acceptance_rate"] is None) == c["role"].startswith("none")
    # same greedy outputs, so the same tokens, in every cell of a concurrency
    assert len({c["output_tokens"] for c in cells if c["concurrency"] == 1}) == 1
    # a random drafter's proposals are rejected: the verdict says off, warns on TAR, and the rule says so
    decision = report["verdict"]
    assert [r["concurrency"] for r in decision["by_concurrency"]] == [1, 2]
    assert not any(r["use"] for r in decision["by_concurrency"]) and decision["saturation_concurrency"] == 1
    assert all(r["tar_warning"] for r in decision["by_concurrency"])
    assert decision["routing_rule"].startswith("do not speculate")
    # the target alone was served before and after the drafter: the verdict's baseline is their mean, the drift
    again = {c["concurrency"]: c["tpot_ms"]["mean"] for c in cells if c["role"] == "none-again"}
    first = {c["concurrency"]: c["tpot_ms"]["mean"] for c in cells if c["role"] == "none"}
    for row in decision["by_concurrency"]:
        c = row["concurrency"]
        assert row["tpot_ms_without"] == pytest.approx((first[c] + again[c]) / 2)
        assert decision["baseline_drift"][str(c)] == pytest.approx(abs(first[c] - again[c]) / row["tpot_ms_without"])
    assert report["lossless_checks"]["none-again"]["identical"] == 3  # the target alone is deterministic in fp32
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("verdict (peagle): do not use for this traffic; c=1: off"), out[-1]
    markdown = (run_dir / "validation.md").read_text()
    assert markdown.startswith("# Validation") and "## Verdict" in markdown
    assert "| 2 | none (again, last) | 0 |" in markdown
    for plot in ("validation-acceptance.png", "validation-tpot.png"):
        assert (run_dir / plot).read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "bench-drafter-k3.txt", "bench-none-again.txt", "bench-none.txt",
        "vllm-drafter-k3.log", "vllm-none-again.log", "vllm-none.log"]
    assert processes_with_marker(server_marker) == []


@pytest.mark.slow
def test_bf16_lossless_check_catches_a_forced_token(tmp_path, target_dir, server_marker, monkeypatch):
    """In bf16 token identity is not the test; a forced token (the drafter's requests allowed only one token, the
    way a broken sampler would act) is a real disagreement all the same: fp32 re-scoring finds it far below the
    target's top logit, and validation fails."""
    from transformers import AutoTokenizer

    forced = AutoTokenizer.from_pretrained(target_dir).encode(" banana")[0]
    monkeypatch.setenv("DRAFTSMITH_FAULT_REQUEST_FIELDS", f'drafter:{{"allowed_token_ids": [{forced}]}}')
    drafter = _random_drafter(target_dir, tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:2]))
    cfg = _write_yaml(tmp_path, tmp_path / "run", "  max_tokens: 8\n  ngram_baseline: false\n  concurrency: 2\n"
                      "  sweep_min_requests: 2\n  serve_baseline_twice: false\n", dtype="bfloat16")
    with pytest.raises(SystemExit) as e:
        run_entry(validate.main, ["--config", str(cfg), "--drafter", str(drafter), "--target", str(target_dir),
                                  "--prompts", str(prompts)])
    assert e.value.code != 0
    report = json.loads((tmp_path / "run" / "validation.json").read_text())
    check = report["lossless_checks"]["drafter-k3"]
    assert report["lossless"] is False and not check["strict"] and check["real"] == 2, check
    for d in check["divergences"]:
        assert d["other_token"] == forced and d["class"] == "real"
        assert d["fp32_gap_other"] > report["lossless_checks"]["drafter-k3"]["near_tie_bound_logits"]
    assert processes_with_marker(server_marker) == []


@pytest.mark.slow
def test_refused_drafter_fails_with_vllm_error_and_leaves_no_process(tmp_path, target_dir, server_marker):
    drafter = _random_drafter(target_dir, tmp_path / "drafter")
    weights = drafter / "model.safetensors"
    # a valid header over truncated data: vLLM reads the header at config time, fails in the engine process
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    cfg = _write_yaml(tmp_path, tmp_path / "run", "  max_tokens: 4\n  ngram_baseline: false\n")
    with pytest.raises(server.ServerError) as e:
        validate.main(["--config", str(cfg), "--drafter", str(drafter), "--target", str(target_dir),
                       "--prompts", str(prompts)])
    assert "drafter-k3" in str(e.value) and "exited with code" in str(e.value)
    assert "SafetensorError" in str(e.value).splitlines()[0], str(e.value)[:2000]  # vLLM's root cause, first
    assert not (tmp_path / "run" / "logs" / "vllm-none.log").exists()  # the baseline never started
    assert processes_with_marker(server_marker) == []


def _served(label, token_ids, latencies_s, delta=None, tpot_ms=None):
    delta = delta or spec_metrics.SpecCounters()
    cells = {} if tpot_ms is None else {4: sweep.LoadCell(
        concurrency=4, num_requests=8, output_tokens=80, tpot_ms={"mean": tpot_ms, "p50": tpot_ms, "p90": tpot_ms},
        ttft_ms=50.0, output_tokens_per_s=1000 / tpot_ms, delta=delta)}
    return serve.ServedRun(label, token_ids, latencies_s, wall_s=2.0, start_s=90.0, delta=delta, cells=cells)


def test_report_from_measured_runs(tmp_path, capsys):
    from draftsmith.data.config import load_config

    run_dir = tmp_path / "run"
    (run_dir / "train").mkdir(parents=True)
    (run_dir / "train" / "eval_heldout.json").write_text(json.dumps({"simulated_acceptance_length": {"3": 2.1}}))
    cfg, _ = load_config(str(_write_yaml(tmp_path, run_dir, "  num_speculative_tokens: [1, 3]\n")))
    outputs = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # 10 output tokens
    runs = {
        # K=3: 4 drafts accepting 2, 1, 1 at positions 0..2: AL 2.0, 10 - 4 = 6 target steps of 60 ms
        "drafter-k3": _served("drafter-k3", outputs, [0.18, 0.18], spec_metrics.SpecCounters(4, 12, 4, (2, 1, 1)),
                              tpot_ms=24.0),
        # K=1: 2 accepted, 8 steps of 37.5 ms
        "drafter-k1": _served("drafter-k1", outputs, [0.15, 0.15], spec_metrics.SpecCounters(4, 4, 2, (2,)),
                              tpot_ms=28.0),
        "none": _served("none", outputs, [0.15, 0.15], tpot_ms=30.0),  # 10 steps of 30 ms
        "ngram-k3": _served("ngram-k3", [[1, 2, 3, 4, 5], [6, 7, 0, 9, 10]], [0.15, 0.15],
                            spec_metrics.SpecCounters(4, 12, 1, (1, 0, 0)), tpot_ms=29.0),
    }
    lossless = validate.lossless_checks(runs, [[0], [0]], dtype="float32", target="t", bound=1.0, eos_token_id=None)
    report = validate.build_report(cfg, runs, {"method": "eagle3"}, run_dir / "drafter", "t", default_prompts=True,
                                   lossless=lossless)
    assert report["num_speculative_tokens"] == 3 and report["acceptance_length"] == pytest.approx(2.0)
    assert report["acceptance_rate_per_position"] == pytest.approx([0.5, 0.25, 0.25])
    assert report["acceptance_length_by_k"] == pytest.approx({"1": 1.5, "2": 1.75, "3": 2.0})
    assert [e["num_speculative_tokens"] for e in report["entries"]] == [1, 3]
    assert report["tokens_per_target_step"] == pytest.approx({"drafter": 10 / 6, "none": 1.0, "ngram": 10 / 9})
    assert report["step_time_ms"] == pytest.approx({"none": 30.0, "drafter": 60.0})
    # step time points (K, ms) (0, 30), (1, 37.5), (3, 60): means (4/3, 42.5), slope 47.5 / (42/9) = 10.1786
    assert report["cost_model"]["c_draft_ms"] == pytest.approx(47.5 / (42 / 9))
    assert report["cost_model"]["c0_ms"] == pytest.approx(42.5 - 47.5 / (42 / 9) * 4 / 3)
    # AL / cost in tokens per ms: K=0 1/28.93 = .0346, K=1 1.5/39.11 = .0384, K=2 1.75/49.29 = .0355, K=3 .0336
    assert report["recommended_k"] == 1
    # n-gram (vLLM's own method) differs: reported, but "lossless" judges the drafter
    assert report["ngram"]["lossless"] is False and report["lossless"] is True
    assert report["lossless_checks"]["ngram-k3"]["real"] == 1
    assert report["ngram"]["first_mismatch"] == {"prompt_index": 1, "token_position": 2}
    assert report["entries"][0]["lossless"] and report["entries"][1]["lossless"]
    mismatch = report["train_serve_mismatch"]
    assert mismatch["checked"] and not mismatch["mismatch"]
    assert mismatch["relative_difference"] == pytest.approx(0.1 / 2.1)
    evaluated = cfg.paths.eval_heldout
    assert validate.check_train_serve(evaluated, {"3": 2.1 * 1.12}, default_prompts=True)["mismatch"] is True
    assert validate.check_train_serve(evaluated, {"3": 2.1 * 0.92}, default_prompts=True)["mismatch"] is False
    assert validate.check_train_serve(evaluated, {"3": 1.0}, default_prompts=False)["checked"] is False
    # served deeper than the trainer simulated (K=5 vs 3 TTT steps): compared at the deepest common K
    deeper = validate.check_train_serve(evaluated, {"1": 1.5, "2": 1.8, "3": 2.0, "4": 2.1, "5": 2.15}, True)
    assert deeper["k"] == 3 and deeper["served_acceptance_length"] == 2.0 and not deeper["mismatch"]
    assert validate.check_train_serve(evaluated, {"4": 2.0}, True)["checked"] is False
    markdown = render_markdown(report)
    assert "| eagle3 | 3 | 2.00 | 1.67 |" in markdown and "best K by it: 1" in markdown
    # the sweep: K=3 cuts TPOT 30 -> 24 ms (20 %), K=1 28 ms (7 %): use K=3 at 4 running requests
    decision = report["verdict"]
    assert [(r["concurrency"], r["best_k"], r["use"]) for r in decision["by_concurrency"]] == [(4, 3, True)]
    assert decision["by_concurrency"][0]["tpot_gain"] == pytest.approx(0.2)
    assert decision["by_concurrency"][0]["token_acceptance_rate"] == pytest.approx(4 / 12)
    assert "| 4 | eagle3 | 3 | 24.0 | 24.0 | 24.0 | 41.7 | 1.05 | 0.33 | 2.00 |" in markdown
    assert "| 4 | none | 0 | 30.0 |" in markdown and "## Verdict" in markdown
    plot_tpot(report, tmp_path / "tpot.png")
    assert (tmp_path / "tpot.png").read_bytes()[:4] == b"\x89PNG"
    plot_acceptance(report, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").read_bytes()[:4] == b"\x89PNG"
    # the summary line sets like beside like: tokens per target step; n-gram's per-draft AL (1.25) stays out
    print_summary(report, tmp_path / "validation.md")
    printed = capsys.readouterr().out.splitlines()
    line = printed[0]
    assert "1.667 tokens per target step" in line and "ngram 1.111 tokens/step" in line and "1.250" not in line
    assert printed[-1].startswith("verdict (eagle3): use; c=4: K=3 +20% TPOT; routing: speculate at every")

    # one K: no entries list; the table row comes from the top-level numbers
    single_cfg, _ = load_config(str(_write_yaml(tmp_path, run_dir, "  num_speculative_tokens: [3]\n")))
    del runs["drafter-k1"]
    single = validate.build_report(single_cfg, runs, {"method": "eagle3"}, run_dir / "drafter", "t", True, lossless)
    assert single["entries"] is None and single["lossless_by_method"] == {"drafter": True, "ngram": False}
    assert "| eagle3 | 3 | 2.00 | 1.67 | 5.0 | 60.0 | True |" in render_markdown(single)
