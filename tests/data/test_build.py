"""data/build.py on a finished dataset: a second run with the same data recipe changes nothing."""
from __future__ import annotations

import dataclasses

from transformers import AutoConfig

from draftsmith.data.build import (
    data_recipe_sha256,
    finished_with_same_recipe,
    loss_mask_options,
    main,
    prompt_line,
    tokenize_samples,
)
from draftsmith.data.config import load_config
from draftsmith.data.manifest import atomic_write_json, target_identity


def test_the_demo_and_peagle_configs_share_one_recipe_and_a_data_change_breaks_it():
    identity = {"name_or_path": "smollm2", "config_sha256": "x"}
    demo, _ = load_config("smollm2-demo")
    peagle, _ = load_config("smollm2-peagle")
    aux = [2, 15, 27]
    assert data_recipe_sha256(demo, identity, aux) == data_recipe_sha256(peagle, identity, aux)
    other_vocab = dataclasses.replace(demo, data=dataclasses.replace(demo.data, draft_vocab_size=4096))
    assert data_recipe_sha256(other_vocab, identity, aux) != data_recipe_sha256(demo, identity, aux)
    assert data_recipe_sha256(demo, identity, [1, 15, 27]) != data_recipe_sha256(demo, identity, aux)


def test_a_finished_dataset_with_the_same_recipe_is_left_untouched(tiny_target_dir, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\n"
                      f"target: {{name_or_path: {tiny_target_dir}, dtype: float32, aux_layer_ids: [1, 2, 3]}}\n"
                      "data: {prompts: {max_prompts: 4}, regenerate: {enabled: false}, draft_vocab_size: 16}\n")
    cfg, _ = load_config(str(config))
    identity = target_identity(str(tiny_target_dir), AutoConfig.from_pretrained(tiny_target_dir))
    ds = cfg.paths.dataset
    out = ds.dir
    out.mkdir(parents=True)
    assert not finished_with_same_recipe(ds, data_recipe_sha256(cfg, identity, [1, 2, 3]))
    atomic_write_json(out / "manifest.json", {"data_recipe_sha256": data_recipe_sha256(cfg, identity, [1, 2, 3])})
    before = (out / "manifest.json").read_bytes()
    main(["--config", str(config)])  # would load the tokenizer the tiny target lacks if it built anything
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]
    assert (out / "manifest.json").read_bytes() == before
    # a manifest from before the recipe hash (or another recipe) means: build as usual
    atomic_write_json(out / "manifest.json", {"config_sha256": "old"})
    assert not finished_with_same_recipe(ds, data_recipe_sha256(cfg, identity, [1, 2, 3]))


def test_earlier_turns_are_trained_without_regeneration_or_when_asked():
    cfg, _ = load_config("smollm2-demo")
    regenerated = cfg.data
    assert regenerated.regenerate.enabled and not regenerated.loss_on_earlier_turns
    assert loss_mask_options(regenerated) == {"loss_on_earlier_turns": False, "loss_on_reasoning": True}
    asked = dataclasses.replace(regenerated, loss_on_earlier_turns=True, loss_on_reasoning=False)
    assert loss_mask_options(asked) == {"loss_on_earlier_turns": True, "loss_on_reasoning": False}
    dataset_only = dataclasses.replace(regenerated, regenerate=dataclasses.replace(regenerated.regenerate,
                                                                                   enabled=False))
    assert loss_mask_options(dataset_only)["loss_on_earlier_turns"] is True


def test_samples_and_prompt_files_keep_the_tools():
    from targets import tokenizer_folder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder("qwen3-coder-30b-a3b-instruct"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conv = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
            "tools": tools, "group": "Hi"}
    options = {"loss_on_earlier_turns": False, "loss_on_reasoning": True}
    [sample] = tokenize_samples([conv], tok, 4096, options)
    assert "<name>get_weather</name>" in tok.decode(sample["input_ids"])
    assert prompt_line(conv) == {"messages": conv["messages"], "tools": tools}
    assert prompt_line({**conv, "tools": []}) == {"messages": conv["messages"]}


def test_prompts_longer_than_the_engine_window_are_skipped_with_a_count(build_config, tmp_path, monkeypatch, caplog):
    import json

    prompts = tmp_path / "prompts.jsonl"
    questions = [f"What is {n} squared? Answer with the number." for n in range(12)]
    questions.insert(5, "Summarise this: " + "lorem ipsum dolor sit amet " * 200)  # > 512 tokens on its own
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in questions))
    config = build_config(tmp_path, prompts={"source": "jsonl", "path": str(prompts), "heldout_fraction": 0.25},
                          regenerate={"enabled": True, "backend": "transformers", "max_new_tokens": 4,
                                      "batch_size": 8})
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING"):
        main(["--config", config])
    skipped = [r.getMessage() for r in caplog.records if "fill the engine's window" in r.getMessage()]
    assert len(skipped) == 1 and "skipped 1 of" in skipped[0] and "data.max_seq_len=512" in skipped[0], skipped
    manifest = json.loads((tmp_path / "run" / "dataset" / "manifest.json").read_text())
    assert manifest["num_samples"] == len(questions) - 1
