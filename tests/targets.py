"""Same-class twins of the real targets, built by the tests: the real HF class, config shape, tokenizer and
chat template, with random weights and few, narrow layers.

The real files are in tests/fixtures/targets/ (copied from ../shared/reference/targets/, provenance in
tests/fixtures/targets/README.md). Tokenizers that ship only in tiktoken form are converted here:
Llama-3.1 from Meta's tokenizer.model in PyPI's llama-models wheel (installed --no-deps by `make setup`;
its licence keeps it out of this repo), GPT-OSS from o200k_base.tiktoken plus its harmony special tokens.

A twin cuts the layer count to TWIN_LAYERS (8: vLLM's default aux ids [2, N//2, N-3] stay distinct) and
scales widths down keeping the real ratios: heads : kv heads, head_dim (never below 32, vLLM's CPU
attention minimum), q width : hidden, intermediate : hidden. Vocab size, RoPE, MoE routing (experts,
top-k), layer types and norms are the real ones. Folders are cached by content under
$DRAFTSMITH_CACHE/test-targets, so a test session builds each once.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import threading
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "targets"
TWIN_LAYERS = 8
TWIN_SEED = 0
LLAMA_MODELS_WHEEL = "llama-models==0.3.0"
# a twin is built under torch's process-wide seed and default dtype (from_config(dtype=...) sets it for the build):
# two threads building at once would leave the default at bf16 for the rest of the run, and mix their seeds
_TORCH_GLOBALS = threading.Lock()

# name -> (fixture folder with config.json, fixture folder with the tokenizer source, width overrides)
TWINS = {
    # 2048 hidden, 32 q heads x 128 (q width 2x hidden), 4 kv heads, experts of 768 (= 0.375 hidden)
    "qwen3-coder-30b-a3b-instruct": {
        "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 32,
        "moe_intermediate_size": 48, "intermediate_size": 342, "max_window_layers": TWIN_LAYERS},
    # 4096 hidden = 32 heads x 128, 8 kv heads, dense MLP 3.5x hidden
    "llama-3.1-8b-instruct": {
        "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
        "intermediate_size": 448},
    # 2880 hidden, 64 q heads x 64 (q width 4096 = 1.42x hidden), 8 kv heads, experts of 2880 (= hidden).
    # Widths stay multiples of 32 like the real 2880 (vLLM's CPU MoE kernel needs it): 320, q width 1.6x.
    "gpt-oss-20b": {
        "hidden_size": 320, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 320},
}
TOKENIZER_SOURCE = {"qwen3-coder-30b-a3b-instruct": "qwen3-coder-30b-a3b-instruct", "qwen3": "qwen3",
                    "llama-3.1-8b-instruct": "llama-3.1-8b-instruct", "gpt-oss-20b": "gpt-oss-20b"}


def test_cache() -> Path:
    root = os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith"
    return Path(root) / "test-targets"


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, Path):
            for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
                if f.is_file():
                    h.update(f.name.encode())
                    h.update(f.read_bytes())
        else:
            h.update(json.dumps(p, sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:12]


def _build_once(dest: Path, build) -> Path:
    """Build into a temporary sibling and rename: a killed or concurrent build never leaves half a folder."""
    if dest.is_dir():
        return dest
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    if dest.is_dir():
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, dest)
    return dest


# ---- tokenizers ----------------------------------------------------------------------------------------------

def tokenizer_folder(name: str) -> Path:
    """A folder that AutoTokenizer loads offline: the real tokenizer and the real chat template of `name`."""
    src = FIXTURES / TOKENIZER_SOURCE[name]
    builders = {"qwen3": _qwen3_tokenizer, "qwen3-coder-30b-a3b-instruct": _qwen3_coder_tokenizer,
                "llama-3.1-8b-instruct": _llama31_tokenizer, "gpt-oss-20b": _gpt_oss_tokenizer}
    dest = test_cache() / "tokenizers" / f"{name}-{_digest(src, FIXTURES / 'qwen3')}"
    return _build_once(dest, builders[name])


def _qwen3_tokenizer(out: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURES / "qwen3" / f, out / f)


def _qwen3_coder_tokenizer(out: Path) -> None:
    # Qwen3-Coder tokenizes exactly like Qwen3 (same vocab, merges and added-token ids; reference README);
    # its own tokenizer_config (special tokens) and current chat template (XML tool calls) go beside it.
    shutil.copy(FIXTURES / "qwen3" / "tokenizer.json", out / "tokenizer.json")
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURES / "qwen3-coder-30b-a3b-instruct" / f, out / f)


def llama_tokenizer_model() -> Path:
    """Meta's Llama 3 tokenizer.model (tiktoken ranks) from the installed llama-models wheel."""
    spec = importlib.util.find_spec("llama_models")  # found, never imported: the wheel is installed --no-deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the Llama-3.1 twin needs Meta's tokenizer: pip install --no-deps {LLAMA_MODELS_WHEEL}")
    return Path(next(iter(spec.submodule_search_locations))) / "llama3" / "tokenizer.model"


