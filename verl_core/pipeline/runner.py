"""``run_planned``: the one function that computes a resolved stage run into its deterministic folder
(``run_stage``: plan, then run).

Prefect tasks (``tasks/``), the distributed worker and tests call it the same way; no Prefect here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from verl_core.data.fingerprint import fingerprint_path
from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.plan import StagePlan, plan_stage
from verl_core.pipeline.records import (
    HISTORY_FILE,
    PREVIOUS_ROUND,
    RECORD_FILE,
    StageContext,
    StageOutput,
    StageRecord,
    StageResult,
)
from verl_core.pipeline.registry import stage_for
from verl_core.pipeline.workdir_lock import stage_lock
from verl_core.train.callbacks import Callback

TABLES_FILE = "tables.json"


def run_stage(
    config: PipelineConfig,
    name: str,
    inputs: dict[str, StageRecord | None],
    callbacks: Sequence[Callback] = (),
    run_id: str | None = None,
    round: int | None = None,
) -> StageResult:
    """Run step ``name`` (round ``round`` of it, for a stage that runs in rounds) into its
    deterministic folder and return its record: :func:`~verl_core.pipeline.plan.plan_stage`, then
    :func:`run_planned` (the Python API's entry point; the Prefect task plans once and calls
    :func:`run_planned` itself, through its launcher)."""
    return run_planned(plan_stage(config, name, inputs, round), callbacks, run_id)


def run_planned(
    plan: StagePlan, callbacks: Sequence[Callback] = (), run_id: str | None = None, write_record: bool = True
) -> StageResult:
    """Compute a resolved stage run into ``plan.out_dir``.

    A folder that already holds a complete record with the same key is reused as is; the record
    is written last (atomically), so a folder without one is an unfinished run to resume.
    ``write_record=False``: a distributed worker's other ranks, which train but leave the
    fingerprint and the record to rank 0.
    """
    o = plan.config.orchestration
    # one writer per stage folder; the reuse check below runs under the lock, so a run that waited
    # for another one to finish reuses its output instead of training into the same folder again
    with stage_lock(plan.config.workdir_path, plan.out_dir, wait=o.busy_workdir == "wait", timeout=o.busy_wait_seconds):
        return _run_locked(plan, callbacks, run_id, write_record)


def _run_locked(plan: StagePlan, callbacks, run_id, write_record: bool) -> StageResult:
    out_dir, key, name = plan.out_dir, plan.key, plan.name
    done = out_dir / RECORD_FILE
    if done.is_file():
        record = StageRecord.model_validate_json(done.read_text())
        if record.cache_key == key and Path(record.output_path).exists():
            hist = out_dir / HISTORY_FILE
            history = json.loads(hist.read_text()) if hist.is_file() else {}
            # the model and artifacts are logged again by the new run (and registered if a killed attempt did not)
            reused = StageOutput(Path(record.output_path), record.metrics, history, model_to_log=record.extra.get("model_to_log"))
            reused.artifacts = [Path(p) for p in record.extra.get("artifacts", []) if Path(p).is_file()]
            tables = out_dir / TABLES_FILE
            reused.tables = json.loads(tables.read_text()) if tables.is_file() else {}
            return StageResult(record, reused, reused=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = {k: v for k, v in plan.inputs.items() if v is not None}
    ctx = StageContext(plan.config, name, plan.variant, inputs, out_dir, list(callbacks), plan.round)
    output = plan.stage.fn(ctx)
    if not write_record:
        return StageResult(StageRecord(stage=name, output_path=str(output.output_path), fingerprint=""), output)
    metrics = {k: float(v) for k, v in output.metrics.items() if isinstance(v, (int, float))}
    record = StageRecord(
        stage=name,
        variant=ctx.variant,
        output_path=str(output.output_path),
        fingerprint=fingerprint_path(output.output_path),
        metrics=metrics,
        mlflow_run_id=run_id,
        cache_key=key,
        round=plan.round,
        extra=output.extra,
    )
    if output.model_to_log:
        record.extra["model_to_log"] = str(output.model_to_log)
    if output.artifacts:
        record.extra["artifacts"] = [str(p) for p in output.artifacts]
    if output.tables:  # kept, so that a rerun reusing this folder publishes them again
        (out_dir / TABLES_FILE).write_text(json.dumps(output.tables, default=str))
    if output.history:
        (out_dir / HISTORY_FILE).write_text(json.dumps(output.history))
        record.extra["history"] = str(out_dir / HISTORY_FILE)
    tmp = out_dir / f".tmp-{RECORD_FILE}"
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(done)
    return StageResult(record, output)


def run_all_rounds(
    config: PipelineConfig,
    name: str,
    inputs: dict[str, StageRecord | None],
    callbacks: Sequence[Callback] = (),
) -> StageResult:
    """Every round of a step (one plain :func:`run_stage` when it has no rounds); the last round's result."""
    stage = stage_for(config, name)
    if stage.rounds is None:
        return run_stage(config, name, inputs, callbacks)
    result = None
    for k in range(1, stage.rounds(config) + 1):
        result = run_stage(config, name, {**inputs, PREVIOUS_ROUND: result.record if result else None}, callbacks, round=k)
    return result
