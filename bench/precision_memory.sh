#!/usr/bin/env bash
# Peak RSS and tokens/s of the EAGLE-3 step over STEPS steps (60 by default) in bf16 autocast, fp32, and bf16 with
# glibc's mmap threshold fixed at 1 MiB (and, with VARIANTS=..., others below), on one built dataset (default: the
# one bench/vs_speculators.py --budget full built). Same data, seed and steps in every variant: the final losses
# printed must agree between variants of one precision.
# Usage: [VARIANTS="bf16 fp32 ..."] [STEPS=60] bash bench/precision_memory.sh [DATASET_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DS=${1:-$HOME/.cache/draftsmith/bench/vs-speculators/draftsmith-first2000/dataset}
STEPS=${STEPS:-60}
OUT=$(mktemp -d)
run() {  # name, precision, extra env, extra overrides
  env $3 .venv/bin/python train/eagle3.py --config smollm2-demo output_dir="$OUT/$1" data.dataset_dir="$DS" \
    data.draft_vocab_size=32000 data.max_seq_len=2048 ttt.num_steps=3 train.lr=2e-3 train.warmup_steps=8 \
    train.batch_tokens=2048 train.max_steps="$STEPS" train.log_every=5 train.eval_every=100000 \
    train.save_every=100000 train.eval_max_samples=1 train.precision="$2" ${4:-} > "$OUT/$1.log" 2>&1
  echo "== $1 (train.precision=$2 $3 ${4:-})"
  .venv/bin/python - "$OUT/$1/train/metrics.jsonl" "$STEPS" <<'P'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if "tokens_per_s" in r and r["step"] % 10 in (0, int(sys.argv[2]) % 10):  # every 10th step and the last
        print(f"step {r['step']:3d}  {r['tokens_per_s']:6.0f} tokens/s  peak RSS {r['peak_mem_gib']:.2f} GiB  "
              f"loss {r['loss']:.4f}")
P
}
VARIANTS=${VARIANTS:-"bf16 fp32 bf16-mmap1MiB"}
echo "$ VARIANTS=\"$VARIANTS\" STEPS=$STEPS bash bench/precision_memory.sh $DS   ($(nproc) cores, $(date -u +%F))"
for v in $VARIANTS; do
  case $v in
    bf16) run bf16 bf16 "";;
    fp32) run fp32 fp32 "";;
    # glibc's mmap threshold fixed (default: it rises with each large free, up to 32 MiB, so freed activations stay
    # in the heap, fragmented); blocks above it come from mmap and go back to the system on free, at page faults
    bf16-mmap1MiB) run bf16-mmap1MiB bf16 MALLOC_MMAP_THRESHOLD_=1048576;;
    bf16-mmap*KiB|fp32-mmap*KiB) k=${v#*-mmap}; run "$v" "${v%%-*}" "MALLOC_MMAP_THRESHOLD_=$((${k%KiB} * 1024))";;
    # oneDNN keeps a compiled primitive (with its reordered weights) per matmul shape, 1024 by default
    bf16-onednn-cache8) run bf16-onednn-cache8 bf16 ONEDNN_PRIMITIVE_CACHE_CAPACITY=8;;
    # rows padded to a multiple of N tokens: a few shapes repeat (train.row_length_multiple)
    bf16-pad*) run "$v" bf16 "" "train.row_length_multiple=${v#bf16-pad}";;
    fp32-pad*) run "$v" fp32 "" "train.row_length_multiple=${v#fp32-pad}";;
    *) echo "unknown variant $v"; exit 2;;
  esac
done
