"""Where a training stage runs: in the flow-run process, as a ``torchrun`` job, or on Ray.

``launcher`` at the top of the pipeline config is the default of every training stage;
``sft.launcher``, ``reward_model.launcher`` and ``policy_optimisation.launcher`` override it for
one stage. Batch sizes are global (processes × gradient accumulation × micro-batch), so the
launcher changes where a stage computes, not what: it is kept out of cache keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from verl_core.config import StrictConfig

LauncherKind = Literal["local", "torchrun", "ray"]
# The steps a launcher applies to: the ones that train. Sampling preference data and the
# evaluation run in the flow-run process.
TRAINING_STEPS = ("sft", "reward_model", "policy_optimisation")


class LauncherConfig(StrictConfig):
    """How a training stage is started.

    - ``local``: in the flow-run process (one CPU or GPU), as without a launcher.
    - ``torchrun``: ``num_processes`` ranks per machine under ``torch.distributed.run``, running
      ``python -m verl_core.pipeline.worker``; ``num_machines`` > 1 needs ``rdzv_endpoint``
      (``host:port`` of machine 0) and each machine's own ``machine_rank``. ``accelerate_config``
      (an ``accelerate config`` YAML file) selects DDP, FSDP2 or DeepSpeed ZeRO.
    - ``ray``: ``num_processes`` Ray Train workers (``TorchTrainer``) on the cluster at
      ``ray_address`` (none: a local cluster started for the stage), each with
      ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs.
    """

    kind: LauncherKind = "local"
    num_processes: int = Field(1, ge=1, description="torchrun: ranks per machine; ray: workers in all")
    num_machines: int = Field(1, ge=1, description="torchrun: machines in the job")
    machine_rank: int = Field(0, ge=0, description="torchrun: this machine's index (0 = the one at rdzv_endpoint)")
    rdzv_endpoint: str | None = Field(None, description="torchrun: host:port of machine 0; default a free local port")
    accelerate_config: str | None = Field(None, description="path of an accelerate config YAML (DDP / FSDP2 / DeepSpeed)")
    ray_address: str | None = Field(None, description="ray: address of a running cluster; none = start a local one")
    cpus_per_worker: float = Field(1.0, gt=0, description="ray: CPUs per worker")
    gpus_per_worker: float = Field(0.0, ge=0, description="ray: GPUs per worker (0 = CPU training with gloo)")
    threads_per_process: int = Field(1, ge=1, description="OMP_NUM_THREADS and torch threads of each rank")
    timeout_seconds: float | None = Field(None, gt=0, description="kill the job after this long (none = no limit)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables of every rank")

    @model_validator(mode="after")
    def _consistent(self):
        if self.kind == "local" and (self.num_processes > 1 or self.num_machines > 1):
            raise ValueError(
                f"kind 'local' trains in the flow-run process: num_processes and num_machines must be 1 "
                f"(got {self.num_processes} and {self.num_machines}); use kind 'torchrun' or 'ray' for more"
            )
        if self.kind != "torchrun":
            for name in ("rdzv_endpoint", "accelerate_config"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is a torchrun setting; kind is {self.kind!r}")
            if self.num_machines > 1:
                raise ValueError(f"num_machines is a torchrun setting (Ray places workers itself); kind is {self.kind!r}")
        if self.kind != "ray" and self.ray_address is not None:
            raise ValueError(f"ray_address is a ray setting; kind is {self.kind!r}")
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank {self.machine_rank} must be below num_machines {self.num_machines}")
        if self.num_machines > 1 and self.rdzv_endpoint is None:
            raise ValueError("num_machines > 1 needs rdzv_endpoint (host:port of machine 0, reachable from every machine)")
        return self

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_machines


def launcher_for(config, step: str) -> LauncherConfig:
    """The launcher of ``step``: its section's ``launcher`` when set, else the pipeline's default."""
    section = getattr(config, step, None)
    own = getattr(section, "launcher", None) if step in TRAINING_STEPS else None
    return own if own is not None else config.launcher
