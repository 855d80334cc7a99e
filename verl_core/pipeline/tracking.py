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
from urllib.parse import urlparse

import yaml

from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.records import StageRecord, StageResult
from verl_core.pipeline.run_summary import headline_metrics, key_params, pipeline_run_name, prefect_flow_run_url
from verl_core.pipeline.workdir_lock import owner_tags
from verl_core.train.traces import log_sample_traces

log = logging.getLogger("verl_core")
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
PARENT_TAG = "mlflow.parentRunId"
FLOW_RUN_TAG = "prefect.flow_run_id"
TASK_RUN_TAG = "prefect.task_run_id"
FLOW_RUN_URL_TAG = "prefect.flow_run_url"
STAGE_TAG = "verl_core.stage"
NOTE_TAG = "mlflow.note.content"  # the run's description in the MLflow UI (markdown)
ERROR_TAG = "verl_core.error"
# MLflow 3's UI reads the experiment's kind from this tag; without it an empty experiment opens in
# GenAI mode (Traces, Judges). The value the UI knows for classic training is "custom_model_development".
TRAINING_STAGES = ("sft", "reward_model", "policy_optimisation")  # their trainer logs its settings as params
MODEL_ARTIFACT = "model"  # where a stage's model folder goes among its run's artifacts
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


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
    # MLflow's own "View run ... at" lines, twice per stage, link its GenAI view; the project prints classic-view links
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    return uri


def client(config: PipelineConfig):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(config))


def experiment_id(config: PipelineConfig) -> str:
    """The configured experiment (created when missing), marked as a model-training experiment."""
    c = client(config)
    exp = c.get_experiment_by_name(config.tracking.experiment)
    if exp is None:
        try:
            c.create_experiment(
                config.tracking.experiment,
                artifact_location=artifact_location(config),
                tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING},
            )
        except Exception:  # created concurrently
            pass
        exp = c.get_experiment_by_name(config.tracking.experiment)
    if exp.tags.get(EXPERIMENT_KIND_TAG) is None:
        c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return exp.experiment_id


def artifact_location(config: PipelineConfig) -> str | None:
    """``<store folder>/mlartifacts``: beside a SQLite store (never MLflow's default ``./mlruns`` in
    the working directory), and the same folder when the store is served by a server on this host
    (``verl-core servers`` serves ``<workdir>/mlflow.db`` with ``--artifacts-destination
    <workdir>/mlartifacts``), so runs logged with and without the server share one artifact root.
    A remote server decides for itself."""
    uri = tracking_uri(config)
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()
    if urlparse(uri).hostname in LOCAL_HOSTS:
        return (config.workdir_path / "mlartifacts").as_uri()
    return None


def ui_url(config: PipelineConfig) -> str:
    uri = tracking_uri(config)
    return (config.tracking.ui_url or (uri if uri.startswith("http") else "http://127.0.0.1:5000")).rstrip("/")


# MLflow 3 opens an experiment in its GenAI view (traces, evaluations) unless the link asks for the classic
# one, where runs, metrics, models and the registry are; the experiment's kind tag alone does not decide it.
CLASSIC_VIEW = "workflowType=machine_learning"


def run_url(config: PipelineConfig, run_id: str) -> str:
    run = client(config).get_run(run_id)
    return f"{ui_url(config)}/#/experiments/{run.info.experiment_id}/runs/{run_id}?{CLASSIC_VIEW}"


def experiment_url(config: PipelineConfig) -> str:
    """The experiment's runs table in the classic view."""
    exp = client(config).get_experiment_by_name(config.tracking.experiment)
    where = f"/#/experiments/{exp.experiment_id}" if exp is not None else "/#/experiments"
    return f"{ui_url(config)}{where}?{CLASSIC_VIEW}"


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
        if ERROR_TAG in c.get_run(run_id).data.tags:  # the previous attempt's error; this attempt may succeed
            c.delete_tag(run_id, ERROR_TAG)
        for k, v in tags.items():
            if v:
                c.set_tag(run_id, k, v)
    return run_id


def prefect_link(flow_run_id: str | None, url: str | None) -> str:
    return f"; Prefect flow run: [{flow_run_id}]({url})" if url else ""


