"""While a stage trains, its progress and metric lines reach the Prefect run's log (what the UI shows),
named after the trainer, at a bounded rate; they are logged, not printed twice."""

from __future__ import annotations

import logging

import pytest


@pytest.mark.slow
def test_training_progress_lines_reach_the_flow_runs_log(prefect_harness, tmp_path, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from flows import stage_flow
    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.train import progress

    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)  # a line per step: the test's run takes seconds
    cfg = load_pipeline_config(
        None,
        [
            f"workdir={tmp_path}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "sft.max_steps=40",
            "sft.batch_size=8",
            "sft.mixed_precision=no",
            "sft.data.limit=64",
        ],
    )
    result = stage_flow("sft", cfg)
    for handler in logging.getLogger("verl_core").handlers:  # Prefect's, attached to the project's logger
        if isinstance(handler, APILogHandler):
            handler.flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[result.flow_run_id])))
    lines = [log.message for log in logs if log.message.startswith("SFTTrainer: ")]
    assert lines and lines[-1].startswith("SFTTrainer: 40/40 steps (100%)") and "loss=" in lines[-1], [m.message for m in logs]
    assert len(lines) <= 41  # one a step at most here; the interval's doubling bounds a long run (test_progress)


@pytest.mark.slow
def test_a_user_error_is_one_readable_line_in_the_flow_runs_log_without_a_traceback(prefect_harness, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from flows import rlhf_pipeline
    from verl_core.pipeline.config import load_pipeline_config

    cfg = load_pipeline_config(
        None,
        [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "evaluation.data.path=/nonexistent/e.jsonl"],
    )
    state = rlhf_pipeline(cfg, return_state=True)
    assert state.is_failed()
    for handler in logging.getLogger("prefect.flow_runs").handlers:
        if isinstance(handler, APILogHandler):
            handler.flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    text = "\n".join(log.message for log in logs)
    assert "data path does not exist: /nonexistent/e.jsonl" in text, text
    assert "Traceback" not in text, text


@pytest.mark.slow
def test_a_torchrun_stages_progress_lines_reach_the_flow_runs_log(prefect_harness, tiny_path, tmp_path, monkeypatch):
    """A launched stage's ranks print their progress; the launcher streams each line into the task's logger,
    so the Prefect run's log shows the training as it goes, named after the trainer."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from flows import stage_flow
    from verl_core.pipeline.config import load_pipeline_config

    monkeypatch.setenv("VERL_CORE_PROGRESS_INTERVAL", "0")  # the ranks' line interval: a line per step here
    cfg = load_pipeline_config(
        None,
        [
            f"workdir={tmp_path}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"base_model={tiny_path}",
            "sft.max_steps=6",
            "sft.batch_size=8",
            "sft.mixed_precision=no",
            "sft.data.limit=64",
            "launcher.kind=torchrun",
            "launcher.num_processes=2",
        ],
    )
    result = stage_flow("sft", cfg)
    for logger in ("verl_core", "prefect.task_runs", "prefect.flow_runs"):
        for handler in logging.getLogger(logger).handlers:
            if isinstance(handler, APILogHandler):
                handler.flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[result.flow_run_id])))
    messages = [log.message for log in logs]
    assert any(m.startswith("sft: torchrun with 2 processes") for m in messages), messages
    progress = [m for m in messages if m.startswith("SFTTrainer: ")]
    assert progress and progress[-1].startswith("SFTTrainer: 6/6 steps (100%)"), messages
    assert len(progress) <= 7  # rank 0's lines only, once each


@pytest.mark.fast
def test_a_process_whose_logging_prefect_set_up_first_still_sends_the_projects_lines_to_the_run_log():
    """A worker starts a deployed run with ``python -m prefect.engine``: Prefect configures logging before the
    project's ``PREFECT_LOGGING_EXTRA_LOGGERS`` default exists, and ``verl_core`` has no handler. The flow's
    first step attaches Prefect's API handler (and its console) then, once."""
    from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

    from tasks.prefect_settings import project_logging

    project = logging.getLogger("verl_core")
    saved, propagate = list(project.handlers), project.propagate
    project.handlers.clear()
    try:
        project_logging()
        project_logging()
        kinds = [type(h) for h in project.handlers]
        assert kinds == [APILogHandler, PrefectConsoleHandler] and not project.propagate
    finally:
        project.handlers[:] = saved
        project.propagate = propagate
