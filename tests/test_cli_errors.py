"""User errors on the CLI: one message, exit 2 for configuration and 1 otherwise, traceback only
with --debug, checked before Prefect starts; and the stage task does not retry them (issue 18)."""

from __future__ import annotations

import time

import pytest

from flows.cli import main


def test_a_config_error_is_one_message_and_exit_2(capsys):
    assert main(["config", "--set", "sft.learning_rate=.inf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verl-core: ConfigError: ") and "sft.learning_rate: Input should be a finite number" in err
    assert "Traceback" not in err and "--debug" in err


def test_debug_prints_the_traceback(capsys):
    assert main(["--debug", "config", "--set", "sft.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "unknown key 'sft.nope'" in err


@pytest.mark.parametrize(
    "sets, error",
    [
        (["workdir={tmp}/afile"], "WorkdirError: workdir .*afile is a file"),
        (
            ["workdir={tmp}/w", "tracking.uri=http://127.0.0.1:9"],
            "TrackingError: MLflow tracking URI http://127.0.0.1:9 cannot be reached",
        ),
    ],
)
def test_workdir_and_tracking_fail_in_seconds_before_any_training(tmp_path, capsys, sets, error):
    import re

    (tmp_path / "afile").write_text("x")
    start = time.monotonic()
    code = main(["run", *[a for s in sets for a in ("--set", s.format(tmp=tmp_path))]])
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 1 and re.search(error, err) and "Traceback" not in err, err
    assert took < 60, took  # the 5 s connection limit plus imports on a loaded machine; training would take 117-262 s
    assert not (tmp_path / "w" / "stages").exists()


def test_user_errors_are_not_retried_other_failures_are():
    from prefect.states import Failed

    from tasks.stage_task import retryable
    from verl_core.data.errors import DataError

    assert not retryable(Failed(data=DataError("d.jsonl line 2: not valid JSON")))
    assert retryable(Failed(data=ConnectionResetError("peer went away")))


@pytest.mark.parametrize(
    "setting, key, name",
    [
        ("evaluation.reward=exact_matchh", "evaluation.reward", "exact_matchh"),
        ("policy_optimisation.grpo.reward_rules={nope: 1.0}", "policy_optimisation.grpo.reward_rules", "nope"),
        ("policy_optimisation.ppo.eval_reward=zz", "policy_optimisation.ppo.eval_reward", "zz"),
        (
            "preference_data.sample_and_score.reward.reward_rules={gsm8kk: 1}",
            "preference_data.sample_and_score.reward.reward_rules",
            "gsm8kk",
        ),
    ],
)
def test_an_unknown_reward_name_fails_when_the_config_is_read_naming_the_key(tmp_path, capsys, setting, key, name):
    """Not after every earlier stage has trained (it failed at evaluation after 326 s, retried)."""
    assert main(["run", "--set", f"workdir={tmp_path}", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert f"{key}: unknown rule reward {name!r}; registered: " in err and "exact_match" in err, err
    assert "Traceback" not in err and not (tmp_path / "stages").exists()


def test_an_unknown_reward_name_through_the_python_api_is_a_config_error():
    from verl_core import GRPOConfig
    from verl_core.config import ConfigError
    from verl_core.rewards import RewardSource

    with pytest.raises(ConfigError, match="eval_reward: unknown rule reward 'zz'"):
        GRPOConfig(eval_reward="zz")
    with pytest.raises(ConfigError, match="unknown rule reward 'nope'; registered: "):
        RewardSource(rules={"nope": 1.0})


def test_prefect_settings_defaults_are_in_place_before_prefect_is_imported():
    import os
    import subprocess
    import sys

    code = (
        "import flows.cli\nfrom prefect.settings import get_current_settings\n"
        "print(get_current_settings().server.ephemeral.startup_timeout_seconds)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "120", out.stderr[-2000:]


@pytest.mark.slow
def test_a_prefect_api_that_does_not_start_in_time_is_one_line_and_leaves_no_lock_nor_running_run(tmp_path):
    import os
    import subprocess
    import sys

    from mlflow import MlflowClient

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "flows.cli", "run", "--set", f"workdir={tmp_path / 'w'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    errors = [line for line in out.stderr.splitlines() if line.startswith("verl-core: ")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert "PrefectStartupError" in errors[0] and "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (now 1)" in errors[0]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "w" / ".lock").exists() and not (tmp_path / "w" / "stages").exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}")
    running = [
        r for e in client.search_experiments() for r in client.search_runs([e.experiment_id]) if r.info.status == "RUNNING"
    ]
    assert not running
