#!/usr/bin/env bash
# One Slurm task's accelerate launcher: maps the job's Slurm variables to accelerate's multi-machine flags.
# Run once per task by srun (train.sbatch); each task is one "machine" that starts PROCS_PER_TASK processes
# (default: the task's share of the node's GPUs, or 1 without GPUs). Rendezvous on the job's first node.
#   srun bash slurm/launch_accelerate.sh train/eagle3.py --config NAME [key=value ...]
# ACCELERATE_CONFIG picks the backend (default configs/accelerate/ddp.yaml); DRY_RUN=1 prints the command.
set -euo pipefail
: "${SLURM_JOB_ID:?run inside a Slurm job}" "${SLURM_NTASKS:?}" "${SLURM_PROCID:?}" "${SLURM_JOB_NODELIST:?}"
tasks_per_node=${SLURM_NTASKS_PER_NODE:-1}
procs=${PROCS_PER_TASK:-$(( ${SLURM_GPUS_ON_NODE:-0} / tasks_per_node ))}
(( procs >= 1 )) || procs=1
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MAIN_PROCESS_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}
cmd=("${PYTHON:-python}" -m accelerate.commands.launch
     --config_file "${ACCELERATE_CONFIG:-configs/accelerate/ddp.yaml}"
     --num_machines "$SLURM_NTASKS" --machine_rank "$SLURM_PROCID"
     --num_processes $(( SLURM_NTASKS * procs ))
     --main_process_ip "$head_node" --main_process_port "$port"
     "$@")
if [[ ${DRY_RUN:-0} == 1 ]]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