def llama31_special_tokens() -> list[str]:
    """Ids 128000-128255 as Llama 3.1's HF tokenizer names them (reference README, section 3)."""
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
             10: "<|python_tag|>"}
    out, reserved = [], 0
    for i in range(256):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def _fast_tokenizer_from_tiktoken(ranks_file: Path, pattern: str, specials: list[str], out: Path,
                                  post_processor=None, **kwargs) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(ranks_file), pattern=pattern, extra_special_tokens=specials).converted()
    if post_processor is not None:
        backend.post_processor = post_processor
    PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs).save_pretrained(out)


def _llama31_tokenizer(out: Path) -> None:
    import inspect

    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # Llama 3's split pattern is TikTokenConverter's default one
    pattern = inspect.signature(TikTokenConverter).parameters["pattern"].default
    # HF's Llama 3.1 tokenizer prepends <|begin_of_text|> (128000) when special tokens are added
    bos = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                        special_tokens=[("<|begin_of_text|>", 128000)])
    _fast_tokenizer_from_tiktoken(llama_tokenizer_model(), pattern, llama31_special_tokens(), out,
                                  post_processor=processors.Sequence([processors.ByteLevel(trim_offsets=False), bos]),
                                  bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", model_max_length=131072)
    shutil.copy(FIXTURES / "llama-3.1-8b-instruct" / "chat_template.jinja", out / "chat_template.jinja")


def o200k_pattern() -> str:
    """o200k's split pattern, read from the installed tiktoken (its loader would fetch the ranks: skipped)."""
    import tiktoken_ext.openai_public as public

    fetch = public.load_tiktoken_bpe
    public.load_tiktoken_bpe = lambda *a, **k: {}
    try:
        return public.o200k_base()["pat_str"]
    finally:
        public.load_tiktoken_bpe = fetch


def _gpt_oss_tokenizer(out: Path) -> None:
    src = FIXTURES / "gpt-oss-20b"
    config = json.loads((src / "tokenizer_config.json").read_text())
    added = sorted((int(i), t["content"]) for i, t in config["added_tokens_decoder"].items())
    first = added[0][0]
    if [i for i, _ in added] != list(range(first, first + len(added))):
        raise ValueError("gpt-oss added tokens are not contiguous")
    _fast_tokenizer_from_tiktoken(src / "o200k_base.tiktoken", o200k_pattern(), [t for _, t in added], out,
                                  bos_token=config["bos_token"], eos_token=config["eos_token"],
                                  pad_token=config["pad_token"], model_max_length=config["model_max_length"])
    shutil.copy(src / "chat_template.jinja", out / "chat_template.jinja")


# ---- twins ---------------------------------------------------------------------------------------------------

def twin_config(name: str):
    """The real config.json with the layer count cut and the widths scaled (TWINS); everything else kept."""
    from transformers import AutoConfig

    raw = json.loads((FIXTURES / name / "config.json").read_text())
    raw.pop("quantization_config", None)  # gpt-oss ships MXFP4 experts; the twin is plain bf16
    raw["num_hidden_layers"] = TWIN_LAYERS
    if "layer_types" in raw:
        raw["layer_types"] = raw["layer_types"][:TWIN_LAYERS]
    raw.update(TWINS[name])
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **raw)


def twin_folder(name: str) -> Path:
    """A save_pretrained folder of `name`'s twin (random weights, seed TWIN_SEED) with the real tokenizer files."""
    tok = tokenizer_folder(name)
    dest = test_cache() / "twins" / f"{name}-{_digest(FIXTURES / name, tok, TWINS[name])}"
    return _build_once(dest, lambda out: _save_twin(name, tok, out))


def _save_twin(name: str, tokenizer_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = twin_config(name)
    with _TORCH_GLOBALS:
        torch.manual_seed(TWIN_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    shutil.copy(FIXTURES / name / "generation_config.json", out / "generation_config.json")
