"""Regenerate assistant responses with the target itself (vLLM when installed, else transformers).

Results are appended to a JSONL file batch by batch, so a killed run resumes where it stopped; the
sampling parameters are recorded beside it and a resume with different ones is refused.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.data.capture import input_device
from draftsmith.data.chat import generated_message, prompt_messages, render_generation_prompt
from draftsmith.data.config import RegenerateConfig
from draftsmith.data.errors import UserError
from draftsmith.data.faults import kill_point
from draftsmith.data.manifest import atomic_write_json, read_json

logger = logging.getLogger(__name__)


def choose_backend(cfg: RegenerateConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


def sampling_record(cfg: RegenerateConfig, backend: str, target: dict) -> dict:
    """What the responses depend on. The target is named by its identity (name and config hash), not by the
    folder it was loaded from, so a moved cache ($DRAFTSMITH_CACHE) does not invalidate finished responses."""
    return {"backend": backend, "target": {k: target[k] for k in ("name_or_path", "config_sha256")},
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
            "seed": cfg.seed}


def prompt_key(record: dict) -> str:
    """What a response answers: the turns before it, and the tools offered (only when there are any, so keys of
    tool-free prompts stay as they were)."""
    prompt = prompt_messages(record["messages"])
    shown = {"messages": prompt, "tools": record["tools"]} if record.get("tools") else prompt
    return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()[:16]


def _load_done(out_path: Path, records: list[dict]) -> dict[int, dict]:
    """Finished responses whose prompt still matches the record at that index (a changed prompt set regenerates).

    A torn last line (a crash mid-write) is cut off the file, so the next append starts on a line of its own.
    """
    done = {}
    if not out_path.is_file():
        return done
    data = out_path.read_bytes()
    good_end = 0  # bytes of whole, parsable lines
    for line in data.splitlines(keepends=True):
        try:
            if not line.endswith(b"\n"):
                raise ValueError("no newline")
            rec = json.loads(line)
        except ValueError:  # JSONDecodeError included
            break
        good_end += len(line)
        i = rec["index"]
        if i < len(records) and rec.get("prompt_key") == prompt_key(records[i]):
            done[i] = rec
    if good_end < len(data):
        logger.warning("%s: dropping a torn line after %d complete responses (a crash mid-write); "
                       "regenerating from there", out_path, len(done))
        with open(out_path, "r+b") as f:
            f.truncate(good_end)
    return done


class TransformersGenerator:
    def __init__(self, target_path: str, dtype: str, tokenizer, device_map: str = ""):
        from draftsmith.data.target import load_target_model

        self.model = load_target_model(target_path, dtype, device_map)
        self.tok = tokenizer

    def generate(self, prompts: list[list[int]], cfg: RegenerateConfig) -> list[list[int]]:
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        t = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), t), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding for generation
            ids[i, t - len(p):] = torch.tensor(p)
            mask[i, t - len(p):] = 1
        torch.manual_seed(cfg.seed)
        kwargs = {"do_sample": cfg.temperature > 0, "max_new_tokens": cfg.max_new_tokens, "pad_token_id": pad}
        if cfg.temperature > 0:
            kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p)
        device = input_device(self.model)  # the first layer's device when target.device_map splits the model
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)[:, t:].cpu()
        eos = self.tok.eos_token_id
        results = []
        for row in out.tolist():
            if eos in row:
                row = row[: row.index(eos) + 1]
            results.append([x for x in row if x != pad or x == eos])
        return results


class VllmGenerator:
    def __init__(self, target_path: str, dtype: str, max_model_len: int, seed: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # vLLM drops torch to one thread unless OMP_NUM_THREADS is set
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        from vllm import LLM

        # on the CPU, torch.compile of the engine costs minutes on 2 cores for a one-off generation job
        eager = not torch.cuda.is_available()
        self.llm = LLM(model=target_path, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=eager)

    def generate(self, prompts: list[list[int]], cfg: RegenerateConfig) -> list[list[int]]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                            seed=cfg.seed)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        # the engine's worker processes spin on the CPU until shut down: stop them before capture starts
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def regenerate_responses(records: list[dict], tokenizer, target_path: str, target_identity: dict, target_dtype: str,
                         cfg: RegenerateConfig, out_path: Path, max_seq_len: int, device_map: str = "") -> list[dict]:
    """records[i]["messages"] -> same conversations with the last assistant turn written by the target."""
    backend = choose_backend(cfg)
    params = sampling_record(cfg, backend, target_identity)
    params_path = out_path.with_suffix(".params.json")
    if params_path.is_file() and read_json(params_path) != params:
        raise UserError(f"{out_path} was generated with {read_json(params_path)}, now {params}; "
                         "delete it to regenerate with the new settings")
    atomic_write_json(params_path, params)
    done = _load_done(out_path, records)
    todo = [i for i in range(len(records)) if i not in done]
    if todo:
        prompts = {i: render_generation_prompt(tokenizer, prompt_messages(records[i]["messages"]),
                                               records[i].get("tools")) for i in todo}
        gen = (VllmGenerator(target_path, target_dtype, max_seq_len, cfg.seed) if backend == "vllm"
               else TransformersGenerator(target_path, target_dtype, tokenizer, device_map))
        try:
            _generate_in_batches(gen, todo, prompts, records, tokenizer, cfg, out_path, done)
        finally:
            if hasattr(gen, "close"):
                gen.close()
    return [done[i] for i in range(len(records))]


def _generate_in_batches(gen, todo, prompts, records, tokenizer, cfg, out_path, done) -> None:
    bar = tqdm(total=len(todo), desc="regenerate", unit="prompt")
    start, new_tokens = time.time(), 0
    with open(out_path, "a") as f:
        for b in range(0, len(todo), cfg.batch_size):
            batch = todo[b: b + cfg.batch_size]
            outputs = gen.generate([prompts[i] for i in batch], cfg)
            for i, out in zip(batch, outputs):
                messages = prompt_messages(records[i]["messages"]) + [generated_message(tokenizer, out)]
                done[i] = {"index": i, "prompt_key": prompt_key(records[i]), "messages": messages,
                           "tools": records[i].get("tools") or [], "num_tokens": len(out),
                           "group": records[i].get("group")}
                f.write(json.dumps(done[i]) + "\n")
                new_tokens += len(out)
            f.flush()
            os.fsync(f.fileno())
            kill_point("regenerate_batch")
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - start, 1e-6):.0f}")
    bar.close()
