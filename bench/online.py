"""Offline vs online training on the same data and machine, side by side in one run (issue #13).

Usage: python bench/online.py [--prompts 40] [--max-new-tokens 96] [--steps 8] [--batch-tokens 1024] [--repeats 2]
Builds the smollm2-quick dataset twice from one set of regenerated responses: offline (hidden states captured
to disk) and online (tokens only, data.capture=online; the build times exclude the shared regeneration), then
trains EAGLE-3 on each, in turn, --repeats times,
and prints the disk each dataset uses, each build's time, training tokens/s and peak memory (each run's own
metrics.jsonl and the child's peak RSS), and the ratios; last, the bytes per token of each mode for the real
recipes' targets. Online pays one target forward per row per epoch; offline pays the disk.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.data.disk import bytes_per_token
from draftsmith.data.layer_ids import default_aux_layer_ids
from draftsmith.data.run_paths import RunPaths

REPO = Path(__file__).resolve().parents[1]
# (name, layers, hidden) of the recipes' real targets (tests/fixtures/targets/*/config.json)
REAL_TARGETS = (("Qwen3-Coder-30B-A3B", 48, 2048), ("Llama-3.1-8B", 32, 4096), ("gpt-oss-20b", 24, 2880))


def run(cmd: list, env: dict) -> tuple[float, float]:
    """Run a stage; -> (seconds, the child's peak RSS in GiB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest child so far: a smaller later child reads as the earlier peak
    return time.perf_counter() - start, max(peak, before) / 2**20


def dataset_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("shard-*.safetensors"))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="draftsmith-online-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    data = [f"data.prompts.max_prompts={a.prompts}", f"data.regenerate.max_new_tokens={a.max_new_tokens}"]
    py = sys.executable

    # the target regenerates the responses once; both builds start from them, so their times differ by capture alone
    run([py, "data/build.py", "--config", "smollm2-quick", f"output_dir={work / 'responses'}", *data,
         "data.capture=online"], env)
    build_s = {}
    responses = RunPaths.at(work / "responses").dataset.regenerated
    for mode in ("offline", "online"):
        dataset = RunPaths.at(work / mode).dataset.dir
        dataset.mkdir(parents=True)
        for f in (responses, responses.with_suffix(".params.json")):
            shutil.copy(f, dataset / f.name)
        build_s[mode], _ = run([py, "data/build.py", "--config", "smollm2-quick", f"output_dir={work / mode}", *data,
                                f"data.capture={mode}"], env)

    train = [f"train.max_steps={a.steps}", f"train.batch_tokens={a.batch_tokens}", f"train.log_every={a.steps}",
             f"train.eval_every={a.steps}", f"train.save_every={a.steps}", "train.eval_max_samples=2",
             "train.warmup_steps=2"]
    best = {}
    for r in range(a.repeats):
        for mode in ("offline", "online"):
            out = work / mode / f"train-{r}"
            paths = RunPaths.at(work / mode)
            seconds, rss = run([py, "train/eagle3.py", "--config", "smollm2-quick", f"output_dir={paths.run}",
                                f"data.dataset_dir={paths.dataset.dir}", *data,
                                *(["data.capture=online"] if mode == "online" else []), *train], env)
            last = [json.loads(line) for line in paths.metrics.read_text().splitlines()
                    if '"tokens_per_s"' in line][-1]
            shutil.move(paths.train, out)
            run_result = {"tokens_per_s": last["tokens_per_s"], "peak_mem_gib": last["peak_mem_gib"],
                          "child_peak_rss_gib": rss, "wall_s": seconds}
            if mode not in best or run_result["tokens_per_s"] > best[mode]["tokens_per_s"]:
                best[mode] = run_result

    disk = {mode: dataset_bytes(RunPaths.at(work / mode).dataset.dir) for mode in ("offline", "online")}
    manifest = json.loads(RunPaths.at(work / "offline").dataset.manifest.read_text())
    print(f"SmolLM2-135M target, {manifest['num_samples']} samples, {manifest['num_tokens']} tokens; EAGLE-3 "
          f"{a.steps} steps of {a.batch_tokens} tokens, best of {a.repeats} runs each, {os.cpu_count()} CPUs")
    print(f"{'':8s} {'dataset bytes':>14s} {'build s':>8s} {'train tok/s':>12s} {'peak mem GiB':>13s}")
    for mode in ("offline", "online"):
        print(f"{mode:8s} {disk[mode]:14d} {build_s[mode]:8.1f} {best[mode]['tokens_per_s']:12.1f} "
              f"{best[mode]['peak_mem_gib']:13.2f}")
    print(f"online / offline: disk {disk['online'] / disk['offline']:.4f} ({100 * disk['online'] / disk['offline']:.2f} "
          f"%), training tokens/s {best['online']['tokens_per_s'] / best['offline']['tokens_per_s']:.3f}, "
          f"peak memory {best['online']['peak_mem_gib'] / best['offline']['peak_mem_gib']:.2f}")
    print("bytes per stored token (default aux ids, bf16 storage) for the recipes' real targets:")
    for name, layers, hidden in REAL_TARGETS:
        offline = bytes_per_token(len(default_aux_layer_ids(layers)), hidden, "bfloat16")
        online = bytes_per_token(len(default_aux_layer_ids(layers)), 0, "bfloat16")
        print(f"  {name:20s} offline {offline:6d} B/token, online {online} B/token ({100 * online / offline:.3f} %)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
