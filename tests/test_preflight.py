"""Everything a run needs is checked before its first step: data files of every enabled stage (fields
of every row, named by key, file, row and line), model paths, output folders; in seconds, not after
the stages before it have trained."""

from __future__ import annotations

import json
import time

import pytest

from flows.cli import main

pytestmark = pytest.mark.fast


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path, capsys, *sets):
    start = time.monotonic()
    code = main(["run", "--set", f"workdir={tmp_path / 'w'}", *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert not (tmp_path / "w" / "stages").exists(), "a stage started"
    assert "Traceback" not in err
    return code, err, time.monotonic() - start


def test_a_missing_evaluation_file_fails_before_any_stage_trains(tmp_path, capsys):
    code, err, took = _run(tmp_path, capsys, "evaluation.data.path=/nonexistent/eval.jsonl")
    assert code == 1 and "DataError: data path does not exist: /nonexistent/eval.jsonl" in err, err
    assert "hf://" not in err  # no hub hint for an absolute path
    assert took < 60


def test_a_row_without_a_field_names_the_key_file_row_and_line(tmp_path, capsys):
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 3 + [{"prompt": "2+2="}])
    code, err, _ = _run(tmp_path, capsys, f"sft.data.path={sft}")
    assert code == 1 and f"sft.data: {sft} row 3 (line 4): missing field 'completion'" in err, err


def test_prompts_without_ground_truth_are_named_when_a_rule_needs_one(tmp_path, capsys):
    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}])
    sets = ["policy_optimisation.algorithm=grpo", f"policy_optimisation.prompts.path={prompts}"]
    code, err, _ = _run(tmp_path, capsys, *sets)
    assert code == 1 and f"policy_optimisation.prompts: {prompts} row 0 (line 1): missing field 'ground_truth'" in err, err
    # a rule that scores without a ground truth does not ask for one
    from verl_core.pipeline.data_checks import rule_needs_ground_truth

    assert rule_needs_ground_truth("exact_match") and rule_needs_ground_truth("gsm8k") and not rule_needs_ground_truth("format")


def test_a_missing_model_folder_is_named_by_its_key(tmp_path, capsys):
    code, err, _ = _run(tmp_path, capsys, f"sft.model_path={tmp_path / 'nope'}")
    assert code == 1 and f"sft.model_path: model path does not exist: {tmp_path / 'nope'}" in err, err


def test_an_output_dir_that_is_a_file_is_a_config_error_through_the_api(tmp_path):
    from verl_core import SFTConfig
    from verl_core.config import ConfigError

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir: .*f is a file, not a folder"):
        SFTConfig(output_dir=str(tmp_path / "f"))


def test_real_gsm8k_with_its_columns_passes_the_checks(tmp_path, shared_data):
    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.pipeline.data_checks import check_data

    gsm8k = shared_data / "gsm8k-test.jsonl"
    cfg = load_pipeline_config(
        None,
        [
            f"sft.data.path={gsm8k}",
            "sft.data.columns={prompt: question, completion: answer}",
            "sft.data.limit=50",
            f"evaluation.data.path={gsm8k}",
            "evaluation.data.columns={prompt: question, ground_truth: answer}",
            "evaluation.reward=gsm8k",
        ],
    )
    check_data(cfg)


def test_a_missing_pairs_file_fails_before_sft_trains(tmp_path, capsys):
    code, err, took = _run(tmp_path, capsys, "preference_data.path=/nonexistent/pairs.jsonl")
    assert code == 1 and "preference_data.path: data path does not exist: /nonexistent/pairs.jsonl" in err, err


def test_a_row_error_found_while_a_stage_trains_names_the_file_and_line_as_the_api_does(tmp_path):
    from verl_core.data.errors import DataError
    from verl_core.pipeline import run_stage
    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.pipeline.registry import base_model_record

    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(20)])
    with sft.open("a") as f:
        f.write(json.dumps({"prompt": "2+2=", "completion": ""}) + "\n")  # present (preflight passes), but empty
    cfg = load_pipeline_config(None, [f"workdir={tmp_path / 'w'}", f"sft.data.path={sft}", "sft.progress=false"])
    with pytest.raises(DataError) as err:
        run_stage(cfg, "sft", {"base": base_model_record(cfg)})
    assert str(err.value) == f"{sft} row 20 (line 21): field 'completion' is empty"


def _half_created_store(db) -> None:
    """The store a run killed inside MLflow's schema migrations leaves: the tables of migration
    27a6a02d2cf1 created, its version stamp not yet written (seen in a kill -9 trial)."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base

    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    Base.metadata.create_all(engine)
    config = _get_alembic_config(f"sqlite:///{db}")
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "728d730b5ebd")
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text("CREATE TABLE model_version_tags (key VARCHAR(250), name VARCHAR(256))"))
    engine.dispose()


def test_a_store_left_half_created_by_a_killed_run_is_moved_aside_and_created_again(tmp_path):
    from mlflow import MlflowClient

    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.pipeline.preflight import check_tracking

    db = tmp_path / "mlflow.db"
    _half_created_store(db)
    import subprocess
    import sys

    opened = subprocess.run(  # what every later run hit (in its own process: MLflow keeps a failed store's engine)
        [sys.executable, "-c", f"from mlflow import MlflowClient; MlflowClient('sqlite:///{db}').search_experiments()"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert opened.returncode != 0 and "model_version_tags already exists" in opened.stderr
    cfg = load_pipeline_config(None, [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{db}"])
    check_tracking(cfg)
    assert [e.name for e in MlflowClient(f"sqlite:///{db}").search_experiments()].count(cfg.tracking.experiment) == 1
    assert len(list(tmp_path.glob("mlflow.db.half-created-*"))) == 1 and not list(tmp_path.glob(".tmp-*"))


def test_a_new_store_appears_complete_or_not_at_all(tmp_path):
    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.pipeline.preflight import _half_created, check_tracking

    db = tmp_path / "mlflow.db"
    cfg = load_pipeline_config(None, [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{db}"])
    check_tracking(cfg)
    assert db.is_file() and not _half_created(db) and not list(tmp_path.glob(".tmp-*"))
