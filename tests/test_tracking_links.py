"""Every MLflow link the project prints or publishes opens MLflow 3's classic (model training) view,
where runs, metrics and models are (its default is the GenAI view: "Traces 0, No data")."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.fast


def test_run_and_experiment_links_ask_for_the_classic_view(tmp_path, monkeypatch):
    from verl_core.pipeline import tracking
    from verl_core.pipeline.config import load_pipeline_config

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    cfg = load_pipeline_config(None, [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    tracking.configure(cfg)
    exp = tracking.experiment_id(cfg)
    run = tracking.client(cfg).create_run(exp).info.run_id
    assert tracking.run_url(cfg, run) == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{run}?workflowType=machine_learning"
    assert tracking.experiment_url(cfg) == f"http://127.0.0.1:5000/#/experiments/{exp}?workflowType=machine_learning"
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"  # MLflow's own GenAI-view lines are off


def test_the_cli_prints_the_classic_experiment_link(tmp_path):
    from flows.cli import ui_locations
    from verl_core.pipeline import tracking
    from verl_core.pipeline.config import load_pipeline_config

    cfg = load_pipeline_config(None, [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    tracking.configure(cfg)
    tracking.experiment_id(cfg)
    mlflow_line = next(line for line in ui_locations(cfg) if line.startswith("MLflow UI:"))
    assert mlflow_line.endswith("?workflowType=machine_learning)"), mlflow_line


def test_a_failed_runs_description_is_a_short_paragraph_and_the_tag_holds_the_whole_message():
    from verl_core.data.errors import DataError
    from verl_core.pipeline.tracking import failure_summary

    long = DataError("sft.data: /data/sft.jsonl row 3 (line 4): missing field 'completion' " + "(context) " * 60)
    text = failure_summary(long)
    assert text.startswith("**Failed** with `DataError`: sft.data: /data/sft.jsonl row 3 (line 4): missing field")
    assert len(text) < 320 and "```" not in text and text.endswith("(whole message: tag `verl_core.error`)")
    assert failure_summary(DataError("short")) == "**Failed** with `DataError`: short"
