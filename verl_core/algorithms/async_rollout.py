"""Asynchronous rollout: sampling in worker processes while the trainer updates, with bounded staleness.

In the synchronous loop the trainer samples step ``s``, then updates on it, and the sampler idles
while the trainer trains (and the reverse). Here ``async_rollout.workers`` processes
(:mod:`verl_core.rollout.worker`; Ray actors when the trainer runs inside a Ray job,
:mod:`verl_core.rollout.ray_actor`) sample, and the batch of step ``s`` may have been sampled with
the weights of any version ``v >= s - max_staleness`` (version ``v``: the weights after ``v``
updates). With ``max_staleness = 1`` the worker samples step ``s + 1`` while the trainer trains
step ``s``: verl's one-step-off-policy recipe; larger bounds are AReaL's staleness-bounded
asynchronous RL (Fu et al. 2025, arXiv:2505.24298, Sec. 4). ``max_staleness = 0`` (the default)
starts nothing: the trainer builds its usual in-process backend, today's loop bit for bit.

Correctness with staleness > 0: the batch is off-policy by up to ``max_staleness`` updates. By
default (``old_logprobs: behaviour``) the worker's sampled log-probs are the old log-probs of the
clipped surrogate, so its ratio is ``pi_theta / pi_behaviour``: PPO's own importance ratio
against the policy that actually sampled the batch (Schulman et al. 2017, arXiv:1707.06347, Eq. 7),
clipped to ``1 +- clip_range``; no extra forward pass, and the loss logs ``mismatch/*`` between
``pi_theta`` and the behaviour policy. ``old_logprobs: recompute`` has the trainer recompute them with
its current weights (AReaL's decoupled "proximal" policy) and keeps the worker's as the behaviour
policy (``rollout_logp``), exactly the path of a vLLM sampler
(:func:`~verl_core.losses.correction.correct_rollout_mismatch`), where ``rollout_correction: tis``
reweights each token by the truncated importance ratio ``min(pi_train / pi_behaviour, tis_cap)``.

Start-up: spawning a worker costs seconds (imports, building its copy). With
``sample_while_starting`` (the default, HF rollouts) the trainer samples each step itself, with its
current weights (staleness 0), until every worker is ready, then hands the next steps to them: the
start-up overlaps training instead of stalling it.

:class:`AsyncRolloutBackend` is what the trainer sees: a :class:`~verl_core.rollout.contract.RolloutBackend`
whose ``generate`` returns the queued batch of the engine's current step (checked against the
prompts and seed the trainer asked for) and whose ``sync_weights`` publishes the next version.
Workers start at the first ``generate``, i.e. after the engine resumed: a resumed run samples from
the resumed step with the resumed weights, queue contents are not kept, and no step is trained
twice. A worker that dies is restarted up to ``max_restarts`` times (its pending jobs are sent
again); then, or when no batch arrives within ``queue_timeout_s``, the step fails naming the
worker, its exit code or last error.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import torch

from verl_core.algorithms.sampling import step_request
from verl_core.config import ConfigError
from verl_core.errors import TrainingError
from verl_core.rollout.contract import RolloutBatch
from verl_core.rollout.ray_actor import ObjectStoreWeights, WorkerActor, inside_ray
from verl_core.rollout.registry import build_rollout_backend
from verl_core.rollout.worker import WeightStore, WorkerProcess, WorkerSpec, batch_from_bytes

log = logging.getLogger("verl_core")


def build_backend(trainer: Any, lm: torch.nn.Module, autocast: torch.dtype | None) -> Any:
    """The trainer's rollout backend: the in-process one (``max_staleness`` 0) or an :class:`AsyncRolloutBackend`."""
    c, processes = trainer.config, trainer.engine.accelerator.num_processes
    if not c.async_rollout.enabled:
        return build_rollout_backend(c.rollout, lm, trainer.policy.tokenizer, autocast, processes)
    if processes > 1:
        raise ConfigError(
            f"async_rollout.max_staleness > 0 runs with one training process; this run has {processes} "
            "(launcher.num_processes: 1, or async_rollout.max_staleness: 0)"
        )
    if hasattr(lm, "get_base_model"):
        raise ConfigError("async_rollout.max_staleness > 0 with a LoRA policy: workers load full weights; use lora: null")
    return AsyncRolloutBackend(trainer, lm, autocast)


class _Worker:
    def __init__(self, index: int):
        self.index, self.incarnation, self.restarts, self.ready, self.spawned_at = index, -1, 0, False, 0.0
        self.handle: Any = None  # a WorkerProcess or a WorkerActor
        self.pending: collections.deque = collections.deque()  # jobs sent, batch not yet received
        self.inbox: collections.deque = collections.deque()  # messages read while only looking for "ready"


