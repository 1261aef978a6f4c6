"""The processes of one dataset build. `python data/build.py` is one; `accelerate launch --num_processes N
data/build.py` starts N that plan the same shards, each capturing its share, and meet at barriers over gloo
(only barriers cross processes, so a CPU host and a GPU node run the same code)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from draftsmith.data.errors import UserError

logger = logging.getLogger(__name__)

# a barrier may wait for the whole regeneration (main process) or for the slowest process's share of capture;
# a process that fails ends the launch (the launcher stops the others), so a long timeout cannot hang a failure
BARRIER_TIMEOUT = timedelta(hours=72)


@dataclass(frozen=True, kw_only=True)
class BuildProcesses:
    rank: int
    """This process's index among all build processes (0 = main: it writes the folder, responses and manifest)."""
    world_size: int
    """Build processes in all; process r captures shards r, r + world_size, ... of the one shard plan."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_build_processes(device_map: str) -> BuildProcesses:
    """This process's place, from the rank variables accelerate launch sets (none = one process); joins the gloo
    group and, on a GPU node, takes the GPU of its local rank."""
    env = os.environ
    procs = BuildProcesses(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")))
    per_node = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if device_map and per_node > 1:
        raise UserError(f"target.device_map={device_map!r} spreads the target over all GPUs of a node, but "
                        f"{per_node} build processes were launched per node; launch one per node (accelerate launch "
                        "--num_processes <number of nodes>) or set target.device_map='' to capture with one "
                        "target copy per GPU")
    if procs.world_size > 1:
        torch.distributed.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
        logger.info("data build: %d processes; process r captures shards r, r+%d, ...", procs.world_size,
                    procs.world_size)
    if torch.cuda.is_available() and not device_map:
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    return procs


def wait_for_all(procs: BuildProcesses) -> None:
    if procs.world_size > 1:
        torch.distributed.barrier()


def end_build_processes(procs: BuildProcesses) -> None:
    if procs.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
