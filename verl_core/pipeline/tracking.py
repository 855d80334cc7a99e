"""MLflow for the pipeline: one parent run per pipeline run, one nested run per stage.

Everything goes through an explicit run id (``MlflowClient``), never the thread's
active run, because Prefect runs tasks in worker threads. No Prefect import here:
callers pass the Prefect ids they want as tags.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.records import StageRecord, StageResult
from verl_core.pipeline.registration import mark_registered, registered_version
from verl_core.pipeline.workdir_lock import owner_tags

log = logging.getLogger("verl_core")
PARENT_TAG = "mlflow.parentRunId"
FLOW_RUN_TAG = "prefect.flow_run_id"
TASK_RUN_TAG = "prefect.task_run_id"
STAGE_TAG = "verl_core.stage"
PIP_REQUIREMENTS = ["torch", "transformers", "accelerate", "safetensors"]


def tracking_uri(config: PipelineConfig) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<workdir>/mlflow.db``."""
    return config.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{config.workdir_path / 'mlflow.db'}"


def configure(config: PipelineConfig) -> str:
    """Point MLflow (process-wide) at the config's store; returns the URI."""
    import mlflow

    uri = tracking_uri(config)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    return uri


def client(config: PipelineConfig):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(config))


def experiment_id(config: PipelineConfig) -> str:
    c = client(config)
    exp = c.get_experiment_by_name(config.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(config.tracking.experiment, artifact_location=artifact_location(config))
    except Exception:  # created concurrently
        return c.get_experiment_by_name(config.tracking.experiment).experiment_id


def artifact_location(config: PipelineConfig) -> str | None:
    """Artifacts beside a SQLite store (never MLflow's default ``./mlruns`` in the working directory);
    a tracking server decides for itself."""
    uri = tracking_uri(config)
    if uri.startswith(("http://", "https://", "databricks")):
        return None
    root = Path(uri[len("sqlite:///") :]).parent if uri.startswith("sqlite:///") else config.workdir_path
    return (root / "mlartifacts").as_uri()


def ui_url(config: PipelineConfig) -> str:
    uri = tracking_uri(config)
    return (config.tracking.ui_url or (uri if uri.startswith("http") else "http://127.0.0.1:5000")).rstrip("/")


def run_url(config: PipelineConfig, run_id: str) -> str:
    run = client(config).get_run(run_id)
    return f"{ui_url(config)}/#/experiments/{run.info.experiment_id}/runs/{run_id}"


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """``{"sft": {"max_steps": 3}}`` → ``{"sft.max_steps": "3"}`` (values cut to MLflow's limit)."""
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: str(data)[:6000]} if prefix else {}


def _find_run(config: PipelineConfig, tag: str, value: str) -> str | None:
    runs = client(config).search_runs([experiment_id(config)], filter_string=f"tags.`{tag}` = '{value}'", max_results=1)
    return runs[0].info.run_id if runs else None


def _open(config: PipelineConfig, reuse_tag: str | None, reuse_value: str | None, name: str, tags: dict[str, str]) -> str:
    """Create a run, or resume the one tagged ``reuse_tag=reuse_value`` (a retried flow or task)."""
    c = client(config)
    tags = {**tags, **owner_tags()}  # who writes the run: verl_core.pipeline.reconcile ends it if that process dies
    run_id = _find_run(config, reuse_tag, reuse_value) if reuse_tag and reuse_value else None
    if run_id is None:
        run_id = c.create_run(experiment_id(config), run_name=name, tags={k: v for k, v in tags.items() if v}).info.run_id
    else:
        c.update_run(run_id, status="RUNNING")
        for k, v in tags.items():
            if v:
                c.set_tag(run_id, k, v)
    return run_id


def start_pipeline_run(config: PipelineConfig, flow_name: str, flow_run_id: str | None = None) -> str:
    """The parent run of one pipeline run: params = the whole config, artifact = config.yaml."""
    run_id = _open(
        config,
        FLOW_RUN_TAG,
        flow_run_id,
        f"{config.name}:{flow_name}",
        {FLOW_RUN_TAG: flow_run_id or "", "verl_core.flow": flow_name},
    )
    log_params(config, run_id, flatten(config.model_dump(mode="json")))
    with tempfile.TemporaryDirectory() as tmp:
        config.to_yaml(Path(tmp) / "config.yaml")
        client(config).log_artifact(run_id, str(Path(tmp) / "config.yaml"))
    return run_id


