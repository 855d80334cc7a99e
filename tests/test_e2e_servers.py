"""End to end against real local servers, all on 127.0.0.1, in the order a user meets them:

1. a ``make run``-style run with no server (temporary Prefect API, MLflow in ``<workdir>/mlflow.db``);
2. ``verl-core servers`` (the real CLI) serving that same store, and a second run through them;
3. the deployment commands of ``deployments/README.md`` (the same as README.md's), literally,
   with a worker, and the deployed run Completed.

MLflow is read back through its REST API, Prefect through its REST API; every link published into
Prefect artifacts and MLflow tags must answer 200.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from flows.cli import launch, stop, wait_http

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not all((Path(sys.executable).parent / b).exists() for b in ("prefect", "mlflow", "verl-core")),
        reason="prefect/mlflow/verl-core CLIs not installed",
    ),
]
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ["evaluation", "policy_optimisation", "preference_data", "reward_model", "sft"]
TRAINING = ("sft", "reward_model", "policy_optimisation")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now, below the kernel's ephemeral range: the servers bind them
    minutes later (after run 1, whose links already name them), and a port from the ephemeral range may meanwhile
    become the local end of some outgoing connection."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) if Path("/proc/sys").is_dir() else 32768
    rng, ports = random.Random(), []
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def start_servers(workdir: Path, env: dict, log: Path, ports: tuple[int, int], tries: int = 5) -> subprocess.Popen:
    """``verl-core servers`` on ``ports``; a start that failed because a port was taken (by another process on
    the machine) is tried again after a pause. Readiness waits up to 10 min (a loaded machine starts the servers
    slowly); a failure quotes what the servers printed."""
    prefect_port, mlflow_port = ports
    cmd = [str(BIN / "verl-core"), "servers", "--workdir", str(workdir)]
    for attempt in range(tries):
        proc = launch([*cmd, "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)], env, log)
        logs = [log, workdir / "servers" / "prefect-server.log", workdir / "servers" / "mlflow-server.log"]
        try:
            wait_http(f"http://127.0.0.1:{prefect_port}/api/health", timeout=600, proc=proc, logs=logs)
            wait_http(f"http://127.0.0.1:{mlflow_port}/health", timeout=600, proc=proc, logs=logs)
            return proc
        except RuntimeError as err:  # the servers' process exited during its start
            stop(proc, grace=10)
            if attempt == tries - 1 or "address already in use" not in str(err).lower():
                raise
            time.sleep(10)
    raise AssertionError("unreachable")


def http_json(url: str, body: dict | None = None, method: str = "GET") -> dict | list:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def status_of(url: str) -> int:
    """The status a browser gets: the Prefect UI answers page routes only to HTML navigation."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "text/html"}), timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def tiny_overrides(workdir: Path, algorithm: str) -> list[str]:
    return [
        "name=e2e",
        f"workdir={workdir}",
        "sft.max_steps=10",
        "sft.batch_size=8",
        "sft.save_steps=5",
        "preference_data.num_prompts=40",
        "reward_model.max_steps=5",
        "reward_model.batch_size=8",
        "reward_model.save_steps=5",
        f"policy_optimisation.algorithm={algorithm}",
        f"policy_optimisation.{algorithm}.max_steps=3",
        f"policy_optimisation.{algorithm}.batch_size=8",
        "evaluation.num_rows=10",
        "evaluation.max_new_tokens=8",
    ]


