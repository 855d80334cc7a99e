"""A failing stage in MLflow: FAILED, with the exception's type and message (tag and description)."""

from __future__ import annotations

import json

import pytest

from verl_core.data import DataError
from verl_core.pipeline import PipelineConfig, StageRecord, load_pipeline_config, tracking


def test_a_data_error_leaves_a_failed_run_that_says_what_went_wrong(tmp_path):
    from tasks.stage_task import execute

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "solution": "#### 2"}) + "\n")
    config: PipelineConfig = load_pipeline_config(
        None,
        [
            f"workdir={tmp_path / 'runs'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"sft.data.path={data}",
            "sft.data.columns={prompt: question, completion: answer}",  # the file has 'solution', not 'answer'
        ],
    )
    tracking.configure(config)
    parent = tracking.start_pipeline_run(config, "rlhf-pipeline")
    base = StageRecord(stage="base", output_path=str(tmp_path), fingerprint="b", given=True)
    with pytest.raises(DataError, match="no column 'answer'"):
        execute("sft", config, {"base": base}, parent)
    (run,) = tracking.client(config).search_runs(
        [tracking.experiment_id(config)], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'"
    )
    assert run.info.status == "FAILED" and run.data.tags["verl_core.algorithm"] == "ppo"
    assert run.data.tags["verl_core.error"].startswith("DataError: sft.data.columns: row 0 has no column 'answer'")
    assert run.data.tags["mlflow.note.content"].startswith("**Failed** with `DataError`")
