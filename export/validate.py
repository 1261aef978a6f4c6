"""Serve an exported drafter in vLLM and answer the operator (DESIGN section 7): acceptance per position, a
lossless check sound under bf16 numerics, and a concurrency x K sweep of TPOT with and without the drafter and with
vLLM's n-gram method, ending in a verdict: per concurrency the best K or "off", the saturation point, a routing rule.

Usage: python export/validate.py --config smollm2-demo [--concurrency 1,4,16,64] [--num-speculative-tokens 3,5,7]
       [--compare OTHER_DRAFTER_DIR] [--prompts F.jsonl]

One server per (method, K), largest K first (a drafter vLLM refuses fails before the baseline starts); each runs
the greedy pass over every prompt, then one load cell per concurrency. Exits non-zero on a real disagreement.
Writes <run_dir>/validation.json, validation.md, validation-acceptance.png and validation-tpot.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

from draftsmith.data.chat import (
    normalize_conversation,
    normalize_tools,
    prompt_messages,
    render_generation_prompt,
)
from draftsmith.data.cli import build_arg_parser, git_commit, log_run_header, parse_run_args, run_entry
from draftsmith.data.errors import UserError
from draftsmith.data.layer_ids import normalize_aux_layer_ids
from draftsmith.data.manifest import atomic_write_bytes, atomic_write_json, read_json, sha256_file
from draftsmith.data.target import load_target_config, load_tokenizer, resolve_target_path
from draftsmith.export import acceptance, serve, verdict
from draftsmith.export.format import spec_from_drafter_config
from draftsmith.export.lossless import Fp32Scorer, check_lossless
from draftsmith.export.report import plot_acceptance, plot_tpot, print_summary, render_markdown
from draftsmith.export.serve import ServedRun
from draftsmith.export.server import ServerError

logger = logging.getLogger("draftsmith.export.validate")

MISMATCH_TOLERANCE = 0.10
"""Relative gap between the trainer's simulated acceptance length and the served one that triggers a warning."""


def int_list(text: str) -> list[int]:
    """'1,4,16' (or one number) -> [1, 4, 16]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,4,16") from None


def parse_args(argv):
    p = build_arg_parser(__doc__)
    p.add_argument("--drafter", help="exported drafter folder (default: <run_dir>/drafter)")
    p.add_argument("--target", help="target folder or Hub id (default: the config's target.name_or_path)")
    p.add_argument("--prompts", help="JSONL of {messages}, {conversations} or {prompt} (default: held-out prompts)")
    p.add_argument("--num-speculative-tokens", type=int_list,
                   help="K values to serve, e.g. 3,5,7 (default: export.num_speculative_tokens)")
    p.add_argument("--concurrency", type=int_list,
                   help="requests in flight per sweep cell, e.g. 1,4,16,64 (default: export.concurrency)")
    p.add_argument("--compare", help="another exported drafter (e.g. P-EAGLE beside EAGLE-3) served on the same "
                                     "prompts and sweep")
    cfg, args = parse_run_args(p, argv)
    flags = {"num_speculative_tokens": args.num_speculative_tokens, "concurrency": args.concurrency}
    try:  # dataclasses.replace re-runs the config's own range checks on the flags' values
        export = dataclasses.replace(cfg.export, **{k: tuple(v) for k, v in flags.items() if v})
    except ValueError as e:
        raise UserError(f"{e} (from the command line)") from None
    return dataclasses.replace(cfg, export=export), args


def check_drafter_fits_target(drafter_dir: Path, target_path: str) -> dict:
    """Refuse, before any server starts, a drafter whose config disagrees with the target's dimensions."""
    if not drafter_dir.is_dir():
        raise FileNotFoundError(f"drafter folder {drafter_dir} does not exist: export the drafter or pass --drafter")
    path = drafter_dir / "config.json"
    spec = spec_from_drafter_config(read_json(path, "drafter config"), str(path))
    target = load_target_config(target_path).get_text_config()
    found = {"target_hidden_size": spec.target_hidden_size, "transformer_layer_config.vocab_size": spec.vocab_size}
    wanted = {"target_hidden_size": target.hidden_size, "transformer_layer_config.vocab_size": target.vocab_size}
    for key, value in found.items():
        if value != wanted[key]:
            raise UserError(f"drafter {drafter_dir} does not fit target {target_path}: {key} = {value} but the "
                             f"target has {wanted[key]}; export the drafter for this target or pass --target")
    aux_ids = list(spec.aux_layer_ids)
    try:
        normalize_aux_layer_ids(aux_ids, target.num_hidden_layers)
    except UserError:
        raise UserError(f"drafter {drafter_dir} does not fit target {target_path}: eagle_aux_hidden_state_layer_ids "
                         f"= {aux_ids} but the target has {target.num_hidden_layers} layers (ids lie in 0..N, "
                         f"N = the stream after the last layer)") from None
    return {"method": spec.method, "aux_layer_ids": aux_ids}


