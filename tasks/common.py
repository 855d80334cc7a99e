"""What every stage task does around ``verl_core.stages.run_stage``: the cache key, the
MLflow nested run, the Prefect artifacts, and per-run options (storage, retries)."""
from __future__ import annotations

from typing import Any

from prefect import Task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import CacheKeyFnPolicy

from verl_core import stages, tracking
from verl_core.callbacks import MLflowCallback
from verl_core.pipeline_config import PipelineConfig
from verl_core.stages import StageRecord, StageResult

Inputs = dict[str, StageRecord | None]


def cache_policy(stage: str) -> CacheKeyFnPolicy:
    """Key = stage + code version + resolved stage config + input fingerprints (see ``stages.stage_key``)."""

    def key(_ctx, parameters: dict[str, Any]) -> str:
        return f"{stage}-{stages.stage_key(parameters['config'], stage, parameters['inputs'])}"

    return CacheKeyFnPolicy(cache_key_fn=key)


def configured(task: Task, config: PipelineConfig) -> Task:
    """The task with this run's result storage (a local Path), retries and cache refresh."""
    o = config.orchestration
    storage = config.result_storage_path
    storage.mkdir(parents=True, exist_ok=True)
    return task.with_options(result_storage=storage, retries=o.retries, retry_delay_seconds=o.retry_delay_seconds,
                             refresh_cache=o.refresh_cache or None)


def execute(stage: str, config: PipelineConfig, inputs: Inputs, parent_run_id: str | None) -> StageRecord:
    """Run one stage inside a nested MLflow run; FAILED on any exception, then re-raise."""
    from prefect.runtime import flow_run, task_run

    tracking.configure(config)
    key = stages.stage_key(config, stage, inputs)
    run_id = tracking.start_stage_run(config, parent_run_id, stage, stages.variant_of(config, stage), key,
                                      flow_run_id=flow_run.id, task_run_id=task_run.id, attempt=task_run.run_count)
    try:
        tracking.log_inputs(config, run_id, inputs)
        result = stages.run_stage(config, stage, inputs, callbacks=[MLflowCallback(run_id)], run_id=run_id)
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
    lines = [f"### {rec.stage}" + (f" ({rec.variant})" if rec.variant else ""), "",
             f"- output: `{rec.output_path}`", f"- fingerprint: `{rec.fingerprint[:16]}`",
             f"- MLflow run: [{run_id}]({url})"]
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
