#!/usr/bin/env bash
# What the training process's resident memory is made of while it runs: anonymous memory (tensors, allocator,
# oneDNN caches) against file-backed pages (mapped libraries; until data/shards.py read rows with pread, also the
# memory-mapped dataset shards), sampled from
# /proc/<pid>/smaps_rollup every 25 s of a 45-step bf16 EAGLE-3 run on the full-budget vs_speculators dataset.
# Usage: bash bench/rss_breakdown.sh [DATASET_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DS=${1:-$HOME/.cache/draftsmith/bench/vs-speculators/draftsmith-first2000/dataset}
OUT=$(mktemp -d)
.venv/bin/python train/eagle3.py --config smollm2-demo output_dir="$OUT/r" data.dataset_dir="$DS" \
  data.draft_vocab_size=32000 data.max_seq_len=2048 ttt.num_steps=3 train.lr=2e-3 train.warmup_steps=8 \
  train.batch_tokens=2048 train.max_steps=45 train.log_every=5 train.eval_every=100000 train.save_every=100000 \
  train.eval_max_samples=1 train.precision=bf16 > "$OUT/log" 2>&1 &
PID=$!
sleep 20
for i in $(seq 1 12); do
  kill -0 $PID 2>/dev/null || break
  step=$(grep -o '"step": [0-9]*' "$OUT/r/train/metrics.jsonl" 2>/dev/null | tail -1 || true)
  echo "t=$((i * 25))s ${step:-\"step\": 0}  $(grep -E '^(Rss|Anonymous|Pss_File)' /proc/$PID/smaps_rollup \
    | awk '{printf "%s %.2f GiB  ", $1, $2 / 1048576}')"
  sleep 25
done
wait $PID