def load_prompt_ids(path: Path, limit: int, tokenizer) -> list[list[int]]:
    """The first `limit` (0 = all) conversations of a JSONL file as generation-prompt token ids."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist: run data/build.py first or pass --prompts")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    lines = lines[:limit] if limit else lines
    prompts = []
    for lineno, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            messages = prompt_messages(normalize_conversation(record))
            prompts.append(render_generation_prompt(tokenizer, messages, normalize_tools(record)))
        except ValueError as e:  # JSONDecodeError included
            raise UserError(f"{path}:{lineno}: {e}") from None
    if not prompts:
        raise UserError(f"prompt file {path} holds no prompts")
    return prompts


def serve_all(cfg, target: str, drafters: dict[str, tuple[Path, bool]], prompts: list[list[int]],
              tokenizer) -> dict[str, ServedRun]:
    """One server per (method, K): each drafter at every K (largest first), no drafter, then n-gram at the largest
    K. `drafters`: role ('drafter', 'compare') -> (folder, parallel drafting)."""
    ks = sorted(set(cfg.export.num_speculative_tokens), reverse=True)
    plan = [(f"{role}-k{k}", serve.drafter_spec_config(folder, k, parallel))
            for role, (folder, parallel) in drafters.items() for k in ks]
    plan.append(("none", None))
    if cfg.export.ngram_baseline:
        plan.append((f"ngram-k{ks[0]}", serve.ngram_spec_config(ks[0])))
    e = cfg.export
    if e.serve_baseline_twice:
        plan.append(("none-again", None))  # the machine's drift over the run (export/verdict.py)
    return {label: serve.measure_served_run(
        target, label, spec, prompts, max_tokens=e.max_tokens, concurrency=max(e.concurrency),
        log_dir=cfg.paths.server_logs, dtype=cfg.target.dtype, start_timeout_s=e.server_start_timeout_s,
        sweep_concurrency=e.concurrency, sweep_min_requests=e.sweep_min_requests, tokenizer=tokenizer)
        for label, spec in plan}


def split_label(label: str) -> tuple[str, int]:
    """'drafter-k5' -> ('drafter', 5); 'none' -> ('none', 0)."""
    role, _, k = label.rpartition("-k")
    return (role, int(k)) if role else (label, 0)


def summarize_run(run: ServedRun, k: int, lossless: dict) -> dict:
    return {"num_speculative_tokens": k, "acceptance_length": acceptance.acceptance_length(run.delta),
            "acceptance_rate_per_position": acceptance.acceptance_rates(run.delta),
            "token_acceptance_rate": acceptance.token_acceptance_rate(run.delta),
            "tokens_per_target_step": acceptance.tokens_per_target_step(run.output_tokens, run.delta.accepted),
            "output_tokens_per_s": run.output_tokens_per_s, "step_time_ms": 1e3 * run.step_time_s,
            "output_tokens": run.output_tokens, "lossless": lossless["lossless"],
            "identical": lossless["identical"] == lossless["num_prompts"],
            "first_mismatch": first_mismatch(lossless), "server_start_s": run.start_s}


def first_mismatch(lossless: dict) -> dict | None:
    d = lossless["divergences"]
    return {"prompt_index": d[0]["prompt_index"], "token_position": d[0]["position"]} if d else None


def sweep_cells(runs: dict[str, ServedRun], methods: dict[str, str]) -> list[dict]:
    """Every load cell of every server, tagged with its role, method and K."""
    out = []
    for label, run in runs.items():
        role, k = split_label(label)
        for cell in run.cells.values():
            out.append({"role": role, "method": methods.get(role, role), "num_speculative_tokens": k,
                        **cell.as_dict()})
    return out


def lossless_checks(runs: dict[str, ServedRun], prompts: list[list[int]], *, dtype: str, target: str, bound: float,
                    eos_token_id: int | None) -> dict[str, dict]:
    """Every speculating run against the target alone; one fp32 scorer shared by all (loaded only if needed)."""
    scorer = Fp32Scorer(target)
    base = runs["none"].token_ids
    return {label: check_lossless(base, run.token_ids, prompts, dtype=dtype, scorer=scorer, bound=bound,
                                  eos_token_id=eos_token_id)
            for label, run in runs.items() if label != "none"}


def check_train_serve(path: Path, served_al_by_k: dict[str, float], default_prompts: bool) -> dict:
    """Compare the trainer's simulated acceptance length (its eval_heldout.json at `path`) with the served one at the
    deepest K both have (the trainer simulates K <= its TTT steps; the served rates give every K <= the served
    one); flag a gap over 10%."""
    if not default_prompts or not path.is_file():
        why = "custom --prompts" if not default_prompts else f"{path} not found"
        return {"checked": False, "reason": why, "mismatch": False}
    simulated_by_k = read_json(path, "trainer eval").get("simulated_acceptance_length", {})
    common = sorted(set(simulated_by_k) & set(served_al_by_k), key=int)
    if not common:
        return {"checked": False, "reason": f"{path} and the served run share no K", "mismatch": False}
    k = common[-1]
    simulated, served_al = simulated_by_k[k], served_al_by_k[k]
    gap = abs(served_al - simulated) / simulated
    block = {"checked": True, "k": int(k), "train_simulated_acceptance_length": simulated,
             "served_acceptance_length": served_al, "relative_difference": gap, "tolerance": MISMATCH_TOLERANCE,
             "mismatch": gap > MISMATCH_TOLERANCE}
    if block["mismatch"]:
        logger.warning("TRAIN/SERVE MISMATCH: the trainer simulated acceptance length %.3f at K=%s on the held-out "
                       "prompts, vLLM served %.3f (%.0f%% apart): check aux layer ids, chat template, norms, vocab",
                       simulated, k, served_al, 100 * gap)
    return block


def build_report(cfg, runs: dict[str, ServedRun], drafter: dict, drafter_dir: Path, target: str,
                 default_prompts: bool, lossless: dict[str, dict], compare: dict | None = None) -> dict:
    """validation.json. `drafter`/`compare`: {"method", ...} of the drafter and of the --compare one."""
    base = runs["none"]
    ks = sorted(set(cfg.export.num_speculative_tokens))
    entries = [summarize_run(runs[f"drafter-k{k}"], k, lossless[f"drafter-k{k}"]) for k in ks]
    top = entries[-1]  # the largest K: its per-position rates cover every smaller K
    ngram_label = f"ngram-k{ks[-1]}"
    ngram_block = summarize_run(runs[ngram_label], ks[-1], lossless[ngram_label]) if ngram_label in runs else None
    c0, c_draft = acceptance.fit_step_cost([(0, base.step_time_s)] + [(e["num_speculative_tokens"],
                                                                  e["step_time_ms"] / 1e3) for e in entries])
    best_k, speed = acceptance.recommend_k(top["acceptance_rate_per_position"], c0, c_draft)
    acceptance_by_k = {str(k): v for k, v in acceptance.acceptance_length_by_k(top["acceptance_rate_per_position"]).items()}
    methods = {"drafter": drafter["method"], "none": "none", "ngram": "ngram", "none-again": "none (again, last)"}
    if compare:
        methods["compare"] = compare["method"]
    cells = sweep_cells(runs, methods)
    decision = verdict.decide(cells, "drafter") if cells else None
    compare_block = None
    if compare:
        compare_entries = [summarize_run(runs[f"compare-k{k}"], k, lossless[f"compare-k{k}"]) for k in ks]
        compare_block = {"method": compare["method"], "drafter_dir": compare["drafter_dir"],
                         "entries": compare_entries, "lossless": all(e["lossless"] for e in compare_entries),
                         "verdict": verdict.decide(cells, "compare") if cells else None,
                         "head_to_head": verdict.head_to_head(cells)}
    drafter_lossless = all(e["lossless"] for e in entries) and (compare_block is None or compare_block["lossless"])
    return {
        "method": drafter["method"], "drafter_dir": str(drafter_dir), "target": target, "dtype": cfg.target.dtype,
        **{key: top[key] for key in ("num_speculative_tokens", "acceptance_length", "acceptance_rate_per_position",
                                     "token_acceptance_rate", "first_mismatch")},
        # lossless = no real disagreement (identity in fp32; near-ties allowed in bf16/fp16, export/lossless.py)
        "lossless": drafter_lossless,
        "lossless_by_method": {"drafter": all(e["lossless"] for e in entries),
                               "ngram": ngram_block and ngram_block["lossless"]},
        "lossless_checks": lossless,
        "num_prompts": len(base.token_ids), "max_tokens": cfg.export.max_tokens,
        "concurrency": max(cfg.export.concurrency),
        "output_tokens_per_s": {"with_drafter": top["output_tokens_per_s"], "without_drafter": base.output_tokens_per_s,
                                "ngram": ngram_block and ngram_block["output_tokens_per_s"]},
        "acceptance_length_by_k": acceptance_by_k,
        "tokens_per_target_step": {"drafter": top["tokens_per_target_step"],
                                   "none": acceptance.tokens_per_target_step(base.output_tokens, base.delta.accepted),
                                   "ngram": ngram_block and ngram_block["tokens_per_target_step"]},
        "step_time_ms": {"none": 1e3 * base.step_time_s, "drafter": top["step_time_ms"]},
        "recommended_k": best_k,
        "cost_model": {"c0_ms": 1e3 * c0, "c_draft_ms": 1e3 * c_draft,
                       "expected_speedup_by_k": {str(k): v / speed[0] for k, v in speed.items()}},
        "ngram": ngram_block,
        "sweep": {"concurrency": list(cfg.export.concurrency), "num_speculative_tokens": ks,
                  "min_requests": cfg.export.sweep_min_requests, "cells": cells} if cells else None,
        "verdict": decision,
        "compare": compare_block,
        "train_serve_mismatch": check_train_serve(cfg.paths.eval_heldout, acceptance_by_k, default_prompts),
        "server_start_s": {label: run.start_s for label, run in runs.items()},
        "entries": entries if len(entries) > 1 else None,
        "versions": versions(),
    }


def versions() -> dict:
    import platform

    import torch
    import transformers

    from draftsmith.export.vllm_cli import vllm_version_aware

    return {"vllm": vllm_version_aware("vllm"), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "draftsmith_commit": git_commit()}


def main(argv=None) -> None:
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: stop servers
    try:
        run_validation(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_validation(argv) -> None:
    cfg, args = parse_args(argv)
    log_run_header("export/validate", args.config)
    paths = cfg.paths
    drafter_dir = Path(args.drafter) if args.drafter else paths.drafter
    target = args.target or resolve_target_path(cfg.target.name_or_path, cfg.target.revision)
    drafter = check_drafter_fits_target(drafter_dir, target)
    drafters = {"drafter": (drafter_dir, drafter["method"] == "peagle")}
    compare = None
    if args.compare:
        compare_dir = Path(args.compare)
        compare = {**check_drafter_fits_target(compare_dir, target), "drafter_dir": str(compare_dir)}
        drafters["compare"] = (compare_dir, compare["method"] == "peagle")
    tokenizer = load_tokenizer(target)
    prompts_path = Path(args.prompts) if args.prompts else paths.dataset.prompts("heldout")
    prompts = load_prompt_ids(prompts_path, cfg.export.num_validation_prompts, tokenizer)
    runs = serve_all(cfg, target, drafters, prompts, tokenizer)
    lossless = lossless_checks(runs, prompts, dtype=cfg.target.dtype, target=target,
                               bound=cfg.export.near_tie_logit_gap, eos_token_id=tokenizer.eos_token_id)
    report = build_report(cfg, runs, drafter, drafter_dir, target, default_prompts=args.prompts is None,
                          lossless=lossless, compare=compare)
    # which weights these figures belong to: export/push.py refuses to publish them beside another drafter
    report["drafter_weights_sha256"] = sha256_file(drafter_dir / "model.safetensors")
    atomic_write_json(paths.validation_json, report)
    atomic_write_bytes(paths.validation_md, render_markdown(report).encode())
    plot_acceptance(report, paths.validation_plot)
    if report["sweep"]:
        plot_tpot(report, paths.validation_tpot_plot)
    print_summary(report, paths.validation_md)
    # n-gram is vLLM's own method: its divergences are reported, the drafters' fail the run
    real = {label: c["real"] for label, c in lossless.items() if c["real"] and split_label(label)[0] != "ngram"}
    if real:
        raise UserError(f"validation failed: outputs with the drafter really differ from the target alone "
                        f"({', '.join(f'{label}: {n} prompt(s)' for label, n in real.items())}; "
                        f"{'fp32: token identity' if cfg.target.dtype == 'float32' else 'not near-ties in fp32'}); "
                        f"divergences in {paths.validation_json}")


if __name__ == "__main__":
    try:
        run_entry(main)
    except ServerError as e:  # vLLM's own error text, without a Python traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
