"""The accelerate set-up for 1..N processes (DDP, FSDP2, DeepSpeed ZeRO-2) and the collectives the loop needs.

The backend is chosen by the accelerate config the run was launched with; this module is the only place that
knows which one it is. Pitfalls it handles (../shared/reference/scale-out.md):
- the LR schedule steps once per global step (`step_scheduler_with_optimizer=False`), not once per process;
- gradient accumulation is accelerate's (`gradient_accumulation_steps`), so DDP skips the all-reduce and
  DeepSpeed steps its engine only on the last micro-step;
- DeepSpeed takes its micro-batch (one packed row), accumulation and clipping from the run config;
- on a host without a GPU: gloo named explicitly, and FSDP2 enabled where accelerate 1.15 would silently
  fall back to DDP (torch's FSDP2 runs on a CPU mesh), with gloo's broken AVG reduction avoided.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from datetime import timedelta

import torch

from draftsmith.data.config import RunConfig
from draftsmith.data.errors import UserError
from draftsmith.train.precision import run_mixed_precision

logger = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def build_accelerator(cfg: RunConfig):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed

    on_cuda = torch.cuda.is_available()
    deepspeed = env_flag("ACCELERATE_USE_DEEPSPEED")
    launched = int(os.environ.get("LOCAL_RANK", "-1")) != -1
    if cfg.train.optimizer == "muon" and (deepspeed or env_flag("ACCELERATE_USE_FSDP")):
        raise UserError("train.optimizer=muon orthogonalizes whole matrices, which FSDP2 and ZeRO shard; "
                        "launch with DDP (configs/accelerate/ddp.yaml) or set train.optimizer=adamw")
    if "wandb" in cfg.train.report_to and importlib.util.find_spec("wandb") is None:
        raise UserError("train.report_to includes wandb, which is not installed: pip install 'draftsmith[wandb]' "
                        "or drop wandb from train.report_to")
    if deepspeed:
        os.environ["ACCELERATE_USE_CPU"] = "false"  # a CPU flag in the environment would switch DeepSpeed off
    handlers = []
    if launched and not on_cuda:
        # without a GPU accelerate picks no backend for DeepSpeed and would run every rank as rank 0
        handlers.append(InitProcessGroupKwargs(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT))
    cpu = not on_cuda and not deepspeed  # accelerate refuses DeepSpeed with cpu=True; gloo is named above
    # the process group first: the precision is decided once and shared before the Accelerator fixes it
    state = PartialState(cpu=cpu, **(handlers[0].to_kwargs() if handlers else {}))
    mixed_precision = run_mixed_precision(cfg.train.precision, on_cuda, cfg.paths.precision_record, state)
    acc = Accelerator(
        cpu=cpu,
        mixed_precision=mixed_precision,  # fp32 master weights either way
        log_with=list(cfg.train.report_to) or None,
        project_config=ProjectConfiguration(project_dir=str(cfg.paths.train), logging_dir=str(cfg.paths.tensorboard)),
        gradient_accumulation_steps=cfg.train.grad_accum,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=handlers,
    )
    if deepspeed:
        configure_deepspeed(acc, cfg)
    if env_flag("ACCELERATE_USE_FSDP") and not acc.is_fsdp2:
        enable_fsdp2_without_gpu(acc)
    set_seed(cfg.train.seed)
    logger.info("accelerate: %s, %d process(es), backend %s", acc.distributed_type, acc.num_processes,
                acc.state.backend)
    return acc


def configure_deepspeed(acc, cfg: RunConfig) -> None:
    """One packed row per micro-step; accumulation and clipping come from the run config, not from two places."""
    ds = acc.state.deepspeed_plugin.deepspeed_config
    wanted = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": cfg.train.grad_accum,
              "gradient_clipping": cfg.train.grad_clip}
    for key, value in wanted.items():
        have = ds.get(key, "auto")
        if have not in ("auto", value):
            field = {"train_micro_batch_size_per_gpu": "(one packed row per micro-step)",
                     "gradient_accumulation_steps": "train.grad_accum", "gradient_clipping": "train.grad_clip"}[key]
            raise UserError(f"the DeepSpeed config sets {key}={have!r} but the run needs {value!r} {field}; "
                            f'set it to "auto" in the accelerate/DeepSpeed config')
        ds[key] = value
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the three above and the world size
    if ds.get("zero_optimization", {}).get("stage", 0) > 2:
        raise UserError("DeepSpeed ZeRO stage 3 is not supported for drafters (they fit on one device); "
                        "use ZeRO-2 or FSDP2")


def enable_fsdp2_without_gpu(acc) -> None:
    """accelerate 1.15 ignores an FSDP config on a CPU-only host and silently trains with DDP; torch's FSDP2
    supports CPU meshes, so switch the state to FSDP2 (the same `fully_shard` path a GPU run takes)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if acc.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables accelerate launch exported
    if plugin.fsdp_version != 2:
        raise UserError("only FSDP2 is supported (fsdp_version: 2 in the accelerate config)")
    # AcceleratorState re-reads PartialState's fields whenever it is instantiated again: set both
    PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin


def after_prepare(acc, model) -> None:
    """gloo's AVG reduce-scatter is wrong (pytorch/pytorch#162338): make FSDP2 reduce with SUM and divide."""
    if acc.is_fsdp2 and acc.state.backend == "gloo":
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def sum_over_processes(acc, values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of a small float64 tensor over all processes (a no-op on one)."""
    if acc.num_processes == 1:
        return values
    return acc.reduce(values.to(acc.device), reduction="sum").cpu()


def full_state_dict(acc, model) -> dict[str, torch.Tensor]:
    """The unsharded trained state on the main process (FSDP2 and ZeRO gather it): call on every process."""
    state = acc.get_state_dict(model)
    if not acc.is_main_process:
        return {}
    # a CPU run's "offload to CPU" copies nothing: clone before FSDP2 frees the gathered storage
    return {k.removeprefix("drafter."): v.detach().clone() for k, v in state.items()}
