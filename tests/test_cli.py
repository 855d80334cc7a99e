"""The ``verl-core`` command line: parsing, config printing, and one cheap stage run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.cli import build_parser, format_table, main
from verl_core.pipeline.config import parse_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_parse_as_yaml_scalars():
    assert parse_overrides(["sft.max_steps=10", "sft.model_path=null", "reward_model.enabled=false", "name=x=y"]) == {
        "sft.max_steps": 10,
        "sft.model_path": None,
        "reward_model.enabled": False,
        "name": "x=y",
    }


def test_config_command_prints_the_resolved_config(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["config", "--set", "sft.max_steps=7", "--set", "policy_optimisation.algorithm=none"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["sft"]["max_steps"] == 7 and printed["reward_model"]["enabled"] is True


def test_bad_override_exits_with_a_message(capsys):
    assert main(["config", "--set", "sft.no_such_key=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key" in err and "no_such_key" in err


def test_stage_names_are_the_pipeline_stages():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage", "not_a_stage"])
    assert build_parser().parse_args(["stage", "reward_model"]).name == "reward_model"


def test_table_formatting_aligns_columns():
    text = format_table([{"policy": "sft", "accuracy": 0.5}, {"policy": "final", "accuracy": 0.75}])
    assert text.splitlines()[0].split() == ["policy", "accuracy"] and "0.7500" in text


@pytest.mark.slow
def test_stage_command_runs_one_stage_and_prints_where_to_look(tmp_path, capsys):
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 120}):
        code = main(
            [
                "stage",
                "preference_data",
                "--config",
                str(ROOT / "configs" / "default.yaml"),
                "--set",
                f"workdir={tmp_path}",
                "--set",
                f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                "--set",
                "preference_data.num_prompts=16",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0
    assert "preference_data" in out and "Completed" in out
    assert "MLflow" in out and "Prefect UI" in out
    assert len((next((tmp_path / "stages").glob("preference_data-*")) / "data" / "pairs.jsonl").read_text().splitlines()) == 16
