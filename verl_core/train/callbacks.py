"""Metric callbacks: the kernel reports numbers here and never needs a tracking server."""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("verl_core")


class Callback:
    """Hooks the engine calls; override what you need. All are no-ops here.

    ``step`` is the loop step (offline: the optimizer step; online: the rollout step) except in
    :meth:`on_update`. ``on_log`` and ``on_update`` run on the main process only (their metrics are
    already global); the others run on every process.
    """

    def on_train_begin(self, params: dict[str, Any]) -> None: ...

    def on_update(self, step: int, metrics: dict[str, float]) -> None:
        """After every optimizer step: ``step`` counts optimizer steps, ``metrics`` are that step's own
        (not averaged over ``logging_steps``). Online, a rollout step makes several updates; this sees each."""

    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_step_end(self, step: int) -> None: ...

    def on_checkpoint(self, step: int, path: str) -> None: ...

    def on_train_end(self, status: str, metrics: dict[str, float]) -> None: ...

    def on_table(self, step: int, name: str, columns: dict[str, list]) -> None:
        """A table of samples at loop step ``step`` (main process only), e.g. an evaluation's agent
        trajectories: ``columns`` maps each column name to its values, one per row."""

    def on_samples(self, step: int, kind: str, samples: list[dict]) -> None:
        """Samples of what the policy wrote at loop step ``step`` (main process only): ``kind`` is
        ``"rollout"`` (training) or ``"evaluation"``; each sample is a dict of the form
        :mod:`verl_core.train.traces` describes (prompt, completion, reward, agent turns)."""


class ConsoleCallback(Callback):
    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))


class MLflowCallback(Callback):
    """Logs params and per-step metrics to an MLflow run (the given id, else the active run)."""

    def __init__(self, run_id: str | None = None, prefix: str = ""):
        import mlflow

        self.client = mlflow.MlflowClient()
        active = mlflow.active_run()
        self.run_id = run_id or (active.info.run_id if active else None)
        if self.run_id is None:
            raise ValueError("MLflowCallback needs a run_id or an active MLflow run")
        self.prefix = prefix

    def on_train_begin(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = {f"{self.prefix}{k}": str(v)[:6000] for k, v in params.items()}
        existing = self.client.get_run(self.run_id).data.params
        fresh = [Param(k, v) for k, v in flat.items() if k not in existing]
        for i in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[i : i + 100])

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"{self.prefix}{k}", float(v), now, step) for k, v in metrics.items() if math.isfinite(v)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def on_table(self, step: int, name: str, columns: dict[str, list]) -> None:
        """An MLflow table artifact ``<name>/step_<step>.json`` (the run's Artifacts and Evaluation views)."""
        self.client.log_table(self.run_id, data=columns, artifact_file=f"{self.prefix}{name}/step_{step:06d}.json")

    def on_samples(self, step: int, kind: str, samples: list[dict]) -> None:
        """Each sample as an MLflow trace linked to the run (:mod:`verl_core.train.traces`)."""
        from verl_core.train.traces import log_sample_traces

        log_sample_traces(self.client, self.run_id, f"{self.prefix}{kind}", step, samples)


class HistoryCallback(Callback):
    """Keeps every logged metric in memory: ``history[name] = [(step, value), ...]``."""

    def __init__(self):
        self.history: dict[str, list[tuple[int, float]]] = {}

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.history.setdefault(k, []).append((step, float(v)))
