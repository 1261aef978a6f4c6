"""A long soak of the chain under random SIGKILLs (issue #16, item 6): a benchmark, not a test.

Usage: .venv/bin/python bench/soak.py [--rounds 20] [--seed 0] [--max-kills 3]
Each round runs the chain on a small random-weight target with SmolLM2's tokenizer and chat template (built once
under the bench cache): data/build.py (capture) -> train/eagle3.py -> export/speculators.py, in a fresh folder.
Every stage is SIGKILLed up to --max-kills times, each time at a random named kill point (data/faults.py) or at a
random moment, and rerun until it finishes. After each round every invariant is checked against an uninterrupted
reference chain: the dataset files byte-identical, the trained weights bit-identical, the exported folder
identical, no temp folder, lock or partial file left. Prints rounds survived, kills survived and artifacts lost.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = {  # script, kill points it passes
    "build": ("data/build.py", ["shard_write", "shard_sidecar", "before_manifest"]),
    "train": ("train/eagle3.py", ["checkpoint_write", "bundle_swap"]),
    "export": ("export/speculators.py", ["export_write", "bundle_swap"]),
}


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "bench" / "soak"


def small_chat_target(out: Path) -> Path:
    """4 random layers of width 64 over SmolLM2's vocabulary and chat template (a real HF folder), once."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from draftsmith.data.target import resolve_target_path

    smollm2 = resolve_target_path("smollm2")
    real = AutoConfig.from_pretrained(smollm2)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=real.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=real.bos_token_id, eos_token_id=real.eos_token_id)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(tmp)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def write_config(folder: Path, target: Path) -> Path:
    """The chain's config: output_dir is relative ("run"), so every round's folder builds the same bytes."""
    prompts = folder / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Explain step {i} of making tea, briefly."},
                          {"role": "assistant", "content": f"Step {i}: " + "boil water, then wait. " * (1 + i % 5)}]}
            for i in range(60)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"output_dir": "run", "target": {"name_or_path": str(target), "dtype": "float32", "aux_layer_ids": [1, 2, 3]},
           "data": {"prompts": {"source": "jsonl", "path": str(prompts), "heldout_fraction": 0.2},
                    "regenerate": {"enabled": False}, "max_seq_len": 256, "samples_per_shard": 4,
                    "capture_batch_tokens": 512, "draft_vocab_size": 512},
           "ttt": {"num_steps": 3},
           "train": {"lr": 3e-3, "max_steps": 12, "warmup_steps": 2, "batch_tokens": 512, "log_every": 4,
                     "eval_every": 4, "save_every": 4, "precision": "fp32", "report_to": []}}
    path = folder / "soak.yaml"
    path.write_text(json.dumps(cfg))
    return path


def run_stage(script: str, config: Path, cwd: Path, kill_at: str | None = None, kill_after: float | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("DRAFTSMITH_KILL_AT", None)
    if kill_at:
        env["DRAFTSMITH_KILL_AT"] = kill_at
    proc = subprocess.Popen([sys.executable, str(REPO / script), "--config", str(config)], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def artifacts(run: Path) -> dict[str, dict[str, bytes]]:
    return {"dataset": files_of(run / "dataset"), "weights": files_of(run / "train" / "best"),
            "export": files_of(run / "drafter")}


def leftovers(run: Path) -> list[str]:
    """Temp files and folders, locks and group records a finished chain must not leave."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*")
                  if p.name.endswith(".tmp") or ".tmp-" in p.name or p.name.endswith(".old") or p.name == "build.lock"
                  or p.name.startswith(".tmp-step"))


def soak_round(config: Path, work: Path, rng: random.Random, max_kills: int) -> tuple[int, list[str]]:
    """One chain in `work` under random kills; returns (kills survived, stage failures)."""
    kills, failures = 0, []
    for name, (script, points) in STAGES.items():
        for _ in range(rng.randrange(0, max_kills + 1)):
            if rng.random() < 0.6:
                rc, err = run_stage(script, config, work, kill_at=f"{rng.choice(points)}:{rng.randrange(1, 4)}")
            else:
                rc, err = run_stage(script, config, work, kill_after=rng.uniform(3.0, 15.0))
            if rc == -signal.SIGKILL:
                kills += 1
            elif rc != 0:
                failures.append(f"{name}: exit {rc} after a kill: {err.strip().splitlines()[-1:]}")
        rc, err = run_stage(script, config, work)
        if rc != 0:
            failures.append(f"{name}: the rerun failed with exit {rc}: {err.strip().splitlines()[-1:]}")
            break
    return kills, failures


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-kills", type=int, default=3, help="kills per stage per round at most")
    a = p.parse_args(argv)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = small_chat_target(root / "chat-target")
    work_root = root / f"seed{a.seed}"
    shutil.rmtree(work_root, ignore_errors=True)
    (work_root / "reference").mkdir(parents=True)
    config = write_config(work_root, target)
    t0 = time.time()
    for script, _ in STAGES.values():
        rc, err = run_stage(script, config, work_root / "reference")
        if rc != 0:
            raise SystemExit(f"the uninterrupted reference chain failed at {script}: {err[-2000:]}")
    want = artifacts(work_root / "reference" / "run")
    print(f"$ .venv/bin/python bench/soak.py --rounds {a.rounds} --seed {a.seed} --max-kills {a.max_kills}; "
          f"reference chain {time.time() - t0:.0f} s", flush=True)
    rng = random.Random(a.seed)
    survived, total_kills, lost = 0, 0, 0
    for r in range(1, a.rounds + 1):
        work = work_root / f"round-{r:03d}"
        work.mkdir()
        t = time.time()
        kills, failures = soak_round(config, work, rng, a.max_kills)
        got = artifacts(work / "run") if not failures else {}
        broken = [k for k in want if got.get(k) != want[k]] if not failures else list(want)
        left = leftovers(work / "run")
        lost_here = len(broken) + len(left)
        survived += not failures and not lost_here
        total_kills += kills
        lost += lost_here
        print(f"round {r:3d}: {kills} kill(s) survived, {time.time() - t:4.0f} s; artifacts differing from the "
              f"uninterrupted chain: {broken or 'none'}; leftovers: {left or 'none'}"
              + (f"; FAILURES: {failures}" if failures else ""), flush=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"SOAK: {survived}/{a.rounds} rounds survived, {total_kills} kills survived, {lost} artifacts lost; "
          f"wall {(time.time() - t0) / 60:.0f} min")


if __name__ == "__main__":
    main()
