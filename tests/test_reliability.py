"""kill -9 trials and concurrent runs on one workdir, through the CLI in subprocesses (issue 18).

One workdir goes through three kills in a row: after SFT's first checkpoint (mid-SFT), while the
resumed run writes its next checkpoint (the model file written, the rest not), and right after the
evaluation stage registered the model (before its run was tagged or ended). A fourth run finishes.
Two runs started at once on a fresh workdir: one waits for the other, then reuses its outputs.
Both must end with the same bytes as each other (so the killed chain equals an uninterrupted run),
no MLflow run left RUNNING, no Prefect flow run left Running, and exactly one registered version.

The subprocesses share the session's Prefect test API (conftest ``prefect_harness``: no temporary server per
run, none per module); the flow runs checked are those started by this module. Tiny model,
6 SFT steps, no reward model or policy optimisation: the cost is mostly process start-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [
    "sft.max_steps=6",
    "sft.save_steps=2",
    "sft.batch_size=8",
    "sft.progress=false",
    "sft.mixed_precision=no",
    "reward_model.enabled=false",
    "policy_optimisation.algorithm=none",
    "evaluation.num_rows=8",
    "orchestration.retries=0",
]


@pytest.fixture(scope="module")
def prefect_api(prefect_harness):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _command(point: str, workdir: Path, *extra: str) -> list[str]:
    sets = [*SETTINGS, f"workdir={workdir}", f"tracking.uri=sqlite:///{workdir}/mlflow.db", *extra]
    return [sys.executable, str(ROOT / "tests" / "killpoints.py"), point, "run", *[a for s in sets for a in ("--set", s)]]


def _env(api: str) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": api, "PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def _run(api: str, point: str, workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_command(point, workdir), env=_env(api), cwd=ROOT, capture_output=True, text=True, timeout=900)


def _sft_model(workdir: Path) -> bytes:
    (model,) = workdir.glob("stages/sft-*/model/model.safetensors")
    return model.read_bytes()


def _mlflow(workdir: Path):
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    runs = c.search_runs([c.get_experiment_by_name("verl-core").experiment_id], max_results=1000)
    return c, runs


def _assert_clean_end(workdir: Path) -> None:
    c, runs = _mlflow(workdir)
    assert not [r.info.run_id for r in runs if r.info.status == "RUNNING"], "an MLflow run was left RUNNING"
    versions = c.search_model_versions("name='verl-core-policy'")
    assert len(versions) == 1, [v.version for v in versions]
    assert not list(workdir.rglob(".tmp-*")) and not list(workdir.glob("stages/*/.model-*"))
    assert not (workdir / ".lock").exists() and not list((workdir / ".locks").glob("*.lock"))


def _running_flow_runs(since: datetime) -> list:
    """The flow runs started ``since`` (not other modules' on the session's API) that are in state Running."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    running = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])),
        start_time=FlowRunFilterStartTime(after_=since),
    )
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=running)


@pytest.fixture(scope="module")
def killed_chain(prefect_api, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("killed") / "work"
    started = datetime.now(timezone.utc)
    outcomes = {point: _run(prefect_api, point, workdir) for point in ("mid-sft", "mid-checkpoint-write", "mid-registration")}
    final = _run(prefect_api, "none", workdir)
    return workdir, outcomes, final, started


def test_kill_9_trials_rerun_to_a_clean_single_registered_result(killed_chain):
    workdir, outcomes, final, started = killed_chain
    for point, proc in outcomes.items():
        assert proc.returncode == -9, (point, proc.returncode, proc.stderr[-3000:])
    assert final.returncode == 0, final.stderr[-3000:]
    _assert_clean_end(workdir)
    _, runs = _mlflow(workdir)
    killed = [r for r in runs if r.data.tags.get("verl_core.reconciled") == "killed"]
    # each killed attempt left its pipeline run (and stage runs) RUNNING; all were ended KILLED with a note
    pipeline_runs = [r for r in killed if "mlflow.parentRunId" not in r.data.tags]
    assert len(pipeline_runs) == len(outcomes) and len(killed) > len(outcomes)
    assert all(r.info.status == "KILLED" and "is gone" in r.data.tags["mlflow.note.content"] for r in killed)
    assert not _running_flow_runs(started), "a Prefect flow run of a killed attempt was left Running"


def test_two_concurrent_runs_one_waits_and_both_equal_the_killed_chain(prefect_api, tmp_path, killed_chain):
    workdir = tmp_path / "work"
    procs = [
        subprocess.Popen(
            _command("none", workdir),
            env=_env(prefect_api),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outputs]
    assert sum("is in use by" in o for o in outputs) >= 1, "neither run waited for the other"
    _assert_clean_end(workdir)
    assert _sft_model(workdir) == _sft_model(killed_chain[0]), "the killed-and-resumed run differs from an uninterrupted one"
