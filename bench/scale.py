"""Training throughput on 1 and 2 CPU processes over the same data and the same global batch (issue #10).

Usage: python bench/scale.py [--steps 12] [--repeats 2] [--batch-tokens 2048] [--samples 160]
Writes a dataset of random hidden states with the embedded SmolLM2 target's real shapes, draft vocab and
teacher head (the step costs what a real one costs), then trains EAGLE-3 on it three ways, each from scratch:
  1 process x 1 thread, grad_accum 2   |   1 process x 2 threads, grad_accum 2   |   2 processes (DDP) x 1 thread
and prints tokens/s (from each run's own metrics.jsonl), the 2-process / 1-process ratio, and the bytes each
run read from the dataset per trained token (summed over processes: it must not grow with the world size).
The three run in turn, --repeats times; the ratios use each one's best rate (the least disturbed run).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.data.layer_ids import default_aux_layer_ids
from draftsmith.data.manifest import atomic_write_json, target_identity
from draftsmith.data.run_paths import DatasetPaths, RunPaths
from draftsmith.data.shards import FORMAT, CapturedSample, write_shard
from draftsmith.data.target import load_target_config, resolve_target_path
from draftsmith.data.vocab import build_draft_vocab, save_vocab

REPO = Path(__file__).resolve().parents[1]


def write_random_dataset(out: Path, num_samples: int, draft_vocab: int, seed: int = 0) -> None:
    """Shards of random bf16 hidden states (lengths 256..1024, half loss-masked) for the embedded target."""
    target = resolve_target_path("smollm2")
    hf = load_target_config(target)
    aux = default_aux_layer_ids(hf.num_hidden_layers)
    g = torch.Generator().manual_seed(seed)
    H, V = hf.hidden_size, hf.vocab_size
    entries, per_shard = [], 32
    for split, n in (("train", num_samples), ("heldout", 8)):
        samples = []
        for _ in range(n):
            t = int(torch.randint(256, 1025, (1,), generator=g))
            mask = torch.zeros(t, dtype=torch.long)
            mask[t // 2:] = 1
            samples.append(CapturedSample(torch.randint(0, V, (t,), generator=g), mask,
                                          torch.randn(t, len(aux) * H, generator=g).bfloat16(),
                                          torch.randn(t, H, generator=g).bfloat16()))
        for i in range(0, n, per_shard):
            entries.append(write_shard(out, len(entries), split, samples[i: i + per_shard], torch.bfloat16))
    counts = torch.bincount(torch.randint(0, V, (100_000,), generator=g), minlength=V)
    d2t, t2d = build_draft_vocab(counts, draft_vocab)
    save_vocab(DatasetPaths(out).vocab, d2t, t2d, counts)
    atomic_write_json(DatasetPaths(out).manifest, {
        "format": FORMAT, "target": target_identity("smollm2", hf), "aux_layer_ids": aux, "dtype": "bfloat16",
        "num_samples": sum(e["num_samples"] for e in entries), "num_tokens": sum(e["num_tokens"] for e in entries),
        "shards": entries})


def train_once(name: str, work: Path, dataset: Path, processes: int, threads: int, steps: int,
               batch_tokens: int, draft_vocab: int) -> dict:
    out = work / name
    overrides = [f"output_dir={out}", f"data.dataset_dir={dataset}", f"data.draft_vocab_size={draft_vocab}",
                 f"train.max_steps={steps}", f"train.batch_tokens={batch_tokens}", f"train.log_every={steps}",
                 f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_max_samples=2",
                 "train.warmup_steps=2", f"train.grad_accum={2 // processes}"]
    script = [str(REPO / "train" / "eagle3.py"), "--config", "smollm2-demo", *overrides]
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / "ddp.yaml"), "--num_processes", str(processes),
               "--main_process_port", "0", *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HOME": str(work / "hf"),
           "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}")
    last = [json.loads(line) for line in RunPaths.at(out).metrics.read_text().splitlines()
            if '"tokens_per_s"' in line][-1]
    return {"run": name, "processes": processes, "threads_per_process": threads,
            "tokens_per_s": round(last["tokens_per_s"], 1), "peak_mem_gib_rank0": round(last["peak_mem_gib"], 2),
            "tokens_trained": last["tokens"], "data_bytes_read": int(last["data_bytes_read"]),
            "data_bytes_per_trained_token": round(last["data_bytes_read"] / last["tokens"], 1),
            "wall_s": round(time.perf_counter() - t, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--samples", type=int, default=160)
    p.add_argument("--draft-vocab", type=int, default=8192)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="draftsmith-scale-") as tmp:
        work = Path(tmp)
        dataset = work / "dataset"
        write_random_dataset(dataset, args.samples, args.draft_vocab)
        print(f"dataset: {args.samples} train samples of random hidden states, SmolLM2 shapes; "
              f"{args.steps} steps x 2 rows x {args.batch_tokens} tokens per run; torch {torch.__version__}, "
              f"{os.cpu_count()} cores", flush=True)
        best = {}
        for repeat in range(args.repeats):
            for name, processes, threads in (("1proc-1thread", 1, 1), ("1proc-2threads", 1, 2), ("2proc-ddp", 2, 1)):
                r = train_once(f"{name}-{repeat}", work, dataset, processes, threads, args.steps, args.batch_tokens,
                               args.draft_vocab)
                print(json.dumps(r), flush=True)
                if name not in best or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                    best[name] = r
    one, base, two = best["1proc-1thread"], best["1proc-2threads"], best["2proc-ddp"]
    print(f"best tokens/s: 1 process x 1 thread {one['tokens_per_s']}, 1 process x 2 threads {base['tokens_per_s']}, "
          f"2 processes x 1 thread {two['tokens_per_s']}")
    print(f"2 processes / 1 process (2 threads): tokens/s ratio {two['tokens_per_s'] / base['tokens_per_s']:.3f} "
          f"(loss {100 * (1 - two['tokens_per_s'] / base['tokens_per_s']):.1f} %)")
    print(f"2 processes / 1 process (1 thread):  tokens/s ratio {two['tokens_per_s'] / one['tokens_per_s']:.3f}")
    print(f"dataset bytes per trained token: 1 process {base['data_bytes_per_trained_token']}, "
          f"2 processes {two['data_bytes_per_trained_token']} (ratio "
          f"{two['data_bytes_read'] / base['data_bytes_read']:.4f}; the same rows, plus one more copy of the "
          "offsets tables)")


if __name__ == "__main__":
    main()
