"""Fixtures of the data tests: a tiny random target with SmolLM2's real tokenizer and chat template, and prompts
whose conversations carry assistant turns, so data/build.py runs end to end in seconds (regeneration off)."""
import inspect
import json
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from draftsmith.data.target import resolve_target_path


@pytest.fixture(scope="session")
def chat_target_dir(tmp_path_factory):
    """4 random layers of width 64 over SmolLM2's vocabulary, saved with its tokenizer (a real HF folder)."""
    smollm2 = resolve_target_path("smollm2")
    path = tmp_path_factory.mktemp("chat-target")
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(path)
    real = AutoConfig.from_pretrained(smollm2)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=real.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=real.bos_token_id, eos_token_id=real.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def conversations_jsonl(tmp_path_factory):
    """Conversations of varied length: a question about a textwrap function and its docstring as the answer."""
    path = tmp_path_factory.mktemp("prompts") / "conversations.jsonl"
    records = []
    for name in sorted(n for n in dir(textwrap) if not n.startswith("_")):
        doc = inspect.getdoc(getattr(textwrap, name)) or ""
        for part in range(1, 4):
            answer = doc[: 120 * part]
            if answer:
                records.append({"messages": [{"role": "user", "content": f"What does textwrap.{name} do? ({part})"},
                                             {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def build_config(chat_target_dir, conversations_jsonl):
    """write(folder, **data overrides) -> path of a run config building a small dataset without regeneration.
    output_dir is relative ("run"), so one config file builds identical datasets from different working dirs."""

    def write(folder, **data) -> str:
        cfg = {"output_dir": "run",
               "target": {"name_or_path": str(chat_target_dir), "dtype": "float32", "aux_layer_ids": [1, 2, 3]},
               "data": {"prompts": {"source": "jsonl", "path": str(conversations_jsonl), "heldout_fraction": 0.25},
                        "regenerate": {"enabled": False}, "max_seq_len": 512, "samples_per_shard": 3,
                        "capture_batch_tokens": 512, "draft_vocab_size": 256, **data}}
        path = folder / "build.yaml"
        path.write_text(json.dumps(cfg))
        return str(path)

    return write
