"""What ``accelerate launch --config_file FILE`` would tell its ranks, for a job torchrun starts.

accelerate reads DDP / FSDP2 / DeepSpeed settings in each rank from environment variables
(``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``, ``ACCELERATE_USE_DEEPSPEED``, ...) that its launcher
derives from the config file. We derive them with accelerate's own launcher functions, so a file
made by ``accelerate config`` means here what it means to ``accelerate launch``, and start the
ranks with torchrun (``accelerate launch --cpu`` runs a single process, which is no use on CPU).
"""

from __future__ import annotations

import os

from verl_core.config import ConfigError
from verl_core.pipeline.launcher_config import LauncherConfig

# Settings the stage's own config decides (``mixed_precision``), not the accelerate file.
_STAGE_DECIDES = {"ACCELERATE_MIXED_PRECISION"}


def accelerate_environment(launcher: LauncherConfig) -> dict[str, str]:
    """The ``ACCELERATE_*`` / ``FSDP_*`` variables ``launcher.accelerate_config`` implies."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    path = launcher.accelerate_config
    argv = [
        "--config_file",
        str(path),
        "--num_processes",
        str(launcher.world_size),
        "--num_machines",
        str(launcher.num_machines),
        "--machine_rank",
        str(launcher.machine_rank),
        "--main_process_port",
        "0",
        "-m",
        "verl_core.pipeline.worker",
    ]
    try:
        args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
        if args.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
            fields = list(defaults.deepspeed_config) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if mp_from_config else []))
            _, env = prepare_deepspeed_cmd_env(args)
        else:
            env = prepare_multi_gpu_env(args)
    except (ValueError, KeyError, TypeError, ImportError, SystemExit) as err:
        raise ConfigError(f"launcher.accelerate_config {path}: accelerate cannot use it: {err}") from None
    return {
        k: v
        for k, v in env.items()
        if k.startswith(("ACCELERATE_", "FSDP_")) and k not in _STAGE_DECIDES and os.environ.get(k) != v
    }


def sharding_unavailable_reason(env: dict[str, str]) -> str | None:
    """Why the FSDP / DeepSpeed setting in ``env`` cannot run on this machine (None: it can).

    Measured with accelerate 1.16 and torch 2.13 (CPU build): with ``Accelerator(cpu=True)`` the
    ranks form a gloo group but accelerate ignores ``ACCELERATE_USE_FSDP`` and wraps the model in
    DDP (MULTI_CPU); with ``cpu=False`` and no GPU it forms no process group at all. DeepSpeed
    ZeRO needs CUDA. So without a GPU, asking for either would silently train something else."""
    import torch

    flags = (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"))
    wanted = [name for key, name in flags if env.get(key) == "true"]
    if not wanted or torch.cuda.is_available():
        return None
    return (
        f"{wanted[0]} needs GPUs: accelerate runs it only on CUDA devices (on CPU it falls back to DDP "
        "without saying so); leave launcher.accelerate_config unset for DDP on CPU (gloo)"
    )
