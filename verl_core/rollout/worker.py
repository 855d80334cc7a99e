"""A rollout worker process: samples the trainer's rollout jobs with the newest published policy weights.

Asynchronous RL (:mod:`verl_core.algorithms.async_rollout`) moves sampling out of the trainer's
process, so that the next step's batch is sampled while the trainer updates on the current one
(AReaL, Fu et al. 2025, arXiv:2505.24298; verl's one-step-off-policy recipe). This module is the
worker's side; it holds no trainer state:

- **Jobs.** The trainer sends ``(step, prompt_ids, seed)``: the prompts and sampling seed the
  synchronous loop would use at ``step`` (``OnlineTrainer.rollout_seed``, ``step_prompt_indices``),
  so a batch is a pure function of ``(step, policy version)``.
- **Weights.** The trainer publishes version ``v`` (the weights after ``v`` updates) as one file
  ``v00000012.pt`` in a shared-memory folder (``/dev/shm`` when there is one), written to a
  temporary name and renamed, so a reader never sees half a file; never a checkpoint on disk.
  Before sampling ``step`` the worker waits until a version ``>= step - max_staleness`` exists and
  loads the newest one (in place: the HF backend samples from the same module, vLLM gets
  ``sync_weights``).
- **Results.** ``("ready", pid)`` once the policy copy is built, then ``("batch", step, version,
  payload, seconds)`` with the :class:`RolloutBatch` tensors (the behaviour log-probs among them)
  serialised by ``torch.save`` into bytes, or ``("error", text)`` before the worker exits with code 1.
- **Orphans.** While waiting the worker polls its parent; a trainer killed with SIGKILL leaves no
  sampler running.

``VERL_CORE_ROLLOUT_WORKER_FAULT`` (``exit:STEP``, ``raise:STEP``, ``hang:STEP``, optionally
``:always``) injects a failure when the worker takes ``STEP``'s job (``STEP`` = ``start``: before
it is ready), in its first incarnation only unless ``always``: the tests' hook for worker death and hangs.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from verl_core.rollout.contract import RolloutBatch

FAULT_ENV = "VERL_CORE_ROLLOUT_WORKER_FAULT"
_POLL_S = 0.05


@dataclass
class WorkerSpec:
    """What a worker needs to build its own policy copy and sampler (sent once, at spawn)."""

    model_config: Any  # the policy LM's transformers config
    dtype: torch.dtype
    tokenizer: Any
    rollout: Any  # RolloutConfig
    sampling: Any  # SamplingParams
    autocast_dtype: torch.dtype | None
    max_staleness: int
    threads: int
    weights_dir: str


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s weights on the CPU, detached: what a version of the policy publishes."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class WeightStore:
    """Versions of the policy weights in a shared-memory folder: :meth:`publish` (trainer), :meth:`newest` /
    :meth:`load` (workers). Only the newest version is kept; a reader whose file was just replaced
    looks again."""

    def __init__(self, folder: str | Path | None = None):
        if folder is None:
            shm = Path("/dev/shm")
            base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
            folder = tempfile.mkdtemp(prefix="verl-core-weights-", dir=base)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        state = cpu_state(model)
        tmp = self.folder / f".tmp-v{version:08d}.pt"
        torch.save(state, tmp)
        tmp.rename(self.folder / f"v{version:08d}.pt")
        for old in self.folder.glob("v*.pt"):
            if _version_of(old) < version:
                old.unlink(missing_ok=True)

    def newest(self) -> int:
        """The newest published version (-1: none yet)."""
        return max((_version_of(p) for p in self.folder.glob("v*.pt")), default=-1)

    def load(self, version: int) -> dict[str, torch.Tensor] | None:
        try:
            return torch.load(self.folder / f"v{version:08d}.pt", weights_only=True)
        except FileNotFoundError:
            return None  # replaced by a newer version meanwhile

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def _version_of(path: Path) -> int:
    return int(path.stem.removeprefix("v"))


def batch_to_bytes(batch: RolloutBatch) -> bytes:
    buf = io.BytesIO()
    torch.save({f.name: getattr(batch, f.name) for f in fields(batch)}, buf)
    return buf.getvalue()


def batch_from_bytes(payload: bytes) -> RolloutBatch:
    return RolloutBatch(**torch.load(io.BytesIO(payload), weights_only=True))


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def _fault(step: int | str, incarnation: int, results) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, at, *always = spec.split(":")
    if at != str(step) or (incarnation > 0 and not always):
        return
    if kind == "exit":
        if results is not None:  # what was sent reaches the trainer (a real crash mid-job also comes after "ready")
            results.close()
            results.join_thread()
        os._exit(3)
    if kind == "raise":
        raise RuntimeError(f"injected rollout worker fault at step {step}")
    if kind == "hang":
        while _parent_alive():
            time.sleep(0.2)
        os._exit(0)


def _next_job(jobs) -> Any:
    while True:
        try:
            return jobs.get(timeout=0.5)
        except queue.Empty:
            if not _parent_alive():
                os._exit(0)


def _wait_for_version(store: WeightStore, need: int) -> int:
    while (version := store.newest()) < need:
        if not _parent_alive():
            os._exit(0)
        time.sleep(_POLL_S)
    return version


class PolicyCopy:
    """A worker's own model and sampler; :meth:`load` brings them to a newer weights version."""

    def __init__(self, spec: WorkerSpec):
        from transformers import AutoModelForCausalLM

        self.spec = spec
        self.model = AutoModelForCausalLM.from_config(spec.model_config, dtype=spec.dtype).eval().requires_grad_(False)
        self.backend: Any = None
        self.held = -1  # the version the model holds

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        from verl_core.rollout.registry import build_rollout_backend

        self.model.load_state_dict(state)
        self.held = version
        if self.backend is None:
            self.backend = build_rollout_backend(self.spec.rollout, self.model, self.spec.tokenizer, self.spec.autocast_dtype)
        else:
            self.backend.sync_weights(self.model)

    def sample(self, step: int, prompt_ids, seed) -> tuple:
        """The ``("batch", step, version, payload, seconds)`` message of one job."""
        t0 = time.perf_counter()
        batch = self.backend.generate(prompt_ids, self.spec.sampling, seed=seed)
        return ("batch", step, self.held, batch_to_bytes(batch.to("cpu")), time.perf_counter() - t0)


