"""The one Prefect task that runs a pipeline step, parametrised by the step's name.

The decorator carries the cache policy (the step's cache key, see
:func:`verl_core.pipeline.keys.stage_key`), result persistence and retries; :func:`task_for`
names it after the step and applies the run's storage and retry settings. The body opens the
step's nested MLflow run, runs :func:`~verl_core.pipeline.runner.run_stage`, logs the result and
publishes Prefect artifacts.
"""

from __future__ import annotations

from typing import Any

from prefect import Task, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import CacheKeyFnPolicy

from verl_core.callbacks import Callback, MLflowCallback
from verl_core.errors import UserError
from verl_core.pipeline import tracking
from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.keys import stage_key
from verl_core.pipeline.records import StageRecord, StageResult
from verl_core.pipeline.registry import variant_of
from verl_core.pipeline.runner import run_stage

Inputs = dict[str, StageRecord | None]


def _cache_key(_ctx, parameters: dict[str, Any]) -> str:
    stage = parameters["stage"]
    return f"{stage}-{stage_key(parameters['config'], stage, parameters['inputs'])}"


@task(
    name="stage",
    cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key),
    persist_result=True,
    result_serializer="json",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=lambda task, task_run, state: retryable(state),
)
def stage_task(stage: str, config: PipelineConfig, inputs: Inputs, parent_run_id: str | None = None) -> StageRecord:
    """Compute pipeline step ``stage`` from its inputs' records (cached on its key)."""
    return execute(stage, config, inputs, parent_run_id)


def retryable(state) -> bool:
    """Retry transient failures only: an error in what the user gave (:class:`UserError`: config,
    data, model, checkpoint, workdir, tracking URI) fails the same way on every attempt."""
    return not isinstance(state.result(raise_on_failure=False), UserError)


def task_for(stage: str, config: PipelineConfig) -> Task:
    """The task of ``stage`` with this run's result storage (a local Path), retries and cache refresh."""
    o = config.orchestration
    storage = config.result_storage_path
    storage.mkdir(parents=True, exist_ok=True)
    return stage_task.with_options(
        name=stage,
        result_storage=storage,
        retries=o.retries,
        retry_delay_seconds=o.retry_delay_seconds,
        refresh_cache=o.refresh_cache or None,
    )


def stage_callbacks(config: PipelineConfig, stage: str, run_id: str) -> list[Callback]:
    """The callbacks a step's training reports to: its nested MLflow run."""
    return [MLflowCallback(run_id)]


def execute(stage: str, config: PipelineConfig, inputs: Inputs, parent_run_id: str | None) -> StageRecord:
    """Run one step inside a nested MLflow run; FAILED on any exception, then re-raise."""
    from prefect.runtime import flow_run, task_run

    tracking.configure(config)
    key = stage_key(config, stage, inputs)
    run_id = tracking.start_stage_run(
        config,
        parent_run_id,
        stage,
        variant_of(config, stage),
        key,
        flow_run_id=flow_run.id,
        task_run_id=task_run.id,
        attempt=task_run.run_count,
    )
    try:
        tracking.log_inputs(config, run_id, inputs)
        result = run_stage(config, stage, inputs, callbacks=stage_callbacks(config, stage, run_id), run_id=run_id)
        tracking.log_stage_result(config, run_id, result)
    except BaseException:
        tracking.end_run(config, run_id, "FAILED")
        raise
    tracking.end_run(config, run_id, "FINISHED")
    publish(config, result, run_id)
    return result.record


def publish(config: PipelineConfig, result: StageResult, run_id: str) -> None:
    """Prefect artifacts: a markdown summary, a link to the MLflow run, and any tables."""
    rec, slug = result.record, result.record.stage.replace("_", "-")
    url = tracking.run_url(config, run_id)
    lines = [
        f"### {rec.stage}" + (f" ({rec.variant})" if rec.variant else ""),
        "",
        f"- output: `{rec.output_path}`",
        f"- fingerprint: `{rec.fingerprint[:16]}`",
        f"- MLflow run: [{run_id}]({url})",
    ]
    if rec.extra.get("resumed_from_step"):
        lines.append(f"- resumed from checkpoint step {rec.extra['resumed_from_step']}")
    if result.reused:
        lines.append("- reused a complete output already on disk")
    if rec.metrics:
        lines += ["", "| metric | value |", "|---|---|"] + [f"| {k} | {v:.4g} |" for k, v in sorted(rec.metrics.items())]
    create_markdown_artifact("\n".join(lines), key=f"{slug}-summary", description=f"{rec.stage} stage")
    create_link_artifact(url, link_text=f"MLflow run of {rec.stage}", key=f"{slug}-mlflow-run")
    for name, rows in result.output.tables.items():
        create_table_artifact(rows, key=f"{slug}-{name.replace('_', '-')}", description=f"{rec.stage}: {name}")
