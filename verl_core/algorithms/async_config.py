"""The ``async_rollout`` settings of the online trainers; the machinery is :mod:`.async_rollout`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from verl_core.config import StrictConfig


class AsyncRolloutConfig(StrictConfig):
    """``async_rollout`` of an online trainer: rollout workers apart from the trainer (see the module doc)."""

    max_staleness: int = Field(
        0, ge=0, description="policy versions a batch may lag the trainer; 0: synchronous, no worker (today's loop exactly)"
    )
    workers: int = Field(1, ge=1, description="rollout worker processes (step s goes to worker s % workers)")
    queue_timeout_s: float = Field(600.0, gt=0, description="longest wait for a step's batch before the stage fails")
    startup_timeout_s: float = Field(300.0, gt=0, description="longest wait for a (re)started worker to build its copy")
    max_restarts: int = Field(2, ge=0, description="restarts of a worker that died, per worker, before the stage fails")
    worker_threads: int = Field(1, ge=1, description="torch threads of each worker")
    trainer_threads: int | None = Field(1, ge=1, description="torch threads of the trainer while workers run (null: unchanged)")
    old_logprobs: Literal["behaviour", "recompute"] = Field(
        "behaviour",
        description="the old log-probs of the clipped ratio: the worker's sampled ones (behaviour: the ratio is "
        "pi_theta / pi_behaviour, no extra forward pass) or recomputed by the trainer (AReaL's decoupled proximal "
        "policy; needed by rollout_correction: tis)",
    )
    sample_while_starting: bool = Field(
        True,
        description="the trainer samples in-process (staleness 0) until every worker has built its copy, so the "
        "workers' start-up overlaps training (hf rollouts only)",
    )

    @property
    def enabled(self) -> bool:
        return self.max_staleness > 0


def check_async_config(c: Any) -> None:
    """Reject what the asynchronous path does not support, naming both settings (an OnlineConfig validator)."""
    a = c.async_rollout
    if not a.enabled:
        return
    if getattr(c, "dynamic_sampling", False):
        raise ValueError(
            "async_rollout.max_staleness > 0 with dynamic_sampling: dynamic sampling decides the next round from "
            "this round's scores inside one step; set dynamic_sampling: false or async_rollout.max_staleness: 0"
        )
    if c.environment is not None:
        raise ValueError(
            f"async_rollout.max_staleness > 0 with environment {c.environment!r}: multi-turn episodes sample in the "
            "trainer's process; set async_rollout.max_staleness: 0"
        )
    if c.rollout_correction != "none" and a.old_logprobs == "behaviour":
        raise ValueError(
            f"rollout_correction {c.rollout_correction!r} with async_rollout.old_logprobs 'behaviour': the clipped "
            "ratio is already taken against the behaviour policy, and the correction needs the trainer's own old "
            "log-probs; set async_rollout.old_logprobs: recompute or rollout_correction: none"
        )
