#!/usr/bin/env bash
# Issue #14's finding, re-checked by the validator: the demo's drafter served in bf16 beside the target alone in
# bf16, on HumanEval's function-completion prompts (another task family than the demo's training prompts). Token
# identity fails there on near-ties of bf16 numerics; export/lossless.py re-scores each first divergence with the
# target alone in fp32 and counts near-ties and real disagreements (a real one fails the run).
# Usage, from the repository root after `make demo`: [DTYPE=float16] bash bench/bf16_lossless.sh [RUN_DIR] [NUM_PROMPTS]
set -euo pipefail
RUN=${1:-runs/smollm2-demo}
N=${2:-64}
DTYPE=${DTYPE:-bfloat16}
OUT=${BF16_OUT:-runs/$DTYPE-lossless}
PY=${PY:-.venv/bin/python}
PROMPTS=$($PY -c "
import sys; sys.path.insert(0, 'bench')
import speculators_side, vs_speculators
cache = speculators_side.bench_cache(); cache.mkdir(parents=True, exist_ok=True)
print(vs_speculators.human_eval_prompts(cache))")
$PY export/validate.py --config smollm2-demo "output_dir=$OUT" "target.dtype=$DTYPE" \
  "export.num_validation_prompts=$N" export.ngram_baseline=false export.sweep_min_requests=4 export.serve_baseline_twice=false \
  --drafter "$RUN/drafter" --prompts "$PROMPTS" --num-speculative-tokens 3 --concurrency 16
$PY - "$OUT/validation.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for label, c in r["lossless_checks"].items():
    gaps = sorted(round(d.get("fp32_gap_other", float("nan")), 3) for d in c["divergences"])
    print(f"{label}: {c['num_prompts']} prompts, identical {c['identical']}, near-ties {c['near_ties']}, "
          f"real {c['real']} (bound {c['near_tie_bound_logits']} logits); fp32 gaps of the drafter runs' tokens: {gaps}")
PY
