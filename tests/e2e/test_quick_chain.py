"""The demo chain in miniature on the real embedded SmolLM2 target: data -> train -> export -> serve-validate
in vLLM (both export formats) -> push dry run. Every stage runs for real, as `make demo` runs it."""
import json

import pytest
import stages
from stages import run_stage

from draftsmith.data.manifest import read_json

pytestmark = pytest.mark.slow

# a Hub token every stage of this chain sees (HF_TOKEN, as a logged-in user has): it must never be written or printed
PLANTED_TOKEN = "hf_DraftsmithPlantedTokenNeverToBeWritten0123"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, quick_dataset):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", PLANTED_TOKEN)
        yield from _quick_run(tmp_path_factory, quick_dataset)


def _quick_run(tmp_path_factory, quick_dataset):
    work, first_output = tmp_path_factory.mktemp("quick"), len(stages.OUTPUTS)
    out = (f"output_dir={work / 'run'}", f"data.dataset_dir={quick_dataset}")
    run_stage("data/build.py", *out, cwd=work)  # the shared dataset is complete: the build finds it and returns
    run_stage("data/check.py", *out, "--samples", "4", cwd=work)
    run_stage("train/eagle3.py", *out, cwd=work)
    run_stage("export/speculators.py", *out, cwd=work)
    run_stage("export/speculators.py", *out, "--format", "legacy", "--out", str(work / "run" / "drafter-legacy"),
              cwd=work)
    yield work, out
    # after every test of this module: nothing the chain wrote or printed holds the token (config copies,
    # metrics.jsonl, TensorBoard events, logs, the exported folders, validation files, the model card)
    written = [p for p in work.rglob("*") if p.is_file() and PLANTED_TOKEN.encode() in p.read_bytes()]
    printed = [i for i, text in enumerate(stages.OUTPUTS[first_output:]) if PLANTED_TOKEN in text]
    assert written == [] and printed == [], (written, printed)


def test_dataset_matches_manifest(quick_run, quick_dataset):
    manifest = read_json(quick_dataset / "manifest.json")
    assert manifest["aux_layer_ids"] == [2, 15, 27]
    assert manifest["target"]["num_hidden_layers"] == 30 and manifest["num_samples"] > 20
    assert {s["split"] for s in manifest["shards"]} == {"train", "heldout"}


def test_served_speculators_and_legacy_formats_are_lossless(quick_run):
    """One validation serves both export formats of the same weights (the legacy folder as --compare), the target
    alone and n-gram, as a user compares two drafters."""
    work, out = quick_run
    printed = run_stage("export/validate.py", *out, "--compare", str(work / "run" / "drafter-legacy"), cwd=work)
    report = json.loads((work / "run" / "validation.json").read_text())
    assert report["lossless"] is True and report["lossless_by_method"] == {"drafter": True, "ngram": True}
    compare = report["compare"]  # the legacy layout, served by the same vLLM on the same prompts and cells
    assert compare["method"] == "eagle3" and compare["lossless"] is True
    assert [(h["concurrency"], h["num_speculative_tokens"]) for h in compare["head_to_head"]] == [(4, 2)]
    assert all(h["winner"] in ("drafter", "compare") for h in compare["head_to_head"])
    assert "eagle3 vs eagle3: eagle3 faster in" in printed
    roles = sorted({c["role"] for c in report["sweep"]["cells"]})
    assert roles == ["compare", "drafter", "ngram", "none"], roles
    assert report["acceptance_length"] >= 1.0 and len(report["acceptance_rate_per_position"]) == 2
    # the same weights in two layouts draft the same tokens (up to batching's rounding at a near-tie)
    legacy = report["compare"]["entries"][-1]
    assert legacy["acceptance_length"] == pytest.approx(report["acceptance_length"], abs=0.05)
    assert "ngram" in json.dumps(report["tokens_per_target_step"])
    assert (work / "run" / "validation.md").is_file() and (work / "run" / "validation-acceptance.png").is_file()
    # the push dry run builds the card from this report and lists the exact upload
    listing = run_stage("export/push.py", *out, "--repo-id", "draftsmith/smollm2-quick", "--dry-run", cwd=work)
    for name in ("README.md", "config.json", "model.safetensors", "validation.json"):
        assert name in listing
    card = (work / "run" / "hub" / "draftsmith--smollm2-quick" / "README.md").read_text()
    assert "--speculative-config" in card and "lossless" in card
