"""A Ray driver for one distributed stage: ``python -m verl_core.pipeline.ray_job REQUEST``.

It runs :func:`verl_core.pipeline.worker.run_request` on ``num_processes`` Ray Train workers
(``TorchTrainer``: Ray starts the workers, sets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` and
the torch process group, gloo on CPU or NCCL on GPUs; accelerate then finds that group). With
``ray_address`` unset, a local cluster is started for the job and stopped after it. The driver
is its own process so that the flow-run process never holds a Ray connection and the launcher
streams its lines (Ray forwards the workers' output to the driver) like a torchrun job's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from verl_core.pipeline.worker import run_request


def _train_loop(request: str) -> None:
    run_request(request)


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
            _node_ip_address="127.0.0.1",
            runtime_env=runtime_env,
        )
    else:
        ray.init(address=launcher.ray_address, runtime_env=runtime_env)
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
            torch_config=TorchConfig(backend="nccl" if launcher.gpus_per_worker else "gloo"),
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
