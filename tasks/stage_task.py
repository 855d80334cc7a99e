"""The one Prefect task that runs a pipeline step, parametrised by the step's name.

The decorator carries the cache policy (the step's cache key, see
:func:`verl_core.pipeline.keys.stage_key`), result persistence and retries; :func:`task_for`
names it after the step and applies the run's storage and retry settings. The body opens the
step's nested MLflow run, runs the step where its launcher says
(:func:`~verl_core.pipeline.launch.run_stage_launched`: in this process, or as a torchrun / Ray job
whose lines go to this task's log), logs the result and publishes Prefect artifacts.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import Task, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import CacheKeyFnPolicy

from tasks.prefect_settings import project_logging
from tasks.result_guard import refuse_foreign_result
from verl_core.errors import UserError
from verl_core.pipeline import model_registry, tracking
from verl_core.pipeline.cached_run import log_cached_stage
from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.launch import run_stage_launched
from verl_core.pipeline.plan import plan_stage
from verl_core.pipeline.records import StageRecord, StageResult
from verl_core.train.callbacks import Callback, MLflowCallback

Inputs = dict[str, StageRecord | None]


def _cache_key(_ctx, parameters: dict[str, Any]) -> str:
    config = parameters["config"]
    plan = plan_stage(config, parameters["stage"], parameters["inputs"], parameters.get("round"))
    key = f"{plan.name}-{plan.key}"
    refuse_foreign_result(config.result_storage_path / key)  # before Prefect reads it with the serializer it names
    return key


@task(
    name="stage",
    cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key),
    persist_result=True,
    result_serializer="json",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=lambda task, task_run, state: retryable(state),
)
def stage_task(
    stage: str, config: PipelineConfig, inputs: Inputs, parent_run_id: str | None = None, round: int | None = None
) -> StageRecord:
    """Compute pipeline step ``stage`` (round ``round`` of it) from its inputs' records (cached on its key)."""
    return execute(stage, config, inputs, parent_run_id, round)


def retryable(state) -> bool:
    """Retry transient failures only: an error in what the user gave (:class:`UserError`: config,
    data, model, checkpoint, workdir, tracking URI) fails the same way on every attempt."""
    return not isinstance(state.result(raise_on_failure=False), UserError)


def task_for(stage: str, config: PipelineConfig, round: int | None = None) -> Task:
    """The task of ``stage`` (named after its round, if any) with this run's result storage (a local
    Path), retries and cache refresh."""
    o = config.orchestration
    storage = config.result_storage_path
    storage.mkdir(parents=True, exist_ok=True)
    return stage_task.with_options(
        name=stage if round is None else f"{stage}-round{round}",
        result_storage=storage,
        retries=o.retries,
        retry_delay_seconds=o.retry_delay_seconds,
        refresh_cache=o.refresh_cache or None,
    )


def stage_callbacks(config: PipelineConfig, stage: str, run_id: str, round: int | None = None) -> list[Callback]:
    """The callbacks a step's training reports to: its nested MLflow run."""
    return [MLflowCallback(run_id)]