def worker_main(index: int, incarnation: int, spec: WorkerSpec, jobs, results) -> None:
    """The worker process (spawned): build the policy copy and backend, then serve jobs until ``None``."""
    try:
        torch.set_num_threads(spec.threads)
        _fault("start", incarnation, results)
        store = WeightStore(spec.weights_dir)
        copy = PolicyCopy(spec)
        results.put(("ready", os.getpid()))  # the trainer's queue timeout restarts: building the copy is not sampling
        while (job := _next_job(jobs)) is not None:
            step, prompt_ids, seed = job
            _fault(step, incarnation, results)
            version = _wait_for_version(store, step - spec.max_staleness)
            while version > copy.held:
                state = store.load(version)
                if state is None:  # replaced while we looked: take the newer one
                    version = store.newest()
                    continue
                copy.load(version, state)
            results.put(copy.sample(step, prompt_ids, seed))
    except BaseException:  # noqa: BLE001  (the trainer gets the traceback as data, then the exit code)
        results.put(("error", f"rollout worker {index}: {traceback.format_exc()}"))
        results.close()
        results.join_thread()
        sys.exit(1)


class WorkerProcess:
    """The trainer's handle on one worker run as a spawned local process (jobs and messages over queues,
    weights from the :class:`WeightStore` folder). :class:`verl_core.rollout.ray_actor.WorkerActor` is the
    same handle on a Ray actor."""

    kind = "process"

    def __init__(self, index: int, incarnation: int, spec: WorkerSpec):
        ctx = multiprocessing.get_context("spawn")  # fork after torch started its threads is unsafe
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=worker_main,
            args=(index, incarnation, spec, self.jobs, self.results),
            name=f"verl-core-rollout-{index}",
            daemon=True,
        )
        self.process.start()
        self.pid = self.process.pid

    def send(self, job: tuple, store: WeightStore) -> None:
        self.jobs.put(job)  # the worker reads the weights it needs from the store itself

    def receive(self, timeout: float) -> tuple | None:
        """The next message, waiting up to ``timeout`` seconds (0: only what already arrived); None: none."""
        try:
            return self.results.get(timeout=timeout) if timeout > 0 else self.results.get_nowait()
        except queue.Empty:
            return None

    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_status(self) -> str:
        self.process.join(timeout=5)
        return f"exited with code {self.process.exitcode}"

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        for q in (self.jobs, self.results):
            q.cancel_join_thread()
            q.close()
