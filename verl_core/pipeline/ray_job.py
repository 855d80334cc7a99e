"""A Ray driver for one distributed stage: ``python -m verl_core.pipeline.ray_job REQUEST``.

It runs :func:`verl_core.pipeline.worker.run_request` on ``num_processes`` Ray Train workers
(``TorchTrainer``: Ray starts the workers, sets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` and
the torch process group, gloo on CPU or NCCL on GPUs; accelerate then finds that group). With
``ray_address`` unset, a local cluster is started for the job and stopped after it. The driver
is its own process so that the flow-run process never holds a Ray connection and the launcher
streams its lines (Ray forwards the workers' output to the driver) like a torchrun job's.

On loopback (``launcher.on_loopback``, a local cluster) every process of the cluster listens on
127.0.0.1 and the cluster requires a token; the environment comes from
:func:`verl_core.pipeline.launch.loopback_environment`. Ray binds its GCS, raylet, object manager and
workers to the node IP, so the node IP is 127.0.0.1 (checked after ``ray.init``); the dashboard is
off. The process group's TCPStore, which Ray Train's ``TorchConfig`` lets torch bind on every
interface, is hosted by rank 0 on 127.0.0.1 instead (:func:`loopback_torch_config`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from verl_core.pipeline.launcher_config import LOOPBACK
from verl_core.pipeline.worker import run_request


def _train_loop(request: str) -> None:
    run_request(request)


_STORE = []  # rank 0's process-group store on loopback, alive as long as the worker


def _host_loopback_store() -> int:
    from verl_core.pipeline.launch import loopback_tcp_store

    _STORE.append(loopback_tcp_store(multi_tenant=True))  # init_process_group on rank 0 reuses it (multi-tenant)
    return _STORE[-1].port


def _set_master(port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)


def loopback_torch_config(backend: str):
    """A Ray Train ``TorchConfig`` whose process group meets at a TCPStore that rank 0 hosts on 127.0.0.1.

    Ray's ``TorchConfig`` sets ``MASTER_ADDR`` / ``MASTER_PORT`` to the node IP and a free port and lets
    ``init_process_group`` start the store, which torch binds on every interface. Its backend here does
    what Ray's does for gloo and NCCL (Ray 2.60's ``ray.train.torch.config``: the same private helpers
    for the rank variables and the group), with the store on loopback; shutdown is Ray's."""
    import ray
    from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _set_torch_distributed_env_vars, _setup_torch_process_group, _TorchBackend

    from verl_core.pipeline import ray_job as job  # by reference, not this __main__: the store stays in its module

    class LoopbackTorchBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config) -> None:
            port = worker_group.execute_single(0, job._host_loopback_store)
            worker_group.execute(job._set_master, port=port)
            if not isinstance(worker_group, V1WorkerGroup):
                worker_group.execute(_set_torch_distributed_env_vars)
            n = len(worker_group)
            setup = dict(backend=backend_config.backend, world_size=n, init_method="env://", timeout_s=backend_config.timeout_s)
            ray.get([worker_group.execute_single_async(i, _setup_torch_process_group, world_rank=i, **setup) for i in range(n)])

    class LoopbackTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return LoopbackTorchBackend

    return LoopbackTorchConfig(backend=backend)


def run(request_path: str) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from verl_core.pipeline.launcher_config import LauncherConfig, launcher_for
    from verl_core.pipeline.plan import StagePlan

    plan = StagePlan.from_request(json.loads(Path(request_path).read_text())["plan"])
    config = plan.config
    launcher: LauncherConfig = launcher_for(config, plan.name)
    forwarded = ("PYTHONPATH", "OMP_NUM_THREADS", "TQDM_DISABLE", "PYTHONUNBUFFERED", "MLFLOW_TRACKING_URI")
    forwarded += ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    env_vars = {k: os.environ[k] for k in forwarded if k in os.environ}
    env_vars.update(launcher.env)
    runtime_env = {"env_vars": env_vars}
    rollout = config.async_rollout_settings() if plan.name == "policy_optimisation" else None
    rollout_cpus = rollout.workers * rollout.worker_threads if rollout is not None else 0  # its Ray actors' share
    if launcher.ray_address is None:
        ray.init(
            num_cpus=max(1, int(launcher.num_processes * launcher.cpus_per_worker + 0.999)) + rollout_cpus,
            num_gpus=int(launcher.num_processes * launcher.gpus_per_worker + 0.999),
            include_dashboard=False,
            runtime_env=runtime_env,
            **({"_node_ip_address": LOOPBACK} if launcher.on_loopback else {}),
        )
        if launcher.on_loopback and ray.util.get_node_ip_address() != LOOPBACK:
            ray.shutdown()
            raise RuntimeError(
                f"the local Ray cluster's node IP is {ray.util.get_node_ip_address()}, not {LOOPBACK}: its processes would "
                "listen there (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must be set before ray is imported)"
            )
    else:
        ray.init(address=launcher.ray_address, runtime_env=runtime_env)
    backend = "nccl" if launcher.gpus_per_worker else "gloo"
    resources = {"CPU": launcher.cpus_per_worker}
    if launcher.gpus_per_worker:
        resources["GPU"] = launcher.gpus_per_worker
    try:
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config=str(Path(request_path).resolve()),
            scaling_config=ScalingConfig(
                num_workers=launcher.num_processes, use_gpu=launcher.gpus_per_worker > 0, resources_per_worker=resources
            ),
            torch_config=(loopback_torch_config if launcher.on_loopback else TorchConfig)(backend=backend),
            run_config=RunConfig(
                name=f"verl-core-{plan.name}",
                storage_path=str(Path(request_path).resolve().parent / "ray"),
                failure_config=FailureConfig(max_failures=0),  # retries belong to the Prefect task
            ),
        )
        trainer.fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m verl_core.pipeline.ray_job REQUEST.json", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    run(sys.argv[1])
