"""A rank of a torchrun stage killed mid-training (SIGKILL, from outside, as an out-of-memory
kill would): the Prefect task fails with that rank's error, the stage's MLflow run is FAILED,
nothing is half-written; the next run resumes from the last checkpoint and ends bitwise equal
to an uninterrupted 2-process run."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from verl_core.pipeline import PipelineConfig, load_pipeline_config
from verl_core.pipeline.launch import LAUNCH_DIR, DistributedStageError, run_stage_launched
from verl_core.pipeline.plan import plan_stage
from verl_core.pipeline.records import RECORD_FILE
from verl_core.pipeline.registry import base_model_record

pytestmark = pytest.mark.slow
SFT = [
    "sft.max_steps=40",
    "sft.batch_size=8",
    "sft.learning_rate=1e-3",
    "sft.save_steps=4",
    "sft.logging_steps=4",
    "sft.data.limit=128",
    "sft.mixed_precision=no",
    "sft.progress=false",
    "preference_data.num_prompts=8",
    "launcher.kind=torchrun",
    "launcher.num_processes=2",
    "orchestration.retries=0",
]


def config(tmp: Path, base: Path) -> PipelineConfig:
    where = [f"workdir={tmp / 'work'}", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", f"base_model={base}"]
    return load_pipeline_config(None, where + SFT)


def kill_rank_after_first_checkpoint(stages: Path, rank: int, killed: list[int]) -> threading.Thread:
    """Watch for the stage's first checkpoint, then SIGKILL ``rank`` (its pid file is in .launch/)."""

    def watch():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for pid_file in stages.glob(f"sft-*/{LAUNCH_DIR}/rank-{rank}.pid"):
                if list(pid_file.parent.parent.glob("checkpoints/step-*")):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                    killed.append(rank)
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def task_log_lines(flow_run_id: str, stage: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # logs reach the API in batches
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
        task = next(r for r in runs if r.name.startswith(stage))
        logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task.id])))
    return [log.message for log in logs]


def test_killed_rank_fails_the_task_and_the_rerun_resumes_bitwise_equal(prefect_harness, tiny_path, tmp_path):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows import stage_flow

    cfg = config(tmp_path, tiny_path)
    stages = cfg.workdir_path / "stages"
    killed: list[int] = []
    watcher = kill_rank_after_first_checkpoint(stages, 1, killed)
    state = stage_flow("sft", cfg, return_state=True)
    watcher.join(timeout=5)
    assert killed == [1] and state.is_failed()

    # the task failed with rank 1's error
    with pytest.raises(DistributedStageError, match="rank 1 was killed by SIGKILL"):
        state.result()  # the flow re-raises its task's exception
    with get_client(sync_client=True) as client:
        flow_run_id = state.state_details.flow_run_id
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(str(flow_run_id))])))
    sft_task = next(r for r in runs if r.name.startswith("sft"))
    assert sft_task.state.is_failed() and "rank 1 was killed by SIGKILL" in sft_task.state.message

    # the MLflow run of the stage is FAILED
    c = MlflowClient(tracking_uri=cfg.tracking.uri)
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    sft_runs = c.search_runs([exp.experiment_id], filter_string="tags.`verl_core.stage` = 'sft'")
    assert [r.info.status for r in sft_runs] == ["FAILED"]

    # nothing half-written: no record, no model folder, no temporary folder; complete checkpoints only
    (folder,) = stages.glob("sft-*")
    assert not (folder / RECORD_FILE).exists() and not (folder / "model").exists()
    assert not list(folder.glob(".model-*")) and not list(folder.glob("checkpoints/.tmp-*"))
    checkpoints = sorted(folder.glob("checkpoints/step-*"))
    assert checkpoints

    # the rerun (a new flow run) resumes from the last checkpoint
    resumed = stage_flow("sft", cfg)
    record = resumed.records["sft"]
    assert resumed.states["sft"] == "Completed"
    assert record.extra["resumed_from_step"] == int(checkpoints[-1].name.split("-")[1]) > 0

    # rank 0 reported to the stage's nested MLflow run; the job's lines are in the task's Prefect log
    finished = [
        r
        for r in c.search_runs([exp.experiment_id], filter_string="tags.`verl_core.stage` = 'sft'")
        if r.info.status == "FINISHED"
    ]
    assert len(finished) == 1 and c.get_metric_history(finished[0].info.run_id, "loss")
    assert finished[0].inputs.dataset_inputs  # the training rows, logged by rank 0
    assert any("torch.distributed.run --nproc_per_node 2" in line for line in task_log_lines(resumed.flow_run_id, "sft"))

    # ... and ends bitwise equal to an uninterrupted 2-process run elsewhere
    other = cfg.updated(workdir=str(tmp_path / "uninterrupted"))
    reference = run_stage_launched(plan_stage(other, "sft", {"base": base_model_record(other)})).record
    assert reference.extra["resumed_from_step"] == 0
    assert reference.fingerprint == record.fingerprint
    assert reference.metrics == record.metrics
