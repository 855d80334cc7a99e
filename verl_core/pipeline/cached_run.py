"""The MLflow child run of a stage Prefect served from its cache: the pipeline run is complete in MLflow
(a child per stage), and the cached one says so in its name, carries the settings it was computed with and
links the run that computed it, whose artifacts it reuses."""

from __future__ import annotations

import yaml

from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.keys import section_for_key
from verl_core.pipeline.records import StageRecord
from verl_core.pipeline.run_summary import prefect_flow_run_url
from verl_core.pipeline.tracking import (
    FLOW_RUN_TAG,
    FLOW_RUN_URL_TAG,
    NOTE_TAG,
    PARENT_TAG,
    STAGE_TAG,
    client,
    experiment_id,
    flatten,
    log_params,
    prefect_link,
    run_exists,
    run_url,
)


def log_cached_stage(
    config: PipelineConfig, parent_run_id: str | None, record: StageRecord, flow_run_id: str | None = None
) -> str:
    """A FINISHED child run for a stage Prefect served from its cache, so the pipeline run is complete
    in MLflow: tagged ``cached=true``, linking the run that computed it, with its headline metrics."""
    import time

    from mlflow.entities import Metric

    c = client(config)
    origin = record.mlflow_run_id
    origin_url = run_url(config, origin) if origin and run_exists(config, origin) else None
    url = prefect_flow_run_url(flow_run_id)
    name = (record.stage if not record.variant else f"{record.stage}-{record.variant}") + (
        f"-round{record.round}" if record.round else ""
    )
    note = f"Stage `{record.stage}` served from the Prefect cache (key `{(record.cache_key or '')[:16]}`)"
    note += (
        f"; computed by [{origin}]({origin_url}), whose artifacts (model, checkpoints, datasets) it reuses" if origin_url else ""
    )
    note += prefect_link(flow_run_id, url)
    tags = {
        PARENT_TAG: parent_run_id or "",
        STAGE_TAG: record.stage,
        "verl_core.variant": record.variant or "",
        "verl_core.round": str(record.round) if record.round else "",
        "verl_core.cache_key": record.cache_key or "",
        "cached": "true",
        "verl_core.cached_from_run_id": origin or "",
        "verl_core.cached_from_url": origin_url or "",
        "verl_core.data.fingerprint": record.fingerprint,
        "verl_core.output_path": record.output_path,
        FLOW_RUN_TAG: flow_run_id or "",
        FLOW_RUN_URL_TAG: url or "",
        NOTE_TAG: note,
    }
    # "(cached)" in the name: the runs table shows it without choosing a column
    run_id = c.create_run(
        experiment_id(config), run_name=f"{name} (cached)", tags={k: v for k, v in tags.items() if v}
    ).info.run_id
    section = section_for_key(config, record.stage)
    log_params(config, run_id, flatten(section))  # the settings it was computed with (its key says they match)
    c.log_text(run_id, yaml.safe_dump(section, sort_keys=False), "stage_config.yaml")
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, int(record.extra.get("steps", 0))) for k, v in record.metrics.items()]
    for i in range(0, len(metrics), 500):
        c.log_batch(run_id, metrics=metrics[i : i + 500])
    c.set_terminated(run_id, "FINISHED")
    return run_id