def start_pipeline_run(config: PipelineConfig, flow_name: str, flow_run_id: str | None = None) -> str:
    """The parent run of one pipeline run: a short set of key params (run_summary.key_params), the
    whole resolved config as the ``config.yaml`` artifact, a description linking the Prefect flow run."""
    url = prefect_flow_run_url(flow_run_id)
    run_id = _open(
        config,
        FLOW_RUN_TAG,
        flow_run_id,
        pipeline_run_name(config, flow_name),
        {
            FLOW_RUN_TAG: flow_run_id or "",
            FLOW_RUN_URL_TAG: url or "",
            "verl_core.flow": flow_name,
            "verl_core.algorithm": config.policy_optimisation.algorithm,
            NOTE_TAG: f"Pipeline `{config.name}`, flow `{flow_name}`" + prefect_link(flow_run_id, url),
        },
    )
    log_params(config, run_id, key_params(config))
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
    round: int | None = None,
) -> str:
    """A nested run for one stage (one round of it); a retry of the same Prefect task run reuses it (tagged with the attempt).

    Params: the settings that make the stage's cache key (the chosen variant's only), as the
    ``stage_config.yaml`` artifact; training stages add their trainer's settings as params
    through :class:`~verl_core.train.callbacks.MLflowCallback`, the others get theirs as params here."""
    from verl_core.pipeline.keys import section_for_key

    url = prefect_flow_run_url(flow_run_id)
    tags = {
        PARENT_TAG: parent_run_id or "",
        STAGE_TAG: stage,
        "verl_core.variant": variant or "",
        "verl_core.algorithm": config.policy_optimisation.algorithm,  # the evaluation run says what it evaluates
        "verl_core.cache_key": key,
        FLOW_RUN_TAG: flow_run_id or "",
        FLOW_RUN_URL_TAG: url or "",
        TASK_RUN_TAG: task_run_id or "",
        "prefect.attempt": str(attempt) if attempt else "",
        "verl_core.round": str(round) if round else "",
        NOTE_TAG: f"Stage `{stage}`"
        + (f" ({variant})" if variant else "")
        + (f" round {round}" if round else "")
        + prefect_link(flow_run_id, url),
    }
    name = (stage if not variant else f"{stage}-{variant}") + (f"-round{round}" if round else "")
    run_id = _open(config, TASK_RUN_TAG, task_run_id, name, tags)
    section = section_for_key(config, stage)
    if stage not in TRAINING_STAGES:
        log_params(config, run_id, flatten(section))
    client(config).log_text(run_id, yaml.safe_dump(section, sort_keys=False), "stage_config.yaml")
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
    """Summary metrics (those without a curve, once each), fingerprint, datasets, artifact files, sample
    answers as traces and the stage's model folder (``tracking.log_stage_models``)."""
    import time

    from mlflow.entities import Metric

    c, rec, out = client(config), result.record, result.output
    now, step = int(time.time() * 1000), int(rec.extra.get("steps", 0))
    curves = set(c.get_run(run_id).data.metrics)  # already logged step by step by MLflowCallback
    metrics = [Metric(k, v, now, step) for k, v in rec.metrics.items() if k not in curves]
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
    for kind, samples in out.traces.items():
        log_sample_traces(c, run_id, kind, step, samples)
    if config.tracking.log_stage_models and is_model_folder(rec.output_path):
        c.log_artifacts(run_id, rec.output_path, MODEL_ARTIFACT)


def is_model_folder(path: str) -> bool:
    return (Path(path) / "config.json").is_file()


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


def failure_summary(error: BaseException, limit: int = 240) -> str:
    """A short paragraph for a run's description (a long one-line code block squeezed MLflow's run panel); the
    whole message is in the ``verl_core.error`` tag."""
    message = " ".join(str(error).split())
    short = message if len(message) <= limit else message[: limit - 1].rsplit(" ", 1)[0] + " …"
    return f"**Failed** with `{type(error).__name__}`: {short}" + (
        f" (whole message: tag `{ERROR_TAG}`)" if short != message else ""
    )


def end_run(
    config: PipelineConfig,
    run_id: str,
    status: str = "FINISHED",
    tags: dict[str, str] | None = None,
    error: BaseException | None = None,
) -> None:
    """Terminate the run; a failed one carries the exception's type and message as the
    ``verl_core.error`` tag and at the top of its description."""
    c = client(config)
    for k, v in (tags or {}).items():
        c.set_tag(run_id, k, v)
    if error is not None:
        text = f"{type(error).__name__}: {error}"
        c.set_tag(run_id, ERROR_TAG, text[:5000])
        note = c.get_run(run_id).data.tags.get(NOTE_TAG, "")
        c.set_tag(run_id, NOTE_TAG, f"{failure_summary(error)}\n\n{note}")
    c.set_terminated(run_id, status=status)


def finish_pipeline_run(
    config: PipelineConfig,
    run_id: str,
    records: dict[str, StageRecord | None],
    states: dict[str, str],
    stage_runs: dict[str, str],
    error: BaseException | None = None,
) -> None:
    """The parent run's headline metrics (copied from its stages), stage states and run ids, then its end."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in headline_metrics(records).items()]
    if metrics:
        client(config).log_batch(run_id, metrics=metrics)
    tags = {f"stage.{k}.state": v for k, v in states.items()}
    tags.update({f"stage.{k}.mlflow_run_id": v for k, v in stage_runs.items()})
    end_run(config, run_id, "FAILED" if error is not None else "FINISHED", tags, error)


def run_exists(config: PipelineConfig, run_id: str) -> bool:
    try:
        client(config).get_run(run_id)
        return True
    except Exception:  # another store, or deleted
        return False
