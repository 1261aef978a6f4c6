#!/usr/bin/env bash
# Peak RSS and tokens/s of the same 30-step bf16 EAGLE-3 run under glibc malloc settings, one after another in one
# run: the default (its mmap threshold rises with each large free, up to 32 MiB, so freed activations stay in the
# heap, fragmented), and a fixed threshold (4 MiB, 64 KiB: larger blocks come from mmap and go back to the system
# on free, each fresh block costing page faults). Same data, seed and steps: the losses must agree.
# Usage: bash bench/malloc_rss.sh [DATASET_DIR]   (the full-budget vs_speculators dataset by default)
set -euo pipefail
cd "$(dirname "$0")/.."
DS=${1:-$HOME/.cache/draftsmith/bench/vs-speculators/draftsmith-first2000/dataset}
OUT=$(mktemp -d)
run() {  # NAME [ENV=VALUE ...]
  local name=$1; shift
  env "$@" .venv/bin/python train/eagle3.py --config smollm2-demo output_dir="$OUT/$name" data.dataset_dir="$DS" \
    data.draft_vocab_size=32000 data.max_seq_len=2048 ttt.num_steps=3 train.lr=2e-3 train.warmup_steps=8 \
    train.batch_tokens=2048 train.max_steps=30 train.log_every=1 train.eval_every=100000 train.save_every=100000 \
    train.eval_max_samples=1 train.precision=bf16 > "$OUT/$name.log" 2>&1
  .venv/bin/python - "$OUT/$name/train/metrics.jsonl" "$name" <<'P'
import json, sys
r = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
print(f"{sys.argv[2]:26} peak RSS GiB by step " + " ".join(f"{x['step']}:{x['peak_mem_gib']:.2f}" for x in r
      if x["step"] % 5 == 0) + f"  final loss {r[-1]['loss']:.4f}  {r[-1]['tokens_per_s']:.0f} tok/s (the run's mean)", flush=True)
P
}
echo "$ bash bench/malloc_rss.sh   ($(nproc) cores, $(date -u +%F))"
run "glibc default"
run "mmap threshold 4 MiB" MALLOC_MMAP_THRESHOLD_=4194304
run "mmap threshold 64 KiB" MALLOC_MMAP_THRESHOLD_=65536
