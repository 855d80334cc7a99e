"""A rollout worker as a Ray actor: the asynchronous trainer's workers when it runs inside a Ray job.

Under ``launcher.kind: ray`` the training process is a Ray Train worker, so its rollout workers
(:mod:`verl_core.algorithms.async_rollout`) are Ray actors of the same cluster rather than local
processes: the cluster places them (``num_cpus = async_rollout.worker_threads`` each), and Ray
kills them with their owner. The protocol is :mod:`verl_core.rollout.worker`'s, over Ray instead
of queues and files:

- **Weights.** The trainer puts version ``v`` into Ray's object store once (:class:`ObjectStoreWeights`),
  and every job carries the reference of the newest version; an actor fetches it only when it is
  newer than the one it holds. Never a checkpoint on disk.
- **Messages.** ``ready()`` answers once the actor built its copy; ``sample(job, version, [ref])``
  answers the ``("batch", step, version, payload, seconds)`` message. Ray runs an actor's calls in
  order, so the answers come in the order of the jobs.
- **Failures.** An actor that dies (``RayActorError``) reads as a dead worker (the trainer restarts
  it, bounded); an exception in a call becomes an ``("error", text)`` message.

:class:`WorkerActor` is the trainer's handle; it has :class:`verl_core.rollout.worker.WorkerProcess`'s methods.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import torch

from verl_core.rollout.worker import PolicyCopy, WorkerSpec, _fault, cpu_state


def inside_ray() -> bool:
    """Whether this process is connected to a Ray cluster (a Ray Train worker, a Ray task or actor)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class ObjectStoreWeights:
    """The newest published weights as one object in Ray's object store (older ones are freed with their references)."""

    def __init__(self) -> None:
        self.version, self.ref = -1, None

    def publish(self, version: int, model: torch.nn.Module) -> None:
        import ray

        self.version, self.ref = version, ray.put(cpu_state(model))

    def remove(self) -> None:
        self.ref = None


class RolloutActor:
    """The actor's side: a :class:`~verl_core.rollout.worker.PolicyCopy` serving jobs."""

    def __init__(self, index: int, incarnation: int, spec: WorkerSpec):
        torch.set_num_threads(spec.threads)
        self.index, self.incarnation = index, incarnation
        _fault("start", incarnation, None)
        self.copy = PolicyCopy(spec)

    def ready(self) -> tuple:
        return ("ready", os.getpid())

    def sample(self, job: tuple, version: int, weights: list) -> tuple:
        import ray

        step, prompt_ids, seed = job
        _fault(step, self.incarnation, None)
        if version > self.copy.held:
            self.copy.load(version, ray.get(weights[0]))  # a list: Ray passes the reference, not the tensors
        return self.copy.sample(step, prompt_ids, seed)


class WorkerActor:
    """The trainer's handle on one worker run as a Ray actor (see the module doc)."""

    kind = "Ray actor"

    def __init__(self, index: int, incarnation: int, spec: WorkerSpec):
        import ray

        remote = ray.remote(RolloutActor).options(num_cpus=spec.threads, max_restarts=0, name=None)
        self.actor = remote.remote(index, incarnation, spec)
        self.answers: collections.deque = collections.deque([self.actor.ready.remote()])
        self.pid: int | None = None
        self.death: str | None = None

    def send(self, job: tuple, store: ObjectStoreWeights) -> None:
        self.answers.append(self.actor.sample.remote(job, store.version, [store.ref]))

    def receive(self, timeout: float) -> tuple | None:
        import ray

        if not self.answers or self.death is not None:
            time.sleep(min(timeout, 0.05))
            return None
        done, _ = ray.wait([self.answers[0]], timeout=timeout)
        if not done:
            return None
        ref = self.answers.popleft()
        try:
            msg: Any = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            self.death = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            self.answers.clear()
            return None
        except ray.exceptions.RayTaskError as err:
            return ("error", f"rollout worker (Ray actor): {err}")
        if msg[0] == "ready":
            self.pid = msg[1]
        return msg

    def alive(self) -> bool:
        return self.death is None

    def exit_status(self) -> str:
        return f"died (Ray: {self.death})" if self.death else "a Ray actor, alive"

    def stop(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001  (already gone)
            pass
