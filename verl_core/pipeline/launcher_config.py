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
from verl_core.processes import is_loopback

LauncherKind = Literal["local", "torchrun", "ray"]
Bind = Literal["loopback", "network"]
LOOPBACK = "127.0.0.1"
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

    ``bind`` says where the processes the launcher starts listen. ``loopback`` (the default of a
    one-machine job): on 127.0.0.1 only, reachable from this machine alone. torchrun: its agent's
    rendezvous and worker stores and the ranks' gloo / NCCL sockets. Ray: the local cluster's GCS,
    raylet, object manager, every worker, the agents and the Ray Train process-group store (no
    dashboard); the cluster also requires a token (``RAY_AUTH_MODE=token``, a fresh
    ``RAY_AUTH_TOKEN`` per job unless the environment sets ``RAY_AUTH_MODE``). ``network`` (implied by
    ``num_machines`` > 1 and by ``ray_address``): a multi-machine job. torchrun's c10d stores then
    listen on every interface and have no authentication (torch offers none): use it on a trusted
    network only. The cluster at ``ray_address`` listens and authenticates as it was started (start it
    with ``RAY_AUTH_MODE=token``; this process needs the token: ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``); a local Ray cluster with ``network`` listens on
    every interface (measured, Ray 2.60), with a token.
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
    bind: Bind | None = Field(
        None,
        description="where the launched processes listen: loopback (127.0.0.1 only) or network (a multi-machine job; "
        "torch's rendezvous store has no authentication, Ray's cluster uses its token); default loopback, "
        "network when num_machines > 1 or ray_address is set",
    )

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
        if self.bind == "loopback" and (self.num_machines > 1 or self.ray_address is not None):
            what = "num_machines > 1" if self.num_machines > 1 else "ray_address (a cluster started elsewhere)"
            raise ValueError(f"bind 'loopback' cannot serve {what}: other machines cannot reach 127.0.0.1; use bind 'network'")
        if self.on_loopback and self.rdzv_endpoint is not None and not is_loopback(self.rdzv_endpoint.rsplit(":", 1)[0]):
            raise ValueError(
                f"rdzv_endpoint {self.rdzv_endpoint!r} is not a loopback address, and a one-machine job listens on "
                "127.0.0.1 (bind 'loopback'); give 127.0.0.1:PORT, leave it unset, or set bind 'network'"
            )
        return self

    @property
    def on_loopback(self) -> bool:
        """Whether every process the launcher starts listens on 127.0.0.1 only (see ``bind``)."""
        if self.bind is not None:
            return self.bind == "loopback"
        return self.num_machines == 1 and self.ray_address is None

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_machines


def launcher_for(config, step: str) -> LauncherConfig:
    """The launcher of ``step``: its section's ``launcher`` when set, else the pipeline's default."""
    section = getattr(config, step, None)
    own = getattr(section, "launcher", None) if step in TRAINING_STEPS else None
    return own if own is not None else config.launcher