def start_stage_run(
    config: PipelineConfig,
    parent_run_id: str | None,
    stage: str,
    variant: str | None,
    key: str,
    flow_run_id: str | None = None,
    task_run_id: str | None = None,
    attempt: int | None = None,
) -> str:
    """A nested run for one stage; a retry of the same Prefect task run reuses it (tagged with the attempt)."""
    tags = {
        PARENT_TAG: parent_run_id or "",
        STAGE_TAG: stage,
        "verl_core.variant": variant or "",
        "verl_core.cache_key": key,
        FLOW_RUN_TAG: flow_run_id or "",
        TASK_RUN_TAG: task_run_id or "",
        "prefect.attempt": str(attempt) if attempt else "",
    }
    run_id = _open(config, TASK_RUN_TAG, task_run_id, stage if not variant else f"{stage}-{variant}", tags)
    section = getattr(config, stage).model_dump(mode="json")
    log_params(config, run_id, flatten(section))
    return run_id


def log_params(config: PipelineConfig, run_id: str, params: dict[str, str]) -> None:
    """Log params not already on the run (MLflow params are write-once)."""
    from mlflow.entities import Param

    c = client(config)
    existing = c.get_run(run_id).data.params
    fresh = [Param(k, v) for k, v in params.items() if k not in existing]
    for i in range(0, len(fresh), 100):
        c.log_batch(run_id, params=fresh[i : i + 100])


def log_inputs(config: PipelineConfig, run_id: str, inputs: dict[str, StageRecord | None]) -> None:
    c = client(config)
    for name, rec in inputs.items():
        if rec is not None:
            c.set_tag(run_id, f"input.{name}.fingerprint", rec.fingerprint)
            c.set_tag(run_id, f"input.{name}.path", rec.output_path)
            if rec.mlflow_run_id:
                c.set_tag(run_id, f"input.{name}.mlflow_run_id", rec.mlflow_run_id)


def log_stage_result(config: PipelineConfig, run_id: str, result: StageResult) -> None:
    """Headline metrics, fingerprint, datasets, artifact files and (if any) the model to register."""
    import time

    from mlflow.entities import Metric

    c, rec, out = client(config), result.record, result.output
    now, step = int(time.time() * 1000), int(rec.extra.get("steps", 0))
    metrics = [Metric(f"final/{k}", v, now, step) for k, v in rec.metrics.items()]
    for i in range(0, len(metrics), 500):
        c.log_batch(run_id, metrics=metrics[i : i + 500])
    for k, v in {
        "fingerprint": rec.fingerprint,
        "output_path": rec.output_path,
        "reused_output": str(result.reused).lower(),
        "resumed_from_step": str(rec.extra.get("resumed_from_step", 0)),
    }.items():
        c.set_tag(run_id, f"verl_core.{k}", v)
    for use in out.datasets:
        log_dataset(config, run_id, use.name, use.rows, use.context, use.source)
    for path in out.artifacts:
        if Path(path).is_file():
            c.log_artifact(run_id, str(path))
    if out.model_to_log and config.tracking.log_model:
        # once per stage output: a rerun after a kill during registration registers only what is missing
        name = config.tracking.registered_model_name
        version = registered_version(c, name, rec.cache_key)
        if version is None:
            version = log_model(config, run_id, out.model_to_log, name)
        mark_registered(c, name, version, run_id, rec.cache_key)


def log_dataset(config: PipelineConfig, run_id: str, name: str, rows: list[dict], context: str, source: str) -> None:
    """Rows as an MLflow dataset input of the run (``mlflow.data.from_pandas``)."""
    import pandas as pd
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.entities import DatasetInput, InputTag

    try:
        df = pd.DataFrame(rows).map(lambda v: v if isinstance(v, (str, int, float, bool)) or v is None else str(v))
        import mlflow.data

        ds = mlflow.data.from_pandas(df, source=CodeDatasetSource({"source": source}), name=name)
        client(config).log_inputs(
            run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])]
        )
    except Exception as err:  # tracking must never break training
        log.warning("could not log dataset %s to MLflow: %s", name, err)


def log_model(config: PipelineConfig, run_id: str, model_path: str, registered_name: str | None) -> str | None:
    """Log the policy folder with ``mlflow.transformers`` and register it; returns the model version."""
    import mlflow

    from verl_core.models import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(model_path, trainable=False), load_tokenizer(model_path)
    configure(config)
    with mlflow.start_run(run_id=run_id):  # the active-run stack is thread-local: safe in a task thread
        info = mlflow.transformers.log_model(
            {"model": model, "tokenizer": tok},
            name="policy",
            task="text-generation",
            pip_requirements=PIP_REQUIREMENTS,
            registered_model_name=registered_name,
        )
    return str(info.registered_model_version) if getattr(info, "registered_model_version", None) else None


def end_run(config: PipelineConfig, run_id: str, status: str = "FINISHED", tags: dict[str, str] | None = None) -> None:
    c = client(config)
    for k, v in (tags or {}).items():
        c.set_tag(run_id, k, v)
    c.set_terminated(run_id, status=status)
