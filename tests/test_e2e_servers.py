"""End to end against real local servers, all on 127.0.0.1: a Prefect server, a process
work pool and worker, an MLflow server; deploy from deployments/prefect.yaml, trigger a
tiny run, read the runs back through MLflow's REST API, shut everything down."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.cli import launch, server_commands, stop, wait_http

pytestmark = pytest.mark.slow  # real Prefect and MLflow servers, a worker and a pipeline run

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL, DEPLOYMENT = "verl-core-process", "rlhf-pipeline/rlhf-default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_api(base: str, path: str, body: dict | None = None, method: str = "GET") -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{path}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def tiny_params(workdir: Path) -> dict:
    return {
        "config": {
            "name": "e2e",
            "workdir": str(workdir),
            "sft": {"max_steps": 10, "batch_size": 8, "save_steps": 5, "logging_steps": 5, "progress": False},
            "preference_data": {"num_prompts": 40},
            "reward_model": {"max_steps": 5, "batch_size": 8, "save_steps": 5, "logging_steps": 5, "progress": False},
            "policy_optimisation": {
                "algorithm": "dpo",
                "dpo": {"max_steps": 3, "batch_size": 8, "save_steps": 2, "progress": False},
            },
            "evaluation": {"num_rows": 10, "max_new_tokens": 8},
        }
    }


@pytest.mark.skipif(not (BIN / "prefect").exists() or not (BIN / "mlflow").exists(), reason="prefect/mlflow CLIs not installed")
def test_deployed_pipeline_runs_on_local_servers_and_logs_to_mlflow(tmp_path):
    prefect_port, mlflow_port = free_port(), free_port()
    commands = server_commands(tmp_path, prefect_port, mlflow_port)
    api = f"http://127.0.0.1:{prefect_port}/api"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_URI": mlflow_url,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PWD": str(ROOT),
    }

    def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run([str(BIN / "prefect"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        return done

    procs: list[subprocess.Popen] = []
    try:
        for name in ("prefect", "mlflow"):
            cmd, extra_env, _ = commands[name]
            procs.append(launch(cmd, {**env, **extra_env}, tmp_path / f"{name}.log"))
        for proc, name in zip(procs, ("prefect", "mlflow")):
            wait_http(commands[name][2], timeout=120, proc=proc)

        cli("work-pool", "create", POOL, "--type", "process")
        cli("--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "rlhf-default")
        procs.append(
            launch(
                [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--prefetch-seconds", "5"],
                {**env, "PREFECT_WORKER_QUERY_SECONDS": "2"},
                tmp_path / "worker.log",
            )
        )

        started = time.monotonic()
        run = cli(
            "deployment",
            "run",
            DEPLOYMENT,
            "--params",
            json.dumps(tiny_params(tmp_path / "work")),
            "--watch",
            "--watch-timeout",
            "240",
            timeout=260,
        )
        assert "Completed" in run.stdout, run.stdout + (tmp_path / "worker.log").read_text()[-3000:]
        print(f"deployed run took {time.monotonic() - started:.0f}s")

        exp = mlflow_api(mlflow_url, "experiments/get-by-name?experiment_name=verl-core")["experiment"]
        runs = mlflow_api(mlflow_url, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 50}, "POST")[
            "runs"
        ]
        tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
        parents = [t for t in tags if "mlflow.parentRunId" not in t]
        stages = sorted(t["verl_core.stage"] for t in tags if "verl_core.stage" in t)
        assert len(parents) == 1 and stages == ["evaluation", "policy_optimisation", "preference_data", "reward_model", "sft"]
        assert {r["info"]["status"] for r in runs} == {"FINISHED"}
        assert (
            mlflow_api(mlflow_url, "registered-models/get?name=verl-core-policy")["registered_model"]["name"]
            == "verl-core-policy"
        )
    finally:
        for proc in reversed(procs):
            stop(proc, grace=5)
