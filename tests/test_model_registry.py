"""The registered policy: versions linked to their training run, the champion alias, loading it back."""

from __future__ import annotations

import json

import pytest

from verl_core.pipeline import PipelineConfig, StageRecord, tracking
from verl_core.pipeline.model_registry import register_policy
from verl_core.pipeline.records import StageOutput, StageResult


@pytest.fixture()
def config(tmp_path) -> PipelineConfig:
    return PipelineConfig(workdir=str(tmp_path / "runs"), tracking={"uri": f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"})


def trained_policy(config: PipelineConfig, tmp_path, name: str) -> StageRecord:
    """A policy stage's record whose MLflow run logged its model folder, as the stage task does."""
    folder = tmp_path / name / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"name": name}))
    run_id = tracking.start_stage_run(config, None, "policy_optimisation", "dpo", key=name)
    record = StageRecord(
        stage="policy_optimisation", variant="dpo", output_path=str(folder), fingerprint=name, mlflow_run_id=run_id
    )
    tracking.log_stage_result(config, run_id, StageResult(record, StageOutput(folder)))
    tracking.end_run(config, run_id)
    return record


def evaluation_run(config: PipelineConfig, key: str) -> str:
    """A finished evaluation stage's MLflow run, which registration tags with the version it made."""
    run_id = tracking.start_stage_run(config, None, "evaluation", None, key=key)
    tracking.end_run(config, run_id)
    return run_id


def champion(config: PipelineConfig):
    return tracking.client(config).get_model_version_by_alias(config.tracking.registered_model_name, "champion")


@pytest.mark.slow
def test_champion_moves_only_to_a_better_policy_and_loads_from_the_registry(config, tmp_path):
    import mlflow

    tracking.configure(config)
    first = trained_policy(config, tmp_path, "first")
    assert register_policy(config, first, {"accuracy/final": 0.5, "accuracy/sft": 0.4}, evaluation_run(config, "eval-1")) == (
        "1",
        True,
    )
    version = tracking.client(config).get_model_version(config.tracking.registered_model_name, "1")
    assert version.run_id == first.mlflow_run_id  # linked to the run that trained it, not the evaluation
    assert version.tags["algorithm"] == "dpo" and version.tags["heldout_score"] == "0.5000"
    evaluation = tracking.client(config).get_run(version.tags["evaluation_run_id"])
    assert evaluation.data.tags["verl_core.registered_version"] == "1" and "0.400" in version.description

    worse = trained_policy(config, tmp_path, "worse")
    assert register_policy(config, worse, {"accuracy/final": 0.3}, evaluation_run(config, "eval-2")) == ("2", False)
    tie = trained_policy(config, tmp_path, "tie")
    assert register_policy(config, tie, {"accuracy/final": 0.5}, evaluation_run(config, "eval-3")) == ("3", False)
    assert str(champion(config).version) == "1"
    better = trained_policy(config, tmp_path, "better")
    assert register_policy(config, better, {"accuracy/final": 0.75}, evaluation_run(config, "eval-4")) == ("4", True)
    assert str(champion(config).version) == "4"
    # another metric is not comparable: the champion stays
    other = trained_policy(config, tmp_path, "other")
    assert register_policy(config, other, {"reward_score/final": 9.0}, evaluation_run(config, "eval-5")) == ("5", False)

    local = mlflow.artifacts.download_artifacts(
        f"models:/{config.tracking.registered_model_name}@champion", dst_path=str(tmp_path / "dl")
    )
    assert json.loads(open(f"{local}/config.json").read()) == {"name": "better"}


def test_registration_off(config, tmp_path):
    config = config.updated(tracking={**config.tracking.model_dump(), "registered_model_name": None})
    assert register_policy(config, trained_policy(config, tmp_path, "x"), {"accuracy/final": 1.0}, "e") is None