def documented_commands(path: Path) -> list[str]:
    """The ``prefect ...`` lines of a markdown file's bash blocks (continuations joined, comments and ``&`` dropped)."""
    text = path.read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip().removesuffix("&").strip()
            if line.startswith("prefect "):
                lines.append(" ".join(line.split()))
    return lines


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Run 1 without servers, then ``verl-core servers`` on the same workdir, then run 2 through them."""
    tmp = tmp_path_factory.mktemp("e2e")
    workdir = tmp / "runs"
    prefect_port, mlflow_port = free_ports(2)
    api, mlflow_url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    base_env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    base_env.update(
        {
            "PREFECT_HOME": str(tmp / "prefect-home"),  # the temporary API of run 1 and the server share its database
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600",  # a busy machine starts it slowly
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PWD": str(ROOT),
        }
    )

    def run(env: dict, algorithm: str, log: str) -> str:
        cmd = [str(BIN / "verl-core"), "run"]
        for item in [*tiny_overrides(workdir, algorithm), f"tracking.ui_url={mlflow_url}"]:
            cmd += ["--set", item]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        (tmp / log).write_text(done.stdout + done.stderr)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return done.stdout

    first = run(base_env, "dpo", "run1.log")  # `make run`: no server anywhere
    proc = start_servers(workdir, base_env, tmp / "servers.log", (prefect_port, mlflow_port))
    server_env = {**base_env, "PREFECT_API_URL": api, "PREFECT_UI_API_URL": api, "MLFLOW_TRACKING_URI": mlflow_url}
    procs = [proc]
    try:
        second = run(server_env, "orpo", "run2.log")
        yield {
            "tmp": tmp,
            "env": server_env,
            "api": api,
            "mlflow": mlflow_url,
            "outputs": (first, second),
            "procs": procs,
            "workdir": workdir,
        }
    finally:
        for p in reversed(procs):
            stop(p, grace=10)


def mlflow_runs(base: str) -> list[dict]:
    exp = http_json(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=verl-core")["experiment"]
    body = {"experiment_ids": [exp["experiment_id"]], "max_results": 200}
    return http_json(f"{base}/api/2.0/mlflow/runs/search", body, "POST")["runs"]


def tags_of(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


@pytest.mark.exhaustive  # the champion alias: tests/test_model_registry.py; one full run here: the deployment test
def test_one_store_two_complete_runs_comparable_in_mlflow_with_models_and_a_champion(servers):
    base = servers["mlflow"]
    first_out, second_out = servers["outputs"]
    # the UI lines printed by each run work: run 1 (no server yet) prints a server command on the
    # published port over the same store; run 2 (server up) prints its address
    assert f"--backend-store-uri sqlite:///{servers['workdir'] / 'mlflow.db'}" in first_out
    assert f"MLflow UI:   {base}" in second_out

    exp = http_json(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=verl-core")["experiment"]
    assert {t["key"]: t["value"] for t in exp["tags"]}["mlflow.experimentKind"] == "custom_model_development"
    runs = mlflow_runs(base)
    parents = sorted((r for r in runs if "mlflow.parentRunId" not in tags_of(r)), key=lambda r: r["info"]["start_time"])
    assert [p["info"]["run_name"].split(" ")[0] for p in parents] == ["e2e/dpo", "e2e/orpo"]
    children = {
        p["info"]["run_id"]: {
            tags_of(r)["verl_core.stage"]: r for r in runs if tags_of(r).get("mlflow.parentRunId") == p["info"]["run_id"]
        }
        for p in parents
    }
    first, second = (children[p["info"]["run_id"]] for p in parents)
    assert sorted(first) == STAGES and sorted(second) == STAGES  # one child per stage, in both
    assert {r["info"]["status"] for r in runs if r in [*first.values(), *second.values(), *parents]} == {"FINISHED"}
    # run 2 reused SFT, pairs and reward model from the cache: finished children tagged cached, linking run 1's
    for stage in ("sft", "preference_data", "reward_model"):
        tags = tags_of(second[stage])
        assert tags["cached"] == "true" and tags["verl_core.cached_from_run_id"] == first[stage]["info"]["run_id"]
    assert "cached" not in tags_of(second["policy_optimisation"])
    # comparable: the same short set of key params and the headline metrics on both parents
    params = [{p["key"]: p["value"] for p in r["data"]["params"]} for r in parents]
    assert params[0].keys() == params[1].keys() and len(params[0]) <= 15
    assert [p["algorithm"] for p in params] == ["dpo", "orpo"]
    metrics = [{m["key"]: m["value"] for m in r["data"]["metrics"]} for r in parents]
    assert all({"accuracy/sft", "accuracy/final", "accuracy_gain"} <= m.keys() for m in metrics)
    # every trained model folder is among its run's artifacts
    for stage in TRAINING:
        listed = http_json(f"{base}/api/2.0/mlflow/artifacts/list?run_id={first[stage]['info']['run_id']}&path=model")
        assert "model/config.json" in {f["path"] for f in listed["files"]}, stage
    # the registry: a version per evaluated policy, linked to its training run; champion = the better one
    query = urllib.parse.urlencode({"filter": "name='verl-core-policy'"})
    versions = http_json(f"{base}/api/2.0/mlflow/model-versions/search?{query}")
    versions = sorted(versions["model_versions"], key=lambda v: int(v["version"]))
    trained_by = [first["policy_optimisation"]["info"]["run_id"], second["policy_optimisation"]["info"]["run_id"]]
    assert [v["run_id"] for v in versions] == trained_by
    scores = [float({t["key"]: t["value"] for t in v["tags"]}["heldout_score"]) for v in versions]
    assert scores == [round(m["accuracy/final"], 4) for m in metrics]
    champion = http_json(f"{base}/api/2.0/mlflow/registered-models/alias?name=verl-core-policy&alias=champion")
    best = 0 if scores[0] >= scores[1] else 1  # a tie keeps the first champion
    assert champion["model_version"]["version"] == versions[best]["version"]


def test_every_link_in_prefect_artifacts_and_mlflow_tags_answers(servers):
    api, base = servers["api"], servers["mlflow"]
    artifacts = http_json(f"{api}/artifacts/filter", {}, "POST")
    links = set()
    for art in artifacts:
        data = art.get("data")
        if isinstance(data, str):
            found = re.findall(r"\]\((https?://[^)\s]+)\)", data)
            links.update(found or ([data] if art["type"] == "link" else []))
    mlflow_links = {u for u in links if u.startswith(base)}
    assert len(mlflow_links) >= 10  # both runs' stages and parents
    for url in sorted(links):
        assert status_of(url) == 200, url
    for run_id in {
        u.rsplit("/runs/", 1)[1].split("?")[0] for u in mlflow_links
    }:  # the run a link names exists in the served store
        assert http_json(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]["info"]["run_id"] == run_id
    # and back: run 2's MLflow runs link to their Prefect flow run
    flow_urls = {tags_of(r).get("prefect.flow_run_url") for r in mlflow_runs(base)} - {None}
    assert flow_urls and all(status_of(u) == 200 for u in flow_urls)


def test_the_documented_deployment_commands_run_the_pipeline_on_a_worker(servers):
    docs = documented_commands(ROOT / "deployments" / "README.md")
    readme = documented_commands(ROOT / "README.md")
    setup = [c for c in docs if c.split()[1:3] in (["work-pool", "create"], ["--no-prompt", "deploy"], ["worker", "start"])]
    # the process-pool walk-through (the guide also documents the Kubernetes-GPU and Ray deployments)
    setup = [c for c in setup if "verl-core-process" in c or c.endswith("--name rlhf-default")]
    trigger = next(c for c in docs if c.startswith("prefect deployment run") and c.endswith("--watch"))
    assert readme == [*setup, trigger]  # README.md's quick deploy block = the deployment guide's commands
    env, tmp = servers["env"], servers["tmp"]

    def cli(command: str, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
        args = shlex.split(command)
        done = subprocess.run(
            [str(BIN / args[0]), *args[1:], *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
        return done

    create, deploy, worker = setup
    cli(create)
    cli(deploy)
    deployment = http_json(f"{servers['api']}/deployments/name/rlhf-pipeline/rlhf-default")
    assert deployment["work_pool_name"] == shlex.split(create)[3]
    # the form: the usual choices, overrides for the rest (host-dependent settings resolve on the worker)
    form = deployment["parameter_openapi_schema"]["properties"]
    assert list(form)[0] == "algorithm" and "overrides" in form and "config" not in form
    args = shlex.split(worker)
    servers["procs"].append(
        launch([str(BIN / args[0]), *args[1:]], {**env, "PREFECT_WORKER_QUERY_SECONDS": "2"}, tmp / "worker.log")
    )
    params = {"overrides": "; ".join(tiny_overrides(servers["workdir"], "simpo"))}
    started = time.monotonic()
    run = cli(trigger, "--params", json.dumps(params), "--watch-timeout", "400", timeout=420)
    assert "Completed" in run.stdout, run.stdout + (tmp / "worker.log").read_text()[-3000:]
    print(f"deployed run took {time.monotonic() - started:.0f}s")
    parents = [r for r in mlflow_runs(servers["mlflow"]) if r["info"]["run_name"].startswith("e2e/simpo")]
    assert len(parents) == 1 and parents[0]["info"]["status"] == "FINISHED"
