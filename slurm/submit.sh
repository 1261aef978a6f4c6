#!/usr/bin/env bash
# Submit the whole chain as dependent jobs: data -> train -> export + validate (each afterok the one before).
#   slurm/submit.sh [--method eagle3|peagle] [--nodes N] [--gpus-per-node G] [--tasks-per-node T] \
#                   [--output-dir DIR] CONFIG [key=value ...]
# Prints the three job ids as "data=ID train=ID export=ID". Run it from the repository root.
set -euo pipefail
method=eagle3 nodes=1 gpus=0 tasks=1 logs=.
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --method) method=$2;; --nodes) nodes=$2;; --gpus-per-node) gpus=$2;; --tasks-per-node) tasks=$2;;
    --output-dir) logs=$2;;
    *) echo "error: unknown option $1" >&2; exit 2;;
  esac
  shift 2
done
config=${1:?usage: slurm/submit.sh [options] CONFIG [key=value ...]}; shift
gpu_flag=() one_gpu=()  # data and export use one GPU, training all of them
if (( gpus > 0 )); then gpu_flag=(--gpus-per-node="$gpus"); one_gpu=(--gpus-per-node=1); fi
out=(--output="$logs/slurm-%x-%j.out")
data=$(sbatch --parsable "${out[@]}" "${one_gpu[@]}" slurm/data.sbatch "$config" "$@")
train=$(sbatch --parsable "${out[@]}" --dependency=afterok:"$data" --nodes="$nodes" --ntasks-per-node="$tasks" \
        "${gpu_flag[@]}" slurm/train.sbatch "$method" "$config" "$@")
export=$(sbatch --parsable "${out[@]}" --dependency=afterok:"$train" "${one_gpu[@]}" \
         slurm/export.sbatch "$config" "$@")
echo "data=$data train=$train export=$export"