def _task_log_line():
    """Where a distributed job's output lines go: the Prefect task log, or this module's logger
    when called outside a task run (the Python API, tests)."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger().info
    except MissingContextError:
        return logging.getLogger(__name__).info


def execute(
    stage: str, config: PipelineConfig, inputs: Inputs, parent_run_id: str | None, round: int | None = None
) -> StageRecord:
    """Run one step (one round of it) inside a nested MLflow run, in this process or as the distributed
    job its launcher names (that job's output lines go to this task's log); FAILED on any exception, then re-raise."""
    from prefect.runtime import flow_run, task_run

    tracking.configure(config)
    project_logging()
    plan = plan_stage(config, stage, inputs, round)  # resolved once; everything below takes the plan
    run_id = tracking.start_stage_run(
        config,
        parent_run_id,
        stage,
        plan.variant,
        plan.key,
        flow_run_id=flow_run.id,
        task_run_id=task_run.id,
        attempt=task_run.run_count,
        round=round,
    )
    registered = None
    try:
        tracking.log_inputs(config, run_id, inputs)
        callbacks = stage_callbacks(config, stage, run_id, round)
        result = run_stage_launched(plan, callbacks, run_id, log_line=_task_log_line())
        tracking.log_stage_result(config, run_id, result)
        registered = _register(config, result, inputs, run_id, parent_run_id)
    except BaseException as err:
        tracking.end_run(config, run_id, "FAILED", error=err)
        raise
    tracking.end_run(config, run_id, "FINISHED")
    publish(config, result.record, run_id, result.output.tables, reused=result.reused, registered=registered)
    return result.record


def _register(config: PipelineConfig, result: StageResult, inputs: Inputs, run_id: str, parent_run_id: str | None):
    """The evaluated policy as a registered model version (the input whose folder the stage names)."""
    target = result.output.model_to_log
    final = next((r for r in inputs.values() if r is not None and target and r.output_path == str(target)), None)
    return (
        model_registry.register_policy(config, final, result.record.metrics, run_id, parent_run_id, result.record.cache_key)
        if final
        else None
    )


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict]) -> str:
    """Rows as a markdown table, floats to three decimals (Prefect renders markdown artifacts)."""
    if not rows:
        return "(no rows)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r.get(k, "")).replace("|", "\\|").replace("\n", " ") for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def publish(
    config: PipelineConfig,
    rec: StageRecord,
    run_id: str,
    tables: dict[str, list[dict]] | None = None,
    reused: bool = False,
    registered: tuple[str, bool] | None = None,
    cached_from: str | None = None,
) -> None:
    """Prefect artifacts: a markdown summary linking the stage's MLflow run, a link artifact, and tables."""
    slug = rec.stage.replace("_", "-")
    url = tracking.run_url(config, run_id)
    lines = [
        f"### {rec.stage}" + (f" ({rec.variant})" if rec.variant else ""),
        "",
        f"- MLflow run: [{run_id}]({url})",
        f"- output: `{rec.output_path}`",
        f"- fingerprint: `{rec.fingerprint[:16]}`",
    ]
    if cached_from:
        origin = tracking.run_url(config, cached_from) if tracking.run_exists(config, cached_from) else None
        lines.append("- served from the Prefect cache; computed by " + (f"[{cached_from}]({origin})" if origin else cached_from))
    if rec.extra.get("resumed_from_step"):
        lines.append(f"- resumed from checkpoint step {rec.extra['resumed_from_step']}")
    if reused:
        lines.append("- reused a complete output already on disk")
    if registered:
        name = config.tracking.registered_model_name
        lines.append(f"- registered `{name}` version {registered[0]}" + (" (alias `champion`)" if registered[1] else ""))
    if rec.metrics:
        lines += ["", markdown_table([{"metric": k, "value": v} for k, v in sorted(rec.metrics.items())])]
    create_markdown_artifact("\n".join(lines), key=f"{slug}-summary", description=f"{rec.stage} stage")
    create_link_artifact(url, link_text=f"MLflow run of {rec.stage}", key=f"{slug}-mlflow-run")
    for name, rows in (tables or {}).items():
        create_markdown_artifact(markdown_table(rows), key=f"{slug}-{name.replace('_', '-')}", description=f"{rec.stage}: {name}")


def mlflow_link(config: PipelineConfig, run_id: str | None) -> str:
    return f"[{run_id[:8]}]({tracking.run_url(config, run_id)})" if run_id else ""


def publish_cached(config: PipelineConfig, record: StageRecord, parent_run_id: str | None, flow_run_id: str | None) -> str:
    """A cache hit runs no task body: its MLflow child run (cached=true) and Prefect artifacts; returns the run id."""
    tracking.configure(config)
    run_id = log_cached_stage(config, parent_run_id, record, flow_run_id)
    publish(config, record, run_id, cached_from=record.mlflow_run_id)
    return run_id