class AsyncRolloutBackend:
    """The trainer's side of the workers (see the module doc)."""

    def __init__(self, trainer: Any, lm: torch.nn.Module, autocast: torch.dtype | None):
        c = trainer.config
        self.trainer, self.lm, self.settings = trainer, lm, c.async_rollout
        # inside a Ray job (launcher.kind: ray) the workers are Ray actors fed from the object store
        self.on_ray = inside_ray()
        self.store = ObjectStoreWeights() if self.on_ray else WeightStore()
        self.worker_cls = WorkerActor if self.on_ray else WorkerProcess
        self.spec = WorkerSpec(
            model_config=lm.config,
            dtype=next(lm.parameters()).dtype,
            tokenizer=trainer.policy.tokenizer,
            rollout=c.rollout,
            sampling=trainer.sampling,
            autocast_dtype=autocast,
            max_staleness=self.settings.max_staleness,
            threads=self.settings.worker_threads,
            weights_dir=str(getattr(self.store, "folder", "")),
        )
        self.workers = [_Worker(i) for i in range(self.settings.workers)]
        self.step: int | None = None  # the step whose batch was handed out last
        self.next_job = 0
        self.last: dict[str, float] = {}
        self.max_seen = 0
        self.threads_before = torch.get_num_threads()
        self.behaviour_is_old = self.settings.old_logprobs == "behaviour"
        # while the workers start, the trainer samples in-process from its own module (only with a backend that
        # shares it: a second vLLM engine in the trainer would cost the memory and compile time the workers take)
        self.local = None
        if self.settings.sample_while_starting and c.rollout.spec.shares_training_model:
            self.local = build_rollout_backend(c.rollout, lm, trainer.policy.tokenizer, autocast, 1)
        self.in_process_steps = 0

    # -- the RolloutBackend protocol ---------------------------------------------------------
    def generate(self, prompt_ids, params, seed) -> RolloutBatch:
        step = self.trainer.engine.step
        if self.step is None:
            self._start(step)
        if self.next_job <= step:  # nothing was sent for this step: the workers were still starting
            if self.local is not None and not self._all_ready() and self._starting_normally():
                return self._generate_in_process(step, prompt_ids, params, seed)
            self._submit_up_to(step + self.settings.max_staleness)
        w = self.workers[step % len(self.workers)]
        t0 = time.perf_counter()
        got, version, payload, gen_seconds = self._receive(w, step)
        job = w.pending.popleft()
        if got != step or job[0] != step or job[2] != seed or [list(p) for p in prompt_ids] != job[1]:
            raise TrainingError(f"rollout worker {w.index} answered step {got}, the trainer is at step {step} (a bug)")
        staleness = step - version
        if not 0 <= staleness <= self.settings.max_staleness:
            raise TrainingError(
                f"step {step} got a batch of policy version {version}: staleness {staleness} outside "
                f"[0, async_rollout.max_staleness={self.settings.max_staleness}] (a bug)"
            )
        self.step, self.max_seen = step, max(self.max_seen, staleness)
        self.last = self._metrics(staleness, version, time.perf_counter() - t0, gen_seconds)
        return batch_from_bytes(payload)

    def _metrics(self, staleness: int, version: int, wait: float, gen_seconds: float) -> dict[str, float]:
        return {
            "async/staleness": float(staleness),
            "async/staleness_max": float(self.max_seen),
            "async/policy_version": float(version),
            "async/queue_wait_s": wait,
            "async/worker_gen_seconds": gen_seconds,
            "async/restarts": float(sum(x.restarts for x in self.workers)),
            "async/in_process_steps": float(self.in_process_steps),
            "async/ray_actor_workers": float(len(self.workers) if self.on_ray else 0),
        }

    def _generate_in_process(self, step: int, prompt_ids, params, seed) -> RolloutBatch:
        """Step ``step`` sampled by the trainer with its current weights (staleness 0); once every worker is
        ready, the steps up to ``step + max_staleness`` go to them, so the next one is sampled meanwhile."""
        t0 = time.perf_counter()
        batch = self.local.generate(prompt_ids, params, seed=seed)
        self.step, self.next_job = step, step + 1
        self.in_process_steps += 1
        self.last = {**self._metrics(0, step, 0.0, 0.0), "async/in_process_gen_seconds": time.perf_counter() - t0}
        if self._all_ready():
            self._submit_up_to(step + self.settings.max_staleness)
        return batch

    def sync_weights(self, model: torch.nn.Module) -> None:
        """After the update of step ``s``: publish version ``s + 1``, send the jobs it unlocks."""
        if self.step is None:
            return
        self.store.publish(self.step + 1, model)
        if self.local is None or self._all_ready():
            self._submit_up_to(self.step + 1 + self.settings.max_staleness)

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def worker_pids(self) -> list[int]:
        return [w.handle.pid for w in self.workers if w.handle is not None and w.handle.pid is not None]

    def close(self) -> None:
        for w in self.workers:  # a worker holds nothing worth a graceful exit: stop them all at once
            self._stop(w)
        self.store.remove()
        if self.settings.trainer_threads is not None:
            torch.set_num_threads(self.threads_before)

    # -- workers -----------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        if self.settings.trainer_threads is not None:
            torch.set_num_threads(self.settings.trainer_threads)
        self.store.publish(step, self.lm)  # version = updates so far (the resumed weights on resume)
        self.next_job = step
        for w in self.workers:
            self._spawn(w)
        if self.local is None:
            self._submit_up_to(step + self.settings.max_staleness)

    def _starting_normally(self) -> bool:
        """No worker died or overran ``startup_timeout_s`` while starting (else :meth:`_receive` restarts or fails)."""
        limit = self.settings.startup_timeout_s
        return all(w.ready or (w.handle.alive() and time.monotonic() - w.spawned_at < limit) for w in self.workers)

    def _all_ready(self) -> bool:
        """Whether every worker has built its copy (reads the "ready" messages that arrived, without waiting)."""
        for w in self.workers:
            while not w.ready:
                msg = w.handle.receive(0)
                if msg is None:
                    break
                if msg[0] == "ready":
                    w.ready = True
                else:  # a batch or an error: _receive deals with it in order
                    w.inbox.append(msg)
                    break
        return all(w.ready for w in self.workers)

    def _job(self, step: int) -> tuple[int, list[list[int]], int | list[int]]:
        """The prompts and seed the synchronous loop samples at ``step`` (one process: rank 0 of 1)."""
        examples, seed = step_request(self.trainer, step)
        return step, [list(e["prompt_ids"]) for e in examples], seed

    def _submit_up_to(self, last: int) -> None:
        last = min(last, self.trainer.engine.total_steps - 1)
        while self.next_job <= last:
            w = self.workers[self.next_job % len(self.workers)]
            job = self._job(self.next_job)
            w.pending.append(job)
            w.handle.send(job, self.store)
            self.next_job += 1

    def _spawn(self, w: _Worker) -> None:
        w.incarnation += 1
        w.ready, w.spawned_at = False, time.monotonic()
        w.inbox.clear()
        w.handle = self.worker_cls(w.index, w.incarnation, self.spec)
        for job in w.pending:  # a restarted worker takes over what its predecessor had not delivered
            w.handle.send(job, self.store)
        log.info("rollout worker %d started as a %s (incarnation %d)", w.index, w.handle.kind, w.incarnation)

    def _stop(self, w: _Worker) -> None:
        if w.handle is not None:
            w.handle.stop()
            w.handle = None

    def _receive(self, w: _Worker, step: int) -> tuple[int, int, bytes, float]:
        """The next message of worker ``w``: restart it when it died (bounded), fail on its error or a timeout."""
        timeout, startup = self.settings.queue_timeout_s, self.settings.startup_timeout_s
        deadline = time.monotonic() + (timeout if w.ready else max(timeout, startup))
        while True:
            msg = w.inbox.popleft() if w.inbox else w.handle.receive(max(0.01, min(0.5, deadline - time.monotonic())))
            if msg is not None and msg[0] == "batch":
                return msg[1], msg[2], msg[3], msg[4]
            if msg is not None and msg[0] == "ready":  # the copy is built: the queue timeout now bounds sampling
                w.ready, deadline = True, time.monotonic() + timeout
                continue
            if msg is None and w.handle.alive():
                if time.monotonic() >= deadline:
                    pid = w.handle.pid
                    self._stop(w)
                    what = f"queue_timeout_s={timeout:g}s" if w.ready else f"startup_timeout_s={max(timeout, startup):g}s"
                    raise TrainingError(
                        f"rollout worker {w.index} (pid {pid}) delivered no batch for step {step} within "
                        f"async_rollout.{what}; it was stopped"
                    )
                continue
            if msg is None:  # died: a last message may still be in the pipe
                msg = w.handle.receive(0.5)
                if msg is not None and msg[0] == "batch":
                    return msg[1], msg[2], msg[3], msg[4]
            if msg is None:
                why = w.handle.exit_status()
                if not w.ready:  # spawn runs the parent's main module first: an unguarded script starts training again
                    why += (
                        " while starting (before it reported ready; its stderr says why: a script that trains "
                        'must start training under `if __name__ == "__main__":`, since a worker imports the main module)'
                    )
            else:
                why = f"failed ({w.handle.exit_status()}): {msg[1].strip().splitlines()[-1]}"
            if w.restarts >= self.settings.max_restarts:
                self._stop(w)
                detail = msg[1] if msg is not None else ""
                raise TrainingError(
                    f"rollout worker {w.index} {why} at step {step}, after {w.restarts} restarts "
                    f"(async_rollout.max_restarts={self.settings.max_restarts}){': ' + detail if detail else ''}"
                )
            log.warning("rollout worker %d %s at step %d: restarting it", w.index, why, step)
            self._stop(w)
            w.restarts += 1
            self._spawn(w)
            deadline = time.monotonic() + max(timeout, startup)
