"""Asynchronous RL as a pipeline setting: the GRPO stage with rollout workers runs through the Prefect flow
under the torchrun launcher (workers: local processes) and the Ray launcher (workers: Ray actors, one of
them killed and restarted), MLflow holds its async/* metrics, and a rerun of the same config is cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_core.pipeline import load_pipeline_config
from verl_core.rollout.worker import FAULT_ENV

SHORT = [
    "sft.max_steps=3",
    "sft.data.limit=64",
    "policy_optimisation.algorithm=grpo",
    "policy_optimisation.grpo.max_steps=4",
    "policy_optimisation.grpo.batch_size=8",
    "policy_optimisation.grpo.mini_batch_size=8",
    "policy_optimisation.grpo.num_generations=4",
    "policy_optimisation.grpo.max_new_tokens=8",
    # every step from the worker (not sampled in-process while it starts): the metrics below are the worker's
    "policy_optimisation.grpo.async_rollout={max_staleness: 1, sample_while_starting: false}",
    "evaluation.num_rows=4",
    "evaluation.max_new_tokens=8",
    "evaluation.include_base=false",
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torchrun", pytest.param("ray", marks=pytest.mark.exhaustive)])
def test_async_grpo_runs_in_the_flow_under_a_launcher_tracked_in_mlflow_and_reruns_cached(prefect_harness, tmp_path, kind):
    from mlflow import MlflowClient

    from flows import rlhf_pipeline

    if kind == "ray":
        pytest.importorskip("ray", reason="Ray is the [ray] extra: pip install 'verl_core[ray]'")
    # under Ray the actor's first incarnation dies when it takes step 2's job: Ray reports it, the trainer restarts it
    env = f"{{{FAULT_ENV}: 'exit:2'}}" if kind == "ray" else "{}"
    launcher = f"policy_optimisation.launcher={{kind: {kind}, num_processes: 1, env: {env}}}"
    where = [f"workdir={tmp_path / 'work'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    config = load_pipeline_config(None, [*where, *SHORT, launcher])
    result = rlhf_pipeline(config)
    assert {result.states[s] for s in ("sft", "policy_optimisation", "evaluation")} == {"Completed"}
    history = json.loads(Path(result.records["policy_optimisation"].extra["history"]).read_text())
    staleness = [value for _, value in history["async/staleness"]]  # (step, value) per logged step
    assert len(staleness) == 4 and all(0 <= s <= 1 for s in staleness)
    assert max(staleness) == 1 and "mismatch/kl" in history  # overlapped; pi_theta against the behaviour policy
    ray_actors = history["async/ray_actor_workers"][-1][1]
    restarts = history["async/restarts"][-1][1]
    assert (ray_actors, restarts) == ((1.0, 1.0) if kind == "ray" else (0.0, 0.0))

    client = MlflowClient(tracking_uri=config.tracking.uri)
    exp = client.get_experiment_by_name(config.tracking.experiment)
    stage_runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{result.mlflow_run_id}'")
    runs = {r.data.tags["verl_core.stage"]: r for r in stage_runs}
    assert runs["policy_optimisation"].info.status == "FINISHED"
    logged = client.get_metric_history(runs["policy_optimisation"].info.run_id, "async/staleness")
    assert [m.step for m in logged] == [1, 2, 3, 4]

    again = rlhf_pipeline(config)
    assert {again.states[s] for s in ("sft", "policy_optimisation", "evaluation")} == {"Cached"}
